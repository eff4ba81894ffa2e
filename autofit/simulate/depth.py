"""The timeline of a model's whole depth, built from the timelines of the same model cut to fewer of its identical
blocks (Note [a timeline extended in depth]).

Note [a timeline extended in depth]
    Depth extrapolation (Note [depth extrapolation], autofit/capture/depth.py) carries every tensor figure along a
    line to all the blocks. The CUDA caching allocator's figures (reserved, the smallest budget) are not on a line:
    they depend on which cached segment each block lands in, a state the allocator carries from block to block. They
    are exact only by replaying the allocator (autofit/cuda/allocator.py) over the whole step's events. Those events
    repeat per period of blocks: the timeline one period deeper is the shallower one with one more copy of a few
    event ranges (the period's forward, its backward, its parameters and states before the step, its tensors in each
    of the optimizer's foreach ops). So the whole timeline is the deepest cut's with ``copies`` more copies of each
    range, found as what the deeper of two cuts has that the shallower lacks (events compared by what they are,
    blocks' indices left out: ``_keys``).

    A free names the storage it frees, and a copy's free must name the copy's storage. Storages are told apart by
    what they are (the key of their allocation); among the live storages of one key, a free takes the one at the
    same rank, counted from the newest or from the oldest, that it took at the shallower depths: a block's
    backward frees its own saved activations (the newest of their key), FSDP2's forward frees the previous block's
    gathered parameters (one before the newest), the optimizer frees its foreach outputs in order (the oldest).
    Where neither rank is the same at the two depths the timeline is not extended. A range where the two cuts part
    can be the end of the run (a backward that reaches the run's first block), so the copies go before it and their
    frees follow the same free one period earlier. Only the events the allocator replays are extended (ops without
    a workspace of their own are left out), and the host's events stay the deepest cut's: the host figures stay on
    their line. The rule is checked before it is used: the second cut's timeline extended by one period must be the third cut's, event for event and free for
    free; the whole step's is then the third cut's extended by the periods the cut misses. That is an approximation
    of the same kind as the line (three depths alike make a change further out unlikely, not impossible);
    tests/test_depth_timeline.py compares the figures with the whole model's simulation.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np

from autofit.simulate.timeline import EventKind, StorageRecord, Timeline

__all__ = ["extended_timeline", "extend_checked"]


def _namer(path: str) -> Callable[[str], str]:
    """A module name with the index of its block under ``path`` left out."""
    pattern = re.compile(re.escape(path) + r"\.\d+(?=\.|$)")
    cache: dict[str, str] = {}

    def name(module: str) -> str:
        if module not in cache:
            cache[module] = pattern.sub(path + ".#", module)
        return cache[module]
    return name


def _storage_key(t: Timeline, sid: int, name: Callable[[str], str]) -> tuple:
    s = t.storages[sid]
    op = t.ops[s.op].name if 0 <= s.op < len(t.ops) else ""
    return (s.nbytes, s.category, s.phase, s.stream, name(s.module), op)


def _keys(t: Timeline, name: Callable[[str], str]) -> list[tuple]:
    """What each event is, without which storage or block: an allocation or free by its storage's key, an op by its
    name, module, phase and workspace."""
    out = []
    for kind, value in t.events:
        if kind is EventKind.OP:
            op = t.ops[value]
            out.append((kind, op.name, name(op.module), op.phase, op.workspace))
        else:
            out.append((kind,) + _storage_key(t, value, name))
    return out


def _added(short: list[tuple], long: list[tuple]) -> list[tuple[int, int]] | None:
    """The ranges ``(start, length)`` of ``long`` that ``short`` lacks, ``long`` being ``short`` with them inserted;
    None when it is not. Where the two part, the range is the one after which ``long`` goes on as ``short`` for the
    most events (the shortest of those): a whole period, not the few events where a period begins differently (an
    FSDP2 all-gather prefetched one block earlier) with the rest of it added further on."""
    ids: dict[tuple, int] = {}
    a = np.array([ids.setdefault(k, len(ids)) for k in short], dtype=np.int64)
    b = np.array([ids.setdefault(k, len(ids)) for k in long], dtype=np.int64)
    i = j = 0
    ranges = []
    while i < len(a):
        # the two agree up to the next difference
        n = min(len(a) - i, len(b) - j)
        differ = np.flatnonzero(a[i:i + n] != b[j:j + n])
        if not len(differ):
            i, j = i + n, j + n
            break
        i, j = i + int(differ[0]), j + int(differ[0])
        most = (len(b) - len(a)) - (j - i)  # what ``long`` has left to add
        best, best_run = None, 0
        for length in np.flatnonzero(b[j + 1:j + most + 1] == a[i]) + 1:
            n = min(len(a) - i, len(b) - j - length)
            unequal = np.flatnonzero(b[j + length:j + length + n] != a[i:i + n])
            run = int(unequal[0]) if len(unequal) else n
            if run > best_run:
                best, best_run = int(length), run
        if best is None:
            return None
        ranges.append((j, best))
        j += best
    if i < len(a):
        return None
    if j < len(b):
        ranges.append((j, len(b) - j))
    return ranges


def _ranks(t: Timeline, keys: list[tuple]) -> list[tuple[int, int] | None]:
    """For each event, a free's (rank from the newest, rank from the oldest) among the live storages of its key."""
    live: dict[tuple, list[int]] = {}
    out: list[tuple[int, int] | None] = []
    for (kind, value), key in zip(t.events, keys):
        if kind is EventKind.ALLOC:
            live.setdefault(key[1:], []).append(value)
            out.append(None)
        elif kind is EventKind.FREE:
            alive = live.get(key[1:], [])
            if value not in alive:  # freed twice or never allocated on the device: not a timeline to extend
                return []
            at = alive.index(value)
            out.append((len(alive) - 1 - at, at))
            alive.pop(at)
        else:
            out.append(None)
    return out


# a free's rule: ("new", r) the storage r before the newest of its key, ("old", r) the r-th oldest
Rule = tuple[str, int]


def _rules(shallow: Timeline, deep: Timeline, name):
    """(the ranges ``deep`` adds to ``shallow``, each event's rule, each event's rule in a copy of its range; the
    rules of frees only). A free outside the ranges follows the rank that is the same at both depths; one inside a
    range its own rank from the newest, and in a copy the rule of the same free a period earlier (the copies are
    periods like those before the range: the range itself can be the end of the run, as a backward that reaches the
    run's first block is). None where ``deep`` is not ``shallow`` with ranges added, or a free outside the ranges
    takes another rank from both ends."""
    ks, kd = _keys(shallow, name), _keys(deep, name)
    ranges = _added(ks, kd)
    if ranges is None:
        return None
    rs, rd = _ranks(shallow, ks), _ranks(deep, kd)
    if (shallow.events and not rs) or (deep.events and not rd):
        return None
    inside = [0] * len(kd)  # the length of the event's range, 0 outside the ranges
    for start, length in ranges:
        inside[start:start + length] = [length] * length
    rules: list[Rule | None] = []
    i = 0
    for j, (kind, _) in enumerate(deep.events):
        if not inside[j]:
            i += 1
        if kind is not EventKind.FREE:
            rules.append(None)
            continue
        new, old = rd[j]
        if inside[j]:  # compared with the same free a period earlier, where there is one
            length = inside[j]
            earlier = rd[j - length] if j >= length and not inside[j - length] and kd[j - length] == kd[j] else None
            rules.append(("old", old) if earlier is not None and earlier[0] != new and earlier[1] == old
                         else ("new", new))
        elif rs[i - 1][0] == new:
            rules.append(("new", new))
        elif rs[i - 1][1] == old:
            rules.append(("old", old))
        else:
            return None
    copied = list(rules)
    for j, length in enumerate(inside):
        if length and j >= length and not inside[j - length] and kd[j - length] == kd[j]:
            copied[j] = rules[j - length]
    return ranges, rules, copied


def extended_timeline(shallow: Timeline, deep: Timeline, copies: int, path: str) -> Timeline | None:
    """``deep`` (a period of the blocks under ``path`` deeper than ``shallow``) with ``copies`` more copies of each
    event range it adds to ``shallow``, each right before the range; the frees by the rules the two follow (Note [a
    timeline extended in depth]). None where ``deep`` is not ``shallow`` with ranges added, or a free follows no
    rule. Only the device's events are extended: ``host_events`` stay the deep cut's."""
    name = _namer(path)
    found = _rules(shallow, deep, name)
    if found is None:
        return None
    ranges, rules, copied = found
    keys = _keys(deep, name)
    starts = dict(ranges)
    storages = list(deep.storages)
    events: list[tuple[EventKind, int]] = []
    live: dict[tuple, list[int]] = {}

    def emit(j: int, rule: Rule | None, copy: bool) -> bool:
        kind, value = deep.events[j]
        if kind is EventKind.ALLOC:
            if copy:
                s = deep.storages[value]
                storages.append(StorageRecord(s.nbytes, s.category, s.op, s.module, s.phase, s.stream))
                value = len(storages) - 1
            live.setdefault(keys[j][1:], []).append(value)
        elif kind is EventKind.FREE:
            alive = live.get(keys[j][1:], [])
            how, rank = rule
            if rank >= len(alive):
                return False
            value = alive.pop(len(alive) - 1 - rank if how == "new" else rank)
        events.append((kind, value))
        return True

    for j in range(len(deep.events)):
        if j in starts:
            for _ in range(copies):
                for k in range(j, j + starts[j]):
                    if not emit(k, copied[k], True):
                        return None
        if not emit(j, rules[j], False):
            return None
    # the stage marks of the deep cut, moved by the events added before them
    marks = [(at + copies * sum(n for start, n in ranges if start < at), micro, phase)
             for at, micro, phase in deep.marks]
    return Timeline(storages=storages, ops=deep.ops, events=events, marks=marks, host_events=list(deep.host_events),
                    host_sids=set(deep.host_sids), closed=True)


def _same(a: Timeline, b: Timeline, name) -> bool:
    """Whether two timelines are the same step: the same events by key, each free of the storage allocated at the
    same event."""
    if len(a.events) != len(b.events) or _keys(a, name) != _keys(b, name):
        return False

    def frees(t: Timeline) -> list[int]:
        born: dict[int, int] = {}
        out = []
        for i, (kind, value) in enumerate(t.events):
            if kind is EventKind.ALLOC:
                born[value] = i
            elif kind is EventKind.FREE:
                out.append(born.get(value, -1))
        return out
    return frees(a) == frees(b)


def _memory_events(t: Timeline) -> Timeline:
    """``t`` without the ops that need no memory of their own: what the allocator replays (ops carry a CPU
    kernel's scratch at most), and fewer events that tell nothing apart (profiler ranges entered and left)."""
    keep = [i for i, (kind, value) in enumerate(t.events) if kind is not EventKind.OP or t.ops[value].workspace]
    before = np.searchsorted(np.array(keep, dtype=np.int64), [at for at, _, _ in t.marks])
    return Timeline(storages=t.storages, ops=t.ops, events=[t.events[i] for i in keep],
                    marks=[(int(b), micro, phase) for b, (_, micro, phase) in zip(before, t.marks)],
                    host_events=t.host_events, host_sids=t.host_sids, closed=True)


def extend_checked(timelines: tuple[Timeline, Timeline, Timeline], copies: int, path: str) -> Timeline | None:
    """The whole step's timeline from three cuts a period apart (shallowest first): the third extended by
    ``copies`` periods, when the second extended by one is the third (Note [a timeline extended in depth]); else
    None."""
    first, second, third = (_memory_events(t) for t in timelines)
    check = extended_timeline(first, second, 1, path)
    if check is None or not _same(check, third, _namer(path)):
        return None
    return extended_timeline(second, third, copies, path)
