"""What the measurement records and the models replay: allocation events (with the stream each allocation is made
on) and ops (with their FLOPs, bytes and collectives), in program order, cut into named segments; a probe's
recorded micro-batches and optimizer steps; the categories of what a step holds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Union

import torch


class Alloc(NamedTuple):
    key: int  # unique per allocation (a storage resized back up is a new allocation)
    nbytes: int
    stream: int  # 0: the default stream; others: FSDP2's all-gather, copy-in, reduce-scatter streams


class Free(NamedTuple):
    key: int


class FreeCarried(NamedTuple):
    """A free of something the previous micro-batch or step left alive (FSDP2's last reduce-scatter buffer)."""

    nbytes: int


Event = Union[Alloc, Free, FreeCarried]


@dataclass(frozen=True)
class Collective:
    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all
    nbytes: int  # bytes of the whole (gathered / unreduced) buffer
    ranks: int
    group: Optional[str]  # the mesh dimension it runs over (dp_shard, dp_replicate, tp)


# What an op is, for its time: a matrix product and attention run on the tensor cores at their own efficiency,
# the rest moves bytes (a view or an allocation moves none); a fallback moves bytes in a kernel of its own even in
# a graph inductor compiles (it generates no code for complex tensors: RoPE's rotation)
GEMM, ATTENTION, MEMORY, VIEW, FALLBACK = "gemm", "attention", "memory", "view", "fallback"
GRAPH_OUTPUTS = "graph outputs"  # the name of the view-kind op that reads what a compiled graph call returns


@dataclass(frozen=True)
class Op:
    name: str
    flops: int
    nbytes: int  # bytes read and written (views and allocations without a fill read and write nothing)
    low_precision: bool  # its output is bf16/fp16: tensor-core peak instead of fp32's
    collective: Optional[Collective] = None
    kind: str = MEMORY
    # gemm: (batch, M, N, K); attention: (batch, heads, query length, head dim, causal, backward)
    shape: tuple = ()
    # inside a compiled graph that inductor would fuse: which call of it (None: run as its own kernel), and the
    # (allocation, bytes) it reads and writes, so that a fused kernel is charged only what crosses its boundary
    region: Optional[int] = None
    reads: tuple = ()
    writes: tuple = ()


@dataclass
class Segment:
    """What runs between two marks of the step: a block's forward or backward, the loss, the optimizer step."""

    name: str
    events: list[Event] = field(default_factory=list)
    ops: list[Op] = field(default_factory=list)

    @property
    def flops(self) -> int:
        return sum(op.flops for op in self.ops)

    def alloc_sizes(self) -> list[tuple[int, int]]:
        return [(e.nbytes, e.stream) for e in self.events if isinstance(e, Alloc)]


# Categories of what a step holds, in the order reports list them
PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS, COMMUNICATION, TEMPORARIES = (
    "parameters", "gradients", "optimizer states", "activations", "communication buffers", "temporaries")
CATEGORIES = (PARAMETERS, GRADIENTS, OPTIMIZER, ACTIVATIONS, COMMUNICATION, TEMPORARIES)


@dataclass
class Run:
    """One recorded micro-batch of a probe."""

    segments: dict[str, Segment]
    categories: dict[int, str]  # allocation key -> category (the rest are temporaries)
    activations: int  # training's activation_bytes
    per_block: dict  # activation bytes by probe block (None: outside the blocks)
    host_per_block: dict = field(default_factory=dict)  # bytes offloaded to host memory, by probe block


@dataclass
class Probe:
    depth: int
    period: int
    first: Run  # a step's first micro-batch: from no gradients
    last: Optional[Run]  # its last micro-batch when it has several: adding to the gradients, then synced
    # a micro-batch between them, adding to the gradients without the replicas' sync (parallel.gradient_sync);
    # None where it runs as the last does (no replicas, or fewer than three micro-batches)
    middle: Optional[Run]
    parameters: list[int]  # storage bytes of this rank's parameters: outside the blocks, then one block's
    block_parameters: list[int]
    buffers: list[int]
    shards: dict[str, list[tuple[torch.Size, torch.dtype]]]  # this rank's parameter shapes: "outside", "block"
    full_sizes: list[int]  # bytes of each parameter at full size in fp32 (the largest is the CPU init transient)
    sharded: bool  # parameters are DTensors

    @property
    def runs(self) -> list[Run]:
        return [run for run in (self.first, self.middle, self.last) if run is not None]

    def run_of(self, micro: int, n_micro: int) -> Run:
        """The recorded run that micro-batch `micro` of `n_micro` replays."""
        if micro == 0:
            return self.first
        return self.middle if self.middle is not None and micro < n_micro - 1 else self.last


@dataclass
class OptimizerRun:
    first: Segment  # gradient clipping and AdamW's first step: it allocates the states
    steady: Segment
    state_keys: set  # the first segment's allocations that are optimizer states
    state_bytes: int
