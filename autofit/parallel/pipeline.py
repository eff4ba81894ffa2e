"""Pipeline parallelism (issue 59): the model cut into stages, one per pipeline rank, run by torch's own pipeline
schedules (``torch.distributed.pipelining``). A layout dimension (Note [layout dimensions], parallel/dimension.py):
the ranks along it hold different layers (so each is simulated: ``ranks_differ``), train the same rows, and run the
window's micro-batches as torch's schedule orders them (Note [one schedule], parallel/schedule.py).

Work in progress: ``estimate`` and ``measure`` run it (2 and 4 stages, GPipe and 1F1B, beside FSDP2 of degree 1); the
planner does not offer it yet, FSDP2 or tensor parallel inside a stage are refused, and so are the multi-stage
schedules (Interleaved 1F1B, Looped BFS, the zero-bubble and V schedules). See Note [pipeline stages] and Note [a
pipeline rank's step].

Note [pipeline stages]
    torch's ``PipelineStage`` (torch/distributed/pipelining/stage.py) runs one module per stage: its forward takes
    what the previous stage sent (the first stage: the micro-batch's inputs) and returns what it sends on (the last:
    the output the schedule's loss reads). torchtitan cuts its own models by deleting the layers a stage does not
    hold and setting the embedding, final norm and head of the middle stages to None, which its ``forward`` skips
    (torchtitan/distributed/pipeline_parallel.py, ``pipeline_module_split``). A Hugging Face decoder declares the
    same cut (``config.base_model_pp_plan``: ``embed_tokens`` takes ``input_ids`` and gives ``inputs_embeds``,
    ``layers`` take and give ``hidden_states``, ``norm`` gives ``hidden_states``; ``_pp_plan``: ``lm_head`` gives
    ``logits``), and its base model's ``forward`` takes ``inputs_embeds`` in place of ``input_ids`` and loops over
    ``self.layers`` (transformers 5, ``LlamaModel.forward``). So a stage here is the decoder with its ``layers``
    cut to the stage's run: the first stage embeds, a later one is given the hidden states as ``inputs_embeds``;
    the embedding only on the first (a later one holds none), the final norm and the head only on the last (an
    earlier one has an identity norm and no head). Each stage
    computes its own rotary embeddings and causal mask from the hidden states' shape, as the whole model does, so
    the stages chained compute exactly the whole model's logits (tests/test_pipeline_stages.py).
    :func:`decoder_stages` makes every stage sharing the model's modules (the tests' chain); a pipeline rank cuts
    its own copy in place (:func:`cut_to_stage`, as torchtitan deletes what a stage does not hold), the kept layers
    under their own names (``model.layers.5`` stays ``model.layers.5``), so that recomputation, the optimizer and
    every per-module rule name the same modules as on the whole model.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autofit.core._torch import pipeline_step
from autofit.core.errors import InvalidInputError, UnsupportedModelError
from autofit.parallel.dimension import ApplyInputs, Dimension, Layout, Placement, StepKnobs
from autofit.parallel.exports import ExportFragment, ExportInputs

__all__ = ["PIPELINE", "PipelineSchedule", "SCHEDULES", "cut_to_stage", "decoder_stages", "layer_split"]

# The schedules a pipeline runs, by the name torchtitan's ``pipeline_parallel_schedule`` and torch's
# ``get_schedule_class`` give them, with torch's class: one stage per rank (the multi-stage ones, Interleaved 1F1B,
# Looped BFS and the zero-bubble and V schedules, are refused for now, with this list in the message).
SCHEDULES = {"gpipe": ("GPipe", "ScheduleGPipe"), "1f1b": ("1F1B", "Schedule1F1B")}


def layer_split(layers: int, stages: int) -> list[range]:
    """The layers of each stage, an even split by count with the remainder on the first stages (torchtitan's
    default, ``generate_llm_fqn_per_model_part`` without weights for the embedding and head)."""
    if not 1 <= stages <= layers:
        raise UnsupportedModelError(f"{layers} layers cannot be split over {stages} pipeline stages: give at most "
                                    f"{layers} stages")
    size, extra = divmod(layers, stages)
    bounds, start = [], 0
    for s in range(stages):
        end = start + size + (1 if s < extra else 0)
        bounds.append(range(start, end))
        start = end
    return bounds


class _Stage(nn.Module):
    """One stage of a Hugging Face decoder (Note [pipeline stages]); its forward runs under the step's autocast,
    as a micro-batch's forward does (``training.step.run_micro_batch``)."""

    def __init__(self, base: nn.Module, head: nn.Module | None, first: bool,
                 autocast: tuple[str, torch.dtype | None, bool] = ("cpu", None, False)) -> None:
        super().__init__()
        self.base, self.head, self.first = base, head, first
        self._autocast = autocast

    def forward(self, x):
        given = {"input_ids": x} if self.first else {"inputs_embeds": x}
        device_type, dtype, enabled = self._autocast
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            hidden = self.base(**given, use_cache=False).last_hidden_state
            return hidden if self.head is None else self.head(hidden)


def _decoder(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The base model and head of a causal LM that declares its pipeline cut, or a typed error naming what is
    missing."""
    plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    base = getattr(model, "base_model", None)
    head = getattr(model, "lm_head", None)
    if not plan or base is None or head is None or not isinstance(getattr(base, "layers", None), nn.ModuleList):
        raise UnsupportedModelError(
            f"{type(model).__name__} cannot be cut into pipeline stages: autofit cuts Hugging Face causal LMs whose "
            "config declares base_model_pp_plan (embed_tokens, layers, norm) and whose head is lm_head")
    return base, head


def decoder_stages(model: nn.Module, stages: int) -> list[nn.Module]:
    """``model`` (a Hugging Face causal LM whose config declares ``base_model_pp_plan``) cut into ``stages``
    modules that share its parameters, in order (Note [pipeline stages])."""
    base, head = _decoder(model)
    cut = []
    for s, layers in enumerate(layer_split(len(base.layers), stages)):
        part = copy.copy(base)  # a shallow copy: the same submodules, in a module dict of its own
        part._modules = dict(base._modules)
        part.layers = nn.ModuleList(base.layers[i] for i in layers)
        last = s == stages - 1
        if s > 0:  # given the hidden states: its forward never reads the embedding, which the first stage keeps
            part.embed_tokens = None
        if not last:
            part.norm = nn.Identity()
        cut.append(_Stage(part, head if last else None, first=s == 0))
    return cut


def cut_to_stage(model: nn.Module, stage: int, stages: int) -> None:
    """Cut ``model`` (a copy a pipeline rank owns) in place to stage ``stage`` of ``stages``: only its layers, under
    their own names; the embedding on the first stage only, the final norm and the head on the last only (Note
    [pipeline stages]). A model whose head shares the embedding's weight is refused: the two are on different
    stages, and keeping them equal is a collective autofit does not plan."""
    base, head = _decoder(model)
    if stages > 1 and head.weight is getattr(base.embed_tokens, "weight", None):
        raise UnsupportedModelError(
            f"{type(model).__name__} ties its output head to its embedding (tie_word_embeddings), which sit on the "
            "first and the last pipeline stage: autofit does not plan the tied weight's sync across stages; build "
            "the model with tie_word_embeddings=False, or use no pipeline")
    names = {id(m): n for n, m in model.named_modules()}
    held = layer_split(len(base.layers), stages)[stage]
    removed = [names[id(layer)] for i, layer in enumerate(base.layers) if i not in held]
    kept = nn.ModuleList()
    for i in held:
        kept.add_module(str(i), base.layers[i])  # its own name: model.layers.5 stays model.layers.5
    base.layers = kept
    if stage > 0:
        removed.append(names[id(base.embed_tokens)])
        base.embed_tokens = None
    if stage < stages - 1:
        removed += [names[id(base.norm)], names[id(head)]]
        base.norm = nn.Identity()
        model.lm_head = None
    model._autofit_cut_away = tuple(removed)  # what the step's per-module knobs skip (apply.cut_away)


# Note [a pipeline rank's step]
#     A pipeline rank runs the window's micro-batches through torch's own schedule: ``PipelineStage`` over its stage
#     and the schedule's class (``ScheduleGPipe``, ``Schedule1F1B``), built once per model and micro-batch count and
#     kept, as a training loop keeps them: the receive buffers the schedule allocates at its first step are held for
#     its life (benchmarks/pipeline_probe.py, Note [pipeline stage memory]). Every stage is given its input and
#     output shapes (torch's STATIC mode: no step is run to infer them), by the decoder's rule: the first stage takes
#     the micro-batch's ``input_ids`` (rows x sequence), every later one hidden states (rows x sequence x hidden
#     size, in the decoder's parameter dtype: under autocast the residual stream stays in it), the last gives logits
#     (rows x sequence x the head's outputs, in the autocast dtype where autocast runs). The loss of micro-batch i is
#     the step's loss of its logits and target (``compute_loss``, under the step's autocast), weighted by its share of
#     the batch's (the window's ``place(i).weight``), so the gradients are one full-batch step's. The simulation runs
#     the same schedule on a fake process group (Note [a pipeline step on a fake process group], core/_torch.py) and
#     is told each forward and backward as it starts.
_SCHEDULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(name, M): torch's schedule}


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """torch's pipeline schedule ``name`` (a key of :data:`SCHEDULES`) over ``stages`` ranks, running a window of
    ``micro_batches`` (Note [one schedule], Note [a pipeline rank's step])."""

    name: str
    stages: int
    micro_batches: int

    @property
    def in_flight(self) -> int:
        """The micro-batches whose activations the first stage holds at once: all of them under GPipe, its warm-up
        under 1F1B (min(M, S); stage s holds min(M, S - s))."""
        return self.micro_batches if self.name == "gpipe" else min(self.micro_batches, self.stages)

    def simulated(self, window: int) -> int:
        """Every micro-batch: how many are in flight, and when, is the schedule's order over all of them."""
        return self.micro_batches

    def run(self, model: nn.Module, layout: Any, window: Any, *, count: int | None = None,
            sync: Callable[..., contextlib.AbstractContextManager[Any]] | None = None) -> list[Any]:
        from torch.distributed.pipelining import PipelineStage, schedules

        stage_index, group, autocast = model._autofit_stage
        first, last = stage_index == 0, stage_index == self.stages - 1
        inputs = [window.rows(i) for i in range(window.size)]
        ids = [_input_ids(batch) for batch, _ in inputs]
        if len({tuple(i.shape) for i in ids}) > 1:  # the stages' buffers are shaped once, for every micro-batch
            raise InvalidInputError(
                f"a pipeline's micro-batches all have one shape, and this window's are "
                f"{', '.join(str(tuple(i.shape)) for i in ids)}: give a batch whose rows are a multiple of the "
                "micro-batch size, every row of one length")
        running = _SCHEDULES.setdefault(model, {})
        key = (self.name, window.size)
        if key not in running:
            base, _ = _decoder_parts(model)
            module = _Stage(base, model.lm_head if last else None, first, autocast)
            rows, length = ids[0].shape
            dtype = next(p.dtype for p in base.parameters() if p.is_floating_point())
            # shapes only: on the meta device, nothing allocated (torch keeps their metadata, not them)
            hidden = torch.empty(rows, length, model.config.hidden_size, dtype=dtype, device="meta",
                                 requires_grad=True)
            given = ids[0] if first else hidden
            if last:
                out = torch.empty(rows, length, model.lm_head.out_features, device="meta",
                                  dtype=autocast[1] if autocast[2] else dtype, requires_grad=True)
            else:
                out = hidden
            stage = PipelineStage(module, stage_index, self.stages, ids[0].device, input_args=(given,),
                                  output_args=(out,), group=group)
            _tell_phases(stage, window)

            def loss_fn(output, target):
                value, weight = target
                with torch.autocast(autocast[0], dtype=autocast[1], enabled=autocast[2]):
                    loss = window.loss(output, value)
                return loss if weight == 1.0 else loss * weight

            torch_class = getattr(schedules, SCHEDULES[self.name][1])
            running[key] = (torch_class(stage, window.size, loss_fn=loss_fn, scale_grads=False), stage)
        schedule, stage = running[key]
        stage._autofit_window = window
        losses: list[Any] = [] if last else None
        targets = [(None if target is None else target.value, window.place(i).weight)
                   for i, (_, target) in enumerate(inputs)] if last else None
        arguments = [(i,) for i in ids] if first else None
        fake = dist.get_backend(group) == "fake"
        pipeline_step(schedule, arguments, targets, losses, fake_group=fake)
        # the losses are the last stage's (torchtitan reports them from there): NaN on the other ranks
        return [loss.detach() for loss in losses] if last else [math.nan] * window.size


def _tell_phases(stage: Any, window_holder: Any) -> None:
    """The stage tells the step's window (``stage._autofit_window``, the current one) each micro-batch's forward and
    backward as torch's schedule starts them (the simulation files allocations by phase)."""
    forward, backward = stage.forward_one_chunk, stage.backward_one_chunk

    def forward_one_chunk(chunk, *args, **kwargs):
        stage._autofit_window.on_phase(chunk, "forward")
        return forward(chunk, *args, **kwargs)

    def backward_one_chunk(chunk, *args, **kwargs):
        stage._autofit_window.on_phase(chunk, "backward")
        return backward(chunk, *args, **kwargs)

    stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk


def _decoder_parts(model: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    base = getattr(model, "base_model", None)
    return base, getattr(model, "lm_head", None)


def _input_ids(batch: Any) -> torch.Tensor:
    """The micro-batch's token ids, the one input the first stage takes; a typed error for any other input."""
    given = [*batch.args, *batch.kwargs.values()]
    names = [f"input {i}" for i in range(len(batch.args))] + [repr(k) for k in batch.kwargs]
    if len(given) != 1 or not isinstance(given[0], torch.Tensor) or given[0].dim() != 2 or \
            given[0].is_floating_point() or (batch.kwargs and "input_ids" not in batch.kwargs):
        raise InvalidInputError(
            f"a pipeline's first stage takes the token ids alone (rows x sequence, integers), and the sample holds "
            f"{', '.join(names) or 'nothing'}: give the input_ids as the sample and the labels as target=")
    return given[0]


class _Pipeline(Dimension):
    """The pipeline dimension (Note [pipeline stages]): its degree is the stage count, its option the schedule."""

    def choices(self, space: Any):
        """The user's ``pipeline_parallel`` and ``pipeline_schedule`` (``autofit.Layout``); the planner offers no
        pipeline yet."""
        options = getattr(space, "layout_options", None)
        degree = getattr(options, "pipeline_parallel", 1) or 1
        if degree == 1:
            return (Placement(self.name),)
        name = str(getattr(options, "pipeline_schedule", "1f1b")).lower()
        if name not in SCHEDULES:
            raise InvalidInputError(
                f"pipeline_schedule {name!r} is not one autofit runs: one of "
                f"{', '.join(title for title, _ in SCHEDULES.values())} (one stage per rank; the interleaved, "
                "zero-bubble and V schedules are not planned yet)")
        return (Placement(self.name, degree, (("schedule", name),)),)

    def check(self, layout: Layout) -> None:
        pp = layout.degree(self.name)
        if pp == 1:
            return
        if layout.world_size % pp:
            raise InvalidInputError(f"pipeline_parallel {pp} does not divide world_size {layout.world_size}: the "
                                    "mesh's pipeline dim takes pipeline_parallel of its ranks")
        if layout.partial:
            return
        others = [f"{layout.registry[p.dimension].field} {p.degree}" for p in layout.placements
                  if p.dimension != self.name and p.degree > 1]
        shard = layout.placement("dp_shard")
        if others or (shard is not None and shard.option("offload_states", False)):
            raise InvalidInputError(
                f"pipeline_parallel={pp} beside {', '.join(others) or 'offload_states'}: autofit runs a pipeline "
                f"alone for now (world_size = pipeline_parallel = {pp}, strategy='fsdp2'); FSDP2, HSDP and tensor "
                "parallel inside a stage are not planned yet")

    def check_step(self, layout: Layout, placement: Placement, step: StepKnobs) -> None:
        """torch's schedule runs the forwards and backwards itself: the gradients are cleared after the optimizer
        step, no GradScaler scales the loss, 1F1B has at least as many micro-batches as stages (torch refuses
        fewer)."""
        pp = placement.degree
        if pp == 1:
            return
        if str(step.zero_grad) != "after-step":
            raise InvalidInputError(f"zero_grad={step.zero_grad!r} with pipeline_parallel={pp}: torch's pipeline "
                                    "schedule runs every forward and backward itself; use zero_grad='after-step'")
        if step.precision.needs_grad_scaler:
            raise InvalidInputError(f"precision {step.precision.name!r} scales the loss (GradScaler), which a "
                                    f"pipeline schedule does not do: use bf16 with pipeline_parallel={pp}")
        micro = step.accumulation_steps
        if placement.option("schedule") == "1f1b" and micro < pp:
            raise InvalidInputError(
                f"the 1F1B schedule over {pp} stages needs at least {pp} micro-batches (torch's Schedule1F1B refuses "
                f"fewer) and the step has {micro}: raise accumulation_steps to {pp} or use pipeline_schedule='GPipe'")

    def kept_between_steps(self, model: nn.Module, layout: Layout, placement: Placement) -> list[Any]:
        """The receive buffers of the rank's running schedules (activations from the previous stage, gradients from
        the next), allocated at their first step and kept for their life (Note [a pipeline rank's step])."""
        kept = []
        for _, stage in _SCHEDULES.get(model, {}).values():
            for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
                kept += [buffer for info in infos if isinstance(buffer := getattr(info, "buffer", None), torch.Tensor)]
        return kept

    def ranks_differ(self, layout: Layout, placement: Placement) -> bool:
        return placement.degree > 1

    def model_ways(self, layout: Layout, placement: Placement) -> int:
        return placement.degree

    def cut(self, model: nn.Module, layout: Layout, placement: Placement, inputs: ApplyInputs) -> nn.Module:
        """This rank's stage of ``model`` (its copy: Note [pipeline stages]), its coordinate along the mesh's
        pipeline dim, and the group its stages send over."""
        if placement.degree == 1:
            return model
        mesh = inputs.mesh[self.name]
        stage = mesh.get_local_rank()
        cut_to_stage(model, stage, placement.degree)
        # the step's autocast (FSDP2's gather dtype is the autocast dtype, None without: ApplyInputs.param_dtype)
        autocast = (mesh.device_type, inputs.param_dtype, inputs.param_dtype is not None)
        model._autofit_stage = (stage, mesh.get_group(), autocast)
        return model

    def schedule(self, layout: Layout, placement: Placement, micro_batches: int) -> PipelineSchedule | None:
        if placement.degree == 1:
            return None
        return PipelineSchedule(placement.option("schedule", "1f1b"), placement.degree, micro_batches)

    def words(self, layout: Layout, placement: Placement, *, ranks: bool = False, after_forward: str = "") -> str:
        if placement.degree == 1:
            return ""
        return f"pp {placement.degree} ({SCHEDULES[placement.option('schedule', '1f1b')][0]})"

    def export(self, framework: str, layout: Layout, placement: Placement, inputs: ExportInputs) -> ExportFragment:
        """torchtitan's degree and schedule name; the other frameworks' exports say they cannot express it."""
        pp = placement.degree
        if framework == "torchtitan":
            settings: dict[str, Any] = {"parallelism": {"pipeline_parallel_degree": pp}}
            if pp > 1:
                # torchtitan's schedule splits each rank's local batch into micro-batches of
                # pipeline_parallel_microbatch_size rows (torchtitan/distributed/pipeline_parallel.py,
                # build_pipeline_schedule): the plan's window is one local batch, its accumulation the schedule's
                settings["parallelism"].update(
                    pipeline_parallel_schedule=SCHEDULES[placement.option("schedule", "1f1b")][0],
                    pipeline_parallel_microbatch_size=inputs.micro_batch_size)
                settings["training"] = {"local_batch_size": inputs.micro_batch_size * inputs.accumulation_steps}
            return ExportFragment(settings)
        if pp == 1:
            return ExportFragment()
        return ExportFragment(unexpressed=(f"pipeline parallel {pp} ({framework} has no pipeline schedule in this "
                                           "export: run it with torchtitan or torch.distributed.pipelining)",))


PIPELINE = _Pipeline(name="pp", mesh_rank=0, shares_rows=True, field="pipeline_parallel")
