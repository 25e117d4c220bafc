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
    SDPA_CUDNN,
    SDPA_EFFICIENT,
    SDPA_FLASH,
    SDPA_FLASH_CPU,
    BlockWrapper,
    checkpoint_wrapper,
    dynamo_recompile_limit,
    functorch_config,
    functorch_supports,
    selective_cache,
)
from membudget.offload import OffloadedBlock, Offloader
from membudget.rules import uses_budget
from membudget.schema import BlockPolicy, block_policies, is_auto

aten = torch.ops.aten

# Ops whose outputs selective AC saves: expensive to recompute, cheap to keep relative to their FLOPs.
SAVE_OPS = {
    aten.mm.default,
    SDPA_EFFICIENT.default,
    SDPA_FLASH.default,
    SDPA_CUDNN.default,
    SDPA_FLASH_CPU.default,
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


def _selective_op_ac(block: nn.Module, cfg, offloader: Optional[Offloader] = None) -> nn.Module:
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
        cache = selective_cache(forward_ctx)
        sink.add(cache)  # the saved outputs count as activations
        if offloader is not None:  # they bypass autograd's saved tensors: offloaded on their own
            offloader.offload_cache(cache)
        return forward_ctx, recompute_ctx

    wrapper = _full_ac(block, cfg, context_fn=context_fn)
    wrapper.selective_cache_sink = sink
    return wrapper


class BudgetedBlock(BlockWrapper):
    """A block whose compiled region carries its own memory budget (per-block budgets)."""

    def __init__(self, block: nn.Module, budget: float):
        super().__init__(block)
        # kept as text: Dynamo guards a string by its value, where a float attribute that differs between
        # blocks would turn symbolic on the second block, and the annotation needs a constant
        self.budget = repr(float(budget))

    def forward(self, *args, **kwargs):
        with torch.autograd.graph.region_activation_memory_budget(float(self.budget)):
            return self.block(*args, **kwargs)


def wrap_block(block: nn.Module, policy: BlockPolicy, cfg, annotate: bool = False,
               offloader: Optional[Offloader] = None, index: int = 0) -> nn.Module:
    """`block` under `policy`; `annotate`: a budget block's region carries its own budget (blocks differ), else
    the budget lives in the compiler's global config; `offloader`: the model's, for an offloading policy."""
    if policy.ac == "full":
        block = _full_ac(block, cfg)
    elif policy.ac == "selective":
        block = _selective_op_ac(block, cfg, offloader if policy.offload else None)
    elif policy.compiled and annotate:
        block = BudgetedBlock(block, policy.budget)
    if policy.offload:
        block = OffloadedBlock(block, offloader, index)
    return block


def uniform_budget(policies: list[BlockPolicy]) -> Optional[float]:
    """The one budget of a model whose blocks all have it (it goes into the compiler's global config)."""
    if policies and all(p.compiled for p in policies) and len({p.budget for p in policies}) == 1:
        return policies[0].budget
    return None


def apply_ac(model: nn.Module, cfg) -> None:
    """Wrap each block of `model.layers` in place with its policy (schema.block_policies)."""
    blocks = list(model.layers.named_children())
    policies = block_policies(cfg, len(blocks))
    annotate = uniform_budget(policies) is None
    offloader = Offloader() if any(p.offload for p in policies) else None
    for index, ((name, block), policy) in enumerate(zip(blocks, policies)):
        model.layers.register_module(name, wrap_block(block, policy, cfg, annotate, offloader, index))


@contextlib.contextmanager
def compiler_scope(ac_cfg, run_dir: Optional[Path] = None, n_layers: Optional[int] = None) -> Iterator[None]:
    """Set the partitioner's settings for one run and restore them afterwards.

    `torch._functorch.config` is process-global, and Dynamo caches compiled frames on the code object:
    without a reset a second run in the same process (tests, a local multirun) would reuse graphs
    partitioned under the first run's budget. Per-block budgets leave the global budget at its default and
    annotate each block instead; blocks with equal budgets share a compiled graph.
    """
    settings, graphs = {}, 8
    if uses_budget(ac_cfg) and not is_auto(ac_cfg):
        settings = dict(
            activation_memory_budget_solver=str(ac_cfg.solver),
            activation_memory_budget_runtime_estimator=str(ac_cfg.runtime_estimator),
            visualize_memory_budget_pareto=bool(ac_cfg.visualize_pareto),
        )
        # Under TP the compiled block takes the process group (a ScriptObject) as an input; it holds no
        # activation memory, so zero is its true size for the knapsack. (torch 2.11 lacks the setting.)
        if functorch_supports("unsafe_treat_script_objects_as_zero_size"):
            settings["unsafe_treat_script_objects_as_zero_size"] = True
        policies = block_policies(ac_cfg, n_layers or 1)
        budget = uniform_budget(policies)
        if budget is not None:
            settings["activation_memory_budget"] = budget
        else:  # each budget block's region carries its budget; blocks of one policy share a compiled graph
            graphs = len(set(policies)) + 2
        if ac_cfg.visualize_pareto and run_dir is not None:
            settings["memory_budget_pareto_dir"] = str(Path(run_dir) / "memory_budget_pareto")
    torch.compiler.reset()
    try:
        with functorch_config(**settings), dynamo_recompile_limit(graphs):
            yield
    finally:
        torch.compiler.reset()
