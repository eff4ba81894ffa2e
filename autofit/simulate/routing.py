"""Mixture-of-experts routing in the real-run fallback: run per-expert loops with the heaviest routing measured.

See Note [MoE routing] in run.py. transformers' experts modules (``@use_experts_implementation`` in
transformers/integrations/moe.py) are called as ``experts(hidden_states, top_k_index, top_k_weights)``. With the
``eager`` implementation they loop over the experts that were hit and their peak depends on ``top_k_index``; the
real run would only see the sample's routing. During a real-run simulation a forward pre-hook on each such module
replaces ``top_k_index`` by :func:`heavy_routing`; the router, its weights and every gradient stay as they were.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["heavy_routing", "per_expert_loops", "heavy_routing_during"]


def heavy_routing(tokens: int, top_k: int, experts: int) -> torch.Tensor:
    """``(tokens, top_k)`` expert indices: every token sends its first choice to expert 0 (which the loop runs first
    in forward and its gradients last in backward, so it receives every token), and its other choices round-robin
    over the remaining experts, so every expert is hit. Of the routings measured on Mixtral (every token to the same
    two experts, balanced round-robin, a random batch, all tokens to the last expert), this one peaks highest
    (docs/memory-model.md, "Mixture of experts: routing"); it is the heaviest measured, not a proven bound."""
    rows = []
    for t in range(tokens):
        others = [1 + (t * (top_k - 1) + j) % (experts - 1) for j in range(top_k - 1)] if experts > 1 else []
        rows.append([0, *others])
    return torch.tensor(rows, dtype=torch.long)


def per_expert_loops(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """transformers experts modules that run the per-expert loop (``experts_implementation="eager"``)."""
    found = []
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if (isinstance(getattr(module, "num_experts", None), int) and hasattr(module, "_apply_gate")
                and getattr(config, "_experts_implementation", None) == "eager"):
            found.append((name, module))
    return found


@contextlib.contextmanager
def heavy_routing_during(model: nn.Module) -> Iterator[list[str]]:
    """Route every per-expert loop of ``model`` with :func:`heavy_routing` while the context is open; yields the
    names of the modules rerouted."""

    def reroute(module, args, kwargs):
        hidden, index, *rest = args
        if index.dim() != 2 or index.shape[1] > module.num_experts:
            return None
        heavy = heavy_routing(index.shape[0], index.shape[1], module.num_experts).to(index.device, index.dtype)
        return (hidden, heavy, *rest), kwargs

    loops = per_expert_loops(model)
    handles = [m.register_forward_pre_hook(reroute, with_kwargs=True) for _, m in loops]
    try:
        yield [name for name, _ in loops]
    finally:
        for h in handles:
            h.remove()
