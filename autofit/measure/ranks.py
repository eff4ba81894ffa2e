"""Measure one step laid out over several processes: ``world_size`` processes on this CPU, joined by gloo, each
running :func:`~autofit.measure.allocator.measure_step` with the layout applied for real (DDP, FSDP2, HSDP, tensor
parallel composed with FSDP2), each measured by its own CPU allocator.

This is the truth the simulation of one rank is checked against (tests/test_measure_layouts.py): the same step,
the same layout code (parallel/apply.py), torch's own collectives instead of the fake process group. Every
rank trains the same rows (the sample at the micro-batch size), as a data-parallel rank's slice would be shaped.

Note [gloo's threads in the measured window]
    gloo runs collectives on its own threads, and they allocate (a collective's staging buffers, an all-reduce's
    copy of its tensor) while the step is profiled. A GPU job's NCCL keeps its buffers outside the caching
    allocator, and the simulation, which models that job, has none of them. Whether gloo's buffer is counted in the
    CPU profile's high-water mark is a race: the rank's thread resumes when the collective completes, and gloo's
    thread frees its buffer after signalling that, so on a loaded machine the rank allocates its next tensors first
    (a CI run counted 32,768 B more than an idle one in every window of a tensor-parallel rank, the size of the
    activation its all-reduces carry).
    So each rank counts only the memory of its own thread (the step's: on the CPU, autograd runs backward on the thread
    that calls it), marked by a ``record_function`` around the window, and keeps the lowest of three windows. A thread's
    memory is what it allocates and frees, and the frees of its allocations on other threads
    (``core._torch_profiler.thread_memory`` matches a free to its allocation by address): gloo's worker sometimes frees
    a tensor of the rank's, and counted by thread that free was lost (a CI run measured a tensor-parallel rank 32,768 B
    high in its first window and 12 x 32,768 B high in the next two, one all-reduce's tensor per all-reduce of the
    step). Such a free is placed at the end of the rank thread's last collective wait before it
    (``core._torch_profiler._freed_at_completion``): gloo signals the collective complete and only then drops the work
    holding the rank's tensor, so under load the rank had allocated its next tensors first (a CI run measured a
    tensor-parallel rank 32,768 B high in all three windows); the wait's end is when the step let go of it. Kernels that
    allocate inside their intra-op worker threads would be left out too; none of the layouts tested does (their figures
    equal the estimate to the byte).
"""

from __future__ import annotations

import pickle
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from autofit.core.errors import InvalidInputError, UnsupportedModelError
from autofit.core.report import Measurement
from autofit.features import FEATURES
from autofit.measure.allocator import measure_step
from autofit.parallel.processes import measured_processes
from autofit.training.batch import Batch, naming_inputs
from autofit.training.loss import LossFn
from autofit.training.step import StepConfig, forward_errors

__all__ = ["measure_laid_out", "measure_ranks"]

_TIMEOUT_SECONDS = 1800  # a hung collective ends the measurement instead of the caller's process


def measure_laid_out(model, batch: Batch, target: Batch | None, loss_fn: LossFn | None, config: StepConfig, *,
                     steps: int) -> Measurement:
    """``measure``'s step in the processes its layout runs in (:func:`~autofit.parallel.processes.measured_processes`):
    one (:func:`~autofit.measure.allocator.measure_step`), or one per rank (:func:`measure_ranks`); a typed error for
    the layouts this CPU cannot run."""
    def one_process() -> Measurement:
        # on the CPU, a precision its oneDNN has no kernel for fails inside the step (Note [CPU kernels])
        with naming_inputs(lambda: batch), forward_errors(config.precision if config.device.is_host else None):
            return measure_step(model, batch, target, loss_fn, config, steps=steps)

    return measured_processes(config.layout, one_process, lambda ranks: measure_ranks(
        model, batch, target, loss_fn, config, steps=steps, ranks=ranks))


def measure_ranks(model, batch: Batch, target: Batch | None, loss_fn: LossFn | None, config: StepConfig, *,
                  steps: int, ranks: int) -> Measurement:
    """Rank 0's measurement (the rank an estimate simulates) with every rank's peak in ``rank_peaks``: the step run
    by ``ranks`` processes on this CPU, joined by gloo."""
    for feature in FEATURES:  # what a step feature cannot run over gloo (Float8's all-gather)
        why = feature.gloo_refusal(config) if config.device.is_host else None
        if why is not None:
            raise InvalidInputError(f"measure: {why}")
    if not config.device.is_host:
        raise InvalidInputError(
            f"measure with world_size={ranks} runs the ranks as processes on this CPU (gloo); on "
            "GPUs run plan.wrap() under torchrun and read torch.cuda.max_memory_allocated() on each rank"
        )
    if config.optimizer_in_backward or config.preallocated_grads or config.precision.stored not in (None, "fp32"):
        raise InvalidInputError(
            "optimizer_in_backward, preallocated_grads and a stored precision are for one process only (DDP's buckets "
            "and FSDP2's shards own the gradients and parameters): measure them with world_size=1"
        )
    payload = (model, batch, target, loss_fn, config, max(steps, 3))
    try:
        data = pickle.dumps(payload)
    except Exception as e:  # a lambda loss, a local class: spawn cannot hand them to the ranks
        raise InvalidInputError(
            f"measure with world_size={ranks} runs each rank in a new process, which receives the "
            f"model, sample and loss_fn pickled, and they do not pickle ({type(e).__name__}: {e}): define the model "
            "class and loss function at module level (not a lambda or a local function)"
        ) from e
    with tempfile.TemporaryDirectory(prefix="autofit-ranks-") as out:
        (Path(out) / "payload.pkl").write_bytes(data)
        context = mp.start_processes(_rank_main, args=(ranks, out), nprocs=ranks, join=False,
                                     start_method="spawn")
        deadline = time.monotonic() + _TIMEOUT_SECONDS
        while not _joined(context):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise UnsupportedModelError(f"the {ranks} ranks did not finish within "
                                            f"{_TIMEOUT_SECONDS} s (a collective waiting on a rank that failed?)")
        results = [pickle.loads((Path(out) / f"rank{r}.pkl").read_bytes()) for r in range(ranks)]
    for rank, result in enumerate(results):
        if isinstance(result, str):  # the rank's traceback
            raise UnsupportedModelError(f"rank {rank} of the measured layout failed:\n{result}")
    peak, breakdown, device = results[0]
    return Measurement(peak, breakdown, device=device, rank_peaks=tuple(r[0] for r in results))


def _joined(context) -> bool:
    """Whether every rank has ended (waiting up to 2 s); a rank that died outside its own error handling (killed,
    out of memory) is a typed error, not torch's ProcessRaisedException."""
    try:
        return context.join(timeout=2)
    except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:  # their base is not exported by torch
        raise UnsupportedModelError(f"a rank of the measured layout ended abnormally: {e}") from e


def _rank_main(rank: int, world_size: int, out: str) -> None:
    # The ranks meet in a file of the job's own folder, not on a TCP port: a port found free and handed to the ranks
    # can be taken before rank 0 listens on it (gloo's connections of other jobs take ephemeral ports; a run with
    # two test workers failed with EADDRINUSE). A rank that fails leaves the others waiting in a collective: gloo
    # gives up after the timeout.
    store = dist.FileStore(str(Path(out) / "rendezvous"), world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    result: tuple | str
    try:
        model, batch, target, loss_fn, config, steps = pickle.loads((Path(out) / "payload.pkl").read_bytes())
        m = measure_step(model, batch, target, loss_fn, config, steps=steps, lowest=True)
        result = (m.peak_bytes, dict(m.breakdown), m.device)  # plain values: a Measurement's breakdown is read-only
    except Exception:
        result = traceback.format_exc()
    finally:
        dist.destroy_process_group()
    (Path(out) / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
