"""What the measurement records and the models replay: allocation events (with the stream each allocation is made
on) and ops (with their FLOPs, bytes and collectives), in program order, cut into named segments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Union


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


@dataclass(frozen=True)
class Op:
    name: str
    flops: int
    nbytes: int  # bytes read and written (views and allocations without a fill read and write nothing)
    low_precision: bool  # its output is bf16/fp16: tensor-core peak instead of fp32's
    collective: Optional[Collective] = None


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
