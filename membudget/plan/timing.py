"""Predicted step time: each op priced as the kernel the GPU runs for it, at the efficiency that kind of kernel
achieves; inductor's fusion in compiled graphs; the host that issues the kernels; communication per collective;
and FSDP2's overlap of the two.

Per kernel (the device's `Efficiency`, each figure's source in docs/planner/sources.md):
- a GEMM at the achieved share of the tensor-core peak, less its wave quantisation (output tiles over the
  multiprocessors: a last, partly filled wave costs a whole one) and a small-K penalty; never faster than its
  bytes at HBM bandwidth;
- attention (SDPA) at its kernel's achieved share in its direction, lower for short sequences;
- every other op moves bytes: at the achieved share of HBM bandwidth, never under a per-kernel floor. In a graph
  inductor compiles, the ops between two anchors (GEMMs, attention, collectives) are one kernel, charged only the
  bytes that cross its boundary: what it reads from outside and what outlives it;
- the host: an eager op costs dispatch and launch time, a compiled graph a call plus a launch per kernel; the
  GPU cannot run ahead of the host that issues its work.
Each collective moves, per rank, (ranks - 1) / ranks of its buffer (twice for an all-reduce, as a ring does) at
NCCL's achieved bus bandwidth over NVLink inside a node, else the inter-node fabric, after a start-up latency.
TP's collectives block the compute stream. FSDP2's run on their own streams: a block's all-gather overlaps the
previous block's compute (forward) or is prefetched one block ahead (backward), a block's reduce-scatter overlaps
the next block's backward; one link carries them in issue order, the optimizer step waits for the last
reduce-scatter, and compute that overlaps them runs without the multiprocessors NCCL's kernels hold.

Not modelled: the all-reduce of DDP/HSDP replicas overlapping backward (it is counted as exposed), and inductor's
choices beyond grouping (GEMM epilogue fusion, split reductions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from membudget.devices import Device

from .fusion import fused_bytes, fused_kernels
from .trace import ATTENTION, FALLBACK, GEMM, VIEW, Collective, Op

_FSDP_GROUPS = ("dp_shard", "dp_replicate")
COMPUTE, FSDP_TRAFFIC, TP_TRAFFIC, HOST = "compute", "exposed FSDP traffic", "TP traffic", "host"
OFFLOAD_TRAFFIC = "exposed offload traffic"
KERNEL_KINDS = ("gemm", "attention", "memory", "fused")  # how a plan breaks down its GPU time


@dataclass(frozen=True)
class StepTime:
    seconds: float  # one optimizer step of one rank (all ranks run alike)
    compute: float  # the compute stream's busy time, TP's collectives included
    communication: float  # FSDP2's collectives on their own streams
    exposed_communication: float  # of those, what the compute stream waited for
    forward: float
    backward: float
    optimizer: float
    host: float = 0.0  # the host's time to issue the step's work
    tp_communication: float = 0.0  # TP's collectives, on the compute stream
    kernels: dict = field(default_factory=dict)  # GPU seconds by kind of kernel: gemm, attention, memory, fused
    bound: str = COMPUTE  # what bounds the step: compute, exposed FSDP traffic, TP traffic, offload traffic or host
    offload_waits: float = 0.0  # the compute stream's waits for offloaded activations (copies out and back)
    offload_transfers: float = 0.0  # the host link's busy time for them, both ways


# --- kernels -------------------------------------------------------------------------------------------------

def gemm_efficiency(shape: tuple, device: Device) -> float:
    """The share of the tensor-core peak a GEMM of (batch, M, N, K) achieves: the large-shape share, times the
    filled share of its waves of output tiles, times K / (K + k_half)."""
    e = device.efficiency
    batch, m, n, k = shape
    tiles = batch * math.ceil(m / e.gemm_tile[0]) * math.ceil(n / e.gemm_tile[1])
    waves = math.ceil(tiles / device.sms) if device.sms else 1
    filled = tiles / (waves * device.sms) if device.sms else 1.0
    return e.gemm * filled * k / (k + e.gemm_k_half)


def attention_efficiency(op: Op, device: Device) -> float:
    _, _, seq, _, _, backward = op.shape
    e = device.efficiency
    kernel = next((k for k in e.attention if k in op.name), "flash")
    forward_share, backward_share = e.attention[kernel]
    return (backward_share if backward else forward_share) * seq / (seq + e.attention_s_half)


def memory_seconds(nbytes: int, device: Device) -> float:
    return max(nbytes / (device.hbm_bandwidth * device.efficiency.memory), device.efficiency.kernel_floor)


def op_seconds(op: Op, device: Device) -> float:
    """GPU seconds of one op run as its own kernel (0 for views and allocations)."""
    if op.kind == VIEW:
        return 0.0
    peak = (device.peak_flops if op.low_precision else device.peak_flops_fp32) * device.compute_scale
    if op.kind == GEMM:
        compute = op.flops / (peak * gemm_efficiency(op.shape, device))
    elif op.kind == ATTENTION:
        compute = op.flops / (peak * attention_efficiency(op, device))
    else:
        compute = op.flops / peak
    return max(compute, memory_seconds(op.nbytes, device))


@dataclass
class Cost:
    """What a run of ops costs: the compute stream's GPU seconds, the host's seconds to issue them, GPU seconds by
    kind of kernel, and the FSDP2 collectives among them (kind, seconds) in issue order."""

    gpu: float = 0.0
    host: float = 0.0
    tp: float = 0.0
    kernels: dict = field(default_factory=lambda: dict.fromkeys(KERNEL_KINDS, 0.0))
    collectives: list = field(default_factory=list)


def cost(ops: list[Op], device: Device, degrees: dict[str, int]) -> Cost:
    e = device.efficiency
    c = Cost()

    def run(kind: str, seconds: float) -> None:
        c.gpu += seconds
        c.kernels[kind] += seconds

    i = 0
    while i < len(ops):
        op = ops[i]
        if op.region is not None:  # one call of a graph inductor compiles
            j = i
            while j < len(ops) and ops[j].region == op.region:
                j += 1
            graph = ops[i:j]
            kernels = fused_kernels(graph)
            c.host += e.host_graph + e.host_kernel * len(kernels)
            for kernel in kernels:
                first = kernel[0]
                if first.collective is not None:
                    _collective(first, device, degrees, c)
                elif first.kind in (GEMM, ATTENTION, FALLBACK):
                    run(first.kind if first.kind != FALLBACK else "memory", op_seconds(first, device))
                else:
                    run("fused", memory_seconds(fused_bytes(kernel, graph), device))
            i = j
            continue
        if op.collective is not None:
            _collective(op, device, degrees, c)
            c.host += e.host_op
        elif op.kind == VIEW:
            c.host += e.host_view if op.name.startswith("aten.") else 0.0  # prim ops are the fake mode's own
        else:
            run(op.kind if op.kind in (GEMM, ATTENTION) else "memory", op_seconds(op, device))
            c.host += e.host_op
        i += 1
    return c


def _collective(op: Op, device: Device, degrees: dict[str, int], c: Cost) -> None:
    seconds = collective_seconds(op.collective, device, degrees)
    if op.collective.group in _FSDP_GROUPS:
        c.collectives.append((op.collective.kind, seconds))
    else:  # TP (or an unknown group): on the compute path
        c.gpu += seconds
        c.tp += seconds


def collective_seconds(c: Collective, device: Device, degrees: dict[str, int]) -> float:
    if c.ranks <= 1:
        return 0.0
    # ranks of the mesh (dp_replicate, dp_shard, tp) are laid out TP-innermost: how many GPUs one group spans
    span = {"tp": degrees["tp"], "dp_shard": degrees["dp_shard"] * degrees["tp"]}.get(
        c.group, degrees["dp_replicate"] * degrees["dp_shard"] * degrees["tp"])
    e = device.efficiency
    link = (device.intra_node_bandwidth * e.nccl_bus_nvlink if span <= device.gpus_per_node
            else device.inter_node_bandwidth * e.nccl_bus_network)
    moved = (c.ranks - 1) / c.ranks * c.nbytes * (2 if c.kind == "all_reduce" else 1)
    return e.nccl_latency + moved / link


# --- the step ------------------------------------------------------------------------------------------------

class _HostLink:
    """Offloaded activations over the GPU's host link, one copy engine each way (offload.py's program): block j's
    copies out start when its forward ends and queue on the D2H engine; the compute stream waits for them at the
    end of block j+1's forward (where it drops the originals; the top block at its own end). When block j's
    backward starts its own copies come back if no prefetch brought them (the top block), then block j-1's
    are prefetched on the H2D engine; block j-1's backward waits for them."""

    def __init__(self, device: Device, offloaded: dict[int, int]):
        self.rate = device.host_link_bandwidth * device.efficiency.host_link
        self.seconds = {j: b / self.rate for j, b in offloaded.items() if b}
        self.top = max(offloaded, default=-1)
        self.out = self.into = 0.0  # when each engine is next free
        self.busy = 0.0  # both engines' time copying
        self.copied: dict[int, float] = {}  # block -> when its copy out is done
        self.fetched: dict[int, float] = {}  # block -> when its copy back is done

    def forward_ends(self, j: int, clock: float) -> float:
        """When the compute stream may go on after block j's forward (its predecessor's copies waited for)."""
        if j in self.seconds:
            self.out = max(self.out, clock) + self.seconds[j]
            self.copied[j] = self.out
            self.busy += self.seconds[j]
        waits = [j - 1] + ([j] if j == self.top else [])
        return max([clock] + [self.copied.pop(i) for i in waits if i in self.copied and i in self.seconds])

    def backward_starts(self, j: int, clock: float) -> float:
        """When block j's backward may start: its copies back done (fetching its own, then prefetching j-1's)."""
        for i in (j, j - 1):
            if i in self.seconds and i not in self.fetched:
                self.into = max(self.into, clock, self.copied.get(i, 0.0)) + self.seconds[i]
                self.fetched[i] = self.into
                self.busy += self.seconds[i]
        return self.fetched.pop(j, 0.0)


def step_time(phases, device: Device, degrees: dict[str, int],
              offloaded: Optional[dict[int, int]] = None) -> Optional[StepTime]:
    """The step's time from its replayed phases (one step: step 2's); None without a time model (CPU).
    `offloaded`: the bytes each block's forward copies to host memory (offload.py), per micro-batch."""
    if not device.is_gpu:
        return None
    offload = _HostLink(device, offloaded or {})
    share = device.efficiency.nccl_sm_share
    clock = link = host = 0.0  # when the compute stream, the communication link and the host are next free
    previous_start = 0.0
    prefetched = 0.0  # when the all-gather the next backward block waits for is done
    busy = comm = tp = waited = offload_waited = 0.0
    kernels = dict.fromkeys(KERNEL_KINDS, 0.0)
    by_kind = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    for phase in phases:
        c = cost(phase.ops, device, degrees)
        tp += c.tp
        for kind, seconds in c.kernels.items():
            kernels[kind] += seconds
        ready = prefetched if phase.kind == "backward" else 0.0
        fetched = offload.backward_starts(phase.block, clock) if phase.kind == "backward" and phase.block is not None else 0.0
        fetch_wait = max(0.0, fetched - max(clock, ready))  # beyond what FSDP2's gather makes it wait
        ready = max(ready, fetched)
        if phase.kind == "optimizer":
            ready = link  # gradients are whole once the last reduce-scatter is done
        gathers_for_next = []
        for kind, seconds in c.collectives:
            comm += seconds
            if kind == "all_gather" and phase.kind == "forward":  # this block's own, issued one block early
                link = max(link, previous_start) + seconds
                ready = max(ready, link)
            elif kind == "all_gather":
                gathers_for_next.append(seconds)
        before, start = clock, max(clock, ready)
        waited += start - clock - fetch_wait
        offload_waited += fetch_wait
        for seconds in gathers_for_next:  # backward: prefetch of the next block's parameters
            link = max(link, start) + seconds
            prefetched = link
        # compute that overlaps NCCL's kernels runs on the multiprocessors they leave
        overlapped = max(0.0, min(link, start + c.gpu) - start)
        gpu = c.gpu + overlapped * share / (1 - share)
        busy += gpu
        host += c.host
        clock = max(start + gpu, host)  # the GPU finishes no earlier than the host has issued the work
        if phase.kind == "forward" and phase.block is not None:
            released = offload.forward_ends(phase.block, clock)
            offload_waited += max(0.0, released - clock)
            clock = max(clock, released)
        by_kind[phase.kind] = by_kind.get(phase.kind, 0.0) + clock - before
        for kind, seconds in c.collectives:
            if kind != "all_gather":  # reduce-scatter / all-reduce: once this block's gradients exist
                link = max(link, clock) + seconds
        previous_start = start
    waited += max(0.0, link - clock)
    seconds = max(clock, link)
    # the bound: the host when issuing the work takes longer than the GPU's work, else the largest term of the
    # compute stream's time (its kernels, TP's collectives on it, and its waits for FSDP2's)
    terms = {COMPUTE: busy - tp, TP_TRAFFIC: tp, FSDP_TRAFFIC: waited, OFFLOAD_TRAFFIC: offload_waited}
    bound = HOST if host > busy and host > offload_waited else max(terms, key=terms.get)
    return StepTime(seconds, busy, comm, waited, by_kind["forward"], by_kind["backward"], by_kind["optimizer"],
                    host=host, tp_communication=tp, kernels=kernels, bound=bound, offload_waits=offload_waited,
                    offload_transfers=offload.busy)
