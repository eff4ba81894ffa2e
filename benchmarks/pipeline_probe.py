"""Pipeline parallelism's memory per stage, measured: ``torch.distributed.pipelining`` on this CPU over gloo.

The ground truth for issue 59. One process per pipeline rank (spawned, joined by gloo), each running
``PipelineStage`` + a schedule (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble) on
a small decoder built from code (an embedding, MLP blocks x + fc2(gelu(fc1(x))), LayerNorm and a head; no download),
fp32, AdamW, ``torch.manual_seed``. Per rank, the CPU allocator's peak of one steady-state step (after a warm-up
step that builds the pipelining buffers and AdamW's state): ``schedule.step(..., return_outputs=False)`` (or
torch's default ``True``: ``--return-outputs``) over all micro-batches, ``optimizer.step()``,
``zero_grad(set_to_none=True)``; read as autofit measures a rank
(``core/_torch_profiler.py``'s ``memory_profile`` and ``window_memory``, one profile from the warm-up on, only the
rank's own thread, the lowest of three windows: Note [gloo's threads in the measured window], measure/ranks.py).
Each peak is then rebuilt by hand: parameters, AdamW state, the library's buffers, and a replay of the rank's
actions with figures of the stage module run alone (one process, one micro-batch, the same backward functions),
and the table prints measured, decomposed and the residual.

    .venv-test/bin/python benchmarks/pipeline_probe.py              # 2 and 4 ranks, all four schedules, M = 2, 4
    .venv-test/bin/python benchmarks/pipeline_probe.py --worlds 2 --schedules gpipe,1f1b --micro 4
    .venv-test/bin/python benchmarks/pipeline_probe.py --return-outputs       # the last stage keeps its outputs

Result (torch 2.13.0, 2 CPU cores, about 50 s a run): 44 rank rows (2 and 4 ranks x GPipe, 1F1B, Interleaved
1F1B, ZBV x M = 2, 4; 1F1B refuses M < ranks), residual 0 bytes in every row, with return_outputs False and True.

Note [pipeline stage memory]
    What a rank holds at its step's peak, each term with the torch code that holds it (torch/distributed/
    pipelining/, torch 2.13):

    - Parameters P, and AdamW's state 2 P + 4 bytes per parameter tensor (``step``, optim/adam.py). Gradients
      (P) exist from a stage's first backward of the step on (``zero_grad(set_to_none=True)`` before it).
    - Receive buffers, allocated at the first ``step()`` (``_PipelineSchedule._initialize_pp_stages`` ->
      ``PipelineStage._prepare_forward_infra`` / ``_prepare_backward_infra``) and kept for the schedule's life,
      one per micro-batch: a stage that is not first holds M activation buffers (``_setup_forward_recv_info``,
      ``_make_tensor_from_meta`` in _utils.py: ``torch.empty_strided``), a stage that is not last M gradient
      buffers (``_setup_backward_recv_info`` -> ``_create_grad_recv_info``). Columns recvA, recvG. gloo's
      ``irecv`` writes into them in place. The first step's metadata inference (DYNAMIC mode:
      ``_forward_metadata_inference``, ``_backward_metadata_inference``) runs a real forward and backward and
      ``_post_metadata_inference_cleanup`` drops it: no steady-state term.
    - Per micro-batch in flight, the activations its backward needs (``acts``: the autograd graph;
      ``forward_one_chunk`` keeps ``(outputs, inputs)`` in ``fwd_cache`` until ``backward_one_chunk`` pops it).
      Measured alone: 589,824 B on the first stage (embedding output + 2 x 262,144 per block: fc1's output saved
      by gelu, gelu's by fc2, each 4 x 32 x 256 fp32, and each block's input), 557,056 B on a middle stage (its
      input is the receive buffer, not counted), 689,156 B on the last (norm, head, log_softmax's output,
      nll's 4-byte total_weight).
    - The stage's output (``outs``), beyond its backward where a ``dist.Work`` of its send still references it:
      ScheduleGPipe keeps every send's Work in ``fwd_sends_to_wait`` to the end of ``_step_microbatches`` (all M);
      Schedule1F1B's ``send_work`` keeps the warm-up's last fired send (micro-batch warmup - 2) until the
      cooldown's ``send_work = _batch_p2p(bwd_sends)``; ``_PipelineScheduleRuntime`` (Interleaved, ZBV) keeps
      every send in ``send_ops`` to the step's end.
    - The input gradient (``gins``, stages that are not first): ``stage_backward`` (_backward.py) reads
      ``val.grad`` and sets it to None, ``bwd_cache`` holds it until ``get_bwd_send_ops`` pops it, then the send:
      GPipe's ``bwd_sends_to_wait`` (to the end), 1F1B's ``bwd_sends`` / ``send_work`` (until the next backward
      has run), the runtime's ``send_ops`` (to the end).
    - The last stage: each micro-batch's loss (4 B) in ``_internal_losses`` until ``_update_losses``; its logits
      are a view (the head's 3-d output), so ``backward_one_chunk``'s ``t.detach_()`` skips them, and they are
      freed with ``fwd_cache``'s entry, except the one the schedule's local ``output`` still binds (GPipe: the last
      forward's, to the end; 1F1B: the latest forward's, until the next forward).
    - ``return_outputs=True`` (torch's default; ``--return-outputs``): ``forward_one_chunk`` appends every logits to
      ``output_chunks``, kept to the next step's ``clear_runtime_states`` (column chunks, freed before the peak),
      so the last stage holds all M logits from their forward on, and ``step()`` ends with ``merge_chunks``
      (microbatch.py: a ``torch.cat``, M logits more for a moment; never the peak here). Under a zero-bubble
      schedule a kept logits also keeps, through its ``grad_fn`` (not detached: a view), the saved tensors of the
      nodes only the I ran, which W's ``autograd.grad(..., retain_graph=False)`` never reached: here GeluBackward's
      saved input, fc1's output, 131,072 B per block and micro-batch (stage_alone's ``stale_split``; 0 after a
      full backward, which frees every saved tensor it runs through).
    - Zero bubble (I then W, ZBV): ``stage_backward_input`` runs ``autograd.grad(..., retain_graph=True)``, so
      the micro-batch's activations stay until its ``stage_backward_weight``, with the gradients it captured at
      the graph's "intermediates" (``param_group["grads"]``; ``ihold``: 131,072 B per block and micro-batch here,
      one 4 x 32 x 256 gradient). The first stage skips I and runs its whole backward at W. ``stage_backward_input``
      also sets ``inp.grad = dinput`` on the receive buffer and nothing clears it until the next step's
      ``clear_runtime_states``: M input gradients held between steps (column x.grad; freed before the peak).
    - ZBV's two stages on one rank hand tensors over in place of a send (Note [V-schedule special case],
      stage.py): ``set_local_fwd_input`` makes the earlier stage's output the later one's receive buffer and
      ``set_local_bwd_input`` the later one's input gradient the earlier one's gradient buffer; they stay until
      the next step's same micro-batch replaces them (in recvA / recvG).
    - The transient of the op at the peak (the stage alone's peak of that forward, backward, I or W above its
      start): 196,864 B for a full backward of the MLP stages, the last block's fc2 backward: the gradient of
      gelu's output (4 x 32 x 256 fp32, 131,072) with fc2.weight's (65,536) and fc2.bias's (256); 262,144 B
      for a middle stage's I (gelu's and fc1's output gradients at once, one kept to W); 393,220 B for the last
      stage's I.
    - AdamW's step (``_single_tensor_adam``: foreach is off on the CPU): ``denom = (exp_avg_sq.sqrt() / ...)``
      allocates two of a parameter's size while the previous parameter's ``denom`` is still bound, + 12 B of
      scalar tensors: max over consecutive parameters of prev + 2 x cur + 12 (163,852 B and 132,108 B here, equal
      to the measurement). Never the peak in these runs: the peak is always in a backward (or a zero-bubble I).
    - gloo allocates nothing on its own threads for these point-to-point sends and receives: counted on every
      thread, each window equals the rank's own (column gloo).

    Micro-batches in flight (forwarded, backward not finished) at most, per rank (column fly): GPipe M on every
    stage; 1F1B min(M, S - s) on stage s of S; Interleaved 1F1B and ZBV from the schedule's own
    ``pipeline_order`` (two stages per rank: 2 ranks M = 4: 5 and 3 (Interleaved), 4 and 4 (ZBV); 4 ranks
    M = 4: 8, 8, 7, 5 and 5, 6, 7, 8). The peak is in a backward with the most micro-batches in flight, the first
    such once the gradients exist (GPipe: micro-batch 0's, all M in flight, no gradients yet; 1F1B with M above its
    warm-up: the second backward, warm-up count in flight and the gradients; the last stage: a later one, 4 B per
    earlier loss), or, for ZBV, an I with the activations I and W retain.

    Found on the way: a probe that keeps a list of the receive buffers across the measured steps keeps ZBV's
    handed-over tensors alive past their replacement (M outputs + M gradients more); the probe drops the list.
    Not measured: DDP or FSDP inside a stage, schedules other than these four
    (LoopedBFS, InterleavedZeroBubble, DualPipeV), bf16, attention blocks.
"""

from __future__ import annotations

import argparse
import copy
import gc
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from gloo_ranks import run_ranks, storage_bytes as _bytes  # noqa: E402
from torch.profiler import record_function  # noqa: E402

from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight  # noqa: E402

from autofit.core._torch_profiler import memory_profile, window_memory  # noqa: E402

H, FF, SEQ, ROWS, VOCAB, BLOCKS_PER_RANK = 64, 256, 32, 4, 128, 2
_WINDOW, _STEP = "probe::rank_thread", "probe::step"


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


# ------------------------------------------------------------------------------------- one stage alone, one process
def stage_alone(module: StageModule, first: bool, last: bool) -> dict[str, int]:
    """One stage module alone, one micro-batch, as ``PipelineStage`` runs it (stage.py ``forward_one_chunk``,
    _backward.py ``stage_backward``): the received activation and the received output gradient exist before (the
    receive buffers), the input gradient is read from ``.grad`` and the ``.grad`` cleared. Rounds: 1, 2 a full
    backward (``B``), the first with no gradients (they are created), the second accumulating into them; 3, 4 the
    zero-bubble split, ``stage_backward_input`` (``I``) then ``stage_backward_weight`` (``W``); 5, 6 as 4 and 2 with
    the last stage's logits kept (``output_chunks``, return_outputs=True); then AdamW's step (``O``). All in one
    memory profile, each phase a ``record_function`` span, read with ``window_memory``: bytes relative to the
    start of a phase (``*_peak``) and what it leaves (``*_delta``)."""
    module = copy.deepcopy(module)
    ids, target = batch(1)
    x = ids if first else torch.randn(ROWS, SEQ, H, requires_grad=True)
    grad_out = None if last else torch.randn(ROWS, SEQ, H)
    optimizer = torch.optim.AdamW(module.parameters())
    held: dict[str, object] = {}
    keep_chunks = False

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
            held["logits"] = _bytes([held["out"]])
            chunk = held.pop("out")
            if keep_chunks:  # return_outputs=True: output_chunks keeps the (not detached) logits
                held["chunk"] = chunk

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
    # 5, 6: as 4 and 2, the logits kept as output_chunks keeps them (return_outputs=True)
    rounds = [(1, "full"), (2, "full"), (3, "split"), (4, "split"), (5, "split"), (6, "full")]
    with memory_profile() as prof:
        for n, kind in rounds:
            keep_chunks = n >= 5
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
    # what a kept output keeps besides itself once the backward ran: the split backward's W leaves the nodes only I
    # ran (here GeluBackward, whose saved input is fc1's output) with their saved tensors, reachable from the
    # logits' grad_fn; a full backward freed every saved tensor it ran through
    def left(n: int, phases: tuple[str, ...]) -> int:  # what round n leaves, against what it found
        return r[f"saved{n}"] + sum(r[f"{phase}_delta{n}"] for phase in phases)

    r["stale_split"] = left(5, ("I", "W")) - left(4, ("I", "W")) - r["out"] if last and not first else 0
    r["stale_full"] = left(6, ("B",)) - left(2, ("B",)) - r["out"] if last and not first else 0
    r["params"] = r["grads"] = sum(p.numel() * p.element_size() for p in module.parameters())  # fp32, like them
    r["state"] = _bytes(v for s in optimizer.state.values() for v in s.values())
    sizes_p = [p.numel() * p.element_size() for p in module.parameters()]
    # AdamW's state: exp_avg and exp_avg_sq like each parameter, and a 4-byte ``step`` tensor each (adam.py)
    r["state_hand"] = 2 * sum(sizes_p) + 4 * len(sizes_p)
    # _single_tensor_adam (foreach is off on the CPU): ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt)``
    # allocates two of a parameter's size while the previous parameter's ``denom`` is still bound, plus 12 bytes
    # of scalar tensors (an 8-byte wrapped number and its 4-byte copy)
    r["opt_hand"] = max(prev + 2 * size for prev, size in zip([0] + sizes_p, sizes_p)) + 12
    return r


# -------------------------------------------------------------------------------------------------- one rank's step
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
             "zbv": "ScheduleZBVZeroBubble"}
MULTI = {"interleaved": "loop", "zbv": "v"}  # two stages per rank: looped (r, r + world) or V (r, 2 world - 1 - r)


def local_stages(name: str, world: int, rank: int) -> list[int]:
    if name not in MULTI:
        return [rank]
    return [rank, rank + world] if MULTI[name] == "loop" else [rank, 2 * world - 1 - rank]


def run_config(name: str, micro: int, outputs: bool, world: int, rank: int, windows: int = 3) -> dict:
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
        schedule.step(*args, return_outputs=outputs, **kwargs)  # the merged output, if any, dropped at once
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def chunks() -> list[torch.Tensor]:  # the last stage's outputs, kept for merge_chunks (return_outputs=True)
        return [t for s in stages for t in s.output_chunks]

    def stale() -> list[torch.Tensor]:  # the tensors the autograd graph of the kept chunks still saves
        nodes, seen, found = [t.grad_fn for t in chunks()], set(), []
        while nodes:
            node = nodes.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            for attr in dir(node):
                if attr.startswith("_saved_"):
                    try:
                        value = getattr(node, attr)
                    except RuntimeError:  # freed by a backward: "Trying to backward through the graph a second time"
                        continue
                    found += [value] if isinstance(value, torch.Tensor) else []
            nodes += [next_node for next_node, _ in node.next_functions]
        return found

    def buffers(kind: str, grad: bool = False) -> list[torch.Tensor]:
        infos = [info for s in stages for per_mb in getattr(s, kind).values() for info in per_mb]
        tensors = [i.buffer for i in infos if i.buffer is not None]
        return [t.grad for t in tensors if t.grad is not None] if grad else tensors

    dist.barrier()
    with memory_profile() as prof:
        with record_function(_WINDOW):
            step()
            state = [v for s in optimizer.state.values() for v in s.values()]
            known: set[int] = set()  # the step's own tensors alive when a window begins (ranks.py's categories)
            recv: list[tuple[int, int, int, int]] = []  # per window: recvA, recvG, x.grad, output chunks
            for _ in range(windows):
                gc.collect()
                # before each window, as ZBV's same-rank handoffs (receive buffers) change from step to step; no list
                # of them may outlive this: it would keep the handed-over tensors alive past their replacement
                known |= {t.untyped_storage().data_ptr() for t in params + state + buffers("args_recv_info")
                          + buffers("grad_recv_info") + buffers("args_recv_info", grad=True) + chunks() + stale()
                          + [ids, target]}
                held = buffers("args_recv_info") + buffers("grad_recv_info")
                xgrad = _bytes(held + buffers("args_recv_info", grad=True)) - _bytes(held)
                held += params + buffers("args_recv_info", grad=True)
                recv.append((_bytes(buffers("args_recv_info")), _bytes(buffers("grad_recv_info")), xgrad,
                             _bytes(held + chunks() + stale()) - _bytes(held)))
                del held
                dist.barrier()
                with record_function(_STEP):
                    step()
    mine = window_memory(prof, _STEP, _WINDOW, [known] * windows)
    every = window_memory(prof, _STEP)  # every thread's memory: gloo's included
    best = min(range(windows), key=lambda w: sum(mine[w][0].values()) + mine[w][1])
    order = schedule.pipeline_order[rank] if schedule.pipeline_order else []
    return {
        "stages": indices, "total": total,
        "params": _bytes(params), "state": _bytes(state),
        "recv_act": recv[best][0], "recv_grad": recv[best][1], "recv_xgrad": recv[best][2],
        "chunks": recv[best][3],
        "inputs": _bytes([ids]) if has_first else 0, "targets": _bytes([target]) if has_last else 0,
        # what the profile saw alive when the window began (params and the batch predate it) and the window's
        # high-water mark above that
        "alive": sum(mine[best][0].values()), "peak": mine[best][1],
        "windows": [sum(a.values()) + p for a, p in mine],
        # the same windows counting every thread's allocations (gloo's workers included) and every tensor alive
        "gloo": max(sum(e[0].values()) + e[1] - sum(m[0].values()) - m[1] for e, m in zip(every, mine)),
        "order": [str(a) for a in order if a is not None],
    }


def rank_work(world: int, rank: int, configs: list) -> dict:
    """One rank's rows, run by ``gloo_ranks.run_ranks`` in the rank's own process."""
    return {(name, micro, outputs): run_config(name, micro, outputs, world, rank) for name, micro, outputs in configs}


# ------------------------------------------------------------------------- the hand decomposition: who holds what
def actions(name: str, micro: int, world: int, rank: int, order: list[str], outputs: bool = False) -> list[tuple]:
    """This rank's compute actions in execution order, with the frees the schedule's code makes between them:
    ``("F" | "B", stage, mb)`` and ``("free", what, stage, mb)``, ``what`` in ``out`` (the stage's output), ``gin``
    (the gradient of its input, sent back), ``logits`` (the last stage's output), and ``("hold", ...)`` for what
    stays referenced past the backward that frees it alone. Mirrors schedules.py: which local variable or list of
    ``dist.Work`` still references a tensor once ``fwd_cache`` / ``bwd_cache`` let go of it. ``outputs``
    (return_outputs=True): the last stage's ``output_chunks`` keep every micro-batch's logits (forward_one_chunk),
    and ``step()`` ends with ``merge_chunks`` (``("merge", stage, M)``)."""
    ops = _actions(name, micro, world, rank, order, outputs)
    total = world * (2 if name in MULTI else 1)
    if outputs and total - 1 in local_stages(name, world, rank):
        ops.append(("merge", total - 1, micro))
    return ops


def _actions(name: str, micro: int, world: int, rank: int, order: list[str], outputs: bool) -> list[tuple]:
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
            if last(s) and (k == micro - 1 or outputs):
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
            if last(s) and not outputs:  # the local ``output`` now holds this forward's logits, not the previous's
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
        if outputs and last(stage) and kind in "BW":  # the whole backward done: output_chunks keeps the logits
            ops.append(("hold", "logits", stage, mb))
            if kind == "W":  # and, through their grad_fn, what only the I ran (stage_alone's stale_split)
                ops.append(("hold", "stale", stage, mb))
        if kind in "BI":
            if stage - 1 in mine:
                ops.append(("free", "gin", stage, mb))  # the previous step's, in the previous stage's buffer
    return ops


TERMS = ("grads", "acts", "outs", "logits", "losses", "gins", "ihold", "other", "transient")


def terms_of(a: dict[str, int], last: bool) -> dict[str, int]:
    """One stage's per-micro-batch terms from the stage-alone figures: ``acts`` the activations its backward saves
    (not the output), ``loss`` (the last stage's loss and nll's total_weight beside it), ``ihold`` what a zero-bubble
    backward-input keeps until its backward-weight (stage_backward_input's captured intermediate gradients)."""
    acts = a["grads"] + a["gin"] - a["B_delta1"] - (a["out"] if last else 0)
    return {"acts": acts, "loss": a["saved1"] - acts - a["out"], "ihold": a["I_delta3"] - a["gin"]}


def simulate(ops: list[tuple], alone: dict[int, dict[str, int]], total: int) -> tuple[int, str, dict[str, int]]:
    """Bytes above what exists before the step (parameters, AdamW state, receive buffers, the batch) at the step's
    peak, by term, from the stage-alone figures: a forward's peak and what it leaves (saved activations, output,
    loss); a backward's peak above its start and what it leaves (frees the activations, creates the gradients the
    first time, the input gradient); the schedule's frees and holds (``ops``). Then AdamW's step over the gradients.
    Returns (peak, where, the terms at the peak: ``transient`` is the peak of the op there above its start)."""
    held = dict.fromkeys(TERMS, 0)
    peak, where, at, merged = 0, "", dict(held), 0
    seen: set[int] = set()

    def check(op_peak: int, label: str) -> None:
        nonlocal peak, where, at
        if sum(held.values()) + op_peak > peak:
            peak, where, at = sum(held.values()) + op_peak, label, dict(held, transient=op_peak)

    for op in ops:
        kind, s = op[0], op[1]
        a = alone[s] if kind in "FBIW" else None
        if kind == "F":
            t = terms_of(a, s == total - 1)
            check(a["fwd_peak1"], f"F{s}.{op[2]}")
            held["acts"] += t["acts"]
            held["logits" if s == total - 1 else "outs"] += a["out"]
            held["losses"] += t["loss"]
        elif kind in "BIW":
            t, last = terms_of(a, s == total - 1), s == total - 1
            n = {"B": 1, "I": 3, "W": 3}[kind] + (1 if s in seen and kind != "I" else 0)
            check(a[f"{kind}_peak{n}"], f"{kind}{s}.{op[2]}")
            before = sum(held.values())
            if kind == "I":
                held["ihold"] += t["ihold"]
                held["gins"] += a["gin"]
            else:
                held["grads"] += a["grads"] if s not in seen else 0
                held["acts"] -= t["acts"]
                held["logits"] -= a["out"] if last else 0
                if kind == "W":
                    held["ihold"] -= t["ihold"]
                else:
                    held["gins"] += a["gin"]
                seen.add(s)
            held["other"] += a[f"{kind}_delta{n}"] - (sum(held.values()) - before)  # 0: the terms add up
        elif kind == "merge":  # the schedule returned: its locals and Works are gone, the output chunks stay
            merged = alone[s]["out"] * op[2]
        else:
            _, what, s, _ = op
            key = {"gin": "gins", "out": "outs", "logits": "logits", "stale": "acts"}[what]
            size = {"gin": "gin", "stale": "stale_split"}.get(what, "out")
            held[key] += (1 if kind == "hold" else -1) * alone[s][size]
    check_opt = max(alone[s]["opt_peak"] for s in seen)
    held = dict.fromkeys(TERMS, 0) | {"grads": sum(alone[s]["grads"] for s in seen)}  # the step ends: grads stay
    if merged:
        held["logits"] = merged  # output_chunks, until the next step's clear_runtime_states()
        check(merged, "merge")  # merge_chunks: torch.cat of the chunks (microbatch.py)
    check(check_opt, "optimizer")
    return peak, where, at


def at_acts(at: dict[str, int], alone: dict[int, dict[str, int]], s: int, where: str) -> str:
    """The activations at the peak as a count of one micro-batch's (a stage's own backward at the peak has freed
    part of one: the transient counts that)."""
    acts = terms_of(alone[s], s == len(alone) - 1)["acts"]
    return f"{at['acts'] / acts:.2f} x {acts:,}"


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
    parser.add_argument("--return-outputs", action="store_true",
                        help="schedule.step(return_outputs=True), torch's default: the last stage keeps and merges "
                             "its outputs")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    names, micros = args.schedules.split(","), [int(m) for m in args.micro.split(",")]
    print(f"torch {torch.__version__}, gloo on this CPU; decoder: embedding {VOCAB}x{H}, {BLOCKS_PER_RANK} MLP blocks "
          f"({H}->{FF}->{H}) per rank, LayerNorm + head; micro-batch {ROWS}x{SEQ} tokens, fp32, AdamW; "
          f"return_outputs={args.return_outputs}")
    rows, alones = [], {}
    for world in (int(w) for w in args.worlds.split(",")):
        configs = [(n, m, args.return_outputs) for n in names for m in micros if valid(n, m, world)]
        for per_rank in (1, 2) if any(n in MULTI for n in names) else (1,):
            modules = stage_modules(world, per_rank)
            alones[(world, per_rank)] = {i: stage_alone(m, i == 0, i == len(modules) - 1)
                                         for i, m in enumerate(modules)}
        results = run_ranks(rank_work, world, configs, "pipeprobe-")
        for name, micro, outputs in configs:
            for rank, result in enumerate(results):
                r = result[(name, micro, outputs)]
                ops = actions(name, micro, world, rank, r["order"], outputs)
                a = alones[(world, 2 if name in MULTI else 1)]
                sim, where, at = simulate(ops, a, r["total"])
                # the step's peak comes after clear_runtime_states() freed recv_xgrad and the output chunks
                base = r["params"] + r["state"] + r["recv_act"] + r["recv_grad"] + r["inputs"] + r["targets"]
                measured = r["params"] + r["inputs"] + r["targets"] + r["alive"] + r["peak"]
                kept = r["alive"] - r["state"] - r["recv_act"] - r["recv_grad"] - r["recv_xgrad"] - r["chunks"]
                rows.append((world, name, micro, rank, r["stages"], in_flight(ops), measured, base + sim,
                             measured - base - sim, where, r, kept, sim, at,
                             r["gloo"]))
    print("\nper micro-batch, one stage module alone (stage_alone): bytes")
    print(f"{'W':>2} {'per':>3} {'stage':>5} {'params':>8} {'state':>8} {'2P+4n':>8} {'acts':>8} {'out':>7} "
          f"{'gin':>7} {'loss':>5} {'fwd tr':>7} {'B tr':>8} {'I tr':>8} {'ihold':>8} {'W tr':>7} {'opt tr':>8} "
          f"{'hand':>8}")
    for (world, per_rank), stages in sorted(alones.items()):
        for i, a in stages.items():
            t = terms_of(a, i == len(stages) - 1)
            print(f"{world:>2} {per_rank:>3} {i:>5} {a['params']:>8,} {a['state']:>8,} {a['state_hand']:>8,} "
                  f"{t['acts']:>8,} {a['out']:>7,} {a['gin']:>7,} {t['loss']:>5,} {a['fwd_peak1'] - a['saved1']:>7,} "
                  f"{a['B_peak1']:>8,} {a['I_peak3']:>8,} {t['ihold']:>8,} {a['W_peak4']:>7,} {a['opt_peak']:>8,} "
                  f"{a['opt_hand']:>8,}")
    print("\nper rank, one steady-state step: measured (the allocator, this rank's thread) against the decomposition")
    print(f"{'W':>2} {'schedule':<12}{'M':>2} {'rank':>4} {'stages':<7}{'fly':>4} {'measured':>10} {'decomposed':>10} "
          f"{'resid':>6} {'peak at':<10}{'params':>8}{'state':>8}{'recvA':>8}{'recvG':>8}{'x.grad':>8}{'chunks':>8}"
          f"{'batch':>7}{'kept':>6}{'gloo':>5}")
    for (world, name, micro, rank, stages, fly, measured, decomposed, resid, where, r, kept, sim, at,
         gloo) in rows:
        print(f"{world:>2} {name:<12}{micro:>2} {rank:>4} {','.join(map(str, stages)):<7}{fly:>4} {measured:>10,} "
              f"{decomposed:>10,} {resid:>6,} {where:<10}{r['params']:>8,}{r['state']:>8,}{r['recv_act']:>8,}"
              f"{r['recv_grad']:>8,}{r['recv_xgrad']:>8,}{r['chunks']:>8,}{r['inputs'] + r['targets']:>7,}{kept:>6,}"
              f"{gloo:>5,}")
    print("\nthe step's own bytes at the peak, by term (what the decomposition adds to params, state, buffers, batch)")
    print(f"{'W':>2} {'schedule':<12}{'M':>2} {'rank':>4} {'peak at':<10}" + "".join(f"{t:>10}" for t in TERMS)
          + " acts / one micro-batch")
    for (world, name, micro, rank, stages, fly, measured, decomposed, resid, where, r, kept, sim, at,
         gloo) in rows:
        alone = alones[(world, 2 if name in MULTI else 1)]
        per = " + ".join(f"{at_acts(at, alone, s, where)}" for s in stages[:1]) if len(stages) == 1 else "-"
        print(f"{world:>2} {name:<12}{micro:>2} {rank:>4} {where:<10}" + "".join(f"{at[t]:>10,}" for t in TERMS)
              + f" {per}")
    print(f"\n{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
