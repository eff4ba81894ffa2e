"""Solver tests on hand-made cost tables (the first level of tests: no model, the solver alone): the checkpoint MILP, the micro-batch
options and the memory/time front, with no model and no simulation behind them.

A ``CheckpointProblem`` says: stretch i of the step holds ``base[i] + sum_u coef[i, u] x[u]`` bytes, where
``x[u] = 1`` when unit u is recomputed; the peak is the maximum over stretches. The tables below are small enough
that every answer is computed by hand in the comments.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from autofit.solve.checkpoint_milp import (
    CheckpointProblem,
    brute_force_checkpoint,
    most_freeing_checkpoint,
    level_checkpoint,
    solve_checkpoint,
)
from autofit.solve.candidate import Candidate, batch_options
from autofit.solve.search import pareto_front


def _problem(costs, base, coef, exclusive=()) -> CheckpointProblem:
    names = tuple(f"unit{i}" for i in range(len(costs)))
    return CheckpointProblem(names, np.asarray(costs, dtype=float), np.asarray(base, dtype=float),
                             np.asarray(coef, dtype=float).reshape(len(base), len(costs)), tuple(exclusive))


# Two units. Stretch 0 (the end of a's forward) drops 30 when a is recomputed; stretch 1 drops 40 when b is;
# stretch 2 is the optimizer stage, which checkpointing cannot touch.
#   peak({})     = max(100, 90, 50) = 100
#   peak({a})    = max( 70, 90, 50) =  90      cost 1
#   peak({b})    = max(100, 50, 50) = 100      cost 2  (never useful alone)
#   peak({a, b}) = max( 70, 50, 50) =  70      cost 3
# So: budget >= 100 -> {}; 90 <= budget < 100 -> {a}; 70 <= budget < 90 -> {a, b}; budget < 70 -> infeasible.
TWO_UNITS = dict(costs=[1.0, 2.0], base=[100, 90, 50], coef=[[-30, 0], [0, -40], [0, 0]])


@pytest.mark.parametrize(("budget", "expected"), [
    (1000, ()), (100, ()),  # slack: the plain peak fits, nothing is recomputed
    (99, (0,)), (90, (0,)),  # first threshold at 100: the cheap unit alone
    (89, (0, 1)), (70, (0, 1)),  # second threshold at 90: both units
    (69, None), (0, None),  # below 70 nothing fits
])
def test_budget_thresholds_computed_by_hand(budget: int, expected) -> None:
    problem = _problem(**TWO_UNITS)
    chosen = solve_checkpoint(problem, budget)
    assert chosen == expected
    assert brute_force_checkpoint(problem, budget) == expected
    if chosen is not None:
        assert problem.peak(chosen) <= budget


def test_slack_budget_gives_empty_set_even_when_recomputing_is_free() -> None:
    # a zero-cost unit that would lower the peak is still not chosen when the plain peak already fits
    problem = _problem(costs=[0.0], base=[100, 40], coef=[[-60], [0]])
    assert solve_checkpoint(problem, 100) == ()
    assert solve_checkpoint(problem, 10**9) == ()


def test_cheaper_set_wins_over_more_freeing_one() -> None:
    # a: cost 1, drops 25; b: cost 5, drops 60. Budget 80: both fit alone (75 / 40), the cheaper one wins;
    # budget 74: only b fits (a reaches 75).
    problem = _problem(costs=[1.0, 5.0], base=[100, 30], coef=[[-25, -60], [0, 0]])
    assert solve_checkpoint(problem, 80) == (0,)
    assert solve_checkpoint(problem, 75) == (0,)
    assert solve_checkpoint(problem, 74) == (1,)
    assert most_freeing_checkpoint(problem) == (0, 1)  # peak max(15, 30) = 30 (no exclusivity here)


def test_positive_coefficients_can_make_recomputing_useless() -> None:
    # Recomputing a drops 30 from stretch 0 but its RNG stash and recompute spike add 40 to stretch 1:
    #   peak({}) = max(100, 80) = 100; peak({a}) = max(70, 120) = 120.
    problem = _problem(costs=[1.0], base=[100, 80], coef=[[-30], [40]])
    assert solve_checkpoint(problem, 99) is None  # {a} would need 120
    assert brute_force_checkpoint(problem, 99) is None
    assert solve_checkpoint(problem, 100) == ()
    assert most_freeing_checkpoint(problem) == ()  # nothing lowers the peak


def test_infeasible_returns_none_not_a_sentinel() -> None:
    # the optimizer stage (stretch 1) alone is above the budget: no set of recomputed modules can help
    problem = _problem(costs=[1.0, 2.0], base=[100, 95], coef=[[-50, -40], [0, 0]])
    assert solve_checkpoint(problem, 94) is None
    assert brute_force_checkpoint(problem, 94) is None
    assert solve_checkpoint(problem, 95) == (0,)


def test_no_units() -> None:
    problem = CheckpointProblem((), np.zeros(0), np.array([100.0, 50.0]), np.zeros((2, 0)))
    assert solve_checkpoint(problem, 100) == ()
    assert solve_checkpoint(problem, 99) is None
    assert most_freeing_checkpoint(problem) == ()


def test_nesting_exclusivity_is_respected() -> None:
    # "block" (0) contains "block.fc" (1): they may not both be recomputed. Without that rule budget 40 would be
    # reached by recomputing both (100 - 30 - 30); with it the best is one of them (peak 70).
    problem = _problem(costs=[2.0, 1.0], base=[100], coef=[[-30, -30]], exclusive=[(0, 1)])
    assert solve_checkpoint(problem, 40) is None
    assert brute_force_checkpoint(problem, 40) is None
    assert solve_checkpoint(problem, 70) == (1,)  # the cheaper of the two
    freeing = most_freeing_checkpoint(problem)
    assert problem.allowed(freeing) and problem.peak(freeing) == 70
    # the same table without the nesting pair does reach 40
    free = _problem(costs=[2.0, 1.0], base=[100], coef=[[-30, -30]])
    assert solve_checkpoint(free, 40) == (0, 1)


def test_exclusivity_forces_a_more_expensive_choice() -> None:
    # parent (0) drops 50 for cost 10; child (1) drops 20 for cost 1; sibling (2) drops 30 for cost 1.
    # Budget 50 needs 50 bytes off: child+sibling = 50 for cost 2 is allowed; parent alone = 50 for cost 10.
    # Budget 30 needs 70 off: parent+sibling (80 off, cost 11) -- parent+child (70 off, cost 11) is excluded, and
    # child+sibling only frees 50. Budget 20 still fits parent+sibling; budget 19 would need all three (excluded).
    problem = _problem(costs=[10.0, 1.0, 1.0], base=[100], coef=[[-50, -20, -30]], exclusive=[(0, 1)])
    assert solve_checkpoint(problem, 50) == (1, 2)
    assert solve_checkpoint(problem, 30) == (0, 2)
    assert solve_checkpoint(problem, 20) == (0, 2)
    assert solve_checkpoint(problem, 19) is None
    assert brute_force_checkpoint(problem, 19) is None


def test_a_solve_stopped_with_no_set_in_time_still_finds_a_set_of_one_depth(monkeypatch) -> None:
    """Note [no set in time]: a MILP stopped by its time limit before any set answers None, as an infeasible one
    does. A model unit ("m") over two blocks with a child each ("m.b0" > "m.b0.fc", "m.b1" > "m.b1.fc"); recomputing
    the model drops nothing (its output is all it keeps, and backward needs all of it again: +10), a block 40 in its
    stretch, a child 25. By hand: budget 70 is met by both blocks (peak max(100 - 40, 100 - 40) = 60, cost 8) and
    by no cheaper set (both children: 75); budget 80 by both children (75, cost 2); budget 50 by no allowed set
    (brute force agrees on all three)."""
    import autofit.solve.checkpoint_milp as milp
    names = ("m", "m.b0", "m.b0.fc", "m.b1", "m.b1.fc")
    problem = CheckpointProblem(names, np.array([9.0, 4.0, 1.0, 4.0, 1.0]), np.array([100.0, 100.0]),
                                np.array([[10, -40, -25, 0, 0], [10, 0, 0, -40, -25]], dtype=float),
                                ((0, 1), (0, 2), (0, 3), (0, 4), (1, 2), (3, 4)))
    assert brute_force_checkpoint(problem, 70) == (1, 3) and brute_force_checkpoint(problem, 80) == (2, 4)
    assert brute_force_checkpoint(problem, 50) is None
    monkeypatch.setattr(milp, "_solve", lambda *args, **kwargs: None)  # the limit reached with no incumbent
    assert solve_checkpoint(problem, 70) == (1, 3) and problem.peak((1, 3)) == 60
    assert solve_checkpoint(problem, 80) == (2, 4) and problem.peak((2, 4)) == 75
    assert solve_checkpoint(problem, 50) is None
    assert level_checkpoint(problem, 200) == (2, 4)  # every depth fits: the cheapest (the children, cost 2)


def _random_problem(rng: np.random.Generator) -> CheckpointProblem:
    n = int(rng.integers(1, 9))  # 1..8 units
    rows = int(rng.integers(1, 7))
    base = rng.integers(10_000, 1_000_000, size=rows).astype(float)
    # mostly savings (negative), sometimes the stash / spike (positive), often nothing
    coef = np.where(rng.random((rows, n)) < 0.55, -rng.integers(0, 300_000, size=(rows, n)), 0).astype(float)
    positive = rng.random((rows, n)) < 0.15
    coef[positive] = rng.integers(0, 50_000, size=int(positive.sum()))
    # small integer costs, so equal-cost sets (ties) are common
    costs = rng.integers(0, 6, size=n).astype(float)
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    exclusive = tuple(p for p in pairs if rng.random() < 0.08)
    names = tuple(f"m{i}" for i in range(n))
    return CheckpointProblem(names, costs, base, coef, exclusive)


def _all_allowed(problem: CheckpointProblem):
    n = len(problem.names)
    for r in range(n + 1):
        for chosen in itertools.combinations(range(n), r):
            if problem.allowed(chosen):
                yield chosen


def _random_cases(seed: int, trials: int):
    """(problem, budget) pairs: budgets around the interesting range, plus exact subset peaks (the thresholds)."""
    rng = np.random.default_rng(seed)
    for trial in range(trials):
        problem = _random_problem(rng)
        peaks = [problem.peak(c) for c in _all_allowed(problem)]
        lo, hi = min(peaks), problem.peak(())
        budgets = {int(rng.integers(int(lo * 0.9), int(hi * 1.05) + 2)), int(rng.choice(peaks)),
                   int(rng.choice(peaks)) - 1}
        for budget in sorted(budgets):
            yield trial, problem, budget


def _describe(trial, problem, budget, milp, brute) -> str:
    def show(c):
        return "None" if c is None else f"{c} (cost {problem.cost(c):g}, peak {problem.peak(c):,})"

    return (f"trial {trial}, budget {budget:,}: milp {show(milp)}, brute force {show(brute)}; costs {problem.costs}, "
            f"base {problem.base}, coef {problem.coef.tolist()}, exclusive {problem.exclusive}")


@pytest.mark.sim  # hundreds of MILPs against brute force: over the quick budget on a slower run (5.2 CPU s in CI)
def test_milp_agrees_with_brute_force_on_feasibility_and_cost() -> None:
    checked = feasible = 0
    for trial, problem, budget in _random_cases(20261122, 300):
        milp = solve_checkpoint(problem, budget)
        brute = brute_force_checkpoint(problem, budget)
        where = _describe(trial, problem, budget, milp, brute)
        checked += 1
        assert (milp is None) == (brute is None), where
        if milp is None:
            continue
        feasible += 1
        assert problem.allowed(milp), where
        assert problem.peak(milp) <= budget, where
        assert problem.cost(milp) == pytest.approx(problem.cost(brute), abs=1e-9), where
    assert checked >= 200 and feasible >= 100, (checked, feasible)


@pytest.mark.sim  # as above: hundreds of MILPs
def test_milp_breaks_cost_ties_by_lower_peak_like_brute_force() -> None:
    # Equal-cost sets are common here (small integer costs, zero-cost units: in real tables, modules with no matmul
    # or convolution have zero FLOPs). Both solvers document the same order: cost, then lower peak, then fewer modules.
    # When the plain peak fits, solve_checkpoint returns () by its slack rule (documented: nothing is recomputed);
    # brute force has no such rule and may pick a zero-cost unit, so slack cases are checked against () instead.
    mismatches = []
    checked = 0
    for trial, problem, budget in _random_cases(20261122, 300):
        milp = solve_checkpoint(problem, budget)
        brute = brute_force_checkpoint(problem, budget)
        if milp is None or brute is None:
            continue
        checked += 1
        if problem.peak(()) <= budget:
            assert milp == (), _describe(trial, problem, budget, milp, brute)
            continue
        if problem.cost(milp) == pytest.approx(problem.cost(brute), abs=1e-9) and \
                problem.peak(milp) != problem.peak(brute):
            mismatches.append(_describe(trial, problem, budget, milp, brute))
    assert checked >= 200
    assert not mismatches, f"{len(mismatches)} of {checked} equal-cost answers have a higher peak than brute " \
                           f"force's:\n" + "\n".join(mismatches[:5])


def test_most_freeing_matches_brute_force_minimum_on_random_instances() -> None:
    rng = np.random.default_rng(7)
    for trial in range(200):
        problem = _random_problem(rng)
        best = min(problem.peak(c) for c in _all_allowed(problem))
        chosen = most_freeing_checkpoint(problem)
        assert problem.allowed(chosen), trial
        assert problem.peak(chosen) == best, (trial, chosen, problem.peak(chosen), best)


# ---- micro-batch options --------------------------------------------------------------------------------------------
def test_batch_options_by_hand() -> None:
    # B = 10: k = 1 -> b 10; k = 2 -> b 5; k = 3 -> b 4 (4 + 4 + 2); k = 4 -> b 3 (3 + 3 + 3 + 1); k = 5 -> b 2;
    # k = 6..9 -> b 2 again (skipped: same micro-batch, 5 steps); k = 10 -> b 1.
    assert batch_options(10) == [(10, 1, 10), (5, 2, 5), (4, 3, 2), (3, 4, 1), (2, 5, 2), (1, 10, 1)]
    assert batch_options(1) == [(1, 1, 1)]
    assert batch_options(7) == [(7, 1, 7), (4, 2, 3), (3, 3, 1), (2, 4, 1), (1, 7, 1)]


@pytest.mark.parametrize("batch_size", [1, 2, 3, 8, 12, 17, 64, 100])
def test_batch_options_cover_every_accumulation_count(batch_size: int) -> None:
    options = batch_options(batch_size)
    micro = [b for b, _, _ in options]
    assert micro == sorted(set(micro), reverse=True)  # distinct, largest (fastest) first
    assert micro[0] == batch_size and micro[-1] == 1
    for b, k, last in options:
        assert k == math.ceil(batch_size / b)
        assert 1 <= last <= b
        assert b * (k - 1) + last == batch_size  # every sample exactly once
        assert b == math.ceil(batch_size / k)  # the smallest micro-batch with k steps (least memory for k steps)
    # every number of accumulation steps any micro-batch size gives is represented
    assert {k for _, k, _ in options} == {math.ceil(batch_size / b) for b in range(1, batch_size + 1)}


# ---- the memory / time front ---------------------------------------------------------------------------------------
def _cand(tag: str, peak: int, seconds: float) -> Candidate:
    return Candidate("fp32", 1, 1, 1, (tag,), peak, seconds)


def test_pareto_front_by_hand() -> None:
    a = _cand("a", 100, 1.0)
    f = _cand("f", 95, 1.0)  # as fast as a, smaller: a is dominated
    e = _cand("e", 100, 1.2)  # dominated by a and f
    b = _cand("b", 80, 1.5)
    c = _cand("c", 90, 2.0)  # dominated by b
    d = _cand("d", 50, 3.0)
    g = _cand("g", 50, 3.5)  # same peak as d, slower: dominated
    front = pareto_front([c, a, g, e, d, b, f])
    assert front == [f, b, d]
    assert pareto_front([]) == []
    assert pareto_front([a]) == [a]


def test_pareto_front_is_non_dominated_and_sorted() -> None:
    rng = np.random.default_rng(3)
    for _ in range(50):
        cands = [_cand(str(i), int(rng.integers(1, 20)), float(rng.integers(1, 20))) for i in range(15)]
        front = pareto_front(cands)
        seconds = [c.seconds for c in front]
        peaks = [c.peak_bytes for c in front]
        assert seconds == sorted(seconds) and peaks == sorted(peaks, reverse=True)
        assert len(set(peaks)) == len(peaks)
        for c in front:  # nothing beats a front member on both axes
            assert not any(o.peak_bytes <= c.peak_bytes and o.seconds <= c.seconds
                           and (o.peak_bytes, o.seconds) != (c.peak_bytes, c.seconds) for o in cands)
        for c in cands:  # everything off the front is dominated (or a duplicate) by a front member
            assert any(f.peak_bytes <= c.peak_bytes and f.seconds <= c.seconds for f in front)


def test_smallest_verified_checks_micro_batch_one_too(monkeypatch) -> None:
    """The lowest *modelled* peak can be a large micro-batch the model underestimates (Llama-2-7b on a T4: micro-batch
    32 modelled lowest, verified at 159.77 GiB, while micro-batch 1 verifies at 131.93 GiB). The infeasibility error
    must name the smallest verified budget, so micro-batch 1 is verified as well."""
    from autofit.core.report import MemoryEstimate
    from autofit.solve import verify as verify_stage
    from autofit.solve.candidate import Candidate

    ranked = [Candidate("fp16", 32, 1, 32, (), 100, 1.0), Candidate("fp16", 16, 2, 16, (), 110, 1.1),
              Candidate("fp16", 8, 4, 8, (), 120, 1.2), Candidate("fp16", 1, 32, 1, (), 130, 3.0)]
    verified = {32: 160, 16: 150, 8: 140, 1: 132}  # hand-made "full estimates" by micro-batch
    monkeypatch.setattr(verify_stage, "smallest_peaks", lambda space: ranked)
    seen = []

    def verify(c):
        seen.append(c.micro_batch_size)
        return MemoryEstimate(peak_bytes=verified[c.micro_batch_size], breakdown={"parameters": 1})

    chosen, est = verify_stage.smallest_verified(None, verify)
    assert (chosen.micro_batch_size, est.device_bytes) == (1, 132)
    assert seen == [32, 16, 1]  # the two lowest modelled, and micro-batch 1: three simulations, not all of them


def _six_blocks() -> CheckpointProblem:
    """Six identical blocks "m.layers.i", each with a child "fc" (nested, so never both recomputed). Stretches: the
    end of forward, then each block's backward from the last. Recomputing a block drops its 10 saved bytes but
    keeps its 2-byte input (-8) in every stretch before its own backward; its child drops 6 and keeps 1 (-5). By
    hand: the end of forward holds 100 + 6 x 10 = 160, block j's backward 105 + 10 (j + 1)."""
    names, costs, cols = [], [], []
    stretches = 1 + 6  # end of forward, then the backward of blocks 5, 4, ..., 0
    for i in range(6):
        before = [s == 0 or (s >= 1 and 6 - s > i) for s in range(stretches)]  # stretches before block i's backward
        for child, cost, drop in (("", 4.0, -8.0), (".fc", 2.0, -5.0)):
            names.append(f"m.layers.{i}{child}")
            costs.append(cost)
            cols.append([drop if b else 0.0 for b in before])
    base = [160.0] + [105.0 + 10 * (j + 1) for j in range(5, -1, -1)]
    exclusive = tuple((2 * i, 2 * i + 1) for i in range(6))
    return CheckpointProblem(tuple(names), np.array(costs), np.array(base), np.array(cols).T, exclusive)


def _uniform(chosen, groups) -> bool:
    """Whether ``chosen`` (units of _six_blocks) treats the blocks of each group alike."""
    treatment = [tuple(u % 2 for u in chosen if u // 2 == b) for b in range(6)]
    return all(len({treatment[b] for b in group}) == 1 for group in groups)


@pytest.mark.parametrize("budget", [159, 152, 145, 140, 131, 125, 118, 111])
def test_identical_blocks_tied_in_groups_give_the_best_set_that_treats_each_group_alike(monkeypatch, budget) -> None:
    """Note [identical blocks solved in groups], solve/block_groups.py: with the program over the limit, blocks 0-1,
    2-3, 4-5 are tied. Truths by enumeration of the whole program: every tied set has the peak and cost of the set it
    expands to, and the answer is the cheapest whole-program set that fits and treats each group alike (never
    cheaper than the unrestricted optimum)."""
    import autofit.solve.block_groups as block_groups
    from autofit.capture.depth import Blocks
    from autofit.solve.checkpoint_milp import tied
    problem, blocks = _six_blocks(), Blocks("m.layers", 6)
    monkeypatch.setattr(block_groups, "_LARGE_PROGRAM", 0)
    monkeypatch.setattr(block_groups, "TIED_UNITS", 6)  # 12 units in blocks -> 2 blocks per group
    parts = block_groups._block_groups(problem, blocks)
    assert parts == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11]]
    small = tied(problem, parts)
    for r in range(len(parts) + 1):
        for c in itertools.combinations(range(len(parts)), r):
            whole = tuple(sorted(u for i in c for u in parts[i]))
            assert small.peak(c) == problem.peak(whole) and small.cost(c) == problem.cost(whole)
            assert small.allowed(c) == problem.allowed(whole)
    groups = ((0, 1), (2, 3), (4, 5))
    fitting = [c for c in _all_allowed(problem) if problem.peak(c) <= budget]
    best_uniform = min((problem.cost(c) for c in fitting if _uniform(c, groups)), default=None)
    chosen = block_groups.solve_in_block_groups(problem, budget, blocks)
    if best_uniform is None:  # the tied program fits nothing: the whole program is solved, as before
        assert chosen == solve_checkpoint(problem, budget)
        return
    assert problem.allowed(chosen) and problem.peak(chosen) <= budget and _uniform(chosen, groups)
    assert problem.cost(chosen) == best_uniform >= min(problem.cost(c) for c in fitting)
