"""The torch boundary for torch.compile's internals (dynamo, AOTAutograd, inductor), beside ``_torch.py``.

Everything here is private torch API, imported lazily (importing inductor costs seconds) and checked when first
used: a torch that moved a piece raises :class:`UnsupportedTorchError` naming it. See Note [inductor without
kernels].

Note [inductor without kernels]
    A compiled model's memory is what inductor's generated wrapper code allocates and frees: AOTAutograd's
    partitioner (``min_cut_rematerialization_partition``) decides which activations the forward graph returns for
    backward, and inductor's scheduler decides which buffers exist at all (a fused kernel keeps its intermediates in
    registers), when each is freed (``del bufN``) and which buffer a later one reuses (``buf3 = buf0; del buf0  #
    reuse``). The wrapper is Python: it allocates with ``empty_strided_cpu``, runs extern kernels (``mm``, ``addmm``,
    attention) as aten ``out=`` ops, and calls the generated C++ kernels through ``async_compile.cpp_pybinding``.
    So a simulation compiles the model for real, on its fake tensors, through inductor's own ``compile_fx`` (the same
    decompositions, partitioner, lowering and scheduler as ``torch.compile(model)``), and only the last step differs:
    the wrapper source is executed with the C++ kernels replaced by no-ops (they read data pointers, and compiling
    them is the slow part), ``empty_strided_cpu`` by ``torch.empty_strided`` and ``reinterpret_tensor`` by
    ``torch.as_strided`` (the C++ helpers create real or meta tensors, not fake ones), so every allocation and free
    of the compiled step passes through the simulation's dispatch mode as it happens on the allocator. The dispatch
    mode declares ``ignore_compile_internals``, so dynamo compiles under it and it sees the compiled code's
    runtime, not the tracing. The module is never written to inductor's caches (FX graph cache and AOTAutograd cache
    off while a simulation compiles), and the compiled function is a fresh code object per simulation, with its own
    backend: dynamo's cache entries live on the code object and check the backend, so no real run can pick up the
    kernel-less code and no simulation a real kernel.

    What this covers: the CPU target exactly (the same wrapper code ``measure`` runs), for inductor with default
    options. For a GPU target inductor generates Triton kernels and its own wrapper; the partitioner's saved set is
    decided on the same graph and carries over, but the GPU wrapper's buffer reuse and which ops become extern
    kernels may differ, and the CUDA caching allocator rounds what it sees. ``mode="max-autotune"`` benchmarks real
    kernels while it compiles and is refused.

Note [a simulation compiles as a fresh process does]
    Dynamo's automatic dynamic shapes remember, per frame, the sizes it has compiled for, and a frame that sees a
    second size recompiles with that dimension symbolic (``torch._dynamo.pgo``: ``get_code_state()`` keyed by
    ``CodeId``, the frame's file, line and name, not its code object). The simulation's compiled caller is a fresh
    code object but not a fresh ``CodeId``, and where the simulated compile breaks its graph dynamo compiles the
    user's own ``forward`` (and autofit's hooks) as frames of their own, whose ``CodeId`` real runs share. So the
    sizes earlier simulations, plans and real steps saw would decide whether a simulation compiles static or dynamic
    graphs, and a plan would depend on what the process ran before it (the same compiled model planned 128 x 4 first
    and 171 x 3 second in one process). While a simulation compiles, dynamo reads a code state of its own, empty when
    the simulation begins: each simulation compiles as a fresh process's first step does, and nothing it sees is
    left for the user's later compiles.

Note [a simulation leaves no cache entries]
    Dynamo keeps its compiled entries on the code object of each frame it compiles, and where the simulated compile
    breaks its graph those frames are the model's own, shared by every copy of the model and every simulation:
    transformers' ``deprecate_kwarg`` wrapper (``wrapped_func``, one code object for every decorated ``forward``)
    gets an entry per decorated class, guarded on the class, and FSDP2 makes its ``FSDP<Block>`` classes afresh for
    each copy. So the entries of earlier simulations piled up: on a Llama under FSDP2, 3 per simulation, and from
    the third simulation of a process ``wrapped_func`` reached ``recompile_limit`` (8) and dynamo ran it, each
    decoder layer's forward with it, eagerly for the rest of the process: a plan's later candidates were simulated
    and priced uncompiled (Llama-3.1-8B on 8 H100s with ``--allow float8 --compile``: float8's casts unfused, 3.29 s
    against 1.84 s), and the entries held the copies' fake graphs. On leaving, a simulation resets
    (``reset_code``) every code object whose entries it changed, so each one starts where a fresh process does.
    A frame of the user's own compiled model that a simulation also compiled loses its entries and recompiles at its
    next real call.
    A frame that reaches ``recompile_limit`` inside one simulation does so in a real run too, from its first step:
    a Hugging Face decoder that builds its KV cache in training (``use_cache=True``), under FSDP2, recompiles
    ``forward_with_checkpointing`` for every layer (dynamo guards the cache's ``layer_idx``), so from the ninth layer
    on it runs eagerly. The simulation runs it as torch does; before it resets the frame, it names it, and the
    estimate says so (``limited``, simulate/run.py), where only torch's log line said it before.

Note [values inside compiled code]
    The kernel-free wrapper computes no values: its C++ kernels are skipped, and their writes reach no dispatch
    mode. So nothing it makes or writes may keep a real value twin (Note [value twins], simulate/value_twins.py):
    a twin of one of its buffers would be a twin of uninitialised memory, answering a later value read with garbage
    instead of refusing, and its extern kernels (``mm``, ``addmm``) would run for real on those garbage twins,
    outside the tracker: a compiled ViT-H simulation spent 250 of its 270 seconds in 18 such bf16 ``mm``s on two
    cores, and over an hour on a machine whose reused memory held denormals. While the wrapper runs,
    :func:`running_compiled_code` is True (the twins stand aside), and each skipped kernel reports the tensors it
    would have written (its non-``const`` pointer arguments, from the argument types inductor compiles it with) to
    the listener :func:`hearing_skipped_writes` installs, which takes their twins away: a kernel may write into an
    input of the graph, such as a buffer updated in place.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import types
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from autofit.core._torch import patch
from autofit.core.errors import UnsupportedModelError, UnsupportedTorchError

__all__ = ["CompileSettings", "compile_settings", "simulated_compile", "compiled_calls", "compiled_in_place",
           "compiled_code_runs_eagerly", "compile_in_this_thread", "running_compiled_code", "hearing_skipped_writes",
           "hearing_skipped_kernels", "recompile_limit"]

# options of the inductor backend that change nothing on the CPU (cudagraphs are a CUDA feature)
_IGNORED_OPTIONS = frozenset({"triton.cudagraphs"})


@dataclass(frozen=True)
class CompileSettings:
    """How a module was compiled: the backend's name and the arguments of ``torch.compile`` that decide memory."""

    backend: str
    options: dict[str, Any] = field(default_factory=dict)
    dynamic: bool | None = None
    fullgraph: bool = False


def compile_settings(module: torch.nn.Module) -> CompileSettings:
    """The settings an ``OptimizedModule`` was compiled with (``torch.compile``'s backend, unwrapped from dynamo's
    frame converters, torch/_dynamo/eval_frame.py and convert_frame.py)."""
    ctx = getattr(module, "dynamo_ctx", None)
    backend = getattr(ctx, "callback", None)
    while hasattr(backend, "_torchdynamo_orig_backend"):
        backend = backend._torchdynamo_orig_backend
    name = getattr(backend, "compiler_name", None)
    if ctx is None or name is None:
        raise UnsupportedTorchError(
            f"autofit reads how a model was compiled from OptimizedModule.dynamo_ctx, which this torch "
            f"({torch.__version__}) does not have as expected; estimate the model before torch.compile")
    options = dict(getattr(backend, "config", None) or {})
    return CompileSettings(name, options, getattr(ctx, "_dynamic", None), bool(getattr(ctx, "fullgraph", False)))


def _check_simulable(settings: CompileSettings, where: str) -> None:
    if settings.backend not in ("inductor", "eager"):
        raise UnsupportedModelError(
            f"{where} is compiled with backend {settings.backend!r}; autofit estimates torch.compile's default "
            "backend (inductor) and eager models: compile with the default backend, or estimate the model "
            "before compiling it")
    odd = sorted(k for k in settings.options if k not in _IGNORED_OPTIONS)
    if odd:
        raise UnsupportedModelError(
            f"{where} is compiled with inductor options {odd} (mode='max-autotune' or options=...); autofit "
            "estimates inductor's default mode only (max-autotune benchmarks real kernels while it compiles): "
            "compile with torch.compile(model) to estimate it, or estimate the model before compiling it")


def _kernel_free_module(self: Any, wrapper_code: Any) -> types.ModuleType:
    """``GraphLowering._compile_to_module_lines`` without kernels (Note [inductor without kernels])."""
    import torch._inductor.async_compile as async_compile

    mod = types.ModuleType("autofit_simulated_inductor")
    mod.__file__ = "<autofit: inductor wrapper without kernels>"
    for name, value in {**self.constants, **getattr(self, "torchbind_constants", {})}.items():
        setattr(mod, name, value)
    with patch(async_compile, "AsyncCompile", lambda _: _NoKernels):
        exec(compile(wrapper_code.value, mod.__file__, "exec"), mod.__dict__)  # noqa: S102 - inductor's own output
    mod.empty_strided_cpu = _empty_strided_cpu
    mod.reinterpret_tensor = _reinterpret_tensor
    mod.assert_size_stride = mod.assert_alignment = _no_check
    mod.call = _without_values(mod.call)  # compile_fx calls the module's ``call``
    return mod


# Note [values inside compiled code]: True while a kernel-free wrapper runs; the listener of skipped kernels' writes
_RUNNING = contextvars.ContextVar("autofit_running_compiled_code", default=False)
_SKIPPED_WRITES: contextvars.ContextVar[Callable[[list[torch.Tensor]], None] | None] = contextvars.ContextVar(
    "autofit_skipped_kernel_writes", default=None)
# Note [fused kernels in the time model]: the listener of each skipped kernel's reads and writes
_SKIPPED_KERNELS: contextvars.ContextVar[Callable[[list[torch.Tensor], list[torch.Tensor]], None] | None] = (
    contextvars.ContextVar("autofit_skipped_kernels", default=None))


def running_compiled_code() -> bool:
    """True while a simulation runs a compiled graph's kernel-free wrapper (Note [values inside compiled code])."""
    return _RUNNING.get()


@contextlib.contextmanager
def hearing_skipped_writes(listener: Callable[[list[torch.Tensor]], None]) -> Iterator[None]:
    """For a while, ``listener(tensors)`` hears of the tensors each skipped kernel would have written (Note [values
    inside compiled code])."""
    token = _SKIPPED_WRITES.set(listener)
    try:
        yield
    finally:
        _SKIPPED_WRITES.reset(token)


@contextlib.contextmanager
def hearing_skipped_kernels(listener: Callable[[list[torch.Tensor], list[torch.Tensor]], None]) -> Iterator[None]:
    """For a while, ``listener(read, written)`` hears of each skipped kernel the tensors it reads and writes (Note
    [fused kernels in the time model])."""
    token = _SKIPPED_KERNELS.set(listener)
    try:
        yield
    finally:
        _SKIPPED_KERNELS.reset(token)


def _without_values(call: Callable[[list[Any]], Any]) -> Callable[[list[Any]], Any]:
    def run(args: list[Any]) -> Any:
        token = _RUNNING.set(True)
        try:
            return call(args)
        finally:
            _RUNNING.reset(token)

    return run


class _NoKernels:
    """``AsyncCompile`` whose C++ kernels do nothing: a simulation needs their outputs' buffers, not values. Each
    reports what it would have written (Note [values inside compiled code])."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def cpp_pybinding(self, argtypes: list[str], source_code: str) -> Callable[..., None]:
        # inductor's argument types: "const float*" is read, "float*" written, "const int64_t" a scalar
        pointers = [t.strip() for t in argtypes]
        written = [i for i, t in enumerate(pointers) if t.endswith("*") and not t.startswith("const")]
        read = [i for i, t in enumerate(pointers) if t.endswith("*") and t.startswith("const")]

        def kernel(*args: Any) -> None:
            def tensors(positions: list[int]) -> list[torch.Tensor]:
                return [args[i] for i in positions if i < len(args) and isinstance(args[i], torch.Tensor)]

            listener = _SKIPPED_WRITES.get()
            if listener is not None:
                listener(tensors(written))
            kernels = _SKIPPED_KERNELS.get()
            if kernels is not None:
                kernels(tensors(read), tensors(written))

        return kernel

    def cpp(self, source_code: str) -> Callable[..., None]:
        return _no_check

    def wait(self, scope: dict[str, Any]) -> None:
        pass


def _no_check(*args: Any, **kwargs: Any) -> None:
    return None


def _empty_strided_cpu(size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_strided(size, stride, dtype=dtype, device="cpu")


def _reinterpret_tensor(t: torch.Tensor, size: Any, stride: Any, offset: int) -> torch.Tensor:
    # inductor's _reinterpret_tensor: a view of the same storage, offset relative to t's own
    return torch.as_strided(t, size, stride, t.storage_offset() + offset)


@contextlib.contextmanager
def simulated_compile(modules: list[tuple[str, torch.nn.Module]], whole: torch.nn.Module | None = None,
                      limited: list[str] | None = None) -> Iterator[None]:
    """While a simulation runs: each compiled module of the (fake) copy compiles its wrapped module with inductor,
    without kernels (Note [inductor without kernels]), and ``whole`` (the ``compile=True`` knob) is compiled as
    ``nn.Module.compile()`` compiles it. The copy's forwards are replaced for the duration. ``limited`` collects
    the frames that reached dynamo's ``recompile_limit`` meanwhile (Note [a simulation leaves no cache entries])."""
    if not modules and whole is None:
        yield
        return
    settings = [(name, module, compile_settings(module)) for name, module in modules]
    for name, _, s in settings:
        _check_simulable(s, f"module {name!r}" if name else "the model")
    # the "eager" backend runs the module's own code: the simulation's force_eager stance already does
    settings = [(name, module, s) for name, module, s in settings if s.backend == "inductor"]
    try:
        import torch._dynamo.pgo as pgo
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config
        from torch._inductor.compile_fx import compile_fx
        from torch._inductor.graph import GraphLowering
    except ImportError as e:
        raise UnsupportedTorchError(f"autofit simulates compiled models through inductor's compile_fx and "
                                    f"GraphLowering, which this torch ({torch.__version__}) lacks: {e}") from e

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable:
        return compile_fx(gm, example_inputs)

    saved = []
    with contextlib.ExitStack() as stack:
        stack.enter_context(_no_entries_left(limited))  # Note [a simulation leaves no cache entries]; leaves last
        stack.enter_context(patch(GraphLowering, "_compile_to_module_lines", lambda _: _kernel_free_module))
        stack.enter_context(inductor_config.patch(fx_graph_cache=False, compile_threads=1))
        stack.enter_context(functorch_config.patch(enable_autograd_cache=False))
        stack.enter_context(_out_kernels_on_meta())
        # Note [a simulation compiles as a fresh process does]
        fresh: dict = defaultdict(pgo.CodeState)
        stack.enter_context(patch(pgo, "get_code_state", lambda _: lambda: fresh))
        try:
            if whole is not None:  # nn.Module.compile: _wrapped_call_impl calls _compiled_call_impl when set
                whole._compiled_call_impl = _compiled_while_eager(
                    torch.compile(_fresh_caller(whole._call_impl), backend=backend))
            for _, module, s in settings:
                saved.append((module, module.__dict__.get("forward")))
                compiled = torch.compile(_fresh_caller(module._orig_mod), backend=backend,
                                         dynamic=s.dynamic, fullgraph=s.fullgraph)
                module.forward = _compiled_while_eager(compiled)
            yield
        finally:
            if whole is not None:
                whole._compiled_call_impl = None
            for module, forward in saved:
                module.__dict__.pop("forward", None)
                if forward is not None:
                    module.forward = forward


def recompile_limit() -> int:
    """How many compiled entries dynamo keeps per frame before it runs the frame eagerly
    (``torch._dynamo.config.recompile_limit``; ``cache_size_limit`` before it was renamed)."""
    import torch._dynamo.config as config

    return getattr(config, "recompile_limit", None) or config.cache_size_limit


@contextlib.contextmanager
def _no_entries_left(limited: list[str] | None = None) -> Iterator[None]:
    """Note [a simulation leaves no cache entries]: reset each code object whose dynamo entries changed inside; the
    ones that reached ``recompile_limit`` are named in ``limited`` first ("forward_with_checkpointing
    (transformers/modeling_layers.py:89)")."""
    try:
        from torch._dynamo.convert_frame import input_codes
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list, reset_code
    except ImportError as e:
        raise UnsupportedTorchError(f"autofit clears what a simulated compile leaves in dynamo's caches through "
                                    f"input_codes and reset_code, which this torch ({torch.__version__}) lacks: {e}"
                                    ) from e

    def entries() -> dict[int, tuple[types.CodeType, int]]:
        codes = (ref() for ref in input_codes.seen)
        return {id(c): (c, len(_debug_get_cache_entry_list(c))) for c in codes if c is not None}

    before = entries()  # holds each code object, so no id is reused while the simulation runs
    try:
        yield
    finally:
        limit = recompile_limit()
        for key, (code, count) in entries().items():
            if before.get(key, (code, -1))[1] != count:
                if limited is not None and count >= limit:
                    where = "/".join(code.co_filename.split("/")[-2:])
                    limited.append(f"{code.co_name} ({where}:{code.co_firstlineno})")
                reset_code(code)


# Extern kernels that inductor's wrapper calls as ``out=`` ops whose ``out=`` overload has no meta kernel (torch 2.13
# registers one for ``_scaled_mm``'s functional form only, torch/_meta_registrations.py). On fake tensors
# FakeTensorMode then runs the real CPU kernel on zero-filled tensors of full size (its "unsafe fallback"): 119 of the
# 129 s of one simulated 8B-shaped float8 block at 8192 tokens, and as much host memory as the real matmul. While a
# simulation compiles, each gets a meta kernel that writes nothing and returns ``out``, as the kernel-free wrapper
# skips its other kernels; the op still passes through the simulation's dispatch mode, so on a CPU target its
# scratch is probed as every kernel's is (autofit/simulate/probe.py).
_OUT_WITHOUT_META = ("_scaled_mm.out", "_scaled_mm_v2.out")


def _returns_out(*args: Any, **kwargs: Any) -> torch.Tensor:
    return kwargs["out"]


@contextlib.contextmanager
def _out_kernels_on_meta() -> Iterator[None]:
    library = None
    for name in _OUT_WITHOUT_META:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet, None), overload, None)
        if op is None or torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "Meta"):
            continue  # this torch lacks the op, or has its own meta kernel
        library = library or torch.library.Library("aten", "IMPL")  # noqa: TOR901 - removed on exit
        library.impl(name, _returns_out, "Meta")
    try:
        yield
    finally:
        if library is not None:
            library._destroy()


def _compiled_while_eager(compiled: Callable) -> Callable:
    """``compiled`` runs compiled although the simulation runs other compiled code eagerly (``force_eager``, Note
    [compiled code in a simulation], simulate/run.py)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        with torch.compiler.set_stance("default"):
            return compiled(*args, **kwargs)

    return call


def compiled_in_place(model: torch.nn.Module) -> list[str]:
    """Modules compiled with ``nn.Module.compile()`` (their ``_compiled_call_impl`` is set), by name."""
    return [name or "the model" for name, m in model.named_modules()
            if getattr(m, "_compiled_call_impl", None) is not None]


@contextlib.contextmanager
def compiled_calls(module: torch.nn.Module) -> Iterator[None]:
    """``nn.Module.compile()`` for a while (the trainer of a plan with ``compile=True``): the module's calls run
    compiled; on exit its call is as before (``_compiled_call_impl``, torch/nn/modules/module.py)."""
    before = module._compiled_call_impl
    module.compile()
    try:
        yield
    finally:
        module._compiled_call_impl = before


def _fresh_caller(module: Callable) -> Callable:
    """A function calling ``module`` (a module or its ``_call_impl``) whose code object is new: dynamo keeps its compiled entries on the code object,
    so they die with it and never mix with a real compile's."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return module(*args, **kwargs)

    call.__code__ = call.__code__.replace()
    return call


def compiled_code_runs_eagerly() -> contextlib.AbstractContextManager:
    """``torch.compile``d functions and modules run their Python code eagerly for a while
    (``torch.compiler.set_stance("force_eager")``); nothing to do when dynamo was never imported."""
    if "torch._dynamo" not in sys.modules:
        return contextlib.nullcontext()
    return torch.compiler.set_stance("force_eager")


def compile_in_this_thread() -> contextlib.AbstractContextManager:
    """Inductor compiles in the calling thread (``compile_threads=1``): with more, it starts a ThreadPoolExecutor
    whose worker is not a daemon and lives as long as the process, and autofit forks no simulation workers beside a
    non-daemon thread (Note [parallel simulations], autofit/core/workers.py), so one compiled optimizer step measured in a
    simulation would make every later plan serial."""
    import torch._inductor.config as inductor_config  # lazily: importing inductor costs seconds

    return inductor_config.patch(compile_threads=1)
