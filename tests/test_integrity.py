"""A run never trains the wrong thing, never poisons its own checkpoints, and never loses or mixes its files:
non-finite steps, two runs in one dir, a resume with another config, a fresh start over an old run,
SIGTERM and Ctrl-C, a full disk, and a SIGKILL at a random step."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import membudget.trainer as trainer
from membudget.errors import Stopped, UserError
from membudget.internals import tree_leaves
from membudget.rundir import ARCHIVE
from tests.conftest import (FAST_COMPILE, ROOT, TINY, membudget_log, read_metrics, read_summary, small_tmpfs,
                            subprocess_env, train_here, train_py_here)
from tests.wandb_offline import find_offline_runs, read_offline_run

RUN = (*TINY, "train.steps=6", "checkpoint.every_steps=2")


def _all_json(path: Path) -> list[dict]:
    """Every line of a metrics.jsonl, parsed strictly (json.loads accepts a bare NaN; this does not)."""
    def reject(constant):
        raise ValueError(f"{constant} is not JSON")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


# --- non-finite steps ------------------------------------------------------------------------------------------

def test_a_diverged_run_stops_before_the_optimizer_step_and_saves_nothing_bad(tmp_path):
    """lr=1e20 with no warmup: step 1 is finite and saved (a checkpoint every step), its update blows the weights
    up, step 2's gradient norm is NaN (deterministic: seeded, fp32 on CPU). The run stops there, step 2 reaches
    neither the optimizer nor a checkpoint, and step 1's checkpoint holds only finite tensors."""
    run_dir = tmp_path / "run"
    with pytest.raises(trainer.LossNotFinite) as err:
        train_here(run_dir, *RUN, "checkpoint.every_steps=1", "optimizer.lr=1e20", "lr_schedule.warmup_steps=0",
                   "train.max_grad_norm=1e20")
    message = str(err.value)
    assert message.startswith("loss=") and "grad_norm=" in message and "optimizer.lr" in message
    assert "\n" not in message and "train step 2" in message
    rows = _all_json(run_dir / "metrics.jsonl")  # valid JSON: non-finite values are null and named
    bad = [r for r in rows if r.get("nonfinite")]
    assert [r["step"] for r in rows] == [1, 2] and [r["step"] for r in bad] == [2]
    assert bad[-1]["skipped"] and set(bad[-1]["nonfinite"]) & {"loss", "grad_norm"}
    assert all(r[k] is None for r in bad for k in r["nonfinite"])
    summary = read_summary(run_dir)
    assert summary["status"] == "failed" and "LossNotFinite" in summary["error"]
    # the only checkpoint on disk is step 1's, every tensor in it finite: the bad step reached neither the
    # optimizer nor a save
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    checkpoints = sorted((run_dir / "checkpoints").glob("step_*"))
    assert [c.name for c in checkpoints] == ["step_0000001"]
    dcp_to_torch_save(checkpoints[0], tmp_path / "step_1.pt")
    state = torch.load(tmp_path / "step_1.pt", weights_only=False)
    tensors = [t for t in tree_leaves(state) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    assert len(tensors) >= 3 * len(state["model"])  # the weights and AdamW's two moments of each
    assert all(t.isfinite().all() for t in tensors)


@pytest.mark.slow
def test_skip_policy_skips_a_bad_step_and_goes_on(tmp_path, monkeypatch):
    """A fault injected into one step's gradient norm: that step is skipped (no optimizer or schedule step), the
    next ones train; the run completes and counts it."""
    real = trainer.clip_grad_norm
    calls = {"n": 0}

    def clip_with_a_fault(model, max_norm):
        calls["n"] += 1
        norm = real(model, max_norm)
        return norm * float("inf") if calls["n"] == 3 else norm

    monkeypatch.setattr(trainer, "clip_grad_norm", clip_with_a_fault)
    summary = train_here(tmp_path / "run", *RUN, "train.on_nonfinite=skip")
    rows = _all_json(tmp_path / "run" / "metrics.jsonl")
    assert summary["status"] == "completed" and summary["skipped_steps"] == 1
    assert [r["skipped"] for r in rows] == [False, False, True, False, False, False]
    assert rows[2]["grad_norm"] is None and rows[2]["nonfinite"] == ["grad_norm"]
    assert rows[3]["lr"] == rows[2]["lr"]  # the schedule did not advance on the skipped step

    calls["n"] = -100  # every step from here is bad: the bounded count stops the run
    monkeypatch.setattr(trainer, "clip_grad_norm", lambda m, n: real(m, n) * float("nan"))
    with pytest.raises(trainer.LossNotFinite, match="train.max_skipped_steps"):
        train_here(tmp_path / "bad", *RUN, "train.on_nonfinite=skip", "train.max_skipped_steps=2")
    assert len(read_metrics(tmp_path / "bad")) == 3


# --- one run per run dir ----------------------------------------------------------------------------------------

def test_a_second_run_in_a_used_dir_is_refused_naming_the_holder(tmp_path):
    run_dir = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from membudget.dirlock import DirLock; "
         "DirLock(sys.argv[1]).acquire(); print('locked', flush=True); time.sleep(60)", str(run_dir)],
        cwd=ROOT, stdout=subprocess.PIPE, text=True, env=subprocess_env(PYTHONPATH=str(ROOT)))
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(UserError) as err:
            train_here(run_dir, *RUN)
        assert str(err.value).startswith(f"hydra.run.dir='{run_dir}': another run is using it (pid {holder.pid}")
        assert not (run_dir / "metrics.jsonl").exists()
    finally:
        holder.kill()  # SIGKILL: the OS releases the lock
        holder.wait()
    assert train_here(run_dir, *RUN, "train.steps=1")["status"] == "completed"


# --- resuming with another config -------------------------------------------------------------------------------

@pytest.fixture
def checkpointed(tmp_path):
    run_dir = tmp_path / "run"
    train_here(run_dir, *RUN, "train.steps=2")
    return run_dir


def test_a_resume_that_would_change_the_model_or_data_is_refused(checkpointed):
    before = (checkpointed / "metrics.jsonl").read_text()
    for changed in (["model.n_layers=2"], ["model.dim=64"], ["train.seq_len=16"], ["train.global_batch_size=4"],
                    ["model.rope_theta=10000"], ["data=synthetic"]):
        with pytest.raises(UserError) as err:
            train_here(checkpointed, *RUN, *changed)
        message = str(err.value)
        assert message.startswith("checkpoint.resume='auto': the checkpoint at step 2") and "\n" not in message
        assert changed[0].split("=")[0].replace("data", "data.name") in message
        assert "checkpoint.archive_old_run=true" in message
    assert (checkpointed / "metrics.jsonl").read_text() == before  # nothing lost or mixed


def test_a_resume_applies_optimizer_changes_and_allows_ac_changes(checkpointed, caplog):
    with caplog.at_level("INFO", logger="membudget"):
        summary = train_here(checkpointed, *RUN, "train.steps=4", "optimizer.lr=1e-3", "lr_schedule.warmup_steps=0",
                             "ac=full", "optimizer.weight_decay=0.0")
    rows = read_metrics(checkpointed)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and summary["status"] == "completed"
    messages = [r.getMessage() for r in caplog.records]
    assert any("takes effect now: optimizer.lr: 0.003 -> 0.001" in m for m in messages)
    assert any("leaves the math alone: ac.mode: 'none' -> 'full'" in m for m in messages)
    from membudget.step import lr_lambda
    from tests.conftest import compose_cfg

    expected = 1e-3 * lr_lambda(compose_cfg(*RUN, "train.steps=4", "lr_schedule.warmup_steps=0"))(2)
    assert rows[2]["lr"] == pytest.approx(expected)  # the new peak LR and schedule, at step 3


def test_a_resume_over_changed_data_is_refused_unless_allowed(tmp_path, caplog):
    """The same data.path with a file edited since the checkpoint: the saved position would point into other
    text. Refused in one line naming the file, nothing lost; checkpoint.allow_data_change=true resumes and says
    what changed. The same for another BPE file at the same tokenizer.path: other tokens from the same text."""
    from tests.test_data import MERGES, write_bpe

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, doc in enumerate(["The first document, long enough for a few windows. " * 4, "A second one. " * 8]):
        (corpus / f"{i}.txt").write_text(doc)
    bpe = tmp_path / "tokenizer.model"
    write_bpe(bpe)
    run_dir, run = tmp_path / "run", (*RUN, "data=text", f"data.path={corpus}", "tokenizer=llama3",
                                      f"tokenizer.path={bpe}", "model.vocab_size=516")
    train_here(run_dir, *run, "train.steps=2")
    assert train_here(run_dir, *run, "train.steps=3")["status"] == "completed"  # unchanged: resumes
    before, was = (run_dir / "metrics.jsonl").read_text(), (corpus / "0.txt").stat().st_size
    (corpus / "0.txt").write_text("Edited. " * 30)
    change = f"0.txt is {was} bytes then and 240 now"
    with pytest.raises(UserError) as err:
        train_here(run_dir, *run, "train.steps=4")
    message = str(err.value)
    assert message.startswith(f"checkpoint.resume='auto': the data changed since the checkpoint at step 3 ({change})")
    assert "\n" not in message
    assert "checkpoint.allow_data_change=true" in message
    assert (run_dir / "metrics.jsonl").read_text() == before  # nothing lost or mixed
    with caplog.at_level("WARNING", logger="membudget"):
        summary = train_here(run_dir, *run, "train.steps=4", "checkpoint.allow_data_change=true")
    assert summary["status"] == "completed" and [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]
    assert any(f"resuming over changed data (checkpoint.allow_data_change=true): {change}" in r.getMessage()
               for r in caplog.records)
    write_bpe(bpe, [MERGES[1], MERGES[0], *MERGES[2:]])  # "th" and "he" swap ranks: the same size, other content
    with pytest.raises(UserError, match=r"^checkpoint.resume='auto': the data changed since the checkpoint at step 4 "
                                        r"\(the tokenizer file tokenizer.model has other content \(the same "):
        train_here(run_dir, *run, "train.steps=5")
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]


def test_steps_below_the_checkpoint_are_refused(checkpointed, caplog):
    with caplog.at_level("INFO", logger="membudget"), \
            pytest.raises(UserError, match=r"^train.steps=1: the checkpoint to resume is at step 2"):
        train_here(checkpointed, *RUN, "train.steps=1", "optimizer.lr=1e-3")
    # refused: no change is announced as taking effect (issue 25 item 5)
    assert not [r for r in caplog.records if "takes effect now" in r.getMessage()]


# --- a fresh start over an old run ------------------------------------------------------------------------------

def test_a_fresh_start_over_a_finished_run_refuses_then_archives(tmp_path):
    run_dir = tmp_path / "run"
    first = train_here(run_dir, *RUN, "train.steps=2")
    first_rows = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(UserError, match=r"^checkpoint.resume='never': .* holds a completed run"):
        train_here(run_dir, *RUN, "checkpoint.resume=never")
    assert (run_dir / "metrics.jsonl").read_text() == first_rows
    second = train_here(run_dir, *RUN, "checkpoint.resume=never", "checkpoint.archive_old_run=true", "train.steps=3")
    (archived,) = (run_dir / ARCHIVE).iterdir()
    assert (archived / "metrics.jsonl").read_text() == first_rows
    assert json.loads((archived / "summary.json").read_text())["final_loss"] == first["final_loss"]
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3] and second["status"] == "completed"
    # a later resume continues the new run only
    third = train_here(run_dir, *RUN, "train.steps=4")
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4] and third["status"] == "completed"


def test_an_unfinished_run_without_checkpoint_restarts_cleanly_under_auto(tmp_path):
    run_dir = tmp_path / "run"
    train_here(run_dir, *RUN, "train.steps=2", "checkpoint.enabled=false")
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["status"] = "preempted"  # as a requeued job that was stopped before its first checkpoint
    (run_dir / "summary.json").write_text(json.dumps(summary))
    train_here(run_dir, *RUN, "train.steps=3")
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]
    assert len(list((run_dir / ARCHIVE).iterdir())) == 1


# --- signals ----------------------------------------------------------------------------------------------------

def _start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run_dir}", *overrides]
    out = open(run_dir.parent / f"{run_dir.name}.out", "w")
    return subprocess.Popen(cmd, cwd=run_dir.parent, env=subprocess_env(), stdin=subprocess.DEVNULL, stdout=out,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _wait_while_running(proc: subprocess.Popen, holds, what: str, timeout: float) -> None:
    """Poll `holds()` while `proc` runs: a process that ended first fails at once, with its exit status."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if holds():
            return
        time.sleep(0.01)
    raise AssertionError(f"no {what} in {timeout} s (exit {proc.poll()})")


def _wait_for_rows(run_dir: Path, proc: subprocess.Popen, n: int, timeout: float = 120) -> None:
    metrics = run_dir / "metrics.jsonl"
    _wait_while_running(proc, lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= n,
                        f"{n} metrics rows", timeout)


def _wait_for_output(out: Path, proc: subprocess.Popen, text: str, timeout: float = 60) -> None:
    try:
        _wait_while_running(proc, lambda: text in out.read_text(), repr(text), timeout)
    except AssertionError as e:
        raise AssertionError(f"{e}: {out.read_text()[-2000:]}") from None


SLOW_RUN = ("logger=wandb", "train.steps=200", "train.seq_len=64", "train.global_batch_size=2",
            "checkpoint.every_steps=1000", "train.progress=lines")


@pytest.mark.slow
def test_sigterm_and_ctrl_c_end_at_a_step_with_checkpoint_and_summary(tmp_path):
    """SIGTERM (exit 143), then Ctrl-C (SIGINT, exit 130) to the run the same command resumed: each stops at a
    step with a checkpoint, an `interrupted` summary and a finished W&B run of its own; the same command then
    resumes again and completes."""
    run_dir = tmp_path / "run"
    done_steps = 0
    for launched, (signum, code) in enumerate(((signal.SIGTERM, 143), (signal.SIGINT, 130)), start=1):
        proc = _start(run_dir, *SLOW_RUN)
        _wait_for_rows(run_dir, proc, done_steps + 3)
        proc.send_signal(signum)
        assert proc.wait(timeout=60) == code, signum
        output = (tmp_path / "run.out").read_text()
        assert "Traceback" not in output and "rerun the same command to resume" in output, signum
        summary = read_summary(run_dir)
        steps = [r["step"] for r in read_metrics(run_dir)]
        assert summary["status"] == "interrupted" and steps == list(range(1, len(steps) + 1)), signum
        assert len(steps) > done_steps and (run_dir / "checkpoints" / f"step_{steps[-1]:07d}").is_dir(), signum
        wandb_runs = find_offline_runs(run_dir)
        assert len(wandb_runs) == launched and read_offline_run(wandb_runs[-1])["exit_code"] == 0, signum
        # the second launch resumed from the first's checkpoint (train.log keeps every launch's lines)
        assert (run_dir / "train.log").read_text().count("resumed from") == launched - 1, signum
        done_steps = steps[-1]
    # the signals were the point; the last resume runs the same command in this process (a failure raises)
    train_py_here(f"hydra.run.dir={run_dir}", *SLOW_RUN, f"train.steps={done_steps + 2}")
    assert read_summary(run_dir)["status"] == "completed"
    assert (run_dir / "train.log").read_text().count("resumed from") == 2
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(1, done_steps + 3))


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once(tmp_path):
    """Ctrl-C asks for a stop at the next step boundary; a second one before it stops at once: exit 130, no
    checkpoint of the step it cut short, and the summary and the console say how the run ended. The second is
    sent once the run has said it received the first (two signals sent together may reach it as one, and the
    run would stop at the boundary as after one); a step of 8 micro-batches leaves it time to land."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir, *SLOW_RUN, "logger=none", "train.seq_len=256", "train.global_batch_size=8",
                  "train.micro_batch_size=1")
    _wait_for_rows(run_dir, proc, 1)
    proc.send_signal(signal.SIGINT)
    _wait_for_output(tmp_path / "run.out", proc, "received SIGINT: stopping at the next step boundary")
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 130
    output = (tmp_path / "run.out").read_text()
    assert "Traceback" not in output and "stopped at once by a second Ctrl-C" in output, output[-3000:]
    summary = read_summary(run_dir)
    assert summary["status"] == "interrupted" and summary["error"].startswith("KeyboardInterrupt"), summary
    assert not list(run_dir.glob("checkpoints/step_*")), "the stop at once saved a checkpoint"


@pytest.mark.slow
def test_a_native_crash_prints_every_threads_python_stack(tmp_path):
    """A process that dies of a native fault says where it was: every thread's Python stack on stderr
    (faulthandler, enabled by train.py). A suite run once lost a TP rank to glibc's "malloc_consolidate():
    unaligned fastbin chunk detected" (SIGABRT) with nothing else to go on. SIGABRT from outside, as abort()
    raises it."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir, *SLOW_RUN, "logger=none")
    _wait_for_rows(run_dir, proc, 2)
    proc.send_signal(signal.SIGABRT)
    assert proc.wait(timeout=60) == -signal.SIGABRT
    output = (tmp_path / "run.out").read_text()
    assert "Fatal Python error: Aborted" in output, output[-3000:]
    # every thread's stack, whichever thread took the signal: the main thread's down to the training loop, and
    # the data prefetcher's
    assert re.search(r'File ".*membudget/trainer\.py", line \d+ in train\n', output), output[-3000:]
    assert re.search(r'File ".*membudget/data\.py", line \d+ in _fill\n', output), output[-3000:]


@pytest.mark.slow
def test_sigkill_at_a_random_step_then_restart_gives_the_same_run(tmp_path):
    steps = 40  # the kill comes within the first 10 steps: 30 more to run when it lands, so it cannot miss
    run = (f"train.steps={steps}", "checkpoint.every_steps=3", "train.seq_len=64", "train.global_batch_size=2")
    overrides = ("logger=wandb", *run)
    reference = tmp_path / "reference"  # uninterrupted, in this process: only the killed run's process is the point
    train_here(reference, "logger=none", *run)
    run_dir = tmp_path / "killed"
    kill_after = random.Random(24).randint(1, 10)  # seeded: a failure reproduces
    print(f"killing after step {kill_after}")
    victim = _start(run_dir, *overrides)
    _wait_for_rows(run_dir, victim, kill_after)
    os.killpg(victim.pid, signal.SIGKILL)  # the whole process group, W&B's service too, as SLURM would
    victim.wait()
    assert not (run_dir / "summary.json").exists(), "the run finished before it could be killed"
    checkpointed = any((run_dir / "checkpoints").glob("step_*"))
    # the same command again (checkpoint.resume=auto picks it up), through train.py's entry point in this process
    train_py_here(f"hydra.run.dir={run_dir}", *overrides)
    assert ("resumed from" in (run_dir / "train.log").read_text()) == checkpointed
    resumed, uninterrupted = read_metrics(run_dir), read_metrics(reference)
    assert [r["step"] for r in resumed] == list(range(1, steps + 1))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in uninterrupted]  # bitwise, fp32 on CPU
    runs = find_offline_runs(run_dir)
    assert read_offline_run(runs[-1])["id"] == read_summary(run_dir)["wandb"]["id"]


# --- a full disk --------------------------------------------------------------------------------------------------

@pytest.fixture
def small_disk(tmp_path):
    with small_tmpfs(tmp_path, "6m") as mount:
        yield mount


def test_a_full_disk_is_one_line_and_leaves_valid_files(small_disk):
    """Each checkpoint of the debug model is ~10 MB: the first save fills the 6 MB disk. The error names the
    path, nothing half-written stays, every JSON file is valid, and the run resumes once there is space."""
    run_dir = small_disk / "run"
    with pytest.raises(UserError) as err:
        train_here(run_dir, *RUN, "train.steps=4")
    message = str(err.value)
    assert "\n" not in message and str(run_dir / "checkpoints") in message and "No space left" in message
    _all_json(run_dir / "metrics.jsonl")
    summary = read_summary(run_dir)  # written atomically: valid, or the error would be in the log
    assert summary["status"] == "failed" and not list((run_dir / "checkpoints").glob(".tmp*"))
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    done = train_here(run_dir, *RUN, "train.steps=4", "checkpoint.archive_old_run=true")
    assert done["status"] == "completed" and [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]


class _SignalAt(logging.Handler):
    """Sends this process `signum` when the membudget logger says a line starting with `prefix`: a signal that
    arrives at a known point of the run's set-up (the trainer's handler runs it in this, the main, thread)."""

    def __init__(self, prefix: str, signum: int = signal.SIGTERM):
        super().__init__(logging.INFO)
        self.prefix, self.signum, self.sent = prefix, signum, 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith(self.prefix):
            self.sent += 1
            signal.raise_signal(self.signum)


@pytest.mark.slow
def test_a_stop_during_set_up_ends_the_run_before_its_first_step(tmp_path, monkeypatch):
    """SIGTERM while auto plans: the planning ends at once, with nothing written. SIGTERM later in the set-up of
    a fresh run: it ends before step 1, with no step trained, no checkpoint and an `interrupted` summary; the
    same command then starts it again (the unfinished run archived) and completes. SIGTERM while a later launch
    resumes: it ends before its first step, its checkpoint and rows as they were, and resumes from them."""
    from membudget.plan.planner import Planner

    plan, started = Planner.plan, []

    def plan_then_signal(self, *args, **kwargs):  # the signal arrives while the second budget is planned
        started.append(args[0].ac.memory_budget)
        if len(started) == 2:
            signal.raise_signal(signal.SIGTERM)
        return plan(self, *args, **kwargs)

    monkeypatch.setattr(Planner, "plan", plan_then_signal)
    planned = tmp_path / "planned"
    with pytest.raises(Stopped) as stopped:
        train_here(planned, *TINY, FAST_COMPILE, "ac=memory_budget", "ac.memory_budget=auto",
                   "ac.target_memory_gib=1", "plan.budgets=[0.0,0.5,1.0]")
    assert started == [0.0, 0.5] and stopped.value.status == "interrupted"  # the third never started
    assert str(stopped.value) == ("stopped by SIGTERM while planning ac.memory_budget=auto, before anything was "
                                  "written")
    assert not planned.exists()
    monkeypatch.undo()

    run_dir = tmp_path / "run"
    eager = (*TINY, "checkpoint.every_steps=1", "train.steps=2")
    with membudget_log(_SignalAt("model llama3_debug: ")) as signalled, pytest.raises(Stopped) as stopped:
        train_here(run_dir, *eager)
    assert signalled.sent == 1
    assert str(stopped.value) == ("stopped by SIGTERM before step 1, during set-up: nothing trained yet, nothing "
                                  "to save")
    summary = read_summary(run_dir)
    assert summary["status"] == "interrupted" and summary["final_loss"] is None
    assert read_metrics(run_dir) == [] and not list(run_dir.glob("checkpoints/step_*"))

    assert train_here(run_dir, *eager)["status"] == "completed"  # the same command: a fresh start
    (archived,) = (run_dir / ARCHIVE).iterdir()
    assert json.loads((archived / "summary.json").read_text())["status"] == "interrupted"
    rows = read_metrics(run_dir)
    checkpoints = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert [r["step"] for r in rows] == [1, 2] and checkpoints[-1] == "step_0000002"

    more = (*eager, "train.steps=4")
    with membudget_log(_SignalAt("resumed from")) as signalled, pytest.raises(Stopped) as stopped:
        train_here(run_dir, *more)
    assert signalled.sent == 1
    assert str(stopped.value) == ("stopped by SIGTERM before step 3, during set-up: nothing trained since the "
                                  "checkpoint of step 2, nothing to save")
    assert read_metrics(run_dir) == rows and read_summary(run_dir)["status"] == "interrupted"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == checkpoints
    assert train_here(run_dir, *more)["status"] == "completed"
    assert read_metrics(run_dir)[:2] == rows and [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]
