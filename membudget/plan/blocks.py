"""Per-block memory budgets chosen by the planner: the fastest mix of budget points that fits a memory target.

One budget for the whole model is a coarse knob: neighbouring budgets often keep the same activations, then one
step further keeps gigabytes more. A mix places some blocks at one budget point and the rest at another, and so
lands between those plateaus. Choosing one point per block is a multiple-choice knapsack (minimise step time,
subject to the peak fitting). Our blocks are alike, so each budget point is measured once, from the plan of
that single budget: what one block keeps (its BlockCost, a middle block of the probe) and the step's predicted
time (on a CPU without a time model: its recompute FLOPs). For n alike blocks and one memory constraint the
LP relaxation's optimum mixes at most two points, adjacent on the lower convex hull of (bytes kept, time), so
searching every two-point mix (k blocks at the lower budget, n - k at the higher) is searching the knapsack's
optimum up to rounding, and it reads as a Hydra override: `ac.memory_budget='0.3*8+0.6*24'`.

The lower budget goes to the bottom blocks: a block's recompute during backward runs while only the blocks
below it still hold activations, so the larger transients come when the least else is alive.

The estimate of a mix's peak starts from each of its two points' planned peaks, takes away the activations
their blocks keep and adds the mix's (the larger of the two, as the peak's transient is one of theirs). The
peak is not monotonic in the budget, so the estimate only picks the pair and a first count: the count is then
settled on plans of the whole model, and only a mix planned as a whole is ever chosen.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
from dataclasses import dataclass
from itertools import combinations
from typing import Optional

from membudget.schema import compact_budgets
from membudget.units import fmt_bytes

from .result import UNCERTAINTY, Plan, fits_within

log = logging.getLogger("membudget")

REPLANS = 6  # whole-model plans a choice may spend: a bisection over up to 64 blocks


@dataclass(frozen=True)
class Mix:
    """`low` budget for the bottom `k` blocks, `high` for the other n - k, as estimated from single budgets."""

    low: float
    high: float
    k: int
    n: int
    judged_bytes: int  # the estimated peak, as a plan's verdict judges it (Plan.judged_bytes)
    cost: float  # the estimated step time in seconds (CPU: recompute FLOPs)

    @property
    def budgets(self) -> list[float]:
        return [self.low] * self.k + [self.high] * (self.n - self.k)

    @property
    def spelling(self) -> str:
        return str(compact_budgets(self.budgets))


@dataclass(frozen=True)
class TargetChoice:
    """At one memory target: the best single budget, and the per-block plan when one beats it."""

    target: int  # bytes that Plan.judged_bytes must stay within (after the plan's uncertainty)
    single: Optional[Plan]  # the fastest single budget that fits
    per_block: Optional[Plan]  # the fastest mix that fits, re-planned as a whole; None: none beats `single`

    @property
    def best(self) -> Optional[Plan]:
        return self.per_block or self.single

    @property
    def gain(self) -> Optional[float]:
        """How much faster the per-block plan is than the best single budget (tokens/s), e.g. 0.05."""
        if self.per_block is None or self.single is None:
            return None
        return cost(self.single) / cost(self.per_block) - 1


def cost(plan: Plan) -> float:
    """What choices minimise: the predicted step time, or without a time model the recompute FLOPs."""
    if plan.step_seconds is not None:
        return plan.step_seconds
    return plan.recompute_flops or 0.0


def block_bytes(plan: Plan) -> int:
    """The activation bytes one block keeps under the plan's setting (the probe's middle blocks)."""
    kept = [b.activation_bytes for b in plan.blocks]
    return int(statistics.median(kept)) if kept else 0


def fits(plan_or_mix, target: int) -> bool:
    """The verdict "fits" against `target` (Planner._verdict's first test)."""
    return fits_within(plan_or_mix.judged_bytes, target)


def single_budgets(plans: list[Plan]) -> list[Plan]:
    return sorted((p for p in plans if p.ac_mode == "memory_budget" and isinstance(p.memory_budget, float)),
                  key=lambda p: p.memory_budget)


def mixes(plans: list[Plan], n_layers: int) -> list[Mix]:
    """Every two-point mix of the single-budget plans that trades memory for time (the lower budget keeps less
    and costs more), with its estimated peak and cost."""
    out = []
    for lo, hi in combinations(single_budgets(plans), 2):
        a_lo, a_hi = block_bytes(lo), block_bytes(hi)
        if a_lo >= a_hi or cost(lo) <= cost(hi):
            continue  # no trade between them: one is as small and as fast as the other
        base = max(lo.judged_bytes - n_layers * a_lo, hi.judged_bytes - n_layers * a_hi)
        for k in range(1, n_layers):
            held = k * a_lo + (n_layers - k) * a_hi
            # blocks add their costs (the time model sums ops); the rest of the step is the same in both
            step = (k * cost(lo) + (n_layers - k) * cost(hi)) / n_layers
            out.append(Mix(lo.memory_budget, hi.memory_budget, k, n_layers, base + held, step))
    return out


def best_single(plans: list[Plan], target: int) -> Optional[Plan]:
    """The fastest single budget among `plans` that fits `target`, ties to the smaller peak."""
    return min((p for p in single_budgets(plans) if fits(p, target)), key=lambda p: (cost(p), p.judged_bytes),
               default=None)


def choose_mix(planner, plans: list[Plan], target: int, single: Optional[Plan] = None) -> Optional[Plan]:
    """The fastest mix that fits `target` and beats `single`, planned as a whole by `planner`; None when no mix
    does. The pair of budgets is the estimate's best; the number of blocks at the lower one is then found by
    bisection on whole-model plans (the reserved peak moves in the allocator's segments, not byte by byte),
    starting where the estimate says, at most REPLANS plans."""
    n = planner.cfg.model.n_layers
    beat = cost(single) if single is not None else float("inf")
    fitting = [m for m in mixes(plans, n) if m.cost < beat and fits(m, target)]
    if not fitting:
        return None
    first = min(fitting, key=lambda m: (m.cost, m.judged_bytes))
    low_k, high_k, k = 1, n - 1, first.k  # the fewest lower-budget blocks that fit lies in [low_k, high_k]
    best = None
    for _ in range(REPLANS):
        mix = dataclasses.replace(first, k=k)
        plan = planner.plan(planner.point("memory_budget", mix.spelling))
        log.info("plan: per-block budgets %s for a target of %s: planned %s (estimated %s), cost %.4g",
                 mix.spelling, fmt_bytes(target), fmt_bytes(plan.judged_bytes), fmt_bytes(first.judged_bytes), cost(plan))
        if fits(plan, target):
            if cost(plan) < beat and (best is None or cost(plan) < cost(best)):
                best = plan
            high_k = k - 1
        else:
            low_k = k + 1
        if low_k > high_k:
            break
        k = (low_k + high_k) // 2
    return best


def targets_between(plans: list[Plan], limit: int, most: int = 5) -> list[int]:
    """Memory targets a per-block plan can make a difference at: just above the peaks of the single budgets
    that fit `limit` (the mix spends what the next budget up would have needed), at most `most`, largest first."""
    peaks = sorted({p.judged_bytes for p in single_budgets(plans)})
    gaps = [(lo, hi) for lo, hi in zip(peaks, peaks[1:]) if hi > lo * 1.01]  # plateaus are one point
    points = [int((lo + (hi - lo) / 2) / (1 - UNCERTAINTY)) for lo, hi in gaps]
    points = [t for t in points if t <= limit]
    if len(points) > most:  # spread over the range
        points = [points[round(i * (len(points) - 1) / (most - 1))] for i in range(most)]
    return sorted(set(points), reverse=True)


def per_target(planner, plans: list[Plan], targets: list[int]) -> list[TargetChoice]:
    """At each target: the best single budget and the per-block plan that beats it (if any)."""
    choices = []
    for target in targets:
        single = best_single(plans, target)
        mix = choose_mix(planner, plans, target, single)
        choices.append(TargetChoice(target, single, mix))
    return choices

