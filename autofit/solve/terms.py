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

from collections.abc import Mapping

from torch import nn

from autofit.core.categories import Category
from autofit.core.units import format_bytes
from autofit.parallel.rungs import climbed_for_memory
from autofit.parallel.step_memory import deferred_gradients_bytes, deferred_trade

__all__ = ["LARGE_SHARE", "deferred_gradient_bytes", "deferred_gradient_note", "large_term_notes"]

LARGE_SHARE = 0.2  # a term over this share of the peak is named, with its reason and its knob


def deferred_gradient_bytes(model: nn.Module, config) -> int:
    """The unsharded gradients one rank holds across the micro-batches of a step with FSDP2's reduce-scatter deferred
    to the last (Note [deferred reduce-scatter]); 0 where the step does not defer (no FSDP2 over data ranks, one
    micro-batch, reducing every micro-batch, the states on the host)."""
    return deferred_gradients_bytes(config.layout, model, config.accumulation_steps, config.precision.autocast)


def deferred_gradient_note(model: nn.Module, config, peak_bytes: int, target, *, flag: str) -> str | None:
    """The note naming the deferred unsharded gradients when they are over ``LARGE_SHARE`` of ``peak_bytes``: how
    many bytes, why, and what ``flag`` (the knob's spelling where the note is read) saves and costs. ``target``: the
    device model (its links price the reduce-scatters)."""
    term = deferred_gradient_bytes(model, config)
    if not term or term <= LARGE_SHARE * peak_bytes:
        return None
    k = config.accumulation_steps
    trade = deferred_trade(config.layout, term, k, target)  # what reducing every micro-batch keeps, and costs
    share, kept, seconds, whole = trade.share, trade.kept, trade.seconds, trade.whole
    dtype = "fp32 " if config.precision.autocast else ""
    return (f"unsharded {dtype}gradients held across {k} micro-batches (deferred reduce-scatter): "
            f"{format_bytes(term)}, {100 * term / peak_bytes:.0f} % of the peak, in 'temporaries': FSDP2 "
            f"reduce-scatters only at the last micro-batch, so every rank keeps the gradients of its whole {whole} "
            f"until then; {flag}: up to -{format_bytes(term - kept)} (it keeps the {share} sharded gradients, "
            f"{format_bytes(kept)}), +{seconds:.3g} s of collectives per step ({k - 1} more reduce-scatters) "
            "(Note [deferred reduce-scatter], autofit/solve/terms.py)")


def large_term_notes(model: nn.Module, config, peak_bytes: int, target, *, flag: str,
                     breakdown: Mapping[str, int] | None = None, planned: bool = False) -> tuple[str, ...]:
    """Every large term of the step this configuration runs, one note each: the deferred unsharded gradients (Note
    [deferred reduce-scatter]) and each category of ``breakdown`` (the estimate's, at its peak) over ``LARGE_SHARE``
    of ``peak_bytes`` (Note [a large term and its knob]); ``planned``: the notes of a plan, whose search chose the
    step's knobs, else of an estimate, whose user did."""
    notes = []
    deferred = deferred_gradient_note(model, config, peak_bytes, target, flag=flag)
    if deferred is not None:
        notes.append(deferred)
    held = dict(breakdown or {})
    held[str(Category.TEMPORARIES)] = held.get(str(Category.TEMPORARIES), 0) - deferred_gradient_bytes(model, config)
    knobs = _PLAN_KNOBS if planned else _ESTIMATE_KNOBS
    gpu_only = ("shard", "split", "expandable") if config.device.is_host else ()
    if planned and not _paid_for_memory(config):  # the budget did not bind: nothing to lower
        return tuple(notes)
    for category, (what, names) in _CATEGORY_KNOBS.items():
        size = held.get(str(category), 0)
        if peak_bytes and size > LARGE_SHARE * peak_bytes:
            why = what(config) if callable(what) else what
            lead = "beyond the micro-batch and recomputation the search chose, " if planned else ""
            notes.append(f"{category}: {format_bytes(size)}, {100 * size / peak_bytes:.0f} % of the peak: {why}; "
                         f"{lead}lowered by {'; '.join(knobs[n] for n in names if knobs.get(n) and n not in gpu_only)}"
                         " (Note [a large term and its knob], autofit/solve/terms.py)")
    return tuple(notes)


# Note [a large term and its knob]
#     A category of the peak (core/categories.py) over a fifth of it is named with what it holds in this step and
#     the knobs that lower it, each with its cost, spelt as the reader gives them: an estimate's as the Python
#     StepConfig field and the `autofit estimate` flag, a plan's as what the planner is asked (its search already
#     weighed the micro-batch, recomputation, precision and the layouts the request allows, so a plan names what it
#     was not allowed to try). The deferred reduce-scatter's unsharded gradients, counted in 'temporaries', have
#     their own note with their figure (Note [deferred reduce-scatter]) and are left out of the temporaries weighed
#     here. Knobs, not figures: what a knob saves depends on the search that follows it, which a note cannot run.
#     A plan that gave nothing up for memory (no accumulation, recomputation, offload or lower stored precision)
#     fits with room, so its terms are not named; on the CPU the GPU knobs (more GPUs, tensor parallel, the CUDA
#     allocator) are left out.
def _paid_for_memory(config) -> bool:
    """Whether the plan's step gave something up for memory: accumulation, recomputation, offload, a stored
    precision lower than built. A plan that gave up nothing fits with room, and its large terms need no knob."""
    return bool(config.accumulation_steps > 1 or config.checkpoint or config.offload
                or climbed_for_memory(config.layout) or config.precision.stored or config.optimizer_in_backward
                or config.chunked_loss is not None)


def _activations(config) -> str:
    recomputed = len(config.checkpoint)
    how = f" with {recomputed} module{'s' * (recomputed != 1)} recomputed" if recomputed else ", nothing recomputed"
    return f"tensors forward saves for backward, at micro-batch {config.micro_batch_size}{how}"


def _optimizer_state(config) -> str:
    k = config.optimizer.state_values_per_parameter()
    return f"{config.optimizer.name}'s state, {k} value{'s' * (k != 1)} per trained parameter"


_CATEGORY_KNOBS = {
    Category.ACTIVATIONS: (_activations, ("recompute", "micro", "split")),
    Category.TEMPORARIES: ("tensors made in backward and the optimizer step that are neither gradients nor state: "
                           "a recomputed module's forward again, the gradients of activations, an op's output before "
                           "the next frees its input", ("micro", "chunked", "split")),
    Category.OPTIMIZER_STATE: (_optimizer_state, ("shard", "optimizer", "offload", "lora")),
    Category.PARAMETERS: ("the parameters, in their stored precision", ("shard", "stored", "offload")),
    Category.GRADIENTS: ("one gradient per trained parameter, in its stored precision", ("shard", "lora", "backward")),
    Category.FRAGMENTATION: ("what the CUDA caching allocator reserves beyond its blocks (segments that free blocks "
                             "cannot return)", ("expandable",)),
}
_ESTIMATE_KNOBS = {
    "recompute": "recomputing more modules (StepConfig(checkpoint=...); --checkpoint NAME or blocks), one more forward "
                 "of each",
    "micro": "a smaller micro-batch (micro_batch_size; -m), more accumulation steps for the same batch",
    "split": "tensor or sequence parallel (Layout(tensor_parallel=..., sequence_parallel=True); --tensor-parallel, "
             "--sequence-parallel), their collectives",
    "chunked": "the output head and loss in chunks of tokens (chunked_loss; --chunked-loss), float rounding only",
    "shard": "FSDP2 over more ranks (Layout(strategy='fsdp2'); --strategy fsdp2 --world-size N), its all-gathers",
    "optimizer": "an optimizer with fewer values (optimizer='sgd' or an 8-bit AdamW, autofit.plan(allow='8bit-"
                 "optimizer'); --optimizer), a different update",
    "offload": "the states on the host (offload_states=True; --offload-states), an optimizer step on the CPU",
    "lora": "training adapters only (--lora), a different model update",
    "stored": "a lower stored precision (precision=PrecisionPolicy('bf16', stored='bf16'); autofit plan "
              "--min-stored-precision), bf16 updates",
    "backward": "the optimizer stepped in backward (optimizer_in_backward=True; --optimizer-in-backward), one process "
                "without clipping",
    "expandable": "expandable segments (expandable_segments=True; --expandable-segments), which autofit plan sets when "
                  "the default allocator does not fit",
}
_PLAN_KNOBS = {
    "recompute": None,  # the search's own knobs: weighed already
    "micro": None,
    "split": "tensor or sequence parallel (--tensor-parallel auto lets the planner weigh the degree; "
             "--sequence-parallel), their collectives",
    "chunked": "the chunked loss (allow='chunked-loss'; --allow chunked-loss), float rounding only",
    "shard": "more GPUs (--nodes, --gpus-per-node), which FSDP2 shards the states over",
    "optimizer": "AdamW's moments in 8 bits (allow='8bit-optimizer'; --allow 8bit-optimizer), a different update",
    "offload": "the states on the host (offload='auto', the default, where nothing fits on the GPUs), an optimizer "
               "step on the CPU",
    "lora": "training adapters only (--lora), a different model update",
    "stored": "a lower stored precision (--min-stored-precision), which the ladder climbs when nothing fits",
    "backward": "the optimizer stepped in backward, which the ladder tries on one process when nothing fits",
    "expandable": "expandable segments, which the plan sets when the default allocator does not fit",
}
