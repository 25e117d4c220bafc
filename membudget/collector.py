"""When Python's cyclic garbage collector runs: rarely while a process imports, composes and compiles, and at
the same step on every rank while it trains.

Importing torch, composing the config, tracing with Dynamo and planning on fake tensors allocate millions of
short-lived objects that reference counting frees; with Python's default thresholds the collector walks the
young generation every 700 allocations and, in a tiny 3-step run, takes about 5 % of the process's CPU (4-job
sweeps and single runs, A B A B: docs/measured.md). Reference counting still frees at once whatever is not in
a cycle."""

from __future__ import annotations

import contextlib
import gc
from typing import Callable, Iterator, Optional

YOUNG_THRESHOLD = 50_000  # allocations between collections of the youngest generation (Python's default: 700)


def collect_rarely() -> None:
    """The collector's thresholds for the rest of this process: its youngest generation every YOUNG_THRESHOLD
    allocations, the older ones every 20 of the younger's collections. Called first by the entry points."""
    gc.set_threshold(YOUNG_THRESHOLD, 20, 20)


@contextlib.contextmanager
def scheduled_gc(every: Optional[int]) -> Iterator[Callable[[int, bool], None]]:
    """`collect(step, first)` for the end of each step: with `every`, Python's automatic cyclic collection is off
    and its young generations are collected after the first step (compilation's garbage) and every `every`
    steps; None: the automatic collector, nothing to do. The collector is switched back on afterwards (the next
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
