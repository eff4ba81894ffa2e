"""``autofit estimate``: the memory of one fixed configuration, per rank, without planning. The command (in
autofit/cli/app.py) parses with ``plan``'s options (autofit/cli/flags.py); this module holds the pure parts, tested
without the CLI: the configuration read from the flags (:func:`estimate_setup`), the call of :func:`autofit.estimate`,
its figures as data (:func:`estimate_data`, the ``--json`` document) and their rendering (:func:`estimate_tables`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from autofit.api import estimate
from autofit.cli.specs import ModelSpec
from autofit.cli.flags import feature_flag_names
from autofit.core.errors import InvalidInputError
from autofit.core.report import MemoryEstimate
from autofit.core.units import format_mib
from autofit.options import Device, Layout, Step
from autofit.device import resolve_device
from autofit.parallel.layout import layout_words
from autofit.parallel.choices import shard_units
from autofit.training.config import DeviceKind, as_zero_grad
from autofit.parallel.layout import as_strategy
from autofit.training.recompute import POLICIES

__all__ = ["EstimateSetup", "estimate_setup", "run_estimate", "estimate_data", "estimate_tables", "BLOCKS",
           "sequence_option", "STEP_FLAGS", "NOT_STEP_KNOBS"]

BLOCKS = "blocks"  # --checkpoint blocks: the model's repeated blocks, the units plan shards (parallel/choices.py)

# Every step knob autofit.estimate takes, with the flag(s) of ``autofit estimate`` that set it (issue 56: a knob the
# Python call has and the command lacks is a figure the command cannot show); tests/test_cli_estimate.py checks
# that this covers the signature and that each flag exists.
STEP_FLAGS: dict[str, tuple[str, ...]] = {
    "micro_batch_size": ("--micro-batch-size",), "accumulation_steps": ("--batch-size",),
    "optimizer": ("--optimizer",), "clip_grad_norm": ("--clip-grad-norm",),
    "device": ("--device", "--gpu", "--expandable-segments"),
    "precision": ("--precision",),
    "layout": ("--world-size", "--strategy", "--reshard-after-forward", "--replicate", "--tensor-parallel",
               "--sequence-parallel", "--pipeline-parallel", "--schedule"),
    "checkpoint": ("--checkpoint",), "offload": ("--offload-activations",), "offload_states": ("--offload-states",),
    "optimizer_in_backward": ("--optimizer-in-backward",),
    "reduce_every_micro_batch": ("--reduce-every-micro-batch", "--defer-reduce"),
    "chunked_loss": ("--chunked-loss",), "compile": ("--compile",), "preallocated_grads": ("--preallocated-grads",),
    "inputs": ("--inputs",), "gradient_as_bucket_view": ("--gradient-as-bucket-view",),
    "zero_grad": ("--zero-grad",),
    **feature_flag_names(),  # the step features' own (Note [carried features]): --float8
}
# What autofit.estimate takes that is not a knob of the step: the model and its data (MODEL, --input-shape,
# --config and --task build them), and how a sample given in Python is laid out (the CLI generates batch-first inputs)
NOT_STEP_KNOBS = frozenset({"model", "sample", "target", "loss_fn", "batch_dim", "deprecated"})


@dataclass(frozen=True, kw_only=True)
class EstimateSetup:
    """The fixed configuration ``autofit estimate`` describes: ``micro_batch_size`` rows per rank and micro-batch,
    ``accumulation_steps`` micro-batches per optimizer step, and the data-parallel layout."""

    micro_batch_size: int
    accumulation_steps: int
    precision: str
    optimizer: str
    device: str
    gpu: str | None
    world_size: int
    strategy: str | None
    reshard_after_forward: bool | int
    replicate: int
    checkpoint: dict[str, str]  # module -> "full", "selective" or "op-selective" (autofit/training/recompute.py)
    clip_grad_norm: float | None
    tensor_parallel: int = 1  # T ranks of a node split each block's linear layers (FSDP2 x tp, or tp alone)
    compile: bool = False  # the step as torch.compile (inductor) compiles it
    sequence_parallel: bool = False  # the blocks' norms split along the sequence too (Note [sequence parallel])
    zero_grad: str = "after-step"  # where the loop clears the gradients (Note [where zero_grad falls])
    # FSDP2 reduce-scatters after every micro-batch (torchtitan) instead of deferring to the last (Note [gradient
    # sync under accumulation])
    reduce_every_micro_batch: bool = False
    offload: tuple[str, ...] = ()  # modules whose saved activations live on the host (save_on_cpu)
    offload_states: bool = False  # parameters, gradients and optimizer state on the host (CPUOffloadPolicy)
    optimizer_in_backward: bool = False
    chunked_loss: bool = False
    preallocated_grads: bool = False
    inputs: str = "batch"  # the rows of inputs resident: the rank's whole batch, or one micro-batch
    gradient_as_bucket_view: bool = True  # DDP's bucket mode
    # the CUDA caching allocator with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (Note [expandable segments as
    # an input], autofit/device.py)
    expandable_segments: bool = False
    pipeline_parallel: int = 1  # P pipeline stages, one per rank (autofit/parallel/pipeline.py)
    pipeline_schedule: str = "1F1B"  # torch's schedule that runs them
    pipeline_layers: tuple[int, ...] | None = None  # each stage's decoder layers; None: the even split
    # the options of the step features carried in more_features (Note [carried features]), as their flags gave them
    # (FEATURE_FLAGS, autofit/cli/flags.py: {"float8": "rowwise"}); None where a flag was not given
    features: dict[str, Any] = field(default_factory=dict)

    @property
    def data_ranks(self) -> int:
        """Ranks that train different rows: the T ranks of a tensor-parallel group share theirs, as the P ranks of a
        pipeline do."""
        return self.world_size // (self.tensor_parallel * self.pipeline_parallel)

    @property
    def layout(self) -> str:
        """The layout in the plan's words ('fsdp2 (ZeRO-3) over 8 ranks'), 'one process' without one."""
        if self.strategy is None:
            return "one process"
        if self.pipeline_parallel > 1:  # the layout's own words (Layout.words): the pipeline first, as in the mesh
            return _pipeline_layout(self).label_with_ranks
        words = layout_words(self.strategy, self.world_size, self.reshard_after_forward, self.replicate, ranks=True,
                             tensor_parallel=self.tensor_parallel, sequence_parallel=self.sequence_parallel)
        return words if as_strategy(self.strategy).shards_parameters else f"{words} over {self.world_size} ranks"


def _pipeline_layout(setup: EstimateSetup) -> Any:
    """The setup's layout as the step holds it, where a pipeline is part of it."""
    from autofit.parallel import Placement
    from autofit.parallel.layout import Parallel

    return Parallel(strategy=setup.strategy, world_size=setup.world_size, replicate=setup.replicate,
                    reshard_after_forward=setup.reshard_after_forward,
                    more_dimensions=(Placement("pp", setup.pipeline_parallel,
                                               (("schedule", setup.pipeline_schedule.lower()),)),))


def _fixed(flag: str, value: object) -> object:
    if value == "auto":
        raise InvalidInputError(f"{flag} auto asks the planner to choose: 'autofit estimate' describes one "
                                f"configuration, so give a value (or run 'autofit plan')")
    return value


def sequence_option(model, sequence_parallel: bool, tensor_parallel: object) -> dict[str, object] | None:
    """--sequence-parallel: the model's own tensor-parallel plan with its blocks' norms sequence-parallel
    (``sequence_parallel_plan``, Note [sequence parallel]); None without the flag. Refused without tensor
    parallel, which it splits further."""
    if not sequence_parallel:
        return None
    if tensor_parallel in (1, "1"):
        raise InvalidInputError("--sequence-parallel splits the sequence over a tensor-parallel group: give "
                                "--tensor-parallel T (or auto for plan)")
    from autofit.parallel.tensor_parallel import sequence_parallel_plan

    return sequence_parallel_plan(model)


def _accumulation(batch_size: int | None, micro: int, data_ranks: int) -> int:
    """--batch-size is the global batch, as for plan: micro-batch x accumulation x data-parallel ranks (the world
    size over the tensor-parallel degree)."""
    if batch_size is None:
        return 1
    rows = micro * data_ranks
    if batch_size < rows or batch_size % rows:
        raise InvalidInputError(
            f"--batch-size {batch_size} is not a multiple of --micro-batch-size {micro} x {data_ranks} data-parallel "
            f"ranks = {rows}: the global batch is micro-batch x accumulation steps x data-parallel ranks")
    return batch_size // rows


def _checkpoint(model, items: list[str]) -> dict[str, str]:
    """--checkpoint NAME[:POLICY] (repeatable), POLICY full (the default), selective or op-selective; NAME 'blocks'
    stands for the model's repeated blocks."""
    out: dict[str, str] = {}
    for item in items:
        name, _, policy = item.partition(":")
        policy = policy or "full"
        if policy not in POLICIES:
            raise InvalidInputError(f"--checkpoint {item!r}: the policy after ':' must be full, selective (matmul and "
                                    "attention outputs kept) or op-selective (torchtitan's per-op policy)")
        names = shard_units(model) if name == BLOCKS else (name,)
        if not names:
            raise InvalidInputError("--checkpoint blocks: this model has no repeated blocks; name the modules")
        out.update({n: policy for n in names})
    return out


def estimate_setup(spec: ModelSpec, *, micro_batch_size: int, batch_size: int | None, precision: str,
                   optimizer: str, device: str, gpu: str | None, world_size: int, strategy: str | None,
                   reshard_after_forward: object, replicate: object, checkpoint: list[str] | None,
                   clip_grad_norm: float | None, tensor_parallel: object = 1, compile: bool = False,
                   sequence_parallel: bool = False, zero_grad: str = "after-step", pipeline_parallel: int = 1,
                   pipeline_schedule: str = "1F1B", pipeline_layers: tuple[int, ...] | None = None,
                   **step: Any) -> EstimateSetup:
    """The configuration the flags describe (``reshard_after_forward`` and ``replicate`` as ``layout_option`` read
    them); "auto" anywhere is refused, since only ``plan`` chooses. ``step``: the other knobs of STEP_FLAGS, by the
    field names of :class:`EstimateSetup`."""
    if step.get("inputs", "batch") not in ("batch", "micro-batch"):
        raise InvalidInputError(f"--inputs {step['inputs']!r}: batch (the rank's whole batch resident, as the "
                                "plan's trainer holds it) or micro-batch (one micro-batch's rows)")
    tp = _fixed("--tensor-parallel", tensor_parallel)
    if not isinstance(tp, int) or tp < 1 or world_size % tp:
        raise InvalidInputError(f"--tensor-parallel {tp} must be a positive divisor of --world-size {world_size}")
    sequence_option(spec.model, sequence_parallel, tp)  # refuses the flag without tensor parallel
    if pipeline_parallel < 1 or world_size % (tp * pipeline_parallel):
        raise InvalidInputError(f"--pipeline-parallel {pipeline_parallel} must be a positive divisor of --world-size "
                                f"{world_size}" + (f" // --tensor-parallel {tp}" if tp > 1 else ""))
    if pipeline_layers is not None and pipeline_parallel == 1:
        raise InvalidInputError("--pipeline-layers splits the layers over pipeline stages: give --pipeline-parallel "
                                "P too")
    return EstimateSetup(
        micro_batch_size=micro_batch_size,
        accumulation_steps=_accumulation(batch_size, micro_batch_size, world_size // (tp * pipeline_parallel)),
        pipeline_parallel=pipeline_parallel, pipeline_schedule=pipeline_schedule, pipeline_layers=pipeline_layers,
        precision=_fixed("--precision", precision), optimizer=optimizer, device=device,
        gpu=resolve_device(device, gpu).name if device == "cuda" else gpu,  # the catalog's name; refuses bad ones
        world_size=world_size, strategy=strategy,
        reshard_after_forward=_fixed("--reshard-after-forward", reshard_after_forward),
        replicate=_fixed("--replicate", replicate), checkpoint=_checkpoint(spec.model, checkpoint or []),
        clip_grad_norm=clip_grad_norm, tensor_parallel=tp, compile=bool(compile),
        sequence_parallel=bool(sequence_parallel), zero_grad=str(as_zero_grad(zero_grad)),
        **{k: tuple(v) if isinstance(v, list) else v for k, v in step.items() if v is not None})


def run_estimate(spec: ModelSpec, setup: EstimateSetup) -> MemoryEstimate:
    """``autofit.estimate`` of the spec's model and sample under ``setup`` (one rank's figures)."""
    return estimate(spec.model, spec.sample, target=spec.target, loss_fn=spec.loss_fn,
                    precision=setup.precision, optimizer=setup.optimizer,
                    device=Device(kind=setup.device, gpu=setup.gpu,
                                  expandable_segments=setup.expandable_segments or None),
                    layout=Layout(world_size=setup.world_size, strategy=setup.strategy,
                                  reshard_after_forward=setup.reshard_after_forward, replicate=setup.replicate,
                                  tensor_parallel=setup.tensor_parallel,
                                  tensor_parallel_plan=sequence_option(spec.model, setup.sequence_parallel,
                                                                       setup.tensor_parallel),
                                  pipeline_parallel=setup.pipeline_parallel,
                                  pipeline_schedule=setup.pipeline_schedule,
                                  pipeline_layers=setup.pipeline_layers),
                    step=Step(micro_batch_size=setup.micro_batch_size, clip_grad_norm=setup.clip_grad_norm,
                              accumulation_steps=setup.accumulation_steps, checkpoint=setup.checkpoint or None,
                              compile=setup.compile, zero_grad=setup.zero_grad,
                              reduce_every_micro_batch=setup.reduce_every_micro_batch, offload=setup.offload,
                              offload_states=setup.offload_states, optimizer_in_backward=setup.optimizer_in_backward,
                              chunked_loss=setup.chunked_loss, preallocated_grads=setup.preallocated_grads,
                              inputs=setup.inputs, gradient_as_bucket_view=setup.gradient_as_bucket_view,
                              **setup.features))


def estimate_data(est: MemoryEstimate, setup: EstimateSetup, description: str) -> dict[str, Any]:
    """The ``--json`` document: integer bytes, every figure for one rank."""
    return {
        "model": description, "device": est.device, "gpu": setup.gpu, "layout": setup.layout,
        "world_size": setup.world_size, "strategy": setup.strategy,
        "reshard_after_forward": setup.reshard_after_forward, "replicate": setup.replicate,
        "micro_batch_size": setup.micro_batch_size, "accumulation_steps": setup.accumulation_steps,
        "tensor_parallel": setup.tensor_parallel, "sequence_parallel": setup.sequence_parallel,
        "pipeline_parallel": setup.pipeline_parallel, "pipeline_schedule": setup.pipeline_schedule,
        "pipeline_layers": None if setup.pipeline_layers is None else list(setup.pipeline_layers),
        # each rank's simulated peak where the ranks' steps differ (a pipeline's stages); the figures are the highest
        "rank_peaks": [{"rank": r, "peak_allocated_bytes": b} for r, b in est.rank_peaks],
        "compile": setup.compile, "reduce_every_micro_batch": setup.reduce_every_micro_batch,
        "offload_activations": list(setup.offload), "offload_states": setup.offload_states,
        "optimizer_in_backward": setup.optimizer_in_backward, "chunked_loss": setup.chunked_loss,
        "preallocated_grads": setup.preallocated_grads, "inputs": setup.inputs,
        "gradient_as_bucket_view": setup.gradient_as_bucket_view, "alloc_conf": est.alloc_conf,
        **setup.features,
        "batch_size": setup.micro_batch_size * setup.accumulation_steps * setup.data_ranks,
        "precision": setup.precision, "optimizer": setup.optimizer, "checkpoint": setup.checkpoint,
        "peak_allocated_bytes": est.peak_allocated_bytes, "peak_reserved_bytes": est.peak_reserved_bytes,
        "device_bytes": est.device_bytes, "host_bytes": est.host_bytes, "peak_phase": est.peak_phase,
        "peak_at": est.peak_at, "breakdown": dict(est.breakdown), "notes": list(est.notes),
    }


def estimate_tables(est: MemoryEstimate, setup: EstimateSetup, description: str) -> Group:
    mib = lambda n: f"{format_mib(n)} MiB"  # noqa: E731
    knobs = Table(title="autofit estimate (per rank)" if setup.world_size > 1 else "autofit estimate",
                  show_header=False, title_justify="left")
    knobs.add_column("figure", style="bold")
    knobs.add_column("value")
    device = f"{setup.device} ({setup.gpu})" if setup.gpu else setup.device
    rows = [("model", description), ("device", device), ("layout", setup.layout),
            ("micro-batch", f"{setup.micro_batch_size} x {setup.accumulation_steps} accumulation"),
            ("precision", setup.precision), ("optimizer", setup.optimizer),
            ("recomputed", f"{len(setup.checkpoint)} modules" if setup.checkpoint else "none")]
    sync = gradient_sync(setup)
    if sync is not None:
        rows.append(("gradient sync", sync))
    rows.append(("peak allocated", mib(est.peak_allocated_bytes)))
    if est.rank_peaks:  # the ranks' steps differ (a pipeline's stages): each one's, the figures the highest's
        rows.append(("per rank", ", ".join(f"rank {r} {mib(b)}" for r, b in est.rank_peaks)))
    if DeviceKind(est.device).caching_allocator:  # reserved and on-device figures differ from allocated
        rows += [("peak reserved", mib(est.peak_reserved_bytes)), ("on the device", mib(est.device_bytes))]
        if est.alloc_conf:
            rows.append(("CUDA allocator", f"PYTORCH_CUDA_ALLOC_CONF={est.alloc_conf}"))
    if est.host_bytes:
        rows.append(("host memory", mib(est.host_bytes)))
    rows.append(("peak in", f"{est.peak_phase}{f' ({est.peak_at})' if est.peak_at else ''}"))
    for key, value in rows:
        knobs.add_row(key, value)
    breakdown = Table(title="peak by category", title_justify="left")
    breakdown.add_column("category")
    breakdown.add_column("MiB", justify="right")
    breakdown.add_column("share", justify="right")
    total = est.device_bytes or 1
    for key, value in est.breakdown.items():
        breakdown.add_row(key, format_mib(value), f"{100 * value / total:.1f} %")
    breakdown.add_row("[bold]total[/]", f"[bold]{format_mib(est.device_bytes)}[/]", "100.0 %")
    notes = [Text(f"note: {n}") for n in est.notes]
    return Group(knobs, breakdown, *notes)


def gradient_sync(setup: EstimateSetup) -> str | None:
    """How FSDP2 syncs the gradients under accumulation, in words, with the flag for the other way (Note [gradient
    sync under accumulation]); None where there is no choice (no FSDP2 over data ranks, or one micro-batch)."""
    if (setup.strategy is None or not as_strategy(setup.strategy).shards_parameters or setup.data_ranks < 2
            or setup.accumulation_steps < 2 or setup.offload_states):
        return None
    if setup.reduce_every_micro_batch:
        return "reduce-scatter after every micro-batch (--reduce-every-micro-batch, as torchtitan)"
    return ("deferred to the last micro-batch (the default: set_requires_gradient_sync(False) before it; "
            "--reduce-every-micro-batch reduces after each, as torchtitan)")
