"""The traced graph of the model's forward, every node attributed to the module calls it ran in.

Capture tries, in order (see Note [capture fallbacks]):
1. ``torch.fx.symbolic_trace``: a module-level FX graph (torch.nn built-ins stay ``call_module`` leaves);
2. a dispatch-level recording on the fake copy (``dispatch_trace.py``): an aten-level FX graph, for forwards symbolic
   tracing cannot follow (Hugging Face style models, dict inputs, Python control flow on shapes);
3. the same recording on a real copy, for code that reads tensor values (``.item()``, data-dependent branches),
   which no value-free trace can follow. Needs real weights.
Every node carries ``node.meta["nn_module_stack"]`` in FX's own format, so every node names the module calls it
belongs to: an entry ``{"layers.0@1": ("layers.0", cls)}`` marks the second call of ``layers.0``.

Note [capture fallbacks]
    symbolic_trace fails on Python control flow over tensors (``if x.shape[0] > 1`` included), on ``**kwargs``
    forwards and on most Hugging Face models. ``make_fx`` would follow shapes but refuses ``.item()`` even on real
    tensors, so the fallback records the aten ops itself: it runs the real Python code and needs nothing from it
    but that it runs.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import networkx as nx
import torch
import torch.fx as fx
from torch import nn

from autofit.core._torch import DATA_DEPENDENT_ERRORS, FakeTensorMode
from autofit.training.batch import Batch
from autofit.capture.dispatch_trace import record_forward
from autofit.capture.model_copy import fake_copy, fake_input, real_copy, require_real_inputs
from autofit.core.errors import UnsupportedModelError

__all__ = ["ModuleCall", "Graph", "capture_graph"]


@dataclass(frozen=True)
class ModuleCall:
    """One call of a module during forward: ``key`` is the qualified name, suffixed ``@k`` for its k-th repeat."""

    name: str
    key: str
    nodes: tuple[str, ...]  # names of the graph nodes that ran inside the call, in execution order
    outputs: tuple[str, ...] | None = None  # nodes whose tensors the call returned (None: not recorded)


@dataclass(frozen=True)
class Graph:
    graph: fx.Graph
    method: str  # "symbolic_trace", "dispatch" (fake tensors) or "dispatch-real"
    calls: tuple[ModuleCall, ...]

    def to_networkx(self) -> nx.DiGraph:
        """Data flow between nodes: an edge u -> v when v reads u's output."""
        g = nx.DiGraph()
        for node in self.graph.nodes:
            g.add_node(node.name, op=node.op)
            for used in node.all_input_nodes:
                g.add_edge(used.name, node.name)
        return g


def capture_graph(model: nn.Module, batch: Batch) -> Graph:
    """Trace ``model``'s forward on ``batch`` without touching ``model``."""
    errors = []
    try:
        traced = fx.symbolic_trace(copy.deepcopy(_skeleton(model)), concrete_args=None) if not batch.kwargs \
            else None
    except Exception as e:  # noqa: BLE001 - any failure just means the next tracer is tried
        traced, _ = None, errors.append(f"symbolic_trace: {type(e).__name__}")
    if traced is not None and _has_module_stacks(traced.graph):
        return Graph(traced.graph, "symbolic_trace", _module_calls(traced.graph))
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    work = fake_copy(model, fake_mode)
    try:
        with fake_mode:
            graph, outputs = record_forward(work, batch.map_tensors(lambda t: fake_input(fake_mode, t)))
        return Graph(graph, "dispatch", _module_calls(graph, outputs))
    except DATA_DEPENDENT_ERRORS:
        pass  # reads tensor values: trace a real copy below
    require_real_inputs(batch, reader="the forward depends on tensor values")
    try:
        work = real_copy(model).cpu()
    except UnsupportedModelError as e:
        raise UnsupportedModelError(f"the forward depends on tensor values, so it can only be traced with real "
                                    f"weights: {e}") from e
    graph, outputs = record_forward(work, batch.map_tensors(lambda t: t.cpu()))
    return Graph(graph, "dispatch-real", _module_calls(graph, outputs))


def _skeleton(model: nn.Module) -> nn.Module:
    """symbolic_trace never reads tensor values, so trace a copy whose tensors are on the meta device (no memory)."""
    memo = {id(t): nn.Parameter(torch.empty_like(t, device="meta"), requires_grad=t.requires_grad)
            for t in model.parameters()}
    memo.update({id(t): torch.empty_like(t, device="meta") for t in model.buffers()})
    return copy.deepcopy(model, memo)


def _has_module_stacks(graph: fx.Graph) -> bool:
    return any(n.meta.get("nn_module_stack") for n in graph.nodes)


def _module_calls(graph: fx.Graph, outputs: dict[str, tuple[str, ...]] | None = None) -> tuple[ModuleCall, ...]:
    members: dict[str, tuple[str, list[str]]] = {}
    for node in graph.nodes:
        for key, value in (node.meta.get("nn_module_stack") or {}).items():
            fqn = value[0] if isinstance(value, tuple) else str(value)
            members.setdefault(key, (fqn, []))[1].append(node.name)
    outputs = outputs or {}
    return tuple(ModuleCall(name, key, tuple(nodes), outputs.get(key))
                 for key, (name, nodes) in members.items() if name)
