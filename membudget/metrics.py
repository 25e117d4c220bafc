"""What a run measures (activation bytes, peak memory, throughput, MFU) and where it goes (metrics.jsonl,
W&B, a progress bar or log lines).

`activation_bytes` is the one definition the trainer, the planner and the report share: the bytes of the
tensors kept for backward during one step, deduplicated by storage, without the storages of parameters
and buffers (a saved reference to a weight costs no memory of its own). Three places keep such tensors:
- autograd's saved tensors, eager and compiled alike: seen by `saved_tensors_hooks`;
- the inputs of a checkpointed block, which non-reentrant checkpoint holds for its recompute;
- the op outputs that selective AC caches (MUST_SAVE), which live in the checkpoint's own storage.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import resource
import sys
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.utils._pytree import tree_leaves

log = logging.getLogger("membudget")


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor: a DTensor's own storage has the global size."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


class ActivationCounter:
    """Counts activation bytes of the forward passes run inside `count()`.

    Checkpoint wrappers report their inputs through a forward pre-hook, and selective AC reports its
    cache through `track_cache`, so every mode is measured the same way.
    """

    _active: Optional["ActivationCounter"] = None

    def __init__(self, model: nn.Module):
        self._excluded = {self._key(t) for t in list(model.parameters()) + list(model.buffers())}
        self._storages: dict[int, torch.UntypedStorage] = {}
        self._caches: list[Any] = []
        for module in model.modules():
            if isinstance(module, CheckpointWrapper):
                module.register_forward_pre_hook(self._on_checkpoint_input)

    @staticmethod
    def _key(t: torch.Tensor) -> int:
        # the StorageImpl's address: unique per storage, also for meta and fake tensors
        return local_tensor(t).untyped_storage()._cdata

    def _add(self, t: Any) -> None:
        if isinstance(t, torch.Tensor):
            storage = local_tensor(t).untyped_storage()
            if storage._cdata not in self._excluded:
                self._storages.setdefault(storage._cdata, storage)

    def _on_checkpoint_input(self, module, args) -> None:
        # A compiled checkpointed block saves its input through autograd (seen by the pack hook), and
        # Dynamo must not trace this hook: is_compiling() folds it away there.
        if torch.compiler.is_compiling():
            return
        if ActivationCounter._active is self and torch.is_grad_enabled():
            for a in tree_leaves(args):
                self._add(a)

    @classmethod
    def track_cache(cls, cache: Any) -> None:
        """Selective AC hands in its cache of saved op outputs (counted when the forward is done)."""
        if cls._active is not None and not torch.compiler.is_compiling():
            cls._active._caches.append(cache)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # FSDP's unsharded parameters exist only during forward/backward: seen as a Parameter or a view of one
        if not isinstance(t, nn.Parameter) and not isinstance(t._base, nn.Parameter):
            self._add(t)
        # detached: keeping a saved output itself would tie it to its own grad_fn in a reference cycle,
        # freed only by the garbage collector
        return t.detach()

    @contextlib.contextmanager
    def count(self) -> Iterator[None]:
        """Count one step's forward passes; read the total from `nbytes` afterwards."""
        self._storages.clear()
        self._caches.clear()
        ActivationCounter._active = self
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield
        finally:
            ActivationCounter._active = None
        for cache in self._caches:
            for leaf in tree_leaves(cache, is_leaf=lambda x: hasattr(x, "val")):
                self._add(getattr(leaf, "val", leaf))
        self._caches.clear()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self._storages.values())

    def release(self) -> None:
        """Drop the references kept for deduplication so the step's memory can be freed."""
        self._storages.clear()


def peak_memory(device: torch.device) -> dict[str, int]:
    """Peak memory so far: CUDA max allocated/reserved on GPU, the process's peak RSS on CPU."""
    if device.type == "cuda":
        allocated = torch.cuda.max_memory_allocated(device)
        return {
            "peak_memory_bytes": allocated,
            "cuda_max_allocated_bytes": allocated,
            "cuda_max_reserved_bytes": torch.cuda.max_memory_reserved(device),
        }
    # ru_maxrss is in KiB on Linux, bytes on macOS
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_memory_bytes": rss if sys.platform == "darwin" else rss * 1024}


# Dense bf16 peak FLOP/s per device, from the vendors' data sheets.
_PEAK_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
}


def device_peak_flops(device: torch.device, configured: Optional[float] = None) -> Optional[float]:
    if configured:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, flops in _PEAK_FLOPS.items():
            if key in name:
                return flops
    return None


def flops_per_token(n_params: int, n_layers: int, n_heads: int, head_dim: int, seq_len: int) -> float:
    """Training FLOPs per token, forward + backward, without recompute (the usual MFU convention):
    6 per parameter plus the attention scores, 12 * layers * heads * head_dim * seq_len."""
    return 6 * n_params + 12 * n_layers * n_heads * head_dim * seq_len


class MetricsWriter:
    """Appends one JSON object per logged step to metrics.jsonl and forwards it to W&B."""

    def __init__(self, run_dir: Path, wandb_run=None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.wandb_run = wandb_run

    def write(self, row: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])


def init_wandb(cfg, run_dir: Path, group: Optional[str], resume_id: Optional[str] = None):
    """An offline W&B run unless the user configured online; None with logger=none."""
    if cfg.logger.name != "wandb":
        return None
    import os

    import wandb
    from omegaconf import OmegaConf

    ac = cfg.ac
    budget = f"-b{float(ac.memory_budget):g}" if ac.mode == "memory_budget" else ""
    selective = f"-{ac.selective_option}" if ac.mode == "selective" else ""
    tags = list(cfg.logger.tags) + [f"ac:{ac.mode}"]
    if ac.mode == "memory_budget":
        tags.append(f"budget:{float(ac.memory_budget):g}")
    return wandb.init(
        project=cfg.logger.project,
        entity=cfg.logger.entity,
        group=cfg.logger.group or group,
        job_type=f"ac-{ac.mode}",
        tags=tags,
        name=cfg.logger.run_name or f"{cfg.model.name}-ac-{ac.mode}{budget}{selective}",
        config=OmegaConf.to_container(cfg, resolve=True),
        dir=str(run_dir),
        mode=cfg.logger.mode or os.environ.get("WANDB_MODE", "offline"),
        id=resume_id,
        resume="allow" if resume_id else None,
    )


def finite_or_none(x: float) -> Optional[float]:
    return x if x is not None and math.isfinite(x) else None
