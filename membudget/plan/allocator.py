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
- cached segments are returned to CUDA only when a cudaMalloc fails, or on empty_cache: then every unsplit
  free segment of every pool and stream (release_cached_blocks), and the request is retried once. (The header
  comment's "first one cached block of sufficient size" is release_available_cached_blocks, which returns at
  once unless max_split_size_mb is set; none of this project's runs sets it.)
- with expandable_segments:True each stream and pool has one segment that grows by mapping pages (2 MiB for
  the small pool, 20 MiB for the large) at its end; blocks split down to 512 bytes; best fit ranks a free
  block followed by unmapped pages by the size it can grow to (get_free_block's expandable_size), so the
  free block at the segment's end (followed by the unmapped rest of an address range of 1 1/8 the device's
  memory) is taken only when no other free block fits; under memory pressure the whole pages inside free
  blocks are unmapped (unmap_block): they become unmapped blocks, which merge with unmapped neighbours only,
  and a request no free block holds maps pages again (find_expandable_block, map_block): from the lowest
  unmapped block whose run of free and unmapped blocks, from the free block before it, spans the request,
  else at the segment's end. Pages are unmapped only then: each stream's segment keeps every page it ever
  mapped, its own high-water mark, which max_memory_reserved counts;
- frees apply in program order: a block recorded on another stream (record_stream) would wait for that stream's
  event (insert_events, process_events), but FSDP2 keeps its cross-stream buffers alive itself and
  ProcessGroupNCCL stashes a collective's tensors until wait() where TORCH_NCCL_AVOID_RECORD_STREAMS=1 or the
  collective is synchronous.
`allocated` counts blocks as torch.cuda.memory_allocated does (the rounded, possibly unsplit block sizes).
Read in c10/cuda/CUDACachingAllocator.cpp (pytorch/pytorch@001074d25, 2024; docs/planner/sources.md section 6):
DeviceCachingAllocator::malloc, get_free_block, alloc_block, release_available_cached_blocks,
release_cached_blocks, release_blocks, find_expandable_block, map_block, unmap_block, should_split.
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
    mapped: bool = True  # False: pages of an expandable segment unmapped under pressure (free, in no free list)

    def entry(self) -> tuple[int, int, "_Block"]:
        """Its place in its pool's free list: by size, then address (unique, so blocks are never compared)."""
        return self.size, self.segment.base + self.offset, self


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
        self._free: dict[tuple[int, bool], list[tuple[int, int, _Block]]] = {}  # pool -> sorted _Block.entry()
        self._live: dict[object, _Block] = {}
        self._segments: list[_Segment] = []
        self._grown: dict[tuple[int, bool], _Segment] = {}
        self._unmapped: dict[tuple[int, bool], list[_Block]] = {}  # pool -> its unmapped blocks (none at the end)
        self._bases = itertools.count(1 << 40, 1 << 40)  # each segment has an address range of its own

    # --- the free lists ------------------------------------------------------------------------------------
    def _insert(self, block: _Block) -> None:
        bisect.insort(self._free.setdefault(block.segment.pool, []), block.entry())

    def _remove(self, block: _Block) -> None:
        entries = self._free[block.segment.pool]
        entries.pop(bisect.bisect_left(entries, block.entry()))

    def _best_fit(self, pool: tuple[int, bool], size: int) -> Optional[_Block]:
        entries = self._free.get(pool, [])
        i = bisect.bisect_left(entries, (size, -1))
        if i == len(entries):
            return None
        if self.expandable:  # get_free_block: the next larger block while it can grow to less
            while i + 1 < len(entries) and _reach(entries[i + 1][2]) < _reach(entries[i][2]):
                i += 1
        return entries[i][2]

    # --- segments ------------------------------------------------------------------------------------------
    def _reserve(self, nbytes: int) -> bool:
        """Whether `nbytes` more can be reserved, releasing cached memory first if the capacity requires it."""
        if self.capacity is None or self.reserved + nbytes <= self.capacity:
            return True
        self.retries += 1
        self._release()
        return self.reserved + nbytes <= self.capacity

    def _release(self) -> None:
        """release_cached_blocks: every unsplit free segment (default), or every whole free page (expandable)."""
        if self.expandable:  # unmap the whole pages inside every free block (release_cached_blocks)
            for pool, entries in self._free.items():
                page = _page(pool)
                for *_, block in list(entries):
                    start, end = math.ceil(block.offset / page) * page, (block.offset + block.size) // page * page
                    if end > start:
                        self._unmap(block, start, end)
            return
        for segment in [s for s in self._segments if s.head.free and s.head.next is None]:  # release_blocks
            self._remove(segment.head)
            self._segments.remove(segment)
            self.reserved -= segment.size

    def _unmap(self, block: _Block, start: int, end: int) -> None:
        """Unmap [start, end) (whole pages) of a free block; the mapped rest either side stays free blocks."""
        self._remove(block)
        segment = block.segment
        if start > block.offset:
            self._insert(self._split(block, start - block.offset, before=True))
        if end < block.offset + block.size:
            self._insert(self._split(block, end - block.offset))
        block.mapped = False
        segment.size -= end - start
        self.reserved -= end - start
        for neighbour in (block.prev, block.next):
            if neighbour is not None and not neighbour.mapped:
                self._unmapped[segment.pool].remove(neighbour)
                block = self._merge(neighbour, block) if neighbour is block.prev else self._merge(block, neighbour)
        if block.next is None:  # unmapped at the end: the segment's address range past its last block
            if block.prev is None:
                segment.head = None
            else:
                block.prev.next = None
        else:
            self._unmapped.setdefault(segment.pool, []).append(block)

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
        """Map pages of the pool's expandable segment until a run of free blocks holds `size`: one free block."""
        segment = self._grown.get(pool)
        if segment is None:
            segment = self._grown[pool] = _Segment(next(self._bases), 0, pool)
            self._segments.append(segment)
        first = self._candidate(segment, size)
        needed = self._mapping(pool, first, size)
        if self.capacity is not None and self.reserved + needed > self.capacity:
            self.retries += 1
            self._release()
            first = self._candidate(segment, size)  # the release unmapped free pages: look again
            needed = self._mapping(pool, first, size)
            if self.reserved + needed > self.capacity:
                self.ooms += 1
        page, run, total, block = _page(pool), [], 0, first
        while total < size:
            if block is None or not block.mapped:  # map pages at its start (or at the segment's end)
                mapped = page * math.ceil((size - total) / page)
                if block is None:
                    tail = run[-1] if run else segment.head and segment.tail
                    block = _Block(segment, tail.offset + tail.size if tail else 0, mapped, prev=tail)
                    if tail is None:
                        segment.head = block
                    else:
                        tail.next = block
                else:
                    self._unmapped[pool].remove(block)
                    if mapped < block.size:
                        self._unmapped[pool].append(self._split(block, mapped, mapped=False))
                    block.mapped = True
                segment.size += block.size
                self.reserved += block.size
            else:
                self._remove(block)
            run.append(block)
            total += block.size
            block = block.next
        if block is not None and block.free and block.mapped:  # map_block merges a free block after the pages
            self._remove(block)
            run.append(block)
        merged = run[0]
        for block in run[1:]:
            merged = self._merge(merged, block)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return merged

    def _candidate(self, segment: _Segment, size: int) -> Optional[_Block]:
        """Where `size` is mapped (find_expandable_block): the first block of a run of free and unmapped blocks
        that spans it, from the lowest unmapped block (or the free one before it); None: the segment's end."""
        for unmapped in sorted(self._unmapped.get(segment.pool, ()), key=lambda b: b.offset):
            block = first = unmapped.prev if unmapped.prev is not None and unmapped.prev.free else unmapped
            total = 0
            while total < size and block is not None and block.free:
                total += block.size
                block = block.next
            if total >= size or block is None:  # (past the last block: the unmapped end)
                return first
        tail = segment.head and segment.tail
        return tail if tail is not None and tail.free else None

    @staticmethod
    def _mapping(pool: tuple[int, bool], first: Optional[_Block], size: int) -> int:
        """Bytes `_grow` maps for `size` from `first`."""
        page, total, needed, block = _page(pool), 0, 0, first
        while total < size:
            if block is None or not block.mapped:
                mapped = page * math.ceil((size - total) / page)
                if block is not None:
                    mapped = min(mapped, block.size)
                needed += mapped
                total += mapped
            else:
                total += block.size
            block = block and block.next
        return needed

    @staticmethod
    def _split(block: _Block, size: int, before: bool = False, mapped: bool = True) -> _Block:
        """Cut `block` after its first `size` bytes; the new block is the first part if `before`, else the rest."""
        segment = block.segment
        if before:
            part = _Block(segment, block.offset, size, prev=block.prev, next=block, mapped=mapped)
            if block.prev is None:
                segment.head = part
            else:
                block.prev.next = part
            block.prev, block.offset, block.size = part, block.offset + size, block.size - size
        else:
            part = _Block(segment, block.offset + size, block.size - size, prev=block, next=block.next, mapped=mapped)
            if block.next is not None:
                block.next.prev = part
            block.next, block.size = part, size
        return part

    @staticmethod
    def _merge(first: _Block, second: _Block) -> _Block:
        """`second` (which follows `first`) joins `first`."""
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        return first

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
            self._insert(self._split(block, size))
        block.free = False
        self._live[key] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key) -> None:
        block = self._live.pop(key)
        self.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free and neighbour.mapped:  # not with unmapped pages
                self._remove(neighbour)
                block = self._merge(neighbour, block) if neighbour is block.prev else self._merge(block, neighbour)
        if block.prev is None:
            block.segment.head = block
        self._insert(block)

    def empty_cache(self) -> None:
        """Release every unsplit free segment (torch.cuda.empty_cache)."""
        self._release()


def _page(pool: tuple[int, bool]) -> int:
    return SMALL_BUFFER if pool[1] else LARGE_BUFFER


def _reach(block: _Block) -> float:
    """What a free block of an expandable segment can grow to: itself and the unmapped block after it; at the
    segment's end, the unmapped rest of its address range (1 1/8 the device's memory: more than any block)."""
    if block.next is None:
        return math.inf
    return block.size + (0 if block.next.mapped else block.next.size)
