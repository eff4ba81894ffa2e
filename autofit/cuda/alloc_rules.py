"""The caching allocator's sizes, shared by both replays (``allocator.py``, ``expandable.py``): constants and rules
from ``c10/cuda/CUDACachingAllocator.cpp``, each named after the C++ it mirrors."""

from __future__ import annotations

__all__ = ["MIN_BLOCK", "SMALL_SIZE", "SMALL_BUFFER", "LARGE_BUFFER", "MIN_LARGE_ALLOC", "ROUND_LARGE",
           "SEGMENT_GRAIN", "round_size", "segment_size", "AllocatorOutOfMemory"]

MIN_BLOCK = 512  # kMinBlockSize
SMALL_SIZE = 1 << 20  # kSmallSize
SMALL_BUFFER = 2 << 20  # kSmallBuffer
LARGE_BUFFER = 20 << 20  # kLargeBuffer
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge
# Every segment is a multiple of this (kSmallBuffer, kLargeBuffer and kRoundLarge are), so reserved bytes are too,
# and a cap only matters in these steps.
SEGMENT_GRAIN = 2 << 20


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


class AllocatorOutOfMemory(Exception):
    """A segment the allocator needs does not fit under the cap even after freeing cached segments."""
