"""The last reliability edges of one process (issue 25): a full disk while a step's metrics are appended, a sweep
with a failing job, a binary file read as text, paths Hydra's grammar cannot take unquoted, unknown choices, the
run dir's lock file, and a refused resume's log."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from membudget.errors import UserError
from tests.conftest import (FAST_COMPILE, ROOT, TINY, compose_cfg, read_metrics, read_summary, small_tmpfs,
                            subprocess_env, train_here)

# --- a full disk while metrics are appended ---------------------------------------------------------------------

@pytest.fixture
def tiny_disk(tmp_path):
    """A 48 KiB tmpfs (as in issue 25)."""
    with small_tmpfs(tmp_path, "48k") as mount:
        yield mount


def _fill(disk: Path, leave: int) -> None:
    """Take all of the disk's free space but `leave` bytes."""
    st = os.statvfs(disk)
    free = st.f_bavail * st.f_frsize
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * max(free - leave, 0))


FULL_DISK_RUN = (*TINY, "train.steps=60", "train.log_every=1", "checkpoint.enabled=false")


def test_a_full_disk_while_appending_metrics_loses_no_line_and_prints_no_logging_traceback(tiny_disk, capfd):
    run_dir = tiny_disk / "run"
    run_dir.mkdir()
    # train.log as Hydra's job logging writes it: a FileHandler on the root logger
    handler = logging.FileHandler(run_dir / "train.log")
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        _fill(tiny_disk, leave=3 * 4096)  # the lock, train.log and a few metrics rows
        with pytest.raises(UserError) as err:
            train_here(run_dir, *FULL_DISK_RUN)
        message = str(err.value)
        assert "\n" not in message and str(run_dir / "metrics.jsonl") in message and "No space left" in message
        # every line whole: the failed append left the file as it was before it
        text = (run_dir / "metrics.jsonl").read_text()
        assert text.endswith("\n")
        steps = [json.loads(line)["step"] for line in text.splitlines()]
        assert steps == list(range(1, len(steps) + 1)) and len(steps) < 60
        if (run_dir / "summary.json").exists():  # written (without its config) if the space allowed it
            assert read_summary(run_dir)["status"] == "failed" and "metrics.jsonl" in read_summary(run_dir)["error"]
        else:  # else the one line says so
            assert f"{run_dir / 'summary.json'} is missing" in message
        # the log file cannot take more lines: one warning, no `--- Logging error ---` traceback per record
        capfd.readouterr()
        for i in range(40):
            logging.getLogger("membudget").warning("line %d %s", i, "x" * 200)
        err_out = capfd.readouterr().err
        assert "Logging error" not in err_out and "Traceback" not in err_out
        assert err_out.count("could not write the log file") == 1 and "train.log" in err_out
    finally:
        root.removeHandler(handler)
        with contextlib.suppress(OSError):  # its buffered lines cannot be flushed either
            handler.close()
    # once there is space, the same command starts over (nothing to resume from: no checkpoint) and completes
    (tiny_disk / "filler").unlink()
    subprocess.run(["mount", "-o", "remount,size=4m", str(tiny_disk)], check=True)
    done = train_here(run_dir, *FULL_DISK_RUN, "train.steps=3")
    assert done["status"] == "completed" and [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3]


def test_an_auto_plan_that_cannot_be_written_is_one_line_and_leaves_no_half_file(tiny_disk):
    """The plan an auto run chose goes into its run dir (auto.write_plan) before training: on a full disk,
    one line naming the file and the fix, and no temporary file left."""
    from membudget.auto import write_plan
    from membudget.plan import plan_setting

    plan = plan_setting(compose_cfg(*TINY, "train.device=cpu"))
    _fill(tiny_disk, leave=0)
    with pytest.raises(UserError) as err:
        write_plan(tiny_disk, plan, {"what": "auto chose from"})
    message = str(err.value)
    assert "\n" not in message and str(tiny_disk / "plan.md") in message and "No space left" in message
    assert "free space, then rerun the same command" in message
    assert sorted(p.name for p in tiny_disk.iterdir()) == ["filler"]


def test_compiled_code_that_cannot_be_kept_is_a_warning_and_leaves_no_half_file(tiny_disk, caplog):
    """The run's compiled code (compile_cache.bin, written after the first compiled step) on a full disk: one
    warning naming the file and what it costs, no temporary file left, and the run goes on."""
    import torch._inductor.codecache  # noqa: F401 - registers inductor's kind of artifact, as its first compile does

    from membudget import compile_cache
    from membudget.internals import compile_artifacts

    compile_artifacts.clear()
    compile_artifacts.record_artifact("inductor", "a graph", b"generated code " * 4096)  # as a compile records it
    _fill(tiny_disk, leave=0)
    try:
        with caplog.at_level("WARNING", logger="membudget"):
            compile_cache.save(tiny_disk)
    finally:
        compile_artifacts.clear()
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith(f"{tiny_disk / 'compile_cache.bin'}: could not write it (No space left")
    assert warning.endswith("a later start compiles again")
    assert sorted(p.name for p in tiny_disk.iterdir()) == ["filler"]


@pytest.mark.slow
def test_a_planner_process_that_fails_is_one_line_with_its_error_above(capfd):
    """An auto job that plans in a fresh interpreter (a later job of a multirun under torchrun,
    plan.choose_setting_apart): a child that dies (here a device torch does not know) is one line naming the key,
    with the child's traceback on stderr above it."""
    from membudget.plan import choose_setting_apart

    with pytest.raises(UserError) as err:
        choose_setting_apart(compose_cfg(*TINY, "ac=memory_budget", "ac.memory_budget=auto"), 1, "tpu")
    message = str(err.value)
    assert "\n" not in message and message.startswith("ac.memory_budget=auto: the planner's process failed")
    assert "exit status 1" in message and "RuntimeError" in capfd.readouterr().err


@pytest.mark.slow
def test_a_choice_that_does_not_fit_in_the_planner_process_is_its_own_line():
    """The same child when nothing fits: its UserError comes back as the same one line that planning in this
    process gives (what would fit, the fixes), not as a failed process."""
    from membudget.plan import choose_setting, choose_setting_apart

    cfg = compose_cfg(*TINY, FAST_COMPILE, "model.n_layers=2", "ac=memory_budget", "ac.memory_budget=auto",
                      "ac.target_memory_gib=0.0001", "plan.budgets=[0.0]")
    with pytest.raises(UserError) as apart:
        choose_setting_apart(cfg, 1, "cpu")
    with pytest.raises(UserError) as here:
        choose_setting(cfg, 1, "cpu")
    assert str(apart.value) == str(here.value)
    assert "\n" not in str(apart.value) and "no budget fits" in str(apart.value)


def test_a_run_not_set_to_auto_removes_the_plan_an_earlier_auto_start_wrote(tmp_path):
    """A resume may change the AC setting: the auto plan left by the run's first start no longer says what runs
    (the report would show it beside the job), so a start that is not auto removes it."""
    from membudget.auto import write_plan
    from membudget.plan import plan_setting

    write_plan(tmp_path, plan_setting(compose_cfg(*TINY, "train.device=cpu")), {"what": "auto chose from"})
    assert (tmp_path / "plan.json").exists() and (tmp_path / "plan.md").exists()
    write_plan(tmp_path, None, None)
    assert not list(tmp_path.iterdir())


# --- a sweep with a failing job --------------------------------------------------------------------------------

@pytest.mark.slow
def test_a_failing_sweep_job_is_one_line_the_others_run_and_the_sweep_ends_with_a_summary(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), "-m", f"hydra.sweep.dir={tmp_path / 'sweep'}",
                           "optimizer.lr=nan,1e-3,2e-3", "debug=fast", "train.steps=1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env=subprocess_env(),
                          stdin=subprocess.DEVNULL)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert "Traceback" not in output and "Error executing job" not in output, output[-3000:]
    job_lines = [line for line in output.splitlines() if "error: job 0 [optimizer.lr=nan debug=fast" in line]
    assert len(job_lines) == 1 and "optimizer.lr=nan:" in job_lines[0], output[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: 1 of 3 jobs failed: job 0 [optimizer.lr=nan]")
    # the other jobs ran; the failed one's summary says why (the sweep's report lists it as failed)
    assert [read_summary(tmp_path / "sweep" / str(n))["status"] for n in range(3)] == ["failed", "completed",
                                                                                      "completed"]
    assert "optimizer.lr=nan" in read_summary(tmp_path / "sweep" / "0")["error"]
    assert not (tmp_path / "sweep" / "0" / ".lock").exists()


# --- a binary file read as text --------------------------------------------------------------------------------

def _binary(path: Path) -> Path:
    path.write_bytes(Path(sys.executable).resolve().read_bytes()[:200_000])  # an ELF executable's start
    return path


@pytest.mark.parametrize("kind", ["text", "jsonl"])
def test_a_binary_data_file_is_one_line_naming_it_before_anything_is_written(tmp_path, kind):
    data = _binary(tmp_path / f"program.{'txt' if kind == 'text' else 'jsonl'}")
    with pytest.raises(UserError) as err:
        train_here(tmp_path / "run", *TINY, f"data={kind}", f"data.path={data}")
    message = str(err.value)
    assert message.startswith(f"data.path={str(data)!r}: not a text file") and "\n" not in message
    assert not (tmp_path / "run").exists()  # refused at the first batch, before the run dir's lock


def test_data_file_text_checks(tmp_path, caplog):
    from membudget.data import Documents, check_text_file
    from membudget.schema import DataConfig

    (tmp_path / "utf16.txt").write_text("plain words " * 50, encoding="utf-16")
    (tmp_path / "random.txt").write_bytes(bytes(random_bytes(4096)))
    for name in ("utf16.txt", "random.txt"):
        with pytest.raises(UserError, match=r"^data.path=.*" + name + r"': not a text file"):
            check_text_file(str(tmp_path / name))
    # a few stray bytes (Latin-1 letters in UTF-8 text) are read, with a warning that says how many
    (tmp_path / "latin1.txt").write_bytes("café crème, naïve façade. ".encode("latin-1") + b"plain text " * 200)
    with caplog.at_level("WARNING", logger="membudget"):
        check_text_file(str(tmp_path / "latin1.txt"))
    warning = [r.getMessage() for r in caplog.records if "latin1.txt" in r.getMessage()]
    assert len(warning) == 1 and "4 of the first" in warning[0] and "%" in warning[0]
    # UTF-8 text, accents and all, passes silently
    (tmp_path / "ok.txt").write_text("données, naïve, 日本語 " * 100)
    caplog.clear()
    check_text_file(str(tmp_path / "ok.txt"))
    assert not caplog.records
    # a binary file further into a directory stops the run when it is reached, naming that file
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the first document")
    _binary(corpus / "b.txt")
    docs = Documents(DataConfig(name="text", path=str(corpus))).read()
    assert next(docs) == "the first document"
    with pytest.raises(UserError, match="b.txt'"):
        next(docs)


def random_bytes(n: int) -> bytes:
    import random

    rng = random.Random(0)
    return bytes(rng.randrange(1, 256) for _ in range(n))  # no NUL: refused for the share of non-text bytes


# --- overrides Hydra's grammar cannot read unquoted ------------------------------------------------------------

def test_unquoted_paths_with_accents_or_spaces_are_one_line_with_the_quoted_form_that_works():
    from membudget.console import override_problem
    from tests.conftest import compose_cfg

    accents = override_problem(["data=text", "data.path=/tmp/données.txt"])
    assert accents is not None and "\n" not in accents and accents.startswith("data.path='/tmp/données.txt'")
    assert """'data.path="/tmp/données.txt"'""" in accents
    split = override_problem(["-m", "data=text", "data.path=/tmp/my", "data.txt", "ac=none,full"])
    assert split is not None and "\n" not in split and "'data.txt'" in split
    assert """'data.path="/tmp/my data.txt"'""" in split
    # the suggested forms are what Hydra reads as the intended paths
    assert compose_cfg("data=text", 'data.path="/tmp/données.txt"').data.path == "/tmp/données.txt"
    assert compose_cfg("data=text", 'data.path="/tmp/my data.txt"').data.path == "/tmp/my data.txt"
    # every override Hydra reads passes untouched: sweeps, appends, deletions, Hydra's own keys and flags
    for argv in (["-m", "ac=none,full", "optimizer.lr=1e-3,2e-3"], ["+train.foo=1", "~logger"],
                 ["--cfg", "job", "hydra.run.dir=/tmp/x y"], ['data.path="/tmp/données.txt"'], []):
        assert override_problem(argv) is None, argv
    assert "is not an override" in override_problem(["nonsense"])


# --- unknown choices: one line naming the key, the value and the options --------------------------------------

@pytest.mark.parametrize("override, options", [
    ("ac.mode=bogus", ["none", "full", "selective", "memory_budget", "offload", "per_block"]),
    ("train.dtype=float16", ["auto", "float32", "bfloat16"]),
])
def test_an_unknown_choice_is_one_line_with_its_options(override, options):
    from hydra.errors import ConfigCompositionException

    from membudget.console import composition_error_line
    from tests.conftest import compose_cfg

    key, value = override.split("=")
    with pytest.raises(ConfigCompositionException) as err:
        compose_cfg(override)
    line = composition_error_line(err.value)
    assert "\n" not in line and line.startswith(f"{key}={value!r}: not one of its options; choose one of ")
    suggested = line.split("choose one of ")[1].split(", ")
    assert suggested == [f"{key}={o}" for o in options]
    for suggestion in suggested:  # each composes
        compose_cfg(suggestion)


@pytest.mark.slow
def test_train_py_reports_hydra_errors_in_one_line(tmp_path):
    def train_py(*args: str):
        return subprocess.run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={tmp_path / 'run'}", *args],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120, env=subprocess_env(),
                              stdin=subprocess.DEVNULL)

    for args, expected in [
        (["data=text", "data.path=/tmp/données.txt"], """'data.path="/tmp/données.txt"'"""),
        (["data=text", "data.path=/tmp/my", "data.txt"], """'data.path="/tmp/my data.txt"'"""),
        (["ac.mode=bogus"], "ac.mode='bogus': not one of its options; choose one of ac.mode=none"),
        (["train.dtype=float16"], "train.dtype='float16': not one of its options"),
    ]:
        proc = train_py(*args)
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, lines
        assert lines[0].startswith("error: ") and expected in lines[0], lines
    assert not (tmp_path / "run").exists()


# --- the run dir's lock file -------------------------------------------------------------------------------------

def test_the_lock_file_exists_only_while_a_run_holds_it(tmp_path):
    from membudget.dirlock import LOCK, DirLock

    run_dir = tmp_path / "run"
    holder = DirLock(run_dir)
    holder.acquire()
    with pytest.raises(UserError, match="another run is using it"):
        DirLock(run_dir).acquire()
    holder.release()
    assert not (run_dir / LOCK).exists()
    # the next run takes the lock anew, on a new file
    late = DirLock(run_dir)
    late.acquire()
    assert (run_dir / LOCK).exists()
    late.release()
    # a run that completes, and one refused after taking the lock (nothing to resume, a completed run there)
    assert train_here(run_dir, *TINY, "train.steps=1")["status"] == "completed"
    assert not (run_dir / LOCK).exists()
    with pytest.raises(UserError, match="checkpoint.resume='never'"):
        train_here(run_dir, *TINY, "train.steps=1", "checkpoint.resume=never")
    assert not (run_dir / LOCK).exists()
