"""The step's configuration: every knob that decides the memory of one training step, as one frozen value validated
once (:class:`StepConfig`), and :func:`make_step_config`, which reads the user's forms of each knob (module names
or a mapping of module name to recomputation policy, precision names, optimizer names). The simulation, ``measure``
and the trainer all run the step this value describes (``step.py``); the planner passes it whole from the request
through the analysis and the search (docs/architecture.md, "The step as one value").
"""

from __future__ import annotations

import contextlib
import difflib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

import torch

from autofit.core.errors import InvalidInputError, require_int
from autofit.training.chunked_loss import LossChunks
from autofit.training.in_backward import check_in_backward
from autofit.training.optim import OptimizerSpec, as_optimizer_spec
from autofit.training.precision import PrecisionPolicy, as_policy
from autofit.training.recompute import require_policy
from autofit.parallel.layout import Parallel
from autofit.parallel.step_rules import gradients_in_buckets, gradients_owner

__all__ = ["StepConfig", "make_step_config", "resolve_modules", "overridden_forwards", "DEVICES", "DeviceKind",
           "ZeroGrad", "ZERO_GRAD_ORDERS", "as_zero_grad"]


class DeviceKind(StrEnum):
    """The kind of device a step is simulated, measured and trained for: what the step's own stages ask of it. A
    ``StrEnum``: it equals, formats and serialises as its name ("cpu", "cuda"), so plans and messages read as they
    did; the core asks its properties, never its name. The device's memory model (allocator, context, catalog GPU)
    is the Target's (autofit/device.py)."""

    CPU = "cpu"
    CUDA = "cuda"

    @property
    def is_host(self) -> bool:
        """The device is this machine's CPU: one memory with the host (nothing to offload to), and its kernels are
        the ones a simulation runs and probes here (Note [CPU kernels]). A GPU's step is simulated on the host with
        the device's rules applied on top (``DeviceTarget.simulation_rules``)."""
        return self is DeviceKind.CPU

    @property
    def caching_allocator(self) -> bool:
        """Memory goes through CUDA's caching allocator: allocated, reserved and on-device figures differ, and
        ``PYTORCH_CUDA_ALLOC_CONF`` applies."""
        return self is DeviceKind.CUDA

    @property
    def foreach_by_default(self) -> bool:
        """torch's optimizers and clipping take their foreach (multi-tensor) kernels here when not told otherwise
        (Note [optimizer implementation on the target], simulate/foreach.py)."""
        return self is DeviceKind.CUDA

    @property
    def host(self) -> DeviceKind:
        """The kind of the host memory this device's offloaded tensors live in: the CPU (for a CPU, itself)."""
        return DeviceKind.CPU

    @property
    def process_group_backend(self) -> str:
        """The ``torch.distributed`` backend a process group of this device's ranks runs on."""
        return "gloo" if self.is_host else "cpu:gloo,cuda:nccl"

    def available(self) -> bool:
        """This machine can run a step on the device (a CPU always; CUDA where torch sees a GPU)."""
        return self.is_host or torch.cuda.is_available()

    def __repr__(self) -> str:  # messages name it as the user wrote it: 'cuda'
        return repr(self.value)


DEVICES = tuple(DeviceKind)


class ZeroGrad(StrEnum):
    """Where the step's ``optimizer.zero_grad(set_to_none=True)`` falls (Note [where zero_grad falls],
    training/step.py). A ``StrEnum``: it equals, formats and serialises as its name."""

    AFTER_STEP = "after-step"  # last, after optimizer.step(): autofit's trainer, Hugging Face's Trainer
    BEFORE_FORWARD = "before-forward"  # first, before the forward: the PyTorch tutorials' loop
    AFTER_FORWARD = "after-forward"  # after forward and loss, before backward: Lightning's automatic optimization

    @property
    def carries_grads(self) -> bool:
        """The gradients of one step are still allocated when the next step begins."""
        return self is not ZeroGrad.AFTER_STEP

    def __repr__(self) -> str:
        return repr(self.value)


ZERO_GRAD_ORDERS = tuple(ZeroGrad)


def as_zero_grad(value: Any) -> ZeroGrad:
    """``zero_grad=``: one of :data:`ZERO_GRAD_ORDERS`, by name."""
    if value not in ZERO_GRAD_ORDERS:
        raise InvalidInputError(
            f"zero_grad must be 'after-step' (optimizer.zero_grad() after optimizer.step(): autofit's trainer, Hugging "
            f"Face's Trainer), 'before-forward' (first, as the PyTorch tutorials' loop) or 'after-forward' (after the "
            f"loss, before backward: Lightning's automatic optimization), got {value!r}")
    return ZeroGrad(value)


@dataclass(frozen=True, kw_only=True)
class StepConfig:
    """Everything that decides the memory of one training step, validated once."""

    micro_batch_size: int
    accumulation_steps: int = 1
    precision: PrecisionPolicy = field(default_factory=PrecisionPolicy)
    checkpoint: tuple[str, ...] = ()  # modules recomputed in backward (non-reentrant checkpoint)
    # the recomputed modules that keep their matmul and attention outputs (Note [selective recomputation]); a subset
    # of ``checkpoint``, the others recompute all of their forward
    selective: tuple[str, ...] = ()
    # the recomputed modules that run torchtitan's per-op policy (Note [torchtitan's per-op policy]); a subset of
    # ``checkpoint``, none of ``selective``
    op_selective: tuple[str, ...] = ()
    optimizer: OptimizerSpec = field(default_factory=lambda: as_optimizer_spec("adamw"))
    device: DeviceKind = DeviceKind.CPU  # "cpu" or "cuda", held as a DeviceKind
    # Rows of input data resident during the window: the trainer receives the whole batch at once and slices it, so
    # a plan counts all of it; a bare estimate counts one micro-batch (0 means micro_batch_size).
    held_rows: int = 0
    gpu: str | None = None  # the GPU a "cuda" step is simulated for (a name autofit.gpu_spec knows)
    # The parallel layout (autofit/parallel/layout.py): strategy, ranks, FSDP2's reshard and HSDP's replicate, tensor
    # parallel, the states on the host; validated where it is built. Held whole: its fields are read on it
    # (``config.layout.world_size``), as the dimensions' rules and shares are (Note [layout dimensions]).
    layout: Parallel = field(default_factory=Parallel)
    # max_norm of torch.nn.utils.clip_grad_norm_ before each optimizer step; None: no clipping (HF Trainer: 1.0)
    clip_grad_norm: float | None = None
    # step each parameter in backward as soon as its gradient is ready (Note [optimizer step in backward])
    optimizer_in_backward: bool = False
    # modules whose saved activations live in host memory between forward and backward (Note [offload])
    offload: tuple[str, ...] = ()
    # the output head and the cross-entropy run in chunks of tokens (Note [chunked cross-entropy],
    # autofit/training/chunked_loss.py); None: the model's own head and the loss as given
    chunked_loss: LossChunks | None = None
    # the model runs as torch.compile(model) (inductor, default options) compiles it (Note [compile as a knob],
    # autofit/features/compile.py)
    compile: bool = False
    # the values of the step features registered after the first ones, (name, value) pairs sorted by name (Note
    # [carried features], autofit/features/base.py: Float8's under "float8"); each value says its rules on the step
    # (``check_step``)
    more_features: tuple[tuple[str, Any], ...] = ()
    # every trainable parameter's gradient allocated before the first forward and zeroed in place after each step
    # (zero_grad(set_to_none=False)), not created in backward (Note [gradients allocated before forward])
    preallocated_grads: bool = False
    # DDP's gradient_as_bucket_view (See Note [DDP's bucket views], autofit/parallel/simulated.py): True, as autofit's
    # trainer wraps the model, keeps every gradient inside the communication buckets; False, torch's default (and
    # Lightning's, Hugging Face's and Accelerate's unless told), keeps the gradients apart from the buckets
    gradient_as_bucket_view: bool = True
    # where optimizer.zero_grad(set_to_none=True) falls: after the optimizer step (the default), before the forward,
    # or after forward and loss (Lightning's), once per accumulation window (Note [where zero_grad falls], step.py)
    zero_grad: ZeroGrad = ZeroGrad.AFTER_STEP

    def policy(self, name: str) -> str:
        """How recomputed module ``name`` is recomputed: "full", "selective" or "op-selective"."""
        return "selective" if name in self.selective else "op-selective" if name in self.op_selective else "full"

    @property
    def grads_between_steps(self) -> bool:
        """One step's gradients are still allocated when the next step begins (Note [where zero_grad falls],
        training/step.py): kept in place (``preallocated_grads``), or cleared at the next window's start, unless the
        optimizer stepping in backward freed them or they are views of DDP's buckets, which live all the time."""
        if self.preallocated_grads:
            return True
        return (self.zero_grad.carries_grads and not self.optimizer_in_backward
                and not gradients_in_buckets(self.layout, self.gradient_as_bucket_view))

    def __post_init__(self) -> None:
        require_int("micro_batch_size", self.micro_batch_size)
        require_int("accumulation_steps", self.accumulation_steps)
        require_int("held_rows", self.held_rows, minimum=0)
        if self.device not in DEVICES:
            raise InvalidInputError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        object.__setattr__(self, "device", DeviceKind(self.device))
        object.__setattr__(self, "zero_grad", as_zero_grad(self.zero_grad))
        if not isinstance(self.layout, Parallel):
            raise InvalidInputError(f"layout must be an autofit.parallel.layout.Parallel, got {self.layout!r}")
        if not isinstance(self.gradient_as_bucket_view, bool):
            raise InvalidInputError(f"gradient_as_bucket_view must be True or False, got "
                                    f"{self.gradient_as_bucket_view!r}")
        clip = self.clip_grad_norm
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float)) or not clip > 0):
            raise InvalidInputError(
                f"clip_grad_norm must be a positive number (the max_norm of torch.nn.utils.clip_grad_norm_, e.g. 1.0) "
                f"or None for no clipping, got {clip!r}"
            )
        for what in ("selective", "op_selective"):
            stray = [n for n in getattr(self, what) if n not in self.checkpoint]
            if stray:
                raise InvalidInputError(
                    f"{what} names modules that are not recomputed ({', '.join(map(repr, stray))}): a selectively "
                    f"recomputed module is also one of checkpoint (give checkpoint={{name: "
                    f"{what.replace('_', '-')!r}}})")
        both = [n for n in self.op_selective if n in self.selective]
        if both:
            raise InvalidInputError(f"{', '.join(map(repr, both))} named in both selective and op_selective: a module "
                                    "is recomputed under one policy; give checkpoint={name: policy}")
        overlap = _nested(self.offload, self.checkpoint)
        if overlap:
            raise InvalidInputError(
                f"{overlap[0]!r} and {overlap[1]!r} are both recomputed and offloaded (one inside the other): each "
                "module keeps, recomputes or offloads its activations; give it to checkpoint= or offload=, not both"
            )
        if not isinstance(self.compile, bool):
            raise InvalidInputError(f"compile must be True or False, got {self.compile!r}")
        self.layout.check_step(self)  # the layout's rules on the step's knobs, its dimensions' (autofit/parallel/)
        for name, value in self.more_features:  # a feature's rules on the step: its value's (Note [carried features])
            if not callable(getattr(value, "check_step", None)):
                raise InvalidInputError(f"{name}={value!r} is not a step feature's value (one the feature read from "
                                        "the user's option, with its check_step): give it through autofit.Step")
            value.check_step(self)
        if not isinstance(self.preallocated_grads, bool):
            raise InvalidInputError(f"preallocated_grads must be True or False, got {self.preallocated_grads!r}")
        if self.preallocated_grads:
            _check_preallocated(self)
        if self.optimizer_in_backward:
            check_in_backward(accumulation_steps=self.accumulation_steps, clip_grad_norm=clip,
                              grad_scaler=self.precision.needs_grad_scaler,
                              master_copy=str(self.precision.stored).endswith("-master"))


def make_step_config(
    *, micro_batch_size: int, precision: Any = "fp32", checkpoint: Any = (), optimizer: Any = "adamw",
    device: str = "cpu", offload: Any = (), optimizer_in_backward: bool = False, layout: Parallel | None = None,
    **knobs: Any,
) -> StepConfig:
    """The step from its knobs as keywords, those the user gives in their own forms read here (a checkpoint mapping, a
    device string, an optimizer name). ``layout``: the parallel layout, one value
    (:class:`~autofit.parallel.layout.Parallel`); None: one process. ``knobs``: the step's other fields, which the
    user gives as the step holds them (``accumulation_steps``, ``held_rows``, ``gpu``, ``clip_grad_norm``,
    ``chunked_loss``, ``compile``, ``preallocated_grads``, ``gradient_as_bucket_view``, ``zero_grad``:
    :class:`StepConfig`), validated there; a knob the step has no field for is a step feature's value (Note [carried
    features]: ``float8=Float8(...)``), carried in ``more_features``, and None there means not in force."""
    if checkpoint is None or checkpoint is False or checkpoint == "none":  # as plan() reads them: no checkpointing
        checkpoint = ()
    if checkpoint == "auto":
        raise InvalidInputError(
            "checkpoint='auto' asks the planner to choose, and only plan() chooses: give estimate/measure the module "
            "names to recompute (plan.checkpoint), or None for none"
        )
    checkpoint, selective, op_selective = _checkpoint_policies(checkpoint)
    device = str(device).split(":")[0] if isinstance(device, (str, torch.device)) else device
    layout = Parallel() if layout is None else layout
    further = {name: knobs.pop(name) for name in [n for n in knobs if n not in _FIELDS]}
    if further:
        knobs["more_features"] = tuple(sorted((n, v) for n, v in further.items() if v is not None))
    return StepConfig(
        micro_batch_size=micro_batch_size, precision=as_policy(precision), checkpoint=checkpoint, selective=selective,
        op_selective=op_selective, optimizer=as_optimizer_spec(optimizer), device=device, layout=layout,
        optimizer_in_backward=bool(optimizer_in_backward), offload=_module_names(offload, "offload"), **knobs,
    )


_FIELDS = frozenset(f.name for f in fields(StepConfig))


def _check_preallocated(config: StepConfig) -> None:
    """Where gradients allocated before forward cannot be kept (Note [gradients allocated before forward])."""
    why = ("the optimizer steps in backward and frees each gradient as soon as it is used"
           if config.optimizer_in_backward else gradients_owner(config.layout))
    if why is None and str(config.precision.stored).endswith("-master"):
        why = "with an fp32 master copy each step moves the gradients to the master parameters and frees them"
    if why is not None:
        raise InvalidInputError(f"preallocated_grads keeps every gradient allocated from before the first forward to "
                                f"the end of training, but {why}: leave preallocated_grads out")


def _checkpoint_policies(checkpoint: Any) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(recomputed modules, those recomputed "selective", those "op-selective") from module names (all "full") or a
    mapping of module name to policy, one of ``recompute.POLICIES`` (Note [selective recomputation])."""
    if isinstance(checkpoint, Mapping):
        names = _module_names(tuple(checkpoint), "checkpoint")
        policies = {n: require_policy(n, checkpoint[n]) for n in names}
        return (names, tuple(n for n in names if policies[n] == "selective"),
                tuple(n for n in names if policies[n] == "op-selective"))
    return _module_names(checkpoint, "checkpoint"), (), ()


def _module_names(names: Any, what: str) -> tuple[str, ...]:
    if names is None or names is False:
        return ()
    if isinstance(names, str):
        names = (names,)
    try:
        names = tuple(names)
    except TypeError as e:
        raise InvalidInputError(f"{what} must be a sequence of module names, got {names!r}") from e
    if not all(isinstance(name, str) for name in names):
        raise InvalidInputError(f"{what} must hold module qualified names (strings), got {names!r}")
    return tuple(dict.fromkeys(names))


def _nested(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, str] | None:
    """A pair (x in a, y in b) where x and y are the same module or one contains the other ("" is the root)."""
    def within(inner: str, outer: str) -> bool:
        return inner == outer or outer == "" or inner.startswith(outer + ".")

    for x in a:
        for y in b:
            if within(x, y) or within(y, x):
                return x, y
    return None


def resolve_modules(model: torch.nn.Module, names: tuple[str, ...], *, what: str) -> list[torch.nn.Module]:
    """Look up qualified names, with a typed error that suggests the closest existing names."""
    known = dict(model.named_modules())
    modules = []
    for name in names:
        if not isinstance(name, str):
            raise InvalidInputError(f"{what} must hold module qualified names (strings), got {name!r}")
        if name == "":
            raise InvalidInputError(f"{what}: '' is the whole model; name a submodule such as 'layers.0'")
        if name not in known:
            close = difflib.get_close_matches(name, [n for n in known if n], n=3)
            hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
            raise InvalidInputError(f"{what}: the model has no module named {name!r}{hint}")
        modules.append(known[name])
    return modules


@contextlib.contextmanager
def overridden_forwards(overrides: Iterable[tuple[torch.nn.Module, Callable[[Callable], Callable]]]) -> Iterator[None]:
    """Each ``(module, make)`` in order: ``module.forward = make(module.forward)``, an instance attribute (the
    class, the parameters and the user's hooks stay as they are; a later override of the same module wraps the
    earlier one). On exit each module gets back exactly what it had: its own instance ``forward``, or none."""
    patches: list[tuple[torch.nn.Module, bool, Any]] = []
    try:
        for module, make in overrides:
            had, old = "forward" in module.__dict__, module.__dict__.get("forward")
            module.forward = make(module.forward)
            patches.append((module, had, old))
        yield
    finally:
        for module, had, old in reversed(patches):
            if had:
                module.forward = old
            else:
                del module.forward
