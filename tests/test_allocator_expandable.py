"""The caching allocator with ``expandable_segments:True`` (Note [expandable segments] in autofit/cuda/expandable.py).

Every expected number is worked out by hand from ``c10/cuda/CUDACachingAllocator.cpp``: pages of 20 MiB in the large
pool and 2 MiB in the small one (``find_expandable_block``'s ``segment_size``), ``map_block`` rounding the bytes it
maps up to pages, ``should_split`` splitting any block with 512 bytes to spare, and ``release_blocks`` ->
``unmap_block`` giving back the whole pages inside each free block when a map fails under the cap.
"""

from __future__ import annotations

import random

import pytest

from autofit.cuda.allocator import SEGMENT_GRAIN, AllocatorOutOfMemory, replay_allocator, smallest_cap
from autofit.cuda.expandable import ExpandableAllocator
from tests.test_allocator_cap import CACHED, PINNED, MiB, _timeline


def test_pages_are_mapped_as_the_segment_grows():
    # map_block maps min(unmapped size, request) rounded up to a 20 MiB page; the rest of the page stays a free
    # mapped block at the segment's end, and the next request is carved from it (should_split: >= 512 bytes left)
    a = ExpandableAllocator()
    a.malloc(4 * MiB)
    assert (a.allocated, a.reserved) == (4 * MiB, 20 * MiB)
    a.malloc(18 * MiB)  # 16 MiB free at the end + 2 MiB more: one more page, merged with the free tail
    assert (a.allocated, a.reserved) == (22 * MiB, 40 * MiB)
    # small pool: its own segment with 2 MiB pages
    a.malloc(1000)
    assert (a.allocated, a.reserved) == (22 * MiB + 1024, 42 * MiB)


def test_a_freed_block_is_reused_and_the_segment_grows_only_by_the_shortfall():
    # CACHED: 12 MiB freed, then 14 MiB: the free 20 MiB page holds it (12 merged back with the 8 MiB rest), so
    # one page in all; plain segments reserve 26 MiB for the same steps (tests/test_allocator_cap.py)
    free = replay_allocator(_timeline(CACHED), expandable=True)
    assert (free.peak_allocated, free.peak_reserved, free.fits) == (14 * MiB, 20 * MiB, True)
    # PINNED: 4 + 18 MiB fit two pages (40 MiB) where plain segments pin 38 MiB (a 20 MiB and an 18 MiB segment)
    pinned = replay_allocator(_timeline(PINNED), expandable=True)
    assert (pinned.peak_allocated, pinned.peak_reserved) == (22 * MiB, 40 * MiB)


def test_a_hole_between_live_blocks_gives_its_pages_back_under_a_cap():
    # a 40 MiB block sits between two 20 MiB ones (pages 0, 1-2, 3); it is freed; a 60 MiB request does not fit the
    # 40 MiB hole, so map_block needs three more pages: 80 + 60 = 140 MiB mapped. Under a cap of 100 MiB the map
    # fails, release_blocks unmaps the hole's two whole pages (80 -> 40 MiB mapped), and find_expandable_block still
    # takes the segment's end (the hole is 40 MiB of address space, too short): 40 + 60 = 100 MiB, it fits.
    steps = [("alloc", "a", 20 * MiB), ("alloc", "b", 40 * MiB), ("alloc", "c", 20 * MiB), ("free", "b", 0),
             ("alloc", "d", 60 * MiB)]
    assert replay_allocator(_timeline(steps), expandable=True).peak_reserved == 140 * MiB
    capped = replay_allocator(_timeline(steps), expandable=True, cap_bytes=100 * MiB)
    assert (capped.fits, capped.released, capped.peak_allocated, capped.peak_reserved) == (True, 1, 100 * MiB,
                                                                                          100 * MiB)
    # plain segments: a (20), b (40), c (20) are three segments; freeing b frees it whole under the cap, and 60 MiB
    # fits next to a and c: 100 MiB as well. A cap of 98 MiB fails both ways (100 MiB are live)
    assert replay_allocator(_timeline(steps), cap_bytes=100 * MiB).fits
    assert not replay_allocator(_timeline(steps), expandable=True, cap_bytes=98 * MiB).fits


def test_unmapped_pages_are_mapped_again_at_the_lowest_address_that_holds_the_request():
    # x (20 MiB, page 0) and b (40 MiB, pages 1-2: 60 MiB mapped, no free tail); b is freed. A 50 MiB request under a
    # cap of 80 MiB: no free block holds it; alloc_block's fraction check refuses (60 + get_allocation_size = 50 ->
    # 110 > 80); release_blocks unmaps b's two pages, which merge with the unmapped rest of the segment (20 MiB
    # mapped); the retry passes the check (20 + 50 <= 80) and find_expandable_block's lowest unmapped block starts
    # at 20 MiB: three pages mapped there, 80 MiB in all, and the block lands where b was.
    a = ExpandableAllocator(cap_bytes=80 * MiB)
    a.malloc(20 * MiB)
    a.free(a.malloc(40 * MiB))
    d = a.malloc(50 * MiB)
    assert (d.offset, a.allocated, a.reserved, a.released) == (20 * MiB, 70 * MiB, 80 * MiB, 1)
    # a cap of 60 MiB: after the release the check still refuses (20 + 50 > 60): out of memory, as cudaMalloc would be
    b = ExpandableAllocator(cap_bytes=60 * MiB)
    b.malloc(20 * MiB)
    b.free(b.malloc(40 * MiB))
    with pytest.raises(AllocatorOutOfMemory):
        b.malloc(50 * MiB)


def test_where_plain_segments_stay_pinned_expandable_ones_unmap_the_free_pages():
    # A 4 MiB block keeps a plain 20 MiB segment (its 16 MiB rest split off and free) and an 18 MiB one needs a new
    # segment: 38 MiB whatever the cap (PINNED). Expandable: 40 MiB unconstrained, and under a cap of 24 MiB the second
    # map (reserved 20 + segment_size(18 MiB) = 38 > 24) fails, release_blocks finds no whole page inside the free
    # 16 MiB rest (offset 4 MiB to 20 MiB: page 0 is partly live), so it runs out of memory too; but freeing the
    # 4 MiB block first (PINNED without it) leaves one free page that unmaps.
    assert not replay_allocator(_timeline(PINNED), cap_bytes=24 * MiB).fits
    assert not replay_allocator(_timeline(PINNED), expandable=True, cap_bytes=24 * MiB).fits
    steps = [("alloc", "a", 4 * MiB), ("alloc", "big", 30 * MiB), ("free", "big", 0), ("alloc", "b", 18 * MiB)]
    # unconstrained: a (page 0), big 30 MiB: 16 MiB free tail + 14 -> one more page (40 MiB mapped); big freed, b
    # takes 18 of the 36 MiB free run: 40 MiB. The plain allocator: a in a 20 MiB segment, big in a 30 MiB one, b
    # reuses big's segment (split: 12 MiB rest > 1 MiB): 50 MiB reserved.
    assert replay_allocator(_timeline(steps), expandable=True).peak_reserved == 40 * MiB
    assert replay_allocator(_timeline(steps)).peak_reserved == 50 * MiB


def test_the_smallest_cap_is_a_cap_the_replay_runs_under_and_a_grain_less_fails():
    # random sequences: under the bisected cap the replay runs, a grain below it fails, and it is never below the
    # live peak. It may lie above the unconstrained mapped peak: alloc_block's fraction check asks for a whole
    # get_allocation_size where map_block would map less (Note [expandable segments])
    rng = random.Random(0)
    for _ in range(40):
        live, steps = [], []
        for i in range(30):
            if live and rng.random() < 0.4:
                steps.append(("free", live.pop(rng.randrange(len(live))), 0))
            else:
                name = f"t{i}"
                steps.append(("alloc", name, rng.choice([300_000, 3 * MiB, 12 * MiB, 45 * MiB])))
                live.append(name)
        t = _timeline(steps)
        cap, free = smallest_cap(t, expandable=True)
        assert replay_allocator(t, expandable=True, cap_bytes=cap).fits
        assert not replay_allocator(t, expandable=True, cap_bytes=cap - SEGMENT_GRAIN).fits
        assert cap >= free.peak_allocated


def test_each_stream_maps_pages_of_its_own_segment():
    # get_free_block takes a free block only on the request's stream, and find_expandable_block searches the
    # unmapped blocks of that stream's segments only (a new ExpandableSegment(device, stream, ...) otherwise): a
    # 16 MiB block freed on the default stream leaves its 20 MiB page mapped there, and a 16 MiB request on a side
    # stream (FSDP2's reduce-scatter) maps a page of its own: 40 MiB reserved where one shared segment holds 20
    a = ExpandableAllocator()
    a.free(a.malloc(16 * MiB))
    side = a.malloc(16 * MiB, stream=1)
    assert (a.allocated, a.reserved) == (16 * MiB, 40 * MiB)
    # freed, the side stream's page goes back to that stream only: the default stream reuses its own page
    a.free(side)
    a.malloc(18 * MiB)
    assert (a.allocated, a.reserved) == (18 * MiB, 40 * MiB)
    # under a cap that a third page would pass, the failed map releases every stream's free pages (release_blocks
    # walks the whole pool) and maps again: the side stream's page is given back, so 20 more MiB fit in 60
    b = ExpandableAllocator(cap_bytes=40 * MiB)
    b.free(b.malloc(16 * MiB, stream=1))
    b.malloc(18 * MiB)
    b.malloc(18 * MiB)  # 2 MiB left in the default page + 20 MiB more: over 40 with the side page, fits without it
    assert (b.allocated, b.reserved, b.released) == (36 * MiB, 40 * MiB, 1)
