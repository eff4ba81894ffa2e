"""The checkpoint MILP over a model's run of identical blocks: large programs solved with the units of consecutive
blocks tied in groups, and the chosen treatments rearranged so that blocks treated alike are neighbours (what a cut
of the model to a few blocks needs: Note [depth extrapolation], autofit/capture/depth.py).
"""

from __future__ import annotations

import math

from autofit.capture.depth import Blocks, block_of
from autofit.solve.checkpoint_milp import CheckpointProblem, solve_checkpoint, tied


__all__ = ["grouped_by_block", "solve_in_block_groups"]


# Note [identical blocks solved in groups]
#     Above a few hundred units the checkpoint MILP stops at its 10 s limit (Note [no set in time],
#     solve/checkpoint_milp.py), and identical blocks are why: any set's treatments can be moved between blocks at
#     the same cost, so the solver meets thousands of equivalent sets and a weak bound. The 405B plan of issue 56
#     (126 blocks, 885 units with the selective ones, 6,581 stretches) solved twelve such programs, 6 to 13 s each,
#     and some of those with selective units found no set at all. Such a program is solved instead with the units of
#     consecutive blocks tied: one unit per (group of blocks, module within the block, policy), its cost and bytes
#     the sums over the group (``tied``), the groups sized to bring the program to about ``TIED_UNITS`` units. A set
#     of the tied program is a set of the whole one with the same peak and cost, so what it returns fits; it forgoes
#     the sets that treat the blocks of one group differently. Those matter little: the treatments are
#     rearranged into runs of blocks anyway (Note [recomputation grouped by block]), and a run's end can then only
#     fall on a group's. Measured on the four programs of that plan's TP 4 layout (two micro-batches, each with
#     and without selective units; one run, two cores), before -> tied (groups of 7 blocks, 129 units; of 5, 132):
#     with selective units, no set in 16.7 s and in 21.2 s (the depth level set was taken, 6.719e15 recompute
#     FLOPs) -> 6.469e15 in 1.0 and 1.2 s; without, 6.612e15 in 10.7 s -> 6.505e15 in 1.5 s, and 6.452e15 in 9.4 s
#     -> the same in 1.1 s. The whole program, stopped at its limit, found no cheaper set in any of them. Where the
#     tied program finds nothing, the whole program is solved as before.
TIED_UNITS = 128  # about this many units in blocks, in the tied program
_LARGE_PROGRAM = 400  # units: above, the whole program stops at its time limit (scipy's HiGHS, two cores)


def solve_in_block_groups(problem: CheckpointProblem, budget: int, blocks: Blocks | None) -> tuple[int, ...] | None:
    """``solve_checkpoint(problem, budget)``, with the units of consecutive identical ``blocks`` tied in groups
    where the program is large (Note [identical blocks solved in groups]); the whole program where the tied one
    finds no set."""
    parts = _block_groups(problem, blocks)
    if parts is not None:
        chosen = solve_checkpoint(tied(problem, parts), budget)
        if chosen is not None:
            return tuple(sorted(u for i in chosen for u in parts[i]))
    return solve_checkpoint(problem, budget)


def _block_groups(problem: CheckpointProblem, blocks: Blocks | None) -> list[list[int]] | None:
    """The units of ``problem`` partitioned into groups: those of one module and policy over consecutive blocks
    together, each other unit alone; None where the program is small enough to solve whole or the groups would be
    single blocks."""
    if blocks is None or len(problem.names) <= _LARGE_PROGRAM:
        return None
    where = [block_of(name, blocks) for name in problem.names]
    inside = sum(1 for found in where if found is not None and found[0] < blocks.count)
    per = math.ceil(inside / TIED_UNITS)  # blocks per group
    if per < 2:
        return None
    index: dict[tuple, int] = {}
    parts: list[list[int]] = []
    for u, found in enumerate(where):
        key = (found[0] // per, found[1], problem.policy(u)) if found is not None and found[0] < blocks.count \
            else ("alone", u)
        if key not in index:
            index[key] = len(parts)
            parts.append([])
        parts[index[key]].append(u)
    return parts


def grouped_by_block(problem: CheckpointProblem, chosen: tuple[int, ...], blocks: Blocks,
                     budget: float) -> tuple[int, ...]:
    """``chosen`` (units of ``problem``) with the identical blocks' treatments rearranged so that blocks treated alike
    are neighbours, when an arrangement keeps the modelled peak under ``budget`` at the same recompute cost; the
    arrangement with the lowest peak. Else ``chosen`` as it is.

    Note [recomputation grouped by block]
        The blocks are identical, so the checkpoint MILP is indifferent to which of them takes which treatment (all
        of it recomputed, selectively, only the MLP, nothing) but for the positional peak, and over many units it
        stops at a 1 % gap: on the 70B-shaped Llama it recomputed 11 of the 80 blocks selectively, scattered over
        blocks 0 to 70. Such a set repeats with no period, so its verification simulated 57 of the 80 blocks, three
        times (Note [depth extrapolation]: about 45 s per depth on two cores). The same treatments in contiguous
        runs cost the same FLOPs and the same step time (the time model prices a module by its name's ops, which are
        the same in every block); the longest run is then cut, the others kept whole. Heaviest recomputation first
        and lightest first are both priced by the MILP's own constraints (every stretch of the window), and the
        lower peak kept if under the budget; the verification that follows simulates the arrangement planned."""
    index: dict[tuple[int, str, str], int] = {}
    units: list[set[tuple[str, str]]] = [set() for _ in range(blocks.count)]
    for i, name in enumerate(problem.names):
        found = block_of(name, blocks)
        if found is not None and found[0] < blocks.count:
            index[(found[0], found[1], problem.policy(i))] = i
            units[found[0]].add((found[1], problem.policy(i)))
    if any(u != units[0] for u in units):  # a block lacks a unit the others have: not identical to the MILP
        return chosen
    treatment: list[list[tuple[str, str]]] = [[] for _ in range(blocks.count)]
    outside = []
    for i in chosen:
        found = block_of(problem.names[i], blocks)
        if found is None or found[0] >= blocks.count:
            outside.append(i)
        else:
            treatment[found[0]].append((found[1], problem.policy(i)))
    kinds = [tuple(sorted(t)) for t in treatment]
    if len(set(kinds)) < 2:
        return chosen
    weight = {k: sum(problem.costs[index[(b, *u)]] for u in k) for b, k in enumerate(kinds)}
    best, best_peak = chosen, None
    for heaviest_first in (True, False):
        order = sorted(kinds, key=lambda k: (-weight[k] if heaviest_first else weight[k], k))
        arranged = tuple(sorted(outside + [index[(b, *u)] for b, k in enumerate(order) for u in k]))
        if not problem.allowed(arranged) or problem.cost(arranged) > problem.cost(chosen) * (1 + 1e-9):
            continue
        peak = problem.peak(arranged)
        if peak <= budget and (best_peak is None or peak < best_peak):
            best, best_peak = arranged, peak
    return best
