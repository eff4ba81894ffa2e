"""Context parallelism's memory per rank, measured: torch's ``context_parallel`` on this CPU over gloo.

DOCSTRING-PLACEHOLDER
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.profiler import record_function  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from autofit.core._torch_profiler import memory_profile, window_memory  # noqa: E402

H, HEADS, FF, SEQ, ROWS, VOCAB, BLOCKS = 64, 4, 128, 256, 2, 64, 2
HD = H // HEADS
_WINDOW, _STEP = "probe::rank_thread", "probe::step"
aten = torch.ops.aten
FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


# ---------------------------------------------------------------------------------------------------------- model
class Block(nn.Module):
    """Pre-norm decoder block: x + proj(sdpa(qkv(ln1 x), causal)), then x + fc2(gelu(fc1(ln2 x)))."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.qkv, self.proj = nn.LayerNorm(H), nn.Linear(H, 3 * H), nn.Linear(H, H)
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(H), nn.Linear(H, FF), nn.Linear(FF, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, n, 3, HEADS, HD).permute(2, 0, 3, 1, 4)
        # F.scaled_dot_product_attention looked up at call time: context_parallel patches the module attribute
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, n, H))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Model(nn.Module):
    def __init__(self, recompute: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.pos = nn.Embedding(VOCAB, H), nn.Embedding(SEQ, H)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.norm, self.head = nn.LayerNorm(H), nn.Linear(H, VOCAB)
        self.recompute = recompute

    def forward(self, ids: torch.Tensor, pos: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.pos(pos)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.recompute else block(x)
        return F.cross_entropy(self.head(self.norm(x)).reshape(-1, VOCAB), target.reshape(-1))


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    target = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    return ids, torch.arange(SEQ).expand(ROWS, SEQ).contiguous(), target


def _bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


# ------------------------------------------------------------- the CPU handler: torch's ring attention, the CPU op
def _ring_cpu_handler(op_call: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
    """``_sdpa_handler`` (_attention.py) for the CPU flash op and its backward: unwrap the DTensors, propagate the
    sharding (the Shard(2) rules below), run torch's ``_templated_ring_attention`` / ``_backward`` with the CPU op
    as ``op``, wrap the local results. The CPU op returns ``(out, logsumexp)`` and its backward ``(dq, dk, dv)``:
    what the templated code unpacks (``out, logsumexp, *rest = op(...)``, ``grad_query_, grad_key_, grad_value_,
    *rest = op(...)``), so the op goes in as it is; the backward's ``dropout_p`` has no default and is passed."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel._attention import (
        _templated_ring_attention, _templated_ring_attention_backward)

    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    output_sharding = op_info.output_sharding
    if output_sharding is None or output_sharding.needs_redistribute:
        raise AssertionError(f"{op_call}: inputs would need a redistribution")
    group = op_info.compute_mesh.get_group()
    a, kw = op_info.local_args, dict(op_info.local_kwargs)
    if op_call is FWD:
        query, key, value, *rest = a
        dropout_p, is_causal = (list(rest) + [0.0, False])[:2] if len(rest) < 2 else rest[:2]
        dropout_p, is_causal = kw.pop("dropout_p", dropout_p), kw.pop("is_causal", is_causal)
        local = _templated_ring_attention(group, 2, FWD, query, key, value, is_causal=is_causal,
                                          dropout_p=dropout_p, **kw)
    else:
        grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = a
        local = _templated_ring_attention_backward(group, 2, BWD, grad_out=grad_out, grad_out_name="grad_out",
                                                   query=query, key=key, value=value, out=out, logsumexp=logsumexp,
                                                   is_causal=is_causal, dropout_p=dropout_p, **kw)
    return dispatcher.wrap(tuple(local), output_sharding.output_spec)


def _register_cpu_ring_attention() -> None:
    """Put the handler beside torch's in ``_attention.custom_ops`` (which ``_enable_cp_dtensor_dispatcher`` merges
    into ``DTensor._op_dispatcher._custom_op_handlers`` when ``context_parallel`` is entered, and which its exit
    drops again) and register the ops' Shard(2) sharding, as ``_sharding_rules.py`` does the CUDA ops' CP
    strategy (outputs, then the tensor inputs, all sharded on the sequence)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy, register_op_strategy
    from torch.distributed.tensor.experimental._context_parallel import _attention

    def strategy(outputs: int):
        def rule(op_schema):
            mesh = op_schema.get_mesh_from_args(validate=False)
            tensors = sum(1 for s in op_schema.args_schema if type(s).__name__ == "OpStrategy")
            return expand_to_full_mesh_op_strategy(mesh, op_schema, [[Shard(2)] * (outputs + tensors)],
                                                   input_index=outputs)
        return rule

    register_op_strategy(FWD, schema_info=RuntimeSchemaInfo(3))(strategy(2))
    register_op_strategy(BWD, schema_info=RuntimeSchemaInfo(6))(strategy(3))
    _attention.custom_ops[FWD] = _attention.custom_ops[BWD] = _ring_cpu_handler


# -------------------------------------------------------------------------------------------------- one rank's step
def _cp(mesh, buffers: list[torch.Tensor]):
    from torch.distributed.tensor.experimental import context_parallel

    return context_parallel(mesh, buffers=buffers, buffer_seq_dims=[1] * len(buffers))


def check(world: int, rank: int, mesh, recompute: bool) -> dict:
    """One CP step's loss and gradients against the single-process full-sequence step's (computed on every rank,
    no communication): each rank's loss is the mean over its own tokens and its gradients those of that mean, so
    the world's are the average (all_reduce SUM / world, what DDP or FSDP over the CP ranks would do)."""
    reference = Model(recompute)
    ids, pos, target = batch()
    ref_loss = reference(ids, pos, target)
    ref_loss.backward()
    model = Model(recompute)
    with _cp(mesh, [ids, pos, target]):
        loss = model(ids, pos, target)
        loss.backward()
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    loss /= world
    worst = {"loss": (abs(loss - ref_loss).item(), abs(loss - ref_loss).item() / abs(ref_loss).item())}
    ok = torch.allclose(loss, ref_loss, rtol=1e-4, atol=0)
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)
        g /= world
        ok &= torch.allclose(g, r.grad, rtol=1e-4, atol=1e-6)
        d = (g - r.grad).abs()
        worst[name] = (d.max().item(), (d / r.grad.abs().clamp_min(1e-6)).max().item())
    name = max(worst, key=lambda n: worst[n][0])
    return {"ok": bool(ok), "loss": loss.item(), "ref_loss": ref_loss.item(), "worst": (name, *worst[name])}


def run_config(world: int, rank: int, mesh, rotate: str, recompute: bool, windows: int = 3) -> dict:
    """This rank's measured step under ``context_parallel`` (entered once, before the profile: its sharding of the
    buffers and its restore copies predate the windows): a warm-up step (AdamW's state), then ``windows`` steps,
    each one ``record_function`` span: forward and loss, ``backward()``, ``optimizer.step()``,
    ``zero_grad(set_to_none=True)``. One memory profile, only this thread's memory (Note [gloo's threads in the
    measured window], measure/ranks.py), the lowest window kept, as ranks.py keeps it."""
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method(rotate)
    model = Model(recompute)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params)
    ids, pos, target = batch()
    cp = _cp(mesh, [ids, pos, target])
    cp.__enter__()
    frame = cp.gen.gi_frame.f_locals  # torch.no_grad() wraps the generator (utils/_contextlib.py _wrap_generator)
    while "original_buffers" not in frame:
        frame = frame["gen"].gi_frame.f_locals
    restore = [b for b in frame["original_buffers"] if b is not None]  # context_parallel's clones, for its exit

    def step() -> None:
        model(ids, pos, target).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    try:
        dist.barrier()
        with memory_profile() as prof:
            with record_function(_WINDOW):
                step()
                state = [v for s in optimizer.state.values() for v in s.values()]
                known = {t.untyped_storage().data_ptr() for t in params + state + restore + [ids, pos, target]}
                for _ in range(windows):
                    gc.collect()
                    dist.barrier()
                    with record_function(_STEP):
                        step()
    finally:
        cp.__exit__(None, None, None)
    mine = window_memory(prof, _STEP, _WINDOW, known)
    every = window_memory(prof, _STEP)
    best = min(range(windows), key=lambda w: sum(mine[w][0].values()) + mine[w][1])
    return {
        "params": _bytes(params), "state": _bytes(state), "batch": _bytes([ids, pos, target]),
        "restore": _bytes(restore), "alive": sum(mine[best][0].values()), "peak": mine[best][1],
        "windows": [sum(a.values()) + p for a, p in mine],
        "gloo": max(sum(e[0].values()) + e[1] - sum(m[0].values()) - m[1] for e, m in zip(every, mine)),
        "holders": peak_holders(prof, best),
    }


def peak_holders(prof, window: int) -> list[tuple[str, int]]:
    """Where the kept window's peak is and who holds its bytes: of the allocations this rank's thread made in the
    window (the profile's event tree, each allocation under the op that made it), those alive at the high-water
    mark, summed by allocating op and ring step, with the op running at the mark first. A reading aid for the
    decomposition, not a measurement (window_memory's count is the measurement)."""
    marks, spans, events = set(), [], []
    stack = [(n, ()) for n in prof.profiler.kineto_results.experimental_event_tree()]
    from autofit.core._torch import EventType
    while stack:
        node, parents = stack.pop()
        if node.name == _WINDOW:
            marks.add(node.start_tid)
        if node.name == _STEP:
            spans.append((node.start_time_ns, node.end_time_ns))
        if node.tag == EventType.Allocation:
            f = node.extra_fields
            events.append((node.start_time_ns, f.alloc_size, node.start_tid, f.ptr, parents))
        here = parents + ((node.name,) if node.tag != EventType.Allocation else ())
        stack.extend((c, here) for c in node.children)
    events.sort(key=lambda e: e[0])
    start, end = sorted(spans)[window]
    live, running, best, at = {}, 0, -1, None
    for time_, size, tid, ptr, parents in events:
        if not start <= time_ <= end:
            continue
        if size > 0 and tid in marks:
            live[ptr] = (size, parents)
            running += size
        elif size < 0 and ptr in live:
            running -= live.pop(ptr)[0]
        if running > best:
            best, at, snapshot = running, parents, dict(live)
    by: dict[str, int] = {}
    for size, parents in snapshot.values():
        key = " > ".join(p for p in parents if not p.startswith("probe::"))[-90:]
        by[key] = by.get(key, 0) + size
    return [("PEAK IN " + " > ".join(at)[-90:], best)] + sorted(by.items(), key=lambda kv: -kv[1])


def _rank_main(rank: int, world: int, port: int, configs: list, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    from torch.distributed.device_mesh import init_device_mesh

    results: dict = {}
    try:
        mesh = init_device_mesh("cpu", (world,))
        _register_cpu_ring_attention()
        for rotate, recompute, checked in configs:
            if checked:
                from torch.distributed.tensor.experimental._attention import set_rotate_method
                set_rotate_method(rotate)
                results[("check", rotate, recompute)] = check(world, rank, mesh, recompute)
            results[(rotate, recompute)] = run_config(world, rank, mesh, rotate, recompute)
    except Exception:
        results["error"] = traceback.format_exc()
    finally:
        dist.destroy_process_group()
    (Path(out) / f"rank{rank}.pkl").write_bytes(pickle.dumps(results))


def measure(world: int, configs: list) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="cpprobe-") as out:
        mp.start_processes(_rank_main, args=(world, port, configs, out), nprocs=world, join=True,
                           start_method="spawn")
        results = [pickle.loads((Path(out) / f"rank{r}.pkl").read_bytes()) for r in range(world)]
    for rank, r in enumerate(results):
        if "error" in r:
            raise RuntimeError(f"rank {rank}:\n{r['error']}")
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4", help="CP degrees (one process per rank)")
    parser.add_argument("--rotate", default="allgather,alltoall")
    parser.add_argument("--recompute", default="off,on")
    parser.add_argument("--debug", action="store_true", help="print who holds the bytes at each peak")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    configs = [(rot, rec == "on", rot == args.rotate.split(",")[0])
               for rot in args.rotate.split(",") for rec in args.recompute.split(",")]
    for world in (int(w) for w in args.worlds.split(",")):
        results = measure(world, configs)
        for rotate, recompute, checked in configs:
            for rank, result in enumerate(results):
                r = result[(rotate, recompute)]
                measured = r["params"] + r["batch"] + r["restore"] + r["alive"] + r["peak"]
                print(world, rotate, recompute, rank, measured, {k: v for k, v in r.items() if k != "holders"})
                if checked and rank == 0:
                    print("  check", result[("check", rotate, recompute)])
                if args.debug:
                    for k, v in r["holders"]:
                        print(f"    {v:>10,}  {k}")
    print(f"\n{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
