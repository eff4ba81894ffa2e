"""Search, then verify the winner with one full simulation; the models' error, where it shows, becomes a margin.

The memory model is exact for the configurations it was built on and close for the others (docs/planner.md). When
the verified peak of the search's winner overshoots the budget, the overshoot is the model's error for that kind of
configuration: the search runs again under a budget lowered by it, at most ``MAX_VERIFICATIONS`` times.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from autofit.core import progress
from autofit.core.errors import HostMemoryError, InfeasibleBudgetError
from autofit.core.report import MemoryEstimate
from autofit.parallel.layout import Parallel
from autofit.parallel.rungs import node_host_words
from autofit.parallel.step_memory import node_bytes
from autofit.solve.candidate import Candidate, SearchSpace
from autofit.solve.host import host_budget_words
from autofit.solve.search import (
    alternatives,
    fits_somewhere,
    search,
    smallest_peaks,
    time_floor,
    whole_batch,
)
from autofit.core.units import format_bytes

__all__ = ["Slower", "Verified", "MAX_VERIFICATIONS", "search_verified", "search_in_backward", "smallest_in_backward",
           "smallest_verified", "infeasible", "host_checked", "host_fits", "with_offload_minimum", "with_closed_rungs"]

MAX_VERIFICATIONS = 4

Verify = Callable[[Candidate], MemoryEstimate]


@dataclass(frozen=True)
class Verified:
    """A candidate whose full estimate fits the budget, the configurations that fit the models, and a note."""

    candidate: Candidate
    estimate: MemoryEstimate
    fitting: tuple[Candidate, ...]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Slower:
    """What ``search_verified`` returns when the fastest configuration left to verify is modelled no faster than
    ``beat``, a plan found already: whatever this search would verify loses to it, so nothing is verified.
    ``modelled_fit``: the models fit some configuration of the space in the budget (the one the search found, or
    where the time floor alone lost, one found without a checkpoint MILP: ``fits_somewhere``)."""

    seconds: float
    modelled_fit: bool = False


def search_verified(space: SearchSpace, budget: int, verify: Verify, beat: float | None = None, *,
                    front: bool = True) -> Verified | Slower | None:
    """The fastest configuration whose verified estimate fits ``budget``, or None when the search finds none;
    ``Slower`` as soon as the next one to verify is modelled no faster than ``beat`` (seconds per step). Its
    ``fitting`` holds the configurations the search evaluated, and with ``front`` also the halving micro-batches of
    ``alternatives`` (a checkpoint MILP each: the CLI's table of alternatives, not needed to plan)."""
    if beat is not None:  # no checkpoint MILP where even the floor of every configuration loses
        floor = time_floor(space, budget)
        if floor >= beat:
            return Slower(floor, modelled_fit=fits_somewhere(space, budget))
    correction = 0
    for attempt in range(MAX_VERIFICATIONS):
        best, fitting = search(space, budget - correction)
        if best is None:
            return None
        if beat is not None and best.seconds >= beat:  # a verified plan's time is its candidate's modelled time
            return Slower(best.seconds, modelled_fit=True)
        progress.report(f"verifying the fastest configuration the models fit: micro-batch {best.micro_batch_size} "
                        f"x {best.accumulation_steps} ({best.precision}), one full simulation",
                        *((attempt, MAX_VERIFICATIONS) if attempt else ()))  # a second try is counted
        est = verify(best)
        fitted = est.within(budget)
        if fitted is not None:
            notes = ()
            if correction:
                notes = (f"the first choices' verified peaks exceeded their modelled peaks; re-planned with "
                         f"{format_bytes(correction)} of margin",)
            more = alternatives(space, budget - correction) if front else []
            return Verified(best, fitted, tuple(fitting) + tuple(more), notes)
        correction += max(est.min_device_bytes - best.peak_bytes, est.min_device_bytes - budget, 1)
    return None


def search_in_backward(space: SearchSpace, budget: int, gradient_bytes: int, verify: Verify) -> Verified | None:
    """Configurations with the optimizer stepped in backward (Note [optimizer step in backward]): one micro-batch
    per step, so the whole batch at once. The models know nothing of the freed gradients, so the search runs with
    their bytes added to the budget; the first configurations it ranks, and the most freeing one, are verified
    with the step in backward, against the real budget."""
    # only the whole batch's options: the MILPs of the others, and their most freeing sets, would be thrown away
    # (the LoRA plan of Qwen2.5-7B on an RTX 4090 spent 90 of its 200 s on them, issue 56)
    whole = whole_batch(space, budget + gradient_bytes)
    whole.sort(key=lambda c: (c.seconds, c.peak_bytes))
    freeing = smallest_peaks(space, whole_batch=True)[:1]
    for c in dict.fromkeys(whole[:2] + freeing):
        c = replace(c, in_backward=True)
        est = verify(c).within(budget)
        if est is not None:
            note = ("the optimizer steps each parameter in backward and frees its gradient (Note [optimizer step in "
                    "backward]): nothing fit with every gradient alive at once")
            return Verified(c, est, (c,), (note,))
    return None


def smallest_in_backward(space: SearchSpace, verify: Verify) -> tuple[Candidate, MemoryEstimate] | None:
    """The most freeing whole-batch configuration with the optimizer stepped in backward, verified; None when the
    space has no whole-batch configuration."""
    whole = smallest_peaks(space, whole_batch=True)
    if not whole:
        return None
    c = replace(whole[0], in_backward=True)
    return c, verify(c)


# Note [the smallest budget]
#     An infeasibility error names the smallest budget that works: the verified peak of the configuration with the
#     smallest one found, so that planning again at that budget succeeds with that configuration (the search's
#     models may pick another, whose verification then fails, and the fallback comes back to this one). Each
#     (precision, micro-batch) is ranked with its most freeing checkpoint set (checkpoint_milp.py), and the set
#     matters beyond the modelled peak: where the optimizer step holds the tensor peak, every set has the same one,
#     but a GPU's caching allocator keeps reserved the segments forward and backward needed, so the set that lowers
#     the window most lowers the device bytes. Ranking micro-batch 1 with only the set that lowers the window's own
#     peak (the loss over the logits, which no module's recomputation helps) made a 4-layer Llama-2-shaped model
#     on an H200 (fp16, 1 x 2048) name 23.36 GiB at batch 1 and 22.16 GiB at batch 8; with every unit that lowers
#     bytes somewhere added, batch 1 names 21.84 GiB (tests/test_verdict.py): a smaller batch never needs more.
#     The budget compared is the smallest one the step runs under (``min_device_bytes``), not what the process
#     would reserve on a card with room to spare: under a budget the caching allocator frees the segments it keeps
#     cached before it gives up (Note [allocating under a cap], autofit/cuda/allocator.py). That takes the cached
#     segments out of the floor, and with them most of the checkpoint set's effect on it, but not the rest of what
#     makes the floor grow as the batch shrinks. Llama-2-7B on an H200 (fp16, no offload, benchmarks/verdict_floors.py)
#     allocates 125.54 GiB at every batch (the optimizer step holds the peak); what stays is the segments the step
#     finds pinned, 2.8 GiB at micro-batch 1 against 0.5 GiB at 4, where the gradients fit the activations' segments
#     exactly (floors of 128.81, 129.11, 126.50, 126.53 GiB at batch 1, 2, 4, 8). Expandable segments where the
#     default allocator's floor is not reached (Note [expandable segments as a plan knob], autofit/device.py) lower
#     the floors at batch 1, 2 and 4 (126.91, 126.89, 126.16, 126.53 GiB), still not monotone: 20 MiB pages that
#     gradients, placed in backward between activations, keep partly live when the optimizer step runs (four layers:
#     189 MiB at micro-batch 1, 89 MiB at 4). A floor that never grows as the batch shrinks needs those gradients
#     laid out apart from the activations, not another allocator setting: allocated before forward (Note [gradients
#     before forward as a plan knob], autofit/solve/estimator.py), which ``smallest_verified`` ranks with
#     ``Estimator.verify_floor``. Four layers of Llama-2-7B then name 20.50 GiB at batch 1, 2, 4 and 8, the full
#     model 126.05 GiB.
def smallest_verified(space: SearchSpace, verify: Verify) -> tuple[Candidate, MemoryEstimate]:
    """The configuration with the smallest verified peak among the two lowest modelled ones and the smallest
    micro-batch of each precision, with its estimate. The models are least exact far from the configurations they
    were built on (a large micro-batch where the optimizer step seemed to dominate), and the budget this names is
    the one the infeasibility error promises works, so a few verifications are worth it."""
    ranked = smallest_peaks(space)
    smallest_micro = min(c.micro_batch_size for c in ranked)
    picks = ranked[:2] + [c for c in ranked if c.micro_batch_size == smallest_micro]
    verified = [(c, verify(c)) for c in dict.fromkeys(picks)]
    return min(verified, key=lambda ce: ce[1].min_device_bytes)


# What to suggest when one category dominates the smallest reachable peak (one entry per Category an estimate can
# report; each is a sentence without its final period, which the message adds).
_STORE_LOWER = ("precision=PrecisionPolicy(name='bf16', stored='bf16-master' or 'bf16'), which precision='auto' "
                "tries by itself on one GPU")
ADVICE = {
    "optimizer_state": "Optimizer state dominates: use SGD (one buffer) instead of Adam (two), store it lower ("
                       + _STORE_LOWER + "), or shard it across GPUs (FSDP2, world_size > 1)",
    "parameters": "Parameters dominate: store them in bf16 (" + _STORE_LOWER + "), or shard them (FSDP2, "
                  "world_size > 1)",
    "gradients": "Gradients dominate: bf16 parameters halve them (" + _STORE_LOWER + "); without gradient "
                 "clipping on one process the planner can step the optimizer in backward and free them; sharding "
                 "(FSDP2) splits them across ranks",
    "activations": "Activations dominate even in the configuration with the smallest peak: shorten the sequence "
                   "or image size, or use a lower precision",
    "temporaries": "Temporaries of backward or the optimizer step dominate: a lower precision or a smaller "
                   "largest layer helps",
    "inputs": "Inputs dominate: the trainer receives the whole batch at once, so the plan holds all of its rows; "
              "plan a smaller batch_size (or more ranks), or shorter sequences / smaller images",
    "buffers": "Buffers dominate (registered buffers and tensor attributes such as causal masks or rotary caches): "
               "size them for the sequence length you train at, or keep large constant tables off the model",
    "workspace": "CPU kernel scratch memory dominates (oneDNN reorders and scratchpads inside the largest "
                 "convolutions and matmuls): try another precision, or a smaller largest layer",
    "autocast_cache": "Autocast's low-precision copies of the weights dominate: they live until the forward's "
                      "autocast region exits; fp32 makes none, and neither do weights already in the autocast dtype",
    "cuda_context": "The CUDA context dominates: it is a constant (512 MiB unless AUTOFIT_CUDA_CONTEXT_MIB says "
                    "otherwise, see benchmarks/gpu_validate.py) that every budget on a GPU must hold",
    "cublas_workspace": "The cuBLAS workspace dominates: it is a constant per process (CUBLAS_WORKSPACE_CONFIG "
                        "sets its size) that every budget on a GPU must hold",
    "fragmentation": "The caching allocator's reserve dominates: segments reserved beyond the blocks in use are "
                     "part of what the process holds, so the budget must cover them",
    "allocator_rounding": "Allocator rounding dominates: every CUDA block is rounded up to 512 bytes, so many tiny "
                          "tensors cost more than their bytes",
}
# When the smallest configuration already stores the parameters low (the planner tried it), advice that says so
# would offer what the planner could not do (Note [stored precision]).
ADVICE_STORED_LOW = {
    "optimizer_state": "Optimizer state dominates even with the parameters stored low: use SGD (one buffer) instead "
                       "of Adam (two), or shard it across GPUs (FSDP2, world_size > 1)",
    "parameters": "Parameters dominate even stored in 16 bits: shard them across GPUs (FSDP2, world_size > 1)",
    "gradients": "Gradients dominate even in 16 bits: shard them across GPUs (FSDP2, world_size > 1)",
}


# When the layout shards the states already (FSDP2 over the ranks), "shard it" would offer what the plan does.
ADVICE_SHARDED = {
    "optimizer_state": "Optimizer state dominates, sharded over {ranks} ranks already: more ranks divide it further "
                       "(world_size; --nodes on the CLI), an 8-bit optimizer stores about 2 bytes per parameter "
                       "instead of 8 (optimizer=bitsandbytes.optim.AdamW8bit), or SGD keeps one buffer instead of "
                       "Adam's two",
    "parameters": "Parameters dominate, sharded over {ranks} ranks already: more ranks divide them further "
                  "(world_size; --nodes on the CLI), or tensor parallel splits the gathered ones (tensor_parallel)",
    "gradients": "Gradients dominate, sharded over {ranks} ranks already: more ranks divide them further "
                 "(world_size; --nodes on the CLI)",
}


def infeasible(smallest: Candidate, est: MemoryEstimate, budget: int, where: str = "", *,
               margin: int = 0, sharded_over: int = 0) -> InfeasibleBudgetError:
    """The error for a budget below the smallest verified peak plus ``margin`` (the bytes a plan keeps free, Note [the
    margin] in autofit/validate.py): that sum is the smallest budget that works; what dominates it, and what helps.
    ``sharded_over``: the ranks FSDP2 shards the states over in that configuration (0: not sharded)."""
    dominant = max(est.breakdown, key=est.breakdown.get)
    advice = ADVICE_STORED_LOW if "/" in smallest.precision else ADVICE  # a label "bf16/bf16": stored low
    if sharded_over > 1:
        advice = {k: v.format(ranks=sharded_over) for k, v in ADVICE_SHARDED.items()}
    kept = f" (less a margin of {format_bytes(margin)} kept free)" if margin else ""
    if est.min_device_bytes + margin <= budget:  # a budget in a window where the allocator fails (docs/cuda.md)
        kept += (f"; the caching allocator runs the configuration below under {format_bytes(est.min_device_bytes)}"
                 f" but not under this budget: with more room it keeps segments cached that the step later pins")
    at_floor = est.within(est.min_device_bytes)  # how the step runs there: the gradients' layout it needs
    ahead = at_floor is not None and at_floor.preallocated_grads
    return InfeasibleBudgetError(
        f"no configuration fits {format_bytes(budget)}{kept}: the smallest reachable peak is "
        f"{format_bytes(est.min_device_bytes)} ({est.min_device_bytes:,} bytes; micro-batch "
        f"{smallest.micro_batch_size}, "
        f"{smallest.precision}, {len(smallest.checkpoint)} modules checkpointed"
        f"{', optimizer stepped in backward' if smallest.in_backward else ''}"
        f"{', gradients allocated before forward' if ahead else ''}{where}). "
        f"{advice.get(dominant, ADVICE.get(dominant, f'{dominant} dominates the smallest peak'))}.",
        min_budget_bytes=est.min_device_bytes + margin, budget_bytes=budget, dominant=dominant,
    )


def host_checked(verify: Verify, fit_bytes: int, host_budget: int | None, layout: Parallel = Parallel()) -> Verify:
    """``verify``, where an estimate that fits the GPU but whose host memory, for the ranks of ``layout`` sharing one
    host, exceeds ``host_budget`` raises ``HostMemoryError`` (nothing fit with the states on the GPU: this was the
    last way)."""
    def checked(c: Candidate) -> MemoryEstimate:
        est = verify(c)
        fitted = est.within(fit_bytes)
        return est if fitted is None else host_fits(fitted, host_budget, layout)
    return checked


def host_fits(est: MemoryEstimate, host_budget: int | None, layout: Parallel = Parallel()) -> MemoryEstimate:
    """``est``, or ``HostMemoryError`` when its host memory for the ranks of ``layout`` sharing one host (the ranks
    of a node, each holding its shard: ``node_bytes``) exceeds ``host_budget``, the memory of one host."""
    limit = host_budget
    node = node_bytes(layout, est.host_bytes)
    if limit is not None and node > limit:
        raise HostMemoryError(
            f"the plan that fits the GPU keeps {node_host_words(layout, est.host_bytes)} in host memory (parameters, "
            f"gradients and optimizer state; {format_bytes(node_bytes(layout, est.host_pinned_bytes))} pinned), more "
            f"than the host budget {format_bytes(limit)} ({limit:,} bytes), and nothing fits with them on the GPU: "
            f"give the training machine's RAM, {host_budget_words(node)} or more, or use SGD, or more GPUs (FSDP2 "
            "over world_size ranks)",
            host_bytes=node, host_budget_bytes=limit,
        )
    return est


def with_offload_minimum(error: InfeasibleBudgetError, smallest: tuple[Candidate, MemoryEstimate],
                         host_budget: int | None, margin: int, layout: Parallel = Parallel()) -> InfeasibleBudgetError:
    """The infeasibility error naming the smallest budget with the states offloaded as well as without. The
    offloaded one counts as a budget that works only when its host memory (for the ranks of ``layout``'s node) fits
    ``host_budget``."""
    candidate, est = smallest
    with_offload = est.min_device_bytes + margin
    on_host = host_budget is None or node_bytes(layout, est.host_bytes) <= host_budget
    minimum = min(error.min_budget_bytes, with_offload) if on_host else error.min_budget_bytes
    host = f"{node_host_words(layout, est.host_bytes)} of host memory"
    if not on_host:
        host += f", more than host_budget {format_bytes(host_budget)}"
    return InfeasibleBudgetError(
        f"{error} With parameters, gradients and optimizer state offloaded to the host (FSDP2 CPUOffloadPolicy) the "
        f"smallest is {format_bytes(with_offload)} ({with_offload:,} bytes; micro-batch {candidate.micro_batch_size},"
        f" {candidate.precision}, {len(candidate.checkpoint)} modules checkpointed, {len(candidate.offload)} "
        f"offloaded; {host}); without offloading it is {format_bytes(error.min_budget_bytes)}.",
        min_budget_bytes=minimum, budget_bytes=error.budget_bytes, dominant=error.dominant,
    )


def with_closed_rungs(error: InfeasibleBudgetError, closed: tuple[str, ...]) -> InfeasibleBudgetError:
    """``error``, ending with the opt-in rungs that would apply to this model but were not allowed (Note [the
    ladder]): they may still fit."""
    if not closed:
        return error
    names = ", ".join(repr(n) for n in closed)
    return InfeasibleBudgetError(
        f"{error} Rungs that change numerics, not allowed, may still fit: allow=({names},) (CLI --allow; "
        "docs/fine-tuning.md).", min_budget_bytes=error.min_budget_bytes, budget_bytes=error.budget_bytes,
        dominant=error.dominant)
