"""Per-block budgets chosen by the planner (membudget/plan/blocks.py): the mixes it weighs, and on CPU a mix that
beats every single budget at a memory target, planned as a whole, trained for real: the planned activation bytes
exactly, the loss of the single-budget runs."""

import dataclasses
import itertools

import pytest

from membudget.plan import Planner, choose_setting
from membudget.plan.blocks import assign, best_single, block_bytes, cost, targets_between
from membudget.plan.result import BlockCost, limit_for, usable
from membudget.schema import compact_policies, parse_block_budgets
from membudget.units import GiB
from tests.conftest import FAST_COMPILE, compose_cfg, read_metrics, train_here
from tests.test_plan_model import plan

# The debug model with activations that outweigh its parameters and optimizer states (else no AC setting moves
# the peak): four blocks, sequences of 256, eight of them
LARGE = ["logger=none", "train.device=cpu", FAST_COMPILE, "train.seq_len=256", "train.global_batch_size=8"]


def _uniform(policy: str, kept: int, seconds: float, peak: int, n: int = 4):
    budget = float(policy.split(":")[1]) if policy.startswith("budget:") else None
    p = plan(f"memory_budget {budget:g}" if budget is not None else policy, budget, reserved=peak, seconds=seconds)
    return dataclasses.replace(p, judged_bytes=peak, policies=f"{policy}*{n}",
                               blocks=[BlockCost(i, policy, kept, 0, 0, 0, None, None) for i in range(5)])


def _budget(b: float, kept: int, seconds: float, peak: int):
    return _uniform(f"budget:{b:g}", kept, seconds, peak)


def _estimate(options, assignment, n):
    """The estimate assign() optimises, by brute force: (time, peak) of one policy per block."""
    used = [options[i] for i in assignment]
    peak = max(o.judged_bytes - n * block_bytes(o) for o in used) + sum(block_bytes(o) for o in used)
    return sum(cost(o) for o in used) / n, peak


def test_assign_is_the_knapsacks_optimum_and_puts_what_keeps_least_at_the_bottom():
    n = 4
    options = [_uniform("none", kept=4 * GiB, seconds=1.0, peak=60 * GiB),
               _uniform("full", kept=GiB // 4, seconds=1.4, peak=36 * GiB),
               _uniform("selective", kept=2 * GiB, seconds=1.1, peak=47 * GiB),
               _budget(0.4, kept=1 * GiB, seconds=1.2, peak=40 * GiB),
               _uniform("offload", kept=GiB // 8, seconds=1.3, peak=36 * GiB)]
    for target_gib in (38, 42, 45, 50, 55, 58, 64):
        target = int(limit_for(target_gib * GiB))
        mix = assign(options, n, target)
        feasible = [a for a in itertools.product(range(len(options)), repeat=n)
                    if _estimate(options, a, n)[1] <= usable(target)]
        best = min(_estimate(options, a, n)[0] for a in feasible)
        assert mix.cost == pytest.approx(best, rel=1e-9), target_gib
        assert mix.judged_bytes <= usable(target)
        kept = [block_bytes(next(o for o in options if o.policies.startswith(str(p)))) for p in mix.policies]
        assert kept == sorted(kept)
    assert assign(options, n, int(30 * GiB)) is None  # nothing fits
    # a mix of three policies where two cannot reach it
    mix = assign(options, n, int(limit_for(45 * GiB)))
    assert mix.spelling == compact_policies(list(mix.policies)) and len(mix.policies) == n


def test_targets_fall_between_the_plateaus_of_single_budgets():
    plans = [_budget(b, kept=GiB, seconds=1.0, peak=p * GiB) for b, p in ((0.3, 40), (0.5, 50), (0.6, 50), (0.9, 60))]
    targets = targets_between(plans, limit=80 * GiB)
    assert targets == [int(limit_for(55 * GiB)), int(limit_for(45 * GiB))]
    assert targets_between(plans, limit=50 * GiB) == [int(limit_for(45 * GiB))]
    assert best_single(plans, targets[1]).memory_budget == 0.3


@pytest.fixture(scope="module")
def chosen():
    """ac.memory_budget=auto at a target between the peaks of budgets 0.5 and 0.6: the sweep, the mixes and
    their re-plans, as train.py runs them."""
    cfg = compose_cfg(*LARGE, "ac=memory_budget", "ac.memory_budget=0.5")
    with Planner(cfg) as planner:
        low, high = (planner.plan(planner.point("memory_budget", b)) for b in (0.5, 0.6))
    target_gib = limit_for((low.judged_bytes + high.judged_bytes) / 2) / GiB
    # the budgets around the gap (the others: lower peaks and more recompute than 0.5, or above 0.6's peak)
    budget, plan_ = choose_setting(compose_cfg(*LARGE, "ac=memory_budget", "ac.memory_budget=auto",
                                              f"ac.target_memory_gib={target_gib}", "plan.budgets=[0.4,0.5,0.6,0.7]"))
    return budget, plan_, low, high, target_gib


@pytest.mark.slow
def test_auto_chooses_a_per_block_plan_that_beats_every_single_budget(chosen):
    budget, plan_, low, high, target_gib = chosen
    assert isinstance(budget, str) and plan_.memory_budget == budget and plan_.label == f"memory_budget {budget}"
    assert set(parse_block_budgets(budget)) == {0.5, 0.6}  # between the two plateaus it spends the gap
    assert plan_.fits and plan_.judged_bytes <= usable(target_gib * GiB) < high.judged_bytes
    # on a CPU without a time model: fewer recompute FLOPs than 0.5, the best single budget that fits
    assert low.judged_bytes <= usable(target_gib * GiB)  # 0.5 fits the target, 0.6 does not
    assert low.recompute_flops > plan_.recompute_flops > high.recompute_flops
    assert low.activations < plan_.activations < high.activations


@pytest.mark.slow
def test_a_per_block_plan_trains_with_the_planned_activations_and_the_same_loss(chosen, tmp_path):
    budget, plan_, *_ = chosen
    run = [*LARGE, "train.steps=2", "train.progress=lines", "data.prefetch=0"]
    mixed = train_here(tmp_path / "mixed", *run, "ac=memory_budget", f"ac.memory_budget='{budget}'")
    single = train_here(tmp_path / "single", *run, "ac=memory_budget", "ac.memory_budget=0.5")
    none = train_here(tmp_path / "none", *run, "ac=none")
    assert mixed["activation_bytes"] == plan_.activations  # the planner is exact on CPU
    per_block = mixed["activation_bytes_per_block"]
    assert len(per_block) == 4 and len(set(per_block)) == 2  # two budgets, two sizes of what a block keeps
    losses = {name: [r["loss"] for r in read_metrics(tmp_path / name)] for name in ("mixed", "single", "none")}
    assert losses["mixed"] == losses["single"]  # fp32 on CPU, compiled alike: bitwise
    assert losses["mixed"] == pytest.approx(losses["none"], abs=1e-5)
    assert none["activation_bytes"] > mixed["activation_bytes"] > single["activation_bytes"]


def test_no_mix_when_none_beats_the_best_single_budget():
    """Equal step times (a run bound by communication, as 8B over 64 ranks plans): nothing to gain per block."""
    plans = [_budget(b, kept=int((1 + 10 * b) * GiB), seconds=1.0, peak=int((40 + 40 * b) * GiB))
             for b in (0.2, 0.4, 0.6)]
    target = int(60 * GiB)
    # no assignment is faster than the best single budget, so choose_mix plans none (it wants mix.cost < single's)
    assert assign(plans, 32, target).cost >= cost(best_single(plans, target)) - 1e-12


def test_the_sweep_table_says_by_how_much_a_per_block_plan_beats_the_best_single_setting():
    from membudget.plan.blocks import TargetChoice
    from membudget.plan.report import blocks_markdown

    single = _budget(0.4, kept=GiB, seconds=2.0, peak=40 * GiB)
    higher = _budget(0.6, kept=3 * GiB, seconds=1.0, peak=50 * GiB)
    full = dataclasses.replace(plan("full", None, reserved=30 * GiB, seconds=2.5), judged_bytes=30 * GiB)
    mixed = dataclasses.replace(_budget(0.5, kept=2 * GiB, seconds=1.6, peak=45 * GiB),
                                policies="budget:0.4*2+budget:0.6*2")
    target = int(limit_for(47 * GiB))
    text = blocks_markdown([TargetChoice(target, single, mixed)], [full, single, higher])
    row = text.splitlines()[-1]
    assert row.startswith("| 49.5 GiB |") and "budget:0.4*2+budget:0.6*2" in row and row.endswith("| +25.0% | +56.2% |")
    assert TargetChoice(target, single, mixed).gain == pytest.approx(0.25)
    assert "| full |" in text.splitlines()[4] and "memory_budget 0.4: " in row  # full fits, its speed is shown; 0.6 does not
