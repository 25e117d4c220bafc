"""Real torch.distributed on CPU (gloo, several processes under torchrun): every parallelism option trains
with every AC mode and matches the single-process loss curve of the same global batch."""

import json
import os
import subprocess
import sys

import pytest

from membudget.config import UserError, validate
from tests.conftest import FAST_COMPILE, ROOT, compose_cfg, read_metrics, run_train

AC_MODES = "none,full,selective,memory_budget"
SMALL = ["train.steps=3", "train.seq_len=64", "train.global_batch_size=8", "logger=none", FAST_COMPILE]


def torchrun(sweep_dir, nproc, *overrides, timeout=420):
    """`torchrun --nproc-per-node N train.py -m ...`: each rank runs the same sweep, job after job."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(ROOT / "train.py"), "-m", f"hydra.sweep.dir={sweep_dir}", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=sweep_dir.parent, capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The single-process sweep of the four AC modes: the reference curves."""
    sweep = tmp_path_factory.mktemp("single") / "sweep"
    proc = run_train(sweep, f"ac={AC_MODES}", *SMALL, multirun=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {json.loads((d / "summary.json").read_text())["ac_mode"]: d for d in sweep.iterdir() if d.is_dir()}


@pytest.mark.parametrize("nproc,parallelism", [
    pytest.param(2, ["parallelism=ddp"], id="ddp"),
    pytest.param(2, ["parallelism=fsdp"], id="fsdp"),
    pytest.param(2, ["parallelism=tp"], id="tp"),
    pytest.param(4, ["parallelism=hsdp", "parallelism.dp_shard=2"], id="hsdp"),
    pytest.param(4, ["parallelism=fsdp_tp"], id="fsdp_tp"),
])
def test_every_parallelism_matches_single_process_for_every_ac_mode(tmp_path, single, nproc, parallelism):
    sweep = tmp_path / "sweep"
    proc = torchrun(sweep, nproc, f"ac={AC_MODES}", *parallelism, *SMALL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    jobs = sorted(d for d in sweep.iterdir() if d.is_dir())
    assert len(jobs) == len(AC_MODES.split(","))
    for job in jobs:
        summary = json.loads((job / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["world_size"] == nproc
        reference = read_metrics(single[summary["ac_mode"]])
        rows = read_metrics(job)
        assert [r["step"] for r in rows] == [1, 2, 3]
        for row, ref in zip(rows, reference):
            assert row["loss"] == pytest.approx(ref["loss"], rel=1e-4), (summary["ac_mode"], parallelism)
        if "tp" in summary["config"]["parallelism"]["name"]:
            # heads, FFN width, sequence (norms) and vocabulary (loss) are split over the TP ranks; only the
            # all-gathered inputs of attention and the FFN stay whole
            whole = json.loads((single[summary["ac_mode"]] / "summary.json").read_text())["activation_bytes"]
            assert summary["activation_bytes"] < 0.75 * whole, summary["ac_mode"]
        # only rank 0 writes artefacts; the other ranks keep their own readable log
        assert (job / "train.log").exists() and (job / "train_rank1.log").exists()
        assert "step 3 | loss" in (job / "train_rank1.log").read_text()


def test_fsdp_halves_parameter_memory_and_keeps_activations_per_rank(tmp_path, single):
    sweep = tmp_path / "sweep"
    # per rank the batch is 4, so activations must equal a single process at batch 4
    proc = torchrun(sweep, 2, "ac=none,full", "parallelism=fsdp", *SMALL)
    assert proc.returncode == 0, proc.stderr[-4000:]
    half = tmp_path / "half"
    ref = run_train(half, "ac=none,full", *SMALL, "train.global_batch_size=4", multirun=True)
    assert ref.returncode == 0, ref.stderr[-3000:]
    for job in ("0", "1"):
        sharded = json.loads((sweep / job / "summary.json").read_text())
        whole = json.loads((half / job / "summary.json").read_text())
        assert sharded["param_bytes_per_rank"] == pytest.approx(whole["param_bytes_per_rank"] / 2, rel=0.01)
        assert sharded["activation_bytes"] == whole["activation_bytes"]


@pytest.mark.parametrize("overrides,world_size,key", [
    (["parallelism=hsdp"], 2, "parallelism.dp_replicate"),  # dp_shard=8 does not fit 2 ranks
    (["parallelism=fsdp", "parallelism.dp_shard=4"], 2, "parallelism"),
    (["parallelism=fsdp", "parallelism.tp=-1"], 2, "parallelism.tp"),
    (["parallelism=fsdp", "parallelism.dp_shard=0"], 2, "parallelism.dp_shard"),
    (["parallelism=tp", "parallelism.tp=8"], 8, "parallelism.tp"),  # 4 heads, 2 KV heads
    (["parallelism=tp"], 3, "parallelism.tp"),
    (["parallelism=fsdp", "train.global_batch_size=6"], 4, "train.global_batch_size"),
    (["parallelism=fsdp", "train.micro_batch_size=3"], 2, "train.micro_batch_size"),
    (["parallelism=single"], 2, "parallelism"),
])
def test_bad_parallelism_is_rejected_with_its_key(overrides, world_size, key):
    with pytest.raises(UserError) as err:
        validate(compose_cfg(*overrides), world_size)
    assert str(err.value).startswith(key + "=") and "\n" not in str(err.value)


def test_world_size_that_does_not_fit_fails_before_anything_starts(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "1"}  # nothing listens there: a rendezvous attempt would fail differently
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", "parallelism=hsdp",
                           "logger=none"], capture_output=True, text=True, timeout=120, env=env,
                          stdin=subprocess.DEVNULL)
    assert proc.returncode == 2
    assert "parallelism.dp_replicate=-1: world size 2 is not a multiple" in proc.stderr + proc.stdout
    assert not (run_dir / "metrics.jsonl").exists()
