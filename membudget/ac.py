"""Activation checkpointing: one small policy per AC mode, one place (`apply_ac`) that applies it per block,
and the scoped compiler settings that carry the memory budget.

Modes:
- none: keep every activation.
- full: recompute each block in backward (non-reentrant torch.utils.checkpoint).
- selective "op": save the outputs of compute-heavy ops (matmuls, attention), recompute the cheap rest;
  of the matmuls only every second one is saved, and matmuls of listed modules are always recomputed.
- selective N: full AC on every N-th block, none on the others.
- memory_budget: no wrappers; the compiler's min-cut partitioner solves a knapsack that keeps the given
  fraction of activations and recomputes the cheapest rest. One budget for all blocks lives in the
  partitioner's global config (`compiler_scope`); per-block budgets annotate each block's region.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from membudget.errors import UserError
from membudget.internals import (
    checkpoint_wrapper,
    dynamo_recompile_limit,
    functorch_config,
    functorch_supports,
    selective_cache,
)
from membudget.schema import ACMode, block_budgets

aten = torch.ops.aten

# Ops whose outputs selective AC saves: expensive to recompute, cheap to keep relative to their FLOPs.
SAVE_OPS = {
    aten.mm.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten.max.default,
}


def _full_ac(block: nn.Module, cfg, **kwargs) -> nn.Module:
    return checkpoint_wrapper(block, preserve_rng_state=cfg.preserve_rng_state,
                              determinism_check=str(cfg.determinism_check), debug=cfg.debug, **kwargs)


def _forced_recompute_shapes(block: nn.Module, module_names) -> set[tuple[int, ...]]:
    """Shapes of the transposed weights that the listed modules' matmuls take as their second argument."""
    shapes, matched = set(), set()
    for name, module in block.named_modules():
        for wanted in module_names:
            if isinstance(module, nn.Linear) and name.endswith(wanted):
                shapes.add(tuple(module.weight.shape[::-1]))
                matched.add(wanted)
    unmatched = [n for n in module_names if n not in matched]
    if unmatched:
        linears = sorted(n for n, m in block.named_modules() if isinstance(m, nn.Linear))
        raise UserError(f"ac.force_recompute_modules={list(module_names)!r}: {unmatched[0]!r} matches no linear "
                        f"module of a block; choose from {', '.join(linears)}")
    return shapes


class SelectiveCacheSink:
    """Where a selective-AC wrapper hands the op outputs it saved: to an ActivationCounter while one counts."""

    def __init__(self):
        self.target: Optional[Callable] = None

    def add(self, cache) -> None:
        if self.target is not None and not torch.compiler.is_compiling():
            self.target(cache)


def _selective_op_ac(block: nn.Module, cfg) -> nn.Module:
    forced = _forced_recompute_shapes(block, cfg.force_recompute_modules)
    sink = SelectiveCacheSink()

    def context_fn():
        # Counts mm calls separately in forward and in recompute, so both make the same save decisions.
        mm_count: dict[str, int] = defaultdict(int)

        def policy(ctx, func, *args, **kwargs):
            if func == aten.mm.default:
                if tuple(args[1].shape) in forced:
                    return CheckpointPolicy.PREFER_RECOMPUTE
                mode = "recompute" if ctx.is_recompute else "forward"
                mm_count[mode] += 1
                # save every second matmul: saving all would keep most of the memory anyway
                if mm_count[mode] % 2 == 0:
                    return CheckpointPolicy.PREFER_RECOMPUTE
            return CheckpointPolicy.MUST_SAVE if func in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

        forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(policy)
        sink.add(selective_cache(forward_ctx))  # the saved outputs count as activations
        return forward_ctx, recompute_ctx

    wrapper = _full_ac(block, cfg, context_fn=context_fn)
    wrapper.selective_cache_sink = sink
    return wrapper


class BudgetedBlock(nn.Module):
    """A block whose compiled region carries its own memory budget (per-block budgets)."""

    def __init__(self, block: nn.Module, budget: float):
        super().__init__()
        self.block = block
        # kept as text: Dynamo guards a string by its value, where a float attribute that differs between
        # blocks would turn symbolic on the second block, and the annotation needs a constant
        self.budget = repr(float(budget))

    def forward(self, *args, **kwargs):
        with torch.autograd.graph.region_activation_memory_budget(float(self.budget)):
            return self.block(*args, **kwargs)


def wrap_block(block: nn.Module, layer_id: int, cfg, budget: Optional[float] = None) -> nn.Module:
    """The AC policy of `cfg.mode` for one transformer block (`budget`: its own, per-block budgets only)."""
    if cfg.mode == ACMode.full:
        return _full_ac(block, cfg)
    if cfg.mode == ACMode.selective:
        if cfg.selective_option == "op":
            return _selective_op_ac(block, cfg)
        every = int(cfg.selective_option)
        return _full_ac(block, cfg) if (layer_id + 1) % every == 0 else block
    if budget is not None:
        return BudgetedBlock(block, budget)
    return block  # none, and one budget for all blocks (it lives in the compiler's config)


def per_block(ac_cfg, n_layers: int) -> Optional[list[float]]:
    """The blocks' budgets when they differ (each block's region is annotated), else None."""
    budgets = block_budgets(ac_cfg, n_layers)
    return budgets if budgets is not None and len(set(budgets)) > 1 else None


def apply_ac(model: nn.Module, cfg) -> None:
    """Wrap each block of `model.layers` in place with the AC policy of `cfg.mode`."""
    blocks = list(model.layers.named_children())
    budgets = per_block(cfg, len(blocks)) or [None] * len(blocks)
    for layer_id, ((name, block), budget) in enumerate(zip(blocks, budgets)):
        model.layers.register_module(name, wrap_block(block, layer_id, cfg, budget))


@contextlib.contextmanager
def compiler_scope(ac_cfg, run_dir: Optional[Path] = None, n_layers: Optional[int] = None) -> Iterator[None]:
    """Set the partitioner's settings for one run and restore them afterwards.

    `torch._functorch.config` is process-global, and Dynamo caches compiled frames on the code object:
    without a reset a second run in the same process (tests, a local multirun) would reuse graphs
    partitioned under the first run's budget. Per-block budgets leave the global budget at its default and
    annotate each block instead; blocks with equal budgets share a compiled graph.
    """
    settings, graphs = {}, 8
    if ac_cfg.mode == ACMode.memory_budget:
        settings = dict(
            activation_memory_budget_solver=str(ac_cfg.solver),
            activation_memory_budget_runtime_estimator=str(ac_cfg.runtime_estimator),
            visualize_memory_budget_pareto=bool(ac_cfg.visualize_pareto),
        )
        # Under TP the compiled block takes the process group (a ScriptObject) as an input; it holds no
        # activation memory, so zero is its true size for the knapsack. (torch 2.11 lacks the setting.)
        if functorch_supports("unsafe_treat_script_objects_as_zero_size"):
            settings["unsafe_treat_script_objects_as_zero_size"] = True
        budgets = per_block(ac_cfg, n_layers) if n_layers is not None else None
        if budgets is None:
            settings["activation_memory_budget"] = block_budgets(ac_cfg, n_layers or 1)[0]
        else:
            graphs = len(set(budgets)) + 2
        if ac_cfg.visualize_pareto and run_dir is not None:
            settings["memory_budget_pareto_dir"] = str(Path(run_dir) / "memory_budget_pareto")
    torch.compiler.reset()
    try:
        with functorch_config(**settings), dynamo_recompile_limit(graphs):
            yield
    finally:
        torch.compiler.reset()
