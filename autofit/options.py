"""What the user may set, grouped by concern: one frozen value each, every field documented where it is declared.

``autofit.plan(model, sample, budget="8GB")`` is the simplest call; the rest is six values, each also accepted as a
shortcut (as Lightning takes ``strategy="fsdp"`` or ``FSDPStrategy(...)``):

- ``device``: a :class:`Device`; or "cpu", "cuda" (this machine's GPU, else A100-80GB), a catalog GPU ("H100");
- ``precision``: a :class:`Precision`; or its compute precision alone: "auto", "fp32", "bf16", "fp16", a
  ``PrecisionPolicy``;
- ``savers``: a :class:`Savers`; or "auto" (the planner may recompute and offload), "none" (neither);
- ``layout``: a :class:`Layout`; or an int, the world size (the planner chooses the strategy);
- ``search``: a :class:`Search`; or "auto", "exact" (no depth extrapolation: every simulation runs the whole model).
- ``step`` (``estimate`` and ``measure``, in place of ``savers`` and ``search``): a :class:`Step`, the one step's
  knobs; or an int, its micro-batch size;
- ``batch_dim`` (all three): a :class:`BatchDim`, which rows of the sample are the batch; or its dim alone: an int,
  or a pair (the inputs', the target's).

A mapping of field names is accepted for each too (``layout={"world_size": 8, "strategy": "fsdp2"}``), as a
torchtitan TOML section reads. The things that are no concern group stay keywords: ``model``, ``sample``,
``budget``, ``batch_size``, ``target`` (the loss's target), ``loss_fn``, ``optimizer`` and ``clip_grad_norm``.

Choices made here: the device's keyword is ``device``, not ``target`` (``target`` is the loss's target since the
first version, and ``device="cuda"`` stays the old call); the nodes are the layout's (``Layout.gpus_per_node``: the
ranks that share NVLink and one host), the host memory the device's (``Device.host_budget``, per node). ``estimate``
and ``measure`` take ``device``, ``precision`` and ``layout`` as ``plan`` does, and in place of ``savers`` and
``search`` (what the planner may try) one :class:`Step`: the knobs of the one step they describe, fixed
(``micro_batch_size``, ``accumulation_steps``, ``checkpoint``, ``offload``, ``compile``, ...;
``step={"micro_batch_size": 8, "accumulation_steps": 4}`` too).

These values hold what the user asked, "auto" included; the request (autofit/request.py) resolves them against the
model and the device once, and checks what needs the model there.

Note [flat keywords]
    Before these values, every knob was one more keyword of ``plan`` (29 of them), copied into ``plan_with_analysis``,
    ``make_request``, ``estimate``, ``measure`` and the command line. The old keywords still work for now: each maps
    to one field of one value in :data:`FLAT_KEYWORDS`, read in one place (:func:`gather`), with a
    ``FutureWarning`` naming the new spelling. A flat keyword beside an option value that sets it too (say
    ``gpu="H100"`` with ``device=Device(gpu="T4")``) is ambiguous and refused; a field the value leaves at its default
    is unset, and beside a shortcut the keyword refines it, so the old ``device="cuda", gpu="H100"`` reads as
    ``device=Device(gpu="H100")``. ``estimate`` and ``measure`` read their old step keywords
    (``micro_batch_size=``, ``accumulation_steps=``, ``checkpoint=``, ``compile=``, ...) the same way, each as the
    field of :class:`Step` of its name (:data:`STEP_KEYWORDS`): the word ``checkpoint`` is a ``Savers`` field for
    ``plan``, a ``Step`` field for them. The old ``shared=`` of all three is the field of :class:`BatchDim` that
    says, beside the batch's dim, which inputs have no batch (``batch_dim=BatchDim(0, shared=("mask",))``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from autofit.core.errors import InvalidInputError, require_int, require_strategy

__all__ = ["Device", "Precision", "Savers", "Layout", "Search", "Step", "BatchDim", "Options", "FLAT_KEYWORDS",
           "gather", "as_device", "as_precision", "as_savers", "as_layout", "as_search", "as_step", "as_batch_dim",
           "STEP_GROUPS", "STEP_KEYWORDS", "PLAN_GROUPS"]

DEVICE_KINDS = ("cpu", "cuda")
ZERO_GRAD_ORDERS = ("after-step", "before-forward", "after-forward")  # autofit.training.config.ZeroGrad's names


@dataclass(frozen=True, kw_only=True)
class Device:
    """The device a plan is for, and what is kept free on it and its host."""

    # "cuda" (a GPU: ``gpu`` names which) or "cpu" (this machine's CPU and its allocator)
    kind: str = "cuda"
    # a catalog GPU ("A100-80GB", "H100", "RTX 4090"; ``autofit.gpu_spec`` knows them), a card not in the catalog as
    # ``{"memory": "12GiB", "like": "RTX-4070"}``, or a ``GPUSpec``; None: this machine's GPU, else A100-80GB (checked
    # when the request resolves it, docs/cuda.md). A plan is for any GPU on any machine: nothing runs on it.
    gpu: Any = None
    # bytes kept free for what the estimate does not model: bytes, "512MB" or a share of the budget ("5%"); None:
    # 0, except on GPUs with world size > 1, where NCCL's buffers live outside the caching allocator (Note [the
    # margin], autofit/validate.py)
    margin: int | str | None = None
    # host memory a plan may pin for offloaded activations or states, per node: bytes or "64GB"; None: the catalog
    # GPU's host, or this machine's RAM when the target is this machine (Note [the host of the target])
    host_budget: int | str | None = None
    # a budget above the GPU's memory is refused unless this is True (say, to plan for a GPU not in the catalog)
    allow_over_capacity: bool = False
    # the caching allocator's PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: True the step runs with it (as
    # torchtitan launches), False without; None: estimate and measure without, a plan sets it where only it fits
    # (Note [expandable segments as an input], autofit/device.py)
    expandable_segments: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, str) or self.kind.split(":")[0] not in DEVICE_KINDS:
            raise InvalidInputError(f"Device(kind=...) must be 'cpu' or 'cuda', got {self.kind!r}: name a GPU model "
                                    "with Device(gpu='H100') (or device='H100')")
        if not isinstance(self.allow_over_capacity, bool):
            raise InvalidInputError(f"Device(allow_over_capacity=...) must be True or False, got "
                                    f"{self.allow_over_capacity!r}")
        if self.expandable_segments not in (None, True, False):
            raise InvalidInputError(f"Device(expandable_segments=...) must be True, False or None (a plan decides), "
                                    f"got {self.expandable_segments!r}")


@dataclass(frozen=True, kw_only=True)
class Precision:
    """The precision the step computes in, and how low the planner may store the parameters."""

    # "auto" (the planner chooses, fastest first), "fp32", "bf16", "fp16" (autocast with that dtype around forward
    # and loss), or a ``PrecisionPolicy`` with per-op / per-module overrides
    compute: Any = "auto"
    # the floor of the stored precision when nothing fits in the dtype the model was built in (Note [stored
    # precision], autofit/training/stored.py): "fp32" (never lower), "fp32-master" (low-precision parameters only
    # with an fp32 master copy) or "bf16"; None: "bf16" (any)
    min_stored: str | None = None
    # module classes, class names or qualified names that compute in fp32 (say the final norm and the LM head; the
    # plan's notes give each one's cost, Note [the cost of an fp32 pin]); "auto": the final norm and the output head,
    # kept in fp32 when the plan still fits with them; None: none
    fp32_modules: Any = None


@dataclass(frozen=True, kw_only=True)
class Savers:
    """What the planner may do to save memory beyond the micro-batch and the precision (Note [the ladder])."""

    # "auto": the planner chooses the modules to recompute (activation checkpointing); a sequence of module
    # qualified names: exactly these ({name: "selective"} recomputes only what is cheap); (): none
    checkpoint: Any = "auto"
    # "auto" or True: activations, or the parameters, gradients and optimizer state, may live in host memory where
    # that is what fits or is faster (GPU targets; Note [offload], docs/offload.md); False: never
    offload: bool | str = "auto"
    # the rungs that change numerics, climbed only when named here and only when nothing fits without them:
    # "chunked-loss" (the output head and cross-entropy in chunks of tokens) and "8bit-optimizer" (AdamW's state in
    # 8 bits) (docs/fine-tuning.md); and "float8", taken for speed where its plan is faster (docs/float8.md)
    allow: Any = ()
    # every step runs the model compiled (torch.compile, inductor) and is estimated so (Note [compile as a knob])
    compile: bool = False
    # every step's linears train in float8: a torchao recipe name ("tensorwise", "rowwise", "rowwise_with_gw_hp") or
    # an autofit.features.float8.Float8 (Note [Float8 training], docs/float8.md); None: as allow= says
    float8: Any = None
    # where the training loop clears the gradients (Note [where zero_grad falls], autofit/training/step.py):
    # "after-step" (after optimizer.step(): autofit's trainer, Hugging Face's Trainer), "before-forward" (the PyTorch
    # tutorials' loop) or "after-forward" (Lightning's automatic optimization: the last step's gradients live through
    # the forward); None: "after-step" (autofit.integrations.lightning.plan: "after-forward")
    zero_grad: str | None = None

    def __post_init__(self) -> None:
        if self.zero_grad not in (None, *ZERO_GRAD_ORDERS):
            raise InvalidInputError(
                f"Savers(zero_grad=...) must be 'after-step' (after optimizer.step(): autofit's trainer, Hugging "
                f"Face's Trainer), 'before-forward' (the PyTorch tutorials' loop) or 'after-forward' (Lightning's "
                f"automatic optimization), got {self.zero_grad!r}")
        if self.offload not in ("auto", True, False):
            raise InvalidInputError(
                f"offload must be 'auto' (the planner may keep activations or states in host memory when that is "
                f"what fits, or is faster), True (the same) or False (never), got {self.offload!r}"
            )


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How the job is laid out over GPUs and nodes (docs/multi-gpu.md). One process by default."""

    # the number of processes (GPUs); batch_size is the global batch and budget is per device
    world_size: int = 1
    # GPUs per node: the ranks whose collectives run over NVLink and which share one host; None: all on one node
    gpus_per_node: int | None = None
    # "ddp", "fsdp2", or None: one process, or with world_size > 1 the planner plans both and keeps the faster
    strategy: str | None = None
    # FSDP2 after forward: True (ZeRO-3), False (ZeRO-2) or an int group size to reshard to; "auto": the planner
    # plans ZeRO-3 and ZeRO-2 (across nodes also the reshard to one node) and keeps the fastest that fits
    reshard_after_forward: bool | int | str = "auto"
    # HSDP: replicate over this many groups, shard within each; "auto": 1, and across nodes also one per node
    replicate: int | str = "auto"
    # 1 (none), T (FSDP2 over world_size // T ranks x tensor parallel T) or "auto" (also T = 2, 4, 8 dividing one
    # node's GPUs, for a model with a tensor-parallel plan: Note [tensor parallel plan])
    tensor_parallel: int | str = 1
    # {module name pattern: style} for a model without its own tensor-parallel plan, or to split more than its own
    tensor_parallel_plan: Mapping[str, Any] | None = None
    # 1 (none) or P: the model cut into P pipeline stages (2P under the schedules that hold two per rank), run by
    # torch's schedule pipeline_schedule (torch's name: "1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS",
    # "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"), the accumulation steps its micro-batches, with FSDP2
    # and tensor parallel inside each stage (strategy="fsdp2"; autofit/parallel/pipeline.py). estimate and measure
    # run it; plan chooses its micro-batches and recomputation, and with pipeline_schedule="auto" the schedule
    # (autofit/planning/pipeline.py); pipeline_parallel="auto": plan also races P = 2, 4, 8, 16 dividing world_size
    # (at least one layer a stage) beside no pipeline, for a model it can cut (a Hugging Face causal LM declaring
    # base_model_pp_plan, its head untied)
    pipeline_parallel: int | str = 1
    pipeline_schedule: str = "1F1B"
    # the decoder layers of each pipeline stage, in stage order (P numbers, 2P under the schedules that hold two
    # stages per rank), summing to the model's layers; None: an even split, the remainder on the first stages
    # (pipeline.layer_split). Checked against the model where it is known
    pipeline_layers: Sequence[int] | None = None

    def __post_init__(self) -> None:
        require_int("world_size", self.world_size)
        if self.pipeline_parallel != "auto":
            require_int("pipeline_parallel", self.pipeline_parallel)
        require_strategy(self.strategy)
        if self.pipeline_layers is not None:
            layers = self.pipeline_layers
            if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence) or not layers or \
                    any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in layers):
                raise InvalidInputError(f"pipeline_layers must be the decoder layers of each stage, positive ints in "
                                        f"stage order (e.g. (15, 16, 16, 15)), got {layers!r}")
            if self.pipeline_parallel in (1, "auto"):  # no stages, or several counts of them: said, not dropped
                raise InvalidInputError(f"pipeline_layers={layers!r} splits the layers over pipeline stages, and "
                                        f"pipeline_parallel is {self.pipeline_parallel!r}: give pipeline_parallel=P "
                                        "too, or leave the split out")
            object.__setattr__(self, "pipeline_layers", tuple(layers))  # hashable, as the layout's options are


@dataclass(frozen=True, kw_only=True)
class Search:
    """How the planner searches (the plan it finds is the same either way, up to depth extrapolation)."""

    # "auto": a model whose depth is a run of at least 16 identical blocks is simulated cut to a few and each figure
    # carried to all of them along a checked line (Note [depth extrapolation], autofit/capture/depth.py); True: from
    # 8 blocks; False: every simulation runs the whole model
    extrapolate_depth: bool | str = "auto"
    # also search the halving micro-batches for the front (one checkpoint MILP each) and skip the quick path (Note
    # [the quick path]); None: the caller's default, False for plan and True for a request made by make_request
    # (the CLI's front)
    alternatives: bool | None = None
    # True: after choosing its configuration the planner tabulates the rows per micro-batch that fit at 1/2, 1/4
    # and 1/8 of the sample's length, a dozen full estimates (Note [rows by length], autofit/solve/lengths.py), for
    # batches of varying length (docs/variable-length.md); False: every batch runs the plan's micro-batch
    variable_length: bool = False

    def __post_init__(self) -> None:
        if self.variable_length not in (True, False):
            raise InvalidInputError(f"Search(variable_length=...) must be True or False, got {self.variable_length!r}")
        depth = self.extrapolate_depth
        if depth is not True and depth is not False and depth != "auto":
            raise InvalidInputError(f"extrapolate_depth must be True, False or 'auto', not {depth!r}")
        if self.alternatives not in (None, True, False):
            raise InvalidInputError(f"Search(alternatives=...) must be True, False or None, got {self.alternatives!r}")


@dataclass(frozen=True, kw_only=True)
class Step:
    """The knobs of the one training step ``estimate`` and ``measure`` describe: what ``plan`` would choose (or the
    user's loop fixes), given. Where ``plan`` searches (``Savers``'s "auto"), a step has one value; the micro-batch
    size has no default (``step=8`` is ``Step(micro_batch_size=8)``), and the other defaults are the plain step: one
    micro-batch, nothing recomputed or offloaded, the trainer's order of ``zero_grad``."""

    # the rows of one micro-batch, per rank (per tensor-parallel group, whose ranks all see the same rows): the first
    # knob plan chooses; None, not given, is refused by estimate and measure, as every step has its own
    micro_batch_size: int | None = None
    # micro-batches per optimizer step, each of ``micro_batch_size`` rows (per rank)
    accumulation_steps: int = 1
    # module qualified names to recompute (``{name: "selective"}`` recomputes only what is cheap): a plan's
    # ``plan.checkpoint``; () or None: none ("auto" is the planner's choice, refused here)
    checkpoint: Any = ()
    # module names whose saved activations live in host memory between forward and backward
    # (``torch.autograd.graph.save_on_cpu``; Note [offload], docs/offload.md)
    offload: Any = ()
    # parameters, gradients and optimizer state in host memory, the optimizer stepping on the CPU (FSDP2's
    # ``CPUOffloadPolicy`` on one process)
    offload_states: bool = False
    # each parameter stepped in backward as soon as its gradient is ready, and the gradient freed (Note [optimizer
    # step in backward], autofit/training/in_backward.py); not with accumulation, clipping, fp16 loss scaling or an
    # fp32 master copy
    optimizer_in_backward: bool = False
    # FSDP2 reduce-scatters after every micro-batch, not only the last (Note [gradient sync under accumulation],
    # autofit/training/step.py)
    reduce_every_micro_batch: bool = False
    # the output head and the cross-entropy in chunks of tokens under checkpoint (Note [chunked cross-entropy],
    # autofit/training/chunked_loss.py): the default loss against an integer target, or a Hugging Face causal LM
    chunked_loss: bool = False
    # the step runs the model as torch.compile (inductor, default options) compiles it (Note [compile as a knob])
    compile: bool = False
    # every trainable parameter's gradient allocated before the first forward and zeroed in place after each step
    # (Note [gradients allocated before forward], autofit/training/grads.py)
    preallocated_grads: bool = False
    # the linears train in float8 (torchao, converted before the layout): a recipe name ("tensorwise", "rowwise",
    # "rowwise_with_gw_hp") or an autofit.features.float8.Float8 (Note [Float8 training], docs/float8.md); None: not
    float8: Any = None
    # where the loop clears the gradients: "after-step" (autofit's trainer, Hugging Face's Trainer),
    # "before-forward" (the PyTorch tutorials' loop) or "after-forward" (Lightning's automatic optimization) (Note
    # [where zero_grad falls], autofit/training/step.py)
    zero_grad: str = "after-step"
    # DDP's bucket mode (strategy "ddp"): True, as autofit's trainer wraps the model (gradients are views into the
    # buckets); False, torch's default, which Lightning, Hugging Face's Trainer and Accelerate use (a second,
    # gradient-sized copy: Note [DDP's bucket views], autofit/parallel/simulated.py)
    gradient_as_bucket_view: bool = True
    # the gradients clipped to this norm before the optimizer step (clip_grad_norm_; HF's Trainer: 1.0); None: not
    clip_grad_norm: float | None = None
    # the rows of inputs and targets resident during the step: "batch" (the whole window's, as plan.wrap's trainer
    # receives the batch and slices it; the figure a plan names) or "micro-batch" (a loop that loads each
    # micro-batch just before it runs) (Note [one configuration, one figure], autofit/emit/assemble.py)
    inputs: str = "batch"


@dataclass(frozen=True)
class BatchDim:
    """Which rows of the sample are the batch (Note [the batch dimension], autofit/training/batch.py): the dim they
    run along, and the inputs that have none. Both describe the sample, so ``plan``, ``estimate`` and ``measure``
    read it alike, and a plan records both for its trainer (``plan.batch_dim``, ``plan.shared``)."""

    # the dim of the batch in every per-sample tensor: an int, for the inputs and the target alike (1 for time-major
    # sequences, nn.LSTM's default (seq, batch, feature)), or a pair (the inputs', the target's) when they differ
    dim: Any = 0
    # inputs passed whole to every micro-batch, not per-sample: positions of a tuple sample, keys of a dict sample
    shared: Any = ()


@dataclass(frozen=True, kw_only=True)
class Options:
    """The values together, as the request holds them."""

    device: Device = Device()
    precision: Precision = Precision()
    savers: Savers = Savers()
    layout: Layout = Layout()
    search: Search = Search()
    batch_dim: BatchDim = BatchDim()

    @classmethod
    def of(cls, **keywords: Any) -> Options:
        """``plan``'s option keywords as it reads them (shortcuts, old flat keywords), for make_request's callers."""
        given = {group: keywords.pop(group) for group in PLAN_GROUPS if group in keywords}
        return cls(**gather("plan", given, keywords))


def _option(cls: type, keyword: str, value: Any, shortcut: Callable[[Any], Any], shortcuts: str) -> Any:
    """What every option keyword accepts: None (the defaults), the value itself, a mapping of its fields, or one of
    its shortcuts (``shortcut`` returns the value it names, None where ``value`` is none of them)."""
    if value is None:
        return cls()
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InvalidInputError(f"{keyword}={{...}}: {cls.__name__} has no field "
                                    f"{', '.join(map(repr, unknown))}; its fields are {', '.join(sorted(known))}")
        return cls(**value)
    named = shortcut(value)
    if named is None:
        raise InvalidInputError(f"{keyword} must be an autofit.{cls.__name__}(...), {shortcuts}, or a mapping of its "
                                f"fields; got {value!r} ({type(value).__name__})")
    return named


def _device_shortcut(value: Any) -> Device | None:
    if type(value).__name__ == "device" and type(value).__module__ == "torch":  # torch.device, without importing torch
        value = str(value)
    if not isinstance(value, str):
        return None
    if value.split(":")[0] in DEVICE_KINDS:
        return Device(kind=value)
    from autofit.cuda.catalog import gpu_spec

    try:
        gpu_spec(value)
    except InvalidInputError as e:  # neither a kind nor a GPU: say both
        raise InvalidInputError(f"device must be 'cpu', 'cuda' or a catalog GPU name, got {value!r} ({e})") from e
    return Device(gpu=value)


def as_device(value: Any) -> Device:
    """``device=``: a :class:`Device`, "cpu", "cuda" ("cuda:1"), a catalog GPU name ("H100"), or a torch.device."""
    return _option(Device, "device", value, _device_shortcut, "'cpu', 'cuda' or a catalog GPU name such as 'H100'")


def as_precision(value: Any) -> Precision:
    """``precision=``: a :class:`Precision`, or its compute precision alone ("auto", "bf16", a ``PrecisionPolicy``;
    checked against the device by the request)."""
    return _option(Precision, "precision", value, lambda compute: Precision(compute=compute), "")


def as_savers(value: Any) -> Savers:
    """``savers=``: a :class:`Savers`, "auto" (the defaults) or "none" (no recomputation, no offload)."""
    named = {"auto": Savers(), "none": Savers(checkpoint=(), offload=False)}
    return _option(Savers, "savers", value, lambda v: named.get(v) if isinstance(v, str) else None,
                   "'auto' or 'none'")


def as_layout(value: Any) -> Layout:
    """``layout=``: a :class:`Layout`, or an int: the world size."""
    def world_size(v: Any) -> Layout | None:
        return Layout(world_size=v) if isinstance(v, int) and not isinstance(v, bool) else None

    return _option(Layout, "layout", value, world_size, "an int (the world size)")


def as_search(value: Any) -> Search:
    """``search=``: a :class:`Search`, "auto" (the defaults) or "exact" (every simulation runs the whole model)."""
    named = {"auto": Search(), "exact": Search(extrapolate_depth=False)}
    return _option(Search, "search", value, lambda v: named.get(v) if isinstance(v, str) else None,
                   "'auto' or 'exact'")


def as_step(value: Any) -> Step:
    """``step=`` of ``estimate`` / ``measure``: a :class:`Step`, a mapping of its fields, or an int: the micro-batch
    size, every other knob the plain step's."""
    return _option(Step, "step", value, lambda v: Step(micro_batch_size=v) if isinstance(v, int)
                   and not isinstance(v, bool) else None, "an int (the micro-batch size)")


def as_batch_dim(value: Any) -> BatchDim:
    """``batch_dim=``: a :class:`BatchDim`, a mapping of its fields, or its dim alone (an int, or a pair: the
    inputs', the target's), checked where the sample is read (Note [the batch dimension])."""
    return _option(BatchDim, "batch_dim", value, lambda dim: BatchDim(dim=dim), "")


_AS = {"device": as_device, "precision": as_precision, "savers": as_savers, "layout": as_layout,
       "search": as_search, "step": as_step, "batch_dim": as_batch_dim}
# estimate's and measure's old keywords, each a field of Step of the same name (Note [flat keywords]); where plan
# reads the same word as a Savers field (checkpoint, offload, compile), the function's groups say which
STEP_KEYWORDS = frozenset(f.name for f in fields(Step))
# plan's; estimate's and measure's: STEP_GROUPS
PLAN_GROUPS = ("device", "precision", "savers", "layout", "search", "batch_dim")
STEP_GROUPS = ("device", "precision", "layout", "step", "batch_dim")

# Note [flat keywords]: each old keyword of plan / estimate / measure -> (the option value, its field)
FLAT_KEYWORDS: dict[str, tuple[str, str]] = {
    "gpu": ("device", "gpu"),
    "margin": ("device", "margin"),
    "host_budget": ("device", "host_budget"),
    "allow_over_capacity": ("device", "allow_over_capacity"),
    "min_stored_precision": ("precision", "min_stored"),
    "fp32_modules": ("precision", "fp32_modules"),
    "checkpoint": ("savers", "checkpoint"),
    "offload": ("savers", "offload"),
    "allow": ("savers", "allow"),
    "compile": ("savers", "compile"),
    "world_size": ("layout", "world_size"),
    "gpus_per_node": ("layout", "gpus_per_node"),
    "strategy": ("layout", "strategy"),
    "reshard_after_forward": ("layout", "reshard_after_forward"),
    "replicate": ("layout", "replicate"),
    "tensor_parallel": ("layout", "tensor_parallel"),
    "tensor_parallel_plan": ("layout", "tensor_parallel_plan"),
    "extrapolate_depth": ("search", "extrapolate_depth"),
    "alternatives": ("search", "alternatives"),  # plan_with_analysis's, before it took a request
    "shared": ("batch_dim", "shared"),
}


def _spelling(group: str, field: str, value: Any) -> str:
    return f"{group}=autofit.{type(_AS[group](None)).__name__}({field}={value!r})"  # the defaults' class


def _holds(value: Any, field: str) -> bool:
    """Whether an option value as passed sets ``field``: a mapping naming it, or a value whose field is off its
    default (so the old ``micro_batch_size=8`` beside ``step=Step(accumulation_steps=2)`` fills it)."""
    if isinstance(value, Mapping):
        return field in value
    return dataclasses.is_dataclass(value) and getattr(value, field) != next(
        f.default for f in dataclasses.fields(value) if f.name == field)


def gather(function: str, given: Mapping[str, Any], flat: Mapping[str, Any],
           groups: tuple[str, ...] = PLAN_GROUPS) -> dict[str, Any]:
    """The option values of a call: ``given`` the option keywords as passed (a value, a shortcut or None), ``flat``
    the old keywords (Note [flat keywords]), each folded into the field it maps to with a ``FutureWarning``.
    ``groups``: the values ``function`` takes; another keyword is a ``TypeError``, as Python names one."""
    values = {}
    for group in groups:
        value = given.get(group)
        values[group] = _AS[group](value)
    updates: dict[str, dict[str, Any]] = {}
    for keyword, value in flat.items():
        owner = ("step", keyword) if "step" in groups and keyword in STEP_KEYWORDS else FLAT_KEYWORDS.get(keyword)
        if owner is None or owner[0] not in groups:
            raise TypeError(f"{function}() got an unexpected keyword argument {keyword!r}")
        group, field = owner
        if _holds(given.get(group), field):
            raise InvalidInputError(
                f"{function}(): {keyword}= and {group}= both given, and {group} holds {field}: drop {keyword}= and "
                f"write {_spelling(group, field, value)} (or set {field} in the {group} you pass)")
        warnings.warn(f"{function}({keyword}=...) is deprecated: write {_spelling(group, field, value)}",
                      FutureWarning, stacklevel=3)
        updates.setdefault(group, {})[field] = value
    for group, changed in updates.items():
        values[group] = replace(values[group], **changed)
    return values
