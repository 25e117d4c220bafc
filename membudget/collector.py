"""When Python's cyclic garbage collector runs: rarely in this project's processes (train.py, the planner's CLI,
the test workers), and at the same step on every rank while a run trains.

Importing torch, Dynamo and inductor, planning on fake tensors and tracing with Dynamo allocate millions of
objects; with Python's default thresholds the collector walks the young generation every 700 allocations and
rescans the whole heap each time it has grown by a quarter. That took 12 % of a planning test's CPU and 14 % of a
compiled 3-step train.py's (docs/measured.md). Reference counting still frees at once whatever is not in a
cycle: a finished run's model (measured single-process, FSDP and DDP on one rank, compiled under a budget) is
freed when train() returns, before any collection.

A process group that outlives the interpreter's atexit (something in torch holds it) once made rare collection
in train.py look like the cause of an abort at exit; the abort came from gloo's worker threads asking for the
GIL during finalization, and launch._leave_process_group now waits for them to go idle."""

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
    steps; None: the process's own thresholds (collect_rarely in train.py), nothing to do. The collector is
    switched back on afterwards (the next job of a multirun, a test)."""
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
