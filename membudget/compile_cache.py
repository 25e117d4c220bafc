"""The code a run compiled, kept in its run dir so that a later start of the run compiles from it: a requeued job
that lands on another node, whose inductor cache stayed on the first, loads it instead of generating every graph's
code again (torch.compiler's portable cache artifacts: inductor's graphs, with Triton's kernels on a GPU; a CPU's
C++ kernels are compiled again). The artifacts' keys hold what compiling depends on (torch, the device, the graph,
the functorch config with the memory budget), so a start with another setting compiles anew rather than reusing
them."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from membudget.internals import compile_artifacts
from membudget.metrics import write_bytes
from membudget.rundir import COMPILE_CACHE

log = logging.getLogger("membudget")


def load(run_dir: Path) -> None:
    """Before the first compile: this process's record of compiled code starts anew, so that the run saves its own
    code only (not every earlier job's of a multirun in one process), and an earlier start's artifacts go into this
    process's caches. A file torch cannot read is one warning (the run compiles), not torch's traceback."""
    compile_artifacts.clear()
    path = Path(run_dir) / COMPILE_CACHE
    if not path.is_file():
        return
    torch_log = logging.getLogger(compile_artifacts.__module__)  # where torch logs a file it cannot read
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)  # its warning is a traceback; ours below says what happens instead
    try:
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
    except Exception as e:  # noqa: BLE001 - an unreadable file: compile as without it
        info, why = None, f"{type(e).__name__}: {e}"
    else:
        why = "torch cannot read it: damaged"
    finally:
        torch_log.setLevel(level)
    if info is None:
        log.warning("%s: could not load it (%s); compiling", path, why)
        return
    found = sum(len(keys) for keys in info.artifacts.values())
    log.info("compiled code of this run's earlier start loaded from %s: %d artifacts", path, found)


def save(run_dir: Path) -> None:
    """After the first step compiled (rank 0): this process's artifacts, for a later start of the run; nothing
    when the backend leaves none (aot_eager), a warning when the file cannot be written."""
    path = Path(run_dir) / COMPILE_CACHE
    try:
        artifacts = torch.compiler.save_cache_artifacts()
        if artifacts and artifacts[0]:
            write_bytes(path, artifacts[0])
    except OSError as e:
        log.warning("%s: could not write it (%s); a later start compiles again", path, e.strerror or e)
    except Exception as e:  # noqa: BLE001 - torch's serialisation: the run goes on, a later start compiles
        log.warning("%s: could not save the compiled code (%s: %s); a later start compiles again", path,
                    type(e).__name__, e)
