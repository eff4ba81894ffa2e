"""Rows per micro-batch at shorter lengths: the plan's table for variable-length batches.

See Note [rows by length] and, for what "length" means, Note [the length of a batch] in autofit/training/length.py.

Note [rows by length]
    The planner chooses its configuration at the sample's length ``L`` (the longest batch). A batch of length
    ``l < L`` holds fewer bytes per row, so more rows fit in one micro-batch and the batch runs in fewer of them.
    After the winner is chosen, the table gives the rows per micro-batch at ``L/2``, ``L/4`` and ``L/8``, with the
    same precision and recomputed modules, each checked by a full estimate against the budget:
    - at a fixed row count the peak does not grow as the length falls (every activation, input and attention
      matrix is at most as long), so the rows found at a longer length are a floor for every shorter one;
    - the first guess is ``rows(L) * L / l`` (activations linear in length, as with flash or memory-efficient
      attention), capped at the batch; when it misses, the floor is estimated too and the next try is where the
      line through the two meets the budget (at a fixed length the peak is close to linear in the rows), four full
      estimates at most, and the floor when those find nothing larger (with a single row count between floor and
      guess, that one is estimated directly: the floor's estimate would only aim the line at it). A quadratic
      (math) attention path only makes the shorter batch cheaper than the guess assumes, so the guess stays on the
      safe side of the real peak: each entry is what a simulation showed, never extrapolated.
    A batch of length ``l`` takes the entry of the smallest tabulated length ``>= l``, so it never runs more rows
    than were shown to fit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

__all__ = ["DIVISORS", "table_lengths", "rows_by_length", "first_guesses", "rows_for_length"]

DIVISORS = (2, 4, 8)  # the table's lengths: L/2, L/4, L/8 (and L itself)
_TRIES = 4  # full estimates per length at most


def table_lengths(length: int) -> tuple[int, ...]:
    """The lengths the table holds, longest first: L, then ceil(L/2), ceil(L/4), ceil(L/8) (distinct)."""
    return tuple(dict.fromkeys([length, *(math.ceil(length / d) for d in DIVISORS)]))


def rows_by_length(length: int, micro_batch_size: int, batch_rows: int, budget: int,
                   peak: Callable[[int, int], int],
                   peaks: Callable[[list[tuple[int, int]]], list[int]] | None = None,
                   known: Mapping[tuple[int, int], int] | None = None) -> tuple[tuple[int, int], ...]:
    """``((l, rows), ...)`` longest first, from ``(L, micro_batch_size)``; ``peak(l, rows)`` is the device bytes of
    a full estimate, checked against ``budget`` (See Note [rows by length]). ``peaks``, if given, estimates several
    ``(l, rows)`` at once (side by side, Note [parallel simulations]): it is asked for every length's first guess
    up front, each of which the table needs whatever the others show (see ``first_guesses``). ``known`` holds
    estimates already made, ``(l, rows) -> bytes`` (Note [rows beside the verification], autofit/solve/finish.py)."""
    known = dict(known or {})
    guesses = [g for g in first_guesses(length, micro_batch_size, batch_rows) if g not in known]
    if peaks is not None and len(guesses) > 1:
        known.update(zip(guesses, peaks(guesses)))

    def cached(short: int, rows: int) -> int:
        if (short, rows) not in known:
            known[(short, rows)] = peak(short, rows)
        return known[(short, rows)]

    table = [(length, micro_batch_size)]
    for short in table_lengths(length)[1:]:
        floor = table[-1][1]  # fits at a longer length, so here too
        guess = min(batch_rows, micro_batch_size * length // short)
        table.append((short, _largest_fitting(short, floor, guess, budget, cached)))
    return tuple(table)


def first_guesses(length: int, micro_batch_size: int, batch_rows: int) -> list[tuple[int, int]]:
    """The ``(l, rows)`` the table estimates first at each shorter length: every guess larger than the one before.
    Each is needed: the floor at a length is the rows found at the longer one, at most that length's guess, so a
    guess above the previous guess is above the floor, and ``_largest_fitting`` estimates it first."""
    out, previous = [], micro_batch_size
    for short in table_lengths(length)[1:]:
        guess = min(batch_rows, micro_batch_size * length // short)
        if guess > previous:
            out.append((short, guess))
        previous = guess
    return out


def _largest_fitting(length: int, floor: int, guess: int, budget: int, peak: Callable[[int, int], int]) -> int:
    """The largest rows in ``[floor, guess]`` an estimate shows to fit, with at most ``_TRIES`` estimates: the guess,
    then the floor, then where the line through the last two estimates meets the budget (the peak is close to
    linear in the rows at a fixed length), until one fits. With one row count between floor and guess, that one
    is estimated at once; with none, nothing more (the floor fits: it fitted at a longer length)."""
    if guess <= floor:
        return floor
    over = (guess, peak(length, guess))
    if over[1] <= budget:
        return guess
    if guess - floor <= 2:  # at most one row count between: the floor's estimate would only aim the line at it
        return floor + 1 if guess - floor == 2 and peak(length, floor + 1) <= budget else floor
    below = (floor, peak(length, floor))
    for _ in range(_TRIES - 2):
        if below[1] > budget or over[0] - below[0] <= 1:
            break
        slope = (over[1] - below[1]) / (over[0] - below[0])
        rows = min(over[0] - 1, below[0] + int((budget - below[1]) / slope))
        if rows <= below[0]:
            break
        point = (rows, peak(length, rows))
        if point[1] <= budget:
            below = point
        else:
            over = point
    return below[0] if below[1] <= budget else floor


def rows_for_length(table: tuple[tuple[int, int], ...], length: int) -> int:
    """The rows of the smallest tabulated length ``>= length`` (the table is longest first)."""
    rows = table[0][1]
    for tabulated, r in table:
        if tabulated >= length:
            rows = r
    return rows
