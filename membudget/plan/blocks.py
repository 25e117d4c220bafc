"""Per-block AC policies chosen by the planner: the fastest assignment of policies to blocks that fits a memory
target.

One setting for the whole model is a coarse knob: full AC keeps each block's input, none keeps everything, the
budgets between them move in plateaus. Giving each block its own policy (none, full, selective, a compiled
budget, or any of them with what it saves waiting in host memory) is a multiple-choice knapsack: minimise the
step time subject to the peak fitting. Our blocks are alike, so each policy is measured once, from the plan of
the model with every block under it (a uniform plan): what one block keeps on the device (the probe's middle
blocks) and the step's predicted time (on a CPU without a time model: its recompute FLOPs). A step's time is
taken as the blocks' shares of their uniform plans (k blocks under A and n - k under B cost
(k t_A + (n - k) t_B) / n), and its peak as the larger of the policies' peaks without their blocks' activations,
plus what the blocks keep. `assign` solves that knapsack exactly on a grid of the memory (a dynamic programme
over blocks and policies); the assignment is then planned as a whole, and only an assignment planned as a
whole is ever chosen: where the estimate was wrong, the target the programme aims at moves by the error and
it solves again.

Blocks that keep less go to the bottom: a block's recompute during backward runs while only the blocks below
it still hold activations, so the larger transients come when the least else is alive.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass
from typing import Optional

import numpy as np

from membudget.schema import BlockPolicy, compact_budgets, compact_policies, parse_block_policies
from membudget.units import fmt_bytes

from .result import Plan, fits_within, limit_for, usable

log = logging.getLogger("membudget")

REPLANS = 6  # whole-model plans one choice may spend
GRID = 4096  # the memory a programme packs, in this many steps: a block's bytes are rounded up to one step


@dataclass(frozen=True)
class Mix:
    """A policy per block (bottom first), with its peak and time as estimated from uniform plans."""

    policies: tuple[BlockPolicy, ...]
    judged_bytes: int  # the estimated peak, as a plan's verdict judges it (Plan.judged_bytes)
    cost: float  # the estimated step time in seconds (CPU: recompute FLOPs)

    @property
    def spelling(self) -> str:
        return compact_policies(list(self.policies))


@dataclass(frozen=True)
class TargetChoice:
    """At one memory target: the best uniform setting, and the per-block plan when one beats it."""

    target: int  # bytes that Plan.judged_bytes must stay within (after the plan's uncertainty)
    single: Optional[Plan]  # the fastest uniform setting that fits
    per_block: Optional[Plan]  # the fastest assignment that fits, planned as a whole; None: none beats `single`

    @property
    def best(self) -> Optional[Plan]:
        return self.per_block or self.single

    @property
    def gain(self) -> Optional[float]:
        """How much faster the per-block plan is than the best uniform setting (tokens/s), e.g. 0.05."""
        if self.per_block is None or self.single is None:
            return None
        return cost(self.single) / cost(self.per_block) - 1


def cost(plan: Plan) -> float:
    """What choices minimise: the predicted step time, or without a time model the recompute FLOPs."""
    if plan.step_seconds is not None:
        return plan.step_seconds
    return plan.recompute_flops or 0.0


def block_bytes(plan: Plan) -> int:
    """The activation bytes one block keeps on the device under the plan's setting (the probe's middle blocks)."""
    kept = [b.activation_bytes for b in plan.blocks]
    return int(statistics.median(kept)) if kept else 0


def fits(plan_or_mix, target: int) -> bool:
    """The verdict "fits" against `target`: a plan's own verdict at its own limit, else verdict.judge's
    first test."""
    if isinstance(plan_or_mix, Plan) and target == plan_or_mix.limit:
        return bool(plan_or_mix.fits)
    return fits_within(plan_or_mix.judged_bytes, target)


def uniform(plans: list[Plan]) -> list[tuple[BlockPolicy, Plan]]:
    """The plans whose blocks all have one policy, with that policy."""
    out = []
    for p in plans:
        policies = set(parse_block_policies(p.policies))
        if len(policies) == 1:
            out.append((policies.pop(), p))
    return out


def single_budgets(plans: list[Plan]) -> list[Plan]:
    return sorted((p for p in plans if p.ac_mode == "memory_budget" and isinstance(p.memory_budget, float)),
                  key=lambda p: p.memory_budget)


def best_single(plans: list[Plan], target: int) -> Optional[Plan]:
    """The fastest uniform setting among `plans` that fits `target`, ties to the smaller peak, then the higher
    budget."""
    return min((p for _, p in uniform(plans) if fits(p, target)),
               key=lambda p: (cost(p), p.judged_bytes, -(p.memory_budget if isinstance(p.memory_budget, float) else 0)),
               default=None)


def assign(plans: list[Plan], n_layers: int, target: int) -> Optional[Mix]:
    """The fastest policy per block, by the estimate, whose estimated peak fits `target`; None when none does.

    For each level of the part of the peak that is not the blocks' (`base`, a policy's peak less its n blocks'
    activations), the policies whose base is within it are packed by a dynamic programme over blocks: cheapest
    time for each number of grid steps of memory. Exact for the estimate, up to one grid step per block."""
    options = [(policy, plan, block_bytes(plan), plan.judged_bytes - n_layers * block_bytes(plan), cost(plan))
               for policy, plan in uniform(plans)]
    budget = usable(target)
    best: Optional[Mix] = None
    for level in sorted({base for *_, base, _ in options}):
        allowed = [o for o in options if o[3] <= level]
        room = budget - level
        if room < 0 or not allowed:
            continue
        step = max(1.0, room / GRID)
        width = int(room // step)
        weights = [int(np.ceil(o[2] / step)) for o in allowed]
        times = np.array([o[4] / n_layers for o in allowed])
        table = np.zeros(width + 1)  # the cheapest time of the blocks so far, using at most w steps
        choice = np.zeros((n_layers, width + 1), dtype=np.int32)
        for j in range(n_layers):
            candidates = np.full((len(allowed), width + 1), np.inf)
            for i, w in enumerate(weights):
                if w <= width:
                    candidates[i, w:] = table[:width + 1 - w] + times[i]
            choice[j] = candidates.argmin(axis=0)
            table = candidates.min(axis=0)
        if not np.isfinite(table[width]):
            continue
        picked, w = [], width
        for j in reversed(range(n_layers)):
            i = int(choice[j, w])
            picked.append(allowed[i])
            w -= weights[i]
        picked.sort(key=lambda o: (o[2], str(o[0])))  # what keeps least goes to the bottom
        mix = Mix(tuple(o[0] for o in picked), int(max(o[3] for o in picked) + sum(o[2] for o in picked)),
                  sum(o[4] for o in picked) / n_layers)
        if best is None or (mix.cost, mix.judged_bytes) < (best.cost, best.judged_bytes):
            best = mix
    return best


def plan_mix(planner, mix: Mix) -> Plan:
    """The whole model's plan of `mix`: per-block budgets under ac=memory_budget when all are budgets and the run
    is one, else ac=per_block."""
    budgets = [p.budget for p in mix.policies]
    if planner.cfg.ac.mode == "memory_budget" and all(p.compiled for p in mix.policies):
        return planner.plan(planner.point("memory_budget", compact_budgets(budgets)))
    return planner.plan(planner.point("per_block", blocks=mix.spelling))


def compatible(plans: list[Plan], tp: int) -> list[list[Plan]]:
    """The groups of uniform plans whose policies may share a model: under TP a fully checkpointed block cannot
    be compiled (rules.check_parallelism), and a budget block turns compile on for every block."""
    if tp == 1:
        return [plans]
    full = {id(p) for policy, p in uniform(plans) if policy.ac == "full"}
    budgets = {id(p) for policy, p in uniform(plans) if policy.compiled}
    return [[p for p in plans if id(p) not in full], [p for p in plans if id(p) not in budgets]]


def choose_mix(planner, plans: list[Plan], target: int, single: Optional[Plan] = None) -> Optional[Plan]:
    """The fastest assignment that fits `target` and beats `single`, planned as a whole by `planner`; None when
    none does. Where a whole-model plan misses the estimate, the target the programme aims at moves by the miss
    (at most REPLANS plans per group of compatible policies)."""
    n = planner.cfg.model.n_layers
    best = single
    for group in compatible(plans, planner.degrees["tp"]):
        aim, tried = target, set()
        for _ in range(REPLANS):
            mix = assign(group, n, aim)
            beat = cost(best) if best is not None else float("inf")
            if mix is None or mix.cost >= beat or mix.policies in tried or len(set(mix.policies)) == 1:
                break
            tried.add(mix.policies)
            plan = plan_mix(planner, mix)
            log.info("plan: per-block policies %s for a target of %s: planned %s (estimated %s), cost %.4g",
                     mix.spelling, fmt_bytes(target), fmt_bytes(plan.judged_bytes), fmt_bytes(mix.judged_bytes),
                     cost(plan))
            if fits(plan, target):
                if cost(plan) < beat:
                    best = plan
                if plan.judged_bytes >= mix.judged_bytes:
                    break  # the estimate was not pessimistic: a larger aim would not fit
            # aim where the estimate's error puts the real target
            aim = int(aim + (target - limit_for(plan.judged_bytes)))
    return best if best is not single else None


def targets_between(plans: list[Plan], limit: int, most: int = 5) -> list[int]:
    """Memory targets a per-block plan can make a difference at: just above the peaks of the uniform settings
    that fit `limit` (a mix spends what the next setting up would have needed), at most `most`, largest first."""
    peaks = sorted({p.judged_bytes for _, p in uniform(plans)})
    gaps = [(lo, hi) for lo, hi in zip(peaks, peaks[1:]) if hi > lo * 1.01]  # plateaus are one point
    points = [int(limit_for(lo + (hi - lo) / 2)) for lo, hi in gaps]
    points = [t for t in points if t <= limit]
    if len(points) > most:  # spread over the range
        points = [points[round(i * (len(points) - 1) / (most - 1))] for i in range(most)]
    return sorted(set(points), reverse=True)


def per_target(planner, plans: list[Plan], targets: list[int]) -> list[TargetChoice]:
    """At each target: the best uniform setting, and the per-block plan that beats it (if any)."""
    choices = []
    for target in targets:
        single = best_single(plans, target)
        choices.append(TargetChoice(target, single, choose_mix(planner, plans, target, single)))
    return choices
