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

from membudget.metrics import write_bytes
from membudget.rundir import COMPILE_CACHE

log = logging.getLogger("membudget")


def load(run_dir: Path) -> None:
    """Before the first compile: an earlier start's artifacts into this process's caches; one that does not load
    is skipped with a warning (the run compiles)."""
    path = Path(run_dir) / COMPILE_CACHE
    if not path.is_file():
        return
    try:
        info = torch.compiler.load_cache_artifacts(path.read_bytes())
    except Exception as e:  # noqa: BLE001 - another torch's or a damaged file: compile as without it
        log.warning("%s: could not load it (%s: %s); compiling", path, type(e).__name__, e)
        return
    found = sum(len(keys) for keys in info.artifacts.values()) if info is not None else 0
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
