"""A dispatch mode that turns a step run on fake tensors (or, for data-dependent models, real CPU tensors) into an
allocation :class:`Timeline`.

Every aten op passes through ``__torch_dispatch__`` below autograd and autocast, so it sees the ops that really run
(the backward's, the optimizer's, the low-precision casts autocast inserts). A storage the op returns that the
tracker has not seen is an allocation; a weak reference on the storage object reports its death as a free. PyTorch
keeps a storage's Python object alive exactly as long as the C++ storage (PyObject preservation), so frees land
where the real allocator frees. This is the technique of ``torch.distributed._tools.mem_tracker``, rebuilt here
on public pieces so the core does not depend on that private module. Two things the mode alone would miss:
``UntypedStorage.resize_`` (FSDP2 frees and re-allocates unsharded parameters with it) is wrapped while the tracker
is active, and a DTensor is counted by its local shard (``_local``), what this rank stores.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.flop_counter import flop_registry

from autofit.core._torch import (
    DATA_DEPENDENT_ERRORS,
    FakeTensor,
    TorchDispatchMode,
    patch,
    pytree,
    storage_tensors,
    dtensor_local,
    op_schema,
)
from autofit.core._torch_compile import hearing_skipped_kernels
from autofit.core._torch_interrupts import interruption_point
from autofit.core.categories import Category
from autofit.capture.corrections import FakeKernelStricter, fake_kernel, registered
from autofit.core.cpu import require_kernel
from autofit.features import FEATURES
from autofit.simulate.accumulation import AccumulationWatch
from autofit.simulate.probe import KernelProber, real_kernel_accepts
from autofit.simulate.timeline import OpRecord, Phase, StorageRecord, Timeline
from autofit.parallel.simulated import gloo_staging_bytes

if TYPE_CHECKING:
    from autofit.training.config import DeviceKind

__all__ = ["StepTracker"]

aten = torch.ops.aten
_DATA_DEPENDENT = DATA_DEPENDENT_ERRORS
_DEFAULT_CPU_STREAM = torch.cpu.current_stream()  # torch.cpu's default stream object, what no stream context sets

_PHASE_CATEGORY = {
    Phase.SETUP: Category.BUFFERS,
    Phase.FORWARD: Category.ACTIVATIONS,
    Phase.BACKWARD: Category.TEMPORARIES,
    Phase.OPTIMIZER: Category.TEMPORARIES,
}


class StepTracker(TorchDispatchMode):
    """Records allocations, frees, per-op workspace and FLOPs of whatever runs inside it."""

    def __init__(self, *, prober: KernelProber | None = None, count_flops: bool = True,
                 kernels_for: DeviceKind | None = None) -> None:
        super().__init__()
        # the target whose step runs on this CPU's kernels ("cpu"; "cuda" for a real run of a GPU-target step), or
        # None: ops oneDNN has no kernel for at their precision then raise before they run (Note [CPU kernels])
        self.kernels_for = kernels_for
        self.timeline = Timeline()
        self.phase = Phase.SETUP
        self.module_stack: list[str] = []
        self.prober = prober
        self.count_flops = count_flops
        self.autocast_device: str | None = None  # set while forward runs under autocast
        self.op_listeners: list = []  # called with each new op's index (the analysis attributes backward ops)
        self.op_first_event = 0  # index of the first event of the op being recorded
        # id(storage object) -> (weak reference, storage id); the weak reference guards against id reuse
        self._known: dict[int, tuple[weakref.ref, int]] = {}
        self._parameter_sids: set[int] = set()
        self._external: dict[int, weakref.ref] = {}  # storages that existed before tracking, not counted
        self.accumulation = AccumulationWatch(self.timeline)  # see Note [engine accumulation]
        self.unregistered_corrections: set[str] = set()  # ops the probe corrected that corrections.py does not list
        # while True, new storages are host memory, not the device's (Note [host storages]); simulate/offload.py
        # sets it around what runs on the host: save_on_cpu's packing, the CPU-offloaded optimizer step
        self.on_host = False
        # id(stream object) -> (its number, the object, kept alive so its id is not reused)
        self._streams: dict[int, tuple[int, object]] = {}

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """torch.compile compiles under the tracker, which sees the compiled code run, not its tracing (Note
        [inductor without kernels], autofit/core/_torch_compile.py)."""
        return True

    # ---- bookkeeping -------------------------------------------------------------------------------------------
    @property
    def module(self) -> str:
        return self.module_stack[-1] if self.module_stack else ""

    def sid_of(self, t: torch.Tensor) -> int | None:
        st = _local(t).untyped_storage()
        entry = self._known.get(id(st))
        if entry is not None and entry[0]() is st:
            return entry[1]
        return None

    def register(self, t: torch.Tensor, category: Category, *, host: bool = False) -> int | None:
        """Count a tensor that exists before the step (parameters, buffers, state, inputs). Returns its storage id.
        ``host``: it lives in host memory (Note [host storages]). A wrapper subclass without a storage of its own
        (torchao's low-bit optimizer state) is counted by its inner tensors; the id returned is the first's."""
        inner = storage_tensors(_local(t))
        if len(inner) != 1 or inner[0] is not _local(t):
            sids = [self.register(x, category, host=host) for x in inner]
            return next((sid for sid in sids if sid is not None), None)
        t = _local(t)
        sid = self.sid_of(t)
        if sid is not None or t.untyped_storage().nbytes() == 0:
            return sid
        sid = self._track(t.untyped_storage(), category, op=-1, host=host)
        if category is Category.PARAMETERS:
            self._parameter_sids.add(sid)
        return sid

    def recategorize(self, t: torch.Tensor, category: Category) -> None:
        sid = self.sid_of(t)
        if sid is not None:
            self.timeline.storages[sid].category = category

    def move_to_host(self, t: torch.Tensor) -> None:
        """``t``'s storage was copied to host memory and its device memory freed (Note [host storages])."""
        sid = self.sid_of(t)
        if sid is not None:
            self.timeline.move_to_host(sid)

    def _track(self, st, category: Category, op: int, nbytes: int | None = None, host: bool = False) -> int:
        size = st.nbytes() if nbytes is None else max(nbytes, 0)
        record = StorageRecord(size, category, op, self.module, self.phase, self._stream())
        sid = self.timeline.new_storage(record, host=host or self.on_host)
        timeline = self.timeline
        known = self._known
        key = id(st)

        def on_free(_ref, sid=sid, key=key) -> None:
            timeline.free(sid)
            entry = known.get(key)
            if entry is not None and entry[1] == sid:
                del known[key]

        self._known[key] = (weakref.ref(st, on_free), sid)
        return sid

    def _stream(self) -> int:
        """The current stream as a small number, 0 the default: FSDP2's CPU path enters ``torch.cpu.stream`` where
        its CUDA path enters its own streams (Note [one pool per stream], autofit/cuda/allocator.py)."""
        current = torch.cpu.current_stream()
        if current is _DEFAULT_CPU_STREAM:
            return 0
        return self._streams.setdefault(id(current), (len(self._streams) + 1, current))[0]

    def resized(self, st, new_bytes: int) -> None:
        """A storage's memory was replaced in place (``UntypedStorage.resize_``: FSDP2 frees and re-allocates its
        unsharded parameters this way): the old allocation ends and, if the new size is not 0, a new one starts."""
        entry = self._known.get(id(st))
        if entry is not None and entry[0]() is st:
            self.timeline.free(entry[1])
            del self._known[id(st)]
            if new_bytes > 0:
                self._track(st, _PHASE_CATEGORY[self.phase], op=len(self.timeline.ops), nbytes=new_bytes)
        elif new_bytes > 0 and not self._is_known_or_external(st):
            self._track(st, _PHASE_CATEGORY[self.phase], op=len(self.timeline.ops), nbytes=new_bytes)

    def _is_known_or_external(self, st) -> bool:
        entry = self._known.get(id(st))
        if entry is not None and entry[0]() is st:
            return True
        ref = self._external.get(id(st))
        return ref is not None and ref() is st

    def __enter__(self):
        # UntypedStorage.resize_ is not an op the mode sees; wrap it for as long as the tracker is active
        # (PyTorch's MemTracker does the same, see torch/distributed/_tools/mem_tracker.py, _track_resize).
        tracker = self

        def tracked(original):
            def resize_(storage, size):
                result = original(storage, size)
                tracker.resized(storage, int(size))
                return result
            return resize_

        self._resize_patch = patch(torch.UntypedStorage, "resize_", tracked)
        self.resize_patch = self._resize_patch.__enter__()
        self._kernels = hearing_skipped_kernels(self._fused_kernel) if self.count_flops else contextlib.nullcontext()
        self._kernels.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self.accumulation.settle()
        self.timeline.closed = True  # Note [a closed timeline]
        self._kernels.__exit__(None, None, None)
        self._resize_patch.__exit__(None, None, None)
        return super().__exit__(*exc)

    # Note [fused kernels in the time model]
    #     A compiled step's element-wise work runs in inductor's fused kernels, which the simulation skips (Note
    #     [inductor without kernels], autofit/core/_torch_compile.py): no aten op of theirs passes through this mode,
    #     so without a record their time was nothing, and a compiled plan was priced as its matmuls alone (torchao's
    #     float8 casts among the free work). Each skipped kernel is recorded as one op, ``inductor_kernel``, that
    #     reads its const pointer arguments and writes the others once each (inductor's argument types): the
    #     roofline of a fused kernel, memory-bound, no FLOPs, one launch. The GPU's Triton kernels fuse by the same
    #     scheduler, so the CPU lowering's kernels stand in for them. Memory is untouched: the record has no
    #     workspace and creates no storage.
    def _fused_kernel(self, read: list[torch.Tensor], written: list[torch.Tensor]) -> None:
        record = OpRecord("inductor_kernel", self.module, self.phase)
        record.io_bytes, record.dtype = _traffic(read, written)
        self.timeline.new_op(record)

    # Note [a closed timeline]
    #     A storage's free is recorded by a weak-reference callback, which fires whenever the storage dies: also after
    #     the simulation has returned, when its fake model copy is dropped (at once, or whenever the cycle collector
    #     gets to it). The timeline the simulation returned then grew frees at its end, in one of the analysis' two
    #     runs (the one made in this process) and not in the other (made in a worker, whose timeline was pickled
    #     first), so the two no longer aligned and the profile fell back to its inexact lines: the memory model of
    #     FSDP2 reducing every micro-batch priced steps 1.5 to 2.9 % low after a few other estimates in the same
    #     process (tests/test_profile_alignment.py). The timeline is closed when the tracker exits: what dies after the
    #     step is not the step.

    # ---- the mode ------------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "prim":  # metadata queries (prim.device): no memory, nothing to record
            return func(*args, **kwargs)
        interruption_point()  # a Ctrl-C is raised here, between two ops (Note [Ctrl-C at safe points])
        epoch = self.accumulation.before_op()
        inputs = [_local(x) for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        distributed = any(x is not y for x, y in zip(inputs, (t for t in pytree.tree_leaves((args, kwargs))
                                                              if isinstance(t, torch.Tensor))))
        for t in inputs:
            # A storage made before tracking and never registered (a global constant, a tensor nested in a
            # module attribute) is not part of the step; views of it must not look like allocations.
            st = t.untyped_storage()
            if not self._is_known_or_external(st):
                self._external[id(st)] = weakref.ref(st)
        seen_through = _computing_subclass(inputs)
        if seen_through is not None:  # Note [subclasses that compute in plain ops]
            with _pushed(self):
                return seen_through.__torch_dispatch__(func, types, args, kwargs)
        if self.kernels_for is not None:
            require_kernel(func, inputs, self.module or None, planned_for_host=self.kernels_for.is_host)
        replacement = fake_kernel(func, args, kwargs)  # a fake kernel stricter than the CPU's (corrections.py)
        try:
            out = replacement(*args, **kwargs) if replacement is not None else func(*args, **kwargs)
        except Exception as e:
            if (_is_fake(args) and not isinstance(e, _DATA_DEPENDENT) and func.namespace == "aten"
                    and real_kernel_accepts(func, args, kwargs)):
                raise FakeKernelStricter(str(func), e) from e  # no correction possible: run for real
            raise
        # DTensor ops (FSDP2's sharded optimizer step) run their local kernels below this mode: no probe
        probe = self.prober.probe(func, args, kwargs) if self.prober is not None and not distributed else None
        real_bytes: dict[int, int] = {}
        if probe is not None and _is_fake(out):
            # a real run (Note [data-dependent models]) already has the CPU kernel's outputs, with their values:
            # replacing them by the probe's (run on dummy values) would corrupt value-dependent ops such as nonzero
            matched, real_bytes = _match_real_outputs(out, probe.outputs)
            if (matched is not out or real_bytes) and registered(func) is None and not op_schema(func).is_mutable:
                self.unregistered_corrections.add(str(func))
            out = matched
        record = OpRecord(str(func.overloadpacket.__name__), self.module, self.phase,
                          workspace=probe.workspace if probe is not None else 0)
        if self.kernels_for is not None and self.kernels_for.is_host:  # on gloo: Note [gloo's staging copies]
            record.workspace += gloo_staging_bytes(func, args)
        if self.count_flops and func.overloadpacket in flop_registry:
            try:
                record.flops = int(flop_registry[func.overloadpacket](*args, **kwargs, out_val=out))
            except Exception:  # noqa: BLE001 - a FLOP formula that cannot read these args counts nothing
                record.flops = 0
        if self.count_flops:
            record.io_bytes, record.dtype = _traffic(inputs, out)
        category = self._category_for(func, inputs)
        op_index = len(self.timeline.ops)
        self.op_first_event = len(self.timeline.events)
        for t in (x for leaf in pytree.tree_leaves(out) if isinstance(leaf, torch.Tensor)
                  for x in storage_tensors(_local(leaf))):
            st = t.untyped_storage()
            # a tensor on the meta device holds no memory (a shape handed to torch: a pipeline stage's)
            if not self._is_known_or_external(st) and st.nbytes() > 0 and t.device.type != "meta":
                sid = self._track(st, category, op_index, nbytes=max(real_bytes.get(id(t), 0), st.nbytes()))
                self.accumulation.created(sid, epoch)
        self.timeline.new_op(record)
        if self.phase is Phase.BACKWARD and not kwargs:
            self.accumulation.after_op(func, args, out, epoch, self.sid_of, self.op_first_event)
        for listener in self.op_listeners:
            listener(op_index)
        return out

    def _category_for(self, func, inputs: list[torch.Tensor]) -> Category:
        if (
            self.phase is Phase.FORWARD
            and self.autocast_device is not None
            and func is aten._to_copy.default
            and inputs
            and self.sid_of(inputs[0]) in self._parameter_sids
        ):
            # autocast casts a weight once per autocast region and caches the copy until the region exits
            return Category.AUTOCAST_CACHE
        return _PHASE_CATEGORY[self.phase]


# Note [subclasses that compute in plain ops]
#     A wrapper tensor subclass whose ``__torch_dispatch__`` computes its op in plain aten ops on its inner tensors
#     (torchao's ``Float8TrainingTensor``: ``mm`` becomes ``_scaled_mm`` on the fp8 data and scales, with the
#     transposes and contiguous copies the kernel needs) would run those ops below this mode, which the mode stack
#     pops while it handles an op: their temporaries and the ``_scaled_mm`` kernel's own scratch (the CPU kernel
#     copies a transposed operand) would go unseen, and its FLOPs unpriced. The tracker calls such a subclass's
#     dispatch itself with the mode pushed again, so each inner op passes through it as in a plain step (and is
#     probed, counted and priced in its own dtype). The subclasses are named by the step features whose modules
#     make them (``Feature.seen_through``), by module and class, looked up only where their library is already
#     imported (no library is imported for the check).
_SEEN_THROUGH = tuple(kind for feature in FEATURES for kind in feature.seen_through)


def _computing_subclass(inputs: list[torch.Tensor]) -> type | None:
    """The subclass of Note [subclasses that compute in plain ops] among the op's tensor arguments, or None."""
    kinds = tuple(kind for kind in (getattr(sys.modules.get(module), name, None) for module, name in _SEEN_THROUGH)
                  if kind is not None)
    if not kinds:
        return None
    return next((type(x) for x in inputs if isinstance(x, kinds)), None)


@contextlib.contextmanager
def _pushed(mode: TorchDispatchMode) -> Iterator[None]:
    """``mode`` on the dispatch-mode stack again, inside its own ``__torch_dispatch__`` (which popped it)."""
    TorchDispatchMode.__enter__(mode)
    try:
        yield
    finally:
        TorchDispatchMode.__exit__(mode, None, None, None)


def _is_fake(out: Any) -> bool:
    return any(isinstance(t, FakeTensor) for t in pytree.tree_leaves(out))


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (what this rank stores); any other tensor itself."""
    local = dtensor_local(t)
    return local if isinstance(local, torch.Tensor) else t


def _traffic(inputs: list[torch.Tensor], out: Any) -> tuple[int, str]:
    """Bytes an op reads and writes (each tensor's own elements) and the floating dtype it computes in."""
    tensors = inputs + [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    total = sum(t.nelement() * t.element_size() for t in tensors)
    dtype = next((t.dtype for t in tensors if t.is_floating_point()), None)
    return total, str(dtype).removeprefix("torch.") if dtype is not None else ""


def _match_real_outputs(out: Any, real: tuple) -> tuple[Any, dict[int, int]]:
    """Make the fake outputs look like the CPU kernel's (see simulate/probe.py): replace outputs whose shape or
    dtype differ, split outputs the fake kernel aliased but the CPU kernel returns apart, and report storages the
    CPU kernel made larger than the shape needs (id(tensor) -> bytes)."""
    leaves, spec = pytree.tree_flatten(out)
    if len(leaves) != len(real):
        return out, {}
    changed, sizes = False, {}
    fake_first: dict[int, int] = {}
    for i, (leaf, r) in enumerate(zip(leaves, real)):
        if not isinstance(leaf, torch.Tensor) or r is None:
            continue
        st = leaf.untyped_storage()
        fake_alias = fake_first.setdefault(id(st), i) if st.nbytes() else i
        split = fake_alias != i and r.alias_of is None
        if split or tuple(leaf.shape) != r.shape or leaf.dtype != r.dtype:
            leaves[i] = torch.empty_strided(r.shape, r.stride, dtype=r.dtype, device=leaf.device)
            changed = True
        if r.alias_of is None and r.storage_bytes > leaves[i].untyped_storage().nbytes():
            sizes[id(leaves[i])] = r.storage_bytes
    return (pytree.tree_unflatten(leaves, spec) if changed else out), sizes
