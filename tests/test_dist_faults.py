"""Faults of one rank, one node or one launcher in a 2-rank gloo job launched as a user would (real torchrun,
real signals): each ends in one line that names the rank, the setting and what to rerun, never a traceback.

- two nodes launched with different overrides stop before any model is built, naming the keys and the node;
- a rank killed (SIGKILL) or stopped (SIGSTOP) past its timeout: the survivor names it, the phase, the step and
  the last complete checkpoint;
- the launcher killed: the workers stop at the next step boundary with a checkpoint;
- a hand-launched rank whose rendezvous never answers gives up after parallelism.timeout_s;
- a signal to one rank is named with the rank it reached; a job's one-line error is printed once.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from membudget.dirlock import LOCK
from tests.conftest import ROOT, TINY, read_metrics, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.dist]

SMALL = ["logger=none", "train.seq_len=32", "train.global_batch_size=2", "train.progress=lines", "data.prefetch=0",
         "train.seed=1"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _start(tmp_path: Path, run_dir: Path, *overrides: str, name: str = "torchrun.out") -> tuple[subprocess.Popen, Path]:
    """`torchrun --standalone --nproc-per-node 2 train.py ...` in a session of its own, its output in a file
    (an unread pipe would block the ranks' logging)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(ROOT / "train.py"),
           f"hydra.run.dir={run_dir}", *SMALL, *overrides]
    out = tmp_path / name
    with out.open("w") as sink:
        job = subprocess.Popen(cmd, cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=sink, stderr=subprocess.STDOUT,
                               env=subprocess_env(), start_new_session=True)
    return job, out


def _wait_for(path: Path, text: str, timeout: float = 180) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        content = path.read_text() if path.exists() else ""
        if text in content:
            return content
        time.sleep(0.05)
    raise AssertionError(f"{text!r} never appeared in {path}: {content[-2000:]}")


def _pid(log: Path) -> int:
    return int(re.search(r"pid (\d+)", _wait_for(log, " pid ")).group(1))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _kill_job(job: subprocess.Popen) -> None:
    if job.poll() is None:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=60)


def _our_traceback(output: str) -> bool:
    """A Python traceback through this project's code (torchrun's own failure report has one through torch's)."""
    return re.search(r'File "[^"]*(membudget/|train\.py)', output) is not None


def _one_error_line(output: str, run: Optional[Path] = None) -> str:
    """The output's one "error: " line; none or several fail with the output's tail (and the run's train.log): a
    rank ended by a signal or a traceback before its line is seen there."""
    errors = [line for line in output.splitlines() if "error: " in line]
    if len(errors) != 1:  # train.log is read only for the message
        log = run / "train.log" if run is not None else None
        shown = f"\n--- {log} ---\n{log.read_text()[-3000:]}" if log is not None and log.is_file() else ""
        raise AssertionError(f"{len(errors)} error lines; the output's tail:\n{output[-3000:]}{shown}")
    return errors[0]


# --- 6: two nodes, different overrides and data ---------------------------------------------------------------

def test_nodes_launched_with_different_overrides_or_data_stop_in_one_line(tmp_path):
    """Two torchrun agents as two nodes of one job (one rendezvous id), each in a directory of its own with its
    own copy of the corpus (the same relative data.path, as on two nodes' local disks), the second with other
    overrides: a value that would train silently apart (optimizer.lr), a shape that would abort deep in a
    collective (model.n_layers), and a copy of the corpus with one file edited. Both stop before a model is
    built, in one line naming each key with both values, the file, and the node. (One launch for all three: the
    check compares hashes of the whole config and data, which test_launch and test_data show change with any
    one value or file.)"""
    endpoint = f"localhost:{_free_port()}"
    procs, nodes = [], [tmp_path / f"node{n}" for n in range(2)]
    for node, cwd in enumerate(nodes):
        (cwd / "corpus").mkdir(parents=True)
        (cwd / "corpus" / "a.txt").write_text("The same first document on both nodes. " * 8)
        (cwd / "corpus" / "b.txt").write_text("A second document, edited on node 1. " * (8 + node))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "job6",
               str(ROOT / "train.py"), *TINY, "parallelism=ddp", "data=text", "data.path=corpus",
               *(["optimizer.lr=0.0005", "model.n_layers=3"] if node else [])]
        procs.append(subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env=subprocess_env(), stdin=subprocess.DEVNULL))
    outs = [p.communicate(timeout=180)[0] for p in procs]
    output = "\n".join(outs)
    assert all(p.returncode != 0 for p in procs), output[-3000:]
    line = _one_error_line(output)  # once for the job (both "nodes" share this host's console)
    for shown in ("model.n_layers=4 on rank 0, 3 on rank 1", "0.0005 on rank 1",
                  "the data differs: b.txt is 296 bytes on rank 0 and 333 on rank 1"):
        assert shown in line, line
    assert "rank 1 (node 1" in line and "same command" in line and "same copy of the data" in line, line
    assert not _our_traceback(output), output[-3000:]
    for cwd in nodes:
        run = cwd / "outputs" / "torchrun-job6"
        assert not (run / "checkpoints").exists() and not (run / "metrics.jsonl").exists()


# --- 7: a rank killed or stopped ------------------------------------------------------------------------------

def test_a_rank_killed_during_saves_is_named_in_one_line(tmp_path):
    """SIGKILL of rank 1 while the job saves a checkpoint every step: the job ends within a few
    parallelism.timeout_s (torch's own default waits 600 s, or forever), and rank 0 says, in one line, that
    rank 1 died (its process on this machine is gone), where and at which step, and which checkpoint the rerun
    resumes from; torchrun's report names the rank and the signal."""
    run = tmp_path / "run"
    job, out = _start(tmp_path, run, "parallelism=fsdp", "train.steps=100000", "checkpoint.every_steps=1",
                      "checkpoint.keep=2", "parallelism.timeout_s=30")
    try:
        pid = _pid(run / "train_rank1.log")
        _wait_for(run / "train.log", "saved checkpoint")
        _wait_for(run / "train.log", "step 3 |")
        killed_at = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        job.wait(timeout=150)
        elapsed = time.monotonic() - killed_at
    finally:
        _kill_job(job)
    output = out.read_text()
    assert job.returncode != 0
    # a bound no loaded machine reaches, where `< 60 s` could be
    assert elapsed < 4 * 30, f"took {elapsed:.0f} s to end after a rank died"
    assert "rank      : 1" in output and "Signal 9 (SIGKILL)" in output, output[-3000:]
    line = _one_error_line(output, run)
    assert re.search(r"rank 1 died \(its process on this machine is gone\) during .+ at step \d+ \("
                     r"(parallelism\.timeout_s=30|"
                     r"checkpoint\.timeout_s=\d+)\); the last complete checkpoint is step_\d+: rerun the same "
                     r"command to resume", line), line
    latest = re.search(r"last complete checkpoint is (step_\d+)", line).group(1)
    assert (run / "checkpoints" / latest / "manifest.json").is_file()
    assert not _our_traceback(output) and "Connection reset" not in output, output[-3000:]
    # torchrun's shutdown SIGTERM is not announced as a checkpointed stop that never comes
    assert "with a checkpoint" not in output, output[-3000:]
    if "ChildFailedError" in output:  # torchrun's own report may follow; ours comes first
        assert output.index(line) < output.index("ChildFailedError")


def test_a_rank_stopped_past_the_timeout_is_named_in_one_line(tmp_path):
    """SIGSTOP of rank 1 for longer than parallelism.timeout_s: rank 0 names it as suspended, the setting and the
    step."""
    run = tmp_path / "run"
    job, out = _start(tmp_path, run, "parallelism=ddp", "train.steps=100000", "checkpoint.every_steps=2",
                      "parallelism.timeout_s=8", "checkpoint.timeout_s=8")
    try:
        pid = _pid(run / "train_rank1.log")
        _wait_for(run / "train.log", "saved checkpoint")
        os.kill(pid, signal.SIGSTOP)
        content = _wait_for(out, "is suspended", timeout=150)
        os.kill(pid, signal.SIGKILL)  # rather than torchrun's 30 s wait for a stopped process
        job.wait(timeout=120)
    finally:
        _kill_job(job)
    output = out.read_text()
    assert content and job.returncode != 0
    line = _one_error_line(output, run)
    assert re.search(r"rank 1 is suspended \(its process on this machine is stopped: SIGSTOP, or a debugger\) "
                     r"during .+ at step \d+ \((parallelism|checkpoint)\.timeout_s=8\); "
                     r"the last complete checkpoint is step_\d+: rerun the same command to resume", line), line
    assert not _our_traceback(output) and "Timed out" not in output, output[-3000:]


# --- 8: the launcher killed -----------------------------------------------------------------------------------

def test_killing_the_launcher_stops_the_workers_with_a_checkpoint(tmp_path):
    """SIGKILL to torchrun's process group (the workers run in sessions of their own): both workers stop at the
    next step boundary, with a checkpoint, and release the run dir."""
    run = tmp_path / "run"
    job, out = _start(tmp_path, run, "parallelism=ddp", "train.steps=100000", "checkpoint.every_steps=1000")
    pids = [_pid(run / "train.log"), _pid(run / "train_rank1.log")]
    try:
        _wait_for(run / "train.log", "step 3 |")
        os.killpg(job.pid, signal.SIGKILL)
        job.wait(timeout=60)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and any(map(_alive, pids)):
            time.sleep(0.1)
        assert not any(map(_alive, pids)), "the workers trained on without their launcher"
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    log = (run / "train.log").read_text()
    # both got SIGTERM at once; one of them may have joined the step's sync just before its signal
    assert re.search(r"stopped by SIGTERM to (every rank|rank \d) \(the launcher, torchrun's agent pid \d+, "
                     r"exited\) after step \d+, checkpoint saved", log), log[-3000:]
    (checkpoint,) = (run / "checkpoints").glob("step_*")
    assert (checkpoint / "manifest.json").is_file()
    assert int(checkpoint.name.split("_")[1]) == read_metrics(run)[-1]["step"]
    assert not (run / LOCK).exists()  # released: the same command resumes at once


# --- 9: a hand-launched rank whose rendezvous never answers ---------------------------------------------------

def test_a_hand_launched_rank_gives_up_after_its_timeout(tmp_path):
    """RANK=1 WORLD_SIZE=2 by hand, MASTER_PORT held by a socket that listens but never answers: one line
    naming the endpoint and the setting, within the timeout (torch's store client alone waits minutes)."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        port = silent.getsockname()[1]
        # the socket never answers: the deadline (timeout_s + JOIN_SLACK_S) is waited in full, whatever the value
        cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path / 'run'}", *TINY,
               "parallelism=ddp", "parallelism.timeout_s=3"]
        env = subprocess_env(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env,
                              stdin=subprocess.DEVNULL)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    line = _one_error_line(output)
    assert f"127.0.0.1:{port}" in line and "parallelism.timeout_s=3" in line, line
    assert "Traceback" not in output  # one process, no torchrun: no traceback at all


# --- 10: a signal to one rank -----------------------------------------------------------------------------------

def test_a_signal_to_one_rank_names_the_signal_and_the_rank(tmp_path):
    """SIGTERM to rank 1 alone: both ranks stop at one step with a checkpoint, with the same exit status, and
    the line names the signal and the rank it reached."""
    run = tmp_path / "run"
    job, out = _start(tmp_path, run, "parallelism=ddp", "train.steps=100000", "checkpoint.every_steps=1000")
    try:
        pid = _pid(run / "train_rank1.log")
        _wait_for(run / "train.log", "step 2 |")
        os.kill(pid, signal.SIGTERM)
        job.wait(timeout=150)
    finally:
        _kill_job(job)
    output = out.read_text()
    assert "stopped by SIGTERM to rank 1 after step" in output, output[-3000:]
    assert "exitcode  : 130" not in output and not _our_traceback(output), output[-3000:]
    assert any(p.name.startswith("step_") for p in (run / "checkpoints").iterdir())
