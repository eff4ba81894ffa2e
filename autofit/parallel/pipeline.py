"""Pipeline parallelism (issue 59): the model cut into stages, one per pipeline rank, run by torch's own pipeline
schedules (``torch.distributed.pipelining``). A layout dimension (Note [layout dimensions], parallel/dimension.py):
the ranks along it hold different layers (so each is simulated: ``ranks_differ``), train the same rows, and run the
window's micro-batches as torch's schedule orders them (Note [one schedule], parallel/schedule.py).

``estimate``, ``measure``, the trainer, the CLI (``--pipeline-parallel``, ``--schedule``) and the torchtitan export run
it: every torch schedule (DualPipeV's overlapped halves one after the other, as torch runs them), with FSDP2 and
tensor parallel (sequence parallel too) inside each stage, each stage's layers the even split or the user's
(``Layout.pipeline_layers``); :func:`pipeline_time` runs a schedule's order for its step's time (Note [a schedule's
time]), with which ``plan`` chooses a pipeline's micro-batches and recomputation, and (``"auto"``) its schedule and
degree (Note [planning a pipeline], autofit/planning/pipeline.py). Not yet: the planner does not balance the split,
nor HSDP or offload inside a stage. See Note [pipeline stages], Note [a pipeline rank's step] and docs/multi-gpu.md
("Pipeline parallel").

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
    its own copy in place (:func:`cut_to_stages`, as torchtitan deletes what a stage does not hold), the kept layers
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

from autofit.core._torch import is_view, pipeline_order, pipeline_step
from autofit.core.errors import InvalidInputError, UnsupportedModelError
from autofit.parallel.dimension import ApplyInputs, Dimension, Layout, Placement, StepKnobs
from autofit.parallel.exports import ExportFragment, ExportInputs
from autofit.parallel.sequence_parallel import is_sequence_parallel

__all__ = ["PIPELINE", "PipelineSchedule", "PipelineTime", "SCHEDULES", "ScheduleKind", "StageSeconds",
           "cut_to_stages", "decoder_names", "decoder_stages", "layer_split", "micro_batch_rule", "pipeline_time"]

@dataclasses.dataclass(frozen=True)
class ScheduleKind:
    """One of torch's pipeline schedules: its name as torchtitan's ``pipeline_parallel_schedule`` and torch's
    ``get_schedule_class`` spell it, its class in torch/distributed/pipelining/schedules.py, the stages each rank
    holds (1, or 2 for the multi-stage schedules: torchtitan's default of two virtual stages per rank), and how
    stages are dealt to ranks ("loop": rank r holds r, r + P, ...; "v": r and 2P - 1 - r, torch's
    ``generate_stage_to_rank_mapping``)."""

    title: str
    torch_class: str
    per_rank: int = 1
    style: str = "loop"

    def stages_of(self, rank: int, ranks: int) -> list[int]:
        """The stage indices rank ``rank`` of ``ranks`` holds, in order."""
        if self.style == "v":
            return [rank, 2 * ranks - 1 - rank]
        return [rank + k * ranks for k in range(self.per_rank)]


# By lower-case name (torch's get_schedule_class matches names without case). DualPipeV's "overlapped" actions
# (OVERLAP_F_B: one micro-batch's forward beside another's backward) run their two halves one after the other unless a
# function is registered for them (``_PipelineScheduleRuntime.register_custom_function``; without one its step runs
# each sub-action in turn, torch/distributed/pipelining/schedules.py, 2.13 to 2.15): autofit runs and plans it so,
# as torch does for a model that registers none (DeepSeek's overlap of communication with compute is not modelled).
SCHEDULES = {kind.title.lower(): kind for kind in (
    ScheduleKind("GPipe", "ScheduleGPipe"), ScheduleKind("1F1B", "Schedule1F1B"),
    ScheduleKind("Interleaved1F1B", "ScheduleInterleaved1F1B", 2),
    ScheduleKind("LoopedBFS", "ScheduleLoopedBFS", 2),
    ScheduleKind("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble", 2),
    ScheduleKind("ZBVZeroBubble", "ScheduleZBVZeroBubble", 2, "v"),
    ScheduleKind("DualPipeV", "ScheduleDualPipeV", 2, "v"))}


def layer_split(layers: int, stages: int, given: tuple[int, ...] | None = None) -> list[range]:
    """The layers of each stage: ``given`` (the user's ``pipeline_layers``, each stage's count in stage order),
    checked against the model's ``layers``, or an even split by count with the remainder on the first stages:
    torchtitan's ``_generate_llm_fqn_per_model_part`` with ``pipeline_parallel_first_stage_less_layers`` and
    ``..._last_stage_less_layers`` 0 (torchtitan/distributed/pipeline_parallel.py; its default of 1 counts the
    embedding and the head as a layer each, so its default split differs where the layers do not divide, and its
    ``generate_split_points`` of late 2024 gave the first stage the even share and the middle stages the remainder:
    ``pipeline_layers`` rebuilds either)."""
    if given is not None:
        if len(given) != stages or sum(given) != layers:
            raise InvalidInputError(
                f"pipeline_layers {list(given)} gives {len(given)} stages {sum(given)} layers, and the model's "
                f"{layers} layers run in {stages} stages (pipeline_parallel x the schedule's stages per rank): give "
                f"{stages} positive counts summing to {layers}, or None for the even split")
        counts = list(given)
    else:
        if not 1 <= stages <= layers:
            raise UnsupportedModelError(f"{layers} layers cannot be split over {stages} pipeline stages: give at "
                                        f"most {layers} stages")
        size, extra = divmod(layers, stages)
        counts = [size + (1 if s < extra else 0) for s in range(stages)]
    bounds, start = [], 0
    for count in counts:
        bounds.append(range(start, start + count))
        start += count
    return bounds


# Note [a schedule's time]
#     A pipeline's step takes longer than its ranks compute: a rank waits for what the stage before it sends (in
#     forward) or the stage after it (in backward), and how long depends on the schedule's order, which torch builds
#     for every rank (Note [a schedule's order without its stages], core/_torch.py). :func:`pipeline_time` runs that
#     order: each rank takes its actions in turn, an action starting when the rank is free and what it needs has
#     ended (a forward: the previous stage's forward of its micro-batch; a backward, or the input half of a split
#     one: the next stage's; the last stage's backward: its own forward; a weight half: its input half), plus the
#     transfer where the two stages sit on different ranks. Sends do not hold the sender (torch's are asynchronous),
#     and a rank's wait steps (None in torch's order) are the waits this finds. So the bubble is the order's, on the
#     installed torch, not a formula's: at equal stages and no transfers it is GPipe's and 1F1B's (P - 1)(F + B)
#     and interleaved 1F1B's (P - 1)(F + B) / v (Narayanan et al., SC 2021, section 2.2), which the tests check.
#     Not modelled: compute overlapping a transfer on the same rank (a send's own time), FSDP2's gathers and
#     reduce-scatters inside a stage (priced apart, as for any FSDP2 layout), and DualPipeV's overlap of one
#     micro-batch's forward with another's backward, which torch runs one after the other unless the model registers
#     a function for it.
@dataclasses.dataclass(frozen=True)
class StageSeconds:
    """One stage's compute for one micro-batch: its forward, and its backward's two halves, the input gradients
    and the weight gradients (a full backward is both; the zero-bubble schedules run them apart)."""

    forward: float
    backward_input: float
    backward_weight: float


@dataclasses.dataclass(frozen=True)
class PipelineTime:
    """A schedule's step (Note [a schedule's time]): ``step_seconds`` from the first action to the last rank's
    last, ``busy_seconds`` each rank's compute within it."""

    step_seconds: float
    busy_seconds: tuple[float, ...]

    @property
    def idle_share(self) -> float:
        """The share of the step the least idle rank waits (the bubble every rank sits through at least)."""
        return 1.0 - max(self.busy_seconds) / self.step_seconds if self.step_seconds else 0.0


def pipeline_time(schedule: str, ranks: int, micro_batches: int, stages: list[StageSeconds],
                  transfer_seconds: float = 0.0) -> PipelineTime:
    """The step of ``schedule`` (a key of :data:`SCHEDULES`) over ``ranks`` ranks and ``micro_batches``, each stage
    computing ``stages[s]`` per micro-batch (one entry per stage: ``ranks`` times the schedule's stages per rank),
    a hand-off between stages on different ranks taking ``transfer_seconds`` (Note [a schedule's time])."""
    kind = SCHEDULES[schedule]
    count = ranks * kind.per_rank
    if len(stages) != count:
        raise InvalidInputError(f"{kind.title} over {ranks} ranks runs {count} stages, and {len(stages)} stage "
                                "times were given: one per stage")
    rank_of = {stage: rank for rank in range(ranks) for stage in kind.stages_of(rank, ranks)}
    order = _order(kind, ranks, micro_batches)
    ended: dict[tuple[int, str, int], float] = {}

    def hop(stage: int, other: int) -> float:
        return 0.0 if rank_of[stage] == rank_of[other] else transfer_seconds

    def ready(stage: int, kind_: str, micro: int) -> float | None:
        """When what the action needs has ended (and reached its rank), or None: not yet run."""
        if kind_ == "F":
            needs = [((stage - 1, "F", micro), hop(stage, stage - 1))] if stage > 0 else []
        elif kind_ == "W":
            needs = [((stage, "I", micro), 0.0)]
        elif stage == count - 1:
            needs = [((stage, "F", micro), 0.0)]
        else:
            done = (stage + 1, "B", micro) if (stage + 1, "B", micro) in ended else (stage + 1, "I", micro)
            needs = [(done, hop(stage, stage + 1))]
        if any(need not in ended for need, _ in needs):
            return None
        return max((ended[need] + transfer for need, transfer in needs), default=0.0)

    def seconds(stage: int, kind_: str) -> float:
        s = stages[stage]
        return {"F": s.forward, "B": s.backward_input + s.backward_weight, "I": s.backward_input,
                "W": s.backward_weight}[kind_]

    position, clock, busy = dict.fromkeys(order, 0), dict.fromkeys(order, 0.0), dict.fromkeys(order, 0.0)
    left = sum(len(actions) for actions in order.values())
    while left:
        moved = False
        for rank, actions in order.items():
            while position[rank] < len(actions):
                action = actions[position[rank]]
                start = ready(*action)
                if start is None:
                    break
                took = seconds(action[0], action[1])
                clock[rank] = ended[action] = max(clock[rank], start) + took
                busy[rank] += took
                position[rank] += 1
                left -= 1
                moved = True
        if not moved:  # torch's own orders never wait on each other; a new schedule that did is named
            waiting = {rank: actions[position[rank]] for rank, actions in order.items()
                       if position[rank] < len(actions)}
            raise UnsupportedModelError(f"{kind.title}'s order over {ranks} ranks and {micro_batches} micro-batches "
                                        f"waits for ever: each rank's next action {waiting}")
    return PipelineTime(max(clock.values()), tuple(busy[rank] for rank in sorted(busy)))


def _equal_stages(kind: ScheduleKind, ranks: int, micro_batches: int) -> PipelineTime:
    """``kind``'s step with every stage's forward 1, its backward 2 (1 + 1 split), per rank."""
    stage = StageSeconds(1 / kind.per_rank, 1 / kind.per_rank, 1 / kind.per_rank)
    return pipeline_time(kind.title.lower(), ranks, micro_batches, [stage] * (ranks * kind.per_rank))


def _order(kind: ScheduleKind, ranks: int, micro_batches: int) -> dict[int, list[tuple[int, str, int]]]:
    """Each rank's compute actions in the order its step runs them: the multi-stage schedules run torch's
    ``pipeline_order`` (Note [a schedule's order without its stages]); GPipe and 1F1B run a loop of their own
    (``_step_microbatches``), written here as it runs: GPipe every forward then every backward; 1F1B stage s
    min(M, P - s) forwards first, then a backward and a forward in turn while forwards remain, then the rest of the
    backwards. (Their ``pipeline_order``, which torch builds to draw them, differs: 1F1B's leaves the last stage's
    first forward out, on 2.13 and 2.14.)"""
    if kind.per_rank > 1:
        return pipeline_order(kind.torch_class, ranks, kind.stages_of(0, ranks), ranks * kind.per_rank,
                              micro_batches)
    order = {}
    for stage in range(ranks):
        forwards = [(stage, "F", m) for m in range(micro_batches)]
        backwards = [(stage, "B", m) for m in range(micro_batches)]
        if kind.title == "GPipe":
            order[stage] = forwards + backwards
            continue
        warm = min(micro_batches, ranks - stage)
        actions = forwards[:warm]
        for m in range(micro_batches):
            actions.append(backwards[m])
            if warm + m < micro_batches:
                actions.append(forwards[warm + m])
        order[stage] = actions
    return order


def micro_batch_rule(kind: ScheduleKind, ranks: int, micro: int) -> str | None:
    """Why torch's ``kind`` refuses ``micro`` micro-batches over ``ranks`` ranks, with the fix, or None: 1F1B needs
    at least as many micro-batches as stages, DualPipeV twice as many, the interleaved schedules whole rounds of
    ``ranks`` (torch raises these when the schedule is made or stepped; a planner reads them as rules)."""
    if kind.title == "1F1B" and micro < ranks:
        return (f"the 1F1B schedule over {ranks} stages needs at least {ranks} micro-batches (torch's Schedule1F1B "
                f"refuses fewer) and the step has {micro}: raise accumulation_steps to {ranks} or use "
                "pipeline_schedule='GPipe'")
    if kind.title == "DualPipeV" and micro < 2 * ranks:
        return (f"the DualPipeV schedule over {ranks} ranks ({2 * ranks} stages) needs at least {2 * ranks} "
                f"micro-batches (torch's ScheduleDualPipeV refuses fewer) and the step has {micro}: raise "
                f"accumulation_steps to {2 * ranks} or use pipeline_schedule='ZBVZeroBubble'")
    rounds = max(1, micro // ranks)  # torch's number_of_rounds (ScheduleInterleaved1F1B, ...InterleavedZeroBubble)
    if kind.title in ("Interleaved1F1B", "InterleavedZeroBubble") and micro % rounds:
        fits = [m for m in range(micro, micro + ranks * rounds + 1) if m % max(1, m // ranks) == 0][0]
        return (f"the {kind.title} schedule over {ranks} ranks runs its micro-batches in rounds of {ranks} and "
                f"needs a whole number of rounds ({micro} micro-batches make {micro / ranks:.2f}; torch refuses "
                f"them): use accumulation_steps={fits}")
    return None


class _Stage(nn.Module):
    """One stage of a Hugging Face decoder (Note [pipeline stages]); its forward runs under the step's autocast,
    as a micro-batch's forward does (``training.step.run_micro_batch``)."""

    def __init__(self, base: nn.Module, head: nn.Module | None, first: bool,
                 autocast: tuple[str, torch.dtype | None, bool] = ("cpu", None, False), sequence_split: int = 1,
                 ) -> None:
        super().__init__()
        self.base, self.head, self.first = base, head, first
        self._autocast = autocast
        self._sequence_split = sequence_split

    def forward(self, x):
        given = {"input_ids": x} if self.first else {"inputs_embeds": x}
        if not self.first and self._sequence_split > 1:
            # Note [sequence parallel across stages]: the rank's shard of the sequence, positioned in the whole one
            length = x.shape[1] * self._sequence_split
            given["position_ids"] = torch.arange(length, device=x.device).unsqueeze(0)
        device_type, dtype, enabled = self._autocast
        with torch.autocast(device_type, dtype=dtype, enabled=enabled):
            hidden = self.base(**given, use_cache=False).last_hidden_state
            return hidden if self.head is None else self.head(hidden)


# Note [sequence parallel across stages]
#     With sequence parallel inside the stages (tensor parallel's norms and residual stream split along the
#     sequence: Note [sequence parallel], parallel/sequence_parallel.py) the hidden states between blocks are each
#     rank's shard of the sequence, and so are those a stage sends to the next: torchtitan's stages exchange them so
#     (its blocks' outputs are sequence-sharded local tensors, torchtitan/models/llama3/parallelize.py), 1/T of the
#     whole in every send, receive buffer and gradient. The first block of the model cuts the whole embedding to the
#     shard ("sequence_shard", on the first stage only) and the final norm gathers it back ("sequence_gather_whole",
#     on the last only), as without a pipeline. A later stage is given its shard as ``inputs_embeds`` and the
#     whole sequence's positions (``position_ids``, 0 to T x its length), from which the decoder derives the rotary
#     embeddings every block's attention applies after gathering the sequence; its causal mask is the whole one
#     (SDPA's is_causal). The stages' gradients equal one full-batch step's (tests/test_pipeline.py).


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


def decoder_names(model: nn.Module) -> tuple[list[str], dict[str, tuple[str, ...]]]:
    """The names in ``model`` of its decoder layers, in order, and of the modules outside them that the first stage
    holds (``"first"``: the embedding) and the last (``"last"``: the final norm and the head); Note [pipeline
    stages]."""
    base, head = _decoder(model)
    names = {id(m): n for n, m in model.named_modules()}
    return ([names[id(layer)] for layer in base.layers],
            {"first": (names[id(base.embed_tokens)],), "last": (names[id(base.norm)], names[id(head)])})


def decoder_stages(model: nn.Module, stages: int, layers: tuple[int, ...] | None = None) -> list[nn.Module]:
    """``model`` (a Hugging Face causal LM whose config declares ``base_model_pp_plan``) cut into ``stages``
    modules that share its parameters, in order, ``layers`` decoder layers each (None: :func:`layer_split`'s even
    split; Note [pipeline stages])."""
    base, head = _decoder(model)
    cut = []
    for s, layers in enumerate(layer_split(len(base.layers), stages, layers)):
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


def cut_to_stages(model: nn.Module, held: list[int], stages: int,
                  autocast: tuple[str, torch.dtype | None, bool] = ("cpu", None, False),
                  layers: tuple[int, ...] | None = None, sequence_split: int = 1) -> list[nn.Module]:
    """Cut ``model`` (a copy a pipeline rank owns) in place to the stages ``held`` of ``stages`` (``layers`` decoder
    layers each, or :func:`layer_split`'s even split where None): only their layers, under their own names; the
    embedding where the first stage is held, the final norm and the head where the last is (Note [pipeline
    stages]); ``sequence_split``: the T ranks sequence parallel splits the hidden states over (Note [sequence
    parallel across stages]). Returns one module per held stage, in order, sharing the cut model's modules (each
    a stage torch's ``PipelineStage`` runs). A model whose head shares the embedding's weight is refused: the two
    are on different stages, and keeping them equal is a collective autofit does not plan."""
    base, head = _decoder(model)
    if stages > 1 and head.weight is getattr(base.embed_tokens, "weight", None):
        raise UnsupportedModelError(
            f"{type(model).__name__} ties its output head to its embedding (tie_word_embeddings), which sit on the "
            "first and the last pipeline stage: autofit does not plan the tied weight's sync across stages; build "
            "the model with tie_word_embeddings=False, or use no pipeline")
    names = {id(m): n for n, m in model.named_modules()}
    split = layer_split(len(base.layers), stages, layers)
    kept_layers = sorted(i for s in held for i in split[s])
    removed = [names[id(layer)] for i, layer in enumerate(base.layers) if i not in kept_layers]
    layers = list(base.layers)
    kept = nn.ModuleList()
    for i in kept_layers:
        kept.add_module(str(i), layers[i])  # its own name: model.layers.5 stays model.layers.5
    embedding, norm = base.embed_tokens, base.norm
    base.layers = kept
    if 0 not in held:
        removed.append(names[id(embedding)])
        base.embed_tokens = None
    if stages - 1 not in held:
        removed += [names[id(norm)], names[id(head)]]
        base.norm = nn.Identity()
        model.lm_head = None
    model._autofit_cut_away = tuple(removed)  # what the step's per-module knobs skip (apply.held_names)
    modules = []
    for s in held:
        part = copy.copy(base)  # a shallow copy: the same submodules, in a module dict of its own
        part._modules = dict(base._modules)
        part.layers = nn.ModuleList(layers[i] for i in split[s])
        part.embed_tokens = embedding if s == 0 else None
        part.norm = norm if s == stages - 1 else nn.Identity()
        modules.append(_Stage(part, head if s == stages - 1 else None, s == 0, autocast, sequence_split))
    return modules


# Note [a pipeline rank's step]
#     A pipeline rank runs the window's micro-batches through torch's own schedule: a ``PipelineStage`` over each
#     stage it holds and the schedule's class (``ScheduleGPipe``, ``Schedule1F1B``, the multi-stage ones over two
#     stages per rank), built once per model and micro-batch count and kept, as a training loop keeps them: the
#     receive buffers the schedule allocates at its first step are held for its life (benchmarks/pipeline_probe.py,
#     Note [pipeline stage memory]). Every stage is given its input and output shapes (torch's STATIC mode: no step is
#     run to infer them), by the decoder's rule: the first stage takes the micro-batch's ``input_ids`` (rows x
#     sequence), every later one hidden states (rows x sequence x hidden size, in the decoder's parameter dtype: under
#     autocast the residual stream stays in it), the last gives logits (rows x sequence x the head's outputs, in the
#     autocast dtype where autocast runs). The loss of micro-batch i is the step's loss of its logits and target
#     (the window's ``loss``, under the step's autocast), weighted by its share of the batch's (the window's
#     ``place(i).weight``), so the gradients are one full-batch step's. The simulation runs the same schedule on a
#     fake process group (Note [a pipeline step on a fake process group], core/_torch.py) and is told each forward
#     and backward (a zero-bubble schedule's input and weight halves both as backward) as it starts.
_SCHEDULES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(name, M): (schedule, stages)}


@dataclasses.dataclass(frozen=True)
class _RankStages:
    """What a rank's cut (``Dimension.cut``) left for its schedule: the stage indices it holds of ``stages``, one
    module per held stage, the group the stages send over, the step's autocast, and sequence parallel's split of the
    hidden states the stages exchange."""

    held: tuple[int, ...]
    stages: int
    modules: tuple[nn.Module, ...]
    group: Any
    autocast: tuple[str, torch.dtype | None, bool]
    # sequence parallel's T: the hidden states between stages are 1/T of the sequence (Note [sequence parallel
    # across stages])
    sequence_split: int = 1


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
    """torch's pipeline schedule ``name`` (a key of :data:`SCHEDULES`) over ``ranks`` ranks, running a window of
    ``micro_batches`` (Note [one schedule], Note [a pipeline rank's step])."""

    name: str
    ranks: int
    micro_batches: int

    @property
    def in_flight(self) -> int:
        """The micro-batches whose activations the first rank holds at once, at most: all of them under GPipe and
        the multi-stage schedules (bounded by their warm-up, which the simulation runs), its warm-up under 1F1B
        (min(M, P); rank r holds min(M, P - r))."""
        return min(self.micro_batches, self.ranks) if self.name == "1f1b" else self.micro_batches

    def simulated(self, window: int) -> int:
        """Every micro-batch: how many are in flight, and when, is the schedule's order over all of them."""
        return self.micro_batches

    def note(self) -> str:
        """The share of the step each rank waits under this schedule's order and under the others that run these
        micro-batches, at equal stage times and no transfers (Note [a schedule's time]): the time side of the
        schedule's memory."""
        idle = {kind.title: _equal_stages(kind, self.ranks, self.micro_batches).idle_share
                for kind in SCHEDULES.values() if micro_batch_rule(kind, self.ranks, self.micro_batches) is None}
        own = SCHEDULES[self.name].title
        others = ", ".join(f"{title} {share:.1%}" for title, share in idle.items() if title != own)
        micro = f"{self.micro_batches} micro-batch{'es' if self.micro_batches > 1 else ''}"
        return (f"{own}'s order over {self.ranks} ranks and {micro} keeps every rank "
                f"waiting at least {idle[own]:.1%} of the step at equal stage times and no transfers ({others}; "
                "Note [a schedule's time], autofit/parallel/pipeline.py): more micro-batches or another schedule "
                "waits less")

    def run(self, model: nn.Module, layout: Any, window: Any, *, count: int | None = None,
            sync: Callable[..., contextlib.AbstractContextManager[Any]] | None = None) -> list[Any]:
        rank: _RankStages = model._autofit_stage
        holds_first, holds_last = 0 in rank.held, rank.stages - 1 in rank.held
        inputs = [window.rows(i) for i in range(window.size)]
        ids = [_input_ids(batch) for batch, _ in inputs]
        labels = [batch.kwargs.get("labels") if batch.kind == "dict" else None for batch, _ in inputs]
        if len({tuple(i.shape) for i in ids}) > 1:  # the stages' buffers are shaped once, for every micro-batch
            raise InvalidInputError(
                f"a pipeline's micro-batches all have one shape, and this window's are "
                f"{', '.join(str(tuple(i.shape)) for i in ids)}: give a batch whose rows are a multiple of the "
                "micro-batch size, every row of one length")
        running = _SCHEDULES.setdefault(model, {})
        key = (self.name, window.size)
        if key not in running:
            running[key] = _torch_schedule(self, model, rank, window, ids[0])
        schedule, stages = running[key]
        for stage in stages:
            stage._autofit_window = window
        losses: list[Any] | None = [] if holds_last else None
        # a sample that carries its labels is trained on the model's own loss, as its forward computes it
        targets = [(labels[i], window.place(i).weight, True) if target is None and labels[i] is not None
                   else (None if target is None else target.value, window.place(i).weight, False)
                   for i, (_, target) in enumerate(inputs)] if holds_last else None
        arguments = [(i,) for i in ids] if holds_first else None
        pipeline_step(schedule, arguments, targets, losses, fake_group=dist.get_backend(rank.group) == "fake")
        # the losses are the last stage's (torchtitan reports them from there): NaN on the other ranks
        return [loss.detach() for loss in losses] if losses is not None else [math.nan] * window.size


def _torch_schedule(schedule: PipelineSchedule, model: nn.Module, rank: _RankStages, window: Any,
                    ids: torch.Tensor) -> tuple[Any, list]:
    """torch's schedule of ``schedule`` over the rank's stages, each given its shapes (Note [a pipeline rank's
    step])."""
    from torch.distributed.pipelining import PipelineStage, schedules

    rows, length = ids.shape
    device_type, dtype_autocast, autocast = rank.autocast
    dtype = next(p.dtype for m in rank.modules for p in m.parameters() if p.is_floating_point())
    # shapes only: on the meta device, nothing allocated (torch keeps their metadata, not them)
    hidden = torch.empty(rows, length // rank.sequence_split, model.config.hidden_size, dtype=dtype, device="meta",
                         requires_grad=True)
    stages = []
    for index, module in zip(rank.held, rank.modules, strict=True):
        given = ids if index == 0 else hidden
        out = hidden
        if index == rank.stages - 1:
            out = torch.empty(rows, length, module.head.out_features, device="meta",
                              dtype=dtype_autocast if autocast else dtype, requires_grad=True)
        stage = PipelineStage(module, index, rank.stages, ids.device, input_args=(given,), output_args=(out,),
                              group=rank.group)
        _tell_phases(stage)
        stages.append(stage)

    def loss_fn(output, target):  # the step's loss of the window now running (each step hands its own)
        value, weight, own = target
        loss_of = stages[0]._autofit_window.loss
        with torch.autocast(device_type, dtype=dtype_autocast, enabled=autocast):
            if own:  # the model's own loss of its logits and labels (transformers' ``loss_function``), checked
                loss = loss_of(model.loss_function(logits=output, labels=value, vocab_size=model.config.vocab_size),
                               None)
            else:
                loss = loss_of(output, value)
        # torch's split backward (the zero-bubble schedules) detaches the loss in place (``stage_backward_input``,
        # torch/distributed/pipelining/_backward.py), which a view refuses (a model's own loss may be one): the
        # product is not, and times 1.0 it is the same value
        return loss * weight if weight != 1.0 or is_view(loss) else loss

    torch_class = getattr(schedules, SCHEDULES[schedule.name].torch_class)
    try:
        built = torch_class(stages[0] if SCHEDULES[schedule.name].per_rank == 1 else stages, window.size,
                            loss_fn=loss_fn, scale_grads=False)
    except ValueError as e:  # a micro-batch count the schedule refuses (_Pipeline.check_step's rules first)
        raise InvalidInputError(f"pipeline_schedule {SCHEDULES[schedule.name].title!r} with {window.size} "
                                f"micro-batches over {schedule.ranks} ranks: {e}") from e
    return built, stages


def _tell_phases(stage: Any) -> None:
    """The stage tells the step's window (``stage._autofit_window``, the current one) each micro-batch's forward and
    backward as torch's schedule starts them (the simulation files allocations by phase); a zero-bubble schedule's
    weight half of a backward is a backward too."""
    for name, phase in (("forward_one_chunk", "forward"), ("backward_one_chunk", "backward"),
                        ("backward_weight_one_chunk", "backward")):
        original = getattr(stage, name, None)
        if original is None:
            continue

        def told(chunk, *args, _original=original, _phase=phase, **kwargs):
            stage._autofit_window.on_phase(chunk, _phase)
            return _original(chunk, *args, **kwargs)

        setattr(stage, name, told)


def _input_ids(batch: Any) -> torch.Tensor:
    """The micro-batch's token ids, the one input the first stage takes (a dict sample may carry its ``labels``
    beside them, for the model's own loss); a typed error for any other input."""
    given = dict(enumerate(batch.args)) | {k: v for k, v in batch.kwargs.items() if k != "labels"}
    ids = next(iter(given.values()), None)
    if len(given) != 1 or not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point() or \
            (batch.kwargs and "input_ids" not in batch.kwargs):
        names = [f"input {k}" if isinstance(k, int) else repr(k) for k in (*range(len(batch.args)), *batch.kwargs)]
        raise InvalidInputError(
            f"a pipeline's first stage takes the token ids alone (rows x sequence, integers; 'labels' beside them "
            f"for the model's own loss), and the sample holds {', '.join(names) or 'nothing'}: give the input_ids "
            "as the sample and the labels as target= (or in the sample as 'labels')")
    return ids


def _degrees(space: Any) -> tuple[int, ...]:
    """The pipeline degrees ``pipeline_parallel="auto"`` races beside none: 2, 4, 8 and 16 dividing the world size,
    each stage at least one layer (two stages a rank under the multi-stage schedules), for a model autofit can cut
    (a Hugging Face causal LM declaring its pipeline cut, its head untied: Note [pipeline stages]); () otherwise."""
    model = getattr(space, "model", None)
    try:
        base, head = _decoder(model)
    except UnsupportedModelError:
        return ()
    if head.weight is getattr(base.embed_tokens, "weight", None):
        return ()
    layers, world = len(base.layers), getattr(space, "world_size", 1)
    return tuple(d for d in (2, 4, 8, 16) if world % d == 0 and 2 * d <= layers)


class _Pipeline(Dimension):
    """The pipeline dimension (Note [pipeline stages]): its degree is the stage count, its option the schedule."""

    def choices(self, space: Any):
        """The user's ``pipeline_parallel`` (``"auto"``: none and every degree :func:`_degrees` allows),
        ``pipeline_schedule`` (``"auto"``: every schedule), each a layout the planner races, and ``pipeline_layers``
        (``autofit.Layout``). Where the model is known, each stage's layers are placed with the schedule (the even
        split where none are given), checked against it before anything runs: the cut, the trainer and the
        torchtitan export read the one split."""
        user = getattr(space, "layout_options", None)
        degree = getattr(user, "pipeline_parallel", 1) or 1
        if degree == "auto":  # no pipeline, and every degree the model and the ranks allow
            return (Placement(self.name),) + tuple(p for d in _degrees(space) for p in self._placements(space, d))
        if degree == 1:
            return (Placement(self.name),)
        return self._placements(space, degree)

    def _placements(self, space: Any, degree: int) -> tuple[Placement, ...]:
        """The placements of a pipeline of ``degree`` stages: one per schedule the user's ``pipeline_schedule``
        names (every one under "auto")."""
        user = getattr(space, "layout_options", None)
        name = str(getattr(user, "pipeline_schedule", "1f1b")).lower()
        if name != "auto" and name not in SCHEDULES:
            raise InvalidInputError(
                f"pipeline_schedule {name!r} is not one autofit runs: one of "
                f"{', '.join(kind.title for kind in SCHEDULES.values())} (torch's names), or 'auto' (plan chooses)")
        given = getattr(user, "pipeline_layers", None)
        if name == "auto" and given is not None and len({kind.per_rank for kind in SCHEDULES.values()}) > 1:
            raise InvalidInputError(
                f"pipeline_layers {list(given)} with pipeline_schedule='auto': the schedules hold one or two stages "
                "per rank, so one split cannot serve them all: name the schedule, or leave the split out")
        found = []
        for key in (SCHEDULES if name == "auto" else (name,)):  # "auto": every schedule, each a layout to race
            options: tuple[tuple[str, Any], ...] = (("schedule", key),)
            model = getattr(space, "model", None)
            if model is not None:
                split = layer_split(len(_decoder(model)[0].layers), degree * SCHEDULES[key].per_rank, given)
                options += (("layers", tuple(len(r) for r in split)),)
            found.append(Placement(self.name, degree, options))
        return tuple(found)

    def check(self, layout: Layout) -> None:
        pp = layout.degree(self.name)
        if pp == 1:
            return
        if layout.world_size % pp:
            raise InvalidInputError(f"pipeline_parallel {pp} does not divide world_size {layout.world_size}: the "
                                    "mesh's pipeline dim takes pipeline_parallel of its ranks")
        if layout.partial:
            return
        if layout.placement("dp_shard") is None:  # DDP's layout: its replicas take no mesh, the stages need one
            raise InvalidInputError(
                f"pipeline_parallel={pp} with strategy='ddp': autofit runs a pipeline on a device mesh, with FSDP2 "
                "over the ranks of each stage (FSDP2 over one rank where the pipeline takes every rank): use "
                "strategy='fsdp2'")
        others = [f"{layout.registry[p.dimension].field} {p.degree}" for p in layout.placements
                  if p.dimension not in (self.name, "dp_shard", "tp") and p.degree > 1]
        shard = layout.placement("dp_shard")
        if others or (shard is not None and shard.option("offload_states", False)):
            raise InvalidInputError(
                f"pipeline_parallel={pp} beside {', '.join(others) or 'offload_states'}: autofit runs a pipeline "
                "with FSDP2 and tensor parallel inside each stage (strategy='fsdp2', world_size a multiple of "
                "pipeline_parallel x tensor_parallel, replicate=1); HSDP and offload inside a stage are not "
                "planned yet")

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
        why = micro_batch_rule(SCHEDULES[placement.option("schedule", "1f1b")], pp, step.accumulation_steps)
        if why is not None:
            raise InvalidInputError(why)

    def kept_between_steps(self, model: nn.Module, layout: Layout, placement: Placement) -> list[Any]:
        """The receive buffers of the rank's running schedules (activations from the previous stage, gradients from
        the next), allocated at their first step and kept for their life (Note [a pipeline rank's step])."""
        kept = []
        for _, stages in _SCHEDULES.get(model, {}).values():
            for infos in (*(i for stage in stages for i in stage.args_recv_info.values()),
                          *(i for stage in stages for i in stage.grad_recv_info.values())):
                kept += [buffer for info in infos if isinstance(buffer := getattr(info, "buffer", None), torch.Tensor)]
        return kept

    def runs(self, model: nn.Module, layout: Layout, placement: Placement) -> tuple[nn.Module, ...]:
        """The rank's stages, which torch's ``PipelineStage`` calls (FSDP2 shards each as a root)."""
        rank = getattr(model, "_autofit_stage", None)
        return () if rank is None else rank.modules

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
        kind = SCHEDULES[placement.option("schedule", "1f1b")]
        held = kind.stages_of(mesh.get_local_rank(), placement.degree)
        stages = placement.degree * kind.per_rank
        # the step's autocast (FSDP2's gather dtype is the autocast dtype, None without: ApplyInputs.param_dtype)
        autocast = (mesh.device_type, inputs.param_dtype, inputs.param_dtype is not None)
        tensor = layout.placement("tp")
        split = tensor.degree if tensor is not None and is_sequence_parallel(tensor.option("plan", ())) else 1
        modules = cut_to_stages(model, held, stages, autocast, placement.option("layers"), split)
        model._autofit_stage = _RankStages(tuple(held), stages, tuple(modules), mesh.get_group(), autocast, split)
        return model

    def schedule(self, layout: Layout, placement: Placement, micro_batches: int) -> PipelineSchedule | None:
        if placement.degree == 1:
            return None
        return PipelineSchedule(placement.option("schedule", "1f1b"), placement.degree, micro_batches)

    def words(self, layout: Layout, placement: Placement, *, ranks: bool = False, after_forward: str = "") -> str:
        if placement.degree == 1:
            return ""
        return f"pp {placement.degree} ({SCHEDULES[placement.option('schedule', '1f1b')].title})"

    def export(self, framework: str, layout: Layout, placement: Placement, inputs: ExportInputs) -> ExportFragment:
        """torchtitan's degree, schedule name and each stage's modules; the other frameworks' exports say they
        cannot express it."""
        pp = placement.degree
        if framework == "torchtitan":
            settings: dict[str, Any] = {"parallelism": {"pipeline_parallel_degree": pp}}
            if pp > 1:
                # torchtitan's schedule splits each rank's local batch into micro-batches of
                # pipeline_parallel_microbatch_size rows (torchtitan/distributed/pipeline_parallel.py,
                # build_pipeline_schedule): the plan's window is one local batch, its accumulation the schedule's
                settings["parallelism"].update(
                    pipeline_parallel_schedule=SCHEDULES[placement.option("schedule", "1f1b")].title,
                    pipeline_parallel_microbatch_size=inputs.micro_batch_size)
                layers = placement.option("layers")
                if layers is not None:  # the split planned, not torchtitan's own default (layer_split)
                    settings["parallelism"]["module_fqns_per_model_part"] = _torchtitan_stages(layers)
                settings["training"] = {"local_batch_size": inputs.micro_batch_size * inputs.accumulation_steps}
            return ExportFragment(settings)
        if pp == 1:
            return ExportFragment()
        return ExportFragment(unexpressed=(f"pipeline parallel {pp} ({framework} has no pipeline schedule in this "
                                           "export: run it with torchtitan or torch.distributed.pipelining)",))


def _torchtitan_stages(layers: tuple[int, ...]) -> list[list[str]]:
    """Each stage's modules in torchtitan's decoder names (its Llama, Qwen3 and DeepSeek models: ``tok_embeddings``,
    ``layers.i``, ``norm``, ``output``), as its ``parallelism.module_fqns_per_model_part`` takes them in place of its
    own default split (torchtitan/distributed/pipeline_parallel.py, ``pipeline_llm``)."""
    runs = layer_split(sum(layers), len(layers), layers)
    return [(["tok_embeddings"] if s == 0 else []) + [f"layers.{i}" for i in run]
            + (["norm", "output"] if s == len(runs) - 1 else []) for s, run in enumerate(runs)]


PIPELINE = _Pipeline(name="pp", mesh_rank=0, shares_rows=True, field="pipeline_parallel")
