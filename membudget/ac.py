"""Activation checkpointing: one small policy per AC mode, one place (`apply_ac`) that applies it per block,
and the scoped compiler settings that carry the memory budget.

Modes:
- none: keep every activation.
- full: recompute each block in backward (non-reentrant torch.utils.checkpoint).
- selective "op": save the outputs of compute-heavy ops (matmuls, attention), recompute the cheap rest;
  of the matmuls only every second one is saved, and matmuls of listed modules are always recomputed.
- selective N: full AC on every N-th block, none on the others.
- memory_budget: no wrappers; the compiler's min-cut partitioner solves a knapsack that keeps the given
  fraction of activations and recomputes the cheapest rest.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from pathlib import Path
from typing import Iterator, Optional

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from membudget.metrics import ActivationCounter

aten = torch.ops.aten

# Ops whose outputs selective AC saves: expensive to recompute, cheap to keep relative to their FLOPs.
_SAVE_OPS = {
    aten.mm.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten.max.default,
}


def _full_ac(block: nn.Module, cfg) -> nn.Module:
    return checkpoint_wrapper(
        block,
        preserve_rng_state=cfg.preserve_rng_state,
        determinism_check=cfg.determinism_check,
        debug=cfg.debug,
    )


def _forced_recompute_shapes(block: nn.Module, module_names) -> set[tuple[int, ...]]:
    """Shapes of the transposed weights that the listed modules' matmuls take as their second argument."""
    shapes = set()
    for name, module in block.named_modules():
        if isinstance(module, nn.Linear) and any(name.endswith(n) for n in module_names):
            shapes.add(tuple(module.weight.shape[::-1]))
    return shapes


def _selective_op_ac(block: nn.Module, cfg) -> nn.Module:
    forced = _forced_recompute_shapes(block, cfg.force_recompute_modules)

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
            return CheckpointPolicy.MUST_SAVE if func in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

        forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(policy)
        ActivationCounter.track_cache(forward_ctx.storage)  # the saved outputs count as activations
        return forward_ctx, recompute_ctx

    return checkpoint_wrapper(
        block,
        context_fn=context_fn,
        preserve_rng_state=cfg.preserve_rng_state,
        determinism_check=cfg.determinism_check,
        debug=cfg.debug,
    )


def wrap_block(block: nn.Module, layer_id: int, cfg) -> nn.Module:
    """The AC policy of `cfg.mode` for one transformer block."""
    if cfg.mode == "full":
        return _full_ac(block, cfg)
    if cfg.mode == "selective":
        if cfg.selective_option == "op":
            return _selective_op_ac(block, cfg)
        every = int(cfg.selective_option)
        return _full_ac(block, cfg) if (layer_id + 1) % every == 0 else block
    return block  # none, and memory_budget (the budget lives in the compiler)


def apply_ac(model: nn.Module, cfg) -> None:
    """Wrap each block of `model.layers` in place with the AC policy of `cfg.mode`."""
    for layer_id, (name, block) in enumerate(list(model.layers.named_children())):
        model.layers.register_module(name, wrap_block(block, layer_id, cfg))


@contextlib.contextmanager
def compiler_scope(ac_cfg, run_dir: Optional[Path] = None) -> Iterator[None]:
    """Set the functorch partitioner settings for one run and restore them afterwards.

    `torch._functorch.config` is process-global, and Dynamo caches compiled frames on the code object:
    without a reset a second run in the same process (tests, a local multirun) would reuse graphs
    partitioned under the first run's budget.
    """
    settings = {}
    if ac_cfg.mode == "memory_budget":
        settings = dict(
            activation_memory_budget=float(ac_cfg.memory_budget),
            activation_memory_budget_solver=ac_cfg.solver,
            activation_memory_budget_runtime_estimator=ac_cfg.runtime_estimator,
            visualize_memory_budget_pareto=bool(ac_cfg.visualize_pareto),
            # Under TP the compiled block takes the process group (a ScriptObject) as an input; it holds no
            # activation memory, so zero is its true size for the knapsack.
            unsafe_treat_script_objects_as_zero_size=True,
        )
        if ac_cfg.visualize_pareto and run_dir is not None:
            settings["memory_budget_pareto_dir"] = str(Path(run_dir) / "memory_budget_pareto")
    torch.compiler.reset()
    try:
        with torch._functorch.config.patch(**settings):
            yield
    finally:
        torch.compiler.reset()
