"""A plan's verdict against the device: the memory limit (ac.target_memory_gib, else the device's memory less
plan.margin_gib), what else the device's memory holds (the CUDA context, NCCL's buffers), and whether the peak
fits, fits only tightly, or does not fit even when the allocator releases its cache (a replay under capacity)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from membudget.devices import Device
from membudget.units import GiB, fmt_bytes

from .allocator import CachingAllocator
from .devices import CUDA_CONTEXT, NCCL_PER_COMMUNICATOR
from .replay import Memory, simulate
from .result import DOES_NOT_FIT, FITS, NO_LIMIT, TIGHT, UNCERTAINTY, fits_within


@dataclass(frozen=True)
class Limit:
    """What one rank may use, and where that figure comes from."""

    nbytes: Optional[int]  # None: no limit known
    source: str
    # ac.target_memory_gib bounds what PyTorch's allocator reserves (max_memory_reserved); the device's memory also
    # holds the CUDA context and NCCL's buffers
    device_memory: bool

    @classmethod
    def of(cls, cfg, device: Device) -> "Limit":
        target_gib = cfg.ac.target_memory_gib
        if target_gib is not None:
            return cls(int(target_gib * GiB), f"ac.target_memory_gib={target_gib:g}", device_memory=False)
        margin = cfg.plan.margin_gib
        return cls(device.memory - int(margin * GiB) if device.memory else None,
                   f"the device's {fmt_bytes(device.memory)} less plan.margin_gib={margin:g}", device_memory=True)


def overheads(degrees: dict[str, int]) -> dict[str, int]:
    """What a GPU's memory holds beyond PyTorch's allocator: the CUDA context and one NCCL communicator's
    buffers per parallel dimension."""
    communicators = sum(1 for d in degrees.values() if d > 1)
    terms = {"CUDA context": CUDA_CONTEXT}
    if communicators:
        terms["NCCL buffers"] = communicators * NCCL_PER_COMMUNICATOR
    return terms


def judge(phases, allocated: Memory, reserved: Optional[Memory], extra: dict[str, int], limit: Limit,
          expandable: bool) -> tuple[str, str, int]:
    """(verdict, why, the bytes judged against the limit): the reserved peak (without an allocator model, the
    allocated one) plus `extra` where the limit is the device's memory."""
    other = sum(extra.values()) if limit.device_memory else 0
    need = (reserved.reserved.nbytes if reserved is not None else allocated.allocated.nbytes) + other
    if not limit.nbytes:
        return NO_LIMIT, "no memory limit known: set ac.target_memory_gib", need
    needs = f"needs {fmt_bytes(need)} of {fmt_bytes(limit.nbytes)}"
    if fits_within(need, limit.nbytes):
        return FITS, needs, need
    tight = f"{needs}: within the plan's {UNCERTAINTY:.0%} uncertainty of the limit"
    if reserved is None:
        return (TIGHT, tight, need) if need <= limit.nbytes else (DOES_NOT_FIT, needs, need)
    capped = simulate(phases, CachingAllocator(expandable=expandable, capacity=limit.nbytes - other))
    if capped.ooms:
        return DOES_NOT_FIT, f"{needs}; even releasing the allocator's cache, {capped.ooms} allocation(s) fail", need
    if need <= limit.nbytes:
        return TIGHT, tight, need
    return TIGHT, (f"{needs} with a full cache; fits only by releasing cached memory ({capped.retries} "
                   f"cudaMalloc retries in two steps: slower)"), need
