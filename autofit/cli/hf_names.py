"""A mistyped ``hf:`` name answered from the offline table before any Hub request (issue 57: a typo spent 51 s on
the Hub's retries before the "closest" message it could have had at once).

Note [near-miss names]
    A name is a near miss of the offline table when, case aside, it has the same numbers as one of the table's names
    (so Qwen/Qwen2-7B is never a typo of Qwen/Qwen2.5-7B, nor Llama-3.2 of Llama-3.1) and is at most
    :data:`TYPO_EDITS` letters from it (a dropped, doubled, swapped or wrong letter, twice): Qwen/Qwen2.5-7b-instrct.
    Suffixes that name another repository (-AWQ, -GGUF, -it, -chat) are three edits or more, so those still go to
    the Hub. A Hub repository that really is that close to a table name is read from a folder holding its
    config.json (hf:./folder), or from the cache once downloaded: both are tried before this check.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["near_miss", "TYPO_EDITS"]

TYPO_EDITS = 2


def _edits(a: str, b: str, limit: int) -> int:
    """Levenshtein distance (insert, delete, replace; a swap is two), or ``limit + 1`` once it exceeds ``limit``."""
    if abs(len(a) - len(b)) > limit:
        return limit + 1
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        if min(current) > limit:
            return limit + 1
        previous = current
    return previous[-1]


def near_miss(name: str, known: Iterable[str]) -> str | None:
    """The known name ``name`` is a typo of (Note [near-miss names]), or None (an exact or unrelated name)."""
    lower, numbers = name.lower(), re.findall(r"\d+", name)
    best: tuple[int, str] | None = None
    for candidate in known:
        other = candidate.lower()
        if other == lower or re.findall(r"\d+", candidate) != numbers:
            continue
        edits = _edits(lower, other, TYPO_EDITS)
        if edits <= TYPO_EDITS and (best is None or edits < best[0]):
            best = (edits, candidate)
    return None if best is None else best[1]
