"""A replay of the CUDA caching allocator over a simulated timeline.

Constants and rules from ``c10/cuda/CUDACachingAllocator.cpp`` (default settings: no ``max_split_size_mb``, no
``roundup_power2_divisions``, no ``expandable_segments``, whose rules ``expandable.py`` replays; the sizes live in
``alloc_rules.py``):
- every request is rounded up to a multiple of 512 bytes (``kMinBlockSize``; ``round_size``);
- requests up to 1 MiB (``kSmallSize``) come from the small pool, larger ones from the large pool;
- a new segment (``cudaMalloc``) is 2 MiB for small requests (``kSmallBuffer``), 20 MiB for requests under 10 MiB
  (``kLargeBuffer``, ``kMinLargeAlloc``), else the request rounded up to 2 MiB (``kRoundLarge``;
  ``get_allocation_size``);
- a request takes the smallest free block of its pool that fits (best fit, lowest address on ties;
  ``get_free_block``), and the block is split when the rest is at least 512 bytes (small pool) or more than 1 MiB
  (large pool; ``should_split``);
- a freed block merges with free neighbours of its segment (``try_merge_blocks``); segments are never returned to
  the driver during a step (no ``empty_cache``) unless a ``cudaMalloc`` fails: see Note [allocating under a cap].
``allocated`` counts the rounded blocks in use, as ``torch.cuda.memory_allocated`` does; ``reserved`` the
segments, as ``torch.cuda.memory_reserved`` does.

``max_split_size`` (``PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:N``; None is the default, unlimited) changes three
rules: a request under it never takes a free block of at least that size, a request of at least that size takes a
free block only when less than ``kLargeBuffer`` bigger (``get_free_block``), and a large block is split only for a
request under it (``should_split``).

Note [allocating under a cap]
    When no cached block fits, ``DeviceCachingAllocator::malloc`` asks the driver for a segment (``alloc_block``);
    if that fails it frees cached segments and asks again before raising OutOfMemoryError:
        alloc_block(params)
        || (release_available_cached_blocks(params) && alloc_block(params))
        || (release_cached_blocks() && alloc_block(params, isRetry=true))
    ``release_available_cached_blocks`` does nothing unless ``max_split_size`` is set; then it frees the smallest
    free block of at least max(request, max_split_size) in the request's pool, or, when there is none, free blocks
    of at least max_split_size from the largest down until that many bytes are freed (returning false, with what it
    freed gone, when it cannot). ``release_cached_blocks`` frees every free block that is a whole segment (not
    split: ``!prev && !next``) of the large pool, then of the small one. A segment a live block sits in is never
    freed. Under a cap of ``cap_bytes`` on what is reserved (a GPU with that much memory for the allocator, or
    ``torch.cuda.set_per_process_memory_fraction``: ``total_allocated_memory + size > allowed_memory_maximum``) a
    step whose unconstrained reserved peak is above the cap can still run: it fails only where the blocks in use and
    the segments they pin leave no room for the next segment even after both releases.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from autofit.cuda.alloc_rules import (LARGE_BUFFER, MIN_BLOCK, SEGMENT_GRAIN, SMALL_SIZE, AllocatorOutOfMemory,
                                      round_size, segment_size)
from autofit.cuda.expandable import ExpandableAllocator
from autofit.simulate.timeline import EventKind, Timeline

__all__ = ["round_size", "segment_size", "CachingAllocator", "AllocatorReplay", "AllocatorOutOfMemory",
           "replay_allocator", "smallest_cap", "MIN_BLOCK", "SMALL_SIZE", "SEGMENT_GRAIN"]

@dataclass(eq=False)
class _Block:
    segment: int
    offset: int
    size: int
    free: bool
    small: bool  # which pool the block's segment belongs to
    stream: int = 0  # the stream whose allocation made its segment (Note [one pool per stream])
    prev: _Block | None = None
    next: _Block | None = None


class CachingAllocator:
    """Blocks and segments of one device, its free blocks kept apart per stream (Note [one pool per stream]).
    ``cap_bytes``: the most the allocator may reserve (None: no limit); ``max_split_size``:
    ``PYTORCH_CUDA_ALLOC_CONF``'s max_split_size in bytes (None: unlimited).

    Note [one pool per stream]
        A free block is reused only by a request on the stream that allocated its segment: the pools order their
        blocks by (stream, size, address) and ``get_free_block`` takes a block only when its stream is the
        request's (c10/cuda/CUDACachingAllocator.cpp, ``BlockComparatorSize``, ``get_free_block``). FSDP2 allocates
        on its own streams (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py: the all-gather buffers inside
        ``all_gather_copy_in_stream``, the reduce-scatter input, output and the new gradient shards inside
        ``reduce_scatter_stream``), so their segments are reserved apart from the default stream's. The simulation
        runs FSDP2's CPU path, whose ``torch.cpu.stream`` contexts it reads at each allocation
        (``StorageRecord.stream``); here each stream has its own free lists. ``release_cached_blocks`` frees whole
        free segments of every stream. Not modelled: ``record_stream`` (a block freed while another stream still
        uses it waits for that stream's events): each free is taken as complete."""

    def __init__(self, *, cap_bytes: int | None = None, max_split_size: int | None = None) -> None:
        # (small?, stream) -> free blocks sorted by size, segment, offset
        self.free_blocks: dict[tuple[bool, int], list[tuple[int, int, int, int]]] = {}
        self.blocks: dict[tuple[int, int], _Block] = {}
        self.segments = 0
        self.allocated = 0
        self.reserved = 0
        self.cap_bytes = cap_bytes
        self.max_split_size = max_split_size
        self.released = 0  # segments freed to make room (Note [allocating under a cap])

    @staticmethod
    def _key(block: _Block) -> tuple[int, int, int, int]:
        return (block.size, block.segment, block.offset, id(block))

    def _pool(self, small: bool, stream: int) -> list[tuple[int, int, int, int]]:
        return self.free_blocks.setdefault((small, stream), [])

    def _remove_free(self, small: bool, block: _Block) -> None:
        pool = self._pool(small, block.stream)
        i = bisect.bisect_left(pool, self._key(block))
        if i < len(pool) and pool[i] == self._key(block):
            pool.pop(i)

    def _oversize(self, size: int) -> bool:
        return self.max_split_size is not None and size >= self.max_split_size

    def _free_block(self, size: int, small: bool, stream: int) -> _Block | None:
        """``get_free_block``: the smallest free block of the pool on ``stream`` that fits, within the max_split_size
        rules."""
        pool = self._pool(small, stream)
        i = bisect.bisect_left(pool, (size, -1, -1, -1))
        if i == len(pool):
            return None
        found = pool[i][0]
        if not self._oversize(size) and self._oversize(found):  # no oversized block for a smaller request
            return None
        if self._oversize(size) and found >= size + LARGE_BUFFER:  # oversized: rounded up only so far
            return None
        _, seg, off, _ = pool.pop(i)
        return self.blocks[(seg, off)]

    def _cuda_malloc(self, alloc: int) -> bool:
        """``alloc_block``: the driver gives a segment while the cap allows it."""
        return self.cap_bytes is None or self.reserved + alloc <= self.cap_bytes

    def _release(self, small: bool, block: _Block) -> int:
        """``release_block``: return a free whole segment to the driver."""
        assert block.prev is None and block.next is None, "only whole segments are freed"
        self._remove_free(small, block)
        del self.blocks[(block.segment, block.offset)]
        self.reserved -= block.size
        self.released += 1
        return block.size

    def _release_available(self, size: int, small: bool, stream: int) -> bool:
        """``release_available_cached_blocks`` (Note [allocating under a cap]), among the request's stream's blocks."""
        if self.max_split_size is None:
            return False
        pool = self._pool(small, stream)
        key = max(size, self.max_split_size)
        i = bisect.bisect_left(pool, (key, -1, -1, -1))
        if i < len(pool):
            _, seg, off, _ = pool[i]
            self._release(small, self.blocks[(seg, off)])
            return True
        released = 0
        while released < key and pool and pool[-1][0] >= self.max_split_size:  # the largest first
            _, seg, off, _ = pool[-1]
            released += self._release(small, self.blocks[(seg, off)])
        return released >= key

    def _release_cached(self) -> bool:
        """``release_cached_blocks``: every free block that is a whole segment, large pool first."""
        for (small, _), pool in sorted(self.free_blocks.items(), key=lambda item: item[0][0]):  # stable: by stream
            for _, seg, off, _ in list(pool):
                block = self.blocks[(seg, off)]
                if block.prev is None and block.next is None:
                    self._release(small, block)
        return True

    def malloc(self, nbytes: int, stream: int = 0) -> _Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        block = self._free_block(size, small, stream)
        if block is None:
            alloc = segment_size(size)
            if not (self._cuda_malloc(alloc)
                    or (self._release_available(size, small, stream) and self._cuda_malloc(alloc))
                    or (self._release_cached() and self._cuda_malloc(alloc))):
                raise AllocatorOutOfMemory(f"{alloc} bytes more do not fit under {self.cap_bytes} with "
                                           f"{self.allocated} allocated and {self.reserved} reserved")
            block = _Block(self.segments, 0, alloc, True, small, stream)
            self.blocks[(block.segment, 0)] = block
            self.segments += 1
            self.reserved += alloc
        remaining = block.size - size
        if (small and remaining >= MIN_BLOCK) or (not small and not self._oversize(size) and remaining > SMALL_SIZE):
            rest = _Block(block.segment, block.offset + size, remaining, True, small, block.stream, prev=block,
                          next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self.blocks[(rest.segment, rest.offset)] = rest
            bisect.insort(self._pool(small, rest.stream), self._key(rest))
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
        bisect.insort(self._pool(small, block.stream), self._key(block))

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
    fits: bool = True  # False: under the cap, a segment did not fit even after freeing cached ones (the step OOMs)
    released: int = 0  # segments freed under the cap to make room (Note [allocating under a cap])


def replay_allocator(timeline: Timeline, *, persistent: tuple[int, ...] = (), cap_bytes: int | None = None,
                     max_split_size: int | None = None, expandable: bool = False) -> AllocatorReplay:
    """Run the timeline's allocations through the caching allocator. ``persistent`` are allocations made before
    the step that live through it (the cuBLAS workspace); they count as allocated and reserved. ``cap_bytes``: the
    most the allocator may reserve; a replay that needs more, after freeing what it can, stops there with
    ``fits=False`` and the peaks it had reached (Note [allocating under a cap]). ``expandable``: with
    ``expandable_segments:True`` (Note [expandable segments], expandable.py; ``max_split_size`` does not apply)."""
    allocator = (ExpandableAllocator(cap_bytes=cap_bytes) if expandable
                 else CachingAllocator(cap_bytes=cap_bytes, max_split_size=max_split_size))
    blocks: dict[int, _Block] = {}
    raw = sum(persistent)
    try:
        for nbytes in persistent:
            allocator.malloc(nbytes)
    except AllocatorOutOfMemory:
        return AllocatorReplay(allocator.allocated, allocator.reserved, 0, fits=False)
    peak_allocated, peak_reserved, raw_at_peak = allocator.allocated, allocator.reserved, raw
    for kind, value in timeline.events:
        if kind is EventKind.ALLOC:
            record = timeline.storages[value]
            nbytes = record.nbytes
            if nbytes <= 0:
                continue
            try:
                blocks[value] = allocator.malloc(nbytes, record.stream)
            except AllocatorOutOfMemory:
                return AllocatorReplay(peak_allocated, peak_reserved, raw_at_peak, False, allocator.released)
            raw += nbytes
            if allocator.allocated > peak_allocated:
                peak_allocated, raw_at_peak = allocator.allocated, raw
            peak_reserved = max(peak_reserved, allocator.reserved)
        elif kind is EventKind.FREE:
            block = blocks.pop(value, None)
            if block is not None:
                allocator.free(block)
                raw -= timeline.storages[value].nbytes
    if timeline.carried:  # Note [the next step's allocator]
        return _next_step(timeline, allocator, blocks, raw, AllocatorReplay(
            peak_allocated, peak_reserved, raw_at_peak, True, allocator.released))
    return AllocatorReplay(peak_allocated, peak_reserved, raw_at_peak, True, allocator.released)


# Note [the next step's allocator]
#     A step that frees the previous step's gradients only at its own start or after its forward (Note [where
#     zero_grad falls], autofit/training/step.py) runs its forward beside gradients the previous backward allocated,
#     where the caching allocator found room then: between that backward's activations, not in segments of their
#     own made before the step (where the simulation registers them). Segments holding a gradient cannot be freed
#     or reused whole, so the forward's activations need more reserved memory than a fresh start suggests. The
#     replay therefore runs the step a second time on the allocator as the first run left it: the parameters and
#     states stay where they are; each gradient the first run left (``Timeline.carried``) stands for the previous
#     step's and is freed where the step frees that one; what else the first run left alive (the loss, the outputs
#     the step's end drops) is freed before it. The figures are the larger of the two runs (a run's peaks are over
#     all its steps). Measured against rasbt/pytorch-memory-optim's published Fabric runs of vit_l_16 (which clear
#     after the forward): docs/published.md.
def _next_step(timeline: Timeline, allocator: Any, left: dict[int, _Block], raw: int,
               first: AllocatorReplay) -> AllocatorReplay:
    carried = timeline.carried
    following = set(carried.values())
    for sid in [s for s in left if s not in following and timeline.storages[s].op >= 0]:
        allocator.free(left.pop(sid))  # the end of the step: what it left besides the gradients
        raw -= timeline.storages[sid].nbytes
    previous = {old: left.pop(new) for old, new in carried.items() if new in left}
    peak_allocated, peak_reserved, raw_at_peak = first.peak_allocated, first.peak_reserved, first.raw_at_peak
    blocks: dict[int, _Block] = {}
    for kind, value in timeline.events:
        if kind is EventKind.ALLOC:
            record = timeline.storages[value]
            if record.nbytes <= 0 or value in left or value in carried:
                continue  # resident since the first run, or the previous step's gradient: already placed
            try:
                blocks[value] = allocator.malloc(record.nbytes, record.stream)
            except AllocatorOutOfMemory:
                return AllocatorReplay(peak_allocated, peak_reserved, raw_at_peak, False, allocator.released)
            raw += record.nbytes
            if allocator.allocated > peak_allocated:
                peak_allocated, raw_at_peak = allocator.allocated, raw
            peak_reserved = max(peak_reserved, allocator.reserved)
        elif kind is EventKind.FREE:
            block = next((b for b in (blocks.pop(value, None), previous.pop(value, None), left.pop(value, None))
                          if b is not None), None)
            if block is not None:
                allocator.free(block)
                raw -= timeline.storages[value].nbytes
    return AllocatorReplay(peak_allocated, peak_reserved, raw_at_peak, True, allocator.released)


# Note [the smallest cap]
#     The smallest cap a step runs under lies between the peak of its live blocks rounded to 512 bytes (every cap
#     below it fails: reserved >= allocated >= that sum, whatever the history) and the unconstrained reserved peak
#     (under that cap no cudaMalloc fails, so the replay is the unconstrained one). Reserved bytes are multiples of
#     SEGMENT_GRAIN, so only caps in those steps differ. Running under a cap is NOT monotone in the cap: a larger
#     cap frees cached segments later, and the blocks placed meanwhile may split and pin more of them
#     (tests/test_allocator_cap.py has a 5-step sequence that runs under 50 and 90 MiB, not under 92, and again
#     under 94; random sequences show it in about 1 in 100). So the bisection's answer is a cap the replay ran under
#     with the grain below failing, the smallest one in the common case, not a promise for every larger cap: a
#     verdict at a budget replays under that budget (``cap_bytes``) instead of comparing with this.
def smallest_cap(timeline: Timeline, *, persistent: tuple[int, ...] = (), max_split_size: int | None = None,
                 expandable: bool = False) -> tuple[int, AllocatorReplay]:
    """The smallest cap on reserved bytes (a multiple of SEGMENT_GRAIN) the step runs under, and the unconstrained
    replay (Note [the smallest cap]); ``expandable``: with expandable segments (mapped bytes are multiples of the
    grain too)."""
    kw = dict(persistent=persistent, max_split_size=max_split_size, expandable=expandable)
    free = replay_allocator(timeline, **kw)
    fails = _rounded_live_peak(timeline, persistent)
    fails = -(-fails // SEGMENT_GRAIN) * SEGMENT_GRAIN - SEGMENT_GRAIN  # the largest grain step below that peak
    runs, step = free.peak_reserved, SEGMENT_GRAIN
    # with expandable segments the fraction check asks for a whole allocation size where mapping needs less, so the
    # unconstrained peak may not run (Note [expandable segments]): widen until a cap does
    while expandable and not replay_allocator(timeline, cap_bytes=runs, **kw).fits:
        fails, runs, step = runs, runs + step, step * 2
    while runs - fails > SEGMENT_GRAIN:
        mid = fails + (runs - fails) // SEGMENT_GRAIN // 2 * SEGMENT_GRAIN
        if replay_allocator(timeline, cap_bytes=mid, **kw).fits:
            runs = mid
        else:
            fails = mid
    return runs, free


def _rounded_live_peak(timeline: Timeline, persistent: tuple[int, ...]) -> int:
    live = peak = sum(round_size(n) for n in persistent)
    alive: set[int] = set()
    for kind, value in timeline.events:
        if kind is EventKind.ALLOC and timeline.storages[value].nbytes > 0:
            alive.add(value)
            live += round_size(timeline.storages[value].nbytes)
            peak = max(peak, live)
        elif kind is EventKind.FREE and value in alive:
            alive.remove(value)
            live -= round_size(timeline.storages[value].nbytes)
    return peak
