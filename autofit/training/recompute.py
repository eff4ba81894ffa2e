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

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from autofit.core.errors import InvalidInputError

__all__ = ["POLICIES", "SAVED_OPS", "saved_op_names", "selective_policy", "selective_context", "require_policy"]

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

