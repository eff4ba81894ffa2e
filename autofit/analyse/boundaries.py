"""Which modules may be checkpoint segments, decided on the traced graph with networkx.

A module call is a valid segment when (1) the only tensors leaving it are the ones it returns: nothing it computes
is read later through a side channel (an attribute it stored, a list it appended to), and (2) it writes in place to
no tensor made outside it except buffers (recomputation would see the written value, not the original). Parameters
and buffers entering it are fine. Built-in modules with ``inplace=True`` (``nn.ReLU(inplace=True)``) write to their
input, so they are never segments on their own; the block around them is.
"""

from __future__ import annotations

import networkx as nx
import torch
from torch import nn

from autofit.core._torch import op_schema
from autofit.capture.graph import Graph, ModuleCall

__all__ = ["segment_problems"]


def segment_problems(model: nn.Module, graph: Graph) -> dict[str, str]:
    """Module name -> why it cannot be a checkpoint segment. Modules absent from the result are valid."""
    g = graph.to_networkx()
    nodes = {n.name: n for n in graph.graph.nodes}
    problems: dict[str, str] = {}
    modules = dict(model.named_modules())
    for call in graph.calls:
        module = modules.get(call.name)
        if module is not None and getattr(module, "inplace", False) is True:
            problems.setdefault(call.name, "writes its input in place (inplace=True)")
            continue
        reason = _call_problem(g, nodes, call)
        if reason:
            problems.setdefault(call.name, reason)
    problems[""] = "the whole model is not a segment"
    return problems


def _call_problem(g: nx.DiGraph, nodes: dict, call: ModuleCall) -> str:
    inside = set(call.nodes)
    if call.outputs is not None:
        returned = set(call.outputs)
        # [Constraint] every edge leaving the call starts at a node whose tensor the call returned
        leaks = {u for u, v in nx.edge_boundary(g, inside) if u not in returned and nodes[v].op != "output"}
        if leaks:
            return f"tensors computed inside ({', '.join(sorted(leaks)[:3])}) are used outside it"
    for name in call.nodes:
        node = nodes[name]
        schema = op_schema(node.target)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for arg, spec in zip(node.args, schema.arguments):
            written = spec.alias_info is not None and spec.alias_info.is_write
            if written and isinstance(arg, torch.fx.Node) and arg.name not in inside and arg.op != "placeholder":
                return f"writes in place to a tensor made outside it ({node.name})"
    return ""
