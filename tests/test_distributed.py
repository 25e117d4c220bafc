"""Real torch.distributed on CPU (gloo, several processes under torchrun): every parallelism option trains with
every AC mode and matches the single-process loss curve of the same global batch; FSDP halves what each rank
holds; only rank 0 writes artefacts and speaks on the console."""

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from membudget.errors import Stopped, UserError
from tests.conftest import (FAST_COMPILE, compose_cfg, membudget_log, read_metrics, read_summary, run_ranks,
                            train_here, train_py_ranks, wait_until)

pytestmark = [pytest.mark.slow, pytest.mark.dist]

POINTS = "none,full,selective,budget_0.5"
SMALL = ["train.steps=3", "train.seq_len=32", "train.global_batch_size=4", "logger=none", FAST_COMPILE,
         "data.prefetch=0", "checkpoint.enabled=false"]


def torchrun(sweep_dir, nproc, *overrides):
    """`torchrun --nproc-per-node N train.py -m ...`: each rank runs the same sweep, job after job."""
    return train_py_ranks(nproc, sweep_dir.parent, "-m", f"hydra.sweep.dir={sweep_dir}", *overrides)


class _Reference(dict):
    """One process, the same global batch: the reference run of an (AC point, tied, global batch) triple, trained
    when first asked for."""

    def __init__(self, base):
        super().__init__()
        self.base = base

    def __missing__(self, key):
        point, tie, batch = key
        run_dir = self.base / f"{point}-{tie}-{batch}"
        train_here(run_dir, *sized(batch), f"+ac_point={point}", f"model.tie_embeddings={tie}",
                   "train.micro_batch_size=1")
        self[key] = run_dir
        return run_dir


def sized(global_batch: int) -> list[str]:
    """This module's runs: SMALL with two blocks (a block boundary and the model's ends are all there is to shard,
    split and checkpoint) and the given global batch (sequences per step)."""
    return [f"train.global_batch_size={global_batch}" if o.startswith("train.global_batch_size=") else o
            for o in SMALL] + ["model.n_layers=2"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _Reference(tmp_path_factory.mktemp("single"))


def _point(summary: dict) -> str:
    return {"none": "none", "full": "full", "selective": "selective"}.get(summary["ac_mode"], "budget_0.5")


def _check_sweep(sweep, single, nproc: int, jobs: int, tie: str, batch: int = 4):
    dirs = sorted(d for d in sweep.iterdir() if d.is_dir() and d.name.isdigit())
    assert len(dirs) == jobs
    for job in dirs:
        summary = read_summary(job)
        assert summary["status"] == "completed" and summary["world_size"] == nproc
        reference = read_metrics(single[_point(summary), tie, batch])
        rows = read_metrics(job)
        assert [r["step"] for r in rows] == [1, 2, 3]
        for row, ref in zip(rows, reference):
            assert row["loss"] == pytest.approx(ref["loss"], rel=1e-4), (summary["ac_mode"], job)
        # only rank 0 writes artefacts; the other ranks keep their own readable log
        assert (job / "train.log").exists() and (job / "train_rank1.log").exists()
        assert "step 3 | loss" in (job / "train_rank1.log").read_text()
        assert not (job / "metrics_rank1.jsonl").exists()
    return dirs


def test_two_ranks_ddp_fsdp_tp_match_one_process(tmp_path, single):
    sweep = tmp_path / "sweep"
    proc = torchrun(sweep, 2, "parallelism=ddp,fsdp,tp", f"+ac_point={POINTS}", "train.micro_batch_size=1", *sized(4))
    assert proc.returncode == 0, proc.why()
    dirs = _check_sweep(sweep, single, 2, 12, "false")
    # rank 0 alone speaks on the console: each step line once per job, not once per rank
    assert proc.console.count("step 3 | loss") == len(dirs)
    whole = {p: read_summary(single[p, "false", 4]) for p in POINTS.split(",")}
    for job in dirs:
        summary = read_summary(job)
        name, point = summary["config"]["parallelism"]["name"], _point(summary)
        if name == "fsdp":  # parameters (and so gradients and states) are halved on each rank
            assert summary["param_bytes_per_rank"] == pytest.approx(whole[point]["param_bytes_per_rank"] / 2,
                                                                    rel=0.01)
        if name == "tp":
            # heads, FFN width, sequence (norms) and vocabulary (loss) are split over the TP ranks; only the
            # all-gathered inputs of attention and the FFN stay whole
            assert summary["activation_bytes"] < 0.75 * whole[point]["activation_bytes"], point


def test_four_ranks_hsdp_and_fsdp_tp_with_tied_embeddings_match_one_process(tmp_path, single):
    sweep = tmp_path / "sweep"
    # gradient accumulation too, two micro-batches per rank under HSDP (four data-parallel ranks), four under
    # fsdp_tp (two): HSDP all-reduces across replicas only on the last one. No group resharded after forward
    # (the two-rank test runs FSDP's default): the same losses
    proc = torchrun(sweep, 4, "parallelism=hsdp,fsdp_tp", "parallelism.dp_shard=2", "+ac_point=budget_0.5",
                    "parallelism.reshard_after_forward=never", "model.tie_embeddings=true",
                    "train.micro_batch_size=1", *sized(8))
    assert proc.returncode == 0, proc.why()
    _check_sweep(sweep, single, 4, 2, "true", batch=8)


def hang_in_a_collective() -> None:
    """A rank of a launch that never ends: rank 1 never joins rank 0's barrier."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        time.sleep(3600)
    dist.barrier()


def test_a_hung_rank_fails_its_launch_with_its_stacks(tmp_path):
    """The ranks' launcher of these tests (tests/conftest.py run_ranks): a rank still running at its timeout
    prints where each of its threads is and ends, so its launch fails with that in its log, not at pytest's
    timeout with the whole worker."""
    start = time.monotonic()
    ranks = run_ranks(2, hang_in_a_collective, cwd=tmp_path, timeout_s=5)
    assert ranks.returncode == 1 and time.monotonic() - start < 120, ranks.why()
    assert "Timeout (0:00:05)!" in ranks.log and "in hang_in_a_collective" in ranks.log, ranks.why()


class _Said(logging.Handler):
    """The membudget logger's lines, INFO and above, while attached."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def plan_then_train(base: str, *overrides: str) -> list[str]:
    """Three jobs of one launch, as a multirun under torchrun runs them: FSDP after the planner's fake process
    group, TP set to ac.memory_budget=auto, planned after the first job joined the real group, and an auto job that
    nothing fits. What this rank said of the auto choice, and the line the last job stopped with."""
    from membudget.plan import Planner
    from membudget.trainer import train

    fsdp = compose_cfg(*sized(4), *overrides, "parallelism=fsdp")
    with Planner(fsdp, world_size=2) as planner:
        planner.plan(planner.point("none"), "none")
    train(fsdp, Path(base) / "fsdp")
    with membudget_log(_Said()) as said:
        # two budgets to choose among: the point is where auto plans, not what it chooses (the sweep: test_plan_cli)
        train(compose_cfg(*sized(4), *overrides, "parallelism=tp", "ac=memory_budget", "ac.memory_budget=auto",
                          "plan.budgets=[0.5,1.0]"), Path(base) / "tp")
    # and one that nothing fits: rank 0's line on every rank
    refused = None
    try:
        train(compose_cfg(*sized(4), *overrides, "parallelism=tp", "ac=memory_budget", "ac.memory_budget=auto",
                          "plan.budgets=[0.0]", "ac.target_memory_gib=0.0001"), Path(base) / "none_fits")
    except UserError as e:
        refused = str(e)
    # and one whose planning SIGTERM ends, as torchrun's and SLURM's reach rank 0 and its planner process
    stopped = None
    try:
        with membudget_log(_TerminatePlanning()):
            train(compose_cfg(*sized(4), *overrides, "parallelism=tp", "ac=memory_budget", "ac.memory_budget=auto",
                              "plan.budgets=[0.5]"), Path(base) / "stopped")
    except Stopped as e:
        stopped = f"{e.status}: {e}"
    return [line for line in said.lines if "ac.memory_budget=auto -> " in line] + [refused, stopped]


class _TerminatePlanning(logging.Handler):
    """On rank 0, when auto starts to plan: SIGTERM to this process and to the planner's, once it runs."""

    def emit(self, record: logging.LogRecord) -> None:
        import psutil
        import torch.distributed as dist

        if not (record.getMessage().startswith("ac.memory_budget=auto: planning") and dist.get_rank() == 0):
            return

        def terminate():
            me = psutil.Process()
            wait_until(lambda: me.children(), what="rank 0's planner process")
            os.kill(me.pid, signal.SIGTERM)
            for child in me.children():
                try:  # rank 0's own handler may have ended it first: both orders are a real shutdown's
                    child.send_signal(signal.SIGTERM)
                except psutil.NoSuchProcess:
                    pass

        threading.Thread(target=terminate, daemon=True).start()


@pytest.mark.slow
@pytest.mark.dist
def test_ranks_that_planned_train_their_own_shards_and_a_later_auto_job_plans(tmp_path, single):
    """DTensor caches its sharding decisions by mesh equality, which ignores the rank: once the planner's fake
    world (every rank plans as rank 0) had filled them, rank 1 of a real mesh of that shape took rank 0's shards
    (its initial weights, its checkpoint's offsets: no checkpoint could be written, and TP's second loss read 12.56
    for 6.29). And an auto job after another job of the launch failed: the planner's fake group cannot be made
    beside the joined one. Each job now gives one process's losses and a checkpoint of its last step, and rank 0
    alone plans the auto job: rank 1 takes its answer (each had planned the same sweep)."""
    overrides = ["checkpoint.enabled=true", "checkpoint.every_steps=3", "train.micro_batch_size=1"]
    ranks = run_ranks(2, plan_then_train, str(tmp_path), *overrides, cwd=tmp_path)
    assert ranks.returncode == 0, ranks.why()
    for layout, point in (("fsdp", "none"), ("tp", "budget_0.5")):  # any budget: the losses of compiled none
        reference = [r["loss"] for r in read_metrics(single[point, "false", 4])]
        assert [r["loss"] for r in read_metrics(tmp_path / layout)] == pytest.approx(reference, rel=1e-4), layout
        assert (tmp_path / layout / "checkpoints" / "step_0000003").is_dir(), layout
    chosen = json.loads((tmp_path / "tp" / "plan.json").read_text())["memory_budget"]
    assert chosen in (0.5, 1.0) and chosen == read_summary(tmp_path / "tp")["memory_budget"]
    # one plan for the launch: rank 0's, which rank 1 took instead of planning its own
    (said, refused, stopped), (taken, refused_too, stopped_too) = ranks.returns[0], ranks.returns[1]
    assert said.startswith(f"ac.memory_budget=auto -> {chosen}: ") and taken == f"{said} (rank 0's plan)"
    # a job that nothing fits: the same one line on both ranks, and nothing written
    assert refused == refused_too and "no budget fits" in refused and "\n" not in refused
    assert not (tmp_path / "none_fits").exists()
    # SIGTERM while rank 0 planned (its planner process ended with it): every rank stops, nothing written
    assert stopped == stopped_too == ("interrupted: stopped by SIGTERM while rank 0 planned ac.memory_budget=auto, "
                                      "before anything was written"), (stopped, stopped_too)
    assert not (tmp_path / "stopped").exists() and "Traceback" not in ranks.outputs[0][1]
