"""Which modules to recompute: an exact 0/1 program solved with ``scipy.optimize.milp`` (HiGHS).

The memory model (``memory_model.py``) turns a micro-batch size into constraints of one shape: at each stretch of the
window, ``base_i + sum_u coef_iu x_u`` bytes are live, where ``x_u`` says whether unit u is recomputed (negative
coefficients: saved tensors it drops; positive: its RNG stash and recompute spike). Two stages: the cheapest set
(recompute FLOPs) that keeps every stretch under the budget, then, among sets that cost no more, the one with the
lowest peak. A module may come as two units, one per way of recomputing it (``policies``: "full" reruns all of its
forward, "selective" keeps its matmul and attention outputs, autofit/training/recompute.py), at most one of which is chosen
(``groups``). Exact up to 40 units; beyond, one stage with a 1 % gap and a time limit (see ``_solve``). Following
``torch/distributed/_tools/sac_ilp.py``, variables and constraints are labelled.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from autofit.core._torch_profiler import quiet_native_output

__all__ = ["CheckpointProblem", "solve_checkpoint", "most_freeing_checkpoint", "level_checkpoint", "most_dropped",
           "brute_force_checkpoint", "nested_pairs", "tied"]


@dataclass(frozen=True, eq=False)
class CheckpointProblem:
    names: tuple[str, ...]  # the units (modules) that may be recomputed
    costs: np.ndarray  # [U] recompute cost of each unit (FLOPs)
    base: np.ndarray  # [I] live bytes of each stretch without checkpointing
    coef: np.ndarray  # [I, U] bytes each unit adds (+) or drops (-) in each stretch when recomputed
    exclusive: tuple[tuple[int, int], ...] = ()  # (ancestor, descendant) pairs that cannot both be chosen
    # how each unit recomputes its module, "full" or "selective" (empty: all "full")
    policies: tuple[str, ...] = ()
    # units that are the same module under different policies: at most one of each group is chosen
    groups: tuple[tuple[int, ...], ...] = ()

    def policy(self, unit: int) -> str:
        return self.policies[unit] if self.policies else "full"

    def peak(self, chosen) -> int:
        x = np.zeros(len(self.names))
        x[list(chosen)] = 1.0
        return int(np.max(self.base + self.coef @ x)) if len(self.base) else 0

    def allowed(self, chosen) -> bool:
        picked = set(chosen)
        return (not any(a in picked and d in picked for a, d in self.exclusive)
                and all(len(picked.intersection(g)) <= 1 for g in self.groups))

    def cost(self, chosen) -> float:
        return float(sum(self.costs[i] for i in chosen))


def _solve(problem: CheckpointProblem, budget: float | None, objective: str,
           max_cost: float | None = None) -> tuple[int, ...] | None:
    """One MILP. ``objective``: "cost" (recompute FLOPs) or "peak"; ``max_cost`` caps the FLOPs (second stage)."""
    n, rows = len(problem.names), len(problem.base)
    if n == 0:
        return () if budget is None or problem.peak(()) <= budget else None
    # Decision variables: x_0..x_{n-1} in {0, 1}: x_u = 1 when unit u is recomputed (checkpointed) by its policy
    #                     (a module with two policies is two units: x_{m,full}, x_{m,selective});
    #                     p (index n), continuous: the peak, max over stretches of live bytes (in units of byte_scale)
    byte_scale = max(float(np.abs(problem.base).max()), 1.0)
    cost_scale = max(float(problem.costs.max()), 1.0)
    c = np.zeros(n + 1)
    if objective == "cost":
        c[:n] = problem.costs / cost_scale + 1e-6  # the small constant prefers fewer modules among free ones
    else:
        c[n] = 1.0
        c[:n] = 1e-9
    # [Constraint] stretch i: base_i + sum_u coef_iu x_u <= p
    a = np.hstack([problem.coef / byte_scale, -np.ones((rows, 1))])
    constraints = [LinearConstraint(a, -np.inf, -problem.base / byte_scale)]
    # [Constraint] nesting: a module and one of its descendants are never both recomputed: x_a + x_d <= 1
    if problem.exclusive:
        nest = np.zeros((len(problem.exclusive), n + 1))
        for k, (i, j) in enumerate(problem.exclusive):
            nest[k, i] = nest[k, j] = 1.0
        constraints.append(LinearConstraint(nest, -np.inf, 1.0))
    # [Constraint] one policy per module: sum_p x_{m,p} <= 1 over the units of module m
    if problem.groups:
        one = np.zeros((len(problem.groups), n + 1))
        for k, group in enumerate(problem.groups):
            one[k, list(group)] = 1.0
        constraints.append(LinearConstraint(one, -np.inf, 1.0))
    # [Constraint] cost cap (second stage): sum_u c_u x_u <= the first stage's optimum
    if max_cost is not None:
        constraints.append(LinearConstraint(np.concatenate([problem.costs, [0.0]])[None, :], -np.inf,
                                            max_cost * (1 + 1e-9) + 1e-9))
    # [Constraint] budget: p <= budget (as a bound on p)
    upper_p = np.inf if budget is None else float(budget) / byte_scale
    bounds = Bounds(np.concatenate([np.zeros(n), [-np.inf]]), np.concatenate([np.ones(n), [upper_p]]))
    # Exact on small problems. On large ones (a 32-layer model has hundreds of units, and identical layers make many
    # equivalent optima the solver cannot tell apart) a 1 % gap on the recompute FLOPs, with a time limit as a guard,
    # the incumbent being feasible. What the search ranks is the step time, of which recomputation is at most about a
    # third (one more forward), so the gap is at most ~0.3 % of a step, below the time model's own error. On
    # Llama-7B (161 units) a 0.1 % gap ran into the 10 s limit on 6 of 15 micro-batches; 1 % closes in 0.3-3.3 s,
    # 5 of 7 at the same optimum and 2 within 0.5 % of its FLOPs (benchmarks/scale.py --plan).
    # The limit is wall-clock, so a plan whose solve reaches it depends on the machine's load (the 70B 4 x 8 plan
    # once recomputed 84 modules under load, 81 quiet). A node limit would not: but GPT-2 XL on a T4 (725 units)
    # spends 14 s in its root node alone, and 2,000 nodes made that test's plan 135 -> 408 s (50 nodes: 30 s per
    # solve, the same incumbent as at 5 nodes). The program itself is made smaller where it is this large and its
    # modules repeat over identical blocks (Note [identical blocks solved in groups], solve/block_groups.py).
    options = {"mip_rel_gap": 0.0} if n <= 40 else {"mip_rel_gap": 1e-2, "time_limit": 10.0}
    with quiet_native_output((1, 2)):  # HiGHS reports solver internals on the C stdout
        result = milp(c, constraints=constraints, integrality=np.concatenate([np.ones(n), [0]]), bounds=bounds,
                      options=options)
    if result.x is None:  # infeasible, or no incumbent within the time limit
        return None
    chosen = tuple(int(i) for i in np.flatnonzero(np.round(result.x[:n]) > 0.5))
    if budget is not None and problem.peak(chosen) > budget:
        return None
    return chosen


def solve_checkpoint(problem: CheckpointProblem, budget: int) -> tuple[int, ...] | None:
    """Indices of the cheapest set whose peak fits ``budget`` (ties: lower peak, then fewer modules); None if none.
    Above 40 units only the first stage runs, within a 1 % gap of the cheapest."""
    if problem.peak(()) <= budget:
        return ()
    # no set can fit when even the most any allowed set drops in some stretch leaves it over budget
    if len(problem.base) and float(np.max(problem.base - most_dropped(problem))) > budget:
        return None
    cheapest = _solve(problem, budget, "cost")
    if cheapest is None:  # infeasible, or stopped by its time limit with no set found (Note [no set in time])
        return level_checkpoint(problem, budget)
    if len(problem.names) > 40:
        return cheapest  # large problems: the cost optimum within the gap is the answer (see _solve)
    # among sets that cost no more, the lowest peak (two stages: a tie-break weight small enough never to trade
    # FLOPs for bytes would be below the solver's tolerances)
    lowest = _solve(problem, budget, "peak", max_cost=problem.cost(cheapest))
    return lowest if lowest is not None and problem.peak(lowest) <= problem.peak(cheapest) else cheapest


# Note [the most a stretch can drop]
#     A MILP that has no solution can take seconds to say so: the 7B LoRA plan on an RTX 4090 spent 4 to 7 s on each of
#     the micro-batches 1 and 2 (hundreds of units, nesting constraints, the solver's time limit as its guard) before
#     this. A set fits only if every stretch fits, so if some stretch stays over the budget after the most that any
#     allowed set drops there, no set fits. Allowed means no module together with one of its descendants (nesting) and
#     one policy per module (groups); in one stretch the most dropped is then a sum over a tree: a module either drops
#     its own bytes (the larger of its policies') or lets its children, each at their best, drop theirs, whichever is
#     more (units that add bytes in that stretch are left out). One pass up the module tree computes it for every
#     stretch at once. The check only says "none" where the MILP would: the MILP's answer is never changed, only
#     found sooner. Summing every unit's drop at once (nesting ignored), the check before this, let those programs
#     through. Used only where the problem's constraints are exactly the tree's (``nested_pairs`` of its names, its
#     groups those of equal names): elsewhere the sum over every unit is the bound, as before.
def most_dropped(problem: CheckpointProblem) -> np.ndarray:
    """For each stretch (row), an upper bound of the bytes any allowed set of units drops there (Note [the most a
    stretch can drop])."""
    drops = np.maximum(-problem.coef, 0.0)
    if not _is_a_tree(problem):
        return drops.sum(axis=1)
    modules = list(dict.fromkeys(problem.names))
    own = np.zeros((len(problem.base), len(modules)))
    where = {name: m for m, name in enumerate(modules)}
    for u, name in enumerate(problem.names):  # one policy per module: the larger drop of its units
        own[:, where[name]] = np.maximum(own[:, where[name]], drops[:, u])
    children = np.zeros_like(own)
    total = np.zeros(len(problem.base))
    for name in sorted(modules, key=len, reverse=True):  # a descendant's name is longer than its ancestor's
        m = where[name]
        best = np.maximum(own[:, m], children[:, m])
        parent = _nearest_ancestor(name, where)
        if parent is None:
            total += best
        else:
            children[:, parent] += best
    return total


def _nearest_ancestor(name: str, where: dict[str, int]) -> int | None:
    for k in range(len(name) - 1, -1, -1):
        if name[k] == "." and name[:k] in where:
            return where[name[:k]]
    return None


def _is_a_tree(problem: CheckpointProblem) -> bool:
    """Whether the problem's constraints are exactly its names' tree: nesting by qualified name, one unit per module
    and policy, and the units of one module grouped (at most one chosen)."""
    same: dict[str, list[int]] = {}
    for u, name in enumerate(problem.names):
        same.setdefault(name, []).append(u)
    groups = {tuple(g) for g in same.values() if len(g) > 1}
    nested = {(i, j) for i, j in nested_pairs(problem.names) if problem.names[i] != problem.names[j]}
    return groups == {tuple(g) for g in problem.groups} and nested == set(problem.exclusive)


# Note [no set in time]
#     A MILP stopped by its wall-clock limit before it found any set answers as an infeasible one does (``_solve``
#     returns None), so under load a budget that fits could read as one that does not: an 8B QLoRA plan on an RTX
#     4090 (1,317 units) found every micro-batch infeasible beside two other jobs, where alone it fit 1 x 8, and
#     climbed to the next rung. So before None is the answer, the sets that recompute every module of one depth in
#     the module tree are tried (all the decoder blocks, all their attentions, ...: what a framework's own
#     checkpointing switch does at the blocks' depth), each module by its full policy, and the cheapest that fits
#     is the answer. Each is allowed by construction (modules of one depth do not nest; one policy per module), and
#     where the MILP proved the budget infeasible none fits (the MILP would have found it), so the answer there is
#     unchanged. A set found this way fits, if it is not the cheapest.
def level_checkpoint(problem: CheckpointProblem, budget: float) -> tuple[int, ...] | None:
    """The cheapest set that fits ``budget`` among those that recompute every module of one depth by its "full"
    policy (Note [no set in time]); None where none fits."""
    levels: dict[int, dict[str, int]] = {}
    for u, name in enumerate(problem.names):
        if problem.policy(u) == "full":
            levels.setdefault(name.count("."), {}).setdefault(name, u)
    fits = [tuple(sorted(units.values())) for _, units in sorted(levels.items())]
    fits = [c for c in fits if problem.allowed(c) and problem.peak(c) <= budget]
    return min(fits, key=lambda c: (problem.cost(c), problem.peak(c)), default=None)


def most_freeing_checkpoint(problem: CheckpointProblem) -> tuple[int, ...]:
    """The set with the lowest peak, whatever it costs: what the smallest feasible budget uses. Among sets with that
    peak, every further unit that lowers the live bytes somewhere without raising the peak is added (largest drop
    first): the peak's stretch may lie where no unit helps (a loss over the logits), while what a GPU's caching
    allocator keeps reserved follows the bytes of the whole window (Note [the smallest budget] in solve/verify.py)."""
    chosen = _solve(problem, None, "peak")
    if chosen is None or problem.peak(chosen) >= problem.peak(()):
        chosen = ()
    peak = problem.peak(chosen)
    drops = -problem.coef.sum(axis=0) if len(problem.base) else np.zeros(len(problem.names))
    for u in sorted(range(len(problem.names)), key=lambda u: -drops[u]):
        if drops[u] <= 0:
            break
        grown = tuple(sorted((*chosen, u)))
        if u not in chosen and problem.allowed(grown) and problem.peak(grown) <= peak:
            chosen = grown
    return chosen


def tied(problem: CheckpointProblem, parts: list[list[int]]) -> CheckpointProblem:
    """The program whose unit i recomputes every unit of ``parts[i]`` together (a partition of ``problem``'s units,
    each part of one policy): costs and byte coefficients summed over the part, exact for any set of whole parts;
    a nesting or one-policy constraint between two units binds their parts. Named by each part's first unit. Its
    sets, each part expanded, are sets of ``problem`` (Note [identical blocks solved in groups],
    solve/block_groups.py)."""
    part_of = np.empty(len(problem.names), dtype=np.int64)
    for i, part in enumerate(parts):
        part_of[part] = i
    summed = np.zeros((len(problem.names), len(parts)))
    summed[np.arange(len(problem.names)), part_of] = 1.0
    exclusive = {(int(part_of[a]), int(part_of[d])) for a, d in problem.exclusive}
    groups = {tuple(sorted({int(part_of[u]) for u in group})) for group in problem.groups}
    return CheckpointProblem(
        names=tuple(problem.names[part[0]] for part in parts), costs=problem.costs @ summed, base=problem.base,
        coef=problem.coef @ summed, exclusive=tuple(sorted(exclusive)),
        policies=tuple(problem.policy(part[0]) for part in parts) if problem.policies else (),
        groups=tuple(sorted(g for g in groups if len(g) > 1)))


def brute_force_checkpoint(problem: CheckpointProblem, budget: int) -> tuple[int, ...] | None:
    """Every subset, for tests on small instances: the cheapest that fits (ties: lower peak, then fewer)."""
    if problem.peak(()) <= budget:
        return ()
    best, best_key = None, None
    n = len(problem.names)
    for mask in range(1 << n):
        chosen = tuple(i for i in range(n) if mask >> i & 1)
        if not problem.allowed(chosen):
            continue
        peak = problem.peak(chosen)
        if peak > budget:
            continue
        key = (round(problem.cost(chosen), 6), peak, len(chosen))
        if best_key is None or key < best_key:
            best, best_key = chosen, key
    return best


def nested_pairs(names: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    """(i, j) for every ``names[j]`` under ``names[i]`` (it starts with ``names[i] + "."``), ordered by i then j."""
    where: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        where.setdefault(name, []).append(i)
    pairs = []
    for j, name in enumerate(names):
        for k, ch in enumerate(name):
            if ch == ".":
                pairs.extend((i, j) for i in where.get(name[:k], ()))
    return tuple(sorted(pairs))
