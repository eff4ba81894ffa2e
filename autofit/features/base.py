"""What a step feature declares to the stages. See Note [step features].

Note [step features]
    A step feature changes what one training step runs: its loss, its optimizer, when the optimizer steps, how the
    model runs, where gradients and saved activations live, the allocator's setting. Each is
    one module of ``autofit/features/`` holding one frozen :class:`Feature` instance, and
    ``autofit.features.FEATURES`` lists them (torchtitan's registry of model converters, where float8 is one file
    switched on by name, and ``torch.utils.flop_counter``'s registry of one function per op are the models). The
    stages never name a feature; each asks every registered one what it needs. Of every feature:
      - the model before its layout: :meth:`Feature.convert`, what the feature does to the model's modules before
        the parallel layout is applied (torchtitan's model converters, which run before ``parallelize``: Float8's
        linears are converted first, so FSDP2 shards and gathers what torchao made). Every path calls it once, through
        ``convert_model`` (autofit/features/__init__.py), at the place it prepares its model: the simulation's fake
        copy (``simulate/run.py``), ``measure``'s real copy (``measure/allocator.py``) and the model the trainer
        wraps (``emit/trainer.py``; ``emit/distributed.py`` before it lays the model out);
      - the step (``training/step.py``, which the simulation, ``measure`` and the trainer all run):
        :meth:`Feature.step_loss`, the loss the feature computes in place of the model's output and the loss
        function; and :meth:`Feature.step_context`, what it holds around the step's forward and backward
        (``simulate/run.py``, ``measure/allocator.py``, ``emit/trainer.py``); both read from the
        :class:`~autofit.training.config.StepConfig`;
      - the real runs, ``measure``'s copy (``measure/allocator.py``) and the model the trainer wraps
        (``emit/trainer.py``): :meth:`Feature.real_context`, what the feature does to a real model from before its
        first forward (undone on exit) where the simulation runs the feature its own way (the feature's module says
        how: a fake copy cannot run what the real one does, compiled kernels for one);
      - the trainer (``emit/trainer.py``, ``emit/distributed.py``, and the callbacks in ``integrations/``):
        :meth:`Feature.before_wrap`, what it puts in place before the model is touched (the allocator's setting),
        :attr:`Feature.one_process`, why it refuses a plan laid out over processes (the layout raises it), and
        :meth:`Feature.trainer_optimizer`, the optimizer the trainer steps;
      - the simulation's notes (``simulate/run.py``): :meth:`Feature.estimate_notes`;
      - the plan (``emit/plan_text.py``, ``emit/plan_json.py``): :meth:`Feature.plan_rows`, its rows in ``str(plan)``
        and the CLI's table, and :meth:`Feature.to_json` / :meth:`Feature.from_json`, its value in the plan's JSON;
        a value the search decides in the estimate (the allocator's setting, gradients allocated before forward) is
        a field the plan derives from its estimate (``init=False``), written to the JSON for readers;
      - the exports (``emit/export.py``): :meth:`Feature.export_notes`, what another framework must do to run it;
        and the callbacks of other training loops (``integrations/``): :meth:`Feature.outside_wrap`, why they cannot;
    An :class:`OptInFeature` also has a rung the user opens with ``plan(allow=...)``, and says:
      - to the request (``request.py``): :meth:`OptInFeature.resolve`, its value for this model and optimizer, and
        :meth:`OptInFeature.not_applicable`, the note when it was allowed but does not apply;
      - to the ladder (``solve/ladder.py``): one rung per feature allowed, cumulative in registry order, named by
        :meth:`OptInFeature.rung_what`, its floor from :attr:`OptInFeature.state_bytes`; or, for a feature that buys
        speed (:attr:`OptInFeature.for_speed`), to the planner (``planner.py``, Note [speed rungs]): the request
        planned again with it, the faster plan taken;
        :meth:`OptInFeature.request_for` is the request as the rung runs it;
      - to the plan's notes (``solve/finish.py``): :meth:`OptInFeature.request_without` and
        :meth:`OptInFeature.climbed`, what the rung saved against the same configuration without it;
      - to other trainers (``integrations/``): :attr:`OptInFeature.replaces`, what of the step a plan applied
        outside ``wrap`` would lose.
    A feature's value travels in the step, the plan (and for an opt-in one the request) under one name
    (:attr:`Feature.field`); ``None`` (False for a flag, empty for a tuple or a string) there means "not in
    force". A feature the user sets
    (:attr:`Feature.user_setting`: ``plan(compile=True)``) travels in the request too, and the plan takes it from
    there as it is (``feature_fields``, autofit/features/__init__.py). Only what the registered
    features use is declared: a new feature that needs another hook adds it here, with a default that changes
    nothing, and the stage that calls it.

Note [carried features]
    The first features have a field of their own on each value that carries them (``StepConfig``, ``PlanRequest``,
    ``Plan``: ``compile``, ``chunked_loss``, ...), read there by the stages that predate the registry. A feature
    registered after them (:attr:`Feature.own_field` False: Float8) needs none: its value travels in the carriers'
    ``more_features``, ``(name, value)`` pairs sorted by name, under :attr:`Feature.field` (and, for an opt-in one,
    the value ``allow=`` opened under :attr:`OptInFeature.allow_field`), as a layout dimension registered after the
    first ones travels in ``Parallel.more_dimensions``. What such a feature needs of the stages it says through its
    hooks: the user's value read (:meth:`Feature.from_user`, from the option of ``autofit.Step`` / ``Savers`` named
    as its field), its rules on the step (the value's own ``check_step``, which ``StepConfig`` runs), what
    ``measure`` cannot run over gloo (:meth:`Feature.gloo_refusal`), its sections of an export
    (:meth:`Feature.export_sections`) and the tensor subclasses the tracker looks through
    (:attr:`Feature.seen_through`). So adding one touches its module, the registry, its option (autofit/options.py)
    and its flag (``FEATURE_FLAGS``, autofit/cli/flags.py, which the CLI reads without importing torch); and
    ``plan.<field>`` reads it as a field would.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any

from autofit.training.loss import StepLoss  # re-exported: the features' hook returns one

if TYPE_CHECKING:  # annotations only: these are values the stages hand in
    import torch
    from torch import nn

    from autofit.training.activation_offload import HostContext
    from autofit.training.batch import Batch
    from autofit.training.config import StepConfig
    from autofit.training.optim import OptimizerSpec

__all__ = ["Feature", "OptInFeature", "StepLoss", "carried", "with_carried"]


def carried(carrier: Any, key: str) -> Any:
    """The value under ``key`` in ``carrier``'s ``more_features`` (Note [carried features]), or None."""
    return dict(getattr(carrier, "more_features", ())).get(key)


def with_carried(pairs: tuple[tuple[str, Any], ...], key: str, value: Any) -> tuple[tuple[str, Any], ...]:
    """``pairs`` (a carrier's ``more_features``) with ``key`` set to ``value``, or dropped where it is None; sorted
    by name, so two carriers of the same values compare equal."""
    values = dict(pairs)
    values.pop(key, None)
    if value is not None:
        values[key] = value
    return tuple(sorted(values.items()))



@dataclasses.dataclass(frozen=True, kw_only=True)
class Feature:
    """A step feature (Note [step features]): one frozen instance per module of ``autofit/features/``. The defaults
    change nothing; a feature overrides what it changes."""

    name: str  # how notes and errors name it: "chunked-loss", "optimizer-in-backward"
    field: str  # the field of StepConfig and Plan (and of PlanRequest, for an opt-in one) carrying its value
    # the plan row its new rows follow (Feature.plan_rows), or several: the first of them the plan's table has; None:
    # after the step's knobs, before the device
    row_after: str | tuple[str, ...] | None = None
    # the user sets its value (plan(compile=True)), not the search: the request carries it under ``field`` and the
    # plan takes it from there (feature_fields)
    user_setting: bool = False
    # why the feature runs in one process only: the message a plan laid out over processes (DDP, FSDP2) is refused
    # with when it is wrapped (features.before_wrap asks the layout, Parallel.refuse_laid_out); None: any layout
    one_process: str | None = None
    # the carriers (StepConfig, PlanRequest, Plan) have a field named ``field``; False: the value travels in their
    # ``more_features`` (Note [carried features]), as every feature registered after the first ones does
    own_field: bool = True
    # tensor subclasses the feature's modules make whose ops compute in plain aten ops on inner tensors, by
    # (module, class name): the tracker looks through them (Note [subclasses that compute in plain ops],
    # simulate/tracker.py)
    seen_through: tuple[tuple[str, str], ...] = ()

    def in_force(self, carrier: Any) -> Any:
        """The value in force on ``carrier`` (a PlanRequest, a StepConfig or a Plan), or None."""
        return getattr(carrier, self.field, None) if self.own_field else carried(carrier, self.field)

    def carry(self, carrier: Any, value: Any) -> Any:
        """``carrier`` (a frozen dataclass: PlanRequest, StepConfig, Plan) with ``value`` in force."""
        if self.own_field:
            return dataclasses.replace(carrier, **{self.field: value})
        return dataclasses.replace(carrier, more_features=with_carried(carrier.more_features, self.field, value))

    # ---- the user's value (Note [carried features]) ---------------------------------------------------------------
    def from_user(self, value: Any, gpu: Any) -> Any:
        """The value the user gave (the option of ``autofit.Step`` / ``Savers`` named as :attr:`field`, or the CLI's
        flag) as the step carries it, checked for the target: ``gpu`` is its catalog GPUSpec (None: a CPU, or a GPU
        not named). Raises a typed error naming what to change."""
        return value

    def gloo_refusal(self, config: StepConfig) -> str | None:
        """Why ``measure`` cannot run ``config``'s step as processes on this CPU joined by gloo, or None."""
        return None

    # ---- the model before its layout: simulated, measured and trained alike ----------------------------------------
    def convert(self, config: StepConfig, model: nn.Module) -> None:
        """What the feature does to ``model``'s modules for ``config``'s step, in place, before the parallel layout
        is applied (the simulation's fake copy, ``measure``'s copy, the model the trainer wraps); must leave a model
        it converted already as it is (the distributed trainer's model passes twice)."""

    # ---- the step: simulated, measured and trained alike ----------------------------------------------------------
    def step_loss(self, config: StepConfig) -> StepLoss | None:
        """The loss this feature computes in ``config``'s step in place of the model's output and the loss function,
        or None: the step's own."""
        return None

    def step_context(self, config: StepConfig, model: nn.Module, optimizer: torch.optim.Optimizer,
                     stepped: set[int] | None = None, *,
                     to_host: HostContext | None = None) -> contextlib.AbstractContextManager[Any]:
        """What the feature holds around ``config``'s forwards and backwards on ``model`` (undone on exit), entered
        after the step's module-level knobs (``patched_model``, training/step.py); ``stepped`` collects the ids of
        parameters the optimizer stepped during backward, where that is asked; ``to_host`` makes the context that
        holds saved tensors in host memory (the simulation's tracked twin of ``save_on_cpu``; None: torch's)."""
        return contextlib.nullcontext()

    def real_context(self, config: StepConfig, model: nn.Module) -> contextlib.AbstractContextManager[Any]:
        """What the feature does to a real ``model`` (``measure``'s copy, the model the trainer wraps, after its
        optimizer is built) before its first forward, undone on exit; the simulation runs the feature its own way.
        Entered before :meth:`step_context`."""
        return contextlib.nullcontext()

    # ---- the trainer and the plan ---------------------------------------------------------------------------------
    def before_wrap(self, plan: Any) -> None:
        """What the feature puts in place before a trainer (or a callback of another training loop) touches the
        model for ``plan``; raises where it cannot. (A feature planned for one process refuses a plan with a
        layout through :attr:`one_process`, not here.)"""

    def trainer_optimizer(self, plan: Any, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer the trainer of ``plan`` steps, given the one passed to wrap()."""
        return optimizer

    def plan_rows(self, plan: Any) -> tuple[tuple[str, str], ...]:
        """The feature's rows in the plan's table: a row named as one of the plan's own replaces it, another goes
        after :attr:`row_after`. None where the feature is not in force."""
        return ()

    def estimate_notes(self, config: StepConfig) -> tuple[str, ...]:
        """What an estimate of ``config``'s step says of the feature (the simulation adds it to its notes)."""
        return ()

    def export_notes(self, plan: Any, framework: str) -> tuple[str, ...]:
        """What an export of ``plan`` to ``framework`` ("hf", "deepspeed", "lightning", "accelerate",
        "torchtitan"; emit/export.py) says of the feature: what that framework can do to run it."""
        return ()

    def export_sections(self, plan: Any, framework: str) -> tuple[dict[str, dict[str, Any]], tuple[str, ...]]:
        """The sections of ``framework``'s config that run the feature for ``plan`` (torchtitan's converter and
        its section), merged into the export, and their notes; ``({}, ())`` where it has none (its
        :meth:`export_notes` say what to do instead)."""
        return {}, ()

    def outside_wrap(self, plan: Any, callback: str) -> str | None:
        """Why ``callback``, applying ``plan`` inside another training loop (``integrations/``), cannot run the
        feature, or None: it can, or the feature is not in force."""
        return None

    def to_json(self, value: Any) -> Any:
        """``value`` as the plan's JSON writes it."""
        return value

    def from_json(self, data: Any) -> Any:
        """The value :meth:`to_json` wrote."""
        return data


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptInFeature(Feature, abc.ABC):
    """A step feature with a rung of the ladder that ``plan(allow=...)`` opens (Note [step features], Note [the
    ladder]); ``name`` is what ``allow=`` takes."""

    allow_field: str  # the field of PlanRequest: the value plan(allow=...) resolved for this model (None: closed)
    replaces: str  # what of the step it replaces, for a trainer other than wrap()'s: "the loss", "the optimizer"
    # the optimizer state's bytes per value on its rung and those after it (the ladder's floor); None: the stored
    # precision's
    state_bytes: int | None = None
    # a rung taken for speed, not memory (float8's faster matmuls): not one of the ladder's memory rungs; the planner
    # plans the request with it beside the plan without it and takes the faster, or the one that fits (planner.py,
    # Note [speed rungs])
    for_speed: bool = False

    # ---- the request: resolved once per plan() --------------------------------------------------------------------
    @abc.abstractmethod
    def resolve(self, model: nn.Module, batch: Batch, target: Batch | None, loss_fn: Any, optimizer: OptimizerSpec,
                allowed: bool) -> Any:
        """The feature's value for this model and optimizer, or None where it does not apply. Not ``allowed``: any
        value but None says only that it would apply (the infeasibility error names the closed rung), and may be
        cheaper to find."""

    @abc.abstractmethod
    def not_applicable(self, optimizer: OptimizerSpec) -> str:
        """The plan's note when ``plan(allow=...)`` named the feature but :meth:`resolve` found nothing."""

    def allowed(self, request: Any) -> Any:
        """The value plan(allow=...) opened on ``request`` (a PlanRequest), or None."""
        return getattr(request, self.allow_field) if self.own_field else carried(request, self.allow_field)

    # ---- the ladder -----------------------------------------------------------------------------------------------
    @abc.abstractmethod
    def rung_what(self, value: Any) -> str:
        """How the plan's notes name the rung that opens the feature with ``value``."""

    def request_for(self, request: Any, value: Any) -> Any:
        """``request`` (a PlanRequest) as a rung with the feature in force runs it."""
        return self.carry(request, value)

    def request_without(self, request: Any, user: Any) -> Any:
        """``request`` (a rung's) without the feature, the rest as the rung runs it; ``user`` is the request as
        the user gave it."""
        return self.carry(request, None)

    @abc.abstractmethod
    def climbed(self, value: Any, user: Any) -> str:
        """The plan's note on what the rung did (``user``: the request as the user gave it)."""
