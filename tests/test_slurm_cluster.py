"""Tests against a real SLURM cluster: the local one of scripts/slurm/start.sh.

They submit real jobs with submitit, one Hydra sweep through
hydra-submitit-launcher with conf/hydra/launcher/slurm_local.yaml, and one
batch script that runs train.py both plainly and under srun, to the partition
"debug"; they are skipped only when `sinfo` is not on PATH or the SLURM
controller does not answer (never under scripts/test.sh, which starts the
cluster). Start the cluster (as root) with

    bash scripts/slurm/start.sh     # and afterwards: bash scripts/slurm/stop.sh

The job functions are defined inside the tests on purpose: cloudpickle then
sends them by value. A module-level function of this test module would be
pickled by reference, and the job's python cannot import the test module.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import ROOT, TINY, subprocess_env

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
    pytest.mark.slow,
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
    """Poll until submitit considers the job done, asking sacct each time (submitit on its own asks at 2, 4,
    8, 16 s ... after submission); cancel and fail after deadline_s."""
    t0 = time.monotonic()
    while not job.done(force_check=True):
        if time.monotonic() - t0 > deadline_s:
            state = job.state
            job.cancel(check=False)
            pytest.fail(
                f"SLURM job {job.job_id} not done after {deadline_s:.0f} s (state {state}); "
                f"stderr:\n{job.stderr() or ''}"
            )
        time.sleep(0.5)
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
    # submitit waits 15 s for a result file that a shared filesystem may show late; here it is local
    job._results_timeout_s = 1
    # Without accounting (sacct) submitit cannot tell a dead job from a running
    # one and would wait forever here; with slurmdbd it sees FAILED.
    _wait_done(job)

    t0 = time.monotonic()
    with pytest.raises(UncompletedJobError, match="has not produced any output"):
        job.result()
    assert time.monotonic() - t0 < JOB_DEADLINE_S
    assert job.state == "FAILED"  # what submitit read from sacct
    assert _sacct(job.job_id, "FAILED") == "FAILED|3:0"


# --- a sweep of two 2-task jobs (a time-limit signal; a crash) and a batch script (plain python; srun) ----

# The sweep's jobs run one after the other on the 2-CPU node: job 0 is signalled mid-run as before a time
# limit, job 1 diverges at its second step. The batch script's srun step trains job 0's run uninterrupted:
# the reference for the resumed loss curve. The submitting shells have MASTER_ADDR/MASTER_PORT of an
# unreachable host exported (as a login shell used for torchrun has): every srun rendezvous must ignore them.
# No hydra.sweep.dir: the default multirun/${run_name:} must be resolved at submission, not in each job.
STEPS = 40
RUN = ["parallelism=fsdp", "logger=none", f"train.steps={STEPS}", "train.seq_len=64", "train.global_batch_size=4",
       "checkpoint.every_steps=1000", "train.max_grad_norm=1e20", "lr_schedule.warmup_steps=0",
       "parallelism.timeout_s=60"]
SWEEP = [str(ROOT / "train.py"), "-m", "hydra/launcher=slurm_local", *RUN, "optimizer.lr=3e-3,1e20"]
REFERENCE = [sys.executable, str(ROOT / "train.py"), *RUN, "optimizer.lr=3e-3"]  # job 0, as one srun step
LEAKED = {"MASTER_ADDR": "192.0.2.1", "MASTER_PORT": "29999"}  # TEST-NET-1: routes nowhere
RUN_NAME = r"\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d-\d+"  # one process's run name: <date>/<time>-<pid>


def _poll(what: str, found, deadline_s: float = JOB_DEADLINE_S, every_s: float = 0.2):
    t0 = time.monotonic()
    while (value := found()) is None:
        if time.monotonic() - t0 > deadline_s:
            pytest.fail(f"no {what} after {deadline_s:.0f} s")
        time.sleep(every_s)
    return value


def _one(paths: list[Path]) -> Path | None:
    return paths[0] if len(paths) == 1 else None


def _signal(job_id: str, train_log: Path) -> None:
    """SIGUSR2 to the job's tasks, as SLURM sends it before the time limit, until the run's log shows it.
    scancel delivers it at once, but when submitit requeues the job meanwhile, slurmctld answers "Job can not
    be altered now" and scancel retries until the requeued job runs (and would signal that one too): it is
    stopped once the signal is in."""
    for _ in range(3):
        scancel = subprocess.Popen(["scancel", "--signal=USR2", job_id], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        try:
            t0 = time.monotonic()
            while time.monotonic() - t0 < 10:
                if "received SIGUSR2" in train_log.read_text():
                    return
                time.sleep(0.2)
        finally:
            scancel.kill()
            scancel.wait()
    pytest.fail(f"job {job_id} never received SIGUSR2")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """Run the sweep once, signal job 0 after its first steps; the tests below read what it left."""
    root = tmp_path_factory.mktemp("sweep")
    start = time.monotonic()
    with (root / "sweep.out").open("w") as out:
        launcher = subprocess.Popen([sys.executable, *SWEEP], cwd=root, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=subprocess_env(**LEAKED))
    array_id = None
    try:
        def job0_steps():
            if launcher.poll() is not None:
                pytest.fail(f"the sweep ended before job 0 trained:\n{(root / 'sweep.out').read_text()[-3000:]}")
            metrics = _one(list(root.glob("multirun/*/*/0/metrics.jsonl")))
            return metrics if metrics and len(metrics.read_text().splitlines()) >= 2 else None

        metrics = _poll("metrics from job 0", job0_steps)
        sweep_dir = metrics.parent.parent
        # submitit's folder per task: <sweep dir>/.submitit/<array job id>_<index>
        job0 = _one(list((sweep_dir / ".submitit").glob("*_0"))).name
        array_id = job0.split("_")[0]
        _signal(job0, sweep_dir / "0" / "train.log")

        # a requeued job waits for its begin time (about 2 minutes in Slurm 22.05); start it now instead
        def requeued():
            state = subprocess.run(["squeue", "-h", "-j", job0, "-o", "%T %r"], capture_output=True, text=True,
                                   timeout=30).stdout
            return True if ("PENDING" in state and "BeginTime" in state) or launcher.poll() is not None else None

        _poll("requeue of job 0", requeued, every_s=0.5)
        subprocess.run(["scontrol", "update", f"JobId={job0}", "StartTime=now"], timeout=30)
        launcher.wait(timeout=4 * JOB_DEADLINE_S)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        if array_id:
            subprocess.run(["scancel", array_id], timeout=30)  # nothing left behind if the sweep failed
    yield SimpleNamespace(root=root, dir=sweep_dir, returncode=launcher.returncode,
                          output=(root / "sweep.out").read_text(), elapsed=time.monotonic() - start)


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_sweep_dir_is_resolved_at_submission_and_holds_every_job(sweep):
    """multirun/<date>/<time>-<pid> of the submitting process, not one dir per job (each job is an srun step,
    where ${run_name:} would name it slurm-<job>.<step>)."""
    assert [p for p in (sweep.root / "multirun").glob("*/*")] == [sweep.dir]
    assert re.fullmatch(RUN_NAME, str(sweep.dir.relative_to(sweep.root / "multirun")))
    assert {"0", "1"} <= {p.name for p in sweep.dir.iterdir()}
    assert not (sweep.root / "outputs").exists()


def test_time_limit_signal_checkpoints_requeues_and_resumes(sweep, batch_job):
    """SLURM's warning signal mid-run (as before a time limit): the 2-task job saves a checkpoint, submitit
    requeues it, and the requeued job resumes and ends with the uninterrupted run's loss curve."""
    signalled = sweep.dir / "0"
    summary = json.loads((signalled / "summary.json").read_text())
    assert summary["status"] == "completed"
    assert summary["world_size"] == 2  # two SLURM tasks joined one process group on the step's first node
    assert "resumed from" in (signalled / "train.log").read_text()
    assert any("checkpoints/step_" in line and "resumed" in line
               for line in (signalled / "train_rank1.log").read_text().splitlines())
    rows, ref = _rows(signalled), _rows(batch_job.root / "outputs" / f"slurm-{batch_job.job_id}.0")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in rows] == [r["loss"] for r in ref]


def test_a_crashing_job_ends_the_sweep_with_an_error_naming_it(sweep):
    """Job 1 diverges: every rank stops (LossNotFinite), and the sweep ends with an error naming the job."""
    assert sweep.returncode != 0
    assert sweep.elapsed < 4 * JOB_DEADLINE_S
    # one line: the job's error, back in the submitting process (membudget.console.sweep_failure_line)
    failure = [line for line in sweep.output.splitlines() if "error: a job of the sweep failed: job 1 [" in line]
    assert failure and "optimizer.lr=1e+20" in failure[-1] and "training diverged" in failure[-1], sweep.output[-3000:]
    assert json.loads((sweep.dir / "1" / "summary.json").read_text())["status"] == "failed"


# --- one batch script of a 2-task job: plain python, and an srun step ------------------------------------------

PLAIN = [sys.executable, str(ROOT / "train.py"), *TINY, "train.steps=2", "parallelism.timeout_s=30"]


@pytest.fixture(scope="module")
def batch_job(tmp_path_factory):
    """`sbatch -n 2` of a script that runs `python train.py` plainly (in the background; the batch script has
    SLURM_NTASKS=2 and SLURM_PROCID=0, but is not an srun step) and `srun -n 2 python train.py` with the
    rendezvous of an unreachable host exported (the sweep's job 0 uninterrupted), and asks for the run name
    twice."""
    root = tmp_path_factory.mktemp("batch")
    name = f"{sys.executable} -c 'from membudget.launch import run_name; print(run_name())'"
    srun = " ".join(REFERENCE)
    (root / "job.sh").write_text(f"""#!/bin/bash
{name} > name_a & {name} > name_b & wait
{' '.join(PLAIN)} > plain.log 2>&1 &
plain=$!
MASTER_ADDR={LEAKED['MASTER_ADDR']} MASTER_PORT={LEAKED['MASTER_PORT']} srun -n 2 {srun} > srun.log 2>&1
echo $? > srun.rc
wait $plain
echo $? > plain.rc
""")
    job_id = subprocess.run(["sbatch", "--parsable", "-n", "2", "-p", PARTITION, "--time=3", "-o", "batch.out",
                             "job.sh"], cwd=root, capture_output=True, text=True, check=True, timeout=30,
                            env=subprocess_env()).stdout.strip()
    try:
        def ended():
            if (root / "plain.rc").exists():
                return True
            queued = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, timeout=30)
            return True if queued.returncode == 0 and not queued.stdout.strip() else None

        _poll(f"end of batch job {job_id}", ended)
    finally:
        subprocess.run(["scancel", job_id], timeout=30)
    yield SimpleNamespace(root=root, job_id=job_id)


def _log(batch, name: str) -> str:
    path = batch.root / name
    if path.exists():
        return path.read_text()
    return f"({name} missing; batch.out: {(batch.root / 'batch.out').read_text()})"


def _run_dirs(batch) -> list[str]:
    outputs = batch.root / "outputs"
    return sorted(str(p.parent.relative_to(outputs)) for p in outputs.rglob(".hydra"))


def test_plain_python_in_a_batch_script_trains_alone_and_says_to_use_srun(batch_job):
    """Before, it took SLURM_NTASKS=2 for its world size and waited for a rank 1 that never came."""
    plain = _log(batch_job, "plain.log")
    assert _log(batch_job, "plain.rc").strip() == "0", plain[-3000:]
    (hint,) = [line for line in plain.splitlines() if "not an srun step" in line]
    assert f"SLURM job {batch_job.job_id} with 2 tasks" in hint and "srun python train.py" in hint
    (run,) = [d for d in _run_dirs(batch_job) if not d.startswith("slurm-")]
    assert re.fullmatch(RUN_NAME, run)
    summary = json.loads((batch_job.root / "outputs" / run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 1


def test_two_plain_runs_in_one_batch_script_get_two_run_names(batch_job):
    """Before, both took the batch shell's start time: the second run resumed the first."""
    names = [_log(batch_job, f"name_{x}").strip() for x in "ab"]
    assert names[0] != names[1] and all(re.fullmatch(RUN_NAME, n) for n in names)


def test_srun_step_trains_two_ranks_in_one_run_dir(batch_job):
    """Both tasks of `srun -n 2 python train.py` in outputs/slurm-<job>.<step>, with the rendezvous on the step's
    first node whatever MASTER_ADDR/MASTER_PORT the shell exported."""
    assert _log(batch_job, "srun.rc").strip() == "0", _log(batch_job, "srun.log")[-3000:]
    run = f"slurm-{batch_job.job_id}.0"
    assert run in _run_dirs(batch_job) and len(_run_dirs(batch_job)) == 2  # and the plain run's: no third
    summary = json.loads((batch_job.root / "outputs" / run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert [r["step"] for r in _rows(batch_job.root / "outputs" / run)] == list(range(1, STEPS + 1))
    assert f"step {STEPS} | loss" in (batch_job.root / "outputs" / run / "train_rank1.log").read_text()
