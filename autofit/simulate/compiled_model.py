"""A compiled model in a simulation: compiled by inductor on the fake copy, without kernels, and warmed up before the
tracked step (Note [inductor without kernels], autofit/core/_torch_compile.py).

Note [compiled models on a GPU target]
    The simulation compiles the model with inductor for this CPU: its CPU decompositions, the partitioner's choice of
    what to save for backward, its C++ kernels' fusions and buffer reuse. On a GPU inductor lowers to Triton with
    CUDA's decompositions and other fusions, and none of that can be run without a GPU. The CPU lowering can come
    out below what the GPU holds (a published GPT-2-style run, bf16, batch 32 x 1024: 11.8 % under its
    ``max_memory_reserved``), and under is the dangerous side. So for a CUDA target a compiled step is simulated
    twice, as inductor compiles it for the CPU and eagerly (compiled code run as plain PyTorch, the CUDA rules of
    ``autofit/cuda`` applied to both), and the estimate is the simulation with the larger allocated peak: an upper
    bound on both of them, by construction. It is an upper bound on the compiled GPU step where inductor's CUDA
    graph saves and holds no more than eager PyTorch does, which is what its min-cut partitioner and fusions aim
    at (activation memory is a term of its cost). PyTorch's inductor dashboard (AMP training on an A100, "Peak
    Memory Compression Ratio", eager peak / compiled peak, https://github.com/pytorch/pytorch/issues/96191) shows
    it for default-mode inductor (without CUDA graphs): 1.03 on hf_Bert, 1.16 on hf_GPT2, 1.17 on BERT_pytorch,
    1.26 on hf_Albert, and 0.997 at the lowest (tts_angular): a compiled peak at most 0.3 % above eager's on those
    models. It is not an upper bound on what eager would never allocate:
    Triton autotuning's benchmark buffers (first step only), or a reserve that a different allocation order
    fragments more (a published batch-8 run reserved 4.9 % more compiled than eager). The estimate's notes say which
    simulation it took and what the other gave. A CPU target keeps the compiled simulation: there it is the program
    that runs, and the CPU allocator agrees with it. The planner's analysis (a simulation with an observer, whose
    per-layer records must come from one run, at micro-batches of 2 and 3 rows) models the eager step, observed
    last (an observer keeps what it saw last): the bound's growth in the micro-batch is eager's, which keeps more
    per row than inductor's partitioner saves, though at 2 or 3 rows the compiled step's fixed buffers can hold
    more. Until 2026-12-01 the analysis modelled the compiled step, and where eager held more at the plan's
    micro-batch the first verified choices missed: Llama-3.1-8B on 8 H100s, ``--compile``, was re-planned "with
    27.70 GiB of margin", a margin that then struck out configurations the bound fits. The time does not follow:
    the step that runs is the compiled one, so the time model prices the compiled simulation's ops
    (``Simulation.priced_timeline``) whichever holds the peak, in the analysis as in the verification.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from torch import nn

from autofit.core._torch import compiled_modules
from autofit.core._torch_compile import compile_settings, recompile_limit, simulated_compile
from autofit.features import FEATURES
from autofit.training.step import run_micro_batch

__all__ = ["compiled_for_simulation", "warm_up", "compiled_note", "limit_note", "upper_bound", "modelled_as_eager"]


@contextlib.contextmanager
def compiled_for_simulation(work: nn.Module, fake: bool, knob: bool = False,
                            limited: list[str] | None = None) -> Iterator[bool]:
    """Compile the fake copy's compiled modules as inductor would (the kernels left out), and with ``knob``
    (``compile=True``) the copy itself unless the user compiled it already; yields whether any was compiled.
    A real run (Note [data-dependent models]) runs compiled code eagerly. ``limited`` collects the frames that
    reached dynamo's recompile limit (:func:`limit_note`)."""
    modules = compiled_modules(work) if fake else []
    whole = work if fake and knob and not any(name == "" for name, _ in modules) else None
    with simulated_compile(modules, whole, limited):
        yield whole is not None or any(compile_settings(m).backend == "inductor" for _, m in modules)


def warm_up(work: nn.Module, micro, micro_target, loss_fn, config) -> None:
    """One forward and backward before tracking: dynamo compiles the forward on the first call and AOTAutograd the
    backward on the first backward, and neither compile belongs in the step's timeline. The gradients are dropped."""
    run_micro_batch(work, micro, micro_target, loss_fn, config, "cpu", features=FEATURES)
    for p in work.parameters():
        p.grad = None


def compiled_note(model: nn.Module, compiled: bool, knob: bool = False) -> str | None:
    """The estimate's note on the user's compiled modules, or on the ``compile=True`` knob."""
    names = [name or "the model" for name, _ in compiled_modules(model)]
    if knob and not names:
        names = ["the model (compile=True)"]
    if not names:
        return None
    if compiled:
        return (f"{', '.join(names)}: torch.compile'd; simulated as inductor compiles it for this CPU, the generated "
                "kernels left out (see Note [inductor without kernels]); on a GPU the saved activations carry over, "
                "inductor's Triton buffers may differ")
    return (f"{', '.join(names)}: torch.compile'd, simulated eagerly (a real run of a data-dependent step, or the "
            "'eager' backend): what compilation changes is not modelled (see Note [compiled code in a simulation])")


def limit_note(model: nn.Module, limited: list[str]) -> str | None:
    """The estimate's note on the frames that reached dynamo's ``recompile_limit`` in the simulated step (Note [a
    simulation leaves no cache entries], core/_torch_compile.py), or None."""
    if not limited:
        return None
    note = (f"torch.compile reached its recompile limit ({recompile_limit()}, torch._dynamo.config."
            f"recompile_limit) on {', '.join(dict.fromkeys(limited))}: from then on dynamo runs that function "
            "eagerly, in the simulation as in a real run, so what it calls is estimated and priced uncompiled")
    if getattr(getattr(model, "config", None), "use_cache", False):
        note += ("; the model builds a KV cache in training (config.use_cache=True), whose layer index each layer's "
                 "compiled frame is guarded on: set use_cache=False (training never reads the cache)")
    return note


def upper_bound(compiled: Any, eager: Any) -> Any:
    """The simulation (``run.Simulation``) with the larger allocated peak of a compiled step simulated as inductor
    compiles it for this CPU and eagerly, with a note saying which (Note [compiled models on a GPU target])."""
    chosen = compiled if compiled.replay.peak_bytes >= eager.replay.peak_bytes else eager
    which = "inductor's CPU lowering" if chosen is compiled else "the eager step"
    note = (f"torch.compile'd for a GPU target: inductor's CUDA lowering is not simulated; the estimate is the larger "
            f"of two simulations, inductor's CPU lowering ({compiled.replay.peak_bytes:,} bytes of tensors at the "
            f"peak) and the eager step ({eager.replay.peak_bytes:,}), here {which}: an upper bound where inductor "
            f"on the GPU keeps no more than eager PyTorch, not on Triton's autotuning buffers (see Note [compiled "
            f"models on a GPU target])")
    notes = tuple(n for n in compiled.notes if "torch.compile'd" not in n) + (note,)
    # the time model prices the compiled step's ops either way: eager only bounds its memory
    return replace(chosen, notes=notes, compiled=True, compiled_timeline=compiled.timeline)


def modelled_as_eager(compiled: Any, eager: Any) -> Any:
    """The planner's analysis of a compiled step for a GPU target: the eager simulation, priced as the compiled step
    (Note [compiled models on a GPU target])."""
    return replace(eager, notes=compiled.notes, compiled=True, compiled_timeline=compiled.timeline)
