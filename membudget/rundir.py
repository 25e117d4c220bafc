"""A run dir belongs to one run at a time: an exclusive lock for the run's life (membudget.dirlock.DirLock on
`<run dir>/.lock`), and a fresh start that moves an earlier run's files aside instead of mixing them with its
own."""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Optional

from hydra.experimental.callback import Callback

from membudget.errors import UserError

log = logging.getLogger("membudget")

ARCHIVE = "archived"
COMPILE_CACHE = "compile_cache.bin"  # the run's compiled code (membudget.compile_cache)
# What a run writes into its dir (Hydra's own .hydra/ and the log files belong to the current invocation).
RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints", "wandb", "memory_budget_pareto", "profile",
             "memory_snapshot.pickle", COMPILE_CACHE)


def previous_run(run_dir: Path) -> Optional[str]:
    """What an earlier run left in `run_dir` ("a completed run", "an unfinished run"), or None."""
    run_dir = Path(run_dir)
    if not any((run_dir / name).exists() for name in RUN_FILES):
        return None
    try:
        status = json.loads((run_dir / "summary.json").read_text()).get("status")
    except (OSError, ValueError, AttributeError):
        status = None
    return "a completed run" if status == "completed" else f"an unfinished run (status {status or 'unknown'})"


def archive_previous_run(run_dir: Path) -> Path:
    """Move an earlier run's files into <run dir>/archived/<time>/, so the new run starts clean."""
    run_dir = Path(run_dir)
    target = run_dir / ARCHIVE / time.strftime("%Y-%m-%d_%H-%M-%S")
    n = 0
    while target.exists():
        n += 1
        target = target.with_name(f"{target.name.split('.')[0]}.{n}")
    target.mkdir(parents=True)
    for name in RUN_FILES:
        if (run_dir / name).exists():
            shutil.move(str(run_dir / name), str(target / name))
    log.warning("moved the earlier run's files in %s to %s", run_dir, target)
    return target


def start_fresh(run_dir: Path, resume_mode: str, archive_allowed: bool) -> None:
    """Before a run that starts from step 0 in `run_dir`: refuse, or archive what an earlier run left.

    An unfinished run that never saved a checkpoint (killed early, requeued) is archived without asking
    under checkpoint.resume=auto: it is what the same command restarts. A completed run, or any run under
    checkpoint.resume=never, is archived only with checkpoint.archive_old_run=true.
    """
    previous = previous_run(run_dir)
    if previous is None:
        return
    if resume_mode == "auto" and previous.startswith("an unfinished") or archive_allowed:
        archive_previous_run(run_dir)
        return
    raise UserError(f"checkpoint.resume={resume_mode!r}: {run_dir} holds {previous} and nothing to resume from; "
                    "add checkpoint.archive_old_run=true to move its files aside and start fresh, or use another "
                    "hydra.run.dir")


def creatable(path: Path) -> Optional[str]:
    """None when `path` exists as a writable dir or can be made, else why not."""
    path = Path(path).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    if existing != path:
        try:  # /proc and friends look writable to root but refuse new entries
            probe = existing / f".membudget_probe_{os.getpid()}"
            probe.mkdir()
            probe.rmdir()
        except OSError as e:
            return f"cannot create a directory in {existing} ({e.strerror})"
    return None


class RunDirCheck(Callback):
    """A Hydra callback: a run dir that cannot be made is one line (Hydra would print a traceback making it).
    In a multirun it also notes each job that ends in this process (membudget.console.SweepJobs), for the
    sweep's one summary line when jobs failed."""

    def _check(self, key: str, path) -> None:
        problem = creatable(Path(str(path)))
        if problem is not None:
            logging.getLogger("membudget").error("error: %s=%r: %s; choose a writable %s", key, str(path), problem, key)
            raise SystemExit(2)

    def on_run_start(self, config, **kwargs) -> None:
        self._check("hydra.run.dir", config.hydra.run.dir)

    def on_multirun_start(self, config, **kwargs) -> None:
        from membudget.console import SweepJobs

        SweepJobs.ended = []
        self._check("hydra.sweep.dir", config.hydra.sweep.dir)

    def on_job_end(self, config, job_return, **kwargs) -> None:
        from membudget.console import SweepJobs

        SweepJobs.ended.append(job_return)
