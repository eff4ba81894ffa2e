"""The torch boundary for the process around a plan, beside ``_torch.py``: torch's lazy imports, made once per
process with SIGINT held (Note [lazy imports and Ctrl-C]), and Ctrl-C raised only at safe points while an entry point
runs (Note [Ctrl-C at safe points]).
"""

from __future__ import annotations

import contextlib
import importlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

__all__ = [
    "import_lazy_modules", "LAZY_MODULES", "interrupts_at_safe_points", "interruption_point", "forget_interrupts",
]


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
#     a KeyboardInterrupt between two imports, which leaves nothing half done. Imported here, a module's own tensors
#     are not the step's either: ``torch.distributed.pipelining`` makes a 0-d tensor at import
#     (``microbatch.sum_reducer``), which the first pipeline simulation of a process counted (4 bytes on its first
#     stage) when the schedule imported it there.
LAZY_MODULES = (
    "torch._dynamo", "torch.fx.experimental.symbolic_shapes", "sympy", "torch.utils._sympy.functions",
    "torch._inductor.config", "torch._numpy", "torch._functorch.aot_autograd", "torch._functorch.make_functional",
    "torch._subclasses.schema_check_mode", "torch._higher_order_ops.triton_kernel_wrap",
    "torch._decomp.decompositions_for_rng", "torch.nn.utils._expanded_weights", "torch.onnx",
    "torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.tensor.debug",
    "torch.distributed._functional_collectives",
    "torch.distributed._composable", "torch.distributed.algorithms._checkpoint.checkpoint_wrapper",
    "torch.distributed._state_dict_utils", "torch.distributed.pipelining", "cProfile", "pstats",
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
