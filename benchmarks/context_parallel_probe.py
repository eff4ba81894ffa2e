"""Context parallelism's memory per rank, measured: torch's ``context_parallel`` on this CPU over gloo.

The ground truth for issue 60's context-parallel dimension. One process per CP rank (spawned, joined by gloo, a
one-dimensional ``DeviceMesh``), each running a small decoder built from code (token and position embeddings, two
pre-norm blocks: LayerNorm, qkv, ``F.scaled_dot_product_attention(is_causal=True)``, proj, LayerNorm, MLP; then
LayerNorm and a head; no download), fp32, AdamW, ``torch.manual_seed``, inside torch's ``context_parallel(mesh,
buffers=[ids, positions, targets], buffer_seq_dims=[1, 1, 1])`` with its default head-tail load balancer, under
``set_rotate_method("allgather")`` and ``("alltoall")``, with and without ``torch.utils.checkpoint`` of each block
(``use_reentrant=False``). Per rank, the CPU allocator's peak of one steady-state step (after a warm-up step that
builds AdamW's state): forward and cross-entropy on the rank's 1/cp of the sequence, ``backward()``,
``optimizer.step()``, ``zero_grad(set_to_none=True)``; read as autofit measures a rank (``core/_torch_profiler.py``'s
``memory_profile`` and ``window_memory``, one profile from the warm-up on, only the rank's own thread, the lowest of
three windows: Note [gloo's threads in the measured window], measure/ranks.py). Each peak is then rebuilt by hand
(Note [context parallel memory]) and the table prints measured, decomposed and the residual, for the lowest window
(what autofit keeps) and the highest. Once per CP degree (allgather, recompute off and on), one CP step's loss and
gradients are checked against the single-process full-sequence step's (the ranks' losses averaged, gradients
all-reduced / cp, as DDP or FSDP over the CP ranks would; ``allclose``, rtol 1e-4, gradients atol 1e-6).

    .venv-test/bin/python benchmarks/context_parallel_probe.py            # cp 2 and 4, both rotations, recompute off/on
    .venv-test/bin/python benchmarks/context_parallel_probe.py --worlds 2 --rotate alltoall --recompute off
    .venv-test/bin/python benchmarks/context_parallel_probe.py --worlds 2 --debug   # who holds the bytes at each peak

Result (torch 2.13.0, 2 CPU cores shared with other work, 70 to 95 s a run): 24 rank rows (cp 2 and 4 x allgather,
alltoall x recompute off, on); the CP step equals the full-sequence step (loss to 7 digits, largest gradient
difference 1.1e-08); residual 0 bytes in 22 to 23 of the 24 rows against the lowest window over the last four
full runs, and 22 to 23 against the highest. The exceptions are single windows, a different row each run, where
autofit's reading of the frees gloo's side makes is off (Note [context parallel memory], gloo and the
measurement).

How the CPU runs it (the one piece of this path that is not torch's). torch 2.13's ring attention has handlers for
the CUDA SDPA ops only: on the CPU ``context_parallel`` fails at the first attention ("Operator
aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy registered"). The probe
gives the CPU flash op and its backward what ``_enable_context_parallel_dispatcher_impl`` gives the CUDA ones:
``_register_cpu_ring_attention`` adds ``_ring_cpu_handler`` to ``_attention.custom_ops`` (which
``_enable_cp_dtensor_dispatcher`` merges into ``DTensor._op_dispatcher._custom_op_handlers`` on entering
``context_parallel``) and registers the ops' Shard(2) sharding strategy (outputs and tensor inputs sharded on the
sequence, as ``_sharding_rules.py`` does for the CUDA ops). The handler is ``_sdpa_handler``'s body (unwrap the
DTensors, propagate, wrap the local results) calling torch's own ``_templated_ring_attention`` /
``_templated_ring_attention_backward`` with the CPU op as ``op``. No wrapping was needed: the CPU op returns
``(out, logsumexp)`` and its backward ``(dq, dk, dv)``, what the templated code unpacks (``out, logsumexp, *rest =
op(...)``; ``grad_query_, grad_key_, grad_value_, *rest = op(...)``), its logsumexp is (batch, heads, seq) fp32
like CUDA flash's, and it takes the keyword arguments the templated code passes (the backward's ``dropout_p``,
which has no default, is passed). What differs from the CUDA path is only the attention kernel itself: the CPU op's
own allocations (the ``op`` columns below) stand where the CUDA kernel's would. Everything else in the measured
step is torch's: the buffer sharding and load balancer, the SDPA patch and DTensor wrapping, the rotaters, the
merger, the fp32 accumulators, the collectives, autograd, checkpoint, AdamW.

Note [context parallel memory]
    What a rank holds at its step's peak, each term with the torch code that holds it (torch 2.13;
    torch/distributed/tensor/experimental/_context_parallel/_attention.py unless named). Sizes at local length
    n = S / cp: u = one (rows, n, H) fp32 activation, which is also each of q, k, v, out and dout
    ((rows, heads, n, hd)); f = an MLP hidden (rows, n, FF); s = a LayerNorm's mean or rstd (rows, n);
    l = the logsumexp (rows, heads, n).

    - Parameters P, AdamW's state 2 P + 4 bytes per parameter tensor (``step``, optim/adam.py), the gradients made
      so far (column grads: head, final norm, the later blocks, this block's proj, ln2, fc1, fc2). CP replicates
      all of them: nothing is divided by cp.
    - The batch: ``context_parallel`` shards each buffer in place (``buffer.resize_(shard.shape); buffer.copy_
      (shard)``), and ``resize_`` never shrinks a storage: ids, positions and targets keep their full-length
      storage (12,288 B here at every cp). It also keeps a full-length clone of each (``original_buffers``, for its
      exit to restore; ``no_restore_buffers`` drops them): another 12,288 B per rank.
    - The activations autograd saves (column acts; ``block_acts``), at 1/cp of the sequence: per block ln1's input,
      output and stats, qkv's output (3 u: q, k, v are views of it, saved by the attention node
      ScaledDotProductFlashAttentionForCpuBackward0), the attention's out and logsumexp (u + l), and proj's input,
      ln2's, fc1's and gelu's outputs. Under CP the saved out and logsumexp are the ``_SDPAMerger``'s results,
      fp32 (``convert_to_f32``; for a bf16 model ``results()`` casts out back, the logsumexp stays fp32). One CP
      effect: proj's input ``a.transpose(1, 2).reshape(...)`` is a view where the attention output is laid out
      (rows, n, heads, hd), as the CPU op writes it and the merger's ``out - sigmoid(...) * (out - block_out)``
      keeps it, but a copy (u) where the merger's last ring step was partial: ``_partial_update``'s ``torch.cat``
      gives a contiguous (rows, heads, n, hd). That is every rank but the last (rank cp - 1's last step i = cp - 1
      is not above its rank), so the last rank holds u less per earlier block. With recompute, an earlier block
      keeps only its checkpointed input (u) and the CPU RNG state non-reentrant ``checkpoint`` saves
      (``preserve_rng_state``: ``torch.get_rng_state()``, 5,056 B), until its backward.
    - In flight (column flight): the gradient of the residual stream and of the attention output (u each), the
      loss's 4-byte seed and nll_loss's 4-byte total_weight.
    - The forward ring (``_templated_ring_attention``) is never at the peak: its buffers (the K,V ``torch.cat``
      sent, 2 u; the all-gather's 2 cp u or the all-to-all's 2 u per step; the merger's fp32 temporaries) die with
      the call, and what stays is the merged out and logsumexp counted in acts.
    - The backward ring, ``_templated_ring_attention_backward`` (replayed, references counted, in
      ``ring_backward``): the fp32 accumulators ``zeros_like(query / key / value, dtype=accum_dtype)`` (acc, 3 u;
      dK and dV give way to the received buffers from step 1); ``key.contiguous()`` and ``value.contiguous()``
      (kvcopy, 2 u: the saved k, v are strided views of qkv's output) until step 1 rebinds them; per step before
      the last, the K,V ``torch.cat`` sent (kvcat, 2 u) and the rotater's buffer: ``_AllGatherRotater``'s one
      ``all_gather_single`` of every rank's K,V (gathered, 2 cp u, kept to the call's end; gloo's
      ``allgather_into_tensor_coalesced_`` stages 2 u more for a moment) or ``_AllToAllRotater``'s
      ``permute_tensor`` output (recvKV, 2 u a step: from step 1 two are alive, the one in use and the next,
      4 u); the dK,dV ``torch.cat`` sent (dkvcat, 2 u; at
      step 0 ``flatten()`` first copies the strided dK and dV, 2 u for a moment) and the dK,dV received
      (recvdKV, 2 u; the dK,dV rotater is all-to-all whatever the rotate method); ``_partial_update``'s cats (dkv
      pu, u each, at steps i <= rank; dq pu, u, at steps i > rank); at steps i > rank the logsumexp chunk's
      ``.contiguous()`` (lse, l / 2).
    - The CPU op inside the ring (the handler's ``op``; columns op out, op dout, op buf): attention.cpp
      ``_scaled_dot_product_flash_attention_cpu_backward`` allocates the step's dq, dk, dv with ``zeros`` (sized
      by the step's query and key rows: n / 2 query rows at steps i > rank, n / 2 key rows at 0 < i <= rank), kept
      until the next step's return rebinds them, so two steps' worth are alive at once; FlashAttentionKernel.cpp
      ``flash_attention_backward_kernel_impl`` copies ``grad_out.contiguous()`` where dout is the chunk of a
      batched tensor (steps i > rank), and ``cpu_flash_attention_backward`` allocates ``buf`` (threads x 2 x
      qSplit x kvSplit fp32; qSplit 32 under 192 query rows, kvSplit min(512, key rows)) and ``dsum`` (qSplit
      fp32), all freed on return.

    Where the peak is (column peak at): inside the backward of a block's attention, the last block's without
    recompute (every earlier activation still saved), the first block's with recompute (the later block's
    gradients exist, its recomputed activations are gone); within the ring call at step 1's op for cp 2 and for
    all-to-all (step 2's on cp 4's rank 1), and for cp 4 all-gather at step 1's K,V cat, while the gathered
    buffer, the step-0 key/value copies and op outputs are all still alive. The gathered K,V (2 cp u, against
    the all-to-all's 2 u, 4 u from cp 3) separates the two rotate methods: all-gather's peak is 131,072 B higher at cp 2
    (2 (cp - 1) u) and 146,304 to 188,288 B higher at cp 4 (its peak falls at another moment of the call).

    gloo and the measurement: gloo's threads allocate buffers of their own (column gloo: every thread's window
    above the rank's own). In a full run (cp 4: four processes on two busy cores) one window of a rank now and then
    reads off the replay while the others equal it: below by 9,216 to 100,480 B (the lowest-of-three rule then
    keeps it), or above by 41,088 to 262,144 B. Runs of one configuration at cp 2 did not reproduce it. ``--debug``
    compares the lowest and highest windows tensor by tensor (``lifetimes``: the windows run the same code, so the
    n-th allocation is the same tensor), and in a debug run both kinds came from the dK,dV all-to-all of the ring
    backward, whose input (the dK,dV cat) and output (the received dK,dV) the profiler recorded no free of in that
    window (in the other windows the rank's thread freed them; here, presumably, gloo's worker dropped the last
    reference with the Work, on a thread the profiler does not follow):
    - cp 4 all-to-all rank 0, 16,384 B low: the two addresses were reused, so Note [a free the profiler did not
      record] put both frees at the rank's first collective wait after the allocation (at allocation #186), but the
      received dK,dV is held by the ring's Python (``grad_key`` / ``grad_value`` views, ``dkv_rotater._buffer``)
      until allocation #201: the inferred free came 15 allocations early, across the peak.
    - cp 4 all-gather rank 3, 41,088 B high: the addresses were not reused inside the window, so the frees were
      never seen and both tensors counted alive to the window's end.
    The first is a limit of the rule's placement (the first wait after the allocation is the earliest the free
    can be, not when it was, where the code holds the tensor past the wait); the second the gap that Note names.
    The column inferred gives, per window, the bytes of frees inferred from a reused address.

    Not measured: bf16 (the merger's and accumulators' fp32 would then be twice the bf16 terms), the CUDA
    kernels' own buffers, ``_cp_options.enable_load_balance = False``, a sequence not divisible by 2 cp (no load
    balancer), flex attention, CP combined with FSDP or TP, cp above 4.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from gloo_ranks import run_ranks, storage_bytes as _bytes  # noqa: E402
from torch.profiler import record_function  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

from autofit.core._torch_profiler import (  # noqa: E402
    UNRECORDED_THREAD, _allocation_events, memory_profile, window_memory)

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
        dropout_p, is_causal = (list(rest) + [0.0, False][len(rest):])[:2]  # the schema's defaults where left out
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
    mine = window_memory(prof, _STEP, _WINDOW, [known] * windows)
    every = window_memory(prof, _STEP)
    best = min(range(windows), key=lambda w: sum(mine[w][0].values()) + mine[w][1])
    events, _, spans = _allocation_events(prof, _WINDOW, _STEP)
    inferred = [sum(-e[1] for e in events if a <= e[0] <= b and e[2] == UNRECORDED_THREAD) for a, b in spans]
    return {
        "inferred": inferred,
        "params": _bytes(params), "state": _bytes(state), "batch": _bytes([ids, pos, target]),
        "restore": _bytes(restore), "alive": sum(mine[best][0].values()), "peak": mine[best][1],
        "windows": [sum(a.values()) + p for a, p in mine],
        "gloo": max(sum(e[0].values()) + e[1] - sum(m[0].values()) - m[1] for e, m in zip(every, mine)),
        "holders": peak_holders(prof, best),
        "lifetimes": [lifetimes(prof, w) for w in range(windows)],
    }


def lifetimes(prof, window: int) -> list[tuple[int, int | None, int, str, str]]:
    """Of the allocations this rank's thread made in a window (the events as autofit reads them:
    ``_allocation_events``), in order: (bytes, how many of them had been made when it was counted freed (None: not
    in the window), the thread of the free: 'rank', 'other' (gloo's, moved back to a wait) or 'inferred' (Note [a
    free the profiler did not record]), the allocating op). The windows run the same code, so the same ordinal is
    the same tensor: where two windows' peaks differ, the tensor whose free moved says why (``--debug``)."""
    from autofit.core._torch import EventType

    where: dict[tuple[int, int], str] = {}
    stack = [(n, ()) for n in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, parents = stack.pop()
        if node.tag == EventType.Allocation:
            where[(node.start_time_ns, node.extra_fields.ptr)] = " > ".join(
                p for p in parents if not p.startswith("probe::") and p != "PythonSubclass")[-80:]
        else:
            stack.extend((c, parents + (node.name,)) for c in node.children)
    events, marks, spans = _allocation_events(prof, _WINDOW, _STEP)
    start, end = spans[window]
    out: list[list] = []
    open_: dict[int, int] = {}  # address -> index in out
    for time_, size, tid, ptr in events:
        if not start <= time_ <= end:
            continue
        if size > 0 and tid in marks:
            open_[ptr] = len(out)
            out.append([size, None, "", where.get((time_, ptr), "")])
        elif size < 0 and ptr in open_:
            i = open_.pop(ptr)
            out[i][1] = len(out)
            out[i][2] = "rank" if tid in marks else "inferred" if tid == UNRECORDED_THREAD else "other"
    return [tuple(x) for x in out]


def peak_holders(prof, window: int) -> list[tuple[str, int]]:
    """Where the kept window's peak is and who holds its bytes: the rank's allocation events as autofit reads them
    (``_torch_profiler._allocation_events``: this thread's, with the frees gloo's thread made moved back to the
    rank's last collective wait), each allocation named by the ops the profile's event tree puts it under; of those
    made in the window, the ones alive at its high-water mark, summed by allocating op, the op running at the mark
    first. A reading aid for the decomposition, not the measurement (window_memory's count is)."""
    from autofit.core._torch import EventType
    where: dict[tuple[int, int], tuple[str, ...]] = {}
    stack = [(n, ()) for n in prof.profiler.kineto_results.experimental_event_tree()]
    while stack:
        node, parents = stack.pop()
        if node.tag == EventType.Allocation:
            where[(node.start_time_ns, node.extra_fields.ptr)] = parents
        else:
            stack.extend((c, parents + (node.name,)) for c in node.children)
    events, marks, spans = _allocation_events(prof, _WINDOW, _STEP)
    start, end = spans[window]
    live: dict[int, tuple[int, tuple[str, ...], bool]] = {}
    running, best, at, snapshot = 0, -1, (), {}
    for time_, size, tid, ptr in events:
        if not start <= time_ <= end:
            continue
        if size > 0 and tid in marks:
            live[ptr] = (size, where.get((time_, ptr), ()), False)
            running += size
        elif size < 0 and ptr in live:
            running -= live.pop(ptr)[0]
        if running > best:
            best, at, snapshot = running, live[ptr][1] if size > 0 and ptr in live else at, dict(live)
    by: dict[str, int] = {}
    for size, parents, _ in snapshot.values():
        key = " > ".join(p for p in parents if not p.startswith("probe::") and p != "PythonSubclass")[-100:]
        by[key] = by.get(key, 0) + size
    return [("PEAK IN " + " > ".join(at)[-90:], best)] + sorted(by.items(), key=lambda kv: -kv[1])


def rank_work(world: int, rank: int, configs: list) -> dict:
    """One rank's rows (and, for the first rotate method, the check against the full-sequence step), run by
    ``gloo_ranks.run_ranks`` in the rank's own process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    results: dict = {}
    mesh = init_device_mesh("cpu", (world,))
    _register_cpu_ring_attention()
    for rotate, recompute, checked in configs:
        if checked:
            set_rotate_method(rotate)
            results[("check", rotate, recompute)] = check(world, rank, mesh, recompute)
        results[(rotate, recompute)] = run_config(world, rank, mesh, rotate, recompute)
    return results


# ------------------------------------------------------------------------- the hand decomposition: who holds what
F32 = 4


def sizes(world: int) -> dict[str, int]:
    """One rank's tensor sizes in bytes at local length n = SEQ / world (all fp32): ``u`` a (rows, n, H) activation
    (and each of q, k, v, out, dout: (rows, HEADS, n, HD)), ``f`` an MLP hidden (rows, n, FF), ``s`` one of a
    LayerNorm's saved mean / rstd (rows, n), ``l`` the attention's logsumexp (rows, HEADS, n)."""
    t = ROWS * SEQ // world
    return {"n": SEQ // world, "u": t * H * F32, "f": t * FF * F32, "s": t * F32, "l": t * HEADS * F32}


def param_bytes() -> dict[str, int]:
    """Parameters by module, by hand (fp32), and the count of tensors (AdamW keeps a 4-byte ``step`` per tensor)."""
    ln, lin = 2 * H, lambda i, o: i * o + o  # noqa: E731
    block = {"ln1": ln, "qkv": lin(H, 3 * H), "proj": lin(H, H), "ln2": ln, "fc1": lin(H, FF), "fc2": lin(FF, H)}
    out = {f"b{b}.{k}": v * F32 for b in range(BLOCKS) for k, v in block.items()}
    out |= {"embed": VOCAB * H * F32, "pos": SEQ * H * F32, "norm": ln * F32, "head": lin(H, VOCAB) * F32}
    return out


TENSORS = 12 * BLOCKS + 2 + 2 + 2  # per block 2 per LayerNorm and Linear; embed, pos; norm; head


def block_acts(z: dict[str, int], through_attention: bool, proj_copy: bool) -> int:
    """What autograd saves for one block, or its part up to and with the attention (what is left of the block whose
    attention backward runs): ln1's input x (u) and mean, rstd (2 s); ln1's output, qkv's input (u); qkv's output
    (3 u, of which q, k, v are views: the attention node saves them); the attention's output and logsumexp (u + l:
    under CP the ``_SDPAMerger``'s fp32 results); then proj's input (u, where ``proj_copy``: see below), ln2's input
    (u) and mean, rstd, its output (fc1's input, u), fc1's output (gelu's input, f) and gelu's (fc2's input, f).

    proj's input is ``a.transpose(1, 2).reshape(b, n, H)``: a view where the attention output is laid out (b, n,
    heads, hd), as the CPU op writes it and the merger's ``out - sigmoid(...) * (out - block_out)`` keeps it; a copy
    (u) where the merger's last step was partial (``_partial_update``'s ``torch.cat`` of the chunks, contiguous
    (b, heads, n, hd)): every rank but the last, whose last ring step i = cp - 1 is above its rank."""
    head = z["u"] + 2 * z["s"] + z["u"] + 3 * z["u"] + z["u"] + z["l"]
    tail = (z["u"] if proj_copy else 0) + z["u"] + 2 * z["s"] + z["u"] + 2 * z["f"]
    return head if through_attention else head + tail


def ring_backward(world: int, rank: int, rotate: str, z: dict[str, int]) -> tuple[int, dict[str, int], str]:
    """The peak of one ``_templated_ring_attention_backward`` call above what existed at its start, and what it
    holds then by kind: a replay of torch's code (_attention.py, torch 2.13) with each tensor's references, a
    tensor freed when its last reference goes, and the CPU op (the handler's ``op``) as its C++ allocates: three
    ``zeros`` for the step's dq, dk, dv (attention.cpp ``_scaled_dot_product_flash_attention_cpu_backward``),
    then in ``flash_attention_backward_kernel_impl`` ``grad_out.contiguous()`` (a copy where dout is the chunk of a
    batched tensor), ``buf`` (threads x 2 x qSplit x kvSplit fp32; qSplit 32 under 192 query rows, 64 under 768,
    kvSplit min(512, kv rows)) and ``dsum`` (qSplit fp32), freed on return."""
    u, l, n = z["u"], z["l"], z["n"]
    live: dict[int, tuple[int, str]] = {}  # object id -> (bytes, kind)
    refs: dict[int, set[str]] = {}
    names: dict[str, int] = {}
    state = {"now": 0, "peak": 0, "at": {}, "next": 0, "here": "", "where": ""}

    def check(extra: dict[str, int] | None = None) -> None:
        now = state["now"] + sum((extra or {}).values())
        if now > state["peak"]:
            at: dict[str, int] = {}
            for size, kind in live.values():
                at[kind] = at.get(kind, 0) + size
            for kind, size in (extra or {}).items():
                at[kind] = at.get(kind, 0) + size
            state["peak"], state["at"], state["where"] = now, at, state["here"]

    def new(size: int, kind: str) -> int:
        state["next"] += 1
        live[state["next"]], refs[state["next"]] = (size, kind), set()
        state["now"] += size
        check()
        return state["next"]

    def bind(name: str, obj: int | None) -> None:  # ``name = obj`` (None: an outside tensor, or del)
        old = names.pop(name, None)
        if obj is not None:
            names[name] = obj
            refs[obj].add(name)
        if old is not None:
            refs[old].discard(name)
            if not refs[old]:
                state["now"] -= live.pop(old)[0]
                del refs[old]

    def transient(**sizes: int) -> None:
        check(sizes)

    threads = torch.get_num_threads()

    def op(qn: int, kvn: int, copy_dout: bool) -> None:  # the CPU backward op, qn query and kvn key rows
        for name, rows in (("dq_", qn), ("dk_", kvn), ("dv_", kvn)):
            bind("ret" + name, new(u * rows // n, "op dq,dk,dv"))
        q_split = 32 if qn < 192 else 64 if qn < 768 else 256
        q_split, kv_split = min(q_split, qn), min(512, kvn)
        transient(**{"op dout copy": u * qn // n if copy_dout else 0,
                     "op scratch": threads * 2 * q_split * kv_split * F32 + q_split * F32})
        for name in ("dq_", "dk_", "dv_"):
            bind("grad_" + name, names["ret" + name])
            bind("ret" + name, None)

    bind("grad_query", new(u, "fp32 dq,dk,dv accumulators"))  # zeros_like(query): strided like it
    bind("grad_key", new(u, "fp32 dq,dk,dv accumulators"))
    bind("grad_value", new(u, "fp32 dq,dk,dv accumulators"))
    bind("key", new(u, "k,v contiguous copies"))  # key.contiguous(): the saved k, v are views of qkv's output
    bind("value", new(u, "k,v contiguous copies"))
    for i in range(world):
        state["here"] = f"i={i} rotate"
        if i > 0:
            bind("buffer", names["kv_rotater"])  # kv_rotater.next_buffer(): the gathered or received K,V
            bind("key", names["buffer"])
            bind("value", names["buffer"])
        if i != world - 1:
            bind("next_kv", new(2 * u, "k,v cat (sent)"))
            if rotate == "allgather":
                if i == 0:  # _AllGatherRotater: one all_gather_single of every rank's K,V, kept to the call's end
                    bind("kv_rotater", new(2 * world * u, "gathered K,V (cp x local)"))
                    transient(**{"gather staging": 2 * u})  # c10d allgather_into_tensor_coalesced_'s copy
            else:  # _AllToAllRotater: permute_tensor's output, the previous rank's K,V
                bind("kv_rotater", new(2 * u, "received K,V"))
        partial = i > rank  # the load-balanced else branch: the query's second chunk against all of K,V
        if partial:
            bind("lse", new(l // 2, "lse chunk copy"))  # logsumexp.chunk(2)[1].contiguous()
        else:
            bind("lse", None)
        bind("k", names["key"])
        bind("v", names["value"])
        state["here"] = f"i={i} op"
        op(n // 2 if partial else n, n // 2 if 0 < i <= rank else n, partial and ROWS > 1)
        if i > 0:
            bind("next_grad_kv", names["dkv_rotater"])  # dkv_rotater.next_buffer(): the dK,dV passed on to here
            bind("grad_key", names["next_grad_kv"])
            bind("grad_value", names["next_grad_kv"])
            if i <= rank:  # _partial_update: a cat of the chunks, the first chunk added to
                bind("grad_key", new(u, "dK,dV partial update"))
                bind("grad_value", new(u, "dK,dV partial update"))
        state["here"] = f"i={i} dK,dV"
        if i == 0:  # grad_key is zeros_like(the strided key): flatten() copies it and grad_value for the cat
            transient(**{"dK,dV flatten copies": 2 * u, "dK,dV cat (sent)": 2 * u})
        bind("next_grad_kv", new(2 * u, "dK,dV cat (sent)"))
        bind("dkv_rotater", new(2 * u, "received dK,dV"))  # the all-to-all rotater, whatever the rotate method
        if partial:
            bind("grad_query", new(u, "dQ partial update"))
    return state["peak"], state["at"], state["where"]


RNG_STATE = 5056  # torch.get_rng_state(): the CPU generator's state, a uint8 tensor (mt19937 and its extras)


def outside(world: int, rank: int, recompute: bool, block: int) -> dict[str, int]:
    """What the rank holds besides the ring call while block ``block``'s attention backward runs: parameters, AdamW
    state, the batch, context_parallel's restore copies; the gradients made so far (head, norm, the later blocks,
    this block's proj, ln2, fc1, fc2); the activations still saved (earlier blocks whole, or, recomputed, only their
    checkpointed input; this block's part through the attention); the gradients in flight (the residual stream's
    and the attention output's, u each); the loss's 4-byte seed and nll_loss's 4-byte total_weight. Recomputed:
    each block not yet through its backward keeps the CPU RNG state its checkpoint saved (non-reentrant
    ``checkpoint``'s ``preserve_rng_state=True``: ``torch.get_rng_state()``, 5,056 B)."""
    z, p = sizes(world), param_bytes()
    params = sum(p.values())
    done = [f"b{b}.{k}" for b in range(block + 1, BLOCKS) for k in ("ln1", "qkv", "proj", "ln2", "fc1", "fc2")]
    done += [f"b{block}.{k}" for k in ("proj", "ln2", "fc1", "fc2")] + ["norm", "head"]
    earlier = z["u"] if recompute else block_acts(z, False, rank < world - 1)
    return {
        "params": params, "state": 2 * params + 4 * TENSORS, "batch": 3 * ROWS * SEQ * 8,
        "restore": 3 * ROWS * SEQ * 8,  # context_parallel's clone of each buffer (ids, pos, target), full length
        "grads": sum(p[k] for k in done),
        "acts": block * earlier + block_acts(z, True, False),
        "in flight": 2 * z["u"] + 8, "rng": (block + 1) * RNG_STATE if recompute else 0,
    }


def decompose(world: int, rank: int, rotate: str, recompute: bool) -> tuple[int, str, dict[str, int]]:
    """The rank's peak by hand: the largest, over the blocks, of what is held outside the ring call at that block's
    attention backward plus the ring call's own peak (``ring_backward``). Returns (bytes, where, the terms)."""
    ring, at, step = ring_backward(world, rank, rotate, sizes(world))
    best = None
    for block in range(BLOCKS):
        terms = outside(world, rank, recompute, block) | {"ring " + k: v for k, v in at.items()}
        total = sum(terms.values())
        if best is None or total > best[0]:
            best = (total, f"b{block} {step}", terms)
    return best


COLUMNS = {  # term -> column header, in the order of the terms table
    "grads": "grads", "acts": "acts", "in flight": "flight", "rng": "rng",
    "ring fp32 dq,dk,dv accumulators": "acc", "ring k,v contiguous copies": "kvcopy", "ring k,v cat (sent)": "kvcat",
    "ring gathered K,V (cp x local)": "gathered", "ring received K,V": "recvKV", "ring lse chunk copy": "lse",
    "ring op dq,dk,dv": "op out", "ring op dout copy": "op dout", "ring op scratch": "op buf",
    "ring dK,dV flatten copies": "flatten", "ring dK,dV cat (sent)": "dkvcat", "ring received dK,dV": "recvdKV",
    "ring dK,dV partial update": "dkv pu", "ring dQ partial update": "dq pu", "ring gather staging": "staging",
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4", help="CP degrees (one process per rank)")
    parser.add_argument("--rotate", default="allgather,alltoall")
    parser.add_argument("--recompute", default="off,on")
    parser.add_argument("--debug", action="store_true", help="print who holds the bytes at each peak")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    start = time.perf_counter()
    rotates, recomputes = args.rotate.split(","), [r == "on" for r in args.recompute.split(",")]
    configs = [(rot, rec, rot == rotates[0]) for rot in rotates for rec in recomputes]
    print(f"torch {torch.__version__}, gloo on this CPU; decoder: embedding {VOCAB}x{H} + positions {SEQ}x{H}, "
          f"{BLOCKS} blocks (LayerNorm, qkv, causal SDPA {HEADS} heads x {HD}, proj, LayerNorm, MLP {H}->{FF}->{H}), "
          f"LayerNorm + head; batch {ROWS}x{SEQ} tokens, fp32, AdamW")
    rows, checks = [], []
    for world in (int(w) for w in args.worlds.split(",")):
        results = run_ranks(rank_work, world, configs, "cpprobe-")
        for rotate, recompute, checked in configs:
            if checked:
                checks.append((world, recompute, [result[("check", rotate, recompute)] for result in results]))
            for rank, result in enumerate(results):
                r = result[(rotate, recompute)]
                base = r["params"] + r["batch"] + r["restore"]
                measured, highest = base + min(r["windows"]), base + max(r["windows"])
                decomposed, where, terms = decompose(world, rank, rotate, recompute)
                rows.append((world, rotate, recompute, rank, measured, highest, decomposed, where, terms, r))
                if args.debug:
                    print(world, rotate, recompute, rank,
                          {k: v for k, v in r.items() if k not in ("holders", "lifetimes")})
                    for k, v in r["holders"]:
                        print(f"    {v:>10,}  {k}")
                    low, high = (min(range(3), key=lambda w: r["windows"][w]),
                                 max(range(3), key=lambda w: r["windows"][w]))
                    if r["windows"][low] != r["windows"][high]:  # the tensors whose free moved between the two
                        a, b = r["lifetimes"][low], r["lifetimes"][high]
                        print(f"    windows {r['windows']}: lowest {low} against highest {high}"
                              + ("" if len(a) == len(b) else f" (allocation counts differ: {len(a)}, {len(b)})"))
                        for i, (x, y) in enumerate(zip(a, b)):
                            if x[:3] != y[:3]:
                                print(f"      #{i} {x[0]:>8,} freed at #{x[1]} ({x[2]}) against #{y[1]} ({y[2]})  "
                                      f"{x[3]}")
    print("\ncorrectness: one CP step (loss averaged, gradients all-reduced / cp) against the full-sequence step in "
          "one process, allclose rtol 1e-4 (gradients atol 1e-6)")
    for world, recompute, per_rank in checks:
        c = per_rank[0]
        verdict = "equal" if all(x["ok"] for x in per_rank) else "DIFFERENT"
        print(f"  cp {world} recompute {'on' if recompute else 'off':<3}: {verdict}; "
              f"loss {c['loss']:.7f} vs {c['ref_loss']:.7f}; largest gradient difference {c['worst'][1]:.2e} "
              f"({c['worst'][0]})")
    print("\nper rank, one steady-state step: measured (the allocator, this rank's thread, lowest of three windows, as "
          "autofit keeps it; and the highest) against the decomposition")
    print(f"{'cp':>2} {'rotate':<9} {'recomp':<6} {'rank':>4} {'measured':>10} {'decomposed':>10} {'resid':>8} "
          f"{'highest':>10} {'resid':>8}  {'peak at (hand)':<16} {'gloo':>9} {'inferred':>17}")
    for world, rotate, recompute, rank, measured, highest, decomposed, where, terms, r in rows:
        print(f"{world:>2} {rotate:<9} {'on' if recompute else 'off':<6} {rank:>4} {measured:>10,} {decomposed:>10,} "
              f"{measured - decomposed:>8,} {highest:>10,} {highest - decomposed:>8,}  {where:<16} {r['gloo']:>9,} "
              f"{'/'.join(f'{x:,}' for x in r['inferred']):>17}")
    print("\nthe decomposition's terms at the peak (bytes); every row also holds params 366,848 (measured "
          f"{rows[0][9]['params']:,}), AdamW state 2P + 4 x {TENSORS} = {2 * 366848 + 4 * TENSORS:,} (measured "
          f"{rows[0][9]['state']:,}), the batch {rows[0][8]['batch']:,} and context_parallel's restore copies "
          f"{rows[0][8]['restore']:,}")
    used = [k for k in COLUMNS if any(row[8].get(k) for row in rows)]
    print(f"{'cp':>2} {'rotate':<9} {'recomp':<6} {'rank':>4}" + "".join(f"{COLUMNS[k]:>10}" for k in used))
    for world, rotate, recompute, rank, measured, highest, decomposed, where, terms, r in rows:
        print(f"{world:>2} {rotate:<9} {'on' if recompute else 'off':<6} {rank:>4}"
              + "".join(f"{terms.get(k, 0):>10,}" for k in used))
    print(f"\n{time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
