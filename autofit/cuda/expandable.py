"""The caching allocator with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, replayed over a timeline.

Rules from ``c10/cuda/CUDACachingAllocator.cpp`` (``ExpandableSegment`` and the ``DeviceCachingAllocator`` functions
named below); see Note [expandable segments].

Note [expandable segments]
    Instead of one ``cudaMalloc`` per segment, each pool (small, large) of each stream reserves one range of virtual
    addresses (``ExpandableSegment``: 1.125 x the card's memory, far more than any cap, so modelled as unbounded)
    and maps physical pages into it on demand (``cuMemCreate`` + ``cuMemMap``). A page is ``kSmallBuffer`` (2 MiB)
    in the small pool and ``kLargeBuffer`` (20 MiB) in the large one (``find_expandable_block``: ``segment_size``).
    - A request is rounded to 512 bytes and takes a pool as without the setting (``round_size``, ``get_pool``).
    - ``get_free_block``: the smallest free mapped block that fits, except that a block followed by unmapped address
      space counts as the size it could grow to, so the search moves on to larger blocks whose such size is
      smaller (the growing end of the segment is used last).
    - ``should_split``: any block is split when at least 512 bytes remain, in both pools (no 1 MiB rule).
    - ``alloc_block`` when no free block fits: under ``set_per_process_memory_fraction`` it first refuses when
      ``total_allocated_memory + get_allocation_size(size)`` exceeds the cap; then ``try_allocate_expandable_block``:
      ``find_expandable_block`` takes the lowest-address unmapped block whose run of free (mapped or unmapped)
      blocks, starting from a free mapped block just before it, holds the request, and ``map_block`` maps pages
      from it (the unmapped block's first ``min(its size, request)`` bytes rounded up to pages; again for the next
      unmapped block while the run is short), merging them with the free neighbours. A map fails when the pages do
      not fit (here: mapped bytes plus them over the cap). Both checks are applied: the replay's cap stands for a
      card with that much memory or for the fraction, and is right (or early by less than a page) for both.
    - ``reserved`` (``memory_reserved``, ``total_allocated_memory``) counts the mapped pages.
    - When that fails, ``release_cached_blocks`` -> ``release_blocks``: every free mapped block of the large pool,
      then the small one, is unmapped where it covers whole pages (``unmap_block``, ``ExpandableSegment::unmap``:
      the pages entirely inside it; the partial pages at its ends stay mapped as free blocks), and the request is
      tried once more. So unlike plain segments, a free hole between live blocks gives its pages back, and the next
      ``find_expandable_block`` can map them again: what a cap must hold is close to the pages the live blocks
      touch, not the segments they pin.
    - Streams stay apart, as without the setting (Note [one pool per stream], allocator.py): ``get_free_block``
      takes a free block only on the request's stream, and ``find_expandable_block`` looks only at the unmapped
      blocks of that stream's segments, making a new ``ExpandableSegment(device, stream, ...)`` for a stream that
      has none. So the pages a side stream mapped (FSDP2's all-gather and reduce-scatter buffers) stay mapped to it,
      and the default stream's activations cannot use them, nor it theirs, until a failed map releases every
      stream's free pages. ``reserved`` is then the sum of what each stream's segment grew to: for Llama 3 8B under
      FSDP2 over 8 ranks, the all-gather copy-in stream maps up to 2.4 GiB (the root unit's gathered parameters and
      a block's) and the reduce-scatter stream 3.7 GiB (its output, of which every fp32 gradient shard is a view),
      which one shared segment found among the pages freed activations leave (docs/published.md, torchao's float8
      table).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from autofit.cuda.alloc_rules import (LARGE_BUFFER, MIN_BLOCK, SMALL_BUFFER, SMALL_SIZE, AllocatorOutOfMemory,
                                      round_size, segment_size)

__all__ = ["ExpandableAllocator", "PAGE_SMALL", "PAGE_LARGE"]

PAGE_SMALL = SMALL_BUFFER  # the small pool's page
PAGE_LARGE = LARGE_BUFFER  # the large pool's page
_VIRTUAL = 1 << 62  # the reserved address range: unbounded for the replay


@dataclass(eq=False)
class _Block:
    offset: int
    size: int
    small: bool
    stream: int = 0
    free: bool = True
    mapped: bool = False
    prev: _Block | None = None
    next: _Block | None = None


class ExpandableAllocator:
    """One expandable segment per pool and stream; the interface of ``CachingAllocator`` (allocator.py)."""

    def __init__(self, *, cap_bytes: int | None = None) -> None:
        self.cap_bytes = cap_bytes
        self.allocated = 0
        self.reserved = 0
        self.released = 0  # unmap_block calls that gave pages back under the cap
        # (small?, stream) -> free mapped blocks as (size, offset, id), and unmapped ones as (offset, id)
        self._free: dict[tuple[bool, int], list[tuple[int, int, int]]] = {}
        self._unmapped: dict[tuple[bool, int], list[tuple[int, int]]] = {}
        self._by_id: dict[int, _Block] = {}

    def _segment(self, small: bool, stream: int) -> tuple[bool, int]:
        """The pool's segment on ``stream``, reserved (all of it unmapped) at the stream's first request."""
        key = (small, stream)
        if key not in self._unmapped:
            self._free[key], self._unmapped[key] = [], []
            self._add_unmapped(_Block(0, _VIRTUAL, small, stream))
        return key

    # ---- the pools' sorted sets -------------------------------------------------------------------------------------
    def _add_free(self, b: _Block) -> None:
        self._by_id[id(b)] = b
        bisect.insort(self._free[b.small, b.stream], (b.size, b.offset, id(b)))

    def _drop_free(self, b: _Block) -> None:
        pool, key = self._free[b.small, b.stream], (b.size, b.offset, id(b))
        i = bisect.bisect_left(pool, key)
        assert pool[i] == key
        pool.pop(i)

    def _add_unmapped(self, b: _Block) -> None:
        self._by_id[id(b)] = b
        bisect.insort(self._unmapped[b.small, b.stream], (b.offset, id(b)))

    def _drop_unmapped(self, b: _Block) -> None:
        pool, key = self._unmapped[b.small, b.stream], (b.offset, id(b))
        i = bisect.bisect_left(pool, key)
        assert pool[i] == key
        pool.pop(i)

    @staticmethod
    def _page(small: bool) -> int:
        return PAGE_SMALL if small else PAGE_LARGE

    # ---- DeviceCachingAllocator ------------------------------------------------------------------------------------
    def _free_block(self, size: int, key: tuple[bool, int]) -> _Block | None:
        """``get_free_block`` with expandable segments: best fit on the stream, the growing end counted at the size it
        can reach."""
        pool = self._free[key]
        i = bisect.bisect_left(pool, (size, -1, -1))
        if i == len(pool):
            return None

        def expandable(j: int) -> int:
            b = self._by_id[pool[j][2]]
            return b.size + (b.next.size if b.next is not None and not b.next.mapped else 0)

        while i + 1 < len(pool) and expandable(i + 1) < expandable(i):
            i += 1
        b = self._by_id[pool.pop(i)[2]]
        return b

    def _merge(self, dst: _Block, src: _Block | None) -> None:
        """``try_merge_blocks``: ``src`` joins ``dst`` when free and mapped alike."""
        if src is None or not src.free or src.mapped != dst.mapped:
            return
        (self._drop_free if src.mapped else self._drop_unmapped)(src)
        del self._by_id[id(src)]
        if dst.prev is src:
            dst.offset, dst.prev = src.offset, src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        dst.size += src.size

    def _map_block(self, b: _Block, size: int) -> _Block | None:
        """``map_block``: map pages for ``size`` bytes at the start of unmapped ``b``; the mapped free block, merged
        with its free neighbours, or None when the pages do not fit under the cap."""
        page = self._page(b.small)
        mapped = -(-size // page) * page
        if self.cap_bytes is not None and self.reserved + mapped > self.cap_bytes:
            return None
        self._drop_unmapped(b)
        b.mapped = True
        if mapped < b.size:
            rest = _Block(b.offset + mapped, b.size - mapped, b.small, b.stream, prev=b, next=b.next)
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = mapped
            self._add_unmapped(rest)
        self._merge(b, b.prev)
        self._merge(b, b.next)
        self._add_free(b)
        self.reserved += mapped
        return b

    def _find_expandable(self, size: int, key: tuple[bool, int]) -> _Block:
        """``find_expandable_block``: the lowest-address unmapped block of the stream's segment (from a free mapped
        block before it) whose run of free blocks holds ``size``."""
        for _, ident in self._unmapped[key]:
            c = self._by_id[ident]
            if c.prev is not None and c.prev.free:
                c = c.prev
            run, cur = 0, c
            while run < size and cur is not None and cur.free:
                run, cur = run + cur.size, cur.next
            if run >= size:
                return c
        raise AssertionError("the unbounded tail always holds the request")

    def _try_expandable(self, size: int, key: tuple[bool, int]) -> _Block | None:
        """``alloc_block`` -> ``try_allocate_expandable_block``."""
        if self.cap_bytes is not None and self.reserved + segment_size(size) > self.cap_bytes:
            return None  # set_fraction: total_allocated_memory + alloc_size > allowed_memory_maximum
        c = self._find_expandable(size, key)
        if not c.mapped:
            c = self._map_block(c, min(c.size, size))
            if c is None:
                return None
        while c.size < size:  # free -> unmapped -> ...: map the rest and merge
            c = self._map_block(c.next, min(size - c.size, c.next.size))
            if c is None:
                return None
        self._drop_free(c)
        return c

    def _unmap_block(self, b: _Block) -> None:
        """``unmap_block``: give back the whole pages inside free mapped ``b``."""
        page = self._page(b.small)
        start, end = -(-b.offset // page) * page, (b.offset + b.size) // page * page
        if end <= start:
            return
        self._drop_free(b)
        if start > b.offset:
            before = _Block(b.offset, start - b.offset, b.small, b.stream, mapped=True, prev=b.prev, next=b)
            if b.prev is not None:
                b.prev.next = before
            b.prev = before
            self._add_free(before)
        if b.offset + b.size > end:
            after = _Block(end, b.offset + b.size - end, b.small, b.stream, mapped=True, prev=b, next=b.next)
            if b.next is not None:
                b.next.prev = after
            b.next = after
            self._add_free(after)
        b.offset, b.size, b.mapped = start, end - start, False
        self._merge(b, b.prev)
        self._merge(b, b.next)
        self._add_unmapped(b)
        self.reserved -= end - start
        self.released += 1

    def _release_cached(self) -> None:
        """``release_cached_blocks`` -> ``release_blocks``: unmap every free mapped block of every stream, large pool
        first."""
        for key in sorted(self._free):  # (small?, stream): the large pool's streams, then the small pool's
            for _, _, ident in list(self._free[key]):
                self._unmap_block(self._by_id[ident])

    def malloc(self, nbytes: int, stream: int = 0) -> _Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        key = self._segment(small, stream)
        block = self._free_block(size, key)
        if block is None:
            block = self._try_expandable(size, key)
            if block is None:
                self._release_cached()  # release_available_cached_blocks: nothing without max_split_size
                block = self._try_expandable(size, key)
            if block is None:
                raise AllocatorOutOfMemory(f"{size} bytes more do not fit under {self.cap_bytes} with "
                                           f"{self.allocated} allocated and {self.reserved} mapped")
        if block.size - size >= MIN_BLOCK:  # should_split: expandable segments split any block
            rest = _Block(block.offset + size, block.size - size, small, stream, mapped=True, prev=block,
                          next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            self._add_free(rest)
        block.free = False
        self.allocated += block.size
        return block

    def free(self, block: _Block) -> None:
        """``free_block``: merge with free mapped neighbours, back to the pool."""
        self.allocated -= block.size
        block.free = True
        self._merge(block, block.prev)
        self._merge(block, block.next)
        self._add_free(block)
