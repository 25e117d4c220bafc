"""When Python's cyclic garbage collector runs: rarely where a process plans (the planner's CLI, the test
workers), and at the same step on every rank while it trains.

Planning on fake tensors and tracing with Dynamo allocate millions of short-lived objects that reference
counting frees; with Python's default thresholds the collector walks the young generation every 700
allocations and took 12 % of a planning test's CPU (docs/measured.md). Reference counting still frees at once
whatever is not in a cycle.

Training processes keep Python's thresholds: with rare collection, the cycles of a finished run (its model,
mesh and process groups) would outlive it until the interpreter exits, after atexit destroyed the process group.
While train.py collected rarely, one torchrun rank of five suite runs aborted at exit (docs/measured.md). The
abort's mechanism was found later, with the collector at its defaults (gloo's worker asking for the GIL while
the interpreter finalizes; launch._leave_process_group now waits for it); rare collection in training has not
been tried again since."""

from __future__ import annotations

import contextlib
import gc
from typing import Callable, Iterator, Optional

YOUNG_THRESHOLD = 50_000  # allocations between collections of the youngest generation (Python's default: 700)


def collect_rarely() -> None:
    """The collector's thresholds for the rest of this process: its youngest generation every YOUNG_THRESHOLD
    allocations, the older ones every 20 of the younger's collections."""
    gc.set_threshold(YOUNG_THRESHOLD, 20, 20)


@contextlib.contextmanager
def scheduled_gc(every: Optional[int]) -> Iterator[Callable[[int, bool], None]]:
    """`collect(step, first)` for the end of each step: with `every`, Python's automatic cyclic collection is off
    and its young generations are collected after the first step (compilation's garbage) and every `every`
    steps; None: Python's own schedule, nothing to do. The collector is switched back on afterwards (the next
    job of a multirun, a test)."""
    if every is None:
        yield lambda step, first: None
        return
    was_enabled = gc.isenabled()
    gc.disable()

    def collect(step: int, first: bool) -> None:
        if first or step % every == 0:
            gc.collect(1)

    try:
        yield collect
    finally:
        if was_enabled:
            gc.enable()
