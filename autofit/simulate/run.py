"""Run one steady-state training step on a copy of the model, under the :class:`StepTracker`.

The copy is fake (no memory) unless the model's code depends on tensor values (``.item()``, ``if x.norm() > c``,
``nonzero``): fake tensors have no values, so such steps run on a real copy at the requested micro-batch instead,
with the same tracker (see Note [data-dependent models]).

Steady state (docs/memory-model.md): optimizer state exists before the step. It is created by one optimizer step
over zero gradients before tracking starts; state of parameters that then receive no gradient in the step is dropped
from the timeline, since a real optimizer never creates it.

Note [data-dependent models]
    A fake tensor cannot answer ``bool(x.norm() > c)``: FakeTensorMode raises DataDependentOutputException (or
    DynamicOutputShapeException for ``nonzero``). The branch taken depends on the data, so no value-free simulation
    can be right; autofit runs the step for real on the CPU with the user's sample rows, tracked exactly like the fake
    run (the kernel probes supply the workspace terms). This needs real weights and enough host memory for one step.
    A fake kernel that refuses inputs its CPU kernel accepts, with no correction in autofit/capture/corrections.py
    (``FakeKernelStricter``), falls back the same way.

Note [compiled code in a simulation]
    Code compiled with ``torch.compile`` cannot run its kernels on fake tensors (inductor's CPU kernels read data
    pointers: a simulation after a real compiled step segfaulted), so while a simulation runs, compiled code runs
    eagerly (``torch.compiler.set_stance("force_eager")``), except a compiled model of a fake run: the copy is
    compiled by inductor without kernels (Note [inductor without kernels], core/_torch_compile.py). A compiled
    optimizer step is measured for real instead (Note [compiled optimizer steps], compiled_steps.py).

Note [MoE routing]
    Whether a mixture-of-experts layer's memory depends on the routing depends on its implementation (transformers
    5.x, integrations/moe.py). ``grouped_mm_experts_forward`` (the default) sorts the tokens x top-k (token, expert)
    pairs by expert and runs one grouped GEMM over all of them: every tensor is sized by tokens x top-k, whatever
    the routing, and the grouped GEMM's CPU kernel writes one ``mm`` per group into slices of a fixed-size output
    (aten/src/ATen/native/GroupedMMUtils.h, ``_grouped_mm_fallback``), so only its scratch could depend on the group
    sizes; the kernel probe measures it with every row in one group, the largest GEMM a routing can ask for
    (autofit/capture/corrections.py). Measured on Mixtral: identical peaks for a batch that routes every token alike and a
    random batch (tests/test_architectures.py). The ``eager`` implementation loops over the experts that were hit
    (``nonzero``, a data-dependent shape: the real-run fallback), and its buffers are sized by the tokens each
    expert receives and by how many experts are hit. Measured on the same model (micro-batch 2): every token to the
    same two experts 1,154,688 B, a random batch 1,196,720 B, balanced round-robin 1,191,164 B, every token to the
    last expert plus a spread 1,176,020 B, every token to the first expert plus a spread 1,206,152 B (+4.5 %). The
    real run therefore does not use the sample's routing: ``routing.py`` reroutes each per-expert loop to that
    heaviest measured routing (a forward pre-hook on ``top_k_index``; router and gradients untouched), so the
    estimate and the plan do not change with the batch, and a note says so. It is the heaviest routing measured,
    not a proven bound over all routings.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from torch import nn

from autofit.core._torch import FakeTensorMode, disable_current_modes
from autofit.core._torch_compile import compiled_code_runs_eagerly
from autofit.training.batch import Batch
from autofit.capture.model_copy import (
    fake_copy,
    fake_input,
    mode_note,
    real_copy,
    require_real_inputs,
    trained_from_eval,
)
from autofit.capture.module_stack import install_module_stack
from autofit.capture.user_hooks import PreviousStep, hook_note, user_hooks_restored
from autofit.core import progress
from autofit.core.categories import Category
from autofit.core.errors import UnsupportedModelError
from autofit.features import FEATURES, convert_model
from autofit.training.loss import LossFn
from autofit.simulate.compiled_model import (compiled_for_simulation, compiled_note, limit_note, modelled_as_eager,
                                             upper_bound, warm_up)
from autofit.simulate.compiled_steps import measured_compiled_steps
from autofit.simulate.foreach import target_implementation
from autofit.simulate.offload import offloaded_states, tracked_save_on_cpu
from autofit.parallel.host import optimizer_runs_on
from autofit.parallel.simulated import simulated_mesh
from autofit.parallel.schedule import schedule_of
from autofit.simulate.probe import KernelProber
from autofit.simulate.randomness import Draws, draws_at, worst_of_extremes
from autofit.simulate.routing import heavy_routing_during
from autofit.core.shared import shared
from autofit.core.units import format_bytes
from autofit.simulate.state import tracked_rng_state
from autofit.simulate.timeline import Replay, Timeline, replay
from autofit.simulate.traced_checks import eager_answers
from autofit.simulate.tracker import StepTracker
from autofit.simulate.value_twins import MAX_TWIN_BYTES, ValueTwins, reader_note
from autofit.simulate.window import DataDependent, StepState, forward_errors, run_window
from autofit.training.step import StepConfig, patched_model
from autofit.parallel.apply import apply_layout

__all__ = ["Simulation", "simulate_step", "probes_kernels", "DeviceRules"]


# One prober per process: kernel scratch sizes depend only on the kernel signature and the machine.
_PROBER = KernelProber()


def probes_kernels(config: StepConfig, probe_kernels: bool = True) -> bool:
    """Whether a simulation of ``config`` runs real CPU kernels to measure their scratch memory: then it must run in
    this process, with its thread count (Note [parallel simulations], autofit/core/workers.py)."""
    return probe_kernels and config.device.is_host


@dataclass(frozen=True)
class Simulation:
    timeline: Timeline
    replay: Replay
    method: str  # "fake" or "real" (see Note [data-dependent models])
    notes: tuple[str, ...] = field(default_factory=tuple)
    preallocated_grads: bool = False  # the step allocated its gradients before forward (training/grads.py)
    compiled: bool = False  # the model ran as inductor compiles it (Note [inductor without kernels])
    random_draws: int = 0  # random decisions forced to an extreme (Note [random layer skipping], randomness.py)
    input_rows: int = 0  # rows of inputs and targets resident all step (StepConfig.held_rows, at least the micro-batch)
    # the module that read values of the sample's rows ("" at the top level; Note [rows that differ],
    # solve/estimator.py), or None where no read did: then every micro-batch of the sample runs the same step
    row_reader: str | None = None
    row_program: Any = field(default=None, compare=False, repr=False)  # those reads, to run on other rows (RowProgram)
    # the compiled step's timeline where the eager one bounds the memory (Note [compiled models on a GPU target]): the
    # time model prices the step that runs, compiled, whichever simulation holds the peak
    compiled_timeline: Timeline | None = field(default=None, compare=False, repr=False)
    # (global rank, peak) of each rank whose step differs (a pipeline's stages), where more than one does; the rest
    # of the simulation is the highest one's
    rank_peaks: tuple[tuple[int, int], ...] = ()

    @property
    def priced_timeline(self) -> Timeline:
        """The timeline whose ops the time model prices: the compiled step's (see ``compiled_timeline``)."""
        return self.compiled_timeline if self.compiled_timeline is not None else self.timeline


# The target device's part of a simulation: enters its kernel and autocast rules on ``stack`` and returns the
# autocast caster whose weight cache must be cleared when each micro-batch's autocast region exits (or None).
DeviceRules = Callable[[contextlib.ExitStack, StepConfig], Any]


class Observer(Protocol):
    """Extra instrumentation for a simulation (the analysis attaches saved-tensor and module hooks this way)."""

    def attach(self, tracker: StepTracker, model: nn.Module) -> contextlib.AbstractContextManager: ...


def simulate_step(
    model: nn.Module, batch: Batch, target: Any, loss_fn: LossFn | None, config: StepConfig, *,
    probe_kernels: bool = True, observer: Observer | None = None, device_rules: DeviceRules | None = None,
) -> Simulation:
    """Simulate one training step of ``config`` and return its timeline and replayed peak.

    ``device_rules`` is the target device's part of the simulation (``DeviceTarget.simulation_rules``: on CUDA the
    autocast op policy and attention kernels); a CUDA step needs it, and the caller resolves the device once."""
    if not config.device.is_host and device_rules is None:
        raise TypeError("simulate_step: a CUDA step needs device_rules=resolve_device('cuda', gpu).simulation_rules")
    if observer is None:  # the same step for another card of the same rules: Note [one analysis for several cards]
        return shared("simulate_step", functools.partial(_hooked_step, model, batch, target, loss_fn, config,
                                                         probe_kernels=probe_kernels, device_rules=device_rules),
                      model=model, batch=batch, target=target, loss_fn=loss_fn, config=config,
                      device_rules=device_rules, extra=(probe_kernels,))
    return _hooked_step(model, batch, target, loss_fn, config, probe_kernels=probe_kernels, observer=observer,
                        device_rules=device_rules)


def _hooked_step(model: nn.Module, batch: Batch, target: Any, loss_fn: LossFn | None, config: StepConfig, *,
                 probe_kernels: bool = True, observer: Observer | None = None,
                 device_rules: DeviceRules | None = None) -> Simulation:
    with user_hooks_restored(model) as hooks:  # Note [user hooks]
        sim = _simulate_step(model, batch, target, loss_fn, config, probe_kernels=probe_kernels, observer=observer,
                             device_rules=device_rules)
    if hooks.slots:  # again, with what the previous step's hooks kept alive at the start (Note [kept across steps])
        with user_hooks_restored(model):
            sim = _simulate_step(model, batch, target, loss_fn, config, probe_kernels=probe_kernels,
                                 observer=observer, device_rules=device_rules, previous=PreviousStep(hooks))
    if hooks.kept:
        sim = replace(sim, notes=sim.notes + (hook_note(hooks),))
    if trained_from_eval(model):  # Note [training mode], capture/model_copy.py
        sim = replace(sim, notes=sim.notes + (mode_note(model),))
    return sim


def _simulate_step(model, batch, target, loss_fn, config: StepConfig, *, probe_kernels: bool,
                   observer: Observer | None, device_rules: DeviceRules | None,
                   previous: PreviousStep | None = None) -> Simulation:
    """The step of each rank whose step differs (``Layout.distinct_ranks``: one per pipeline stage; rank 0 stands
    for all in any other layout): the one with the highest peak, every one's peak in ``rank_peaks``. An observer
    keeps what it saw last, so the highest is run again when another ran after it."""
    ranks = config.layout.layout.distinct_ranks
    if ranks == (0,):
        return _one_rank(model, batch, target, loss_fn, config, _Around(probe_kernels, observer, device_rules,
                                                                           previous))
    sims = []
    for rank in ranks:
        progress.step(f"rank {rank} of the ranks whose steps differ ({', '.join(map(str, ranks))})")
        sims.append(_one_rank(model, batch, target, loss_fn, config,
                              _Around(probe_kernels, observer, device_rules, previous, rank)))
    peaks = tuple(s.replay.peak_bytes for s in sims)
    worst = max(range(len(sims)), key=peaks.__getitem__)
    sim = sims[worst]
    if observer is not None and worst != len(sims) - 1:
        sim = _one_rank(model, batch, target, loss_fn, config,
                        _Around(probe_kernels, observer, device_rules, previous, ranks[worst]))
    note = (f"the ranks' steps differ ({config.layout.label}): each was simulated, and the figures are rank "
            f"{ranks[worst]}'s, the highest peak; every rank's peak: "
            + ", ".join(f"rank {r} {format_bytes(p)}" for r, p in zip(ranks, peaks)))
    timed = schedule_of(config.layout, config.accumulation_steps).note()  # a pipeline's wait (Note [one schedule])
    return replace(sim, notes=sim.notes + (note,) + ((timed,) if timed else ()), rank_peaks=tuple(zip(ranks, peaks)))


def _one_rank(model, batch, target, loss_fn, config: StepConfig, around: _Around) -> Simulation:
    """The step of the rank ``around.rank``."""
    observer = around.observer
    try:
        with _quiet_engines():
            sim = worst_of_extremes(functools.partial(_simulate, model, batch, target, loss_fn, config, around,
                                                      fake=True), observed=observer is not None)
            if not config.device.is_host and sim.compiled:  # Note [compiled models on a GPU target]
                eager = _simulate(model, batch, target, loss_fn, config, around, fake=True, eager=True)
                # the analysis (an observer, which keeps what it saw last: the eager run) models the eager step
                sim = upper_bound(sim, eager) if observer is None else modelled_as_eager(sim, eager)
            return sim
    except DataDependent as e:
        require_real_inputs(batch, target, reader=f"{e.subject} reads tensor values ({e.cause})")
        try:
            with _quiet_engines():
                sim = worst_of_extremes(functools.partial(_simulate, model, batch, target, loss_fn, config, around,
                                                     fake=False), observed=observer is not None)
        except UnsupportedModelError as e2:
            raise UnsupportedModelError(
                f"{e.subject} {e.why} ({e.cause}), so autofit must run the step for real, but: {e2}"
            ) from e
        note = (f"{e.subject} {e.why} ({e.cause}); the step was run "
                "for real on the CPU with the sample's rows (see Note [data-dependent models])")
        notes = sim.notes + (note,)
        return Simulation(sim.timeline, sim.replay, "real", notes, sim.preallocated_grads,
                          random_draws=sim.random_draws, input_rows=sim.input_rows)


@contextlib.contextmanager
def _quiet_engines() -> Iterator[None]:
    """Warnings FSDP2 gives about the user's training code, not about a simulation: that a wrapped module returns a
    view (an in-place op on it would skip the all-gather: torch/distributed/fsdp/_fully_shard/_fsdp_state.py). A
    plan simulates FSDP2 on many configurations, so it would repeat; the trainer's real ``fully_shard`` still warns."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        yield


@dataclass(frozen=True)
class _Around:
    """What every simulation of one step runs with, besides the step: whether it probes the CPU's kernels, the
    caller's instruments, the target device's rules, and what the previous step's hooks kept (Note [kept across
    steps]), or None."""

    probe_kernels: bool
    observer: Observer | None
    device_rules: DeviceRules | None
    previous: PreviousStep | None
    rank: int = 0  # the global rank simulated (Layout.distinct_ranks)


def _simulate(model, batch, target, loss_fn, config: StepConfig, around: _Around, *, fake: bool,
              eager: bool = False, extreme: str = "top", locate: bool = False) -> Simulation:
    """One simulation; ``eager``: compiled code runs eagerly (Note [compiled models on a GPU target]); ``extreme``:
    where small random draws land (Note [random layer skipping])."""
    observer, device_rules, previous = around.observer, around.device_rules, around.previous
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    prober = _PROBER if probes_kernels(config, around.probe_kernels) else None
    if prober is not None:
        prober.skipped = prober.failed = 0
    work = convert_model(config, fake_copy(model, fake_mode) if fake else real_copy(model).to("cpu"))
    # the device mesh holds real tensors: it is made before the fake mode is entered
    mesh_ctx = simulated_mesh(config.layout, around.rank)
    # the optimizer and clipping take the implementation torch picks on the target (foreach on CUDA)
    # the optimizer of a CPU-offloaded step steps host tensors: torch picks its CPU implementation (Note [offload])
    implementation = optimizer_runs_on(config.layout, config.device)
    # Note [compiled code in a simulation]; a compiled optimizer step is measured for real (compiled_steps.py)
    compiled = measured_compiled_steps() if fake else contextlib.nullcontext()
    limited: list[str] = []  # frames that reached dynamo's recompile limit (Note [a simulation leaves no cache entries])
    with mesh_ctx as mesh, fake_mode if fake else contextlib.nullcontext(), target_implementation(implementation), \
            compiled_code_runs_eagerly(), compiled, \
            compiled_for_simulation(work, fake and not eager, config.compile and not eager, limited) as inductor:
        if mesh is not None:  # cut, split and shard before the optimizer is built, as the trainer does
            work = apply_layout(work, config.layout, mesh=mesh, param_dtype=config.precision.param_dtype)
        to_sim = functools.partial(fake_input, fake_mode) if fake else (lambda t: t.to("cpu"))
        micro = batch.map_tensors(to_sim).resize(config.micro_batch_size)
        micro_target = None if target is None else target.map_tensors(to_sim).resize(config.micro_batch_size)
        state = StepState.build(work, config, fake, micro, micro_target)
        # the step runs on this CPU's kernels when the CPU is the target, or when it runs for real (Note [CPU kernels])
        tracker = StepTracker(prober=prober, kernels_for=config.device if config.device.is_host or not fake else None)
        state.register(tracker, work, micro, micro_target)
        if previous is not None:  # what the hooks kept in the step before (Note [kept across steps])
            previous.fill(lambda t: tracker.register(t, Category.ACTIVATIONS))
        handles = install_module_stack(work, tracker.module_stack)
        try:
            observe = observer.attach(tracker, work) if observer is not None else contextlib.nullcontext()
            with contextlib.ExitStack() as stack:
                caster = device_rules(stack, config) if device_rules is not None else None
                stack.enter_context(patched_model(work, config, "cpu"))
                if state.states_apart:
                    stack.enter_context(offloaded_states(tracker))
                stepped: set[int] = set()  # parameters the optimizer stepped in backward
                # Note [host storages]: on a GPU target, what the step holds in host memory is not the device's
                to_host = None if config.device.is_host else tracked_save_on_cpu(tracker)
                for feature in FEATURES:  # what each step feature holds around the step (Note [step features])
                    stack.enter_context(feature.step_context(config, work, state.optimizer, stepped,
                                                             to_host=to_host))
                stack.enter_context(tracked_rng_state(fake))
                rerouted = [] if fake else stack.enter_context(heavy_routing_during(work))  # Note [MoE routing]
                if inductor:  # untracked; its value reads answered as the tracked step's are (Note [value twins])
                    with forward_errors(tracker), \
                            _twinned(work, model, micro, micro_target, batch, target, config, tracker) as twins, \
                            eager_answers(twins):
                        warm_up(work, micro, micro_target, loss_fn, config)
                stack.enter_context(tracker)
                twins = None
                if fake:  # above the tracker: what it computes for real is not counted (Note [value twins])
                    twins = stack.enter_context(_twinned(work, model, micro, micro_target, batch, target, config,
                                                         tracker))
                    stack.enter_context(eager_answers(twins))  # Note [am I traced]
                stack.enter_context(observe)
                # Note [random layer skipping]; not under dynamo, which a dispatch mode and patched random functions
                # made skip the model's frames, leaving the user's later real compile eager
                draws = stack.enter_context(
                    draws_at(extreme, work, lambda: tracker.module, locate=locate) if not inductor
                    else contextlib.nullcontext(Draws(extreme)))
                run_window(tracker, work, state, micro, micro_target, loss_fn, config, caster, stepped, fake=fake)
        finally:
            for h in handles:
                h.remove()
    notes = _notes(model, config, inductor, limited, rerouted, tracker, prober)
    if fake and twins.readers:  # the path the sample's values chose (Note [value twins])
        notes += (reader_note(list(twins.readers)),)
    progress.step("replaying the step's allocations")
    return Simulation(tracker.timeline, replay(tracker.timeline), "fake" if fake else "real", notes,
                      config.preallocated_grads,
                      compiled=bool(inductor), random_draws=draws.count,
                      input_rows=max(config.held_rows, config.micro_batch_size),
                      row_reader=twins.sample_reader if twins is not None and twins.sample_reads else None,
                      row_program=twins.program if twins is not None and twins.sample_reads else None)


def _notes(model: nn.Module, config: StepConfig, inductor: Any, limited: list[str], rerouted: list[str],
           tracker: StepTracker, prober: KernelProber | None) -> tuple[str, ...]:
    """What a simulation says beside its figures: each feature's notes, then what was simulated other than as
    written (compiled code, frames at dynamo's recompile limit, MoE routing, corrected kernels, kernels too large to
    probe)."""
    notes = [note for feature in FEATURES for note in feature.estimate_notes(config)]  # Note [step features]
    notes += [note for note in (compiled_note(model, inductor, config.compile), limit_note(model, limited)) if note]
    if rerouted:
        notes.append(f"{', '.join(rerouted)}: per-expert loops whose peak depends on the routing; simulated with the "
                     "heaviest routing measured (see Note [MoE routing]), not the sample's")
    if tracker.unregistered_corrections:
        ops = ", ".join(sorted(tracker.unregistered_corrections))
        notes.append(f"the CPU kernels of {ops} return other outputs than their fake kernels; corrected from a probe "
                     "(not yet listed in autofit/capture/corrections.py)")
    if prober is not None and prober.skipped:
        notes.append(f"{prober.skipped} kernels were too large to probe; their scratch memory is not counted")
    return tuple(notes)


def _twinned(work: nn.Module, model: nn.Module, micro: Batch, micro_target: Any, batch: Batch, target: Any,
             config: StepConfig, tracker: StepTracker) -> ValueTwins:
    """The value twins of a fake step (Note [value twins]): the micro-batch's rows, marked as the sample's (Note
    [rows that differ], solve/estimator.py), and a clone of each real buffer of the user's model (never the buffer
    itself: an in-place op on a twin runs for real)."""
    twins = ValueTwins(where=lambda: tracker.module)
    pairs = [(micro, batch)] + ([(micro_target, target)] if micro_target is not None and target is not None else [])
    with disable_current_modes():  # real tensors, which neither the fake mode nor the tracker sees
        for fake, real in pairs:
            real_rows = real.resize(config.micro_batch_size)
            for f, r in zip(fake.tensors(), real_rows.tensors()):
                twins.add(f, r if r.is_meta else r.detach().cpu(), from_sample=True)
        originals = dict(model.named_buffers())
        for name, fake in work.named_buffers():
            real = originals.get(name)
            if real is not None and not real.is_meta and real.nelement() * real.element_size() <= MAX_TWIN_BYTES:
                twins.add(fake, real.detach().cpu().clone())
    return twins
