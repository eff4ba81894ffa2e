"""The public entry points. Each reads as the pipeline stages it composes (docs/index.md, "The pipeline")."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from autofit.analyse.analyse import analyse_model
from autofit.analyse.table import Analysis
from autofit.training.batch import naming_inputs
from autofit.training.chunked_loss import LossChunks, chunkable
from autofit.device import resolve_device
from autofit.features.allocator import put_in_place
from autofit.core.errors import InvalidInputError
from autofit.training.loss import LossFn
from autofit.measure.ranks import measure_laid_out
from autofit.core.report import Measurement, MemoryEstimate
from autofit.capture.user_hooks import restores_user_hooks
from autofit.features import user_features
from autofit.core.rng import keeps_user_rng
from autofit.core._torch_interrupts import import_lazy_modules
from autofit.options import STEP_GROUPS, BatchDim, Device, Layout, Precision, Step, gather
from autofit.validate import as_inputs, check_model
from autofit.simulate.run import simulate_step
from autofit.solve.terms import large_term_notes
from autofit.parallel.requested import estimate_notes, one_layout, step_layout
from autofit.training.step import StepConfig, forward_errors, make_step_config

__all__ = ["analyse", "estimate", "measure"]


@dataclass(frozen=True)
class _OneStep:
    """What ``estimate`` / ``measure`` were given, as one step runs it (See :func:`_one_step`)."""

    device: str  # the device kind
    gpu: str | None
    precision: Any  # the compute precision
    layout: Layout  # one layout: its "auto" read as the plain one
    step: Step
    expandable: bool | None  # the allocator's expandable segments (Note [expandable segments as an input])
    batch_dim: BatchDim  # which rows of the sample are the batch (Note [the batch dimension])


def _config(model, given: _OneStep, optimizer, batch, target, loss_fn) -> StepConfig:
    step = given.step
    micro_batch_size = step.micro_batch_size
    # the layout's own rules, before its modules are resolved or anything simulated (autofit/parallel/requested.py)
    layout = step_layout(model, given.layout, step, batch.tensors())
    chunks = _loss_chunks(model, batch, target, loss_fn) if step.chunked_loss else None
    # the step features carried in more_features read the user's options for the target's card (Note [carried
    # features]): Float8 refuses a card without FP8 tensor cores
    gpu = getattr(resolve_device(given.device, given.gpu), "gpu", None)
    return make_step_config(micro_batch_size=micro_batch_size, accumulation_steps=step.accumulation_steps,
                            precision=given.precision, checkpoint=step.checkpoint, optimizer=optimizer,
                            device=given.device, gpu=given.gpu, clip_grad_norm=step.clip_grad_norm,
                            optimizer_in_backward=step.optimizer_in_backward, offload=step.offload,
                            layout=layout, chunked_loss=chunks,
                            compile=step.compile, preallocated_grads=step.preallocated_grads,
                            held_rows=_held_rows(step.inputs, micro_batch_size, step.accumulation_steps),
                            gradient_as_bucket_view=step.gradient_as_bucket_view, zero_grad=step.zero_grad,
                            more_features=user_features(step, gpu))


def _one_step(function: str, device: Any, precision: Any, layout: Any, step: Any, batch_dim: Any,
              deprecated: dict[str, Any]) -> _OneStep:
    """The options of ``estimate`` / ``measure`` (autofit/options.py; old flat keywords by Note [flat keywords]) as
    one step runs them: the device kind and GPU, the compute precision, the layout, the step's knobs, the
    allocator's expandable segments (Note [expandable segments as an input], autofit/device.py) and the sample's batch
    rows. A step has one layout, so "auto" reads as the plain one (ZeRO-3, no replication) and the planner's choices
    are refused."""
    options = gather(function, dict(device=device, precision=precision, layout=layout, step=step,
                                    batch_dim=batch_dim), deprecated, groups=STEP_GROUPS)
    chosen, wants = options["device"], options["precision"]
    if options["step"].micro_batch_size is None:
        raise InvalidInputError(f"{function}() needs the rows of one micro-batch, got micro_batch_size=None: give "
                                "step=N (autofit.Step(micro_batch_size=N)), or set micro_batch_size in the Step you "
                                "pass")
    if chosen.margin is not None or chosen.host_budget is not None or chosen.allow_over_capacity:
        raise InvalidInputError(f"{function}: Device(margin=, host_budget=, allow_over_capacity=) are what a plan's "
                                "budget keeps free; an estimate has no budget: leave them out (plan takes them)")
    if wants.min_stored is not None or wants.fp32_modules is not None:
        raise InvalidInputError(f"{function}: Precision(min_stored=, fp32_modules=) are the planner's choices; a step "
                                "runs one policy: give precision=PrecisionPolicy(name, fp32_modules=..., stored=...)")
    return _OneStep(device=chosen.kind, gpu=chosen.gpu, precision=wants.compute,
                    layout=one_layout(options["layout"], function), step=options["step"],
                    expandable=chosen.expandable_segments, batch_dim=options["batch_dim"])


INPUTS = ("batch", "micro-batch")


def _held_rows(inputs: str, micro_batch_size: int, accumulation_steps: int) -> int:
    """``StepConfig.held_rows`` for ``inputs`` (See Note [one configuration, one figure], autofit/emit/assemble.py):
    "batch", the whole window's rows resident, as ``trainer.step`` receives the batch at once and slices it;
    "micro-batch", one micro-batch's (a loop that loads each micro-batch just before it runs)."""
    if inputs not in INPUTS:
        raise InvalidInputError(f"inputs={inputs!r}: give 'batch' (the whole batch resident during the step, as "
                                "plan.wrap's trainer holds it) or 'micro-batch' (one micro-batch at a time)")
    if inputs == "micro-batch" or not all(isinstance(n, int) and n >= 1
                                          for n in (micro_batch_size, accumulation_steps)):
        return 0  # 0 holds the micro-batch only; a bad size is named by StepConfig's own check
    return micro_batch_size * accumulation_steps


def _loss_chunks(model, batch, target, loss_fn) -> LossChunks:
    """``chunked_loss=True``: the chunks this model and batch can run, or a typed error saying why none."""
    chunks = chunkable(model, batch, target, loss_fn)
    if chunks is None:
        raise InvalidInputError(
            "chunked_loss=True needs the default loss (no loss_fn), an nn.Linear output head, and an integer target "
            "(class indices) or a Hugging Face causal LM given labels=...: leave chunked_loss out for this model"
        )
    return chunks


@keeps_user_rng  # Note [the user's random state]
@restores_user_hooks  # Note [user hooks]
def estimate(
    model: nn.Module, sample: Any, *, step: Step | int | Mapping[str, Any] | None = None, target: Any = None,
    loss_fn: LossFn | None = None, optimizer: Any = "adamw", batch_dim: BatchDim | int | tuple[int, int] = 0,
    device: Device | str = "cpu", precision: Precision | Any = "fp32",
    layout: Layout | int | None = None, **deprecated: Any,
) -> MemoryEstimate:
    """Predict the peak memory of one steady-state training step, without allocating the model or its activations.

    The step (docs/memory-model.md): forward and loss under the precision's autocast, backward; after
    ``step.accumulation_steps`` micro-batches of ``step.micro_batch_size`` rows, ``optimizer.step()`` and
    ``zero_grad(set_to_none=True)``. Parameters, buffers, optimizer state, inputs and targets are counted. ``model``
    may live on the meta device. It is never modified. ``Step.clip_grad_norm``: clip the gradients to this norm before
    the step (``torch.nn.utils.clip_grad_norm_``; Hugging Face's Trainer clips at 1.0); None does not clip. The optimizer
    runs the implementation torch picks on ``device`` (foreach on CUDA, unless the optimizer sets foreach/fused).

    ``device``, ``precision`` and ``layout`` are the option values ``plan`` takes (autofit/options.py), with their
    shortcuts; ``step`` (an ``autofit.Step``, a mapping of its fields, or an int: the micro-batch size alone,
    ``step=8``) fixes what ``plan`` would choose: ``micro_batch_size`` (required), ``accumulation_steps``,
    ``checkpoint``, ``offload``, ``offload_states``, ``optimizer_in_backward``, ``reduce_every_micro_batch``,
    ``chunked_loss``, ``compile``, ``preallocated_grads``, ``float8``, ``zero_grad``, ``gradient_as_bucket_view``
    and ``inputs``, each documented where ``Step`` declares it. The old flat keywords (``micro_batch_size=8``,
    ``accumulation_steps=4``, ...) still work, with a ``FutureWarning`` (Note [flat keywords]).

    ``device``: "cpu", "cuda", a catalog GPU ("H100") or ``autofit.Device(gpu=...)``. A GPU adds the CUDA model
    (``autofit.cuda``) for that GPU (default: this machine's GPU, else A100-80GB) and three figures:
    ``peak_allocated_bytes`` (= ``peak_bytes``, comparable with ``torch.cuda.max_memory_allocated``),
    ``peak_reserved_bytes`` (``max_memory_reserved``) and ``device_bytes`` (nvidia-smi: reserved plus the CUDA
    context; budgets apply to it). On the CPU the three are equal. What ``Step(offload=..., offload_states=True)``
    keeps on the host is ``host_bytes``, apart from the device's figures (Note [offload], docs/offload.md).

    ``layout``: an ``autofit.Layout`` (or an int, the world size), as ``plan`` takes it, but one layout: its
    "auto" values read as ZeRO-3 without replication, ``tensor_parallel="auto"`` is refused and ``gpus_per_node``
    changes no figure. ``world_size`` and ``strategy`` ("ddp" or "fsdp2"; required with world_size > 1): the step
    of one rank of a data-parallel job laid out as ``plan`` lays it out (FSDP2 shards the units ``plan`` shards);
    ``Step.micro_batch_size`` rows per rank. ``reshard_after_forward`` (True ZeRO-3, False ZeRO-2, an int group) and
    ``replicate`` (HSDP): FSDP2's layout, as ``plan.parallel.reshard_after_forward`` / ``plan.parallel.replicate``
    give it.
    ``tensor_parallel`` T (with ``strategy="fsdp2"``): one rank of a (world_size // T, T) mesh, the modules of
    ``tensor_parallel_plan`` (``{module name pattern: style}``, the styles of Note [tensor parallel plan]; default
    the Hugging Face model's ``config.base_model_tp_plan``) split over the T ranks of its group with torch's
    ``parallelize_module``, then FSDP2 over the other world_size // T (none when T == world_size);
    ``Step.micro_batch_size`` rows per tensor-parallel group, which all see the same rows (Note [tensor parallel plan],
    autofit/parallel/tensor_parallel.py). A DDP estimate's ``notes`` say which bucket mode it assumed
    (``Step.gradient_as_bucket_view``).

    A model the user compiled is estimated as compiled either way (Note [inductor without kernels],
    docs/fine-tuning.md). ``est.input_rows`` says which rows of inputs ``Step.inputs`` counted.

    The defaults (``device="cpu"``, ``precision="fp32"``, the plain ``Step()``: no checkpointing) differ from
    ``plan``'s (``"cuda"``, ``"auto"``, ``Savers()``'s "auto") on purpose: an estimate describes one step whose knobs
    you fix ("auto" is the planner's choice), with the same defaults as :func:`measure`, which must run on any
    machine, so that the two calls with the same arguments compare.

    ``batch_dim``: which rows of the sample are the batch (Note [the batch dimension], autofit/training/batch.py):
    an ``autofit.BatchDim(dim, shared=...)``, or its dim alone: 0 (the default), 1 for time-major sequences
    (``nn.LSTM``'s default), a pair (the inputs', the target's) when they differ; ``BatchDim.shared`` names the
    inputs that are not per-sample (positions of a tuple sample, keys of a dict sample), passed whole to every
    micro-batch (the old ``shared=`` keyword, Note [flat keywords]).
    """
    import_lazy_modules()  # Note [lazy imports and Ctrl-C]
    model = check_model(model)
    given = _one_step("estimate", device, precision, layout, step, batch_dim, deprecated)
    batch, target_batch = as_inputs(sample, target, batch_dim=given.batch_dim)
    config = _config(model, given, optimizer, batch, target_batch, loss_fn)
    device_model = resolve_device(config.device, config.gpu, given.expandable)
    with naming_inputs(lambda: batch):
        sim = simulate_step(model, batch, target_batch, loss_fn, config, device_rules=device_model.simulation_rules)
    est = device_model.estimate(sim)
    # a term over a fifth of the peak named, with its knob (Note [deferred reduce-scatter], autofit/solve/terms.py)
    est = replace(est, notes=est.notes + large_term_notes(
        model, config, est.device_bytes, device_model,
        flag="reducing every micro-batch (reduce_every_micro_batch=True; autofit estimate --reduce-every-micro-batch)",
        breakdown=est.breakdown))
    est = replace(est, notes=est.notes + estimate_notes(config.layout, config.gradient_as_bucket_view))
    if len(batch.per_sample_tensors()) < len(batch.tensors()):  # say what the rule did (Note [the batch dimension])
        est = replace(est, notes=(*est.notes, f"inputs by Note [the batch dimension]: {batch.layout()}"))
    return est


@keeps_user_rng  # Note [the user's random state]
@restores_user_hooks  # Note [user hooks]
def measure(
    model: nn.Module, sample: Any, *, step: Step | int | Mapping[str, Any] | None = None, target: Any = None,
    loss_fn: LossFn | None = None, optimizer: Any = "adamw", batch_dim: BatchDim | int | tuple[int, int] = 0,
    device: Device | str = "cpu", precision: Precision | Any = "fp32",
    layout: Layout | int | None = None, steps: int = 1, **deprecated: Any,
) -> Measurement:
    """Run the same step for real on a copy of ``model`` on ``device`` and measure its peak with the allocator.

    Same arguments and defaults as :func:`estimate` (the old flat ``micro_batch_size=``, ``gpu=``, ``world_size=``,
    ``accumulation_steps=``, ... too, deprecated: Note [flat keywords], autofit/options.py) (``Step(inputs="batch")``:
    the whole batch is built before the step and every micro-batch is a slice of it, as the trainer runs them;
    ``device="cpu"`` and ``precision="fp32"`` so that it runs on any machine; ``plan`` defaults to ``"cuda"`` and
    ``"auto"`` because it chooses for a GPU). ``steps``: the measured windows after one warm-up window (which creates
    the optimizer state); the figures are the highest of them.

    A parallel ``layout`` (``Layout(world_size=N, strategy=...)``, with ``reshard_after_forward``, ``replicate``,
    ``tensor_parallel``, as :func:`estimate` takes them) runs ``world_size`` processes on this CPU joined by gloo,
    each the step of one rank laid out for real (autofit/measure/ranks.py); the figures are rank 0's, the rank
    :func:`estimate` simulates, and ``rank_peaks`` holds every rank's peak. The model, sample and ``loss_fn`` are
    pickled to the processes (no lambdas)."""
    import_lazy_modules()  # Note [lazy imports and Ctrl-C]
    model = check_model(model)
    given = _one_step("measure", device, precision, layout, step, batch_dim, deprecated)
    batch, target_batch = as_inputs(sample, target, batch_dim=given.batch_dim)
    config = _config(model, given, optimizer, batch, target_batch, loss_fn)
    if not config.device.available():
        raise InvalidInputError("measure(device='cuda') needs a CUDA device; this machine has none")
    expandable = given.expandable
    if resolve_device(config.device, config.gpu, expandable).caching_allocator and expandable is not None:
        # the setting the figures are measured under (Note [expandable segments as an input], autofit/device.py)
        put_in_place(f"expandable_segments:{expandable}", "measure(device=Device(expandable_segments=...)) runs with")
    return measure_laid_out(model, batch, target_batch, loss_fn, config, steps=steps)


@keeps_user_rng  # Note [the user's random state]
@restores_user_hooks  # Note [user hooks]
def analyse(
    model: nn.Module, sample: Any, *, target: Any = None, loss_fn: LossFn | None = None, precision: Any = "fp32",
    optimizer: Any = "adamw", device: str = "cpu", gpu: str | None = None, shared: Any = None, batch_dim: Any = 0,
) -> Analysis:
    """Trace the forward and tabulate every module: parameter bytes, bytes saved for backward, output bytes and
    FLOPs (per sample and fixed), and whether it may be a checkpoint segment; plus the step's peak per stage as a
    function of the micro-batch. Fake tensors only, unless the forward reads tensor values (then a real copy runs at
    the analysis' micro-batches, 2 and 3). No CPU kernel probes (``plan`` adds them for CPU targets), so on the CPU
    the profile leaves out kernel scratch memory. ``model`` is never modified."""
    import_lazy_modules()  # Note [lazy imports and Ctrl-C]
    model = check_model(model)
    batch, target_batch = as_inputs(sample, target, shared, batch_dim)
    config = make_step_config(micro_batch_size=1, precision=precision, optimizer=optimizer, device=device, gpu=gpu)
    with naming_inputs(lambda: batch), forward_errors():  # the capture runs the forward outside the simulator's
        return analyse_model(model, batch, target_batch, loss_fn, config,
                             device_rules=resolve_device(config.device, config.gpu).simulation_rules)
