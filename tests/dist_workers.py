"""Worker processes for tests/test_distributed.py (forked from a fork server; importable by module name)."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils._python_dispatch

import autofit
from autofit.core._torch import ddp_bucket_bytes
from autofit.training.batch import as_batch
from autofit.measure.allocator import measure_callable
from sharded_models import EXTRA_CASES
from zoo import ZOO


# Note [ranks from a fork server]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A spawned rank starts a fresh interpreter and imports torch, autofit and this module (about 3 CPU seconds on two
# cores), and the gloo tests start about 66 ranks (test_layouts.py's 18: 164 CPU seconds spawned, 137 forked). A
# fork server imports them once per test process (its ``preload``) and forks each rank from there: the rank then runs
# ``run_jobs`` as a spawned one would, in a process that has run no torch op (so no OpenMP pool crosses the fork,
# Note [parallel simulations] in autofit/core/workers.py) and holds no process group. What a rank inherits from the
# server rather than from the test: the environment and sys.path when the server started (no test here changes
# either before a launch). The ranks are the server's children, so conftest's CPU figures leave them out.
def launch(jobs: list[dict], tmp_path: Path, world: int) -> list[list[dict]]:
    """Spawn ``world`` processes running :func:`run_jobs`; each rank's results, or a test failure (not a hang) after
    a timeout."""
    import pytest

    # Note [ranks from a fork server]; the tiny Llama's ranks build it with transformers (skipped where it is missing)
    mp.set_forkserver_preload([__name__, "transformers.models.llama.modeling_llama"])
    # a file of its own for each launch: a test may launch twice into one folder, and a launch whose rank failed
    # leaves its file behind (the last rank to close the store removes it)
    rendezvous = os.path.join(tempfile.mkdtemp(prefix="rendezvous-", dir=tmp_path), "store")
    context = mp.start_processes(run_jobs, args=(world, rendezvous, jobs, str(tmp_path)), nprocs=world, join=False,
                                 start_method="forkserver")
    deadline = time.monotonic() + 600
    # join() returns False while some workers still run (it raises if one failed): wait for all, up to the deadline
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail("distributed workers timed out")
    return [json.loads((Path(tmp_path) / f"rank{r}.json").read_text()) for r in range(world)]


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)


def _build(case_name: str, plan: autofit.Plan, optimizer: str, eval_mode: bool = False):
    torch.manual_seed(0)
    case = ZOO[case_name]() if case_name in ZOO else EXTRA_CASES[case_name]()
    if eval_mode:
        case.model.eval()  # dropout off: the reference step must see the same forward
    if optimizer == "sgd":
        factory = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    else:
        factory = lambda params: torch.optim.AdamW(params, lr=1e-3)  # noqa: E731
    opt = factory if plan.parallel.strategy == "fsdp2" else factory(case.model.parameters())
    return case, plan.wrap(case.model, opt, loss_fn=case.loss_fn)


def _global_batch(case, size: int):
    batch = as_batch(case.sample).resize(size)
    target = None if case.target is None else as_batch(case.target, what="target").resize(size)
    return batch, target


def pad_target(target: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    padded = target.clone()
    for row, n in enumerate(lengths):
        padded[row, n:] = -100
    return padded


class _Collectives(torch.utils._python_dispatch.TorchDispatchMode):
    """The functional collectives called on this rank (DTensor's redistributions, in forward and in backward), in
    bytes of all-reduce: an all-reduce its buffer, an all-gather half its output, a reduce-scatter half its input
    (a ring all-gather or reduce-scatter moves (N - 1) / N of the whole per rank, an all-reduce twice that)."""

    def __init__(self):
        super().__init__()
        self.moved, self.calls = 0.0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        namespace, _, op = func._schema.name.partition("::")
        if namespace == "_c10d_functional" and op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
            whole = (out if op == "all_gather_into_tensor" else args[0])
            nbytes = whole.numel() * whole.element_size()
            self.moved += nbytes if op == "all_reduce" else nbytes / 2
            self.calls[op] = self.calls.get(op, 0) + 1
        return out


def run_jobs(rank: int, world_size: int, rendezvous: str, jobs: list[dict], out_dir: str) -> None:
    # the ranks meet in a file (launch): a free port handed to them can be taken before rank 0 listens on it
    dist.init_process_group("gloo", store=dist.FileStore(rendezvous, world_size), rank=rank, world_size=world_size)
    results = []
    try:
        for job in jobs:
            plan = autofit.Plan.from_json(job["plan"])
            case, trainer = _build(job["case"], plan, job["optimizer"], job["kind"] in ("equivalence", "lengths"))
            batch, target = _global_batch(case, plan.batch_size)
            if job.get("pad_lengths"):  # a token-mean loss: -100 after each row's length (ranks hold unequal counts)
                target = as_batch(pad_target(target.value, job["pad_lengths"]), what="target")
            if job["kind"] == "lengths":  # ranks hold batches of different lengths (Note [rows by length])
                rows = plan.batch_size // world_size
                length = job["lengths"][rank]
                ids = batch.value[rank * rows:(rank + 1) * rows, :length].clone()
                labels = target.value[rank * rows:(rank + 1) * rows, :length].clone()
                trainer.step(ids, labels, local=True)
                params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().tolist()
                          for n, p in getattr(trainer.model, "module", trainer.model).named_parameters()}
                results.append({"params": params, "micro_batches": trainer.micro_batches})
            elif job["kind"] == "odd length":  # a batch the plan refuses: the error's words
                try:
                    trainer.step({k: v[:, :job["length"]] for k, v in batch.value.items()})
                    results.append({"refused": ""})
                except autofit.InvalidInputError as e:
                    results.append({"refused": str(e)})
            elif job["kind"] == "collectives":  # one forward and backward, the collectives torch runs counted
                with _Collectives() as counted:
                    batch.call(trainer.model).loss.backward()
                results.append({"moved": counted.moved, "calls": counted.calls})
            elif job["kind"] == "equivalence":
                trainer.step(batch.value, None if target is None else target.value)
                params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().tolist()
                          for n, p in getattr(trainer.model, "module", trainer.model).named_parameters()}
                results.append({"params": params})
            else:  # memory: each rank trains on its own slice (local=True), as with a DistributedSampler
                # with tensor parallel the ranks of a group share their slice: the data-parallel rank and count
                shape = plan.parallel.layout
                data_rank, data_ranks = shape.data_rank(trainer.rank), shape.data_ranks
                rows = plan.batch_size // data_ranks
                mine = batch.slice(data_rank * rows, (data_rank + 1) * rows).map_tensors(lambda t: t.clone())
                mine_target = None if target is None else target.slice(
                    data_rank * rows, (data_rank + 1) * rows).map_tensors(lambda t: t.clone())
                args = (mine.value, None if mine_target is None else mine_target.value)
                trainer.step(*args, local=True)  # optimizer state exists from here on
                trainer.step(*args, local=True)  # DDP rebuilds its buckets after its first iteration
                # DDP's gradient buckets outlive every step (gradient_as_bucket_view) but no tensor we hold points
                # at them once zero_grad(set_to_none=True) has run: count their bytes, sized by the reducer itself
                resident = 0
                if plan.parallel.strategy == "ddp":
                    resident = ddp_bucket_bytes(trainer.model)
                peaks = []
                for _ in range(job.get("repeats", 3)):
                    live = [_local(p) for p in trainer.model.parameters()] + list(trainer.model.buffers())
                    live += mine.tensors() + (mine_target.tensors() if mine_target is not None else [])
                    live += [_local(v) for s in trainer.optimizer.state.values() for v in s.values()
                             if isinstance(v, torch.Tensor)]
                    # this thread's allocations only: gloo's threads race with it (Note [gloo's threads in the
                    # measured window], autofit/measure/ranks.py)
                    peaks.append(resident + measure_callable(lambda: trainer.step(*args, local=True), live,
                                                             own_thread=True))
                results.append({"peaks": peaks})
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        dist.destroy_process_group()


def check_peaks(ranks: list[list[dict]], memory: autofit.Plan, label: str = "") -> None:
    """Every rank's measured peak of the first job (a "memory" job; the lowest of its three steady-state steps: gloo's
    worker threads occasionally allocate inside the profiling window) within 0.5 % of the plan's per-rank peak."""
    for rank, results in enumerate(ranks):
        measured = min(results[0]["peaks"])
        print(f"{memory.layout}{label}, rank {rank}: predicted {memory.peak_bytes} measured {measured} "
              f"({(memory.peak_bytes - measured) / measured:+.3%})")
        assert abs(memory.peak_bytes - measured) <= 0.005 * measured, (
            f"{memory.layout} rank {rank}: predicted {memory.peak_bytes}, measured {results[0]['peaks']}")


def check_memory_and_equivalence(ranks: list[list[dict]], memory: autofit.Plan, equivalence: autofit.Plan,
                                 reference, label: str = "") -> None:
    """What a ("memory", "equivalence") pair of jobs must show on every rank: ``check_peaks``, and the parameters
    after one SGD step equal to a single-process full-batch step of ``reference`` (a fresh case, the same seed)."""
    check_peaks(ranks, memory, label)
    model = reference.model.eval()
    batch = as_batch(reference.sample).resize(equivalence.batch_size)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch.call(model).loss.backward()
    optimizer.step()
    for name, p in model.named_parameters():
        for rank, results in enumerate(ranks):
            got = torch.tensor(results[1]["params"][name], dtype=p.dtype)
            torch.testing.assert_close(got, p.detach(), rtol=1e-5, atol=1e-6,
                                       msg=f"{equivalence.layout} rank {rank}: {name}")
