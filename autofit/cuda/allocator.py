"""A replay of the CUDA caching allocator over a simulated timeline.

Constants and rules from ``c10/cuda/CUDACachingAllocator.cpp`` (default settings: no ``max_split_size_mb``, no
``roundup_power2_divisions``, no ``expandable_segments``):
- every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``; ``round_size``);
- requests up to 1 MiB (``kSmallSize``) come from the small pool, larger ones from the large pool;
- a new segment (``cudaMalloc``) is 2 MiB for small requests (``kSmallBuffer``), 20 MiB for requests under 10 MiB
  (``kLargeBuffer``, ``kMinLargeAlloc``), else the request rounded up to 2 MiB (``kRoundLarge``;
  ``get_allocation_size``);
- a request takes the smallest free block of its pool that fits (best fit, lowest address on ties;
  ``get_free_block``), and the block is split when the rest is at least 512 bytes (small pool) or more than 1 MiB
  (large pool; ``should_split``);
- a freed block merges with free neighbours of its segment (``try_merge_blocks``); segments are never returned to
  the driver during a step (no ``empty_cache``).
``allocated`` counts the rounded blocks in use, as ``torch.cuda.memory_allocated`` does; ``reserved`` the
segments, as ``torch.cuda.memory_reserved`` does.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from autofit.simulate.timeline import EventKind, Timeline

__all__ = ["round_size", "segment_size", "CachingAllocator", "AllocatorReplay", "replay_allocator", "MIN_BLOCK",
           "SMALL_SIZE"]

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize
SMALL_BUFFER = 2 << 20  # kSmallBuffer
LARGE_BUFFER = 20 << 20  # kLargeBuffer
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge


def round_size(size: int) -> int:
    if size < MIN_BLOCK:
        return MIN_BLOCK
    return MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)


def segment_size(size: int) -> int:
    if size <= SMALL_SIZE:
        return SMALL_BUFFER
    if size < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return ROUND_LARGE * ((size + ROUND_LARGE - 1) // ROUND_LARGE)


@dataclass(eq=False)
class _Block:
    segment: int
    offset: int
    size: int
    free: bool
    small: bool  # which pool the block's segment belongs to
    prev: _Block | None = None
    next: _Block | None = None


class CachingAllocator:
    """Blocks and segments of one device, one stream."""

    def __init__(self) -> None:
        self.free_blocks: dict[bool, list[tuple[int, int, int, int]]] = {True: [], False: []}  # small? -> sorted
        self.blocks: dict[tuple[int, int], _Block] = {}
        self.segments = 0
        self.allocated = 0
        self.reserved = 0

    @staticmethod
    def _key(block: _Block) -> tuple[int, int, int, int]:
        return (block.size, block.segment, block.offset, id(block))

    def _remove_free(self, small: bool, block: _Block) -> None:
        pool = self.free_blocks[small]
        i = bisect.bisect_left(pool, self._key(block))
        if i < len(pool) and pool[i] == self._key(block):
            pool.pop(i)

    def malloc(self, nbytes: int) -> _Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self.free_blocks[small]
        i = bisect.bisect_left(pool, (size, -1, -1, -1))
        if i < len(pool):
            _, seg, off, _ = pool.pop(i)
            block = self.blocks[(seg, off)]
        else:
            alloc = segment_size(size)
            block = _Block(self.segments, 0, alloc, True, small)
            self.blocks[(block.segment, 0)] = block
            self.segments += 1
            self.reserved += alloc
        remaining = block.size - size
        if (small and remaining >= MIN_BLOCK) or (not small and remaining > SMALL_SIZE):
            rest = _Block(block.segment, block.offset + size, remaining, True, small, prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self.blocks[(rest.segment, rest.offset)] = rest
            bisect.insort(pool, self._key(rest))
        block.free = False
        self.allocated += block.size
        return block

    def free(self, block: _Block) -> None:
        small = block.small
        self.allocated -= block.size
        block.free = True
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove_free(small, neighbour)
                block = self._merge(block, neighbour)
        bisect.insort(self.free_blocks[small], self._key(block))

    def _merge(self, a: _Block, b: _Block) -> _Block:
        first, second = (a, b) if a.offset < b.offset else (b, a)
        del self.blocks[(second.segment, second.offset)]
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        return first


@dataclass(frozen=True)
class AllocatorReplay:
    peak_allocated: int  # comparable with torch.cuda.max_memory_allocated
    peak_reserved: int  # comparable with torch.cuda.max_memory_reserved
    raw_at_peak: int  # unrounded bytes live at the allocated peak (peak_allocated - raw: rounding)


def replay_allocator(timeline: Timeline, *, persistent: tuple[int, ...] = ()) -> AllocatorReplay:
    """Run the timeline's allocations through the caching allocator. ``persistent`` are allocations made before
    the step that live through it (the cuBLAS workspace); they count as allocated and reserved."""
    allocator = CachingAllocator()
    for nbytes in persistent:
        allocator.malloc(nbytes)
    blocks: dict[int, _Block] = {}
    raw = sum(persistent)
    peak_allocated, peak_reserved, raw_at_peak = allocator.allocated, allocator.reserved, raw
    for kind, value in timeline.events:
        if kind is EventKind.ALLOC:
            nbytes = timeline.storages[value].nbytes
            if nbytes <= 0:
                continue
            blocks[value] = allocator.malloc(nbytes)
            raw += nbytes
            if allocator.allocated > peak_allocated:
                peak_allocated, raw_at_peak = allocator.allocated, raw
            peak_reserved = max(peak_reserved, allocator.reserved)
        elif kind is EventKind.FREE:
            block = blocks.pop(value, None)
            if block is not None:
                allocator.free(block)
                raw -= timeline.storages[value].nbytes
    return AllocatorReplay(peak_allocated, peak_reserved, raw_at_peak)
