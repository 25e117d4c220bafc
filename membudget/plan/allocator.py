"""A model of PyTorch's CUDA caching allocator, to turn a step's allocations into the memory it reserves.

The rules are those documented in c10/cuda/CUDACachingAllocator.cpp (its header comment and Note [Expandable
Segments]) and in the "CUDA memory management" notes of the PyTorch docs; no constant here is fitted to a
measurement:
- every request is rounded up to a multiple of 512 bytes (kMinBlockSize);
- requests up to 1 MiB (kSmallSize) come from the small pool, packed into 2 MiB segments (kSmallBuffer);
  larger ones from the large pool: requests under 10 MiB (kMinLargeAlloc) get a 20 MiB segment (kLargeBuffer),
  larger ones a segment of their size rounded up to 2 MiB (kRoundLarge);
- a request takes the smallest free cached block of its pool and stream that fits (best fit), split when the
  rest is at least 512 bytes (small pool) or more than 1 MiB (large pool); a freed block merges with free
  neighbours of its segment; blocks are reused only by the stream they were allocated on;
- cached segments are returned to CUDA only when a cudaMalloc fails (then one unsplit free segment large
  enough, else all unsplit free ones, and the request is retried) or on empty_cache;
- with expandable_segments:True each stream and pool has one segment that grows by mapping pages (2 MiB for
  the small pool, 20 MiB for the large) at its end; blocks split down to 512 bytes; under memory pressure free
  whole pages are unmapped.
`allocated` counts blocks as torch.cuda.memory_allocated does (the rounded, possibly unsplit block sizes).
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass
from typing import Optional

MIN_BLOCK = 512
SMALL_SIZE = 1 << 20
SMALL_BUFFER = 2 << 20
MIN_LARGE_ALLOC = 10 << 20
LARGE_BUFFER = 20 << 20
ROUND_LARGE = 2 << 20


def round_size(nbytes: int) -> int:
    return MIN_BLOCK * max(1, math.ceil(nbytes / MIN_BLOCK))


def segment_size(size: int) -> int:
    """What one cudaMalloc reserves for a request of `size` (rounded) bytes when no cached block fits."""
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * math.ceil(size / ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    segment: "_Segment"
    offset: int
    size: int
    free: bool = True
    prev: Optional["_Block"] = None
    next: Optional["_Block"] = None

    @property
    def address(self) -> int:
        return self.segment.base + self.offset

    def sort_key(self) -> tuple[int, int]:
        return self.size, self.address


@dataclass(eq=False)
class _Segment:
    base: int
    size: int  # bytes reserved (mapped, for an expandable segment)
    pool: tuple[int, bool]  # (stream, small)
    head: Optional[_Block] = None

    def blocks(self):
        block = self.head
        while block is not None:
            yield block
            block = block.next

    @property
    def tail(self) -> _Block:
        block = self.head
        while block.next is not None:
            block = block.next
        return block


class CachingAllocator:
    """Replays malloc/free calls; `reserved` and `allocated` and their peaks read like torch.cuda's counters.
    With a `capacity`, a segment that would exceed it first releases cached memory, as cudaMalloc's failure
    does; `ooms` counts requests that still did not fit, `retries` those that fit only after releasing."""

    def __init__(self, expandable: bool = False, capacity: Optional[int] = None):
        self.expandable = expandable
        self.capacity = capacity
        self.reserved = self.allocated = 0
        self.peak_reserved = self.peak_allocated = 0
        self.ooms = self.retries = 0
        self._free: dict[tuple[int, bool], list[tuple[int, int, int]]] = {}  # pool -> sorted (size, address, id)
        self._by_id: dict[int, _Block] = {}
        self._live: dict[object, _Block] = {}
        self._segments: list[_Segment] = []
        self._grown: dict[tuple[int, bool], _Segment] = {}
        self._bases = itertools.count(1 << 40, 1 << 40)  # each segment has an address range of its own

    # --- the free lists ------------------------------------------------------------------------------------
    def _insert(self, block: _Block) -> None:
        self._by_id[id(block)] = block
        bisect.insort(self._free.setdefault(block.segment.pool, []), (*block.sort_key(), id(block)))

    def _remove(self, block: _Block) -> None:
        entries = self._free[block.segment.pool]
        entries.pop(bisect.bisect_left(entries, (*block.sort_key(), id(block))))
        del self._by_id[id(block)]

    def _best_fit(self, pool: tuple[int, bool], size: int) -> Optional[_Block]:
        entries = self._free.get(pool, [])
        i = bisect.bisect_left(entries, (size, -1, -1))
        return self._by_id[entries[i][2]] if i < len(entries) else None

    # --- segments ------------------------------------------------------------------------------------------
    def _reserve(self, nbytes: int) -> bool:
        """Whether `nbytes` more can be reserved, releasing cached memory first if the capacity requires it."""
        if self.capacity is None or self.reserved + nbytes <= self.capacity:
            return True
        self.retries += 1
        self._release(self.reserved + nbytes - self.capacity)
        return self.reserved + nbytes <= self.capacity

    def _release(self, wanted: int) -> None:
        if self.expandable:  # unmap every free whole page
            for segment in self._segments:
                page = _page(segment.pool)
                for block in segment.blocks():
                    if block.free:
                        start, end = math.ceil(block.offset / page) * page, (block.offset + block.size) // page * page
                        self.reserved -= max(0, end - start)
                        segment.size -= max(0, end - start)
            return
        unsplit = [s for s in self._segments if s.head.free and s.head.next is None]
        single = sorted((s for s in unsplit if s.size >= wanted), key=lambda s: s.size)[:1]
        for segment in single or unsplit:
            self._remove(segment.head)
            self._segments.remove(segment)
            self.reserved -= segment.size

    def _new_segment(self, pool: tuple[int, bool], nbytes: int) -> _Block:
        if not self._reserve(nbytes):
            self.ooms += 1
        segment = _Segment(next(self._bases), nbytes, pool)
        segment.head = _Block(segment, 0, nbytes)
        self._segments.append(segment)
        self.reserved += nbytes
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return segment.head

    def _grow(self, pool: tuple[int, bool], size: int) -> _Block:
        """Map pages at the end of the pool's expandable segment until its last free block holds `size`."""
        segment = self._grown.get(pool)
        if segment is None:
            segment = self._grown[pool] = _Segment(next(self._bases), 0, pool)
            self._segments.append(segment)
        tail = segment.head and segment.tail
        end = tail.offset + tail.size if tail else 0
        have = tail.size if tail is not None and tail.free else 0
        page = _page(pool)
        mapped = page * math.ceil((size - have) / page)
        if not self._reserve(mapped):
            self.ooms += 1
        segment.size += mapped
        self.reserved += mapped
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        if have:
            self._remove(tail)
            tail.size += mapped
            return tail
        block = _Block(segment, end, mapped, prev=tail)
        if tail is None:
            segment.head = block
        else:
            tail.next = block
        return block

    # --- malloc and free -----------------------------------------------------------------------------------
    def malloc(self, key, nbytes: int, stream: int = 0) -> None:
        size = round_size(nbytes)
        pool = (stream, size <= SMALL_SIZE)
        block = self._best_fit(pool, size)
        if block is not None:
            self._remove(block)
        elif self.expandable:
            block = self._grow(pool, size)
        else:
            block = self._new_segment(pool, segment_size(size))
        rest = block.size - size
        if rest >= MIN_BLOCK if (pool[1] or self.expandable) else rest > SMALL_SIZE:
            tail = _Block(block.segment, block.offset + size, rest, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = tail
            block.next, block.size = tail, size
            self._insert(tail)
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key) -> None:
        block = self._live.pop(key)
        self.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove(neighbour)
                first, second = (neighbour, block) if neighbour is block.prev else (block, neighbour)
                first.size += second.size
                first.next = second.next
                if second.next is not None:
                    second.next.prev = first
                block = first
        if block.prev is None:
            block.segment.head = block
        self._insert(block)

    def empty_cache(self) -> None:
        """Release every unsplit free segment (torch.cuda.empty_cache)."""
        self._release(self.reserved)


def _page(pool: tuple[int, bool]) -> int:
    return SMALL_BUFFER if pool[1] else LARGE_BUFFER
