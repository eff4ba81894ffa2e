"""The ranks of a probe (``pipeline_probe.py``, ``context_parallel_probe.py``): one spawned process per rank on this
CPU, joined by gloo through a file store, each running the probe's ``work(world, rank, configs)`` and handing back
its results (a dict) pickled through a temporary directory; a rank's exception comes back as its traceback and is
raised here, naming the rank. Each rank runs one intra-op thread, so that the ranks do not contend for the cores.
Also what both probes count by hand with: :func:`storage_bytes`."""

from __future__ import annotations

import pickle
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

Work = Callable[[int, int, list], dict]


def run_ranks(work: Work, world: int, configs: list, prefix: str) -> list[dict]:
    """Every rank's ``work(world, rank, configs)`` (a module-level function: spawn pickles it), in rank order."""
    with tempfile.TemporaryDirectory(prefix=prefix) as out:
        mp.start_processes(_rank_main, args=(world, work, configs, out), nprocs=world, join=True,
                           start_method="spawn")
        results = [pickle.loads((Path(out) / f"rank{r}.pkl").read_bytes()) for r in range(world)]
    for rank, r in enumerate(results):
        if "error" in r:
            raise RuntimeError(f"rank {rank}:\n{r['error']}")
    return results


def _rank_main(rank: int, world: int, work: Work, configs: list, out: str) -> None:
    # the ranks meet in a file of the run's folder, as measure's do (autofit/measure/ranks.py): no port to race for
    store = dist.FileStore(str(Path(out) / "rendezvous"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    try:
        results = work(world, rank, configs)
    except Exception:
        results = {"error": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    (Path(out) / f"rank{rank}.pkl").write_bytes(pickle.dumps(results))


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (non-tensors skipped): views of one storage count once."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())
