"""Where the model runs and how it is wrapped: the device, and per block AC then compile.

Order per block follows torchtitan: AC wraps the block first, so that compile sees the checkpoint (and
its selective policy) and the partitioner can plan across it; each block is compiled on its own because
blocks are identical and share one compiled graph.
"""

from __future__ import annotations

import torch
from torch import nn

from membudget.ac import apply_ac
from membudget.config import compile_enabled


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        from membudget.config import UserError

        raise UserError("train.device='cuda': no CUDA device is visible; use train.device=auto or cpu")
    return torch.device(name)


def apply_compile(model: nn.Module, cfg) -> None:
    for name, block in list(model.layers.named_children()):
        model.layers.register_module(
            name, torch.compile(block, backend=cfg.compile.backend, fullgraph=cfg.compile.fullgraph)
        )


def parallelize(model: nn.Module, cfg) -> nn.Module:
    """Apply AC, then compile, to each block of `model.layers`, in place."""
    apply_ac(model, cfg.ac)
    if compile_enabled(cfg):
        apply_compile(model, cfg)
    return model
