"""Tests against a real SLURM cluster: the local one of scripts/slurm/start.sh.

They submit real jobs with submitit (and one Hydra sweep through
hydra-submitit-launcher with conf/hydra/launcher/slurm_local.yaml) to the
partition "debug", and are skipped only when `sinfo` is not on PATH or the
SLURM controller does not answer (never under scripts/test.sh, which starts the
cluster). Start the cluster (as root) with

    bash scripts/slurm/start.sh     # and afterwards: bash scripts/slurm/stop.sh

The job functions are defined inside the tests on purpose: cloudpickle then
sends them by value. A module-level function of this test module would be
pickled by reference, and the job's python cannot import the test module.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PARTITION = "debug"
JOB_DEADLINE_S = 120  # a job of a few seconds must be done (or failed) by then


def _cluster_down_reason() -> str | None:
    """Why the tests cannot run here, or None when the controller answers."""
    if shutil.which("sinfo") is None:
        return "SLURM is not installed (`sinfo` not on PATH); start it with scripts/slurm/start.sh"
    try:
        # `scontrol ping` answers at once; `sinfo` retries for ~10 s when slurmctld is down.
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=30)
        if "is UP" not in ping.stdout:
            first = (ping.stdout or ping.stderr).strip().splitlines()
            return f"SLURM cluster is not up (`scontrol ping`: {first[0] if first else ping.returncode}); run scripts/slurm/start.sh"
        proc = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"SLURM controller does not answer ({exc}); run scripts/slurm/start.sh"
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        return f"SLURM cluster is not up (`sinfo`: {msg[-1] if msg else proc.returncode}); run scripts/slurm/start.sh"
    return None


_DOWN = _cluster_down_reason()

pytestmark = [
    pytest.mark.slurm,
    # scripts/test.sh (and so CI) starts the cluster and sets MEMBUDGET_REQUIRE_SLURM=1: there a down
    # cluster fails these tests instead of skipping them
    pytest.mark.skipif(_DOWN is not None and not os.environ.get("MEMBUDGET_REQUIRE_SLURM"), reason=_DOWN or ""),
    pytest.mark.timeout(300),  # hard backstop (pytest-timeout); the tests bound their own waits
]

submitit = pytest.importorskip("submitit")
from submitit.core.utils import UncompletedJobError  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def debug_partition_usable():
    """The controller answers: the partition must exist with a usable node (else fail, not skip)."""
    proc = subprocess.run(
        ["sinfo", "-h", "-p", PARTITION, "-o", "%T"], capture_output=True, text=True, timeout=30
    )
    states = proc.stdout.split()
    usable = {"idle", "mixed", "allocated", "completing"}
    assert proc.returncode == 0 and usable & set(states), (
        f"partition {PARTITION!r} has no usable node (sinfo states: {states or proc.stderr.strip()}); "
        "see /var/log/slurm/ and rerun scripts/slurm/start.sh"
    )


def _executor(folder: Path, **params) -> "submitit.AutoExecutor":
    ex = submitit.AutoExecutor(folder=folder / "%j", cluster="slurm")
    ex.update_parameters(
        slurm_partition=PARTITION,
        nodes=1,
        cpus_per_task=1,
        timeout_min=5,
        slurm_signal_delay_s=30,
        **params,
    )
    return ex


def _wait_done(job, deadline_s: float = JOB_DEADLINE_S) -> float:
    """Poll until submitit considers the job done; cancel and fail after deadline_s."""
    t0 = time.monotonic()
    while not job.done():
        if time.monotonic() - t0 > deadline_s:
            state = job.state
            job.cancel(check=False)
            pytest.fail(
                f"SLURM job {job.job_id} not done after {deadline_s:.0f} s (state {state}); "
                f"stderr:\n{job.stderr() or ''}"
            )
        time.sleep(1)
    return time.monotonic() - t0


def _sacct(job_id: str, want: str, deadline_s: float = 30) -> str:
    """`State|ExitCode` of the job's allocation in accounting, once its state is `want`
    (records reach slurmdbd a moment after the job ends)."""
    row = ""
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        proc = subprocess.run(
            ["sacct", "-n", "-X", "-P", "-o", "State,ExitCode", "-j", str(job_id)],
            capture_output=True, text=True, timeout=30,
        )
        row = proc.stdout.strip()
        if proc.returncode == 0 and row.startswith(want + "|"):
            return row
        time.sleep(0.5)
    pytest.fail(f"sacct: job {job_id} is {row or 'not recorded'!r}, expected {want} (is slurmdbd up?)")


def test_two_tasks_per_node_return_results_from_both_ranks(tmp_path):
    def rank_info(tag):
        import os
        import socket

        import submitit

        env = submitit.JobEnvironment()
        return {
            "tag": tag,
            "procid": int(os.environ["SLURM_PROCID"]),
            "ntasks": int(os.environ["SLURM_NTASKS"]),
            "partition": os.environ.get("SLURM_JOB_PARTITION"),
            "job_id": os.environ["SLURM_JOB_ID"],
            "global_rank": env.global_rank,
            "world_size": env.num_tasks,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }

    job = _executor(tmp_path, tasks_per_node=2).submit(rank_info, "hello")
    _wait_done(job)
    results = job.results()  # one per task

    assert len(results) == 2, results
    assert sorted(r["procid"] for r in results) == [0, 1]
    assert [r["global_rank"] for r in results] == [r["procid"] for r in results]
    for r in results:
        assert r["tag"] == "hello"
        assert r["ntasks"] == 2 and r["world_size"] == 2
        assert r["partition"] == PARTITION
        assert r["job_id"] == str(job.job_id)
    assert results[0]["host"] == results[1]["host"]  # one node
    assert results[0]["pid"] != results[1]["pid"]  # one process per task
    assert _sacct(job.job_id, "COMPLETED") == "COMPLETED|0:0"


def test_hard_crash_raises_instead_of_hanging(tmp_path):
    def crash():
        import os

        os._exit(3)  # no exception handling, no result pickle

    job = _executor(tmp_path, tasks_per_node=1).submit(crash)
    # Without accounting (sacct) submitit cannot tell a dead job from a running
    # one and would wait forever here; with slurmdbd it sees FAILED.
    _wait_done(job)

    t0 = time.monotonic()
    with pytest.raises(UncompletedJobError, match="has not produced any output"):
        job.result()
    assert time.monotonic() - t0 < JOB_DEADLINE_S
    assert job.state == "FAILED"  # what submitit read from sacct
    assert _sacct(job.job_id, "FAILED") == "FAILED|3:0"


SWEEP = [str(REPO / "train.py"), "-m", "hydra/launcher=slurm_local", "parallelism=fsdp", "logger=none",
         "train.steps=3", "train.seq_len=64", "train.global_batch_size=4",
         "compile.backend=aot_eager_decomp_partition"]


def _sweep(tmp_path, *overrides, timeout=4 * JOB_DEADLINE_S):
    sweep = tmp_path / "sweep"
    proc = subprocess.run([sys.executable, *SWEEP, f"hydra.sweep.dir={sweep}", *overrides], cwd=tmp_path,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return sweep, proc


def test_train_sweep_runs_each_job_as_two_tasks(tmp_path):
    """python train.py -m hydra/launcher=slurm_local parallelism=fsdp ac=none,memory_budget ..."""
    sweep, proc = _sweep(tmp_path, "ac=none,memory_budget")
    assert proc.returncode == 0, f"sweep failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    for job, mode in (("0", "none"), ("1", "memory_budget")):
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["ac_mode"] == mode
        assert summary["world_size"] == 2  # two SLURM tasks joined one process group
        steps = [json.loads(line)["step"] for line in (sweep / job / "metrics.jsonl").read_text().splitlines()]
        assert steps == [1, 2, 3]
        assert "step 3 | loss" in (sweep / job / "train_rank1.log").read_text()


def test_a_crashing_job_ends_the_sweep_with_an_error_naming_it(tmp_path):
    start = time.monotonic()
    # the second job diverges at once: every rank stops with LossNotFinite
    sweep, proc = _sweep(tmp_path, "optimizer.lr=3e-3,1e20", "train.max_grad_norm=1e20",
                         "lr_schedule.warmup_steps=0", "train.steps=6")
    assert proc.returncode != 0
    assert time.monotonic() - start < 3 * JOB_DEADLINE_S
    output = proc.stdout + proc.stderr
    failure = [line for line in output.splitlines() if "UserError: job 1 [" in line]
    assert failure and "optimizer.lr=1e+20" in failure[-1] and "loss=nan" in failure[-1]
    assert (sweep / "0" / "summary.json").exists()  # the good job finished and kept its results


def _squeue(fmt: str) -> list[str]:
    out = subprocess.run(["squeue", "-h", "-o", fmt], capture_output=True, text=True, timeout=30).stdout
    return out.split()


def test_time_limit_signal_checkpoints_requeues_and_resumes(tmp_path):
    """SLURM's warning signal mid-run (as before a time limit): the 2-task job saves a checkpoint, submitit
    requeues it, and the requeued job resumes and ends with the uninterrupted run's loss curve."""
    sweep = tmp_path / "sweep"
    # two identical jobs (they differ only in a W&B tag): job 0 is signalled, job 1 is the reference
    cmd = [sys.executable, *SWEEP, f"hydra.sweep.dir={sweep}", "train.steps=40", "train.seq_len=128",
           "checkpoint.every_steps=1000", "logger.tags=[signalled],[reference]"]
    with (tmp_path / "sweep.out").open("w") as out:
        launcher = subprocess.Popen(cmd, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    metrics = sweep / "0" / "metrics.jsonl"
    deadline = time.monotonic() + JOB_DEADLINE_S
    while time.monotonic() < deadline and len(metrics.read_text().splitlines() if metrics.exists() else []) < 3:
        time.sleep(0.2)
    (job_id,) = [j for j in _squeue("%i") if j.endswith("_0")]
    subprocess.run(["scancel", "--signal=USR2", job_id], check=True, timeout=30)
    # a requeued job waits for its begin time (about 2 minutes in Slurm 22.05); start it now instead
    deadline = time.monotonic() + JOB_DEADLINE_S
    while time.monotonic() < deadline and launcher.poll() is None:
        state = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True, text=True,
                               timeout=30).stdout
        if "PENDING" in state and "BeginTime" in state:
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], timeout=30)
            break
        time.sleep(0.5)
    launcher.wait(timeout=3 * JOB_DEADLINE_S)
    output = (tmp_path / "sweep.out").read_text()
    assert launcher.returncode == 0, output[-3000:]

    signalled, reference = sweep / "0", sweep / "1"
    assert "resumed from" in (signalled / "train.log").read_text()
    assert any("checkpoints/step_" in line and "resumed" in line
               for line in (signalled / "train_rank1.log").read_text().splitlines())
    rows = [json.loads(line) for line in (signalled / "metrics.jsonl").read_text().splitlines()]
    ref = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref]
    assert json.loads((signalled / "summary.json").read_text())["status"] == "completed"
