"""Which module is running: forward hooks on a copy of the model push and pop qualified names on a stack.

Installed only on autofit's own copies, never on the user's model. A forward that raises leaves its entry on the
stack, which is how errors name the innermost module that failed.

Inside a compiled region (dynamo tracing a simulated ``torch.compile``) the hooks do nothing: what they observe
(autograd nodes, storages) would break dynamo's graph at every module, so the simulation would compile a graph per
module where the user's step compiles one, and leave dynamo's cache entries on code objects real runs share
(the user's ``forward``, ``nn.Linear.forward``). A compiled module is one call at its boundary, as inductor runs it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["install_module_stack"]


def install_module_stack(
    model: nn.Module, stack: list[str], *, on_exit: Callable[[str, nn.Module, object, object], None] | None = None,
    on_enter: Callable[[str, nn.Module, tuple, dict], None] | None = None,
) -> list[RemovableHandle]:
    handles: list[RemovableHandle] = []
    for name, module in model.named_modules():
        if not name:
            continue

        def pre(mod, args, kwargs, name=name):
            if torch.compiler.is_compiling():
                return
            stack.append(name)
            if on_enter is not None:
                on_enter(name, mod, args, kwargs)

        def post(mod, args, kwargs, output, name=name):
            if torch.compiler.is_compiling():
                return
            if on_exit is not None:
                on_exit(name, mod, args, output)
            if stack and stack[-1] == name:
                stack.pop()

        handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(module.register_forward_hook(post, with_kwargs=True))
    return handles
