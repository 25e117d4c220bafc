"""Faults that lose nothing: a killed run resumes to the same loss curve and metrics; a dead rank ends the
job with an error naming it, in bounded time."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, read_metrics, run_train, subprocess_env
from tests.wandb_offline import find_offline_runs, read_offline_run

RUN = ["logger=wandb", "train.steps=20", "checkpoint.every_steps=4", "train.seq_len=128"]


def _train_cmd(run_dir, *overrides):
    return [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", *overrides]


def _process(pid):
    import psutil

    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None


def test_sigkill_at_a_random_step_then_restart_gives_the_same_run(tmp_path):
    reference = tmp_path / "reference"
    proc = run_train(reference, *RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]

    run_dir = tmp_path / "killed"
    kill_after = random.Random().randint(1, 16)
    print(f"killing after step {kill_after}")
    victim = subprocess.Popen(_train_cmd(run_dir, *RUN), cwd=tmp_path, env=subprocess_env(), stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and victim.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= kill_after:
            break
        time.sleep(0.005)
    # the whole process tree at once, as SLURM or the OOM killer would: W&B's service process too, which
    # otherwise keeps the run id busy for a while
    import psutil

    tree = [victim.pid] + [p.pid for p in psutil.Process(victim.pid).children(recursive=True)]
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    victim.wait()
    psutil.wait_procs([p for p in map(_process, tree) if p is not None], timeout=30)
    assert not (run_dir / "summary.json").exists(), "the run finished before it could be killed"
    checkpointed = any((run_dir / "checkpoints").glob("step_*"))  # killed before the first save: starts afresh

    proc = run_train(run_dir, *RUN)  # the same command again: checkpoint.resume=auto picks it up
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("resumed from" in (run_dir / "train.log").read_text()) == checkpointed
    resumed, uninterrupted = read_metrics(run_dir), read_metrics(reference)
    assert [r["step"] for r in resumed] == list(range(1, 21))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in uninterrupted]  # bitwise, fp32 on CPU
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_loss"] == json.loads((reference / "summary.json").read_text())["final_loss"]
    # the W&B run continues under the same id
    # (the killed run's log may end before its run record: its id is read from its dir, offline-run-<time>-<id>)
    first, second = find_offline_runs(run_dir)
    assert read_offline_run(second)["id"] == summary["wandb"]["id"]
    assert (Path(first).parent.name.rsplit("-", 1)[1] == summary["wandb"]["id"]) == checkpointed


def test_a_killed_rank_ends_the_job_with_an_error_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           *_train_cmd(run_dir, "parallelism=fsdp", "logger=none", "train.steps=100000", "train.seq_len=64",
                       "parallelism.timeout_s=30", "checkpoint.enabled=false")[1:]]
    out = tmp_path / "torchrun.out"
    with out.open("w") as sink:  # a file, not a pipe: an unread pipe would block the ranks' logging
        job = subprocess.Popen(cmd, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    log = run_dir / "train_rank1.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "step 3 |" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.1)
    pid = int(log.read_text().split("pid ")[1].split()[0])
    killed_at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    job.wait(timeout=120)
    output = out.read_text()
    elapsed = time.monotonic() - killed_at
    assert job.returncode != 0
    assert elapsed < 30 + 30, f"took {elapsed:.0f} s to end after a rank died"
    assert "rank      : 1" in output and "Signal 9 (SIGKILL)" in output, output[-3000:]
