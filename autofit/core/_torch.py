"""The torch boundary: every private torch symbol autofit uses, checked once at import.

autofit simulates a training step on fake tensors, watches it below autograd with a dispatch mode, re-registers
autocast kernels, and reads the profiler's event tree. None of that is public API, so it all goes through this
module and the three beside it: ``_torch_profiler.py`` (the profiler's memory record), ``_torch_interrupts.py``
(torch's lazy imports and Ctrl-C at safe points) and ``_torch_compile.py`` (torch.compile's internals). A release
that moves or removes a piece fails here, at import, with an :class:`UnsupportedTorchError` naming the piece and the
supported range, instead of deep inside a simulation. Nothing else in autofit imports a private torch module or reads
a private attribute of a torch object (tests/test_architecture.py checks that).

This module holds the symbols themselves (fake tensors, dispatch, modules, operator schemas, the optimizer's
implementation choice, DTensor and FSDP2 internals, the GradScaler, the allocator's settings) and the process-wide
patches (a module attribute that torch's own code looks up at call time), which go through :func:`patch`: one lock
for all of them, restored on exit, and a count of how often torch really called the replacement, so a caller can
check the patch still takes effect (:meth:`Patch.require_hit`).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from autofit.core.errors import AutofitError, UnsupportedTorchError

__all__ = [
    "SUPPORTED_TORCH", "TESTED_TORCH", "DATA_DEPENDENT_ERRORS", "PASSTHROUGH_ERRORS", "FakeTensorMode", "scaled_mm",
    "OpOverload", "op_by_name", "op_named",
    "TorchDispatchMode", "disable_current_modes", "pytree", "tree_map", "current_autograd_node", "module_call_codes",
    "EventType", "has_dispatch_kernel", "all_aten_op_names", "exclude_dispatch_key",
    "is_view", "grad_scaler_state", "FakeTensor", "unset_fake_temporarily", "storage_tensors",
    "compiled_modules", "rewrap_compiled", "foreach_types_include", "foreach_devices_include", "destroy_library",
    "value_free_grad_scaler", "patch_lock", "fake_store", "fsdp_internals", "Patch", "patch", "BatchNormBase",
    "SpectralNormParametrization", "NormBase", "tensor_version",
    "onednn_low_precision", "op_schema", "dtensor_local", "allocator_settings", "set_allocator_settings",
    "ddp_bucket_bytes", "ddp_bucket_sizes", "dtensor_specs_once", "dtensor_shardings_of", "forget_dtensor_shardings",
    "pipeline_step",
    "pipeline_order",
]

SUPPORTED_TORCH = ">=2.13"  # pyproject.toml says the same
TESTED_TORCH = ("2.13.0", "2.15.0")  # tests/matrix.sh: the oldest supported release and the newest on 2026-11-22


def _need(module: str, name: str) -> Any:
    """``module.name``, or an UnsupportedTorchError that names it (raised at autofit's import)."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise UnsupportedTorchError(
            f"this torch ({torch.__version__}) has no {module}.{name}, which autofit needs; autofit supports torch "
            f"{SUPPORTED_TORCH} and is tested on {', '.join(TESTED_TORCH)}: install one of those"
        ) from e


# ---- float8: the matmul torchao's Float8Linear runs (Note [CPU kernels], core/cpu.py) -----------------------------
scaled_mm = _need("torch", "_scaled_mm")

# ---- fake tensors (simulate, capture) ----------------------------------------------------------------------------
FakeTensorMode = _need("torch._subclasses.fake_tensor", "FakeTensorMode")
FakeTensor = _need("torch._subclasses.fake_tensor", "FakeTensor")
# leaves the fake mode for a while: factory calls in it make real tensors (Note [optimizers that read values])
unset_fake_temporarily = _need("torch._subclasses.fake_tensor", "unset_fake_temporarily")
# Fake tensors have no values: code that reads them raises these (see Note [data-dependent models], simulate/run.py).
DATA_DEPENDENT_ERRORS: tuple[type[Exception], ...] = (
    _need("torch._subclasses.fake_tensor", "DataDependentOutputException"),
    _need("torch._subclasses.fake_tensor", "DynamicOutputShapeException"),
)
# What autofit lets through untouched when it turns failures of the user's code into typed errors: its own errors,
# the data-dependent errors above (the simulator and the tracer fall back to a real run on them), and running out of
# memory (a real result of measure and the trainer).
PASSTHROUGH_ERRORS: tuple[type[BaseException], ...] = (AutofitError, *DATA_DEPENDENT_ERRORS, torch.OutOfMemoryError)

# ---- dispatch (tracker, tracer, probes) --------------------------------------------------------------------------
TorchDispatchMode = _need("torch.utils._python_dispatch", "TorchDispatchMode")
disable_current_modes = _need("torch.utils._python_dispatch", "_disable_current_modes")
pytree = importlib.import_module("torch.utils._pytree")  # tree_leaves / tree_map / tree_flatten over args and outputs
tree_map = _need("torch.utils._pytree", "tree_map")
_current_autograd_node = _need("torch._C", "_current_autograd_node")
_all_op_names = _need("torch._C", "_dispatch_get_all_op_names")
_has_kernel = _need("torch._C", "_dispatch_has_kernel_for_dispatch_key")
_ExcludeGuard = _need("torch._C", "_ExcludeDispatchKeyGuard")
_DispatchKeySet = _need("torch._C", "DispatchKeySet")
_DispatchKey = _need("torch._C", "DispatchKey")

# ---- modules (step) ------------------------------------------------------------------------------------------------
# The base of every BatchNorm (1d/2d/3d, their lazy forms, SyncBatchNorm): the checkpoint wrapper freezes their
# running statistics while it recomputes (Note [recomputed BatchNorm], step.py).
BatchNormBase = _need("torch.nn.modules.batchnorm", "_BatchNorm")
# The parametrization ``torch.nn.utils.parametrizations.spectral_norm`` registers: one power iteration on its ``_u``
# and ``_v`` buffers per forward in training, so the trainer warns about it under accumulation as it does BatchNorm.
SpectralNormParametrization = _need("torch.nn.utils.parametrizations", "_SpectralNorm")
# The base of BatchNorm and InstanceNorm: the running statistics both blend in with ``momentum`` inside the kernel.
NormBase = _need("torch.nn.modules.batchnorm", "_NormBase")


def tensor_version(tensor: torch.Tensor) -> int:
    """The version counter autograd moves on every in-place write to ``tensor`` (torch/csrc/autograd/variable.h,
    ``VariableVersion``): how the checkpoint wrapper sees a forward write a buffer (Note [buffers under
    recomputation], training/recompute.py)."""
    return tensor._version

# ---- optimizer implementation choice (simulate/foreach.py) ------------------------------------------------------
# torch picks foreach / fused / for-loop per parameter group from these (torch/optim/optimizer.py,
# torch/utils/_foreach_utils.py); the simulation makes fake CPU tensors count as the target's.
_optimizer_internals = importlib.import_module("torch.optim.optimizer")
_foreach_utils = importlib.import_module("torch.utils._foreach_utils")
for _module, _name in ((_optimizer_internals, "_foreach_supported_types"),
                       (_optimizer_internals, "_get_foreach_kernels_supported_devices"),
                       (_optimizer_internals, "_default_to_fused_or_foreach"),
                       (_foreach_utils, "_foreach_supported_types")):
    _need(_module.__name__, _name)


@contextlib.contextmanager
def foreach_types_include(extra: type) -> Iterator[None]:
    """``extra`` passes the type checks of the optimizer's implementation choice
    (``optimizer._foreach_supported_types``) and of ``clip_grad_norm_`` (``_foreach_utils._foreach_supported_types``)
    for the duration, under the patch lock."""
    lists = (_optimizer_internals._foreach_supported_types, _foreach_utils._foreach_supported_types)
    with _PATCH_LOCK:
        added = [types for types in lists if extra not in types]
        for types in added:
            types.append(extra)
        try:
            yield
        finally:
            for types in added:
                types.remove(extra)


@contextlib.contextmanager
def foreach_devices_include(device: str) -> Iterator[Patch]:
    """``device`` passes the optimizer's foreach device check
    (``optimizer._get_foreach_kernels_supported_devices``) for the duration."""
    with patch(_optimizer_internals, "_get_foreach_kernels_supported_devices",
               lambda original: lambda: [*original(), device]) as record:
        yield record


# ---- operator schemas and DTensor shards (capture, simulate, cuda) ----------------------------------------------
def op_schema(op: object) -> Any:
    """An operator overload's ``FunctionSchema`` (arguments, ``is_mutable``, alias info): ``OpOverload._schema``,
    which torch names nowhere publicly. None for anything else (a Python function, a module)."""
    return getattr(op, "_schema", None)


OpOverload = _need("torch._ops", "OpOverload")


def op_by_name(op: object) -> tuple[str, str] | None:
    """An operator overload as its schema's name and its overload's (``"aten::add"``, ``"Tensor"``), which
    :func:`op_named` turns back into torch's own object; None for anything else. ``OpOverload._overloadname`` is
    named nowhere publicly."""
    if not isinstance(op, OpOverload):
        return None
    return op._schema.name, op._overloadname


def op_named(schema_name: str, overload: str) -> Any:
    """``torch.ops.<namespace>.<name>.<overload>``: the operator :func:`op_by_name` named."""
    namespace, name = schema_name.split("::", 1)
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def dtensor_local(t: object) -> Any:
    """A DTensor's local shard as stored (``DTensor._local_tensor``), without the view ``to_local()`` would make
    (an allocation-free read, as the tracker needs); None for any other tensor."""
    return getattr(t, "_local_tensor", None)


# ---- oneDNN's low-precision kernels (autofit/core/cpu.py, Note [CPU kernels]) -------------------------------------------
# No public API says whether oneDNN has bf16 / fp16 kernels on this CPU. torch registers two operators that ask ideep
# (``ideep::has_bf16_type_support``: oneDNN's effective ISA, the CPU's capped by ONEDNN_MAX_CPU_ISA, at least
# AVX512_CORE; ``has_fp16_type_support``: at least AVX512_CORE_FP16), which torch's own tests use. They exist only in
# builds with oneDNN (aten/src/ATen/native/mkldnn/RegisterMkldnnOpContextClass.cpp); without oneDNN nothing calls a
# oneDNN kernel, so there is nothing to ask.
if torch.backends.mkldnn.is_available():
    try:
        _onednn_bf16 = torch.ops.mkldnn._is_mkldnn_bf16_supported
        _onednn_fp16 = torch.ops.mkldnn._is_mkldnn_fp16_supported
    except AttributeError as e:
        raise UnsupportedTorchError(
            f"this torch ({torch.__version__}) has oneDNN but no torch.ops.mkldnn._is_mkldnn_bf16_supported / "
            f"_is_mkldnn_fp16_supported, which autofit asks which precisions this CPU runs natively; autofit supports "
            f"torch {SUPPORTED_TORCH} and is tested on {', '.join(TESTED_TORCH)}: install one of those"
        ) from e
else:
    _onednn_bf16 = _onednn_fp16 = None


def onednn_low_precision() -> tuple[bool, bool]:
    """(bf16, fp16): whether oneDNN has kernels for that dtype on this CPU, after ``ONEDNN_MAX_CPU_ISA`` (read once,
    when oneDNN first starts: set it before the process starts). (False, False) in a build without oneDNN."""
    if _onednn_bf16 is None or _onednn_fp16 is None:
        return False, False
    return bool(_onednn_bf16()), bool(_onednn_fp16())


# ---- profiler (measure, probes) ----------------------------------------------------------------------------------
EventType = _need("torch._C._profiler", "_EventType")


def current_autograd_node() -> Any:
    """The autograd node whose backward is running (None outside backward)."""
    return _current_autograd_node()


def module_call_codes() -> frozenset:
    """Code objects of ``Module.__call__``'s implementation: a traceback holds one frame per module call it left."""
    impls = (getattr(torch.nn.Module, "_call_impl", None), getattr(torch.nn.Module, "_wrapped_call_impl", None))
    return frozenset(f.__code__ for f in impls if f is not None)


def all_aten_op_names() -> list[str]:
    """Every aten operator the dispatcher knows, without the ``aten::`` prefix."""
    return [n.removeprefix("aten::") for n in _all_op_names() if n.startswith("aten::")]


def has_dispatch_kernel(op: str, key: str) -> bool:
    """Whether ``aten::op`` has a kernel registered for dispatch key ``key`` (e.g. "AutocastCUDA")."""
    return bool(_has_kernel(op if "::" in op else f"aten::{op}", key))


def exclude_dispatch_key(key: str) -> Any:
    """A guard that skips dispatch key ``key`` while it is alive (as the key's own kernels do to call further)."""
    return _ExcludeGuard(_DispatchKeySet(getattr(_DispatchKey, key)))


def compiled_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The ``torch.compile`` wrappers (``torch._dynamo.eval_frame.OptimizedModule``) in ``model``, by name. None when
    dynamo was never imported: then nothing can have been compiled."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    cls = getattr(eval_frame, "OptimizedModule", None)
    if cls is None:
        return []
    return [(name, m) for name, m in model.named_modules() if isinstance(m, cls)]


def rewrap_compiled(module: torch.nn.Module) -> None:
    """Rebuild a copied ``OptimizedModule``'s forward around its own ``_orig_mod`` (``OptimizedModule._initialize``,
    torch/_dynamo/eval_frame.py): a deep copy keeps the forward built around the original's."""
    module.__dict__.pop("forward", None)
    module.__dict__.pop("_forward", None)
    module._initialize()


_is_wrapper_subclass = _need("torch.utils._python_dispatch", "is_traceable_wrapper_subclass")


def ddp_bucket_sizes(ddp: torch.nn.Module) -> list[int]:
    """Bytes of each of a DistributedDataParallel module's gradient buckets, which live as long as it does
    (``gradient_as_bucket_view=True``: every gradient is a view into one), sized by its reducer
    (``Reducer._get_zeros_like_grad_buckets``, which allocates buckets of the same sizes for a moment)."""
    return [b.buffer().nbytes for b in ddp.reducer._get_zeros_like_grad_buckets()]


def ddp_bucket_bytes(ddp: torch.nn.Module) -> int:
    """Bytes of a DistributedDataParallel module's gradient buckets (:func:`ddp_bucket_sizes`)."""
    return sum(ddp_bucket_sizes(ddp))


def storage_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that hold ``t``'s memory: ``t`` itself, or for a wrapper subclass without a storage of its own
    (torchao's ``OptimState8bit``: codes, scale, qmap) its inner tensors, found through ``__tensor_flatten__``
    (torch/utils/_python_dispatch.py, ``is_traceable_wrapper_subclass``), recursively."""
    local = dtensor_local(t)
    if local is not None:  # a DTensor: its local shard (its flattened attributes hold the mesh too)
        return storage_tensors(local)
    if not _is_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [inner for name in names for inner in storage_tensors(getattr(t, name))]


def is_view(t: torch.Tensor) -> bool:
    return t._is_view()


def destroy_library(lib: torch.library.Library) -> None:
    """Remove every kernel a ``torch.library.Library`` registered (there is no public way to undo ``impl``)."""
    lib._destroy()


def value_free_grad_scaler(device: str) -> torch.amp.GradScaler:
    """A GradScaler whose step skips the ``found_inf.item()`` check: fake tensors have no values, and the step the
    memory model describes is the normal one, where the optimizer steps. It allocates what the real one does."""
    return _ValueFreeGradScaler(device)


class _ValueFreeGradScaler(torch.amp.GradScaler):
    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        return optimizer.step(*args, **kwargs)


if not hasattr(torch.amp.GradScaler, "_maybe_opt_step"):
    _need("torch.amp.GradScaler", "_maybe_opt_step")  # raises: the override above would silently do nothing


def grad_scaler_state(scaler: torch.amp.GradScaler) -> list[torch.Tensor]:
    """The tensors a GradScaler keeps between steps (its scale and growth tracker), once created."""
    return [t for t in (getattr(scaler, "_scale", None), getattr(scaler, "_growth_tracker", None))
            if isinstance(t, torch.Tensor)]


def fake_store() -> Any:
    """A store for ``init_process_group("fake", ...)``: collectives return at once with the right shapes. Loaded on
    first use: only FSDP2 simulations need it, and it lives in torch's test utilities."""
    return _need("torch.testing._internal.distributed.fake_pg", "FakeStore")()


# Note [a pipeline step on a fake process group]
#     torch's pipeline schedules (torch/distributed/pipelining/schedules.py) begin their first step with a vote that
#     runs over the stages' point-to-point links (``_PipelineSchedule._warmup_p2p``: each stage sends the product of
#     its predecessors' votes on, 1 where the user gave its input and output shapes, STATIC, 0 where they must be
#     inferred by running a step, DYNAMIC). On a fake process group a receive writes nothing, so torch 2.13's vote
#     reads the zeros its buffer began with and chooses DYNAMIC, whose inference then receives pickled metadata that
#     never came. torch 2.14 decides locally on a fake group (STATIC where every stage has its shapes), and autofit
#     gives every stage its shapes, so that on every rank of a real job the result is STATIC too: on 2.13 each stage
#     of a fake group is given that result. The step runs over micro-batches already split (each micro-batch's own
#     rows and target, as the step's window holds them): torch 2.14's ``step(arg_mbs=..., target_mbs=...)``, and on
#     2.13 what its ``step`` does after splitting a whole batch (the stage told whether backward runs, its states of
#     the last step cleared, then ``_step_microbatches``). ``return_outputs=False``, as torchtitan steps its schedule:
#     with torch's default True the last stage keeps every micro-batch's output to the step's end.
def pipeline_step(schedule: Any, arg_mbs: list | None, target_mbs: list | None, losses: list | None, *,
                  fake_group: bool) -> None:
    """One step of torch's pipeline ``schedule`` over micro-batches already split (Note [a pipeline step on a fake
    process group]); ``fake_group``: its stages' group is a fake one."""
    stages = list(getattr(schedule, "_stages", None) or [schedule._stage])  # a multi-stage schedule's, or its one
    if fake_group and torch.__version__ < "2.14" and not getattr(schedule, "_autofit_voted", False):
        mode = _need("torch.distributed.pipelining._utils", "InferenceMode")

        def voted(*_, **__) -> None:
            for stage in stages:
                stage._inference_mode = mode.STATIC

        schedule._warmup_p2p = voted
        schedule._autofit_voted = True
    schedules = sys.modules[type(schedule).__module__]
    held = patch(schedules, "_batch_p2p", _holding_sends) if fake_group else contextlib.nullcontext()
    with held:
        if "arg_mbs" in inspect.signature(schedule.step).parameters:  # torch 2.14 on
            schedule.step(arg_mbs=arg_mbs, target_mbs=target_mbs, losses=losses, return_outputs=False)
            return
        if schedule._has_backward and not torch.is_grad_enabled():
            raise RuntimeError("a pipeline step with backward needs gradients enabled")
        for stage in stages:
            stage.has_backward = schedule._has_backward
            stage.clear_runtime_states()
        schedule._step_microbatches(arg_mbs, None, target_mbs, losses, return_outputs=False)


# Note [a schedule's order without its stages]
#     Every multi-stage schedule of torch.distributed.pipelining (``PipelineScheduleMulti``) builds, when it is made,
#     the compute actions of every rank in the order that rank runs them (``pipeline_order``: rank -> [_Action(stage,
#     type, micro-batch) or None], None a step the rank waits), and its step runs that list. The order depends on the
#     degree, the stages and the micro-batch count only, so a schedule made over stand-ins that carry those (the stage
#     fields its constructor reads: ``num_stages``, ``group_size``, ``group_rank``, ``stage_index``, and ``submod``,
#     which the runtime schedules inspect for FSDP2) gives torch's own order without a model, a process group or a
#     step: checked on 2.13 and 2.14 for the five multi-stage schedules of ``autofit.parallel.pipeline.SCHEDULES``.
#     GPipe and 1F1B step a loop of their own, and the ``pipeline_order`` they build only to be drawn is not it
#     (1F1B's leaves the last stage's first forward out): their orders are written in parallel/pipeline.py.
#     DualPipeV's overlapped action (OVERLAP_F_B) runs its sub-actions one after the other where no function is
#     registered for it (``_PipelineScheduleRuntime``), so it is given as them.
def pipeline_order(torch_class: str, ranks: int, held: list[int], stages: int, micro_batches: int
                   ) -> dict[int, list[tuple[int, str, int]]]:
    """torch's order of compute actions for multi-stage schedule class ``torch_class`` of ``schedules.py`` over
    ``ranks`` ranks and ``stages`` stages running ``micro_batches``, rank 0 holding the stage indices ``held``: for
    each rank its
    actions in order as ``(stage, kind, micro-batch)``, kind one of "F" (forward), "B" (full backward), "I" (the
    input-gradient half of a split backward), "W" (its weight half) (Note [a schedule's order without its stages])."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules

    kinds = {_need("torch.distributed.pipelining.schedules", name): kind for name, kind in (
        ("FORWARD", "F"), ("FULL_BACKWARD", "B"), ("BACKWARD_INPUT", "I"), ("BACKWARD_WEIGHT", "W"))}
    overlapped = _need("torch.distributed.pipelining.schedules", "OVERLAP_F_B")
    standins = [SimpleNamespace(num_stages=stages, group_size=ranks, group_rank=0, stage_index=index,
                                is_first=index == 0, is_last=index == stages - 1,
                                submod=torch.nn.Module()) for index in held]
    built = getattr(schedules, torch_class)(standins, micro_batches, loss_fn=lambda output, target: output,
                                            scale_grads=False)

    def plain(action: Any) -> list[tuple[int, str, int]]:
        if action is None:
            return []
        if action.computation_type == overlapped:
            return [a for sub in action.sub_actions for a in plain(sub)]
        kind = kinds.get(action.computation_type)  # UNSHARD, RESHARD, REDUCE_GRAD: no compute of their own here
        return [] if kind is None else [(action.stage_index, kind, action.microbatch_index)]

    return {rank: [a for action in actions for a in plain(action)] for rank, actions in built.pipeline_order.items()}


# Note [a send holds its tensor]
#     A point-to-point send's ``Work`` keeps the tensor it sends for as long as the Work lives on gloo (measured, below;
#     NCCL's ``WorkNCCL`` stashes an op's tensors for the caching allocator's safety too, read in ProcessGroupNCCL.cpp
#     for its collectives, not checked on a GPU for its sends), and torch's schedules keep the Works of their sends
#     until they wait on them (ScheduleGPipe every forward send to the step's end, Schedule1F1B its last warm-up send,
#     benchmarks/pipeline_probe.py): a stage's output outlives its backward there. A fake process group's Work holds
#     nothing, so on one the sends return Works that hold their ops' tensors: two gloo ranks of a 4-layer Llama under
#     GPipe measured the first stage's 8,192-B output (2 x 16 x 64 fp32) still alive at its last backward, which a
#     fake Work had let go.
class _HeldWork:
    """A Work and the tensor its op sends or receives, kept together (Note [a send holds its tensor])."""

    def __init__(self, work: Any, tensors: list) -> None:
        self._work, self._tensors = work, tensors

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _holding_sends(original: Callable) -> Callable:
    def batch_p2p(p2p_ops: list, *args: Any, **kwargs: Any) -> list:
        works = original(p2p_ops, *args, **kwargs)
        if len(works) == len(p2p_ops):  # one Work per op (no coalescing): each holds its own op's tensor
            return [_HeldWork(w, [op.tensor]) for w, op in zip(works, p2p_ops)]
        return [_HeldWork(w, [op.tensor for op in p2p_ops]) for w in works]
    return batch_p2p


# Note [DTensor's tuple strategies in linear time]
#     A foreach op over FSDP2's sharded parameters (the optimizer step: _foreach_mul_, _foreach_lerp_, ... over
#     every parameter) reaches DTensor's sharding propagation as one OpSchema whose arguments are lists of all of
#     them, and a TupleStrategy of one child per parameter. torch 2.13's ``propagate_op_sharding_non_cached``
#     calls ``_propagate_use_strided_shard_flag(child, op_schema)`` for each child, and each call reads
#     ``op_schema.args_spec``, a property that flattens every argument again (torch/distributed/tensor/
#     _sharding_prop.py, _op_schema.py): quadratic in the parameters. On the 70B-shaped Llama's full 80-block
#     simulation (723 parameters per foreach list) it was 335 of a plan's 869 profiled CPU seconds. The function
#     reads only ``op_schema.args_spec``, which depends only on ``op_schema.args_schema``, so while simulating it
#     is handed the specs flattened once per schema: the same tuple of the same spec objects, the same strategies.
#     The cache holds one schema and its argument tuple by reference and is used only while both are the same
#     objects (a rewrapped schema gets a new tuple, _op_schema.py ``_inplace_rewrap_schema_suggestion``); any
#     other attribute is read from the schema itself. A torch without the function is left as it is.
#     The function's first loop, whether any input spec holds a ``_StridedShard``, also reads every spec, once per
#     child: it is answered once per schema too, and where none does the function returns at once, as torch's
#     does then, without changing anything (a 1 B-parameter seq2seq's FSDP2 estimate at world size 2: 31.8 to
#     25.2 CPU s, the same figures).
class _Specs:
    """An OpSchema whose ``args_spec`` was flattened once (Note [DTensor's tuple strategies in linear time])."""

    def __init__(self, schema: Any, specs: tuple) -> None:
        self._inner, self.args_spec = schema, specs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def dtensor_specs_once() -> Iterator[None]:
    """DTensor's sharding propagation with each schema's argument specs flattened once per schema, not once per
    child of a tuple strategy (Note [DTensor's tuple strategies in linear time])."""
    try:
        module = importlib.import_module("torch.distributed.tensor._sharding_prop")
    except ImportError:  # a torch without distributed: no DTensor to propagate
        yield
        return
    if not callable(getattr(module, "_propagate_use_strided_shard_flag", None)):
        yield
        return

    strided = getattr(importlib.import_module("torch.distributed.tensor.placement_types"), "_StridedShard", None)

    def make(original: Callable) -> Callable:
        # the schema, its argument tuple, its specs, and whether any of them holds a _StridedShard
        last: list[Any] = [None, None, None, True]

        def propagate(op_strategy: Any, schema: Any) -> Any:
            if last[0] is not schema or last[1] is not schema.args_schema:
                specs = schema.args_spec
                last[:] = [schema, schema.args_schema, specs,
                           strided is None or any(isinstance(p, strided) for s in specs for p in s.placements)]
            if not last[3]:
                return None  # torch's function returns before changing anything when no input is strided
            return original(op_strategy, _Specs(schema, last[2]))
        return propagate

    with patch(module, "_propagate_use_strided_shard_flag", make):
        yield


# Note [one process, several simulated ranks]
#     DTensor caches each op's sharding by its inputs' specs (``ShardingPropagator.propagate_op_sharding``, an LRU
#     cache), and a spec's mesh compares equal to any mesh of the same rank map, layout and dim names
#     (``DeviceMesh.__eq__``): the coordinate of the rank that built it, and so the process groups of its dims, are
#     not part of the key. A real process is one rank and builds its meshes once, so that cannot matter there. The
#     simulation is several ranks in turn in one process (a pipeline's stages: ``Layout.distinct_ranks``), each on a
#     fake process group of its own: rank 2's tensor-parallel mesh over ranks 2 and 3 found rank 0's output specs,
#     whose mesh's group ("3", ranks 0 and 1) the next fake group no longer held, and its first sequence-parallel
#     all-gather failed to resolve it. And after a plan, the cache would hand the user's own DTensor ops meshes of a
#     destroyed fake group. So the cache is cleared when a simulation's fake group is made for another mesh or
#     another rank than the last one's, and at the start and end of each of autofit's entry points (``keeps_user_rng``,
#     core/rng.py: the user's own DTensor ops neither find a fake group's mesh nor leave theirs for a simulation).
#     Within one call it is kept: the simulations of one rank of one mesh make their fake groups again under the same
#     names, and a plan's simulations of an FSDP2 layout share the sharding of each op, which DTensor computes slowly
#     for a foreach op over hundreds of parameters (clearing it at every simulation made the plan of a 1B seq2seq
#     model over two FSDP2 ranks take 51.2 s against 45.7 s, tests/test_value_twins.py's model).
_SHARDINGS_OF: list[Any] = [None]  # the simulated mesh and rank DTensor's cached shardings are of, None: empty


def dtensor_shardings_of(mesh: tuple) -> None:
    """DTensor's cached shardings kept where they are of ``mesh`` (a simulation's world size, mesh shape, names and
    rank), else cleared: also where nothing was simulated since the last clearing, the user's own ops may have
    filled them (Note [one process, several simulated ranks])."""
    if _SHARDINGS_OF[0] != mesh:
        _clear_shardings()
    _SHARDINGS_OF[0] = mesh


def forget_dtensor_shardings() -> None:
    """Clear DTensor's cached shardings at an entry point's start and end (Note [one process, several simulated
    ranks]) where DTensor's debug module is loaded. Where it is not, no simulation ran (the entry points import it
    with torch's lazy modules, SIGINT held: Note [lazy imports and Ctrl-C], core/_torch_interrupts.py), and
    importing it here, before them, a Ctrl-C could leave DTensor and sympy half initialised
    (tests/test_interrupts.py); a simulation's mesh clears what the user's own ops cached
    (:func:`dtensor_shardings_of`)."""
    _SHARDINGS_OF[0] = None
    if "torch.distributed.tensor.debug" in sys.modules:
        _clear_shardings()


def _clear_shardings() -> None:
    """DTensor's caches of op shardings cleared, the Python one and the C++ fast path's, as torch's own
    ``_clear_sharding_prop_cache`` does (torch/distributed/tensor/debug)."""
    if torch.distributed.is_available():  # a torch without distributed: no DTensor, nothing cached
        _need("torch.distributed.tensor.debug", "_clear_sharding_prop_cache")()


def fsdp_internals() -> tuple[type, type]:
    """FSDP2's ``FSDPParam`` and ``FSDPParamGroup``: the simulation of a CPU-offloaded step wraps where a unit's
    parameters are copied to the device and where its reduced gradients go back to the host (simulate/offload.py)."""
    return (_need("torch.distributed.fsdp._fully_shard._fsdp_param", "FSDPParam"),
            _need("torch.distributed.fsdp._fully_shard._fsdp_param_group", "FSDPParamGroup"))


# ---- process-wide patches ----------------------------------------------------------------------------------------
_PATCH_LOCK = threading.RLock()


def patch_lock() -> threading.RLock:
    """The lock every process-wide change to torch's state holds (for changes that are not one attribute, such as
    an entry appended to a module-level list)."""
    return _PATCH_LOCK


class Patch:
    """One attribute replaced for a while; ``hits`` counts the calls torch made to the replacement."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner, self.name, self.hits = owner, name, 0

    def require_hit(self, why: str) -> None:
        """Raise if torch never called the replacement although ``why`` says it must have."""
        if self.hits == 0:
            where = getattr(self.owner, "__name__", type(self.owner).__name__)
            raise UnsupportedTorchError(
                f"autofit replaces {where}.{self.name} while it simulates, because {why}, but this torch "
                f"({torch.__version__}) never called it, so the estimate would miss that term; autofit supports torch "
                f"{SUPPORTED_TORCH} and is tested on {', '.join(TESTED_TORCH)}"
            )


@contextlib.contextmanager
def patch(owner: Any, name: str, make: Callable[[Callable], Callable]) -> Iterator[Patch]:
    """Replace ``owner.name`` by ``make(original)`` under the process-wide patch lock; restore it on exit.

    The lock is held for the whole context: two simulations in two threads would otherwise restore each other's
    patches. It is re-entrant, so one simulation can nest several patches."""
    with _PATCH_LOCK:
        original = getattr(owner, name)
        record = Patch(owner, name)
        replacement = make(original)

        def counted(*args: Any, **kwargs: Any) -> Any:
            record.hits += 1
            return replacement(*args, **kwargs)

        setattr(owner, name, counted)
        try:
            yield record
        finally:
            setattr(owner, name, original)


# the caching allocator's settings as PYTORCH_ALLOC_CONF text ('' for defaults) and their setter (a plan may need them)
allocator_settings = _need("torch._C", "_accelerator_getAllocatorSettings")
set_allocator_settings = _need("torch._C", "_accelerator_setAllocatorSettings")
