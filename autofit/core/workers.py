"""Independent simulations side by side, in forked worker processes (Note [parallel simulations]).

Note [parallel simulations]
    A simulation is single-threaded Python (fake tensors dispatch one op at a time), and a plan runs several that do
    not depend on each other: the analysis's two micro-batch sizes, the cut models of a depth extrapolation (Note
    [cuts side by side], solve/estimator.py), and the first guesses of the rows-by-length table. On a machine with
    a second core, :func:`start` forks a child that runs one of them while this process runs another; the child sends its result back pickled through a pipe. A forked child starts as an exact copy of
    this process, so it computes exactly what this process would: the same timeline, byte for byte
    (tests/test_plan_speed.py). The collector is frozen before each fork (``gc.freeze``): otherwise its passes in
    both processes touch every object and copy the pages they share.

    When it does not run in parallel, and why:
    - a simulation that probes CPU kernels (CPU targets): the scratch memory a oneDNN kernel allocates depends on the
      thread count, and a child must run with one thread: GNU OpenMP's thread pool does not survive ``fork``
      (a child that uses it after the parent did hangs; seen here with torch 2.13), the reason DataLoader workers
      run single-threaded too. (Tried: a worker that asks this process to run each probe, with its thread count.
      Byte-exact, but no faster on the CPU plans of benchmarks/planning.py, unet's 1.8 s becoming 2.2 s: the probes,
      most of a CPU simulation's time, then all run here, one after another);
    - no ``fork`` (Windows), not Linux (macOS forks unsafely once system frameworks are loaded), one usable core,
      inside a worker already, or ``AUTOFIT_WORKERS=1`` in the environment;
    - another thread of this process that is not a daemon (a user's thread may be inside a torch op, holding a lock
      the child would inherit locked; daemon threads, such as a progress display's, are taken to be helpers).
    A child never outlives this process: on Linux it asks the kernel for SIGKILL when its parent dies
    (``prctl(PR_SET_PDEATHSIG)``), whatever ends the parent (SIGTERM's default action, SIGKILL, a crash), and checks
    its parent is still the one that forked it, in case that happened between ``fork`` and ``prctl``. The signal
    follows the thread that forked, not the process: forks happen only where no other non-daemon thread runs (the
    main thread of a plan), so that thread lives as long as the plan does. A child takes the default SIGINT and
    SIGTERM actions (a Ctrl-C reaches the whole process group: the child just ends, the parent cleans up).
    Anything wrong with a child (it died, or its result does not unpickle, or it raised, or it takes far longer
    than this process took for its own share: ``CHILD_PATIENCE``) makes this process run the job itself: a failure
    is then the same typed error a serial run raises, a result is never lost, and a stuck child cannot hang a plan.
    A fork the system refuses (``OSError``, ENOMEM or EAGAIN on a large planning process) and a child that ends
    without a result because it was killed (the kernel's out-of-memory killer sends SIGKILL) do the same, with a
    one-line ``RuntimeWarning``; after a refused fork this process forks no more (every later fork would be refused
    the same way, each after copying its page tables).

Note [Ctrl-C and workers]
    A KeyboardInterrupt may arrive anywhere in the parent. Between ``fork`` and the :class:`Pending` that owns the
    child it would leave a child nobody stops or reaps (and whose result, once larger than the pipe holds, blocks it
    forever), so SIGINT is blocked across those few lines and delivered right after. A parent interrupted while it
    waits for a child kills the child instead of waiting for its job to end, and ``run_all`` cancels every child on
    the way out: an interrupted plan leaves no process behind (tests/test_interrupts.py).

    Not done: beginning the analysis in workers while the quick path simulates, in case it does not fit. Measured
    with benchmarks/planning.py, it saved under 10 % of a tight plan on the GPU targets, and made the plans the quick
    path settles (one simulation) 1.5-2.3 times slower: after ``fork`` every page the planning process writes is
    copied, and a simulation writes reference counts all over the heap.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import pickle
import select
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from autofit.core import progress, shared
from autofit.core._torch_interrupts import forget_interrupts, interruption_point

__all__ = ["Pending", "start", "run_all", "parallel_available", "ENV"]

T = TypeVar("T")

ENV = "AUTOFIT_WORKERS"  # "1": every simulation in this process; a number n > 1: at most n at once (default: cores)

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_in_worker = False  # set in a child: a worker never forks again
_fork_refused = False  # the system refused a fork (Note [parallel simulations]): no more forks in this process
_WAIT_SLICE = 0.1  # seconds a parent waits on a child between two looks for a Ctrl-C
CHILD_PATIENCE = 10  # run_all waits this many times its own share's time (plus 30 s) for a child, then runs it here


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def parallel_available() -> int:
    """How many simulations may run at once here (1: none side by side). See Note [parallel simulations]."""
    if _in_worker or _fork_refused or not hasattr(os, "fork") or not sys.platform.startswith("linux"):
        return 1
    this = threading.current_thread()
    if any(t is not this and not t.daemon for t in threading.enumerate()):
        return 1
    cores = _cores()
    setting = os.environ.get(ENV, "").strip()
    if setting:
        try:
            return max(1, min(int(setting), cores))
        except ValueError:
            warnings.warn(f"{ENV}={setting!r} is not a number of worker processes; running every simulation in "
                          f"this process (set {ENV}=1 for that, or a number such as 2)", stacklevel=2)
            return 1
    return cores


class Pending(Generic[T]):
    """A job that runs in a forked child, or later in this process (when it cannot, or the child failed)."""

    def __init__(self, job: Callable[[], T], pid: int | None = None, fd: int | None = None) -> None:
        self._job, self._pid, self._fd = job, pid, fd
        self._done = False
        self._value: Any = None

    @property
    def forked(self) -> bool:
        return self._pid is not None

    def result(self, timeout: float | None = None) -> T:
        """The job's value; raises what the job raises (run again in this process, see the Note). A child that has
        not answered within ``timeout`` seconds is stopped and the job runs here instead."""
        if not self._done:
            value = self._collect(timeout) if self._pid is not None else _FAILED
            self._value = self._job() if value is _FAILED else value
            self._done = True
        return self._value

    def cancel(self) -> None:
        """Stop the child (its result is not wanted); the job is never run here."""
        if self._pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGKILL)
            self._reap()
        self._done = True

    def _collect(self, timeout: float | None) -> Any:
        chunks = []
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                # in slices: a Ctrl-C the entry point recorded is raised between them (Note [Ctrl-C at safe points])
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready, _, _ = select.select([self._fd], [], [], _WAIT_SLICE if left is None else min(left, _WAIT_SLICE))
                interruption_point()
                if not ready:
                    if left is not None and left <= _WAIT_SLICE:  # hung, or far slower than this process: give up
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(self._pid, signal.SIGKILL)
                        return _FAILED
                    continue
                chunk = os.read(self._fd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
        except BaseException:  # interrupted (Ctrl-C): the child is stopped, not waited for (Note [Ctrl-C and workers])
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, signal.SIGKILL)
            raise
        finally:
            killed = self._reap()
        try:
            status, value, stages = pickle.loads(b"".join(chunks))
        except Exception:  # noqa: BLE001 - the child died or wrote nothing usable: run the job here
            if killed == signal.SIGKILL:  # not by us (a child given up on returned above): the OOM killer, mostly
                warnings.warn("a worker process was killed (out of memory?) before it answered: running its "
                              "simulation in this process (Note [parallel simulations])", RuntimeWarning,
                              stacklevel=4)
            return _FAILED
        if status != "ok":
            return _FAILED
        shared.merge(stages)
        return value

    def _reap(self) -> int | None:
        """Close the pipe and wait for the child; the signal that ended it, if one did."""
        signalled = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._pid is not None:
            with contextlib.suppress(ChildProcessError):
                _, status = os.waitpid(self._pid, 0)
                signalled = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
            self._pid = None
            _child_gone()
        return signalled

    def __del__(self) -> None:  # a result nobody asked for: no zombie, no orphan
        if getattr(self, "_pid", None) is not None:
            self.cancel()


_FAILED = object()
_alive = 0  # forked children not yet reaped: the objects frozen for them stay frozen until the last is gone


def _child_gone() -> None:
    global _alive
    _alive -= 1
    if _alive == 0:
        gc.unfreeze()


def start(job: Callable[[], T], *, fork: bool = True) -> Pending[T]:
    """Begin ``job`` in a forked child when ``fork`` and this machine allow it (Note [parallel simulations]), else
    return it to run in this process when its result is asked for."""
    global _alive
    if not fork or parallel_available() < 2:
        return Pending(job)
    sys.stdout.flush()
    sys.stderr.flush()
    # the collector would touch every object in both processes, copying their shared pages (each side's writes to
    # a page after fork copy it): freezing them first keeps the collector off them in the child and the parent
    gc.freeze()
    held = _hold_interrupts()  # Note [Ctrl-C and workers]: no child is forked without its Pending
    try:
        try:
            read, write = os.pipe()
            parent = os.getpid()
            pid = _fork_or_none(read, write)
        except OSError as e:  # no pipe: the same as a refused fork
            pid = _refused(e)
        if pid is None:
            if _alive == 0:
                gc.unfreeze()
            return Pending(job)
        if pid != 0:
            os.close(write)
            _alive += 1
            pending = Pending(job, pid, read)
    finally:
        _release_interrupts(held)  # the child's too: it starts with no signal pending
    if pid != 0:
        return pending
    # the child: run the job, send the result, leave without running the parent's exit handlers
    status = 1
    try:
        os.close(read)
        _die_with(parent)
        _child_setup()
        try:
            value = job()
            # what the job computed for the parent's shared stages (Note [one analysis for several cards])
            payload = pickle.dumps(("ok", value, shared.taken()), protocol=pickle.HIGHEST_PROTOCOL)
        except BaseException:  # noqa: BLE001 - the parent runs the job itself and raises the real error
            payload = pickle.dumps(("error", None, b""))
        with os.fdopen(write, "wb") as out:
            out.write(payload)
        status = 0
    finally:
        os._exit(status)


def _fork_or_none(read: int, write: int) -> int | None:
    """``os.fork()``; None (the pipe closed, a warning given) where the system refuses it."""
    try:
        return os.fork()
    except OSError as e:
        os.close(read)
        os.close(write)
        return _refused(e)


def _refused(e: OSError) -> None:
    global _fork_refused
    _fork_refused = True
    warnings.warn(f"could not start a worker process ({e.strerror or e}): running every simulation in this "
                  "process from now on (Note [parallel simulations])", RuntimeWarning, stacklevel=5)
    return None


def _hold_interrupts() -> Any:
    """Block SIGINT in this thread (a Ctrl-C stays pending until released); the previous mask, or None where the
    platform cannot."""
    mask = getattr(signal, "pthread_sigmask", None)
    return None if mask is None else mask(signal.SIG_BLOCK, {signal.SIGINT})


def _release_interrupts(previous: Any) -> None:
    if previous is not None:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _die_with(parent: int) -> None:
    """End this child when ``parent`` ends (Note [parallel simulations]); at once if it already has."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the parent's finally blocks and Pending.__del__ still reap it
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _child_setup() -> None:
    global _in_worker
    _in_worker = True
    shared.forked()
    import torch

    torch.set_num_threads(1)  # see Note [parallel simulations]: OpenMP's pool does not survive fork
    progress.silence()  # the parent's listener draws on the parent's terminal
    forget_interrupts()  # a Ctrl-C the parent recorded is the parent's to raise (Note [Ctrl-C at safe points])
    # What the job prints or warns, the parent's own run of the same code shows; and another thread of the parent
    # (a progress display) may have held the streams' locks at the fork, which the child would wait on forever.
    sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115 - the child's, until os._exit
    warnings.simplefilter("ignore")


def run_all(jobs: Sequence[Callable[[], T]], *, fork: bool = True) -> list[T]:
    """Every job's value, in order: up to ``parallel_available()`` at once, this process running its share."""
    # cores already busy with this process's children (a job of an outer run_all forks no more than is free)
    width = max(1, parallel_available() - _alive) if fork else 1
    if width < 2 or len(jobs) < 2:
        return [job() for job in jobs]
    # this process takes jobs 0, width, 2 x width, ...; child i the jobs i, i + width, ...
    children = [start(_chain(jobs[i::width])) for i in range(1, min(width, len(jobs)))]
    try:
        started = time.monotonic()
        mine = [job() for job in jobs[::width]]
        # a child does as much as this process did: one that needs many times longer is stuck (a lock another
        # thread held at the fork, say), and the plan must not hang on it
        patience = CHILD_PATIENCE * (time.monotonic() - started) + 30.0
        theirs = [c.result(timeout=patience) for c in children]
    finally:
        for c in children:
            c.cancel()
    out: list[Any] = [None] * len(jobs)
    out[::width] = mine
    for i, values in enumerate(theirs, start=1):
        out[i::width] = values
    return out


def _chain(jobs: Sequence[Callable[[], T]]) -> Callable[[], list[T]]:
    return lambda: [job() for job in jobs]
