"""The torch boundary: every private torch symbol autofit uses, checked once at import.

autofit simulates a training step on fake tensors, watches it below autograd with a dispatch mode, re-registers
autocast kernels, and reads the profiler's event tree. None of that is public API, so it all goes through this
module: a release that moves or removes a piece fails here, at import, with an :class:`UnsupportedTorchError` naming
the piece and the supported range, instead of deep inside a simulation. Nothing else in autofit imports a private
torch module or reads a private attribute of a torch object (tests/test_architecture.py checks that).

Process-wide patches (a module attribute that torch's own code looks up at call time) go through :func:`patch`: one
lock for all of them, restored on exit, and a count of how often torch really called the replacement, so a caller can
check the patch still takes effect (:meth:`Patch.require_hit`).
"""

from __future__ import annotations

import bisect
import contextlib
import importlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from autofit.core.errors import AutofitError, UnsupportedTorchError

__all__ = [
    "SUPPORTED_TORCH", "TESTED_TORCH", "DATA_DEPENDENT_ERRORS", "PASSTHROUGH_ERRORS", "FakeTensorMode", "scaled_mm",
    "OpOverload", "op_by_name", "op_named",
    "TorchDispatchMode", "disable_current_modes", "pytree", "tree_map", "current_autograd_node", "module_call_codes",
    "allocation_sizes", "window_memory", "thread_memory", "high_water_mark", "memory_profile", "quiet_native_output", "EventType", "has_dispatch_kernel", "all_aten_op_names", "exclude_dispatch_key",
    "is_view", "grad_scaler_state", "FakeTensor", "unset_fake_temporarily", "storage_tensors",
    "compiled_modules", "rewrap_compiled", "foreach_types_include", "foreach_devices_include", "destroy_library",
    "value_free_grad_scaler", "patch_lock", "fake_store", "fsdp_internals", "Patch", "patch", "BatchNormBase",
    "SpectralNormParametrization", "NormBase", "tensor_version",
    "onednn_low_precision", "op_schema", "dtensor_local", "allocator_settings", "set_allocator_settings",
    "import_lazy_modules", "LAZY_MODULES", "ddp_bucket_bytes", "ddp_bucket_sizes", "dtensor_specs_once",
    "interrupts_at_safe_points", "interruption_point", "forget_interrupts",
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


def _allocation_events(prof: torch.profiler.profile, thread_of: str | None,
                       span: str | None = None) -> tuple[list[tuple[int, int, int, int]], set[int], list[tuple[int, int]]]:
    """``(time, size, thread id, address)`` of every Allocation event a ``profile_memory=True`` CPU profile
    recorded, in time order (negative size on free), read from the profiler's event tree (``kineto_results.
    experimental_event_tree``), the allocator's own record; the thread ids that ran the ``record_function`` named
    ``thread_of``; and the (start, end) times of the ``record_function`` calls named ``span``, in order."""
    events: list[tuple[int, int, int, int]] = []
    marks: set[int] = set()
    spans: list[tuple[int, int]] = []
    waits: list[tuple[int, int]] = []  # (thread id, end) of each collective wait
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == EventType.Allocation:
            fields = node.extra_fields
            events.append((node.start_time_ns, fields.alloc_size, node.start_tid, fields.ptr))
        elif thread_of is not None and node.name == thread_of:
            marks.add(node.start_tid)
        elif span is not None and node.name == span:
            spans.append((node.start_time_ns, node.end_time_ns))
        elif thread_of is not None and node.name.endswith("wait_tensor"):
            waits.append((node.start_tid, node.end_time_ns))
        stack.extend(node.children)
    events.sort(key=lambda e: e[0])
    if thread_of is not None:
        events = _freed_at_completion(events, marks, sorted(end for tid, end in waits if tid in marks))
    return events, marks, sorted(spans)


# Note [a free the profiler did not record]
#     The CPU profiler records an allocator event on the threads it follows; a tensor of the rank's whose last
#     reference gloo's worker drops can be freed on a thread it does not follow, and then no free is recorded at all.
#     A CI run measured sequence parallel's rank 1 32,768 B high in all three windows: one all-gather's 32 KiB tensor
#     allocated on the rank's thread, no free event, its address handed out again 35 events later (a rank measured
#     alongside other gloo jobs on two cores; the same tensor idle is freed on the rank's thread before its wait
#     ends). The allocator hands out no address still in use, so an allocation at an address the rank allocated and
#     never freed proves the free: it is put at the end of the rank's first collective wait after the allocation
#     (where the collective that held it completed, as for the frees gloo's thread does record), or just before the
#     reuse where no wait comes between. An unrecorded free whose address is not reused inside the window stays
#     unseen.
UNRECORDED_THREAD = -1  # the thread id of an inferred free: no thread the profiler followed


def _freed_at_completion(events: list[tuple[int, int, int, int]], marks: set[int],
                         waits: list[int]) -> list[tuple[int, int, int, int]]:
    """The events with each free that another thread made of a marked thread's allocation moved back to the end of
    the marked thread's last collective wait before it (and after the allocation). gloo's worker signals a
    collective complete, then drops the work and the rank's tensors it holds: on a loaded machine the rank's thread
    has allocated its next tensors by then, and the free landing after them counted a tensor the step no longer
    held (a CI run measured a tensor-parallel rank 32,768 B high in each of three windows: Note [gloo's threads in
    the measured window], measure/ranks.py). The wait's end is when the step let go of it, as NCCL's job does. And a
    free the profiler did not record at all is put back where an address the marked thread holds is handed out
    again (Note [a free the profiler did not record])."""
    allocated_by_mark: dict[int, tuple[int, int]] = {}  # address -> (time, bytes) of a marked thread's allocation
    moved = []
    for time, size, tid, ptr in events:
        if size > 0:
            if ptr in allocated_by_mark:  # its free went unrecorded (Note [a free the profiler did not record])
                allocated, nbytes = allocated_by_mark.pop(ptr)
                first = bisect.bisect_right(waits, allocated)  # the first wait ending after the allocation
                moved.append((waits[first] if first < len(waits) and waits[first] < time else time, -nbytes,
                              UNRECORDED_THREAD, ptr))
            if tid in marks:
                allocated_by_mark[ptr] = time, size
        elif ptr in allocated_by_mark:
            allocated, _ = allocated_by_mark.pop(ptr)
            if tid not in marks:  # gloo's worker dropped it: back to the rank's last wait before the free
                i = bisect.bisect_left(waits, time) - 1
                if i >= 0 and waits[i] > allocated:
                    time = waits[i]
        moved.append((time, size, tid, ptr))
    moved.sort(key=lambda e: e[0])  # stable: a free moved to a wait's end stays after what came before it there
    return moved


def allocation_sizes(prof: torch.profiler.profile, thread_of: str | None = None) -> list[int]:
    """Bytes of every Allocation event a ``profile_memory=True`` CPU profile recorded, in time order; negative on
    free: the ground truth where there is no GPU (docs/accuracy.md). ``thread_of``: only the memory of the thread
    that ran the ``record_function`` of that name (the profiler's own thread ids), as :func:`thread_memory` reads it.
    The profiler reports no free of memory allocated while no memory profile ran (Note [memory from before the
    window], measure/allocator.py)."""
    events, marks, _ = _allocation_events(prof, thread_of)
    if thread_of is None:
        return [size for _, size, _, _ in events]
    return thread_memory([(size, tid, ptr) for _, size, tid, ptr in events], marks)


def window_memory(prof: torch.profiler.profile, span: str, thread_of: str | None = None,
                  known: set[int] | None = None) -> list[tuple[dict[int, int], int]]:
    """Of a ``profile_memory=True`` CPU profile whose code ran ``record_function(span)`` one or more times, one after
    another, for each span: what the profile had seen allocated and not freed when it began (``{address: bytes}``),
    and its high-water mark above the bytes alive then. One profile holds what comes before the spans and the spans
    themselves, so no free between them goes unseen (Note [memory from before the window], measure/allocator.py).
    ``thread_of``: only the memory of the thread that ran the ``record_function`` of that name, as
    :func:`thread_memory` counts it; and of what was alive when a span began, only the ``known`` addresses (the
    step's own tensors) count, and the frees of the rest do not: a rank's tensor still alive when a window begins
    may be in gloo's hands, freed by its thread whenever it gets there (Note [gloo's threads in the measured
    window])."""
    events, marks, spans = _allocation_events(prof, thread_of, span)
    if not spans:
        raise AssertionError(f"the profile ran no record_function({span!r})")
    ours = (lambda tid: True) if thread_of is None else (lambda tid: tid in marks)
    live: dict[int, int] = {}  # address -> bytes of what counts and is not freed yet
    windows: list[tuple[dict[int, int], int]] = []
    position = 0
    for start, end in spans:
        while position < len(events) and events[position][0] < start:
            _count(events[position], live, ours)
            position += 1
        unknown: set[int] = set()  # alive at the start, not the step's own: neither it nor its free counts
        if thread_of is not None:
            unknown = {a for a in live if a not in (known or ())}
            for address in unknown:
                del live[address]
        at_start, running, peak = dict(live), 0, 0
        while position < len(events) and events[position][0] <= end:
            event = events[position]
            position += 1
            if event[3] in unknown:
                unknown.discard(event[3])
                if event[1] < 0:
                    continue
            running += _count(event, live, ours)
            peak = max(peak, running)
        windows.append((at_start, peak))
    return windows


def _count(event: tuple[int, int, int, int], live: dict[int, int], ours: Callable[[int], bool]) -> int:
    """Apply one allocation event to ``live`` (what counts and is not freed yet); the bytes it counts: an allocation
    by one of ``ours`` threads, a free on one of them, and a free of what they allocated (:func:`thread_memory`)."""
    _, size, tid, ptr = event
    if size > 0:
        if not ours(tid):
            live.pop(ptr, None)  # the address now holds another thread's tensor
            return 0
        live[ptr] = size
        return size
    if live.pop(ptr, None) is None and not ours(tid):
        return 0  # another thread's free of what is not ours
    return size


def thread_memory(events: list[tuple[int, int, int]], marks: set[int]) -> list[int]:
    """Of ``(size, thread id, address)`` allocation events in time order (negative size on free), the sizes that are
    the memory of the threads in ``marks``: their allocations and every free on them, and the frees of their
    allocations on any other thread (matched by address). Note [gloo's threads in the measured window]
    (measure/ranks.py): gloo's worker can drop the last reference to a tensor the rank's thread allocated, and
    counted by thread that free would be lost, the window keeping its bytes for good. Another thread's
    allocations do not count."""
    mine: set[int] = set()  # addresses the marked threads allocated and have not seen freed
    sizes = []
    for size, tid, ptr in events:
        if size > 0:
            if tid in marks:
                mine.add(ptr)
                sizes.append(size)
            else:
                mine.discard(ptr)  # the address now holds another thread's tensor
        elif ptr in mine:
            mine.discard(ptr)
            sizes.append(size)
        elif tid in marks:
            sizes.append(size)
    return sizes


def high_water_mark(sizes: list[int]) -> tuple[int, int]:
    """(highest running sum, final running sum) of allocation sizes (negative on free), in order."""
    running = peak = 0
    for size in sizes:
        running += size
        peak = max(peak, running)
    return peak, running


@contextlib.contextmanager
def quiet_native_output(fds: tuple[int, ...] = (2,)) -> Iterator[None]:
    """Send what native code writes to these file descriptors to /dev/null for a while. Kineto prints a
    'profiler_start' / 'profiler_stop' line on the C stderr each time a profiler starts and stops, whatever its log
    level (autofit starts one per kernel probe); HiGHS prints solver internals on stdout."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {}
    try:
        for fd in fds:
            saved[fd] = os.dup(fd)
    except OSError:  # no such descriptor (embedded interpreters): nothing to silence
        for fd in saved.values():
            os.close(fd)
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            for fd in fds:
                os.dup2(devnull.fileno(), fd)
        yield
    finally:
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)


class memory_profile:  # noqa: N801 - used like torch.profiler.profile
    """``torch.profiler.profile(activities=[CPU], profile_memory=True)`` without Kineto's stderr lines."""

    def __enter__(self):
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with quiet_native_output():
            self._prof.__enter__()
        return self._prof

    def __exit__(self, *exc):
        with quiet_native_output():
            return self._prof.__exit__(*exc)


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


# ---- torch's lazy imports (every public entry point, before its first simulation) --------------------------------
# Note [lazy imports and Ctrl-C]
#     The first simulation in a process makes torch import about 800 modules it imports lazily (dynamo for
#     ``set_stance``, sympy and the symbolic shapes behind fake tensors, inductor's config, FSDP2 and DTensor, aot
#     autograd): several seconds. A KeyboardInterrupt inside one of those imports leaves a package half initialised:
#     Python drops the package being imported from ``sys.modules`` but keeps the submodules it had finished, so every
#     later import of it raises (``module 'sympy' has no attribute 'logic'``, ``partially initialized module
#     'torch._inductor'``) and the process cannot plan again. So every entry point (``estimate``, ``measure``,
#     ``plan``, ``analyse``) first imports these modules, once per process, with SIGINT held until they are done (in
#     the main thread, where Python delivers signals); an interrupt that arrives meanwhile is raised right after, as
#     a KeyboardInterrupt between two imports, which leaves nothing half done.
LAZY_MODULES = (
    "torch._dynamo", "torch.fx.experimental.symbolic_shapes", "sympy", "torch.utils._sympy.functions",
    "torch._inductor.config", "torch._numpy", "torch._functorch.aot_autograd", "torch._functorch.make_functional",
    "torch._subclasses.schema_check_mode", "torch._higher_order_ops.triton_kernel_wrap",
    "torch._decomp.decompositions_for_rng", "torch.nn.utils._expanded_weights", "torch.onnx",
    "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed._functional_collectives",
    "torch.distributed._composable", "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
    "torch.distributed._state_dict_utils", "cProfile", "pstats",
)
_lazy_imported = False


def import_lazy_modules() -> None:
    """Import :data:`LAZY_MODULES` once, with SIGINT held until done (See Note [lazy imports and Ctrl-C]); a module
    this torch build lacks is skipped (torch imports it nowhere then)."""
    global _lazy_imported
    if _lazy_imported:
        return
    with _interrupts_held():
        for name in LAZY_MODULES:
            try:
                importlib.import_module(name)
            except ImportError:
                continue
        _lazy_imported = True


# ---- Ctrl-C (every public entry point) ---------------------------------------------------------------------------
# Note [Ctrl-C at safe points]
#     Python raises KeyboardInterrupt at whatever bytecode the main thread runs next after SIGINT. In a simulation
#     much of that Python is called by torch's C++ where an exception cannot pass: the Python dispatcher asking
#     ``find_torch_dispatch_rule`` under the fake mode (the process aborts: "terminate called after throwing an
#     instance of 'pybind11::error_already_set'" or "'python_error'", a notebook's kernel dies), a weak reference's
#     callback or a ``__del__`` (Python prints "Exception ignored" and drops the interrupt: the tracker's timeline
#     then misses a free, and the call goes on as if nothing happened). And a second Ctrl-C inside an ``__exit__``
#     leaves the rest of it undone: a dispatch mode on torch's stack (every later op of the process routed through
#     it, plain training steps 2.5x slower), a patch in place, the grad mode off. Issue 55 reported 9 of 14 runs of
#     about 30 interrupts aborted, one interrupt became a ForwardError, two left modes behind. Measured here before
#     this (2026-11-28): tests/_interrupt_storm.py aborted ('python_error') after dropping 16 interrupts; of five
#     runs of 40 interrupts of a small transformer's plan/estimate/measure, one aborted ('error_already_set', in
#     find_torch_dispatch_rule), one left grad mode off (every later call a LossError), two dropped an interrupt.
#     After: every interrupt of the storm is a KeyboardInterrupt, none dropped, nothing left behind.
#
#     So every entry point (``estimate``, ``measure``, ``plan``, ``analyse``: the decorator in
#     capture/user_hooks.py) runs under :func:`interrupts_at_safe_points`: SIGINT's handler only records the signal,
#     and :func:`interruption_point` raises it where an exception takes torch's and autofit's ordinary error path:
#     each op one of autofit's dispatch modes sees (an exception from ``__torch_dispatch__`` unwinds as a fake
#     tensor's data-dependent error does), each stage the planner reports (core/progress.py), each micro-batch of a
#     measured step, each wait for a worker (core/workers.py); and on leaving the entry point. Every context then
#     exits as for any error, and no later interrupt can cut an exit short (it is recorded, and raised when the entry
#     point is left). The interrupt reaches the caller as the handler that was installed makes it: Python's raises
#     KeyboardInterrupt, a notebook's its own; an ignored SIGINT stays ignored. In the main thread only (the one
#     Python delivers signals to); nested entry points share the outer one's.
_pending_interrupts: list[int] = []  # SIGINTs recorded while deferred, not yet raised
_deferred_handler: list[Any] = []  # the handler that was installed before the outermost deferral (empty: none)
_raised_inside: list[bool] = []  # whether an interruption point raised inside the outermost deferral


def _record_interrupt(signum: int, frame: Any) -> None:
    _pending_interrupts.append(signum)


def forget_interrupts() -> None:
    """Drop the interrupts recorded so far (a forked worker: they are its parent's to raise)."""
    _pending_interrupts.clear()


def interruption_point() -> None:
    """Raise a Ctrl-C recorded by :func:`interrupts_at_safe_points` (See Note [Ctrl-C at safe points]); a no-op
    when none is pending. Cheap: it runs on every op a simulation dispatches."""
    if _pending_interrupts:
        _pending_interrupts.clear()
        handler = _deferred_handler[0] if _deferred_handler else signal.default_int_handler
        if _raised_inside and handler is signal.default_int_handler:
            _raised_inside[0] = True
        _deliver(handler)


def _deliver(handler: Any) -> None:
    """Do what ``handler`` (a SIGINT disposition) does with a SIGINT, here."""
    if callable(handler):
        handler(signal.SIGINT, None)  # Python's default handler raises KeyboardInterrupt
    elif handler == signal.SIG_DFL:
        raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_at_safe_points() -> Iterator[None]:
    """SIGINT inside is raised only at :func:`interruption_point` and on exit (See Note [Ctrl-C at safe points])."""
    if (threading.current_thread() is not threading.main_thread() or _deferred_handler
            or signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, None)):
        yield  # not where signals arrive, or already deferred, or ignored (None: not installed from Python)
        return
    _deferred_handler.append(signal.signal(signal.SIGINT, _record_interrupt))
    _raised_inside.append(False)
    try:
        yield
    except KeyboardInterrupt:
        _undefer(deliver=False)  # one interrupt is enough
        raise
    except BaseException as e:
        raised = _raised_inside[0]
        _undefer(deliver=True)
        if raised:  # a KeyboardInterrupt some layer turned into another error on its way out: still the user's Ctrl-C
            raise KeyboardInterrupt from e
        raise
    raised = _raised_inside[0]
    _undefer(deliver=True)
    if raised:  # a KeyboardInterrupt some code caught and went on from: the result is not to be trusted
        raise KeyboardInterrupt


def _undefer(*, deliver: bool) -> None:
    _raised_inside.pop()
    signal.signal(signal.SIGINT, _deferred_handler.pop())
    if _pending_interrupts:
        _pending_interrupts.clear()
        if deliver:
            _deliver(signal.getsignal(signal.SIGINT))


_interrupts_held = interrupts_at_safe_points  # the lazy imports: no safe point inside, raised right after
