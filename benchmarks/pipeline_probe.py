"""Pipeline parallelism's memory per stage, measured: ``torch.distributed.pipelining`` on this CPU over gloo.

(docstring: Note [pipeline stage memory], filled in below once measured)
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import pickle
import re
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
from torch import nn  # noqa: E402
from torch.profiler import record_function  # noqa: E402

from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight  # noqa: E402

from autofit.core._torch_profiler import memory_profile, window_memory  # noqa: E402

H, FF, SEQ, ROWS, VOCAB, BLOCKS_PER_RANK = 64, 256, 32, 4, 128, 2
_WINDOW, _STEP, _MARK = "probe::rank_thread", "probe::step", "probe::mark"


# ---------------------------------------------------------------------------------------------------------- model
class Block(nn.Module):
    """x + fc2(gelu(fc1(x))): a transformer's MLP half, the simplest block whose activations outweigh its weights."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, FF), nn.Linear(FF, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(x)))


class StageModule(nn.Module):
    """Blocks ``[start, stop)`` of the decoder; the embedding on the first stage, norm and head on the last."""

    def __init__(self, blocks: int, start: int, stop: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # every stage's weights drawn from one seeded full model
        embed, layers = nn.Embedding(VOCAB, H), [Block() for _ in range(blocks)]
        norm, head = nn.LayerNorm(H), nn.Linear(H, VOCAB)
        self.embed = embed if start == 0 else None
        self.layers = nn.ModuleList(layers[start:stop])
        self.norm, self.head = (norm, head) if stop == blocks else (None, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))


def stage_modules(world: int, per_rank: int) -> list[StageModule]:
    """The ``world * per_rank`` stages of a ``world * BLOCKS_PER_RANK``-block decoder, split evenly by blocks."""
    blocks, stages = world * BLOCKS_PER_RANK, world * per_rank
    size = blocks // stages
    return [StageModule(blocks, i * size, (i + 1) * size) for i in range(stages)]


def batch(micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (micro * ROWS, SEQ), generator=g)
    return ids, torch.randint(0, VOCAB, (micro * ROWS, SEQ), generator=g)


def _bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


# ------------------------------------------------------------------------------------- one stage alone, one process
def stage_alone(module: StageModule, first: bool, last: bool) -> dict[str, int]:
    """One stage module alone, one micro-batch, as ``PipelineStage`` runs it (stage.py ``forward_one_chunk``,
    _backward.py ``stage_backward``): the received activation and the received output gradient exist before (the
    receive buffers), the input gradient is read from ``.grad`` and the ``.grad`` cleared. Twice, the first time
    with no gradients (they are created), the second accumulating into them; then AdamW's step. All in one memory
    profile, each phase a ``record_function`` span: bytes relative to the start."""
    module = copy.deepcopy(module)
    ids, target = batch(1)
    x = ids if first else torch.randn(ROWS, SEQ, H, requires_grad=True)
    grad_out = None if last else torch.randn(ROWS, SEQ, H)
    optimizer = torch.optim.AdamW(module.parameters())
    held: dict[str, object] = {}

    def forward() -> None:
        held["out"] = module(x)
        if last:
            held["loss"] = loss_fn(held["out"], target)

    def backward() -> None:
        if last:
            torch.autograd.backward([held["loss"]], grad_tensors=[None])
        else:
            torch.autograd.backward([held["out"]], grad_tensors=[grad_out])
        if not first:
            held["gin"], x.grad = x.grad, None
        detach_logits()

    def detach_logits() -> None:  # backward_one_chunk: a last stage's outputs detach_()ed once backward ran, and
        # nothing holds them (fwd_cache popped); the schedules that keep them (a local ``output``) say so
        if last and not first:
            if not held["out"]._is_view():  # views are not detachable in place (the head's 3-d output is one)
                held["out"].detach_()
            held["logits"] = _bytes([held.pop("out")])

    def backward_input() -> None:  # backward_one_chunk(full_backward=False): the first stage skips it
        if not first:
            outputs = (held["loss"],) if last else (held["out"],)
            dinputs, held["groups"] = stage_backward_input(list(outputs), None if last else [grad_out], [x],
                                                           module.parameters())
            held["gin"] = dinputs[0]  # and x.grad, the same tensor: stage_backward_input sets inp.grad = dinput
            detach_logits()

    def backward_weight() -> None:  # backward_weight_one_chunk: the first stage's full backward runs here
        if first:
            backward()
        else:
            stage_backward_weight(module.parameters(), held.pop("groups"))

    forward(), backward(), optimizer.step(), optimizer.zero_grad(set_to_none=True), held.clear()  # lazy state
    sizes = {}
    phases = {"full": [("B", backward)], "split": [("I", backward_input), ("W", backward_weight)]}
    rounds = [(1, "full"), (2, "full"), (3, "split"), (4, "split")]
    with memory_profile() as prof:
        for n, kind in rounds:
            if n == 3:
                optimizer.zero_grad(set_to_none=True)
            with record_function(f"F{n}"):
                forward()
            for phase, fn in phases[kind]:
                with record_function(f"{phase}{n}"):
                    fn()
            with record_function(f"E{n}"):
                pass
            sizes[f"out{n}"] = held["logits"] if last and not first else _bytes([held["out"]])
            sizes[f"gin{n}"] = _bytes([held.get("gin")])
            held.clear()
            x.grad = None
        with record_function("O"):
            optimizer.step()
        with record_function("Z"):
            optimizer.zero_grad(set_to_none=True)

    def span(name: str) -> tuple[int, int]:
        [(alive, peak)] = window_memory(prof, name)
        return sum(alive.values()), peak

    r = {"out": sizes["out1"], "gin": sizes["gin1"]}
    for n, kind in rounds:
        f0, fpeak = span(f"F{n}")
        r.update({f"fwd_peak{n}": fpeak})
        level = f0
        for phase, _ in phases[kind]:
            p0, ppeak = span(f"{phase}{n}")
            if phase == phases[kind][0][0]:
                r[f"saved{n}"] = p0 - f0
            else:
                r[f"{prev}_delta{n}"] = p0 - level
            r[f"{phase}_peak{n}"], level, prev = ppeak, p0, phase
        r[f"{prev}_delta{n}"] = span(f"E{n}")[0] - level
    o0, r["opt_peak"] = span("O")
    r["grads"] = _bytes(p.grad for p in module.parameters()) if False else sum(
        p.numel() * p.element_size() for p in module.parameters())
    r["params"] = r["grads"]
    r["state"] = _bytes(v for s in optimizer.state.values() for v in s.values())
    return r


# -------------------------------------------------------------------------------------------------- one rank's step
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
             "zbv": "ScheduleZBVZeroBubble"}
MULTI = {"interleaved": "loop", "zbv": "v"}  # two stages per rank: looped (r, r + world) or V (r, 2 world - 1 - r)


def local_stages(name: str, world: int, rank: int) -> list[int]:
    if name not in MULTI:
        return [rank]
    return [rank, rank + world] if MULTI[name] == "loop" else [rank, 2 * world - 1 - rank]


def run_config(name: str, micro: int, world: int, rank: int, windows: int = 3) -> dict:
    """This rank's measured step: a warm-up step (the pipelining infra and AdamW's state), then ``windows`` steps,
    each one ``record_function`` span: ``schedule.step`` over all micro-batches, ``optimizer.step()``,
    ``zero_grad(set_to_none=True)``. All under one memory profile (Note [memory from before the window],
    measure/allocator.py), only this thread's memory counted (Note [gloo's threads in the measured window],
    measure/ranks.py); the lowest window kept, as ranks.py keeps it."""
    from torch.distributed import pipelining

    per_rank = 2 if name in MULTI else 1
    indices = local_stages(name, world, rank)
    modules = stage_modules(world, per_rank)
    total = len(modules)
    stages = [pipelining.PipelineStage(modules[i], i, total, torch.device("cpu")) for i in indices]
    schedule_class = getattr(pipelining, SCHEDULES[name])
    schedule = (schedule_class(stages, micro, loss_fn=loss_fn) if name in MULTI
                else schedule_class(stages[0], micro, loss_fn=loss_fn))
    params = [p for s in stages for p in s.submod.parameters()]
    optimizer = torch.optim.AdamW(params)
    ids, target = batch(micro)
    has_first, has_last = 0 in indices, total - 1 in indices
    args = (ids,) if has_first else ()
    kwargs = {"target": target} if has_last else {}

    def step() -> None:
        schedule.step(*args, return_outputs=False, **kwargs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def buffers(kind: str) -> list[torch.Tensor]:
        infos = [info for s in stages for per_mb in getattr(s, kind).values() for info in per_mb]
        return [i.buffer for i in infos if i.buffer is not None]

    dist.barrier()
    with memory_profile() as prof:
        with record_function(_WINDOW):
            step()
            gc.collect()
            state = [v for s in optimizer.state.values() for v in s.values()]
            known_tensors = params + state + buffers("args_recv_info") + buffers("grad_recv_info") + [ids, target]
            known = {t.untyped_storage().data_ptr() for t in known_tensors}
            for _ in range(windows):
                dist.barrier()
                with record_function(_STEP):
                    step()
    mine = window_memory(prof, _STEP, _WINDOW, known)
    every = window_memory(prof, _STEP)  # every thread's memory: gloo's included
    best = min(range(windows), key=lambda w: sum(mine[w][0].values()) + mine[w][1])
    order = schedule.pipeline_order[rank] if schedule.pipeline_order else []
    return {
        "stages": indices, "total": total,
        "params": _bytes(params), "state": _bytes(state),
        "recv_act": _bytes(buffers("args_recv_info")), "recv_grad": _bytes(buffers("grad_recv_info")),
        "inputs": _bytes([ids]) if has_first else 0, "targets": _bytes([target]) if has_last else 0,
        # what the profile saw alive when the window began (params and the batch predate it) and the window's
        # high-water mark above that
        "alive": sum(mine[best][0].values()), "peak": mine[best][1],
        "windows": [sum(a.values()) + p for a, p in mine],
        "every_thread": [sum(a.values()) + p for a, p in every],
        "order": [str(a) for a in order if a is not None],
    }


def _rank_main(rank: int, world: int, port: int, configs: list, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    results: dict = {}
    try:
        for name, micro in configs:
            results[(name, micro)] = run_config(name, micro, world, rank)
    except Exception:
        results["error"] = traceback.format_exc()
    finally:
        dist.destroy_process_group()
    (Path(out) / f"rank{rank}.pkl").write_bytes(pickle.dumps(results))


def measure(world: int, configs: list) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="pipeprobe-") as out:
        mp.start_processes(_rank_main, args=(world, port, configs, out), nprocs=world, join=True,
                           start_method="spawn")
        results = [pickle.loads((Path(out) / f"rank{r}.pkl").read_bytes()) for r in range(world)]
    for rank, r in enumerate(results):
        if "error" in r:
            raise RuntimeError(f"rank {rank}:\n{r['error']}")
    return results


# ------------------------------------------------------------------------- the hand decomposition: who holds what
def actions(name: str, micro: int, world: int, rank: int, order: list[str]) -> list[tuple]:
    """This rank's compute actions in execution order, with the frees the schedule's code makes between them:
    ``("F" | "B", stage, mb)`` and ``("free", what, stage, mb)``, ``what`` in ``out`` (the stage's output), ``gin``
    (the gradient of its input, sent back), ``logits`` (the last stage's output). Mirrors schedules.py: which local
    variable or list of ``dist.Work`` still references a tensor once ``fwd_cache`` / ``bwd_cache`` let go of it."""
    total = world * (2 if name in MULTI else 1)
    first = lambda s: s == 0  # noqa: E731
    last = lambda s: s == total - 1  # noqa: E731
    ops: list[tuple] = []
    if name == "gpipe":  # ScheduleGPipe._step_microbatches
        s = rank
        ops += [("F", s, k) for k in range(micro)]
        for k in range(micro):
            ops.append(("B", s, k))
            # the last stage's logits: fwd_cache popped, backward_one_chunk detach_()es them; only the local
            # ``output`` (the last forward's) outlives its backward. A non-last stage's outputs stay referenced by
            # fwd_sends_to_wait's Work objects, its input gradients by bwd_sends_to_wait's, to the end of the step.
            if last(s) and k == micro - 1:
                ops.append(("hold", "logits", s, k))
        return ops
    if name == "1f1b":  # Schedule1F1B._step_microbatches
        s = rank
        warmup = min(micro, total - s)
        held_out = warmup - 2 if not last(s) and warmup >= 2 else None  # send_work keeps its Work until cooldown
        f = b = 0
        for _ in range(warmup):
            ops.append(("F", s, f))
            f += 1

        def backward(cooldown: bool) -> None:
            nonlocal b
            ops.append(("B", s, b))
            if last(s):  # the local ``output`` holds the logits of the last forward, this backward's
                ops.append(("hold", "logits", s, b))
            if not last(s) and b != held_out:
                ops.append(("free", "out", s, b))
            if not first(s) and b >= 1:  # bwd_sends (loop) or send_work (cooldown) let go of the previous one
                ops.append(("free", "gin", s, b - 1))
            b += 1

        while True:
            backward(False)
            if f == micro:
                break
            ops.append(("F", s, f))
            if last(s):  # the local ``output`` now holds this forward's logits, not the previous one's
                ops.append(("free", "logits", s, f - 1))
            f += 1
        if held_out is not None:  # send_work = _batch_p2p(bwd_sends): the warm-up's last fired send let go
            ops.append(("free", "out", s, held_out))
        while b < micro:
            backward(True)
        return ops
    # _PipelineScheduleRuntime._step_microbatches: every send's Work kept in send_ops to the end of the step; two
    # adjacent stages on this rank (ZBV's V) hand tensors over in place of a send (set_local_fwd_input,
    # set_local_bwd_input): the receiving stage's _RecvInfo.buffer holds them to the next step, which frees the old
    for a in order:
        m = re.fullmatch(r"(\d+)([FBIW])(\d+)", a)
        if m is None:
            continue
        stage, kind, mb = int(m[1]), m[2], int(m[3])
        mine = local_stages(name, world, rank)
        ops.append((kind, stage, mb))
        if kind == "F" and stage + 1 in mine:
            ops.append(("free", "out", stage, mb))  # the previous step's output, the next stage's buffer until now
        if kind in "BI":
            if stage - 1 in mine:
                ops.append(("free", "gin", stage, mb))  # the previous step's, in the previous stage's buffer
    return ops


def simulate(ops: list[tuple], alone: dict[int, dict[str, int]]) -> tuple[int, str, int]:
    """Bytes above what exists before the step (parameters, AdamW state, receive buffers, the batch) at the step's
    peak, from the stage-alone figures: a forward's peak and the bytes it leaves (saved activations, output, loss);
    a backward's peak above that and the bytes it leaves (the first creates the gradients); the frees of ``ops``.
    Then AdamW's step over the gradients. Returns (peak, where, bytes the schedule ends holding)."""
    cur = peak = 0
    where = ""
    seen: set[int] = set()
    for op in ops:
        if op[0] == "F":
            a = alone[op[1]]
            if cur + a["fwd_peak1"] > peak:
                peak, where = cur + a["fwd_peak1"], f"F{op[1]}.{op[2]}"
            cur += a["saved1"]
        elif op[0] in "BIW":
            phase, a = op[0], alone[op[1]]
            n = {"B": 1, "I": 3, "W": 3}[phase] + (1 if op[1] in seen and phase != "I" else 0)
            if phase != "I":
                seen.add(op[1])
            if cur + a[f"{phase}_peak{n}"] > peak:
                peak, where = cur + a[f"{phase}_peak{n}"], f"{phase}{op[1]}.{op[2]}"
            cur += a[f"{phase}_delta{n}"]
        else:
            kind, what, s, _ = op
            cur += (1 if kind == "hold" else -1) * alone[s]["gin" if what == "gin" else "out"]
    grads = sum(alone[s]["grads"] for s in seen)
    held = cur - grads
    opt = grads + max(alone[s]["opt_peak"] for s in seen)
    if opt > peak:
        peak, where = opt, "optimizer"
    return peak, where, held


def in_flight(ops: list[tuple]) -> int:
    """The most micro-batches whose forward has run and whose backward has not, over this rank's stages."""
    n = most = 0
    for op in ops:
        n += {"F": 1, "B": -1, "W": -1}.get(op[0], 0)
        most = max(most, n)
    return most


def valid(name: str, micro: int, world: int) -> bool:
    return not (name == "1f1b" and micro < world)  # Schedule1F1B.__init__ refuses fewer micro-batches than stages


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4", help="pipeline ranks (one stage per rank, two for interleaved, zbv)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--micro", default="2,4", help="micro-batches per step")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    names, micros = args.schedules.split(","), [int(m) for m in args.micro.split(",")]
    print(f"torch {torch.__version__}, gloo on this CPU; decoder: embedding {VOCAB}x{H}, {BLOCKS_PER_RANK} MLP blocks "
          f"({H}->{FF}->{H}) per rank, LayerNorm + head; micro-batch {ROWS}x{SEQ} tokens, fp32, AdamW")
    rows = []
    for world in (int(w) for w in args.worlds.split(",")):
        configs = [(n, m) for n in names for m in micros if valid(n, m, world)]
        alone = {}
        for per_rank in (1, 2):
            modules = stage_modules(world, per_rank)
            alone[per_rank] = {i: stage_alone(m, i == 0, i == len(modules) - 1) for i, m in enumerate(modules)}
        results = measure(world, configs)
        for name, micro in configs:
            for rank, result in enumerate(results):
                r = result[(name, micro)]
                ops = actions(name, micro, world, rank, r["order"])
                a = alone[2 if name in MULTI else 1]
                sim, where, held = simulate(ops, a)
                base = r["params"] + r["state"] + r["recv_act"] + r["recv_grad"] + r["inputs"] + r["targets"]
                measured = r["params"] + r["inputs"] + r["targets"] + r["alive"] + r["peak"]
                kept = r["alive"] - r["state"] - r["recv_act"] - r["recv_grad"]
                rows.append((world, name, micro, rank, r["stages"], in_flight(ops), measured, base + sim,
                             measured - base - sim, where, r, kept, sim, held,
                             max(r["every_thread"]) - min(r["windows"])))
    print(f"\n{'W':>2} {'schedule':<12}{'M':>2} {'rank':>4} {'stages':<7}{'fly':>4} {'measured':>10} {'decomposed':>10} "
          f"{'resid':>7} {'peak at':<10}{'params':>8}{'state':>8}{'recvA':>8}{'recvG':>8}{'batch':>6}{'kept':>7}"
          f"{'act+tr':>9} {'gloo':>5}")
    for (world, name, micro, rank, stages, fly, measured, decomposed, resid, where, r, kept, sim, held,
         gloo) in rows:
        print(f"{world:>2} {name:<12}{micro:>2} {rank:>4} {','.join(map(str, stages)):<7}{fly:>4} {measured:>10,} "
              f"{decomposed:>10,} {resid:>7,} {where:<10}{r['params']:>8,}{r['state']:>8,}{r['recv_act']:>8,}"
              f"{r['recv_grad']:>8,}{r['inputs'] + r['targets']:>6,}{kept:>7,}{sim:>9,} {gloo:>5,}")
    print(f"\n{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
