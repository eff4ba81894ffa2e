"""autofit/core/_torch.py, the torch boundary (with its siblings _torch_*.py, the only modules that read private torch
symbols): missing pieces fail with a typed error that names them, process-wide patches are restored, serialised and
counted, and the profiler primitives (autofit/core/_torch_profiler.py) read the allocator's record."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from autofit.core import _torch, _torch_profiler
from autofit.core.errors import AutofitError, UnsupportedTorchError


def test_a_missing_internal_names_itself_and_the_supported_range() -> None:
    with pytest.raises(UnsupportedTorchError) as info:
        _torch._need("torch._subclasses.fake_tensor", "NoSuchThing")
    message = str(info.value)
    assert "torch._subclasses.fake_tensor.NoSuchThing" in message
    assert _torch.SUPPORTED_TORCH in message and torch.__version__ in message
    with pytest.raises(UnsupportedTorchError, match="torch.no_such_module.X"):
        _torch._need("torch.no_such_module", "X")
    assert issubclass(UnsupportedTorchError, AutofitError) and issubclass(UnsupportedTorchError, ImportError)


def test_the_supported_range_is_the_one_pyproject_states() -> None:
    import pathlib

    import tomllib

    pyproject = tomllib.loads((pathlib.Path(__file__).parents[1] / "pyproject.toml").read_text())
    torch_requirement = next(d for d in pyproject["project"]["dependencies"] if d.startswith("torch"))
    assert torch_requirement == "torch" + _torch.SUPPORTED_TORCH


def test_patch_replaces_counts_and_restores() -> None:
    original = torch.get_rng_state
    with _torch.patch(torch, "get_rng_state", lambda orig: lambda: orig()[:4]) as p:
        assert torch.get_rng_state().numel() == 4
        torch.get_rng_state()
        assert p.hits == 2
        p.require_hit("it must be called")
    assert torch.get_rng_state is original


def test_patch_restores_after_an_exception() -> None:
    original = torch.UntypedStorage.resize_
    with pytest.raises(RuntimeError, match="boom"):
        with _torch.patch(torch.UntypedStorage, "resize_", lambda orig: orig):
            raise RuntimeError("boom")
    assert torch.UntypedStorage.resize_ is original


def test_a_patch_torch_never_called_is_reported() -> None:
    with _torch.patch(torch, "get_rng_state", lambda orig: orig) as p:
        pass
    with pytest.raises(UnsupportedTorchError, match=r"torch\.get_rng_state.*never called it"):
        p.require_hit("checkpointing stashes the RNG state")


def test_patches_from_two_threads_do_not_interleave() -> None:
    """The second thread's patch waits until the first is restored: otherwise each would restore the other's."""
    order: list[str] = []
    entered = threading.Event()

    def first() -> None:
        with _torch.patch(torch, "get_rng_state", lambda orig: orig):
            order.append("first in")
            entered.set()
            time.sleep(0.2)
            order.append("first out")

    def second() -> None:
        entered.wait()
        with _torch.patch(torch, "get_rng_state", lambda orig: orig):
            order.append("second in")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert order == ["first in", "first out", "second in"]


def test_allocation_sizes_read_the_allocator() -> None:
    """A 1 MiB tensor made and freed under the profiler: +1 MiB then -1 MiB (hand computation: 2**18 fp32)."""
    with _torch_profiler.memory_profile() as prof:
        t = torch.empty(2**18, dtype=torch.float32)
        del t
    sizes = _torch_profiler.allocation_sizes(prof)
    assert 2**20 in sizes and -(2**20) in sizes
    assert sizes.index(2**20) < sizes.index(-(2**20))


def test_one_threads_memory_counts_its_tensors_freed_on_another_thread() -> None:
    """Note [gloo's threads in the measured window], by hand: thread 1 (marked) allocates A (100 B) and B (50 B) and
    frees C (30 B, allocated before the window); thread 2 (gloo's) frees A (the last reference to a collective's
    tensor), allocates D (70 B) and frees it. Thread 1's memory: +100 +50 -30 -100 (A's free, on thread 2), nothing
    of D. Counted by thread alone, A's 100 B would never be freed: the window would end at 120, not 20."""
    a, b, c, d = 0xA0, 0xB0, 0xC0, 0xD0
    events = [(100, 1, a), (50, 1, b), (-30, 1, c), (-100, 2, a), (70, 2, d), (-70, 2, d)]
    assert _torch_profiler.thread_memory(events, {1}) == [100, 50, -30, -100]
    assert _torch_profiler.high_water_mark(_torch_profiler.thread_memory(events, {1})) == (150, 20)
    # an address thread 2 allocates again after A's free is thread 2's: its free on thread 2 does not count
    reused = [(100, 1, a), (-100, 2, a), (60, 2, a), (-60, 2, a)]
    assert _torch_profiler.thread_memory(reused, {1}) == [100, -100]


def test_a_free_the_profiler_did_not_record_is_put_at_the_collectives_completion() -> None:
    """Note [a free the profiler did not record] (core/_torch_profiler.py). Events are (time, size, thread, address).
    The rank (thread 1) allocates X (32 KiB, a collective's tensor) at 10 and waits until 20; the free of X is never
    recorded (gloo's worker dropped it on a thread the profiler does not follow); the rank allocates Y (32 KiB) at 30,
    waits until 40, and at 50 the allocator hands X's address out again (16 KiB). By hand the rank holds at most Y and
    the 16 KiB: 48 KiB, ending at 48 KiB. Counted as recorded, X never goes: 80 KiB. An address the rank freed itself
    and allocates again is no missing free."""
    kib = 1024
    x, y = 0xA0, 0xB0
    events = [(10, 32 * kib, 1, x), (30, 32 * kib, 1, y), (50, 16 * kib, 1, x)]
    moved = _torch_profiler._freed_at_completion(events, {1}, [20, 40])
    assert moved == [(10, 32 * kib, 1, x), (20, -32 * kib, _torch_profiler.UNRECORDED_THREAD, x),
                     (30, 32 * kib, 1, y), (50, 16 * kib, 1, x)]
    def peak(evs):
        return _torch_profiler.high_water_mark(
            _torch_profiler.thread_memory([(size, tid, ptr) for _, size, tid, ptr in evs], {1}))
    assert peak(moved) == (48 * kib, 48 * kib) and peak(events) == (80 * kib, 80 * kib)
    # no wait between the allocation and the reuse: freed just before the reuse
    assert _torch_profiler._freed_at_completion(events, {1}, [60])[2] == (
        50, -32 * kib, _torch_profiler.UNRECORDED_THREAD, x)
    # freed by the rank itself, then allocated again: nothing inferred
    recorded = [(10, 32 * kib, 1, x), (15, -32 * kib, 1, x), (50, 16 * kib, 1, x)]
    assert _torch_profiler._freed_at_completion(recorded, {1}, [20, 40]) == recorded


def test_one_threads_memory_in_a_real_profile() -> None:
    """The marked thread's 1 MiB made and freed inside its ``record_function``: +1 MiB, -1 MiB (2**18 fp32)."""
    with _torch_profiler.memory_profile() as prof:
        with torch.profiler.record_function("test::marked"):
            t = torch.empty(2**18, dtype=torch.float32)
            del t
    assert _torch_profiler.allocation_sizes(prof, "test::marked") == [2**20, -(2**20)]


def test_high_water_mark_by_hand() -> None:
    # +4 +6 (10) -4 (6) +8 (14) -6 (8): the running sum peaks at 14 and ends at 8
    assert _torch_profiler.high_water_mark([4, 6, -4, 8, -6]) == (14, 8)
    assert _torch_profiler.high_water_mark([]) == (0, 0)


def test_dispatch_helpers_agree_with_known_registrations() -> None:
    # aten::mm has a CPU autocast kernel (autocast_mode.cpp lists mm as lower_precision_fp); aten::relu has none
    assert _torch.has_dispatch_kernel("mm", "AutocastCPU")
    assert not _torch.has_dispatch_kernel("relu", "AutocastCPU")
    assert "mm" in _torch.all_aten_op_names()
