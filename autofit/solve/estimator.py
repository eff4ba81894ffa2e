"""One full estimate of a configuration: simulate the step on fake tensors, then apply the device model.

Every full estimate the planner makes (the quick path, a search winner's verification, the smallest budget, the fp32
pins, the even split, the rows at shorter lengths) is this one call on an :class:`Estimator`, the request at one
data-parallel layout. A configuration is a search :class:`~autofit.solve.candidate.Candidate` and the precision policy
it runs (its label alone does not carry a pin set the planner adds after the search).

Note [gradients before forward as a plan knob]
    Gradients allocated before the first forward (Note [gradients allocated before forward], training/grads.py) put
    them in segments apart from the activations, so that when the optimizer step holds the peak, the activations'
    segments are wholly free and a budget frees them: 4 layers of Llama-2-7B on an H200 (fp16, every layer
    recomputed) run under 22,013,804,544 bytes at every micro-batch from 1 to 4, where the gradients placed in
    backward need 22,223,519,744 at micro-batch 1 and 22,118,662,144 at 2. But with one micro-batch per step they
    also live through forward and the first backward, which raises the tensor peak wherever forward or backward
    holds it (the same model at 4 x 1: 21.13 GiB allocated against 19.99). So they are a knob of the verdict at a
    budget, as expandable segments are (Note [expandable segments as a plan knob], autofit/device.py), chosen per
    configuration by what the caching allocator replay says, not a default: a configuration whose figures leave
    more than a 20 MiB page above what it allocates plus the context (segments pinned) is simulated a second time
    with them. :meth:`Estimator.verify` does it only when the default layout does not run under the budget asked
    (lazily, in the estimate's ``under``); :meth:`Estimator.verify_floor`, which ranks the configurations whose
    smallest budget an infeasibility error names, does it at once and keeps the lower floor. Either way the figures
    that fit say so (``MemoryEstimate.preallocated_grads`` -> ``Plan.preallocated_grads``), and the trainer allocates
    the gradients in ``wrap``. It changes no number of the update. One process only, without the optimizer stepping
    in backward or a master copy (StepConfig refuses them); it needs a second simulation, not a new analysis.

Note [rows that differ]
    A simulation runs one micro-batch's rows: the sample resized to the micro-batch, its first rows (training/
    batch.py), in every micro-batch of the window. Where the step reads no value of those rows, every micro-batch of
    that size runs the same ops on the same shapes, and the rows do not matter. A step that does read them (a model
    that trims padding to the longest row of its micro-batch, ``int(mask.sum(1).max())``, answered from the rows'
    value twins, Note [value twins]) can run another step on other rows, and the trainer runs every micro-batch it
    cuts from a batch: a sample whose long rows (256 tokens) come last, the rest 4 tokens long, was planned 1 x 32
    at a predicted 370,444 B, and the trainer's real step on that same sample peaked at 821,004 B
    (tests/test_own_sample.py); 64 wide and 512 tokens long, 3 x 11 under a budget of 1,000,000 B at 998,156 B,
    and the real step 6,294,796 B (issue 55: 720,700 B against 17,088,324 B for its model).
    So where the simulation says a value of the sample's rows was read (``Simulation.row_reader``), every other
    micro-batch the trainer would cut from the sample (the sample as consecutive batches of ``batch_size`` rows,
    repeated cyclically to fill the last, split over the data-parallel ranks and into micro-batches as
    ``micro_batch_bounds`` cuts them) is simulated too, those with the same values as one simulated already
    skipped, each in every micro-batch of the window. A step's micro-batches differ only in their rows, each starts
    from the same live set (the gradients, or none for the first), so the window with one micro-batch's rows in
    both places holds that micro-batch at its worst; the largest of them, by the device's figures, bounds the real
    step and is the estimate, with a note naming it. Every estimate of the planner goes through here (the quick
    path, the verification and its re-planning, the table of rows by length, the even split), so the plan holds the
    sample's largest micro-batch. A step that reads none of the sample's values runs exactly one simulation, as
    before. One that does is not simulated once per micro-batch: the twins record the ops from the rows' values to
    each read and the answers (``RowProgram``, simulate/value_twins.py), a few small real ops, and those run on each
    micro-batch's rows; a micro-batch whose reads all get the answers of one simulated already runs the same
    simulated step (a fake step's shapes follow from the input shapes, all the micro-batch's, and the answers), so
    only the micro-batches that answer otherwise are simulated. A Hugging Face model's ``mask.all()`` on a padded
    sample answers alike everywhere: one simulation, as before; the padding-trimming model: two. A simulation sent
    back by a worker keeps no program (it holds ops by reference): the first rows are simulated again in this
    process (``each_step``, simulate/sample_rows.py). Not covered: a step run for real (Note [data-dependent
    models]) runs the sample's first rows only, as before, and says so in its note. The analysis the search's
    models are built from (analyse/analyse.py) takes the largest micro-batch of the sample's at each of its two
    sizes the same way (by the tensor peak), so the search ranks configurations on the rows the plan must hold.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from autofit.core import progress
from autofit.core.categories import Category
from autofit.core.workers import run_all
from autofit.training.batch import Batch
from autofit.training.length import cut_to_length, length_spec
from autofit.training.precision import PrecisionPolicy
from autofit.core.report import MemoryEstimate
from autofit.core.units import format_bytes
from autofit.analyse.analyse import op_costs
from autofit.analyse.table import OpCosts
from autofit.parallel.rungs import one_process_features
from autofit.capture.depth import truncated
from autofit.simulate.depth import extend_checked
from autofit.simulate.run import Simulation, probes_kernels, simulate_step
from autofit.simulate.sample_rows import each_step, sample_micro_batches
from autofit.simulate.timeline import replay
from autofit.solve.candidate import Candidate
from autofit.solve.depth import DepthRun, config_at_depth, depth_grid, depth_runs
from autofit.solve.extrapolate import extrapolate, extrapolate_grid, fallback_note, overtaken
from autofit.training.step import StepConfig, forward_errors

if TYPE_CHECKING:  # the request is built after this stage in the import order; only its values are read here
    from autofit.request import PlanRequest
    from autofit.parallel.layout import Parallel

__all__ = ["Estimator", "announce", "with_rows"]

_PAGE = 20 << 20  # kLargeBuffer: a segment of the large pool, the least that pinned segments can cost


@dataclass(frozen=True)
class Estimator:
    """Full estimates of configurations of ``request`` laid out as ``parallel`` (one process, DDP or FSDP2 over its
    ranks, or the states on the host)."""

    request: PlanRequest
    parallel: Parallel

    def config(self, c: Candidate, policy: PrecisionPolicy) -> StepConfig:
        """The step ``c`` describes, holding the rows one rank trains per step as inputs: the one the plan carries
        when ``c`` wins (Note [the plan's step], emit/plan.py). FSDP2's reduce-scatter after every micro-batch is
        the layout's only where there is more than one (with one, every micro-batch is the last and reduces anyway:
        the same step), as the plan says."""
        parallel = self.parallel.for_micro_batches(c.accumulation_steps)
        return replace(self.request.step(parallel, c.accumulation_steps), micro_batch_size=c.micro_batch_size,
                       accumulation_steps=c.accumulation_steps, precision=policy, checkpoint=c.checkpoint,
                       selective=c.selective, op_selective=c.op_selective, optimizer_in_backward=c.in_backward,
                       offload=c.offload,
                       preallocated_grads=c.preallocated_grads)

    def simulate(self, c: Candidate, policy: PrecisionPolicy, length: int | None = None,
                 depth: int | tuple[int, ...] | None = None) -> Simulation:
        """One step of ``c`` on fake tensors, on the sample cut to ``length`` along its length dims (None: as is),
        of the model cut to ``depth`` of its identical blocks, or to the blocks ``depth`` (None: all; Note [depth
        extrapolation])."""
        request = self.request
        batch, target = request.batch, request.target
        if length is not None:
            spec = length_spec(request.batch, request.target)
            batch, target = cut_to_length(batch, spec, length), cut_to_length(target, spec, length)
        model, config = request.model, self.config(c, policy)
        if depth is not None:
            model, config = truncated(model, request.blocks, depth), config_at_depth(config, request.blocks, depth)
        with forward_errors():
            sim = simulate_step(model, batch, target, request.loss_fn, config,
                                device_rules=request.device.simulation_rules)
            if sim.row_reader is None:  # no value of the sample's rows read: every micro-batch alike
                return sim
            return self._largest_rows(sim, model, batch, target, config)

    def _largest_rows(self, first: Simulation, model, batch: Batch, target: Batch | None,
                      config: StepConfig) -> Simulation:
        """The simulation of the largest micro-batch the trainer would cut from the sample, ``first`` being that of
        its first rows, with a note saying the rows differ (Note [rows that differ])."""
        request = self.request
        rows = sample_micro_batches(batch, target, request.batch_size, request.per_rank, config.micro_batch_size,
                                    request.min_rows)

        def simulated(r) -> Simulation:
            progress.report(f"the step reads values of the sample's rows: simulating {r.label}")
            return simulate_step(model, r.batch, r.target, request.loss_fn, config,
                                 device_rules=request.device.simulation_rules)

        steps = each_step(rows, first, simulated, lambda sim: sim.row_program)
        named, sims = [r for r, _ in steps], [sim for _, sim in steps]
        if len(sims) == 1:  # every micro-batch answers the reads as the first rows do: the same step
            return first
        sized = [(request.device.estimate(sim), sim, r) for sim, r in zip(sims, named)]
        est, sim, worst = max(sized, key=lambda e: (e[0].min_device_bytes, e[0].device_bytes))
        reader = first.row_reader or sim.row_reader
        who = f"module {reader!r}" if reader else "the model's top-level forward (or the loss)"
        size = f"{config.micro_batch_size} row{'s' if config.micro_batch_size > 1 else ''}"
        note = (f"the rows differ: {who} reads values of the sample's rows, and the {len(rows)} micro-batches of "
                f"{size} the trainer cuts from the sample run {len(sized)} different steps; the largest is "
                f"{worst.label}, {format_bytes(est.device_bytes)} against {format_bytes(sized[0][0].device_bytes)} "
                f"for the first rows, and the estimate holds it (Note [rows that differ])")
        return replace(sim, notes=sim.notes + (note,))

    def estimate(self, c: Candidate, policy: PrecisionPolicy, length: int | None = None) -> MemoryEstimate:
        """The device's figures for one step of ``c`` (see :meth:`simulate`), extrapolated in depth where the
        request allows it and the figures are on a line (Note [depth extrapolation])."""
        est = self._extrapolated(c, policy, length)[0] if self.request.blocks is not None else None
        if est is None:
            est = self._full(c, policy, self.simulate(c, policy, length))
        return est

    def estimate_and_ops(self, c: Candidate, policy: PrecisionPolicy,
                         known: dict[tuple[int, ...], tuple[Simulation, MemoryEstimate]] | None = None,
                         ) -> tuple[MemoryEstimate, OpCosts]:
        """:meth:`estimate` and the per-op costs of one micro-batch of ``c`` (the time model's input), from the same
        simulations: the deepest cut model's ops with the missing blocks' appended when extrapolated. ``known``: cut
        models of ``c`` simulated already and their estimates (:meth:`misses`), by the blocks they keep."""
        b = c.micro_batch_size
        if self.request.blocks is not None:
            est, sims, cut = self._extrapolated(c, policy, None, known)
            if est is not None:
                return est, cut.ops(lambda keep: op_costs(sims[keep].priced_timeline, sims[keep].priced_timeline,
                                                              per_sample_from=b))
        sim = self.simulate(c, policy)
        est = self._full(c, policy, sim)
        return est, op_costs(sim.priced_timeline, sim.priced_timeline, per_sample_from=b)

    def _full(self, c: Candidate, policy: PrecisionPolicy, sim: Simulation) -> MemoryEstimate:
        """The device's figures of a simulation of the whole model, saying why when depth extrapolation was
        allowed."""
        progress.step("the device's figures")
        est = self.request.device.estimate(sim)
        blocks = self.request.blocks
        if blocks is None:
            return est
        return replace(est, notes=est.notes + (fallback_note(blocks, depth_runs(self.config(c, policy), blocks),
                                                             self.request.cheaper_cuts_only),))

    def misses(self, c: Candidate, policy: PrecisionPolicy,
               budget: int) -> tuple[bool, dict[tuple[int, ...], tuple[Simulation, MemoryEstimate]]]:
        """Whether ``c``'s step cannot fit ``budget``, told by the two shallowest cuts its depth extrapolation
        simulates (Note [a step that misses by its first cuts]), and those cuts' simulations and estimates; (False,
        {}) where the request does not cut the model, or this configuration would not be cut."""
        blocks = self.request.blocks
        if blocks is None:
            return False, {}
        config = self.config(c, policy)
        if self.request.device.own_kernels and depth_grid(config, blocks) is not None:
            return False, {}  # cut along a grid first (Note [cutting every run])
        run = next(iter(depth_runs(config, blocks)), None)
        if run is None or (self.request.cheaper_cuts_only and sum(run.depths) >= blocks.count):
            return False, {}
        cuts = self._cuts(c, policy, None, run.keeps[:2])
        rounding = str(Category.ALLOCATOR_ROUNDING)
        low, high = (est.peak_bytes - est.breakdown.get(rounding, 0) for _, est in cuts.values())
        return high + (high - low) * (run.steps + 1) > budget, cuts

    def _cuts(self, c: Candidate, policy: PrecisionPolicy, length: int | None,
              keeps: list[tuple[int, ...]]) -> dict[tuple[int, ...], tuple[Simulation, MemoryEstimate]]:
        """The model cut to each of ``keeps`` simulated, side by side where a second core allows (Note [cuts side
        by side]), and the device's estimate of each, in ``keeps`` order."""
        progress.report(f"simulating micro-batch {c.micro_batch_size} x {c.accumulation_steps} ({policy.label}) at "
                        f"{', '.join(str(len(k)) for k in keeps)} of {self.request.blocks.count} blocks")
        jobs = [functools.partial(self.simulate, c, policy, length, depth=keep) for keep in keeps]
        sims = run_all(jobs, fork=not probes_kernels(self.config(c, policy)))
        progress.step("the device's figures of each cut")  # the CUDA allocator's replay: seconds on a 7B step
        return {keep: (sim, self.request.device.estimate(sim)) for keep, sim in zip(keeps, sims)}

    # Note [a step that misses by its first cuts]
    #     A depth extrapolation checks its line with a third cut (Note [depth extrapolation], capture/depth.py), but
    #     a step that cannot fit needs no line: its allocated peak is the largest of its stages' peaks, each growing
    #     by the same bytes per period of blocks, so as a function of depth it is a maximum of lines, convex, and the
    #     line through two depths stays below it beyond them. Carried to all blocks along the two shallowest cuts,
    #     the allocated peak (less the allocator's rounding) is thus at most the whole step's, and the device needs
    #     more than its allocated peak: over the budget, the step cannot fit. The quick path asks this first (one
    #     round of simulations instead of two, where two cores run the cuts side by side) and hands the two cuts on
    #     to the estimate where the step may fit. Llama-3-70B-shaped on 4 x 8 H100s: its fastest configuration
    #     (micro-batch 1, nothing recomputed) is carried to several times the budget from 2 and 3 blocks.
    def _extrapolated(self, c: Candidate, policy: PrecisionPolicy, length: int | None,
                      known: dict[tuple[int, ...], tuple[Simulation, MemoryEstimate]] | None = None):
        """(estimate, the simulations by blocks kept, the cut) extrapolated from cut models, or (None, None, None)
        when no cut's figures are on their lines or the configuration's pattern has no period (Note [depth
        extrapolation]; every run of alike blocks cut first where there are several: Note [cutting every run])."""
        # Note [cuts side by side]
        #     The cut models of one extrapolation (three depths, or a grid's 1 + 2 x runs) are independent simulations,
        #     so they run side by side where a second core allows (Note [parallel simulations], core/workers.py): a
        #     child sends its Simulation back pickled, and this process turns each into the device's figures, the
        #     same as a serial run computes (a forked child computes exactly what this process would). The
        #     Llama-3-70B-shaped plan for 8 x H100 with the states on the host (benchmarks/multi_gpu_70b.py --nodes
        #     1, 2 cores): its verification at 8, 9, 10 blocks took 24.4 s one after another, 7.4 s side by side;
        #     more than the core alone gives, since the collector's full passes no longer walk this process's heap
        #     (it is frozen for the fork, gc.freeze). Not on CPU targets, whose simulations probe CPU kernels.
        known = known or {}
        sims: dict[tuple[int, ...], Simulation] = {k: sim for k, (sim, _) in known.items()}
        ests: dict[tuple[int, ...], MemoryEstimate] = {k: est for k, (_, est) in known.items()}
        config, blocks = self.config(c, policy), self.request.blocks

        def simulated(keeps):  # the cut models side by side where a second core allows (Note [cuts side by side])
            missing = [keep for keep in dict.fromkeys(keeps) if keep not in ests]
            if missing:
                for keep, (sim, est) in self._cuts(c, policy, length, missing).items():
                    sims[keep], ests[keep] = sim, est
            return tuple(ests[k] for k in keeps)
        # Note [cutting every run]: on the CPU only, where every figure is a tensor figure
        grid = depth_grid(config, blocks) if self.request.device.own_kernels else None
        if grid is not None and not (self.request.cheaper_cuts_only and sum(grid.depths) >= blocks.count):
            est = extrapolate_grid(grid, simulated(grid.keeps))
            if est is not None:
                return est, sims, grid
        for run in depth_runs(config, blocks):
            if self.request.cheaper_cuts_only and sum(run.depths) >= blocks.count:
                continue  # three cuts of more blocks than the whole model: simulated whole (exact, and cheaper)
            est = extrapolate(run, simulated(run.keeps), self.request.fit_bytes,
                              whole=functools.partial(self._whole, run, sims))
            if est is not None and overtaken(run, tuple(sims[k].timeline for k in run.keeps)):
                continue  # Note [a stage that overtakes]
            if est is not None:
                return est, sims, run
        return None, None, None

    def _whole(self, run: DepthRun, sims: dict[tuple[int, ...], Simulation]) -> MemoryEstimate | None:
        """The device's estimate of the whole step's timeline built from the cuts' of ``run`` (Note [a timeline
        extended in depth], simulate/depth.py), or None where it cannot be built; on a caching allocator only."""
        if not self.request.device.caching_allocator:
            return None
        progress.report(f"replaying the caching allocator over all {run.blocks.count} blocks")
        timeline = extend_checked(tuple(sims[k].timeline for k in run.keeps), run.steps, run.blocks.path)
        if timeline is None:
            return None
        return self.request.device.estimate(replace(sims[run.keeps[-1]], timeline=timeline, replay=replay(timeline)))

    def policy(self, label: str) -> PrecisionPolicy:
        """The policy a search candidate's precision label names: an allowed precision or a stored option."""
        return {p.label: p for p in self.request.policies + self.request.stored_options}[label]

    def verify(self, c: Candidate) -> MemoryEstimate:
        """The full estimate of a configuration the search picked, in its own policy; what the search's ``verify``
        callable is (solve/verify.py)."""
        return self._verified(c, eager=False)

    def verify_floor(self, c: Candidate) -> MemoryEstimate:
        """:meth:`verify`, with the smallest budget the lower of the gradients' two layouts (Note [gradients before
        forward as a plan knob]): what ranks the configurations an infeasibility error names."""
        return self._verified(c, eager=True)

    def _verified(self, c: Candidate, *, eager: bool) -> MemoryEstimate:
        policy = self.policy(c.precision)
        announce(c, policy)
        est = self.estimate(c, policy)
        if not self._may_preallocate(c, policy, est):
            return est

        @functools.cache
        def ahead() -> MemoryEstimate:
            progress.report(f"simulating micro-batch {c.micro_batch_size} x {c.accumulation_steps} ({policy.label}) "
                            "with the gradients allocated before forward")
            return self.estimate(replace(c, preallocated_grads=True), policy)

        def under(budget: int) -> MemoryEstimate | None:
            default = None if est.under is None else est.under(budget)
            return default if default is not None else ahead().within(budget)

        floor = min(est.min_device_bytes, ahead().min_device_bytes) if eager else est.min_device_bytes
        return replace(est, min_device_bytes=floor, under=under)

    def _may_preallocate(self, c: Candidate, policy: PrecisionPolicy, est: MemoryEstimate) -> bool:
        """Whether ``c`` is worth simulating with the gradients allocated before forward: a CUDA step of one
        process that StepConfig allows it for, whose smallest budget holds pinned segments beyond its blocks."""
        if not self.request.device.caching_allocator or not one_process_features(self.parallel) or c.in_backward:
            return False
        if c.preallocated_grads or str(policy.stored).endswith("-master"):
            return False
        context = est.breakdown.get(str(Category.CUDA_CONTEXT), 0)
        return est.min_device_bytes - est.peak_bytes > context + _PAGE


def announce(c: Candidate, policy: PrecisionPolicy) -> None:
    """Tell whoever listens (the CLI's progress line) that a full estimate of ``c`` begins."""
    progress.report(f"simulating micro-batch {c.micro_batch_size} x {c.accumulation_steps} ({policy.label}) in full")


def with_rows(c: Candidate, rows: int, micro: int) -> Candidate:
    """``c`` with ``micro`` rows per micro-batch over ``rows`` per step, the last micro-batch taking the rest."""
    steps = -(-rows // micro)
    return replace(c, micro_batch_size=micro, accumulation_steps=steps,
                   last_micro_batch_size=rows - micro * (steps - 1))
