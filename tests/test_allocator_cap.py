"""The caching allocator under a cap on reserved bytes (Note [allocating under a cap] in autofit/cuda/allocator.py).

Source of the rules: c10/cuda/CUDACachingAllocator.cpp, ``DeviceCachingAllocator::malloc``:
    alloc_block(params) || (release_available_cached_blocks(params) && alloc_block(params))
                        || (release_cached_blocks() && alloc_block(params, true))
``release_available_cached_blocks`` returns false unless max_split_size is set; ``release_cached_blocks`` ->
``release_blocks`` frees the free blocks with ``!prev && !next`` (whole segments), large pool then small. Every
expected number below is worked out by hand from those rules and the segment sizes of ``get_allocation_size``.
"""

from __future__ import annotations

import random

import pytest

from autofit.core.categories import Category
from autofit.cuda.allocator import (
    SEGMENT_GRAIN,
    AllocatorOutOfMemory,
    CachingAllocator,
    replay_allocator,
    smallest_cap,
)
from autofit.simulate.timeline import Phase, StorageRecord, Timeline

MiB = 1 << 20


def _timeline(steps: list[tuple[str, str, int]]) -> Timeline:
    """("alloc", name, bytes) / ("free", name, 0) steps as a timeline."""
    t, ids = Timeline(), {}
    for kind, name, nbytes in steps:
        if kind == "alloc":
            ids[name] = t.new_storage(StorageRecord(nbytes=nbytes, category=Category.ACTIVATIONS, op=-1, module="",
                                                    phase=Phase.FORWARD))
        else:
            t.free(ids[name])
    return t


# A 12 MiB tensor is freed, then a 14 MiB one is needed: the cached 12 MiB segment is too small, so unconstrained
# the allocator opens a 14 MiB segment and reserves 26 MiB while only 14 MiB are ever allocated at once.
CACHED = [("alloc", "a", 12 * MiB), ("free", "a", 0), ("alloc", "b", 14 * MiB)]

# A 4 MiB tensor lives in a 20 MiB segment (kLargeBuffer; the 16 MiB rest is split off), then an 18 MiB one needs
# its own 18 MiB segment. The 16 MiB rest is free but its segment is pinned by the live 4 MiB block, so no release
# returns it: 22 MiB allocated, 38 MiB reserved, whatever the cap.
PINNED = [("alloc", "a", 4 * MiB), ("alloc", "b", 18 * MiB)]


def test_unconstrained_replays_keep_cached_segments():
    free = replay_allocator(_timeline(CACHED))
    assert (free.peak_allocated, free.peak_reserved, free.fits, free.released) == (14 * MiB, 26 * MiB, True, 0)
    pinned = replay_allocator(_timeline(PINNED))
    assert (pinned.peak_allocated, pinned.peak_reserved) == (22 * MiB, 38 * MiB)


def test_under_a_cap_below_the_reserved_peak_the_cached_segment_is_freed_and_the_step_runs():
    # cap 14 MiB: cudaMalloc(14 MiB) fails (12 + 14 > 14); release_available does nothing (no max_split_size);
    # release_cached frees the whole, free 12 MiB segment; the retry fits exactly.
    capped = replay_allocator(_timeline(CACHED), cap_bytes=14 * MiB)
    assert (capped.fits, capped.released) == (True, 1)
    assert (capped.peak_allocated, capped.peak_reserved) == (14 * MiB, 14 * MiB)
    # 14 MiB - 512 bytes: even with nothing cached the 14 MiB segment does not fit
    assert not replay_allocator(_timeline(CACHED), cap_bytes=14 * MiB - 512).fits


def test_under_a_cap_below_allocated_plus_pinned_fragmentation_the_step_fails():
    assert replay_allocator(_timeline(PINNED), cap_bytes=38 * MiB).fits
    for cap in (22 * MiB, 36 * MiB, 38 * MiB - 512):  # the allocated peak; the grain below 22 + 16 MiB
        capped = replay_allocator(_timeline(PINNED), cap_bytes=cap)
        assert (capped.fits, capped.released) == (False, 0), cap


def test_smallest_cap_by_hand():
    assert smallest_cap(_timeline(CACHED))[0] == 14 * MiB
    assert smallest_cap(_timeline(PINNED))[0] == 38 * MiB
    # the cuBLAS workspace (8,519,680 bytes: a 20 MiB segment, 11.875 MiB split off) then the CACHED steps: the
    # 12 MiB tensor does not fit the 11.875 MiB rest (a 12 MiB segment), the 14 MiB one needs its own. Under a cap
    # the freed 12 MiB segment goes back; the workspace's segment stays (pinned): 20 + 14 MiB.
    cap, free = smallest_cap(_timeline(CACHED), persistent=(8_519_680,))
    assert (free.peak_reserved, cap) == (46 * MiB, 34 * MiB)


def test_release_available_frees_one_large_enough_oversize_block_first():
    # max_split_size 40 MiB. A 1000-byte tensor (a 2 MiB small segment) and a 100 MiB one are freed; a 60 MiB
    # request may not take the cached 100 MiB block (oversize, and >= 60 + kLargeBuffer): cudaMalloc(60 MiB) under
    # 150 MiB fails (2 + 100 + 60). release_available_cached_blocks finds the 100 MiB block (>= max(60, 40) MiB) and
    # frees only it, so the small segment stays: 62 MiB reserved.
    a = CachingAllocator(cap_bytes=150 * MiB, max_split_size=40 * MiB)
    a.free(a.malloc(1000))
    a.free(a.malloc(100 * MiB))
    a.malloc(60 * MiB)
    assert (a.reserved, a.released) == (62 * MiB, 1)
    # without max_split_size the 100 MiB block is taken (split: 60 MiB + 40 MiB rest), nothing new is reserved
    b = CachingAllocator(cap_bytes=150 * MiB)
    b.free(b.malloc(1000))
    b.free(b.malloc(100 * MiB))
    b.malloc(60 * MiB)
    assert (b.reserved, b.released) == (102 * MiB, 0)


def test_release_available_frees_oversize_blocks_from_the_largest_until_enough():
    # max_split_size 40 MiB. S (4 MiB: 20 MiB segment, split) stays; X (50 MiB) and Y (60 MiB) are oversize
    # segments, freed; W (30 MiB, under max_split_size) may not take the 50 MiB block, so it opens a 30 MiB
    # segment, freed: 160 MiB reserved. Z (70 MiB) fits no cached block; cudaMalloc under 180 MiB fails (230).
    # release_available: no block >= 70 MiB; from the largest: Y (60, not enough), X (110 >= 70): stop. W's 30 MiB
    # segment stays cached (release_cached_blocks, which would free it, is not reached): 20 + 30 + 70 = 120 MiB.
    a = CachingAllocator(cap_bytes=180 * MiB, max_split_size=40 * MiB)
    a.malloc(4 * MiB)
    for size in (50 * MiB, 60 * MiB, 30 * MiB):
        a.free(a.malloc(size))
    assert a.reserved == 160 * MiB
    a.malloc(70 * MiB)
    assert (a.reserved, a.released) == (120 * MiB, 2)


def test_release_cached_follows_when_release_available_frees_too_little():
    # max_split_size 40 MiB; X (50 MiB) and W (30 MiB) freed, S (4 MiB) live: 100 MiB reserved. Z (70 MiB) under
    # 130 MiB: cudaMalloc fails (170); release_available frees X (50 < 70: false); release_cached frees W; the retry
    # fits: 20 + 70 = 90 MiB.
    a = CachingAllocator(cap_bytes=130 * MiB, max_split_size=40 * MiB)
    a.malloc(4 * MiB)
    for size in (50 * MiB, 30 * MiB):
        a.free(a.malloc(size))
    a.malloc(70 * MiB)
    assert (a.reserved, a.released) == (90 * MiB, 2)
    with pytest.raises(AllocatorOutOfMemory):  # 90 + 42 > 130 MiB; the free 16 MiB rest is split: nothing to free
        a.malloc(42 * MiB)
    assert (a.reserved, a.released) == (90 * MiB, 2)


def _random_steps(rng: random.Random, n: int) -> list[tuple[str, str, int]]:
    sizes = [rng.choice([rng.randint(1, 1 << 20), rng.randint(1 << 20, 10 << 20), rng.randint(10 << 20, 80 << 20)])
             for _ in range(n)]
    steps, live = [], []
    for i, size in enumerate(sizes):
        steps.append(("alloc", str(i), size))
        live.append(str(i))
        while live and rng.random() < 0.5:
            steps.append(("free", live.pop(rng.randrange(len(live))), 0))
    return steps


# Running under a cap is not monotone in the cap. 43 MiB (a 44 MiB segment) freed, 47 MiB (48) freed, then 24 MiB,
# 21 MiB and 1000 bytes live together. Under 92 MiB both segments stay cached: 24 MiB splits the 44 MiB one (the
# smallest that fits), 21 MiB the 48 MiB one, both are pinned, and the 2 MiB small segment finds no room and nothing
# to free. Under 90 MiB the 48 MiB segment did not fit beside the cached 44 MiB one, which was freed: 24 and 21 MiB
# both go into the 48 MiB segment and the small one fits (50 MiB). Under 94 MiB (the unconstrained peak) all fit.
NON_MONOTONE = [("alloc", "a", 43 * MiB), ("free", "a", 0), ("alloc", "b", 47 * MiB), ("free", "b", 0),
                ("alloc", "c", 24 * MiB), ("alloc", "d", 21 * MiB), ("alloc", "e", 1000)]


def test_running_under_a_cap_is_not_monotone_in_the_cap():
    t = _timeline(NON_MONOTONE)
    runs = {c: replay_allocator(t, cap_bytes=c * MiB).fits for c in (46, 48, 50, 90, 92, 94)}
    assert runs == {46: False, 48: False, 50: True, 90: True, 92: False, 94: True}
    assert replay_allocator(t).peak_reserved == 94 * MiB
    # bisection (46 fails: below the 45 MiB + 512 live peak's grain; 94 runs) goes 68, 56, 50, 46, 48: 50 MiB
    assert smallest_cap(t)[0] == 50 * MiB


@pytest.mark.parametrize("max_split_size", [None, 40 * MiB])
def test_bisection_returns_a_cap_that_runs_with_the_grain_below_failing(max_split_size):
    """Note [the smallest cap] over random sequences: the cap bisection returns runs and the one a grain below fails;
    every cap from the unconstrained reserved peak up runs, every cap below the live blocks' peak fails."""
    rng = random.Random(30)
    for _ in range(60):
        steps = _random_steps(rng, rng.randint(3, 14))
        timeline = _timeline(steps)
        free = replay_allocator(timeline, max_split_size=max_split_size)
        cap, _ = smallest_cap(timeline, max_split_size=max_split_size)
        runs = lambda c: replay_allocator(timeline, cap_bytes=c, max_split_size=max_split_size).fits  # noqa: E731
        assert cap % SEGMENT_GRAIN == 0 and runs(cap) and not runs(cap - SEGMENT_GRAIN)
        assert runs(free.peak_reserved) and runs(free.peak_reserved + 7 * SEGMENT_GRAIN)
        sizes, live, peak = {}, 0, 0  # the bytes live at once: reserved >= allocated >= that, under any cap
        for kind, name, nbytes in steps:
            sizes.setdefault(name, nbytes)
            live += nbytes if kind == "alloc" else -sizes[name]
            peak = max(peak, live)
        assert peak <= cap and not runs(peak - 1)
