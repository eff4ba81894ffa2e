"""The layout of a model cut in depth (Note [depth extrapolation], autofit/solve/depth.py): the estimates simulate
the model cut to a few of its identical blocks, and the layout names modules of the whole model. Which of its names a
cut renames, and how, is the layout's: the depth extrapolation asks here and reads none of its fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from autofit.parallel.layout import Parallel

__all__ = ["renamed_in_depth", "at_depth"]


def renamed_in_depth(layout: Parallel) -> tuple[tuple[str, ...], ...]:
    """``layout``'s lists of module names that a cut in depth renames block by block (:func:`at_depth`), each of
    which must repeat over the blocks for the cut to extrapolate: FSDP2's units. Not the tensor plan, whose pairs
    a cut keeps as they are named."""
    return (layout.shard_units,)


def at_depth(layout: Parallel, cut: Callable[[tuple[str, ...]], tuple[str, ...]],
             kept: Callable[[str], bool]) -> Parallel:
    """``layout`` as the model cut in depth runs it: FSDP2's units given by ``cut`` (those under blocks the cut drops
    go, the others renumbered), and the tensor plan's pairs whose module ``kept`` says the cut holds, as named. The
    blocks take alike tensor-parallel styles, so the cut's k blocks take the plan's first k as they are named: no
    renumbering, and the first block's sequence shard (Note [sequence parallel]) stays on the cut's first block;
    names of blocks past the cut go (parallelize_module warns once for each name it cannot resolve)."""
    return replace(layout, shard_units=cut(layout.shard_units),
                   tensor_plan=tuple(pair for pair in layout.tensor_plan if kept(pair[0])))
