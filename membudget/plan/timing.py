"""Predicted step time: a roofline per op, communication per collective, and FSDP2's overlap of the two.

Per op, as torch.distributed._tools.runtime_estimator's roofline does: the larger of its FLOPs at the device's
peak (bf16 tensor cores, or fp32) and its bytes read and written at HBM bandwidth; views and allocations cost
nothing. Recompute is priced the same way, since it is ops in the backward. Each collective moves, per rank,
(ranks - 1) / ranks of its buffer (twice for an all-reduce, as a ring does) over NVLink inside a node, else the
inter-node fabric. TP's collectives block the compute stream. FSDP2's run on their own streams: a block's
all-gather overlaps the previous block's compute (forward) or is prefetched one block ahead (backward), a
block's reduce-scatter overlaps the next block's backward; one link carries them in issue order, and the
optimizer step waits for the last reduce-scatter.

Not modelled: kernel launch overhead and CPU-bound stretches, inductor's fusion (compiled blocks are priced op
by op, as aot_eager runs them: an upper bound on their memory-bound time), and the all-reduce of DDP/HSDP
replicas overlapping backward (it is counted as exposed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .devices import Device
from .trace import Collective, Op

_FSDP_GROUPS = ("dp_shard", "dp_replicate")


@dataclass(frozen=True)
class StepTime:
    seconds: float  # one optimizer step of one rank (all ranks run alike)
    compute: float  # the compute stream's busy time, TP's collectives included
    communication: float  # FSDP2's collectives on their own streams
    exposed_communication: float  # of those, what the compute stream waited for
    forward: float
    backward: float
    optimizer: float


def op_seconds(op: Op, device: Device) -> float:
    peak = device.peak_flops if op.low_precision else device.peak_flops_fp32
    return max(op.flops / peak, op.nbytes / device.hbm_bandwidth)


def collective_seconds(c: Collective, device: Device, degrees: dict[str, int]) -> float:
    if c.ranks <= 1:
        return 0.0
    # ranks of the mesh (dp_replicate, dp_shard, tp) are laid out TP-innermost: how many GPUs one group spans
    span = {"tp": degrees["tp"], "dp_shard": degrees["dp_shard"] * degrees["tp"]}.get(
        c.group, degrees["dp_replicate"] * degrees["dp_shard"] * degrees["tp"])
    bandwidth = device.intra_node_bandwidth if span <= device.gpus_per_node else device.inter_node_bandwidth
    moved = (c.ranks - 1) / c.ranks * c.nbytes * (2 if c.kind == "all_reduce" else 1)
    return moved / bandwidth


def _split(ops: list[Op], device: Device, degrees: dict[str, int]) -> tuple[float, list[tuple[str, float]]]:
    """A segment's compute-stream seconds and its FSDP2 collectives (kind, seconds) in issue order."""
    compute, collectives = 0.0, []
    for op in ops:
        if op.collective is None:
            compute += op_seconds(op, device)
        elif op.collective.group in _FSDP_GROUPS:
            collectives.append((op.collective.kind, collective_seconds(op.collective, device, degrees)))
        else:  # TP (or an unknown group): on the compute path
            compute += collective_seconds(op.collective, device, degrees)
    return compute, collectives


def step_time(phases, device: Device, degrees: dict[str, int]) -> Optional[StepTime]:
    """The step's time from its replayed phases (one step: step 2's); None without a time model (CPU)."""
    if not device.is_gpu:
        return None
    clock = link = 0.0  # when the compute stream and the communication link are next free
    previous_start = 0.0
    prefetched = 0.0  # when the all-gather the next backward block waits for is done
    busy = comm = 0.0
    by_kind = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    for phase in phases:
        compute, collectives = _split(phase.ops, device, degrees)
        busy += compute
        ready = prefetched if phase.kind == "backward" else 0.0
        if phase.kind == "optimizer":
            ready = link  # gradients are whole once the last reduce-scatter is done
        gathers_for_next = []
        for kind, seconds in collectives:
            comm += seconds
            if kind == "all_gather" and phase.kind == "forward":  # this block's own, issued one block early
                link = max(link, previous_start) + seconds
                ready = max(ready, link)
            elif kind == "all_gather":
                gathers_for_next.append(seconds)
        before, start = clock, max(clock, ready)
        for seconds in gathers_for_next:  # backward: prefetch of the next block's parameters
            link = max(link, start) + seconds
            prefetched = link
        clock = start + compute
        by_kind[phase.kind] = by_kind.get(phase.kind, 0.0) + clock - before
        for kind, seconds in collectives:
            if kind != "all_gather":  # reduce-scatter / all-reduce: once this block's gradients exist
                link = max(link, clock) + seconds
        previous_start = start
    seconds = max(clock, link)
    return StepTime(seconds, busy, comm, seconds - busy, by_kind["forward"], by_kind["backward"],
                    by_kind["optimizer"])
