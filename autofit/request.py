"""The request: what the user asked ``plan`` for, validated once into a frozen value every later stage reads.

Everything a stage could reject is checked here (model, sample and target, budget, batch and world size, strategy,
precision, optimizer, checkpoint names), so the stages after it take typed values and never re-validate.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from torch import nn

from autofit.capture.depth import Blocks, find_blocks
from autofit.capture.rows import smallest_rows
from autofit.capture.user_hooks import restores_user_hooks
from autofit.training.batch import Batch
from autofit.training.chunked_loss import LossChunks
from autofit.device import DeviceTarget, resolve_device
from autofit.options import Layout, Options, Precision
from autofit.core.errors import require_int
from autofit.core.rng import keeps_user_rng
from autofit.features import OPT_IN, step_features, user_features
from autofit.features.base import with_carried
from autofit.training.loss import LossFn
from autofit.training.optim import OptimizerSpec, as_optimizer_spec
from autofit.training.precision import PrecisionPolicy
from autofit.training.config import ZeroGrad, as_zero_grad
from autofit.training.step import StepConfig, make_step_config
from autofit.core.units import parse_budget
from autofit.parallel.layout import Parallel, Strategy  # the layout value (parallel/layout.py); re-exported here
from autofit.parallel.requested import planned_layouts
from autofit.core._torch_interrupts import import_lazy_modules
from autofit.validate import (allow_names, as_inputs, auto_pins, check_capacity, check_model, check_positions,
                              cpu_precision_notes, fixed_checkpoint, fixed_policies, fp32_module_names,
                              resolve_host_budget, margin_for, pinned, precisions, stored_options)

# plan(extrapolate_depth=True) cuts a run of at least this many identical blocks (Note [depth extrapolation]);
# "auto" (the default) one of at least DEPTH_AUTO_BLOCKS: from there the cut simulations (2, 3 and 4 blocks, or an
# analysis at 3) cost less than one of the whole model, measured in benchmarks/planning.py ("deep" table)
DEPTH_MIN_BLOCKS = 8
DEPTH_AUTO_BLOCKS = 16

__all__ = ["Parallel", "PlanRequest", "make_request"]


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """The validated inputs of ``plan``; built by :func:`make_request`."""

    model: nn.Module
    batch: Batch
    target: Batch | None
    loss_fn: LossFn | None
    device: DeviceTarget  # resolved once: the CPU or one catalog GPU
    budget_bytes: int  # what the user gave, per device
    margin_bytes: int  # kept free for what the estimate does not model (Note [the margin]); plans fit the rest
    batch_size: int  # effective batch, all ranks
    per_rank: int  # samples per rank per optimizer step
    world_size: int
    strategies: tuple[Strategy | None, ...]  # to plan, in order; the fastest wins
    gpus_per_node: int = 0  # ranks per node (0: one node)
    reshard_options: tuple[bool | int, ...] = (True,)  # FSDP2 reshard_after_forward values to plan
    replicate_options: tuple[int, ...] = (1,)  # HSDP replicate sizes to plan (1: plain FSDP)
    tensor_options: tuple[int, ...] = (1,)  # tensor-parallel degrees to plan (1: none; docs/multi-gpu.md)
    # the user's Layout as given: each dimension reads its own options from it (Dimension.choices), the tensor
    # parallel plan ({pattern: style}; None: the model's own) among them; the fields above are what the request
    # derived and checked of it
    layout_options: Layout = Layout()
    policies: tuple[PrecisionPolicy, ...]  # allowed compute precisions, preferred first
    optimizer: OptimizerSpec
    fixed_checkpoint: tuple[str, ...] | None  # None: the planner chooses; a tuple: exactly these modules
    clip_grad_norm: float | None  # max_norm of clip_grad_norm_ before each optimizer step (None: no clipping)
    # where the step clears the gradients (Note [where zero_grad falls], autofit/training/step.py)
    zero_grad: ZeroGrad = ZeroGrad.AFTER_STEP
    quick: bool  # plan(): try the quick path first (Note [the quick path], solve/quick.py), no front beyond the search
    auto_precision: bool  # the first policy is the device's fastest ("auto", or a single policy)
    notes: tuple[str, ...] = ()
    # Stored precisions the planner may turn to when the model's own does not fit, in order of risk (Note [stored
    # precision], autofit/training/stored.py): each a policy whose ``stored`` is set
    stored_options: tuple[PrecisionPolicy, ...] = ()
    # plan(fp32_modules=...): what the user named, and the qualified names each resolved to
    pins: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # plan(fp32_modules="auto"): the final norm and the output head, pinned only when the plan still fits with them
    optional_pins: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # plan(offload=...): whether the planner may keep activations or states in host memory (Note [offload]); only
    # on a GPU, whose host link the time model prices. host_budget_bytes: the host memory a plan may pin.
    offload: bool = False
    host_budget_bytes: int | None = None
    # plan(checkpoint={name: policy}): (names, those recomputed "selective", those "op-selective"), as
    # make_step_config reads them
    fixed_policies: tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]] = ((), (), ())
    # plan(allow=...): the opt-in rungs that change numerics (Note [the ladder]), each a step feature's value
    # resolved for this model (Feature.allow_field, Note [step features]): the chunks of a chunked loss, and the
    # 8-bit twin of the optimizer with its dotted class name; None where the rung was not allowed or does not apply
    # (the notes say why)
    allow_chunked_loss: LossChunks | None = None
    allow_eight_bit: tuple[OptimizerSpec, str] | None = None
    closed_rungs: tuple[str, ...] = ()  # rungs that would apply here but were not allowed (the error says so)
    # what a rung of the ladder set for the step it searches (Feature.field): the chunked loss, and the 8-bit
    # optimizer's class
    chunked_loss: LossChunks | None = None
    low_bit_optimizer: str | None = None
    # plan(compile=True): every step runs the model compiled (Note [compile as a knob], autofit/features/compile.py)
    compile: bool = False
    # the step features registered after the first ones (Note [carried features], autofit/features/base.py), (name,
    # value) pairs sorted by name: what allow= opened for each (under its allow_field: the Float8 of the speed rung,
    # Note [speed rungs], planner.py) and its value in force, the user's (Savers(float8=...)) or its rung's
    more_features: tuple[tuple[str, Any], ...] = ()
    # the model's run of identical blocks, simulated cut to a few of them and extrapolated (plan(extrapolate_depth=),
    # Note [depth extrapolation], autofit/capture/depth.py); None: every simulation runs the whole model
    blocks: Blocks | None = None
    # extrapolate_depth="auto": a cut whose simulations hold more blocks in all than the whole model is not tried
    # (the whole model is simulated instead: cheaper, and exact); True tries every cut
    cheaper_cuts_only: bool = False
    # the fewest rows a micro-batch may hold: 2 when the model refuses one row (Note [micro-batches a model refuses],
    # autofit/capture/rows.py)
    min_rows: int = 1
    # what the user asked, by concern (autofit/options.py), "auto" included; the fields above are these resolved
    options: Options = Options()

    @property
    def fit_bytes(self) -> int:
        """What a plan's estimate must fit: the budget less the margin."""
        return self.budget_bytes - self.margin_bytes

    def step(self, parallel: Parallel, accumulation_steps: int = 1) -> StepConfig:
        """The step every configuration of this request shares at ``parallel``'s layout: the knobs the user fixed
        (optimizer, clipping, the target) and the layout's. A stage or a search candidate sets the rest (micro-batch,
        accumulation, precision, recomputation, offload, in-backward stepping) with ``dataclasses.replace``, so the
        whole step travels as one value through the analysis, the search and the full estimates.
        ``accumulation_steps``: where the layout's rules read them (a pipeline schedule's micro-batches)."""
        return make_step_config(
            micro_batch_size=1, accumulation_steps=accumulation_steps, optimizer=self.optimizer, device=self.device.kind, held_rows=self.per_rank,
            gpu=self.device.name, layout=parallel, clip_grad_norm=self.clip_grad_norm,
            chunked_loss=self.chunked_loss, compile=self.compile, zero_grad=self.zero_grad,
            more_features=step_features(self))

    def for_layout(self, parallel: Parallel) -> PlanRequest:
        """The request as ``parallel`` runs it: each rank trains the rows of its data rank, the layout's share of
        batch_size (``Parallel.rank_rows``: a dimension whose ranks share their rows, tensor parallel's T, divides the
        world size by its degree first: Note [layout dimensions])."""
        per_rank = parallel.rank_rows(self.batch_size)
        return self if per_rank == self.per_rank else replace(self, per_rank=per_rank)

    @property
    def allow_checkpoint(self) -> bool:
        return self.fixed_checkpoint is None

    @property
    def fixed_selective(self) -> tuple[str, ...]:
        """Those of the user's fixed checkpoint set given as ``{name: "selective"}`` (autofit/training/recompute.py)."""
        return self.fixed_policies[1]

    @property
    def fixed_op_selective(self) -> tuple[str, ...]:
        """Those of the user's fixed set given as ``{name: "op-selective"}`` (torchtitan's per-op policy)."""
        return self.fixed_policies[2]

    @property
    def row_bytes(self) -> int:
        """Bytes one sample adds to the inputs and targets (batch tensors only)."""
        total = 0
        for b in (self.batch, self.target):
            if b is None:
                continue
            for t in b.per_sample_tensors():
                total += t.nelement() // b.size * t.element_size()  # whichever dim is the batch
        return total


# make_request runs the user's forward (at one row on a fake copy, Note [micro-batches a model refuses]), so it keeps
# what an entry point keeps; plan_with_analysis keeps them through the planning, so plan, the two in turn, keeps them
# throughout
@keeps_user_rng  # Note [the user's random state]
@restores_user_hooks  # Note [user hooks]
def make_request(
    model: Any, sample: Any, budget: int | str, *, options: Options = Options(), batch_size: int | None = None,
    target: Any = None, loss_fn: LossFn | None = None, optimizer: Any = "adamw", clip_grad_norm: float | None = None,
) -> PlanRequest:
    """The request of a ``plan`` call (its keywords, autofit/planner.py), validated and resolved once. ``options``:
    its option values gathered (``Options.of`` reads them as ``plan`` takes them, shortcuts and old flat keywords
    included)."""
    d, s = options.device, options.savers
    import_lazy_modules()  # Note [lazy imports and Ctrl-C]
    model = check_model(model)
    batch, target_batch = as_inputs(sample, target, batch_dim=options.batch_dim)
    target_device = resolve_device(d.kind, d.gpu, d.expandable_segments)
    budget_bytes = parse_budget(budget, device_total_bytes=target_device.total_bytes)
    check_capacity(budget_bytes, target_device, d.allow_over_capacity)
    check_positions(model, batch, target_batch)
    notes = [target_device.note] if target_device.note else []
    if len(batch.per_sample_tensors()) < len(batch.tensors()):  # say what the rule did (Note [the batch dimension])
        notes.append(f"inputs by Note [the batch dimension]: {batch.layout()}")
    if batch_size is None:
        batch_size = batch.size
        notes.append(f"no batch_size given: planning for the sample's batch of {batch.size}")
    require_int("batch_size", batch_size)
    layout_fields = planned_layouts(
        model, options.layout, batch_size, batch.tensors(),
        # a tensor-parallel layout the user fixed, checked against clipping as the step checks it (StepConfig)
        check_step=lambda parallel: clip_grad_norm is None or make_step_config(
            micro_batch_size=1, clip_grad_norm=clip_grad_norm, layout=parallel))
    world_size = layout_fields["world_size"]
    margin_bytes = margin_for(d.margin, budget_bytes, target_device, world_size)
    may_offload = s.offload is not False and target_device.host_offload
    host_budget_bytes, host_note = (resolve_host_budget(d.host_budget, target_device, layout_fields["gpus_per_node"])
                                    if may_offload else (None, None))
    notes += [host_note] if host_note else []
    precision_fields = _precisions(model, options.precision, target_device, world_size)
    notes += cpu_precision_notes(options.precision.compute, target_device)
    spec = as_optimizer_spec(optimizer)
    rung_fields = _rungs(model, batch, target_batch, loss_fn, spec, s.allow, notes,
                         user_features(s, getattr(target_device, "gpu", None)))
    min_rows, refused = smallest_rows(model, batch) if batch_size // world_size > 1 else (1, None)
    if refused is not None:
        notes.append(f"every micro-batch keeps at least {min_rows} rows (a shorter last one takes rows from the one "
                     f"before): with one row, {refused} (Note [micro-batches a model refuses])")
    extrapolate_depth = options.search.extrapolate_depth
    return PlanRequest(
        model=model, batch=batch, target=target_batch, min_rows=min_rows, loss_fn=loss_fn, device=target_device,
        budget_bytes=budget_bytes, margin_bytes=margin_bytes, batch_size=batch_size, optimizer=spec,
        fixed_checkpoint=fixed_checkpoint(model, s.checkpoint),
        # the quick path only where the caller said no alternatives: plan() turns its None into False first, while
        # a request made with None (the CLI's, plan_with_analysis's callers) searches the front (Note [the quick path])
        quick=options.search.alternatives is False,
        fixed_policies=fixed_policies(s.checkpoint),
        # validated by the step's own rules (StepConfig), before any simulation
        clip_grad_norm=make_step_config(micro_batch_size=1, clip_grad_norm=clip_grad_norm).clip_grad_norm,
        zero_grad=as_zero_grad(s.zero_grad or "after-step"),  # Note [where zero_grad falls]
        notes=tuple(notes), offload=may_offload, host_budget_bytes=host_budget_bytes,
        **layout_fields, **precision_fields, **rung_fields,
        blocks=_depth_blocks(model, extrapolate_depth, s.compile),
        cheaper_cuts_only=extrapolate_depth == "auto",
        compile=make_step_config(micro_batch_size=1, compile=s.compile).compile,  # validated as the step validates it
        options=options,
    )


def _precisions(model: nn.Module, p: Precision, target_device: DeviceTarget, world_size: int) -> dict[str, Any]:
    """The request's fields of the precisions to plan: the compute policies and stored options, with the fp32
    modules pinned (or, with "auto", the pins the planner may drop)."""
    optional = auto_pins(model) if isinstance(p.fp32_modules, str) and p.fp32_modules == "auto" else ()
    pins = () if optional else fp32_module_names(model, p.fp32_modules)
    return dict(policies=pinned(precisions(p.compute, target_device), pins),
                stored_options=pinned(stored_options(model, p.compute, target_device, world_size, p.min_stored), pins),
                pins=pins, optional_pins=optional, auto_precision=isinstance(p.compute, (str, PrecisionPolicy)))


def _rungs(model: nn.Module, batch: Batch, target: Batch | None, loss_fn: Any, spec: OptimizerSpec, allow: Any,
           notes: list[str], more: tuple[tuple[str, Any], ...]) -> dict[str, Any]:
    """The request's fields of the opt-in rungs (Note [step features]): each feature's value where ``allow`` opened
    it, and the closed rungs that would apply; a rung allowed that does not apply adds its note to ``notes``. The
    features carried in ``more_features`` (Note [carried features]) put theirs beside ``more``, the values the user
    gave them."""
    allowed = allow_names(allow)
    opened, closed = {}, []
    for feature in OPT_IN:
        found = feature.resolve(model, batch, target, loss_fn, spec, feature.name in allowed)
        if feature.name not in allowed:
            closed += [feature.name] if found is not None else []
            found = None
        elif found is None:
            notes.append(feature.not_applicable(spec))
        if feature.own_field:
            opened[feature.allow_field] = found
        else:
            more = with_carried(more, feature.allow_field, found)
    return dict(opened, closed_rungs=tuple(closed), more_features=more)


def _depth_blocks(model: nn.Module, extrapolate_depth: Any, compile: bool) -> Blocks | None:
    """The run of identical blocks plan(extrapolate_depth=...) cuts: True from DEPTH_MIN_BLOCKS blocks, "auto" from
    DEPTH_AUTO_BLOCKS, False never; none for a compiled step (inductor compiles the whole model's graph)."""
    # extrapolate_depth is checked where it is declared (Search, autofit/options.py)
    if extrapolate_depth is False or compile:
        return None
    return find_blocks(model, DEPTH_MIN_BLOCKS if extrapolate_depth is True else DEPTH_AUTO_BLOCKS)
