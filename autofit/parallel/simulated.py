"""One rank of a data-parallel step, simulated with PyTorch's own DDP / FSDP2 machinery where it can run.

- FSDP2 runs for real on the fake copy: ``fully_shard`` over a device mesh of a *fake* process group
  (``torch.testing._internal.distributed.fake_pg``, whose collectives return at once with the right shapes), so the
  sharded parameters, the all-gathered units and the reduce-scattered gradients are FSDP2's own allocations.
  The fake group needs no other process; it is the default group only while the simulation runs, so plan before
  ``init_process_group`` in a real job (the example does).
- DDP with ``gradient_as_bucket_view=True`` keeps every gradient inside its flat communication buckets for the whole
  run; each gradient backward produces is copied in and freed. That is exactly a micro-batch that starts with
  gradients already allocated, so the simulation gives each parameter a view into one flat bucket per dtype.
  With ``False`` the buckets are there as well, and the gradients live apart from them (See Note [DDP's bucket
  views]).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from autofit.core._torch import dtensor_shardings_of, dtensor_specs_once, fake_store
from autofit.core.errors import UnsupportedModelError
from autofit.parallel.layout import Parallel
from autofit.parallel.apply import device_mesh, gradient_sync

__all__ = ["fake_mesh", "simulated_mesh", "simulated_buckets", "simulated_sync", "ddp_buckets", "grads_into_buckets",
           "gloo_staging_bytes"]


@contextlib.contextmanager
def fake_mesh(layout: Parallel, rank: int = 0) -> Iterator[object]:
    """A CPU device mesh of ``layout`` over a fake process group of its ranks (this process is rank ``rank``), built
    as the real one is (parallel/apply.py, ``device_mesh``)."""
    if dist.is_initialized():
        raise UnsupportedModelError(
            "autofit simulates FSDP2 with a fake process group, which needs the default group to be free: "
            "call autofit.plan before torch.distributed.init_process_group (or in a separate process)"
        )
    # init_process_group wraps sys.excepthook to prefix every later traceback with "[rank0]" and
    # destroy_process_group leaves it (torch/distributed/distributed_c10d.py): a plan leaves the process as it was
    excepthook = sys.excepthook
    dist.init_process_group("fake", store=fake_store(), rank=rank, world_size=layout.world_size)
    # DTensor's cached shardings hold the meshes of the rank simulated before (Note [one process, several simulated
    # ranks], core/_torch.py): kept for another simulation of the same rank of the same mesh, whose fake groups are
    # made again under the same names, cleared for any other
    dtensor_shardings_of((layout.world_size, layout.layout.mesh_shape, layout.layout.mesh_names, rank))
    try:
        with dtensor_specs_once():  # Note [DTensor's tuple strategies in linear time], core/_torch.py
            yield device_mesh("cpu", layout)
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook


def simulated_mesh(layout: Parallel, rank: int = 0) -> contextlib.AbstractContextManager:
    """The mesh a simulated step of global rank ``rank`` lays its copy out on: a fake one where the layout shards
    (FSDP2 runs for real on the fake copy); none otherwise, DDP's buckets being modelled by the simulation itself
    (Note [DDP's bucket views]). The mesh holds real tensors: it is entered before the fake mode."""
    return fake_mesh(layout, rank) if layout.shards_parameters else contextlib.nullcontext()


def simulated_buckets(model: nn.Module, layout: Parallel, *, views: bool) -> list[torch.Tensor]:
    """DDP's communication buckets where the layout replicates (:func:`ddp_buckets`); none otherwise."""
    return ddp_buckets(model, views=views) if layout.replicates_parameters else []


def simulated_sync(model: nn.Module, layout: Parallel, *, last: bool) -> contextlib.AbstractContextManager:
    """The gradient sync of one simulated micro-batch: FSDP2's as on a real rank (``gradient_sync``); none for DDP,
    whose buckets the simulation models itself (Note [DDP's bucket views])."""
    return contextlib.nullcontext() if layout.replicates_parameters else gradient_sync(model, layout, last=last)


# Note [DDP's bucket views]
#     DistributedDataParallel's reducer allocates its communication buckets when it is built, flat buffers as large
#     as the trainable parameters' gradients together (per dtype), and keeps them as long as it lives (reducer.cpp,
#     ``Reducer::initialize_buckets``). With ``gradient_as_bucket_view=True`` every ``param.grad`` is a view into a
#     bucket: the gradients cost nothing beyond the buckets, and they exist from the first step to the last. With
#     ``False``, torch's default, autograd creates each gradient as in one process (and ``zero_grad`` frees it), and
#     the reducer copies it into its bucket to communicate and back after: one more gradient-sized copy at the
#     peak. Lightning's ``DDPStrategy``, Hugging Face's Trainer and Accelerate build DDP with the default unless
#     told; autofit's trainer sets True, its plans count that, and its exports set it where the framework can
#     (autofit/emit/export.py). ``estimate(strategy="ddp", gradient_as_bucket_view=...)`` takes either mode and
#     says which it assumed.
#     Under accumulation the bucket views do not hold from the start of a window: the micro-batches before the last
#     run under ``no_sync()``, where the reducer does nothing, so autograd creates the gradients apart from the
#     buckets (zero_grad(set_to_none=True) left them None) and they accumulate there; only the last micro-batch's
#     backward copies each gradient into its bucket as it is ready and points ``.grad`` at the bucket, freeing the
#     separate one (reducer.cpp, ``mark_variable_ready_dense``). So a window of k > 1 holds both copies from the
#     first backward until the last one (two gloo ranks of a tiny Llama at 2 x 4 rows measured 394,496 B, its
#     gradients, above the step with views from the start). The simulation does the same: the grads point at the
#     buckets from the start only for k = 1; for k = 2 they move in as each is accumulated in the last backward;
#     for k > 2 the simulated last micro-batch stands also for those in between, which run all of their backward
#     without moving any, so they move after its backward (the peak of a middle micro-batch, the larger).
def _trainable_by_dtype(model: nn.Module) -> list[list[nn.Parameter]]:
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in model.parameters():
        if p.requires_grad:
            by_dtype.setdefault(p.dtype, []).append(p)
    return list(by_dtype.values())


def _slices(model: nn.Module, buffers: list[torch.Tensor]) -> Iterator[tuple[nn.Parameter, torch.Tensor]]:
    """Each trainable parameter with its slice of the bucket of its dtype, shaped like it."""
    for params, flat in zip(_trainable_by_dtype(model), buffers):
        offset = 0
        for p in params:
            yield p, flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()


def ddp_buckets(model: nn.Module, *, views: bool = True) -> list[torch.Tensor]:
    """One flat buffer per dtype of the trainable parameters (DDP's buckets), every parameter's ``.grad`` pointed
    at its slice with ``views`` (``gradient_as_bucket_view=True``), left alone without (See Note [DDP's bucket
    views]). Returns the buffers, which must stay referenced while the step runs."""
    buffers = [torch.zeros(sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device)
               for params in _trainable_by_dtype(model)]
    if views:
        for p, view in _slices(model, buffers):
            p.grad = view
    return buffers


def _into_bucket(p: nn.Parameter, view: torch.Tensor) -> None:
    if p.grad is not None and p.grad is not view:
        view.copy_(p.grad)
        p.grad = view


def grads_into_buckets(model: nn.Module, buffers: list[torch.Tensor], *, as_ready: bool):
    """The reducer's last backward of a window with bucket views (See Note [DDP's bucket views]): with ``as_ready``
    a context in which each gradient moves into its bucket as soon as it is accumulated; without, a context that
    moves every gradient when it exits."""
    pairs = list(_slices(model, buffers))
    stack = contextlib.ExitStack()
    if as_ready:
        for p, view in pairs:
            handle = p.register_post_accumulate_grad_hook(lambda p, view=view: _into_bucket(p, view))
            stack.callback(handle.remove)
    else:
        stack.callback(lambda: [_into_bucket(p, view) for p, view in pairs])
    return stack


# Note [gloo's staging copies]
#     A CPU job's collectives run on gloo, and two of them copy on the calling thread, what the CPU allocator of a
#     rank counts: all_gather_into_tensor (``c10d::_allgather_base_``) gathers into a new flat tensor the size of its
#     output and copies it out, and reduce_scatter_tensor (``c10d::_reduce_scatter_base_``) clones its whole input
#     (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp; seen in the profile below, not read in that file). Each copy is freed before the rank's next allocation, so it is a
#     transient of the op, like a kernel's scratch (Note [peak inside a kernel], simulate/timeline.py). Measured on
#     two gloo ranks of FSDP2 ZeRO-3 (benchmarks/llama.py's Llama, hidden 64, 2 layers, profiler allocation events of
#     rank 0): ``aten::empty`` of 147,968 B inside ``c10d::_allgather_base_`` (a layer's gathered parameters) and an
#     ``aten::clone`` of 147,968 B inside ``c10d::_reduce_scatter_base_`` (its unsharded gradients), each freed by
#     the next event. The backward prefetch of layers.0 holds its gathered parameters, gloo's copy of them and
#     layers.1's at once: that was the rank's peak, 1,896,444 B, which the simulation without the copy put at
#     1,846,780 B (-2.6 %, tests/test_measure_layouts.py). NCCL, what a GPU job runs, writes into the output in place
#     and keeps its buffers outside the caching allocator: a CUDA target gets none of this.
_GLOO_STAGED = {"_allgather_base_": 0, "_reduce_scatter_base_": 1}  # op -> the argument gloo copies whole


def gloo_staging_bytes(func, args) -> int:
    """Bytes gloo copies on the calling thread for the c10d op ``func`` (Note [gloo's staging copies]); 0 for any
    other op."""
    if func.namespace != "c10d":
        return 0
    position = _GLOO_STAGED.get(func.overloadpacket.__name__)
    if position is None or len(args) <= position or not isinstance(args[position], torch.Tensor):
        return 0
    staged = args[position]
    return staged.numel() * staged.element_size()
