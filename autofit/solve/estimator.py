"""One full estimate of a configuration: simulate the step on fake tensors, then apply the device model.

Every full estimate the planner makes (the quick path, a search winner's verification, the smallest budget, the fp32
pins, the even split, the rows at shorter lengths) is this one call on an :class:`Estimator`, the request at one
data-parallel layout. A configuration is a search :class:`~autofit.solve.search.Candidate` and the precision policy
it runs (its label alone does not carry a pin set the planner adds after the search).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from autofit import progress
from autofit.length import cut_to_length, length_spec
from autofit.precision import PrecisionPolicy
from autofit.report import MemoryEstimate
from autofit.simulate.run import Simulation, simulate_step
from autofit.solve.search import Candidate
from autofit.step import StepConfig, forward_errors, make_step_config

if TYPE_CHECKING:  # the request is built after this stage in the import order; only its values are read here
    from autofit.request import Parallel, PlanRequest

__all__ = ["Estimator", "announce", "with_rows"]


@dataclass(frozen=True)
class Estimator:
    """Full estimates of configurations of ``request`` laid out as ``parallel`` (one process, DDP or FSDP2 over its
    ranks, or the states on the host)."""

    request: PlanRequest
    parallel: Parallel

    def config(self, c: Candidate, policy: PrecisionPolicy) -> StepConfig:
        """The step ``c`` describes, holding the rows one rank trains per step as inputs."""
        request, parallel = self.request, self.parallel
        return make_step_config(
            micro_batch_size=c.micro_batch_size, accumulation_steps=c.accumulation_steps, precision=policy,
            checkpoint=c.checkpoint, optimizer=request.optimizer, device=request.device.kind,
            held_rows=request.per_rank, gpu=request.device.name, strategy=parallel.strategy,
            world_size=parallel.world_size, shard_units=parallel.shard_units, clip_grad_norm=request.clip_grad_norm,
            optimizer_in_backward=c.in_backward, offload=c.offload, offload_states=parallel.offload_states,
            chunked_loss=request.chunked_loss,
        )

    def simulate(self, c: Candidate, policy: PrecisionPolicy, length: int | None = None) -> Simulation:
        """One step of ``c`` on fake tensors, on the sample cut to ``length`` along its length dims (None: as is)."""
        request = self.request
        batch, target = request.batch, request.target
        if length is not None:
            spec = length_spec(request.batch, request.target)
            batch, target = cut_to_length(batch, spec, length), cut_to_length(target, spec, length)
        with forward_errors():
            return simulate_step(request.model, batch, target, request.loss_fn, self.config(c, policy),
                                 device_rules=request.device.simulation_rules)

    def estimate(self, c: Candidate, policy: PrecisionPolicy, length: int | None = None) -> MemoryEstimate:
        """The device's figures for one step of ``c`` (see :meth:`simulate`)."""
        return self.request.device.estimate(self.simulate(c, policy, length))

    def policy(self, label: str) -> PrecisionPolicy:
        """The policy a search candidate's precision label names: an allowed precision or a stored option."""
        return {p.label: p for p in self.request.policies + self.request.stored_options}[label]

    def verify(self, c: Candidate) -> MemoryEstimate:
        """The full estimate of a configuration the search picked, in its own policy; what the search's ``verify``
        callable is (solve/verify.py)."""
        policy = self.policy(c.precision)
        announce(c, policy)
        return self.estimate(c, policy)


def announce(c: Candidate, policy: PrecisionPolicy) -> None:
    """Tell whoever listens (the CLI's progress line) that a full estimate of ``c`` begins."""
    progress.report(f"simulating micro-batch {c.micro_batch_size} x {c.accumulation_steps} ({policy.label}) in full")


def with_rows(c: Candidate, rows: int, micro: int) -> Candidate:
    """``c`` with ``micro`` rows per micro-batch over ``rows`` per step, the last micro-batch taking the rest."""
    steps = -(-rows // micro)
    return replace(c, micro_batch_size=micro, accumulation_steps=steps,
                   last_micro_batch_size=rows - micro * (steps - 1))
