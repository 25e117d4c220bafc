"""The planner predicts what a real step allocates: activation bytes exactly as training measures them,
parameter/gradient/optimizer bytes as the real optimizer leaves them, and the peak as torch's MemTracker sees
it; it plans Llama 3 8B over 8 or 64 fake ranks in little memory, and `auto` picks the cheapest budget that fits."""

import dataclasses
import json
import os
import resource
import subprocess
import sys

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from membudget.ac import compiler_scope
from membudget.config import UserError, validate
from membudget.metrics import ActivationCounter
from membudget.plan import SWEEP_BUDGETS, Planner, _choose, choose, non_monotonic, plan_setting, plan_sweep, plot_sweep
from membudget.trainer import build_model, build_optimizer, forward_backward
from tests.conftest import FAST_COMPILE, ROOT, compose_cfg

GiB = 2**30
# the debug model on CPU in fp32, as the trainer runs it there; 4 blocks (the probes extrapolate from 3)
DEBUG = ["logger=none", "train.device=cpu", FAST_COMPILE, "train.seq_len=64", "train.global_batch_size=2"]


class CompiledMemTracker(MemTracker):
    """torch's MemTracker, kept on while compiled graphs run (aot_eager graphs run op by op)."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


def real_step(cfg):
    """Two real training steps of `cfg` (the second under MemTracker): activation bytes, the bytes of the
    parameters, gradients (before zero_grad) and optimizer states, and the second step's peak."""
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch_size, cfg.train.seq_len + 1))
    with compiler_scope(cfg.ac):
        model = build_model(cfg, torch.device("cpu"))
        optimizer, _ = build_optimizer(model, cfg)
        counter = ActivationCounter(model)
        _, activation_bytes = forward_backward(model, tokens[:, :-1], tokens[:, 1:], counter)
        grad_bytes = sum(p.grad.nbytes for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        tracker = CompiledMemTracker()
        tracker.track_external(model, optimizer)
        with tracker:
            forward_backward(model, tokens[:, :-1], tokens[:, 1:], counter)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {
        "activations": activation_bytes,
        "parameters": sum(p.nbytes for p in model.parameters()),
        "gradients": grad_bytes,
        "optimizer_states": sum(t.nbytes for s in optimizer.state.values() for t in s.values()),
        "peak": tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"],
        "tokens": tokens.nbytes,  # the batch: not in the plan
    }


@pytest.mark.parametrize("overrides", [
    ["ac=none"],
    ["ac=full"],
    ["ac=selective"],
    ["ac=selective", "ac.selective_option=2", "model.n_layers=6"],  # two kinds of block: probe 4, scale to 6
    ["ac=memory_budget", "ac.memory_budget=0.0"],
    ["ac=memory_budget", "ac.memory_budget=0.5"],
    ["ac=memory_budget", "ac.memory_budget=1.0"],
])
def test_plan_matches_a_real_step(overrides):
    cfg = compose_cfg(*DEBUG, *overrides)
    plan, real = plan_setting(cfg), real_step(cfg)
    for key in ("activations", "parameters", "gradients", "optimizer_states"):
        assert getattr(plan, key) == real[key], key
    # what MemTracker tracks beyond the plan is the batch of tokens
    assert plan.peak == pytest.approx(real["peak"] - real["tokens"], abs=1024)


REAL_TWO_RANK_STEP = """
import json, sys, torch
from membudget.ac import compiler_scope
from membudget.metrics import ActivationCounter
from membudget.parallel import build_mesh, dp_coordinates, init_distributed
from membudget.trainer import build_model, build_optimizer, forward_backward
from tests.conftest import compose_cfg
from tests.test_plan import CompiledMemTracker

cfg = compose_cfg(*sys.argv[1:])
launch = init_distributed(torch.device("cpu"))
mesh = build_mesh(cfg.parallelism, launch, torch.device("cpu"))
torch.manual_seed(0)  # TP ranks must see the same batch
tokens = torch.randint(0, cfg.model.vocab_size, (cfg.train.global_batch_size // dp_coordinates(mesh)[1],
                                                 cfg.train.seq_len + 1))
with compiler_scope(cfg.ac):
    model = build_model(cfg, torch.device("cpu"), mesh)
    optimizer, _ = build_optimizer(model, cfg)
    counter = ActivationCounter(model)

    def step():
        activations = forward_backward(model, tokens[:, :-1], tokens[:, 1:], counter)[1]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return activations

    step()
    tracker = CompiledMemTracker()
    tracker.track_external(model, optimizer)
    with tracker:  # a steady step
        activations = step()
peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
if launch.rank == 0:
    print(json.dumps({"activations": activations, "peak": peak - tokens.nbytes}))
"""


@pytest.mark.parametrize("parallelism", ["fsdp", "tp"])
def test_plan_matches_a_real_two_rank_step(tmp_path, parallelism):
    """Real FSDP2 or TP over two gloo processes, compiled under a memory budget: the plan for world size 2
    matches."""
    overrides = [*DEBUG, f"parallelism={parallelism}", "train.global_batch_size=4", "ac=memory_budget"]
    script = tmp_path / "step.py"
    script.write_text(REAL_TWO_RANK_STEP)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), *overrides],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1",
                                                                    "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    real = json.loads(proc.stdout.strip().splitlines()[-1])
    plan = plan_setting(compose_cfg(*overrides), world_size=2)
    assert plan.activations == real["activations"]
    assert plan.peak == pytest.approx(real["peak"], abs=1024)


@pytest.fixture(scope="module")
def llama3_8b_plans():
    """Every AC mode for Llama 3 8B at sequence length 8192, FSDP over 8 and over 64 ranks."""
    cfg = compose_cfg("logger=none", "model=llama3_8b", "parallelism=fsdp", "train.seq_len=8192",
                      "train.global_batch_size=64", "train.micro_batch_size=1")
    plans = {}
    for world_size in (8, 64):
        with Planner(cfg, world_size) as planner:
            for mode, budget in (("none", None), ("full", None), ("selective", None), ("memory_budget", 0.5)):
                plans[world_size, mode] = planner.plan(planner.point(mode, budget), mode)
    return plans


def test_llama3_8b_plans_on_a_cpu_in_little_memory(llama3_8b_plans):
    # 8B parameters alone would be 30 GiB in fp32; fake tensors hold no data
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < 3 * GiB
    for (world_size, mode), plan in llama3_8b_plans.items():
        assert plan.seconds < 60, (world_size, mode)
        assert plan.setting["dp_shard"] == world_size and plan.setting["dtype"] == "bf16 autocast"
        assert plan.peak > plan.parameters + plan.optimizer_states + plan.activations
    none, full, budget = (llama3_8b_plans[64, m] for m in ("none", "full", "memory_budget"))
    assert none.activations > budget.activations > full.activations
    assert none.recompute_flops == 0 < budget.recompute_flops < full.recompute_flops


def test_fsdp_shards_parameters_gradients_and_states_but_not_activations(llama3_8b_plans):
    for mode in ("none", "full", "selective", "memory_budget"):
        eight, sixty_four = llama3_8b_plans[8, mode], llama3_8b_plans[64, mode]
        for key in ("parameters", "gradients", "optimizer_states"):
            # 8x more shards; FSDP2 pads dim 0 to a multiple of the shard count
            assert getattr(eight, key) / getattr(sixty_four, key) == pytest.approx(8, rel=0.01), (mode, key)
        assert eight.activations == sixty_four.activations
        assert eight.forward_flops == 8 * sixty_four.forward_flops  # per step: 8 micro-batches a rank on 8 ranks
        assert eight.parameters == pytest.approx(8.03e9 * 4 / 8, rel=0.01)  # fp32 master weights


@pytest.fixture(scope="module")
def sweep():
    return plan_sweep(compose_cfg(*DEBUG, "ac=memory_budget"))


def with_target(plans, target):
    return [dataclasses.replace(p, target=target) for p in plans]


def test_sweep_plans_budgets_next_to_the_ac_modes(sweep, tmp_path):
    assert [p.label for p in sweep[:3]] == ["none", "full", "selective"]
    assert [p.memory_budget for p in sweep[3:]] == list(SWEEP_BUDGETS)
    budgets = {p.memory_budget: p for p in sweep[3:]}
    assert budgets[0.0].activations < budgets[1.0].activations <= sweep[0].activations
    assert budgets[0.0].recompute_flops > budgets[1.0].recompute_flops == 0
    for path in plot_sweep(sweep, tmp_path):
        assert path.stat().st_size > 1000
    assert (tmp_path / "sweep.svg").read_text().lstrip().startswith(("<?xml", "<svg"))


@pytest.mark.parametrize("quantile", [0.2, 0.5, 0.8])
def test_auto_chooses_the_least_recompute_that_fits(sweep, quantile):
    peaks = sorted(p.peak for p in sweep[3:])
    plans = with_target(sweep, peaks[int(quantile * (len(peaks) - 1))])
    chosen = choose(plans)
    assert chosen is not None and chosen.fits and chosen.ac_mode == "memory_budget"
    fitting = [p for p in plans if p.ac_mode == "memory_budget" and p.fits]
    assert chosen.recompute_flops == min(p.recompute_flops for p in fitting)
    assert not any(p.memory_budget > chosen.memory_budget and p.recompute_flops < chosen.recompute_flops
                   for p in fitting)


def test_auto_says_what_would_fit_when_no_budget_does(sweep):
    with pytest.raises(UserError) as info:
        _choose(with_target(sweep, min(p.peak for p in sweep) - 1), compose_cfg(*DEBUG), None)
    message = str(info.value)
    assert "\n" not in message and "ac=full" in message and "micro_batch_size" in message and "fsdp" in message


def test_non_monotonic_peaks_are_flagged(sweep):
    budgets = sweep[3:]
    assert non_monotonic([dataclasses.replace(p, peak=i) for i, p in enumerate(budgets)]) == []
    bumped = [dataclasses.replace(p, peak=p.peak + GiB) if p.memory_budget == 0.3 else p for p in budgets]
    assert {p.memory_budget for p in non_monotonic(bumped)} >= {b for b in SWEEP_BUDGETS if b > 0.3}


def test_budget_auto_and_sweep_in_config():
    validate(compose_cfg("ac=memory_budget", "ac.memory_budget=auto", "ac.target_memory_gib=70"))
    with pytest.raises(UserError, match="python -m membudget.plan"):
        validate(compose_cfg("ac=memory_budget", "ac.memory_budget=sweep"))
    with pytest.raises(UserError, match="set plan.world_size"):
        plan_setting(compose_cfg("parallelism=fsdp"))


def test_cli_writes_plan_json_and_md_into_its_hydra_dir(tmp_path):
    run_dir = tmp_path / "plan"
    proc = subprocess.run(
        [sys.executable, "-m", "membudget.plan", f"hydra.run.dir={run_dir}", *DEBUG, "ac=full", "plan.device_gib=8",
         "plan.margin_gib=1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["ac_mode"] == "full" and plan["target"] == 7 * GiB
    assert plan["fits"] is True and plan["activations"] > 0
    assert "predicted peak" in (run_dir / "plan.md").read_text()
