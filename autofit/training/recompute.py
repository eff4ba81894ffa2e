"""How a checkpointed module is recomputed: all of its forward ("full"), or all but its matmuls and attention
("selective"). One definition, used by the simulation, ``measure`` and the trainer (through step.py).

See Note [selective recomputation].

Note [selective recomputation]
    ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` (torch/utils/checkpoint.py) runs the module's
    forward under a dispatch mode that asks a policy, op by op, whether to save its outputs. ``MUST_SAVE``: the
    outputs are kept in the checkpoint's own storage from the forward until the recomputation in backward, which
    returns them instead of running the op again; ``PREFER_RECOMPUTE``: the op runs again. The policy here is
    torchtitan's "op" policy in its plain form (torchtitan/models/llama3/infra/parallelize.py, ``_save_list``):
    keep the outputs of the ops whose FLOPs dominate a transformer layer (matrix products, attention, convolution)
    and recompute the pointwise ones (activations, norms, dropout, residual adds, rotary embeddings, casts).
    torchtitan also recomputes every second ``mm``; autofit keeps every one, and lets the planner choose full
    recomputation where the memory is needed. Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large
    Transformer Models", section 4.2) make the same trade by hand: recompute what is cheap per byte.

    Two consequences the memory model accounts for (solve/memory_model.py): a kept output stays live from the
    forward to the recomputation whether or not autograd would have saved it (an ``o_proj`` output that only a
    residual add reads is kept too), and what is kept is an op's *output*, the same storage autograd saves.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autofit.core._torch import SpectralNormParametrization, tensor_version
from autofit.core.errors import InvalidInputError

__all__ = ["BufferWrites", "POLICIES", "SAVED_OPS", "saved_op_names", "selective_policy", "selective_context",
           "require_policy"]

POLICIES = ("full", "selective")  # how a recomputed module is recomputed; "none" is a module not recomputed


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


def require_policy(name: str, policy: object) -> str:
    if policy not in POLICIES:
        raise InvalidInputError(
            f"checkpoint policy of {name!r} must be one of {', '.join(map(repr, POLICIES))} (recompute all of its "
            f"forward, or all but its matmul and attention outputs), got {policy!r}")
    return policy



# Note [buffers under recomputation]
#     A recomputation is a second forward, so whatever a module's forward writes into its own buffers is written
#     twice per micro-batch under checkpointing: a call counter counts two, an exponential moving average (a VQ
#     codebook, a running normaliser) takes two steps, spectral norm's power iteration runs twice. The norms whose
#     kernels write their running statistics behind autograd's back (aten ``native_batch_norm`` does not mark them
#     written, so their version counters do not move) get their own rule, Note [recomputed BatchNorm] in
#     training/step.py. Every other write is seen through what autograd sees: an in-place write (``add_``,
#     ``copy_``, ``lerp_``, ``out=``) moves the buffer's version counter, and an assignment (``self.count =
#     self.count + 1``) replaces the buffer object. :class:`BufferWrites` records both for each checkpointed call:
#     versions and objects before its first forward, compared after it. Around the recomputation of that call, the
#     buffers its first forward wrote are put back afterwards as the recomputation found them (values copied back
#     through ``.data``, which moves no version counter, as the first forward's writes did not move them for
#     anything saved before; a replaced buffer set back to the object it was), so each write lands once per
#     forward, as without checkpointing. The copies live only while the recomputation runs.
#     The recomputation reads the buffers as the first forward left them. That is the first forward's output
#     again for a module whose output does not read what it wrote (counters, running statistics, a codebook's
#     average updated after the lookup). Spectral norm (torch/nn/utils/parametrizations.py, ``_SpectralNorm``)
#     normalises by an estimate computed from the vectors its power iteration just updated, so it recomputes with
#     ``n_power_iterations = 0``: no iteration, the estimate from the vectors as the first forward left them, which
#     is the first forward's estimate exactly. Writes through ``.data`` or ``torch.no_grad()`` on a detached alias
#     that moves no version counter are not seen.

class BufferWrites:
    """The buffers one checkpointed call's forward writes, and the guard that keeps its recomputation from writing
    them again (Note [buffers under recomputation])."""

    def __init__(self, module: torch.nn.Module) -> None:
        self._module = module
        self._written: list[tuple[torch.nn.Module, str, bool]] = []  # (owner, name, replaced rather than in place)

    def _buffers(self) -> list[tuple[torch.nn.Module, str, torch.Tensor]]:
        return [(owner, name, buffer) for owner in self._module.modules()
                for name, buffer in owner.named_buffers(recurse=False)]

    @contextlib.contextmanager
    def first_forward(self) -> Iterator[None]:
        before = [(owner, name, buffer, tensor_version(buffer)) for owner, name, buffer in self._buffers()]
        yield
        for owner, name, buffer, version in before:
            now = getattr(owner, name, None)
            if now is not buffer:
                self._written.append((owner, name, True))
            elif tensor_version(buffer) != version:
                self._written.append((owner, name, False))

    @contextlib.contextmanager
    def recomputation(self) -> Iterator[None]:
        kept = [(owner, name, getattr(owner, name), None if replaced else getattr(owner, name).detach().clone())
                for owner, name, replaced in self._written]
        norms = [(m, m.n_power_iterations) for m in self._module.modules()
                 if isinstance(m, SpectralNormParametrization) and m.training]
        for m, _ in norms:
            m.n_power_iterations = 0
        try:
            yield
        finally:
            for m, iterations in norms:
                m.n_power_iterations = iterations
            with torch.no_grad():
                for owner, name, buffer, value in kept:
                    setattr(owner, name, buffer)
                    if value is not None:
                        buffer.data.copy_(value)

    def run(self, recompute: bool):
        return self.recomputation() if recompute else self.first_forward()
