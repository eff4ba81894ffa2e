"""Large terms explained: when one term of a step's peak is over a fifth of it, the estimate and the plan name it, say
why this configuration has it, and name the knob that removes it with what that costs (issue 56).

Note [deferred reduce-scatter]
    FSDP2 under accumulation with the gradient sync left to the last micro-batch (Note [gradient sync under
    accumulation], autofit/training/step.py) keeps, on every rank, each parameter's *unsharded* gradient of its
    tensor-parallel shard, in the reduce dtype, from its first backward to the last micro-batch. In torch's source
    (torch 2.13, torch/distributed/fsdp/_fully_shard/):
    - ``FSDPModule.set_requires_gradient_sync(False)`` sets every group's ``reduce_grads = False``
      (_fully_shard.py, lines 413-435);
    - ``FSDPParamGroup.post_backward`` then only accumulates and returns, without reduce-scatter: it calls
      ``accumulate_unsharded_grad_if_needed`` and ``to_accumulated_grad_if_needed`` (_fsdp_param_group.py, lines
      603-612);
    - ``FSDPParam.to_accumulated_grad_if_needed`` moves the unsharded gradient into ``unsharded_accumulated_grad``,
      cast to ``reduce_dtype`` (fp32 under autofit's ``MixedPrecisionPolicy(param_dtype=low,
      reduce_dtype=float32)``; without autocast it stays the parameter's gradient, in its dtype), and later
      micro-batches add into it (_fsdp_param.py, lines 802-821).
    So the term is, by count: sum over trainable parameters of their tensor-parallel-local elements times 4 bytes
    (fp32), every one alive at the last micro-batch's backward. Reducing every micro-batch (torchtitan's loop: its
    train step never disables gradient sync) keeps instead the sharded fp32 gradients, 1/S of it over the shard group
    S, and one unit's unsharded gradients while it reduce-scatters; it costs one reduce-scatter of those gradients per
    micro-batch instead of one per step (k - 1 more, priced by ``ring_seconds``).
"""

from __future__ import annotations

from torch import nn

from autofit.core.units import format_bytes
from autofit.solve.sharding import Links, _SPLIT_ALL, _SPLIT_WEIGHT, ring_seconds

__all__ = ["LARGE_SHARE", "deferred_gradient_bytes", "deferred_gradient_note", "large_term_notes"]

LARGE_SHARE = 0.2  # a term over this share of the peak is named, with its reason and its knob


def deferred_gradient_bytes(model: nn.Module, config) -> int:
    """The unsharded gradients one rank holds across the micro-batches of a step with FSDP2's reduce-scatter deferred
    to the last (Note [deferred reduce-scatter]); 0 where the step does not defer (no FSDP2 over data ranks, one
    micro-batch, reducing every micro-batch, the states on the host)."""
    if (not config.fully_sharded or config.accumulation_steps < 2 or config.reduce_every_micro_batch
            or config.offload_states):
        return 0
    split = dict(config.layout.tensor_plan) if config.tensor_parallel > 1 else {}
    total = 0
    for name, module in model.named_modules():
        style = split.get(name)
        for pname, p in module.named_parameters(recurse=False):
            if not p.requires_grad:
                continue
            cut = style in _SPLIT_ALL or (style in _SPLIT_WEIGHT and pname == "weight")
            numel = p.numel() // config.tensor_parallel if cut else p.numel()
            total += numel * (4 if config.precision.autocast else p.element_size())
    return total


def deferred_gradient_note(model: nn.Module, config, peak_bytes: int, target, *, flag: str) -> str | None:
    """The note naming the deferred unsharded gradients when they are over ``LARGE_SHARE`` of ``peak_bytes``: how
    many bytes, why, and what ``flag`` (the knob's spelling where the note is read) saves and costs. ``target``: the
    device model (its links price the reduce-scatters)."""
    term = deferred_gradient_bytes(model, config)
    if not term or term <= LARGE_SHARE * peak_bytes:
        return None
    layout, k = config.layout, config.accumulation_steps
    shard = layout.shard_ranks
    kept = term // max(shard, 1)
    links = Links.of(target)
    data = layout.data_parallel if layout.tensor_parallel > 1 else layout  # the FSDP2 dim's ranks
    seconds = (k - 1) * ring_seconds("reduce_scatter", shard, term, links.bandwidth(data, shard))
    whole = "tensor-parallel shard" if layout.tensor_parallel > 1 else "model"
    dtype = "fp32 " if config.precision.autocast else ""
    return (f"unsharded {dtype}gradients held across {k} micro-batches (deferred reduce-scatter): "
            f"{format_bytes(term)}, {100 * term / peak_bytes:.0f} % of the peak, in 'temporaries': FSDP2 "
            f"reduce-scatters only at the last micro-batch, so every rank keeps the gradients of its whole {whole} "
            f"until then; {flag}: up to -{format_bytes(term - kept)} (it keeps the 1/{shard} sharded gradients, "
            f"{format_bytes(kept)}), +{seconds:.3g} s of collectives per step ({k - 1} more reduce-scatters) "
            "(Note [deferred reduce-scatter], autofit/solve/terms.py)")


def large_term_notes(model: nn.Module, config, peak_bytes: int, target, *, flag: str) -> tuple[str, ...]:
    """Every large term of the step this configuration runs that autofit can explain (Note [deferred reduce-scatter]
    so far), one note each."""
    note = deferred_gradient_note(model, config, peak_bytes, target, flag=flag)
    return () if note is None else (note,)
