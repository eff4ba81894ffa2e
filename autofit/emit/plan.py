"""The plan: the chosen knobs, the verified estimate behind them and the alternatives; data that emit/apply.py
turns into a trainer (Note [the plan is data]). Its JSON is emit/plan_json.py's (``PlanJson``), its rows and the
alternatives it reports emit/plan_text.py's (``PlanText``, ``Alternative``, ``Forgone``): both bases of ``Plan``."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

from torch import nn

from autofit.core.errors import InvalidInputError, require_int
from autofit.training.config import DEVICES, DeviceKind, StepConfig, ZeroGrad, as_zero_grad
from autofit.training.length import LengthSpec
from autofit.training.normalisation import LOSS_REDUCTIONS
from autofit.training.optim import OPTIMIZER_NAMES, OptimizerSpec, as_optimizer_spec
from autofit.training.precision import PrecisionPolicy
from autofit.core.report import MemoryEstimate
from autofit.emit.model_record import ModelRecord
from autofit.emit.plan_json import PlanJson
from autofit.emit.plan_text import Alternative, Forgone, PlanText
from autofit.features import FEATURES, FURTHER, step_features
from autofit.training.chunked_loss import LossChunks
from autofit.solve.lengths import rows_for_length
from autofit.parallel.layout import Parallel, trade_words
from autofit.core.units import format_bytes

__all__ = ["Plan", "plan_step", "use_wrap", "why_layout"]

# the function Plan.wrap hands the plan to: autofit.emit.apply.wrap, set by autofit/emit/__init__.py (Note [the plan
# is data], in Plan.wrap)
_WRAP: list[Callable[..., Any]] = []


def use_wrap(wrap: Callable[..., Any]) -> None:
    """Make ``wrap`` the function :meth:`Plan.wrap` calls (autofit/emit/__init__.py does, once)."""
    _WRAP[:] = [wrap]


def _flat_layout_field(name: str) -> property:
    """``plan.<name>``, a field of the plan's layout read flat: ``plan.parallel.<name>``, with a ``FutureWarning``
    (Note [the plan's layout])."""
    def read(self: Plan) -> Any:
        warnings.warn(f"plan.{name} is deprecated: write plan.parallel.{name} (the plan holds its layout whole, "
                      "Note [the plan's layout])", FutureWarning, stacklevel=2)
        return getattr(self.parallel, name)
    return property(read, doc=f"Deprecated: ``plan.parallel.{name}`` (Note [the plan's layout]).")


@dataclass(frozen=True, kw_only=True)
class Plan(PlanJson, PlanText):
    """What ``autofit.plan`` decided, with the verified estimate of exactly this configuration as three figures
    (see :class:`~autofit.MemoryEstimate`): ``peak_allocated_bytes`` (~ ``torch.cuda.max_memory_allocated``; the
    same number as ``peak_bytes``), ``peak_reserved_bytes`` (~ ``max_memory_reserved``) and ``device_bytes``
    (~ nvidia-smi: reserved plus the CUDA context), which the budget is checked against."""

    micro_batch_size: int
    gradient_accumulation_steps: int
    batch_size: int  # effective batch: samples per optimizer step over all ranks
    last_micro_batch_size: int  # the last micro-batch of a window when batch_size does not divide evenly
    precision: PrecisionPolicy
    checkpoint: tuple[str, ...]
    peak_bytes: int  # = peak_allocated_bytes (the name the API began with)
    device_bytes: int  # what the budget is checked against (CUDA: allocator reserve and context included)
    budget_bytes: int
    device: DeviceKind  # "cpu" or "cuda", held as a DeviceKind
    optimizer: str
    predicted_step_seconds: float
    estimate: MemoryEstimate
    gpu: str | None = None
    frontier: tuple[Alternative, ...] = ()
    notes: tuple[str, ...] = field(default_factory=tuple)
    clip_grad_norm: float | None = None  # the trainer clips gradients to this norm before each optimizer step
    # where the step clears the gradients (Note [where zero_grad falls], training/step.py): "after-step" (the
    # default), "before-forward" or "after-forward" (Lightning's); written to the JSON only when not the default
    zero_grad: ZeroGrad = ZeroGrad.AFTER_STEP
    peak_reserved_bytes: int = 0  # ~ max_memory_reserved (0: taken from the estimate)
    # Variable-length batches (Note [the length of a batch], autofit/training/length.py): the sample's maximum sizes, and
    # the rows per micro-batch each length fits, longest first (Note [rows by length], solve/lengths.py).
    lengths: LengthSpec | None = None
    rows_by_length: tuple[tuple[int, int], ...] = ()
    # the optimizer steps each parameter in backward (Note [optimizer step in backward], autofit/training/in_backward.py)
    optimizer_in_backward: bool = False
    # offloading (Note [offload], docs/offload.md): modules whose saved activations live in host memory (whether
    # parameters, gradients and optimizer state do is the layout's offload_states)
    offload: tuple[str, ...] = ()
    host_budget_bytes: int | None = None  # the host memory the plan was allowed (None: not checked)
    # kept free for what the estimate does not model (Note [the margin], autofit/validate.py): device_bytes fits
    # budget_bytes - margin_bytes
    margin_bytes: int = 0
    # an uneven plan (last_micro_batch_size < micro_batch_size) in the terms other frameworks can express: equal
    # micro-batches (micro, accumulation) over the same effective batch, verified to fit (Note [even split]); the
    # exports use it. None when the plan is even already.
    even_split: tuple[int, int] | None = None
    # the fewest rows the model accepts in a micro-batch (Note [micro-batches a model refuses], capture/rows.py): the
    # trainer's last micro-batch takes rows from the one before rather than hold fewer
    min_rows: int = 1
    # the step features the planner climbed (plan(allow=...), Note [the ladder]), each under its Feature.field
    # (Note [step features], autofit/features/): the output head and the cross-entropy in chunks of tokens (Note
    # [chunked cross-entropy]), and the 8-bit optimizer the trainer builds in place of the one given to wrap() (its
    # dotted class name, Note [8-bit optimizer state])
    chunked_loss: LossChunks | None = None
    low_bit_optimizer: str | None = None
    # plan(compile=True): the trainer compiles the model (the step feature "compile", Note [compile as a knob])
    compile: bool = False
    # the step features registered after the first ones (Note [carried features], autofit/features/base.py), (name,
    # value) pairs sorted by name, each read as ``plan.<name>`` (None where not in force): plan(float8=...) or the
    # "float8" rung, the linears converted to torchao's Float8Linear before the layout (Note [Float8 training])
    more_features: tuple[tuple[str, Any], ...] = ()
    # the trainer allocates every gradient before the first forward and keeps it between steps, where only that fits
    # the budget (the step feature "preallocated-grads"; Note [gradients before forward as a plan knob],
    # solve/estimator.py): the estimate's, which the search decided (not an argument)
    preallocated_grads: bool = field(init=False, default=False)
    # the PYTORCH_CUDA_ALLOC_CONF the plan needs: "" (the default allocator) or "expandable_segments:True" where only
    # that fits the budget (the step feature "allocator-setting"; Note [expandable segments as a plan knob],
    # autofit/device.py): the estimate's; the trainer sets it before the step allocates, or refuses
    alloc_conf: str = field(init=False, default="")
    # those of ``checkpoint`` recomputed selectively: they keep their matmul and attention outputs and rerun the
    # rest (Note [selective recomputation], autofit/training/recompute.py); the others rerun all of their forward
    selective: tuple[str, ...] = ()
    # those of ``checkpoint`` recomputed by torchtitan's per-op policy, "op-selective" (its attention and every other
    # matmul kept: Note [torchtitan's per-op policy]), as the user fixed them (plan(checkpoint={name: policy}))
    op_selective: tuple[str, ...] = ()
    # when the plan recomputes selectively: the predicted step time of the fastest configuration, under the same
    # budget and in the same run, that recomputes whole modules only (None: not searched, or none fits)
    module_level_step_seconds: float | None = None
    # the loss the plan was planned with (Note [the plan's loss]): "default" or "custom: <module>.<name>", written to
    # the JSON; ``loss_fn`` is the function itself, known in the process that planned only
    loss: str = "default"
    loss_fn: Callable[..., Any] | None = field(default=None, compare=False, repr=False)
    # "mean" or "sum" over rows: how the trainer adds micro-batch losses up (Note [sum-reduced losses])
    loss_reduction: str = "mean"
    # inputs passed whole to every micro-batch, by position or key (Note [the batch dimension], training/batch.py)
    shared: tuple[int | str, ...] = ()
    # the model the plan was made for, which wrap() checks (Note [the plan's model], emit/model_record.py); None: not
    # recorded (a plan written before the record, or built by hand), and wrap() takes any model
    made_for: ModelRecord | None = None
    # the dim of the batch in the inputs and in the target (Note [the batch dimension])
    batch_dim: tuple[int, int] = (0, 0)
    # beside a plan that climbed the ladder (offload, stored lower, an opt-in rung): the best without that rung
    alternatives: tuple[Forgone, ...] = ()

    # The parallel layout the plan was verified with (autofit/parallel/layout.py): strategy, ranks, FSDP2's units and
    # reshard, HSDP's replicate, ranks per node, tensor and sequence parallel, the states on the host, gradient sync
    # under accumulation; validated where it is built. The trainers lay the model out by it. Held whole, read whole
    # (``plan.parallel.world_size``); the JSON keeps its fields flat (Note [the plan's layout]).
    parallel: Parallel = field(default_factory=Parallel)
    # The step the planner's final estimate simulated (Note [the plan's step]): what ``Plan.step`` is, for a plan
    # ``autofit.plan`` made; None for a plan loaded from JSON or built by hand. Not written to the JSON, and no part
    # of equality: ``Plan.step`` is a function of the plan's own fields, which are.
    verified_step: StepConfig | None = field(default=None, compare=False, repr=False)

    # the layout's fields read flat on the plan: deprecated (Note [the plan's layout])
    strategy = _flat_layout_field("strategy")
    world_size = _flat_layout_field("world_size")
    shard_units = _flat_layout_field("shard_units")
    reshard_after_forward = _flat_layout_field("reshard_after_forward")
    replicate = _flat_layout_field("replicate")
    gpus_per_node = _flat_layout_field("gpus_per_node")
    tensor_parallel = _flat_layout_field("tensor_parallel")
    tensor_plan = _flat_layout_field("tensor_plan")
    offload_states = _flat_layout_field("offload_states")
    reduce_every_micro_batch = _flat_layout_field("reduce_every_micro_batch")

    @functools.cached_property
    def step(self) -> StepConfig:
        """The training step this plan runs, as one value: the one its estimate was verified with (Note [the plan's
        step]). The trainers and the integrations read it; built on first read, from the plan's fields."""
        step = plan_step(self)
        return self.verified_step if step == self.verified_step else step

    def checkpoint_policy(self, name: str) -> str:
        """How module ``name`` is recomputed: "full", "selective", "op-selective", or "none"."""
        if name not in self.checkpoint:
            return "none"
        return "selective" if name in self.selective else "op-selective" if name in self.op_selective else "full"

    @property
    def checkpoint_policies(self) -> dict[str, str]:
        """Recomputed module -> its policy ("full", "selective" or "op-selective"), what ``estimate``/``measure``
        take as ``checkpoint=``."""
        return {n: self.checkpoint_policy(n) for n in self.checkpoint}

    @property
    def host_bytes(self) -> int:
        """Host memory the offloaded tensors need at their high-water mark (pinned on a GPU); 0 without offload."""
        return self.estimate.host_bytes

    def __post_init__(self) -> None:
        object.__setattr__(self, "preallocated_grads", self.estimate.preallocated_grads)
        object.__setattr__(self, "alloc_conf", self.estimate.alloc_conf)
        for name in ("micro_batch_size", "gradient_accumulation_steps", "batch_size", "last_micro_batch_size"):
            require_int(f"Plan.{name}", getattr(self, name))
        if not self.peak_reserved_bytes:
            object.__setattr__(self, "peak_reserved_bytes", self.estimate.peak_reserved_bytes)
        for name in ("peak_bytes", "device_bytes", "budget_bytes", "peak_reserved_bytes", "margin_bytes"):
            require_int(f"Plan.{name} (bytes)", getattr(self, name), minimum=0)
        if self.device not in DEVICES:
            raise InvalidInputError(f"Plan.device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        object.__setattr__(self, "device", DeviceKind(self.device))
        object.__setattr__(self, "zero_grad", as_zero_grad(self.zero_grad))
        if not isinstance(self.parallel, Parallel):
            raise InvalidInputError(f"Plan.parallel must be an autofit.parallel.layout.Parallel, got {self.parallel!r}")
        if self.loss_reduction not in LOSS_REDUCTIONS:
            raise InvalidInputError(f"Plan.loss_reduction must be 'mean' or 'sum', got {self.loss_reduction!r}")
        if self.made_for is not None and not isinstance(self.made_for, ModelRecord):
            raise InvalidInputError(f"Plan.made_for must be a ModelRecord or None, got {type(self.made_for).__name__}")
        if not isinstance(self.precision, PrecisionPolicy):
            raise InvalidInputError(f"Plan.precision must be a PrecisionPolicy, got {type(self.precision).__name__}")

    @property
    def layout(self) -> str:
        """The parallel layout in words: 'fsdp2 (ZeRO-3)', 'fsdp2 (ZeRO-2)', 'hsdp 2 x 4 (ZeRO-3)', 'ddp'."""
        return self.parallel.layout.words(after_forward=" after forward", alone="None")

    @property
    def peak_allocated_bytes(self) -> int:
        """~ ``torch.cuda.max_memory_allocated()`` (the CPU allocator's peak on the CPU): ``peak_bytes``."""
        return self.peak_bytes

    def micro_batch_size_for(self, shape: int | tuple[int, ...]) -> int:
        """Rows per micro-batch for a batch of this length: ``shape`` is the length, or the shape of the batch's
        ``[batch, length, ...]`` tensors (dim 1 is the length). Shorter batches take the entry of the smallest
        tabulated length at least theirs; a plan without a length (or a batch at full length) gives
        ``micro_batch_size``. A length over the planned maximum is an error naming both."""
        if isinstance(shape, int) and not isinstance(shape, bool):
            length = shape
        else:
            try:
                dims = tuple(int(s) for s in shape)
            except (TypeError, ValueError) as e:
                raise InvalidInputError(f"micro_batch_size_for: give a length or a shape, got {shape!r}") from e
            if len(dims) < 2:
                raise InvalidInputError(
                    f"micro_batch_size_for: shape {dims} has no length dim; give (batch, length, ...) or the length"
                )
            length = dims[1]
        require_int("micro_batch_size_for: length", length)
        longest = self.lengths.length if self.lengths is not None else None
        if longest is None or not self.rows_by_length:
            return self.micro_batch_size
        if length > longest:
            raise InvalidInputError(
                f"a batch of length {length} is longer than the plan's maximum {longest} (the sample given to plan() "
                "is the longest batch): plan with the longest batch you train on, or truncate this one"
            )
        return rows_for_length(self.rows_by_length, length)

    # ---- the emitted wrapper ---------------------------------------------------------------------------------------
    def wrap(self, model: nn.Module, optimizer, *, loss_fn=None, loss_reduction: str | None = None, shared=None):
        """A :class:`~autofit.emit.Trainer` that trains ``model`` with ``optimizer`` exactly as planned.

        Without ``loss_fn`` it trains with the loss the plan was planned with (Note [the plan's loss]): the default
        one, or the ``loss_fn`` given to ``plan()`` in this process; a plan loaded from JSON that was planned with a
        custom loss needs it again (an :class:`~autofit.InvalidInputError` otherwise). ``loss_reduction``: "mean" or
        "sum" over rows (a sum's micro-batch losses add up unweighted, Note [sum-reduced losses]); None takes
        ``plan.loss_reduction``, which ``plan()`` found by running the loss. ``shared``: inputs passed whole to every
        micro-batch (None: ``plan.shared``, Note [the batch dimension]).
        For multi-process plans (``world_size > 1``) it returns a DDP or FSDP2 trainer; FSDP2 needs ``optimizer``
        to be a factory ``params -> Optimizer`` because sharding replaces the parameters."""
        # Note [the plan is data]
        # ~~~~~~~~~~~~~~~~~~~~~~~
        # A plan is a value: the knobs, the estimate behind them, JSON in and out. The trainers read it
        # (emit/trainer.py, emit/distributed.py), so it cannot import them back without an import cycle, even one in a
        # function or under TYPE_CHECKING (tests/test_architecture.py counts both). The wrapping lives in emit:
        # ``autofit.emit.wrap(plan, model, optimizer)`` (emit/apply.py). This method, the call the README teaches,
        # hands itself to that function through ``_WRAP``, which autofit/emit/__init__.py fills: Python runs a
        # package's ``__init__`` before any import of one of its modules returns, so the slot is filled before any
        # code outside the package can hold this class, let alone a Plan. One slot, one filler: not a plug-in point.
        return _WRAP[0](self, model, optimizer, loss_fn=loss_fn, loss_reduction=loss_reduction, shared=shared)

    def planned_loss(self) -> Callable[..., Any] | None:
        """The loss the trainer uses when ``wrap`` is given none: the planned one (None: the default loss)."""
        # Note [the plan's loss]
        # ~~~~~~~~~~~~~~~~~~~~~~
        # The plan's memory, and its meaning, were computed with one loss; a trainer that silently falls back to the
        # default trains something else (label smoothing dropped, or the wrong output). So the plan keeps the
        # function (compare=False: two plans of the same knobs are equal whatever function object they hold) and a
        # description for the JSON. A function cannot travel through JSON, and loading runs no code, so a loaded plan
        # whose loss was custom refuses to guess rather than train with the default.
        if self.loss == "default" or self.loss_fn is not None:
            return self.loss_fn
        raise InvalidInputError(
            f"this plan was planned with a custom loss ({self.loss}) and was loaded from JSON, which cannot carry a "
            "function: pass it again, plan.wrap(model, optimizer, loss_fn=...)"
        )


# Note [the plan's layout]
#     The plan holds its parallel layout as one value, ``Plan.parallel``, the one the estimate was verified with
#     and the layout of the plan's step (``Plan.step.layout``, Note [the plan's step]), by which the trainers lay
#     the model out; its fields are read on it (``plan.parallel.world_size``), so that a new layout dimension adds
#     no field to the plan (Note [layout dimensions], autofit/parallel/dimension.py). The JSON has always had them
#     flat, between the plan's other fields: the layout says after which field each stands (Note [the layout in a
#     plan's JSON], autofit/parallel/layout.py), so plans are written byte for byte as before, and ``from_json``
#     reads them back into one ``Parallel`` (``layout_from_json``, the one reader of the flat spelling). The flat
#     reads (``plan.world_size``), ``Plan(world_size=...)`` and ``dataclasses.replace(plan, world_size=...)`` still
#     work, deprecated, with a ``FutureWarning`` naming ``plan.parallel``: ``_with_flat_layout`` folds flat fields
#     into ``parallel`` before the dataclass's own ``__init__`` runs, and the layout validates them as it validates
#     any other.
_LAYOUT_FIELDS = frozenset(f.name for f in fields(Parallel))
# What the plan derives from its estimate (the search decided it there: alloc_conf, preallocated_grads): written to
# the JSON for readers, and given back to Plan(...) (from_json, Plan(**plan.__dict__)) it is ignored
_DERIVED_FIELDS = frozenset(f.name for f in fields(Plan) if not f.init)


def _with_flat_layout(init: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(init)
    def __init__(self, **kwargs: Any) -> None:
        for k in _DERIVED_FIELDS & kwargs.keys():
            del kwargs[k]
        flat = {k: kwargs.pop(k) for k in list(kwargs) if k in _LAYOUT_FIELDS}  # in the caller's order
        if flat:
            named = ", ".join(f"{k}={v!r}" for k, v in flat.items())
            warnings.warn(f"Plan({named}) is deprecated: write Plan(parallel=Parallel({named})), or "
                          f"dataclasses.replace(plan, parallel=dataclasses.replace(plan.parallel, {named})) (Note "
                          "[the plan's layout])", FutureWarning, stacklevel=3)
            kwargs["parallel"] = replace(kwargs.get("parallel") or Parallel(), **flat)
        init(self, **kwargs)
    return __init__


Plan.__init__ = _with_flat_layout(Plan.__init__)


# plan.float8: a feature carried in more_features (Note [carried features]), read as a field would be
for _feature in FURTHER:
    setattr(Plan, _feature.field, property(_feature.in_force, doc=f"the step feature {_feature.name!r}'s value"))


# Note [the plan's step]
#     The plan carries the step its estimate was verified with, ``Plan.step`` (a StepConfig, training/config.py):
#     the trainers, the distributed one and the integrations read it, and replace only what the real run knows and
#     the estimate could not, each with its reason where it does (the device the parameters are on, the optimizer
#     given to ``wrap``). ``plan_step`` is the one function from a plan's fields to that step, for every plan: the
#     planner's, whose ``assemble_plan`` (emit/assemble.py) checks that it gives back exactly the step the final
#     estimate simulated (``Estimator.config``, solve/estimator.py) and keeps that value (``verified_step``), and a
#     plan loaded from JSON, whose fields are the ones the JSON has always had, so the JSON is written as before
#     and old plans load. It reads every knob from the plan's fields, so ``dataclasses.replace(plan,
#     micro_batch_size=4)`` runs four rows; from ``verified_step`` it takes only what the JSON cannot carry, the
#     optimizer's factory (a JSON holds its name: a named optimizer loads as that name builds it, another as a
#     factory that refuses to build, since the trainer steps the optimizer given to ``wrap`` anyway). The rows the
#     trainer holds (``held_rows``) are one data-parallel rank's share of the batch, as the request counts them.
#     The step is built on first read, so a plan built by hand with knobs a step refuses fails where it is trained.
_STEP_FIELDS = frozenset(f.name for f in fields(StepConfig))


def plan_step(plan: Plan) -> StepConfig:
    """The step ``plan`` runs, from its fields (See Note [the plan's step]): what ``Plan.step`` reads."""
    verified = plan.verified_step
    optimizer = (verified.optimizer if verified is not None and verified.optimizer.name == plan.optimizer
                 else _optimizer_named(plan.optimizer))
    knobs = dict(
        micro_batch_size=plan.micro_batch_size, accumulation_steps=plan.gradient_accumulation_steps,
        precision=plan.precision, checkpoint=plan.checkpoint, selective=plan.selective,
        op_selective=plan.op_selective, optimizer=optimizer,
        device=plan.device, held_rows=plan.parallel.rank_rows(plan.batch_size), gpu=plan.gpu,
        layout=plan.parallel, clip_grad_norm=plan.clip_grad_norm, offload=plan.offload, compile=plan.compile,
        preallocated_grads=plan.preallocated_grads, zero_grad=plan.zero_grad,
    )
    # each step feature's value, where the step holds one (Note [step features]); those carried in more_features
    # all are the step's (Note [carried features])
    knobs.update((f.field, getattr(plan, f.field)) for f in FEATURES if f.own_field and f.field in _STEP_FIELDS)
    return StepConfig(**knobs, more_features=step_features(plan))


def _optimizer_named(name: str) -> OptimizerSpec:
    """The optimizer a loaded plan names: as that name builds it, or one whose factory says why it cannot."""
    if name in OPTIMIZER_NAMES:
        return as_optimizer_spec(name)
    return OptimizerSpec(name, functools.partial(_not_in_json, name))


def _not_in_json(name: str, params: Any) -> Any:
    raise InvalidInputError(
        f"this plan was loaded from JSON, which names its optimizer ({name!r}) but cannot carry how it is built: "
        "wrap(model, optimizer) steps the optimizer it is given; to estimate, pass the optimizer again"
    )


def why_layout(chosen: Plan, all_plans: list[Plan]) -> str:
    """The note saying why ``chosen``'s data-parallel layout won over the other layouts' plans."""
    other = sorted((p for p in all_plans if p is not chosen), key=lambda p: p.predicted_step_seconds)
    if not other:
        return (f"{chosen.layout} chosen: no other layout fits the budget with a faster step (the notes that follow "
                "say why each was left)")
    against = "; ".join(f"{o.layout} {o.predicted_step_seconds:.3g} s (micro-batch {o.micro_batch_size}, "
                        f"{format_bytes(o.device_bytes)})" for o in other)
    trades = "".join(f"; {words}" for words in trade_words(p.parallel for p in all_plans))  # the dimensions' own
    return (f"{chosen.layout} chosen: predicted step {chosen.predicted_step_seconds:.3g} s (micro-batch "
            f"{chosen.micro_batch_size}, {format_bytes(chosen.device_bytes)}), against {against}. FSDP2 shards "
            "parameters, gradients and optimizer state but gathers parameters every micro-batch; ZeRO-2 holds the "
            "gathered parameters from forward to backward instead of gathering them again" + trades)
