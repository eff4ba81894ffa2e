"""The checkpoint MILP's rows built by intervals (Note [coefficients by intervals], autofit/solve/memory_model.py)
against the brute force they replace: every coefficient the same integer, the same pairs, the same window peaks."""

from __future__ import annotations

import numpy as np

from autofit.solve.memory_model import contained_sums, nested_pairs, window_max


def _dense(lo, hi, terms, n_units):
    out = np.zeros((len(lo), n_units), dtype=np.int64)
    for a, b, unit, value in terms:
        for r in range(len(lo)):
            for e in range(len(a)):
                if lo[r] >= a[e] and hi[r] <= b[e]:
                    out[r, unit[e]] += value[e]
    return out


def test_interval_sums_equal_the_brute_force_on_random_rows() -> None:
    rng = np.random.default_rng(0)
    for trial in range(200):
        n_units, terms = int(rng.integers(1, 6)), []
        for _ in range(int(rng.integers(1, 4))):
            n_edits = int(rng.integers(0, 30))
            a = rng.integers(0, 50, n_edits)
            b = a + rng.integers(-3, 30, n_edits)  # some intervals empty (b < a)
            terms.append((a, b, rng.integers(0, n_units, n_edits), rng.integers(-(1 << 40), 1 << 40, n_edits)))
        if trial % 3 == 0:  # the recompute instants: one event each, in any order
            lo = rng.integers(0, 60, int(rng.integers(0, 20)))
            hi = lo + 1
        elif trial % 3 == 1:  # consecutive stretches of a window, as the MILP cuts it
            cuts = np.unique(rng.integers(0, 80, int(rng.integers(2, 25))))
            lo, hi = cuts[:-1], cuts[1:]
        else:  # rows whose end falls in the order of their starts: the dense path
            lo = rng.integers(0, 60, int(rng.integers(0, 20)))
            hi = lo + rng.integers(0, 20, len(lo))
        got = contained_sums(lo, hi, terms, n_units)
        assert got.dtype == np.int64
        assert np.array_equal(got, _dense(lo, hi, terms, n_units))


def test_window_peaks_and_nested_pairs_by_brute_force() -> None:
    rng = np.random.default_rng(1)
    live = rng.integers(-100, 100, 40)
    cuts = np.unique(rng.integers(0, 41, 12))
    lo, hi = cuts[:-1], cuts[1:]
    assert list(window_max(live, lo, hi)) == [live[x:y].max() for x, y in zip(lo, hi)]
    names = ("a", "a.b", "a.b.c", "ab", "a.b", "", ".x", "ab.c", "a.bc")
    expected = tuple((i, j) for i, x in enumerate(names) for j, y in enumerate(names)
                     if i != j and y.startswith(x + "."))
    assert nested_pairs(names) == expected
