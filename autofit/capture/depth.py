"""A model's run of identical blocks, and the same model cut to fewer of them (Note [depth extrapolation]).

Note [depth extrapolation]
    A deep model's simulation dispatches every op of every block: a Llama-3-70B step at sequence 8192 is about 1,700
    ops per block and 1.3-2.2 ms per op on two CPU cores, so one simulation of 80 blocks takes minutes and a plan
    simulates several. But most deep models are a run of structurally identical blocks (a Llama's ``layers``: one
    class, the same parameter and buffer names, shapes and dtypes per block) between a fixed head and tail, and every
    figure of a step that only repeats those blocks grows by the same bytes per block. So a configuration is simulated
    on the same model cut to d1 < d2 < d3 blocks, and each figure of its estimate is carried to all N blocks along the
    line through d2 and d3 (autofit/solve/depth.py, autofit/solve/extrapolate.py); the estimate's notes say so.

    - What is cut: only the ModuleList, by a shallow copy of every module on its path with a fresh ``_modules`` dict
      (and, for a Hugging Face model, a copied config whose ``num_hidden_layers`` and per-layer lists are cut too).
      Parameters are shared, never copied: the simulation makes fake copies anyway. The user's model is unchanged.
    - Which configurations: module names under block i (recomputed, offloaded, sharded, fp32-pinned) must repeat
      with a period p (block i's set equals block i mod p's); the depths are then N mod p plus multiples of p, so the
      cut model's blocks carry the same pattern as the first blocks of the full one. Any other pattern is simulated in
      full.
    - How it is checked: the line through d1 and d2 must predict d3 (to the byte for the tensor figures; within
      the CUDA allocator's segment granularity for the reserved ones), else larger depths are tried, else the full
      model is simulated. A peak is a maximum of lines (one per stage of the step), so it is affine only from the depth
      where one stage dominates; three agreeing depths make a later change of the dominant stage unlikely, not
      impossible. That is the approximation, and the tests compare with the CPU allocator at full depth. A CUDA
      target's segment figures may be off their line where the tensor figures are on theirs: they are then carried
      with the largest reserve seen, unless the smallest budget lands near the budget, where the caching allocator
      is replayed over the whole step's timeline built from the cuts' (Note [segment figures in depth],
      autofit/solve/extrapolate.py; Note [a timeline extended in depth], autofit/simulate/depth.py).
    - The estimate under a budget (``MemoryEstimate.under``, an allocator replay under a cap) is the d3 replay under
      the budget less the extrapolated growth, then shifted by it: approximate, and said so in its notes.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable
from dataclasses import dataclass

from torch import nn

__all__ = ["Blocks", "find_blocks", "truncated", "block_of", "period_of", "periodic_runs", "names_at_depth", "MIN_BLOCKS"]

MIN_BLOCKS = 6  # a shorter run is not worth cutting: the cut model needs up to 4 blocks plus the period


@dataclass(frozen=True)
class Blocks:
    """A ModuleList of ``count`` structurally identical blocks at ``path`` (e.g. "model.layers")."""

    path: str
    count: int


def _signature(module: nn.Module) -> tuple:
    """What makes two blocks the same for a simulation: classes of every submodule, parameter and buffer names,
    shapes, dtypes and whether they train."""
    mods = tuple((n, type(m)) for n, m in module.named_modules())
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in module.named_parameters())
    bufs = tuple((n, tuple(b.shape), b.dtype) for n, b in module.named_buffers())
    return mods, params, bufs


def find_blocks(model: nn.Module, min_count: int = MIN_BLOCKS) -> Blocks | None:
    """The longest ModuleList of ``model`` whose blocks are all identical (at least ``min_count``), or None."""
    best = None
    for name, module in model.named_modules():
        if not name or not isinstance(module, nn.ModuleList) or len(module) < max(min_count, 2):
            continue
        first = _signature(module[0])
        if all(_signature(b) == first for b in list(module)[1:]):
            if best is None or len(module) > best.count:
                best = Blocks(name, len(module))
    return best


def _cut_config(config, count: int, keep: tuple[int, ...]):
    """A copy of a Hugging Face config with the layers ``keep``: num_hidden_layers and per-layer lists cut."""
    cut = copy.copy(config)
    if getattr(cut, "num_hidden_layers", None) == count:
        cut.num_hidden_layers = len(keep)
    for key, value in list(vars(cut).items()):
        if isinstance(value, (list, tuple)) and len(value) == count and key != "architectures":
            setattr(cut, key, type(value)(value[i] for i in keep))
    return cut


def _keep(blocks: Blocks, depth: int | tuple[int, ...]) -> tuple[int, ...]:
    keep = tuple(range(depth)) if isinstance(depth, int) else tuple(depth)
    if not keep or any(b <= a for a, b in zip(keep, keep[1:])) or keep[0] < 0 or keep[-1] >= blocks.count:
        raise ValueError(f"truncated: blocks {keep} are not increasing indices in 0..{blocks.count - 1}")
    return keep


def truncated(model: nn.Module, blocks: Blocks, depth: int | tuple[int, ...]) -> nn.Module:
    """``model`` with only the first ``depth`` blocks of ``blocks`` (or the blocks of the indices ``depth``, in
    order, renumbered from 0); ``model`` itself is not modified and the parameters are shared (see Note [depth
    extrapolation])."""
    keep = _keep(blocks, depth)
    config = getattr(model, "config", None)
    cut_config = _cut_config(config, blocks.count, keep) if hasattr(config, "num_hidden_layers") else None
    parts = blocks.path.split(".")
    root = copy.copy(model)
    root._modules = dict(model._modules)
    parent = root
    for part in parts[:-1]:
        child = copy.copy(parent._modules[part])
        child._modules = dict(child._modules)
        parent._modules[part] = child
        parent = child
    layers = copy.copy(parent._modules[parts[-1]])
    layers._modules = {str(n): _renumbered(layers._modules[str(i)], i, n) for n, i in enumerate(keep)}
    parent._modules[parts[-1]] = layers
    if cut_config is not None:  # every module on the path that reads the config reads the cut one
        for module in _path_modules(root, parts):
            if getattr(module, "config", None) is config:
                module.config = cut_config
    return root


def _renumbered(block: nn.Module, index: int, position: int) -> nn.Module:
    """``block`` (the full model's block ``index``) as the cut model's block ``position``: where a submodule knows
    its block by a ``layer_idx`` (Hugging Face's attention layers: the KV cache is a list indexed by it, sized by
    the cut config's ``num_hidden_layers``), a shallow copy of the block with copies of those submodules and of the
    modules above them, renumbered; else the block itself. A cut that keeps blocks of both ends (the tail kept
    whole after a cut run) would otherwise index the cache with the full model's numbers."""
    if index == position or not any(getattr(m, "layer_idx", None) == index for m in block.modules()):
        return block

    def copied(module: nn.Module) -> nn.Module:
        if not any(getattr(m, "layer_idx", None) == index for m in module.modules()):
            return module
        out = copy.copy(module)
        out._modules = {name: copied(child) if child is not None else None for name, child in module._modules.items()}
        if getattr(module, "layer_idx", None) == index:
            out.layer_idx = position
        return out
    return copied(block)


def _path_modules(root: nn.Module, parts: list[str]) -> Iterable[nn.Module]:
    module = root
    yield module
    for part in parts[:-1]:
        module = module._modules[part]
        yield module


def block_of(name: str, blocks: Blocks) -> tuple[int, str] | None:
    """(block index, the rest of the name) of a qualified name under ``blocks`` ("" for the block itself)."""
    m = re.fullmatch(re.escape(blocks.path) + r"\.(\d+)(\..+)?", name)
    return None if m is None else (int(m.group(1)), m.group(2) or "")


def period_of(names: Iterable[str], blocks: Blocks) -> int | None:
    """The smallest p such that the names under block i are those under block i mod p, for every block (1 when no
    name is under a block); None when there is none shorter than the run's half."""
    per_block: list[set[str]] = [set() for _ in range(blocks.count)]
    for name in names:
        found = block_of(name, blocks)
        if found is not None and found[0] < blocks.count:
            per_block[found[0]].add(found[1])
    for p in range(1, blocks.count // 2 + 1):
        if all(per_block[i] == per_block[i % p] for i in range(blocks.count)):
            return p
    return None


def names_at_depth(names: Iterable[str], blocks: Blocks, depth: int | tuple[int, ...]) -> tuple[str, ...]:
    """``names`` as the model cut to ``depth`` blocks (or to the blocks ``depth``) knows them: those under a block
    not kept dropped, the others renumbered."""
    position = {i: n for n, i in enumerate(_keep(blocks, depth))}
    kept = []
    for name in names:
        found = block_of(name, blocks)
        if found is None:
            kept.append(name)
        elif found[0] in position:
            kept.append(f"{blocks.path}.{position[found[0]]}{found[1]}")
    return tuple(kept)


def periodic_runs(name_lists: Iterable[Iterable[str]], blocks: Blocks,
                  max_period: int = 4) -> tuple[tuple[int, int, int], ...]:
    """(start, end, period) of every maximal run of blocks ``[start, end)`` over which every list of names under
    the blocks repeats with the period (block b's names are block b - period's), for periods up to ``max_period``."""
    lists = [list(names) for names in name_lists]
    signature = []
    for b in range(blocks.count):
        signature.append(tuple(frozenset(f[1] for n in names if (f := block_of(n, blocks)) is not None and f[0] == b)
                               for names in lists))
    runs = []
    for p in range(1, max_period + 1):
        start = 0
        for b in range(p, blocks.count + 1):
            if b == blocks.count or signature[b] != signature[b - p]:
                runs.append((start, b, p))
                start = b - p + 1
    return tuple(runs)
