"""How a checkpointed module is recomputed: all of its forward ("full"), all but its matmuls and attention
("selective"), or as torchtitan's per-op policy does ("op-selective": its attention, every other matmul). One
definition, used by the simulation, ``measure`` and the trainer (through step.py).

See Note [selective recomputation] and Note [torchtitan's per-op policy].

Note [selective recomputation]
    ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` (torch/utils/checkpoint.py) runs the module's
    forward under a dispatch mode that asks a policy, op by op, whether to save its outputs. ``MUST_SAVE``: the
    outputs are kept in the checkpoint's own storage from the forward until the recomputation in backward, which
    returns them instead of running the op again; ``PREFER_RECOMPUTE``: the op runs again. The policy here is
    torchtitan's "op" policy in its plain form (torchtitan/models/llama3/infra/parallelize.py, ``_save_list``):
    keep the outputs of the ops whose FLOPs dominate a transformer layer (matrix products, attention, convolution)
    and recompute the pointwise ones (activations, norms, dropout, residual adds, rotary embeddings, casts).
    torchtitan also recomputes every second ``mm`` (its own policy is "op-selective": Note [torchtitan's per-op
    policy]); "selective" keeps every one, and lets the planner choose full recomputation where the memory is
    needed. Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models", section 4.2) make the same trade by hand: recompute what is cheap per byte.

    Two consequences the memory model accounts for (solve/memory_model.py): a kept output stays live from the
    forward to the recomputation whether or not autograd would have saved it (an ``o_proj`` output that only a
    residual add reads is kept too), and what is kept is an op's *output*, the same storage autograd saves.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterator

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autofit.core._torch import NormBase, tensor_version
from autofit.core.errors import InvalidInputError

__all__ = ["BufferWrites", "POLICIES", "SAVED_OPS", "OP_SELECTIVE_SAVED", "saved_op_names", "op_selective_names",
           "selective_policy", "selective_context", "op_selective_policy", "op_selective_context", "context_of",
           "require_policy"]

# how a recomputed module is recomputed; "none" is a module not recomputed
POLICIES = ("full", "selective", "op-selective")


def _ops(*names: str) -> frozenset:
    """The aten overload packets of ``names`` this torch build has (an older build may lack an attention kernel)."""
    return frozenset(getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n))


# The ops whose outputs a selective recomputation keeps (torchtitan's _save_list, plus the CPU and math kernels of
# the same products and convolution). Matched by overload packet, so every overload of an op counts.
SAVED_OPS = _ops(
    "mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_efficient_attention_forward", "_flash_attention_forward",
    "convolution", "_convolution",
)


def saved_op_names() -> frozenset[str]:
    """Names of :data:`SAVED_OPS` as the simulation's timeline records them (the overload packet's: ``mm``, ...)."""
    return frozenset(op.__name__ for op in SAVED_OPS)


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """Keep matmul, attention and convolution outputs, recompute the rest (Note [selective recomputation])."""
    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if packet in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


# The ``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for a selectively recomputed module.
selective_context = functools.partial(create_selective_checkpoint_contexts, selective_policy)


# Note [torchtitan's per-op policy]
#     torchtitan's "selective" activation checkpointing with ``selective_ac_option = "op"`` (``_apply_op_sac`` in
#     torchtitan/distributed/activation_checkpoint.py, its save list ``_op_sac_save_list`` in
#     torchtitan/models/llama3/infra/parallelize.py; the same in ``_apply_ac_to_transformer_block`` at 6fc499f, the
#     commit of torchao's B200 rows, whose list is a subset of today's: no cuDNN SDPA, no all-to-all) wraps each
#     transformer block in a checkpoint whose ``context_fn`` builds a fresh policy per call: it keeps the outputs
#     of the ops in its save list (``aten.mm.default``, the SDPA kernels, ``aten.max.default``, which low-precision
#     recipes read their scales from, and the collectives ``reduce_scatter_tensor`` and ``all_to_all_single``) but
#     counts ``aten.mm.default`` calls and recomputes every second one (the 2nd, 4th, ... of the call), and
#     recomputes every other op. Matched by overload, as there: ``addmm`` (a linear with a bias), ``bmm`` and
#     convolutions are recomputed. autofit's "op-selective" is that policy, with the CPU kernel of SDPA
#     (``_scaled_dot_product_flash_attention_for_cpu``) beside the GPU ones so that the CPU runs keep what a GPU run
#     keeps; torchtitan's forced saves of device-to-host copies (its offloading) are left out.
#
#     The count is per checkpointed call (``op_selective_context`` makes a new counter each time checkpoint calls
#     it, once per call) and per pass: older torch releases asked the policy again in the recomputation
#     (``ctx.is_recompute``), which must return the same choice for the same op, so the recomputation counts its
#     own ``mm`` calls from zero, in the same order, as torchtitan does; torch 2.13 asks only in the forward and
#     the recomputation follows what the forward stored (``_CachedTorchDispatchMode``, torch/utils/checkpoint.py).
#     Either way the n-th ``mm`` of a call is kept in both passes or in neither. The memory and time models count
#     what is kept by the same rule (``LayerObserver.kept_bytes``, analyse/layers.py; ``OpCosts.op_selective``).

def _overloads(*names: str) -> frozenset:
    """The overloads ``namespace.op.overload`` of ``names`` this torch build has."""
    found = set()
    for name in names:
        space, op, overload = name.split(".")
        found.add(getattr(getattr(getattr(torch.ops, space, None), op, None), overload, None))
    return frozenset(found - {None})


MM = torch.ops.aten.mm.default
# torchtitan's _op_sac_save_list (its higher-order ops, flex attention and compiled regions, have no eager twin here),
# plus the CPU kernel of SDPA
OP_SELECTIVE_SAVED = _overloads(
    "aten.mm.default", "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_attention_math.default",
    "aten._scaled_dot_product_fused_attention_overrideable.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "_c10d_functional.reduce_scatter_tensor.default", "_c10d_functional.all_to_all_single.default",
    "aten.max.default",
)


def op_selective_names() -> frozenset[str]:
    """Names of :data:`OP_SELECTIVE_SAVED` as the simulation's timeline records them (the overload packet's)."""
    return frozenset(op.overloadpacket.__name__ for op in OP_SELECTIVE_SAVED)


def op_selective_policy(mm_calls: list[int], ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """torchtitan's per-op policy for one checkpointed call (Note [torchtitan's per-op policy]): keep the outputs of
    :data:`OP_SELECTIVE_SAVED` but every second ``mm``. ``mm_calls``: ``mm`` calls seen so far, [forward, recompute]."""
    if op == MM:
        mm_calls[ctx.is_recompute] += 1
        return CheckpointPolicy.MUST_SAVE if mm_calls[ctx.is_recompute] % 2 else CheckpointPolicy.PREFER_RECOMPUTE
    return CheckpointPolicy.MUST_SAVE if op in OP_SELECTIVE_SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def op_selective_context():
    """The ``context_fn`` of one checkpointed call under "op-selective": a new ``mm`` count each call."""
    return create_selective_checkpoint_contexts(functools.partial(op_selective_policy, [0, 0]))


def context_of(policy: str):
    """The checkpoint ``context_fn`` of a recomputation policy (None: the default, "full")."""
    return {"full": None, "selective": selective_context, "op-selective": op_selective_context}[policy]


def require_policy(name: str, policy: object) -> str:
    if policy not in POLICIES:
        raise InvalidInputError(
            f"checkpoint policy of {name!r} must be one of {', '.join(map(repr, POLICIES))} (recompute all of its "
            f"forward; all but its matmul and attention outputs; or as torchtitan's per-op policy, keeping its "
            f"attention and every other matmul), got {policy!r}")
    return policy



# Note [buffers under recomputation]
#     A recomputation is a second forward, so whatever a module's forward writes into its own buffers is written
#     twice per micro-batch under checkpointing: a call counter counts two, an exponential moving average (a VQ
#     codebook, a running normaliser) takes two steps, spectral norm's power iteration runs twice. And the
#     recomputation reads the buffers as the first forward left them, so a module whose output reads what it writes
#     (spectral norm normalises by the vectors its power iteration just updated; a codebook looked up before its
#     average moves) recomputes another output than its first forward's, and trains on another gradient.
#
#     The norms whose kernels write their running statistics behind autograd's back (aten ``native_batch_norm``
#     does not mark them written, so their version counters do not move) have their own rule, Note [recomputed
#     BatchNorm] in training/step.py. Every other write is seen through what autograd sees: an in-place write
#     (``add_``, ``copy_``, ``lerp_``, ``out=``) moves the buffer's version counter, and an assignment
#     (``self.count = self.count + 1``) replaces the buffer object. :class:`BufferWrites` compares both before and
#     after each checkpointed call's first forward, and around its recomputation puts back what that forward found
#     (the old object of a replaced buffer; the values of one written in place) and afterwards what the
#     recomputation found. So the recomputation reads what the first forward read and computes its output again,
#     and each write lands once per forward, as without checkpointing. Values go back through ``.data``, which moves
#     no version counter: the recomputation's saved tensors stay valid, and a tensor saved before aliases the
#     buffer's storage as it would without checkpointing.
#
#     The values a buffer had before the forward must be copied before it, when it is not yet known whether the
#     forward writes. The first call of each checkpointed module copies all of its buffers (the norms' running
#     statistics and what nothing writes are dropped right after it) and learns which ones it writes; later calls
#     copy only those. A copy lives from the forward to the recomputation, as the activations a checkpoint keeps do,
#     and the simulation runs this same wrapper, so estimates count it. A buffer a later call writes for the first
#     time is put back after its recomputation but read by it as written. Writes that move no version counter
#     (through ``.data``) are not seen.

_WRITTEN: weakref.WeakKeyDictionary[torch.nn.Module, set[str]] = weakref.WeakKeyDictionary()  # owner -> names
_LEARNT: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # checkpointed modules whose first call was watched


class BufferWrites:
    """The buffers one checkpointed call's forward writes, and the guard that gives its recomputation the buffers
    that forward read and keeps it from writing them again (Note [buffers under recomputation])."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        # (owner, name, the buffer object the forward found, its values then or None)
        self._written: list[tuple[torch.nn.Module, str, torch.Tensor, torch.Tensor | None]] = []

    def _buffers(self) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
        return [(owner, name, buffer) for owner in self._module.modules() if not _running_norm(owner)
                for name, buffer in owner.named_buffers(recurse=False)]

    @contextlib.contextmanager
    def first_forward(self) -> Iterator[None]:
        learning = self._module not in _LEARNT
        before = []
        for owner, name, buffer in self._buffers():
            copy = learning or name in _WRITTEN.get(owner, ())
            before.append((owner, name, buffer, tensor_version(buffer), buffer.detach().clone() if copy else None))
        yield
        _LEARNT.add(self._module)
        for owner, name, buffer, version, value in before:
            if getattr(owner, name, None) is not buffer:  # replaced: the old object holds what the forward read
                self._written.append((owner, name, buffer, None))
            elif tensor_version(buffer) != version:
                self._written.append((owner, name, buffer, value))
                _WRITTEN.setdefault(owner, set()).add(name)

    @contextlib.contextmanager
    def recomputation(self) -> Iterator[None]:
        found = []
        with torch.no_grad():
            for owner, name, read, value in self._written:
                now = getattr(owner, name)
                found.append((owner, name, now, None if now is not read else now.detach().clone()))
                setattr(owner, name, read)
                if value is not None:
                    read.data.copy_(value)
        try:
            yield
        finally:
            with torch.no_grad():
                for owner, name, now, value in found:
                    setattr(owner, name, now)
                    if value is not None:
                        now.data.copy_(value)

    def run(self, recompute: bool):
        return self.recomputation() if recompute else self.first_forward()


def _running_norm(module: torch.nn.Module) -> bool:
    """A norm whose running statistics Note [recomputed BatchNorm] freezes while it recomputes."""
    return isinstance(module, NormBase) and module.training and module.track_running_stats
