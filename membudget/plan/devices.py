"""The device a plan is for, and why (the GPUs themselves are membudget/devices.py's table), and the memory
outside PyTorch's allocator (CUDA context, NCCL) as named terms."""

from __future__ import annotations

import os
from dataclasses import replace

import torch

from membudget.devices import GPUS, Device, by_cuda_name
from membudget.errors import UserError
from membudget.units import GiB, MiB

# Device memory outside PyTorch's caching allocator, so not in max_memory_reserved. Named, not fitted:
# - the CUDA context with its kernels: CUDA 12 loads modules lazily (CUDA_MODULE_LOADING=LAZY, torch's default),
#   which PyTorch's notes put at a few hundred MB; 0.5 GiB here;
# - NCCL's buffers per communicator: NCCL_BUFFSIZE (4 MiB, NCCL's documented default) for each of its three
#   protocols' buffers (Simple 4 MiB, LL128 about the same, LL small), per channel, for both ring neighbours;
#   NCCL opens up to 32 channels over NVLink (NCCL_MAX_NCHANNELS): 2 x 32 x 8 MiB = 512 MiB per communicator.
CUDA_CONTEXT = 512 * MiB
NCCL_PER_COMMUNICATOR = 2 * 32 * 8 * MiB


def host_memory() -> int:
    import psutil  # a dependency of the training stack; on a bare torch install a CPU plan has no limit

    return psutil.virtual_memory().available


def assumed_device(plan_cfg, target: str, local_ranks: int = 1) -> Device:
    """The device `python -m membudget.plan` plans for: plan.device_gib, the host for CPU runs, plan.gpu, the
    visible GPU, else an H100; `reason` says which and how to change it."""
    if target != "cuda":
        try:
            memory = host_memory() // max(1, local_ranks)
        except ImportError:
            memory = 0
        shared = f" shared by {local_ranks} ranks" if local_ranks > 1 else ""
        device = Device("cpu", memory, reason=f"a CPU run: its memory is this host's available memory{shared}")
    elif str(plan_cfg.gpu).lower() == "auto":
        if torch.cuda.is_available():
            name = torch.cuda.get_device_name(0)
            key = by_cuda_name(name)
            base = GPUS[key] if key else GPUS["H100"]
            device = replace(base, name=name, memory=torch.cuda.get_device_properties(0).total_memory,
                             capability=torch.cuda.get_device_capability(0),
                             reason=f"the visible GPU ({name})" + ("" if key else ": its speeds assumed as an H100's"))
        else:
            device = replace(GPUS["H100"], reason="no GPU visible: H100 80GB assumed, set plan.gpu")
    else:
        key = {k.lower(): k for k in GPUS}.get(str(plan_cfg.gpu).lower())
        if key is None:
            raise UserError(f"plan.gpu={plan_cfg.gpu!r}: not a GPU the planner knows; choose one of "
                            f"{', '.join(GPUS)} or auto, or set plan.device_gib")
        device = replace(GPUS[key], reason=f"plan.gpu={key}")
    if plan_cfg.device_gib is not None:
        device = replace(device, memory=int(plan_cfg.device_gib * GiB),
                         reason=f"{device.reason}; memory from plan.device_gib={plan_cfg.device_gib:g}")
    return device


def expandable_segments(plan_cfg) -> bool:
    """Whether the run's caching allocator uses expandable segments: plan.expandable_segments, else this
    environment's PYTORCH_CUDA_ALLOC_CONF (the run inherits it)."""
    configured = plan_cfg.expandable_segments
    if configured is not None:
        return bool(configured)
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + "," + os.environ.get("PYTORCH_ALLOC_CONF", "")
    return "expandable_segments:true" in conf.replace(" ", "").lower()
