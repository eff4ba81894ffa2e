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
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from autofit.core._torch import interrupts_at_safe_points

__all__ = ["user_hooks_restored", "HookRecord", "hook_note", "restores_user_hooks"]

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
T = TypeVar("T")
_DEPTH = 3  # containers inside containers followed this deep


class HookRecord:
    """Filled on exit: the hooks whose reachable state took tensors during the step."""

    def __init__(self) -> None:
        self.kept: list[str] = []


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
        names = hook.__code__.co_names
        objects += [hook.__globals__[n] for n in names if n in hook.__globals__]
    return objects, cells


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


def _restore(value: Any, before: Any) -> bool:
    """Put ``value`` back as ``before`` (in place); True when it had taken a tensor (compared by identity: ``==`` on
    tensors is elementwise)."""
    if isinstance(value, list):
        kept = {id(v) for v in before}
        took = any(id(v) not in kept and _holds_tensor(v) for v in value)
        value[:] = before
    elif isinstance(value, set):
        took = any(v not in before and _holds_tensor(v) for v in value)
        value.clear()
        value.update(before)
    else:
        now = value if isinstance(value, dict) else vars(value)
        took = any((k not in before or before[k] is not v) and _holds_tensor(v) for k, v in list(now.items()))
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
                    took |= isinstance(cell.cell_contents, torch.Tensor)
                    cell.cell_contents = content
            for value, before in seen.values():
                took |= _restore(value, before)
            if took and where not in record.kept:
                record.kept.append(where)


def hook_note(record: HookRecord) -> str:
    """The note of a step whose hooks kept tensors."""
    return (f"{', '.join(record.kept)} kept tensors during the step: they are counted, as in a real step, and what "
            "the hooks reach was put back as it was before (see Note [user hooks])")


def restores_user_hooks(entry: Callable[..., T]) -> Callable[..., T]:
    """An entry point (``estimate``, ``measure``, ``plan``, ``analyse``) whose every pass over the model, simulated or
    real, leaves what the model's hooks reach as it was (See Note [user hooks]); the model is its first argument."""
    @functools.wraps(entry)
    def wrapped(*args: Any, **kwargs: Any) -> T:
        # Ctrl-C only where it leaves nothing half done, this restore included (Note [Ctrl-C at safe points])
        with interrupts_at_safe_points(), user_hooks_restored(args[0] if args else kwargs.get("model")):
            return entry(*args, **kwargs)
    return wrapped
