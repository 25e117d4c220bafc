"""The Pareto front of activation memory against step time, with ties.

Two runs tie when their activation memory and their step time are each within a relative tolerance of the
other's: a 20 KB difference at 9 MiB, or step times within the machine's noise, do not make one run better.
A run is dominated when another is no worse on both (within the tolerance) and better beyond the tolerance
on one. Of tied runs one is named, the others are listed with it: the one ahead by more, each difference
counted in units of its tolerance (at the defaults 1 % of memory weighs as much as 5 % of step time). So
the front never lists two runs that tie, and the report says why it named the one it did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from membudget.units import fmt_bytes

Row = dict[str, Any]


@dataclass(frozen=True)
class Ties:
    memory: float = 0.01  # relative: activation memory within 1 % is the same memory
    time: float = 0.05  # relative: step times within 5 % are the same speed

    def same_memory(self, a: float, b: float) -> bool:
        return abs(a - b) <= self.memory * max(abs(a), abs(b))

    def same_time(self, a: float, b: float) -> bool:
        return abs(a - b) <= self.time * max(abs(a), abs(b))

    def describe(self) -> str:
        return f"activation memory within {self.memory:.0%} and step time within {self.time:.0%}"


def _mem(r: Row) -> float:
    return r["activation_bytes"]


def _time(r: Row) -> float:
    return r["median_step_time_s"]


def tied(a: Row, b: Row, ties: Ties) -> bool:
    return ties.same_memory(_mem(a), _mem(b)) and ties.same_time(_time(a), _time(b))


def dominates(a: Row, b: Row, ties: Ties) -> bool:
    """a is no worse than b on both (within the tolerance) and better beyond it on at least one."""
    same_m, same_t = ties.same_memory(_mem(a), _mem(b)), ties.same_time(_time(a), _time(b))
    no_worse = (_mem(a) <= _mem(b) or same_m) and (_time(a) <= _time(b) or same_t)
    return no_worse and ((_mem(a) < _mem(b) and not same_m) or (_time(a) < _time(b) and not same_t))


def _units(ratio: float, tolerance: float) -> float:
    """|log ratio| in units of a tolerance: exactly <= 1 when Ties calls the two values the same."""
    return abs(math.log(ratio)) / -math.log1p(-max(tolerance, 1e-12))


def merit(r: Row, ties: Ties) -> float:
    """Lower is better: log memory plus log time, each in units of its tolerance. Of two tied runs the one
    ahead by more tolerances has the lower merit, and a run always has a lower merit than those it
    dominates (so sorting by merit puts every run after all that beat it)."""
    return (math.log(max(_mem(r), 1)) / -math.log1p(-max(ties.memory, 1e-12))
            + math.log(max(_time(r), 1e-12)) / -math.log1p(-max(ties.time, 1e-12)))


@dataclass
class FrontPoint:
    best: Row
    tied: list[Row] = field(default_factory=list)  # non-dominated runs that tie with `best`, named after it
    reasons: list[str] = field(default_factory=list)  # per tied run: why `best` is named rather than it


def candidates(rows: list[Row]) -> list[Row]:
    """Rows with both measurements and a loss not flagged."""
    return [r for r in rows if r.get("activation_bytes") is not None and r.get("median_step_time_s") is not None
            and not r.get("loss_flagged")]


def _percent(x: float) -> str:
    return f"{x * 100:.2g}%" if x < 0.1 else f"{x:.0%}"


def _why(best: Row, other: Row, ties: Ties) -> str:
    """Why `best` is named rather than `other`, a run tied with it."""
    name = best["run"]
    dm = abs(_mem(best) - _mem(other)) / max(_mem(best), _mem(other), 1)
    dt = abs(_time(best) - _time(other)) / max(_time(best), _time(other), 1e-12)
    um = _units(max(_mem(best), 1) / max(_mem(other), 1), ties.memory)
    ut = _units(_time(best) / _time(other), ties.time)
    if dm == 0:
        if dt == 0:
            return "the same memory and step time; the first in job order is named"
        return f"the same memory, and {name} is {_percent(dt)} faster"
    memory = f"{_percent(dm)} ({fmt_bytes(abs(_mem(best) - _mem(other)))}) " \
             f"{'less' if _mem(best) < _mem(other) else 'more'} memory"
    if dt == 0:
        return f"{name} uses {memory} at the same step time"
    if _mem(best) < _mem(other) and _time(best) < _time(other):
        return f"{name} uses {memory} and is {_percent(dt)} faster"
    weights = f"{um:.2f} of the memory tolerance against {ut:.2f} of the time tolerance"
    if _mem(best) < _mem(other):
        return f"{name} uses {memory} for a {_percent(dt)} longer step ({weights})"
    return f"{name} is {_percent(dt)} faster for {memory} ({weights})"


def pareto_front(rows: list[Row], ties: Ties = Ties()) -> list[FrontPoint]:
    """The non-dominated runs, less memory first, each tie folded into its best run. Also sets each row's
    "pareto": front, tied with <run>, dominated by <run>, loss flagged, or None (not measured)."""
    # In merit order every run comes after all runs that dominate it: a run is on the front when no front
    # run dominates it. So every run off the front is dominated by a front run, and no run drops out only
    # because a run that is itself off the front beats it (dominance within a tolerance is not transitive).
    points = sorted(candidates(rows), key=lambda r: (merit(r, ties), r["job"]))
    free, beaten = [], {}
    for r in points:
        beaters = [f for f in free if dominates(f, r, ties)]
        if beaters:
            beaten[id(r)] = beaters
        else:
            free.append(r)
    # The best remaining front run takes every remaining one it ties with: named runs never tie with each
    # other, and each listed run ties with the run it is listed under.
    front = []
    while free:
        best, *rest = free
        mates = [r for r in rest if tied(best, r, ties)]
        front.append(FrontPoint(best, mates, [_why(best, r, ties) for r in mates]))
        free = [r for r in rest if not any(r is m for m in mates)]
    front.sort(key=lambda p: (_mem(p.best), _time(p.best)))

    for r in rows:
        r["pareto"] = "loss flagged" if r.get("loss_flagged") else None
    for p in front:
        p.best["pareto"] = "front"
        for r in p.tied:
            r["pareto"] = f"tied with {p.best['run']}"
    for r in points:
        if id(r) in beaten:  # named after a front run that beats it, a named one where one does
            beaters = beaten[id(r)]
            beater = next((b for b in beaters if b["pareto"] == "front"), beaters[0])
            r["pareto"] = f"dominated by {beater['run']}"
    return front


def front_runs(front: list[FrontPoint]) -> list[str]:
    return [p.best["run"] for p in front]
