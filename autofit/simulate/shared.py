"""Simulations shared between plans for several cards (Note [one analysis for several cards]).

Note [one analysis for several cards]
    A simulation runs on the CPU, on fake tensors; the card a plan targets enters it only through the device's rules
    (``DeviceTarget.simulation_rules``: on CUDA, the attention kernel ``sdpa_backend`` picks from the compute
    capability, autocast's op policy and CUDA's softmax branch) and the card's name carried in ``StepConfig.gpu``.
    Everything after it is the card's: the caching allocator and its workspaces (``DeviceTarget.estimate``), the
    memory model's calibration (``memory_terms``), the time model (the card's FLOP rate and bandwidth), the budget.
    So cards whose rules agree (``DeviceTarget.simulation_key``: the same platform and the same choices of
    attention kernel) run the same simulation of the same step, byte for byte, and ``autofit.compare`` plans them
    one after another inside :func:`sharing`, where the analysis (``analyse_model``) and each full simulation
    (``simulate_step``) of a step already run for one card are answered from here for the next. Each card's plan is
    still the planner's own, stage by stage; only the work it would repeat is skipped.
    The key is the step as the simulation reads it: the model (its modules' names and types and its parameters, by
    identity: a cut model shares the whole model's parameters, Note [depth extrapolation]), the inputs (their
    tensors by identity, shape and dtype), the loss, the ``StepConfig`` without the card's name, and the rules'
    key. The memo keeps every object its keys name alive, so an identity is never reused while it is in use; it
    lives for one :func:`sharing` block. A simulation that a forked worker runs (Note [parallel simulations],
    autofit/core/workers.py: the cut models of a depth extrapolation) is answered from the memo when it is there,
    but one it computes stays in the worker; the analyses and the simulations of whole models run in this process.
    A step whose config or loss cannot be hashed is simulated each time, as without sharing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch.utils import _pytree as pytree

__all__ = ["sharing", "shared", "SharedStats"]

T = TypeVar("T")


@dataclasses.dataclass
class SharedStats:
    """How often each stage ran (``computed``) and was answered from the memo (``reused``), by stage name."""

    computed: dict[str, int] = dataclasses.field(default_factory=dict)
    reused: dict[str, int] = dataclasses.field(default_factory=dict)


class _Memo:
    def __init__(self) -> None:
        self.values: dict[tuple, Any] = {}
        self.alive: list[Any] = []  # what the keys name by identity, kept alive (Note [one analysis for several cards])
        self.stats = SharedStats()


_ACTIVE: _Memo | None = None


@contextlib.contextmanager
def sharing() -> Iterator[SharedStats]:
    """Inside this block, :func:`shared` answers a stage already run for the same step from memory (Note [one
    analysis for several cards]); yields the counts of stages run and reused. Blocks do not nest (the inner one
    shares the outer's memo)."""
    global _ACTIVE
    if _ACTIVE is not None:
        yield _ACTIVE.stats
        return
    _ACTIVE = _Memo()
    try:
        yield _ACTIVE.stats
    finally:
        _ACTIVE = None


def _model_key(model: torch.nn.Module) -> tuple:
    return (tuple((name, type(m)) for name, m in model.named_modules()), tuple(id(p) for p in model.parameters()))


def _leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        return ("tensor", id(leaf), tuple(leaf.shape), leaf.dtype, leaf.device.type)
    try:
        hash(leaf)
        return leaf
    except TypeError:
        return ("object", id(leaf))


def _batch_key(batch: Any) -> tuple:
    if batch is None:
        return (None,)
    leaves, spec = pytree.tree_flatten((batch.args, batch.kwargs) if hasattr(batch, "args") else batch)
    extra = tuple(getattr(batch, f, None) for f in ("size", "kind", "shared", "batch_dim"))
    return (str(spec), tuple(_leaf_key(leaf) for leaf in leaves), extra)


def _rules_key(device_rules: Any) -> Any:
    """The device's simulation key (``DeviceTarget.simulation_key``) of the bound ``simulation_rules``; None where the
    rules say nothing of themselves (then nothing is shared)."""
    if device_rules is None:
        return ("no device rules",)
    owner = getattr(device_rules, "__self__", None)
    return getattr(owner, "simulation_key", None)


def shared(stage: str, compute: Callable[[], T], *, model: torch.nn.Module, batch: Any, target: Any, loss_fn: Any,
           config: Any, device_rules: Any, extra: tuple = ()) -> T:
    """``compute()``, or inside :func:`sharing` its value for the same step computed before (Note [one analysis for
    several cards]). Outside a sharing block it only calls ``compute``."""
    memo = _ACTIVE
    if memo is None:
        return compute()
    rules = _rules_key(device_rules)
    try:
        step = dataclasses.replace(config, gpu=None) if dataclasses.is_dataclass(config) else config
        key = (stage, rules, _model_key(model), _batch_key(batch), _batch_key(target), loss_fn, step, extra)
        hash(key)
    except TypeError:  # an unhashable config or loss: not shared
        key = None
    if rules is None or key is None:
        return compute()
    if key in memo.values:
        memo.stats.reused[stage] = memo.stats.reused.get(stage, 0) + 1
        return memo.values[key]
    value = compute()
    memo.values[key] = value
    memo.alive.append((model, batch, target, loss_fn, config))
    memo.stats.computed[stage] = memo.stats.computed.get(stage, 0) + 1
    return value
