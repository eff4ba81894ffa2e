"""Context parallelism's memory per rank, measured: torch's ``context_parallel`` on this CPU over gloo.

DOCSTRING-PLACEHOLDER
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import record_function  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from autofit.core._torch_profiler import memory_profile, window_memory  # noqa: E402

H, HEADS, FF, SEQ, ROWS, VOCAB, BLOCKS = 64, 4, 128, 256, 2, 64, 2
HD = H // HEADS
_WINDOW, _STEP = "probe::rank_thread", "probe::step"
aten = torch.ops.aten
FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


# ---------------------------------------------------------------------------------------------------------- model
class Block(nn.Module):
    """Pre-norm decoder block: x + proj(sdpa(qkv(ln1 x), causal)), then x + fc2(gelu(fc1(ln2 x)))."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.qkv, self.proj = nn.LayerNorm(H), nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(H), nn.Linear(H, FF), nn.Linear(FF, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, HEADS, HD).permute(2, 0, 3, 1, 4)
        # F.scaled_dot_product_attention looked up at call time: context_parallel patches the module attribute
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, H))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Model(nn.Module):
    def __init__(self, recompute: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.pos = nn.Embedding(VOCAB, H), nn.Embedding(SEQ, H)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm, self.head = nn.LayerNorm(H), nn.Linear(H, VOCAB)
        self.recompute = recompute

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos(pos)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        return F.cross_entropy(self.head(self.norm(x)).reshape(-1, VOCAB), target.reshape(-1))


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    target = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    return ids, torch.arange(SEQ).expand(ROWS, SEQ).contiguous(), target


def _bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


# ------------------------------------------------------------- the CPU handler: torch's ring attention, the CPU op
def _ring_cpu_handler(op_call: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
    """``_sdpa_handler`` (_attention.py) for the CPU flash op and its backward: unwrap the DTensors, propagate the
    sharding (the Shard(2) rules below), run torch's ``_templated_ring_attention`` / ``_backward`` with the CPU op
    as ``op``, wrap the local results. The CPU op returns ``(out, logsumexp)`` and its backward ``(dq, dk, dv)``:
    what the templated code unpacks (``out, logsumexp, *rest = op(...)``, ``grad_query_, grad_key_, grad_value_,
    *rest = op(...)``), so the op goes in as it is; the backward's ``dropout_p`` has no default and is passed."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention, _templated_ring_attention_backward)

    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    output_sharding = op_info.output_sharding
    if output_sharding is None or output_sharding.needs_redistribute:
        raise AssertionError(f"{op_call}: inputs would need a redistribution")
    group = op_info.compute_mesh.get_group()
    a, kw = op_info.local_args, dict(op_info.local_kwargs)
    if op_call is FWD:
        query, key, value, *rest = a
        dropout_p, is_causal = (list(rest) + [0.0, False])[:2] if len(rest) < 2 else rest[:2]
        dropout_p, is_causal = kw.pop("dropout_p", dropout_p), kw.pop("is_causal", is_causal)
        local = _templated_ring_attention(group, 2, FWD, query, key, value, is_causal=is_causal,
                                          dropout_p=dropout_p, **kw)
    else:
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = a
        local = _templated_ring_attention_backward(group, 2, BWD, grad_out=grad_out, grad_out_name="grad_out",
                                                   query=query, key=key, value=value, out=out, logsumexp=logsumexp,
                                                   is_causal=is_causal, dropout_p=dropout_p, **kw)
    return dispatcher.wrap(tuple(local), output_sharding.output_spec)


def _register_cpu_ring_attention() -> None:
    """Put the handler beside torch's in ``_attention.custom_ops`` (which ``_enable_cp_dtensor_dispatcher`` merges
    into ``DTensor._op_dispatcher._custom_op_handlers`` when ``context_parallel`` is entered, and which its exit
    drops again) and register the ops' Shard(2) sharding, as ``_sharding_rules.py`` does the CUDA ops' CP
    strategy (outputs, then the tensor inputs, all sharded on the sequence)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy
    from torch.distributed.tensor.experimental._context_parallel import _attention

    def strategy(outputs: int):
        def rule(op_schema):
            mesh = op_schema.get_mesh_from_args(validate=False)
            tensors = sum(1 for s in op_schema.args_schema if type(s).__name__ == "OpStrategy")
            return expand_to_full_mesh_op_strategy(mesh, op_schema, [[Shard(2)] * (outputs + tensors)],
                                                   input_index=outputs)
        return rule

    register_op_strategy(FWD, schema_info=RuntimeSchemaInfo(3))(strategy(2))
    register_op_strategy(BWD, schema_info=RuntimeSchemaInfo(6))(strategy(3))
    _attention.custom_ops[FWD] = _attention.custom_ops[BWD] = _ring_cpu_handler
