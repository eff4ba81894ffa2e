"""What the user's hooks keep during autofit's step, given back as it was (Note [user hooks]).

Note [user hooks]
    A hook registered on the user's model (``register_forward_hook`` and the like) travels with autofit's copy of it:
    the copy's hook dictionaries hold the same functions, and those functions reach the user's own objects (a list
    in a closure, a module-level dict, the attributes of the object a bound method belongs to). A feature-extraction
    hook that keeps outputs (``feats.append(out)``) therefore runs in the simulated step, as it must: what it keeps
    stays alive, and the estimate counts it, as the allocator does in a real step. But it would leave autofit's
    tensors in the user's objects: fake tensors after ``estimate`` and ``plan`` (``.item()`` on one raises), the
    copy's real tensors after ``measure``. So before the step, every mutable container a hook can reach (its closure
    cells, the globals its code names, the ``__dict__`` of its bound object, a ``functools.partial``'s arguments,
    and the lists, dicts and sets inside those, a few levels deep) is snapshotted, and afterwards each is put back
    in place, as it was; the estimate's notes name the hooks that kept tensors. Hooks that keep tensors somewhere
    else (an attribute of an object that is neither of those, a file) are not seen.

Note [kept across steps]
    What a hook keeps in one step is still there when the next step starts, until the hook replaces it: a hook that
    stores the gradient reaching the first layer (``self.grad = grad_output[0]``, a tensor hook doing the same) keeps
    the previous step's gradient alive through the whole forward and most of the backward of the next one. A step
    simulated once, from hooks that held nothing yet, missed that term: 10 % under the real steady-state step of an
    MLP whose first layer's backward hook keeps its output gradient (1 MiB of 8.6 MiB). So where a hook kept tensors
    (``HookRecord.slots``: each place it wrote, and the shapes it wrote there), the step is simulated once more with
    each place holding, before the step, tensors of those shapes, counted as alive before the step (``PreviousStep``):
    an attribute, a dict key or a closure variable holds the previous step's value until the hook replaces it (then it
    is freed where the real step frees it), and a list holds what it held plus the previous step's appended tensors. A
    hook that appends every step makes memory grow without end; the estimate counts one earlier step's tensors, and
    its note says by how much a step grows it.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from autofit.core._torch import pytree
from autofit.core._torch_interrupts import interrupts_at_safe_points

__all__ = ["user_hooks_restored", "HookRecord", "hook_note", "entry_keeps_hooks", "restores_user_hooks", "PreviousStep"]

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
T = TypeVar("T")
_DEPTH = 3  # containers inside containers followed this deep


@dataclass(frozen=True)
class _Spec:
    """The shape of a kept tensor, without the tensor (Note [kept across steps])."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        extent = 1 + sum((n - 1) * st for n, st in zip(self.shape, self.stride)) if all(self.shape) else 0
        return extent * self.dtype.itemsize


@dataclass(frozen=True)
class _Slot:
    """A place a hook wrote tensors into during the step (Note [kept across steps])."""

    container: Any  # a list, a dict, a plain object, or a closure cell
    key: Any  # the dict key or attribute name; None for a list or a cell
    kept: Any  # what it held at the end, each tensor as a _Spec (for a list: the items appended)
    before: Any = None  # a list's items before the step

    @property
    def appends(self) -> bool:
        return isinstance(self.container, list)


def _specs(value: Any) -> Any:
    return pytree.tree_map_only(torch.Tensor, lambda t: _Spec(tuple(t.shape), tuple(t.stride()), t.dtype), value)


class HookRecord:
    """Filled on exit: the hooks whose reachable state took tensors during the step, and where they put them."""

    def __init__(self) -> None:
        self.kept: list[str] = []
        self.slots: list[_Slot] = []

    def growth_bytes(self) -> int:
        """Bytes a step adds for good: the tensors appended to lists (Note [kept across steps])."""
        return sum(spec.nbytes for slot in self.slots if slot.appends
                   for spec in pytree.tree_leaves(slot.kept) if isinstance(spec, _Spec))


class PreviousStep:
    """Puts into each place a hook wrote what a previous step left there, as tensors counted alive before the step
    (Note [kept across steps]). ``fill`` runs where the step's tensors are made (inside the fake mode of a fake
    simulation), before the step, and again before each simulation of the same step."""

    def __init__(self, record: HookRecord) -> None:
        self.slots = list(record.slots)

    def fill(self, register: Callable[[torch.Tensor], Any]) -> None:
        """Fill every slot; ``register(tensor)`` counts each tensor made as alive before the step."""
        def make(spec: _Spec) -> torch.Tensor:
            t = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="cpu")
            register(t)
            return t

        for slot in self.slots:
            value = pytree.tree_map_only(_Spec, make, slot.kept)
            if slot.appends:
                slot.container[:] = list(slot.before) + list(value)
            elif isinstance(slot.container, types.CellType):
                slot.container.cell_contents = value
            elif isinstance(slot.container, dict):
                slot.container[slot.key] = value
            else:
                setattr(slot.container, slot.key, value)


def _hooks(model: Any) -> list[tuple[str, Any]]:
    found = []
    if not isinstance(model, nn.Module):  # refused by the entry point's own checks
        return found
    for name, module in model.named_modules():
        for attr in _HOOK_DICTS:
            for hook in getattr(module, attr, {}).values():
                found.append((f"{attr[1:-1].replace('_', ' ')} on {name or 'the model'!r}", hook))
    return found


def _roots(hook: Any) -> tuple[list[Any], list[types.CellType]]:
    """The objects a hook reaches (partial arguments, its bound or callable object, the globals its code names) and
    its closure cells."""
    objects: list[Any] = []
    cells: list[types.CellType] = []
    while isinstance(hook, functools.partial):
        objects += [*hook.args, *hook.keywords.values()]
        hook = hook.func
    if isinstance(hook, types.MethodType):
        objects.append(hook.__self__)
        hook = hook.__func__
    elif not isinstance(hook, types.FunctionType) and hasattr(hook, "__dict__"):
        objects.append(hook)  # a callable object
        hook = getattr(type(hook), "__call__", None)
    if isinstance(hook, types.FunctionType):
        cells += list(hook.__closure__ or ())
        names = _global_names(hook.__code__)
        objects += [hook.__globals__[n] for n in names if n in hook.__globals__]
    return objects, cells


def _global_names(code: types.CodeType) -> list[str]:
    """The global names ``code`` and the functions defined in it use: a forward hook that registers a tensor hook
    (``out.register_hook(lambda g: store.append(g))``) reaches ``store`` through the lambda's code."""
    names = list(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names += _global_names(const)
    return names


def _mutable(value: Any) -> bool:
    return isinstance(value, (list, dict, set)) or (
        hasattr(value, "__dict__") and not isinstance(value, (type, types.ModuleType, types.FunctionType, nn.Module,
                                                              torch.Tensor)))


def _snapshot(value: Any, seen: dict[int, tuple[Any, Any]], depth: int) -> None:
    if depth < 0 or id(value) in seen or not _mutable(value):
        return
    if isinstance(value, list):
        seen[id(value)] = (value, list(value))
        children = list(value)
    elif isinstance(value, dict):
        seen[id(value)] = (value, dict(value))
        children = list(value.values())
    elif isinstance(value, set):
        seen[id(value)] = (value, set(value))
        children = []
    else:
        seen[id(value)] = (value, dict(vars(value)))
        children = list(vars(value).values())
    for child in children:
        _snapshot(child, seen, depth - 1)


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (list, tuple, set)):
        return any(isinstance(v, torch.Tensor) for v in value)
    if isinstance(value, dict):
        return any(isinstance(v, torch.Tensor) for v in value.values())
    return False


def _restore(value: Any, before: Any, slots: list[_Slot]) -> bool:
    """Put ``value`` back as ``before`` (in place); True when it had taken a tensor (compared by identity: ``==`` on
    tensors is elementwise). Where it took one is added to ``slots`` (Note [kept across steps])."""
    if isinstance(value, list):
        kept = {id(v) for v in before}
        new = [v for v in value if id(v) not in kept and _holds_tensor(v)]
        took = bool(new)
        if took:
            slots.append(_Slot(value, None, _specs(new), list(before)))
        value[:] = before
    elif isinstance(value, set):
        took = any(v not in before and _holds_tensor(v) for v in value)
        value.clear()
        value.update(before)
    else:
        now = value if isinstance(value, dict) else vars(value)
        changed = [(k, v) for k, v in list(now.items()) if (k not in before or before[k] is not v) and _holds_tensor(v)]
        took = bool(changed)
        slots += [_Slot(value, k, _specs(v)) for k, v in changed]
        if isinstance(value, dict):
            value.clear()
            value.update(before)
        else:
            for key in [k for k in now if k not in before]:
                delattr(value, key)
            for key, v in before.items():
                if now.get(key, before) is not v:
                    setattr(value, key, v)
    return took


@contextlib.contextmanager
def user_hooks_restored(model: nn.Module) -> Iterator[HookRecord]:
    """The state the hooks of ``model`` reach, put back on exit as it was on entry (See Note [user hooks])."""
    record = HookRecord()
    hooks = _hooks(model)
    if not hooks:
        yield record
        return
    watched: list[tuple[str, dict[int, tuple[Any, Any]], list[tuple[types.CellType, Any]]]] = []
    for where, hook in hooks:
        objects, cells = _roots(hook)
        seen: dict[int, tuple[Any, Any]] = {}
        cell_values = []
        for cell in cells:
            try:
                content = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            cell_values.append((cell, content))
            _snapshot(content, seen, _DEPTH)
        for obj in objects:
            _snapshot(obj, seen, _DEPTH)
        watched.append((where, seen, cell_values))
    try:
        yield record
    finally:
        for where, seen, cell_values in watched:
            took = False
            for cell, content in cell_values:
                if cell.cell_contents is not content:
                    if _holds_tensor(cell.cell_contents):
                        took = True
                        record.slots.append(_Slot(cell, None, _specs(cell.cell_contents)))
                    cell.cell_contents = content
            for value, before in seen.values():
                took |= _restore(value, before, record.slots)
            if took and where not in record.kept:
                record.kept.append(where)


def hook_note(record: HookRecord) -> str:
    """The note of a step whose hooks kept tensors."""
    note = (f"{', '.join(record.kept)} kept tensors during the step: they are counted, as in a real step, with what "
            "the previous step kept alive until the hooks replace it (see Note [kept across steps]), and what the "
            "hooks reach was put back as it was before (see Note [user hooks])")
    grows = record.growth_bytes()
    if grows:
        note += (f"; hooks append {grows:,} B to lists every step, so memory grows by that much a step without end "
                 "(the estimate counts one earlier step's)")
    return note


@contextlib.contextmanager
def entry_keeps_hooks(model: nn.Module) -> Iterator[None]:
    """What an entry point runs inside: every pass over ``model``, simulated or real, leaves what its hooks reach as
    it was (See Note [user hooks]), and Ctrl-C comes only where it leaves nothing half done, this restore included
    (Note [Ctrl-C at safe points])."""
    with interrupts_at_safe_points(), user_hooks_restored(model):
        yield


def restores_user_hooks(entry: Callable[..., T]) -> Callable[..., T]:
    """An entry point (``estimate``, ``measure``, ``make_request``, ``analyse``) run inside
    :func:`entry_keeps_hooks`; the model is its first argument."""
    @functools.wraps(entry)
    def wrapped(*args: Any, **kwargs: Any) -> T:
        with entry_keeps_hooks(args[0] if args else kwargs.get("model")):
            return entry(*args, **kwargs)
    return wrapped
