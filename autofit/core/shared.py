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
    The key is the step as the simulation reads it: the model (its modules' names and classes, and its parameters by
    identity: a cut model holds the whole model's parameters, Note [depth extrapolation]), the inputs (a real tensor
    by its bytes, a meta tensor by its shape and dtype), the loss by identity, the ``StepConfig`` without the card's
    name (a factory built as ``functools.partial`` by what it calls: the optimizer's is built anew per request), and
    the rules' key. The memo keeps every object its keys name by identity alive, so an identity is never reused
    while it is in use; it lives for one :func:`sharing` block. A forked worker (Note [parallel simulations],
    autofit/core/workers.py: the analysis' two sizes, the cut models of a depth extrapolation) starts with the memo
    as it was and sends what it computed back with its result (:func:`taken`, :func:`merge`): its keys name the
    parent's parameters at the same addresses, and an input it made itself is keyed by its bytes (one keyed by
    identity is not sent). A step whose config cannot be hashed is simulated each time, as without sharing, and
    so is a step that reads values of the sample's rows (its program of those reads, Note [rows that differ],
    solve/estimator.py, does not copy). Every answer is a fresh copy (the memo keeps the pickle, as a worker sends
    it): a later stage may keep state on the simulation it is handed (the caching allocator replayed under a
    budget), and a second card handed the same object saw it. Measured: Llama-3-8B QLoRA (axolotl_qlora_8b.yml)
    on the RTX-4090 came out 60 MiB higher from the comparison than from its single plan until then (measured
    before the load effect below was known, so perhaps that effect too).
    The memo pickles with torch's operators named, not copied (:class:`_Pickler`): an analysis' traced graph names
    each op it ran, and pickled by value an ``OpOverload`` drags in its dispatch table, whose decorated
    decompositions do not pickle; the analysis of every model trained with a cross-entropy loss then went unshared.
    A row can still differ from its card's single plan run at another moment, and so can two single plans: the
    checkpoint MILP of a model with hundreds of recomputable units stops at a wall-clock limit (solve/
    checkpoint_milp.py), and the incumbent it holds then depends on the machine's load. Measured on
    axolotl_qlora_8b.yml, RTX-4090 at 90 %, one command three times with nothing shared: 22,372,417,536,
    22,800,236,544 and 23,192,403,968 B on the device (33, 37 and 43 modules recomputed), two of its MILPs (1,317
    and 835 units) stopped by the limit in each run. That, not the sharing, is what set a shared row 428 MB below
    an earlier single plan (the analysis was not shared for a while because of it).
    What stays per card is what the card changes: the search's checkpoint MILPs (its memory and time models), and
    the verification of a configuration no card before it chose (benchmarks/compare_cards.py times one plan
    against the comparison).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import pickle
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from autofit.core._torch import op_by_name, op_named, pytree

__all__ = ["sharing", "shared", "SharedStats", "forked", "taken", "merge"]

T = TypeVar("T")


@dataclasses.dataclass
class SharedStats:
    """How often each stage ran (``computed``) and was answered from the memo (``reused``), by stage name."""

    computed: dict[str, int] = dataclasses.field(default_factory=dict)
    reused: dict[str, int] = dataclasses.field(default_factory=dict)


class _Memo:
    def __init__(self) -> None:
        self.values: dict[tuple, Any] = {}
        self.order: list[tuple] = []  # keys in the order computed; a forked worker sends back those after ``since``
        self.since = 0
        self.alive: list[Any] = []  # what the keys name by identity, kept alive (Note [one analysis for several cards])
        self.stats = SharedStats()

    def store(self, key: tuple, value: Any, stage: str) -> None:
        self.values[key] = value
        self.order.append(key)
        self.stats.computed[stage] = self.stats.computed.get(stage, 0) + 1


_ACTIVE: _Memo | None = None
_CONTENT_LIMIT = 64 << 20  # a real input tensor up to this size is keyed by its bytes, a larger one by identity


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


def forked() -> None:
    """In a forked worker: what this process computes from here on is what :func:`taken` sends back."""
    if _ACTIVE is not None:
        _ACTIVE.since = len(_ACTIVE.order)


def taken() -> bytes:
    """In a forked worker: the stages it computed, pickled for the parent's :func:`merge` (b"" when none, or when
    they do not pickle: the parent then only misses the chance to reuse them)."""
    if _ACTIVE is None:
        return b""
    entries = [(k, _ACTIVE.values[k]) for k in _ACTIVE.order[_ACTIVE.since:] if _portable(k)]
    try:
        return pickle.dumps(entries, protocol=pickle.HIGHEST_PROTOCOL) if entries else b""
    except Exception:  # noqa: BLE001 - a key or value that does not pickle: nothing shared, nothing wrong
        return b""


def merge(data: bytes) -> None:
    """In the parent: a worker's stages (:func:`taken`), kept as if computed here."""
    if _ACTIVE is None or not data:
        return
    try:
        entries = pickle.loads(data)
    except Exception:  # noqa: BLE001
        return
    for key, value in entries:
        if key not in _ACTIVE.values:
            _ACTIVE.store(key, value, key[0])


def _portable(key: tuple) -> bool:
    """Whether ``key`` names only what the parent holds too: the model's parameters (a forked worker's are the
    parent's, at the same addresses) and inputs keyed by their bytes, not an object of the worker's own."""
    return "by identity" not in repr(key[3:5])


def _model_key(model: torch.nn.Module) -> tuple:
    # modules by name and class name, parameters by identity: a cut model holds the whole model's parameters
    return (tuple((name, type(m).__module__, type(m).__qualname__) for name, m in model.named_modules()),
            tuple(id(p) for p in model.parameters()))


def _leaf_key(leaf: Any) -> Any:
    if isinstance(leaf, torch.Tensor):
        head = ("tensor", tuple(leaf.shape), str(leaf.dtype), leaf.device.type, leaf.requires_grad)
        real = leaf.device.type == "cpu" and not _is_fake(leaf)
        if real and leaf.numel() * leaf.element_size() <= _CONTENT_LIMIT:
            data = leaf.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
            return (*head, hashlib.blake2b(data, digest_size=16).hexdigest())
        return (*head, "by identity", id(leaf)) if real else head  # a meta tensor has no values
    if isinstance(leaf, (str, int, float, bool, type(None))):
        return leaf
    return ("by identity", id(leaf))


def _is_fake(t: torch.Tensor) -> bool:
    return type(t).__name__ == "FakeTensor"


def _batch_key(batch: Any) -> tuple:
    if batch is None:
        return (None,)
    leaves, spec = pytree.tree_flatten((batch.args, batch.kwargs) if hasattr(batch, "args") else batch)
    extra = tuple(repr(getattr(batch, f, None)) for f in ("size", "kind", "shared", "batch_dim"))
    return (str(spec), tuple(_leaf_key(leaf) for leaf in leaves), extra)


def _step_key(config: Any) -> Any:
    """The step's fields but the card's name (``gpu``); a factory built as ``functools.partial`` (the optimizer's:
    a new one per request) by what it calls."""
    if not dataclasses.is_dataclass(config):
        return config
    return tuple((f.name, _callable_key(getattr(config, f.name))) for f in dataclasses.fields(config)
                 if f.name != "gpu")


def _callable_key(value: Any) -> Any:
    if isinstance(value, functools.partial):
        return ("partial", _callable_key(value.func), tuple(_callable_key(a) for a in value.args),
                tuple(sorted((k, _callable_key(v)) for k, v in value.keywords.items())))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__, tuple((f.name, _callable_key(getattr(value, f.name)))
                                                for f in dataclasses.fields(value)))
    return value


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
        step = _step_key(config)
        # the loss by identity: the caller's object, alive in the parent of a forked worker too
        key = (stage, rules, _model_key(model), _batch_key(batch), _batch_key(target), id(loss_fn), step, extra)
        hash(key)
    except TypeError:  # an unhashable config: not shared
        key = None
    if rules is None or key is None:
        return compute()
    if key in memo.values:
        memo.stats.reused[stage] = memo.stats.reused.get(stage, 0) + 1
        return _fresh(memo.values[key])
    value = compute()
    if getattr(value, "row_reader", None) is not None:  # its program of the rows' reads does not copy: not shared
        return value
    frozen = _frozen(value)
    if frozen is None:  # no copy can be made: a second card handed this object would see the first card's state
        return value
    memo.alive.append((model, batch, target, loss_fn, config))
    memo.store(key, frozen, stage)
    return value


def _frozen(value: Any) -> "_Pickled | None":
    """What the memo keeps of ``value``: its pickle, so that every answer is a fresh copy, as a simulation run again
    would give (a later stage may keep state on what it is handed: the allocator's replay under a budget); None
    where it does not pickle (then it is not shared)."""
    buffer = io.BytesIO()
    try:
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except Exception:  # noqa: BLE001
        return None
    return _Pickled(buffer.getvalue())


class _Pickler(pickle.Pickler):
    """Pickles torch's operators by name, as torch itself holds them: the traced graph of an analysis names each op
    it ran, and pickled by value an ``OpOverload`` drags in its dispatch table, whose decorated decompositions do
    not pickle ("it's not the same object as torch._decomp.decompositions.nll_loss_forward")."""

    def reducer_override(self, obj: Any) -> Any:
        named = op_by_name(obj)
        return (op_named, named) if named is not None else NotImplemented


def _fresh(value: "_Pickled") -> Any:
    return pickle.loads(value.data)


@dataclasses.dataclass(frozen=True)
class _Pickled:
    data: bytes
