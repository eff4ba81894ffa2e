"""Record a forward as an aten-level FX graph by watching the dispatcher (the fallback of ``graph.py``).

Each aten op becomes a ``call_function`` node whose arguments point at the nodes that produced its tensor inputs;
tensors nobody produced (parameters, buffers, inputs) become placeholders. ``nn_module_stack`` is filled from forward
hooks on the (copied) model in the same format FX's tracer uses, so the analysis treats both graphs alike.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from autofit.core._torch import TorchDispatchMode, pytree
from autofit.core._torch_interrupts import interruption_point
from autofit.core._torch_compile import compiled_code_runs_eagerly
from autofit.training.batch import Batch
from autofit.capture.module_stack import install_module_stack
from autofit.capture.corrections import fake_kernel

__all__ = ["record_forward"]


class _Recorder(TorchDispatchMode):
    def __init__(self, names: dict[int, str]) -> None:
        super().__init__()
        self.graph = fx.Graph()
        self.producer = WeakTensorKeyDictionary()  # tensor -> node that produced it
        self.names = names  # id(tensor) -> parameter / buffer name, for readable placeholders
        self.stack: list[tuple[str, str, type]] = []  # (key, qualified name, class) of running module calls
        self.calls: dict[str, int] = {}
        self.call_outputs: dict[str, tuple[str, ...]] = {}  # call key -> nodes producing the returned tensors

    def enter(self, name: str, module: nn.Module, *_: object) -> None:
        count = self.calls.get(name, 0)
        self.calls[name] = count + 1
        self.stack.append((name if count == 0 else f"{name}@{count}", name, type(module)))

    def exit(self, name: str, module: nn.Module, args: object, output: object) -> None:
        if self.stack and self.stack[-1][1] == name:
            key = self.stack.pop()[0]
            produced = [self.producer.get(t) for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
            self.call_outputs[key] = tuple(n.name for n in produced if n is not None)

    def _node_for(self, t: torch.Tensor) -> fx.Node:
        node = self.producer.get(t)
        if node is None:
            node = self.graph.placeholder(self.names.get(id(t), "input").replace(".", "_"))
            self.producer[t] = node
        return node

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace != "prim":  # a metadata query may come from C++ that cannot pass an exception on
            interruption_point()  # Note [Ctrl-C at safe points]
        replacement = fake_kernel(func, args, kwargs)  # fake kernels stricter than the CPU's (autofit/capture/corrections.py)
        out = replacement(*args, **kwargs) if replacement is not None else func(*args, **kwargs)
        if func.namespace == "prim":
            return out
        node_args, node_kwargs = pytree.tree_map_only(torch.Tensor, self._node_for, (args, kwargs))
        node = self.graph.call_function(func, tuple(node_args), dict(node_kwargs))
        node.meta["nn_module_stack"] = {key: (fqn, cls) for key, fqn, cls in self.stack}
        for leaf in pytree.tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self.producer[leaf] = node
        return out


def record_forward(model: nn.Module, batch: Batch) -> tuple[fx.Graph, dict[str, tuple[str, ...]]]:
    """Run ``model`` on ``batch`` once; return the recorded graph and, per module call, the nodes it returned.
    The model must be autofit's own copy (hooks are added for the duration)."""
    names = {id(t): n for n, t in model.named_parameters()}
    names.update({id(t): n for n, t in model.named_buffers()})
    recorder = _Recorder(names)
    handles = install_module_stack(model, [], on_enter=recorder.enter, on_exit=recorder.exit)
    try:
        # compiled code runs eagerly here: under a dispatch mode dynamo would skip the frame and never compile that
        # code again in this process, the user's later real compiles included (Note [inductor without kernels])
        with compiled_code_runs_eagerly(), recorder:
            output = batch.call(model)
    finally:
        for h in handles:
            h.remove()
    outputs = [recorder.producer.get(t) for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    recorder.graph.output(tuple(n for n in outputs if n is not None))
    return recorder.graph, recorder.call_outputs
