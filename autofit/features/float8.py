"""The step feature "float8": the model's linear layers train in Float8 (torchao's ``convert_to_float8_training``),
converted before the parallel layout is applied, as torchtitan's model converters run before ``parallelize``. This
module is the whole feature: its value, the conversion, and what each stage does with it (Note [step features],
autofit/features/base.py).

Note [Float8 training]
    ``float8="tensorwise"`` (or "rowwise", "rowwise_with_gw_hp": the names torchao's
    ``Float8LinearConfig.from_recipe_name`` accepts, read from the installed torchao by :func:`recipe_names`) swaps
    each plain ``nn.Linear`` the filter keeps for torchao's ``Float8Linear``, whose matmuls cast their operands to
    float8 with dynamic scales (per tensor, or per row) and run ``torch._scaled_mm``. The filter is torchtitan's
    (``torchtitan/components/quantization/utils.py``, ``module_filter_fn``): both dimensions multiples of 16 (the
    float8 tensor cores' requirement), and the qualified name containing none of ``Float8.skip`` (torchtitan's
    ``filter_fqns``, matched as substrings); "auto_filter_small_kn" among them also skips the layers too small to
    gain (torchao's ``_auto_filter_for_recipe``, as torchtitan does). The model's output head is skipped by default
    (torchtitan's configs give ``filter_fqns=["output"]``; here the head is found by its place, not its name:
    ``output_head``, autofit/training/chunked_loss.py).

    Where it is applied: the feature's :meth:`Feature.convert` runs on the simulation's fake copy, on ``measure``'s
    real copy and on the model the trainer wraps, each time before the layout (``convert_model``,
    autofit/features/__init__.py): FSDP2 then shards and gathers the converted modules' parameters, as torchtitan's
    do. What is not assumed: what ``Float8Linear`` saves for backward changed between releases (torchao of late 2024
    saved the float8 input and weight; since July 2025, 0.18 included, ``matmul_with_hp_or_float8_args`` saves the
    high-precision ones and casts again in backward). The simulation runs the installed torchao's own module on fake
    tensors, so what it saves, casts and frees is the release's; the tracker sees inside ``Float8TrainingTensor``'s
    dispatch (Note [subclasses that compute in plain ops], autofit/simulate/tracker.py), so the ``_scaled_mm`` kernels
    and the transposed copies they take are recorded, probed and priced like any op.

    FSDP2's float8 all-gather (``Float8.all_gather``, tensorwise only: torchao's
    ``enable_fsdp_float8_all_gather``) wraps each converted weight in ``WeightWithDynamicFloat8CastTensor``, whose
    ``fsdp_pre_all_gather`` casts the shard to float8 and gathers 1 byte per element instead of the compute dtype's
    2 (torchao/float8/fsdp_utils.py). gloo cannot run it ("Invalid scalar type"), so ``measure`` refuses it on the
    CPU; its gathered bytes are :func:`gathered_bytes`, checked against a hand count in tests/test_float8.py.

    The time model prices each ``_scaled_mm`` at the card's dense FP8 rate (``GPUSpec.fp8_flops``) and the casts
    (absolute maximum, scale, clamp, conversion) as the memory-bound element-wise ops they are; a card without FP8
    tensor cores (A100, V100, T4, ...) refuses the feature (:func:`require_fp8`), and so does a CPU target whose
    oneDNN has no float8 matmul (Note [CPU kernels], core/cpu.py). Eager torchao runs each cast as several kernels
    over the activations, which the roofline prices as it runs them: on an H100 an eager float8 step is often
    predicted slower than bf16 (Llama-3.1-8B, 8 H100, FSDP2: 2.96 s against 2.09 s), as torchao and torchtitan say
    it is without ``torch.compile``, which fuses the casts. Float8 changes numerics, so the planner takes it only
    where ``plan(allow=...)`` names "float8" (a speed rung: Note [speed rungs], planner.py) or the user gave
    ``float8=``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from torch import nn

from autofit.core.errors import InvalidInputError, UnsupportedFeatureError
from autofit.features.base import OptInFeature
from autofit.parallel.step_rules import require_fully_sharded
from autofit.training.chunked_loss import output_head

if TYPE_CHECKING:
    from autofit.training.batch import Batch
    from autofit.training.config import StepConfig
    from autofit.training.optim import OptimizerSpec

__all__ = ["FLOAT8", "Float8", "Float8Training", "as_float8", "recipe_names", "gathered_bytes", "require_fp8",
           "converted_linears", "convert", "torchtitan_float8"]

AUTO_FILTER = "auto_filter_small_kn"  # torchtitan's filter_fqns entry that turns on torchao's size filter
_MULTIPLE = 16  # both dimensions of a converted linear: the float8 tensor cores' requirement (torchtitan, torchao)
ALL_GATHER_RECIPE = "tensorwise"  # the only recipe whose weights FSDP2 gathers in float8 (torchao/float8/fsdp_utils.py)


def _torchao_float8() -> Any:
    """torchao's float8 package, or a typed error saying what to install."""
    try:
        import torchao.float8 as float8  # noqa: PLC0415 - optional dependency, imported where Float8 is asked for
    except ImportError as e:
        raise UnsupportedFeatureError(
            "float8 training needs torchao (pip install torchao): its convert_to_float8_training swaps the linear "
            "layers; leave float8 out, or install it") from e
    config = getattr(float8, "Float8LinearConfig", None)
    if config is None or not hasattr(config, "from_recipe_name") or \
            not hasattr(float8, "convert_to_float8_training"):
        raise UnsupportedFeatureError(
            "float8 training needs torchao 0.9 or later (Float8LinearConfig.from_recipe_name, "
            "convert_to_float8_training): upgrade torchao (pip install -U torchao)")
    return float8


def recipe_names() -> tuple[str, ...]:
    """The recipes the installed torchao's ``Float8LinearConfig.from_recipe_name`` accepts."""
    _torchao_float8()
    from torchao.float8.config import Float8LinearRecipeName  # noqa: PLC0415 - after _torchao_float8's check

    return tuple(r.value for r in Float8LinearRecipeName)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Float8:
    """Float8 training of the linear layers (Note [Float8 training]). ``recipe``: torchao's recipe name;
    ``skip``: qualified-name substrings of linears left in high precision (torchtitan's ``filter_fqns``; the
    output head is always left); ``all_gather``: FSDP2 gathers the converted weights in float8 (tensorwise only)."""

    recipe: str = "tensorwise"
    skip: tuple[str, ...] = ()
    all_gather: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.recipe, str):
            raise InvalidInputError(f"Float8.recipe must be a recipe name such as 'tensorwise', got {self.recipe!r}")
        if isinstance(self.skip, str) or not all(isinstance(s, str) and s for s in self.skip):
            raise InvalidInputError(f"Float8.skip must be a tuple of module-name substrings, got {self.skip!r}")
        object.__setattr__(self, "skip", tuple(self.skip))
        if not isinstance(self.all_gather, bool):
            raise InvalidInputError(f"Float8.all_gather must be True or False, got {self.all_gather!r}")
        if self.all_gather and self.recipe != ALL_GATHER_RECIPE:
            raise InvalidInputError(
                f"Float8.all_gather with recipe {self.recipe!r}: only 'tensorwise' weights can be gathered in "
                "float8 (torchao's enable_fsdp_float8_all_gather); use recipe='tensorwise' or all_gather=False")

    def check_step(self, config: StepConfig) -> None:
        """The rules on the step that carries it (Note [carried features]): the float8 all-gather is FSDP2's."""
        if self.all_gather:
            require_fully_sharded(config.layout, "Float8(all_gather=True) is FSDP2's float8 all-gather of the "
                                  "weights: it needs strategy='fsdp2' over several ranks; leave all_gather out "
                                  "otherwise")

    def torchao_config(self) -> Any:
        """torchao's ``Float8LinearConfig`` for this recipe."""
        config = _torchao_float8().Float8LinearConfig.from_recipe_name(self.recipe)
        if self.all_gather:
            config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
        return config

    def label(self) -> str:
        """How the plan and the notes name it: "tensorwise with float8 all-gather, skipping 'attention.wk'"."""
        parts = [self.recipe + (" with float8 all-gather" if self.all_gather else "")]
        if self.skip:
            parts.append("skipping " + ", ".join(map(repr, self.skip)))
        return ", ".join(parts)


def as_float8(value: Any) -> Float8 | None:
    """``float8=`` as the user gives it (None, a recipe name, or a :class:`Float8`) checked against the installed
    torchao: the value a step carries, or None."""
    if value is None or value is False:
        return None
    if isinstance(value, str):
        value = Float8(recipe=value)
    if not isinstance(value, Float8):
        raise InvalidInputError(f"float8 must be a recipe name ('tensorwise', 'rowwise', 'rowwise_with_gw_hp') or an "
                                f"autofit.features.float8.Float8, got {value!r}")
    names = recipe_names()
    if value.recipe not in names:
        mx = (" (MX formats are torchao's prototype MXFP8TrainingOpConfig, in torchao.prototype.moe_training, which "
              "autofit does not plan: docs/float8.md, 'Not covered')" if value.recipe.lower().startswith(("mx", "nvfp"))
              else "")
        raise InvalidInputError(f"float8 recipe {value.recipe!r} is not one of the installed torchao's Float8 recipes: "
                                f"give one of {', '.join(map(repr, names))}{mx}")
    if AUTO_FILTER in value.skip and value.recipe not in ("tensorwise", "rowwise"):
        raise InvalidInputError(f"Float8.skip {AUTO_FILTER!r} has no size thresholds for recipe {value.recipe!r} in "
                                "torchao (_auto_filter_for_recipe): leave it out, or name the layers to skip")
    return value


def converted_linears(model: nn.Module, value: Float8) -> tuple[str, ...]:
    """The qualified names of the linears :func:`convert` swaps in ``model``: plain ``nn.Linear`` modules (not
    torchao's already converted ones, nor other libraries' subclasses) whose dimensions are multiples of 16, whose
    name contains none of ``value.skip``, that are not the output head, and where ``value.skip`` asks for it, that
    torchao's size filter keeps (Note [Float8 training])."""
    head = output_head(model)
    substrings = tuple(s for s in value.skip if s != AUTO_FILTER)
    small = None
    if AUTO_FILTER in value.skip:
        from torchao.float8 import _auto_filter_for_recipe  # noqa: PLC0415 - torchtitan's own lookup

        small = _auto_filter_for_recipe(value.recipe, filter_fqns=list(substrings))
    names = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or not name or name == head:
            continue
        if module.in_features % _MULTIPLE or module.out_features % _MULTIPLE:
            continue
        if any(s in name for s in substrings) or (small is not None and not small(module, name)):
            continue
        names.append(name)
    return tuple(names)


def convert(model: nn.Module, value: Float8) -> tuple[str, ...]:
    """Swap ``model``'s linears for torchao's ``Float8Linear`` in place (the same parameters); returns their names."""
    names = converted_linears(model, value)
    if names:
        chosen = set(names)
        _torchao_float8().convert_to_float8_training(model, config=value.torchao_config(),
                                                     module_filter_fn=lambda module, fqn: fqn in chosen)
    return names


def gathered_bytes(numel: int, converted: bool, value: Float8 | None, compute_bytes: int) -> int:
    """Bytes FSDP2's all-gather moves into each rank for a parameter of ``numel`` elements whose compute dtype has
    ``compute_bytes`` bytes per element: 1 per element for a converted weight under float8 all-gather
    (``WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`` gathers the float8 data, and its scale is computed
    from an all-reduced absolute maximum, not gathered), the compute dtype's otherwise."""
    if converted and value is not None and value.all_gather:
        return numel
    return numel * compute_bytes


# torchtitan's float8 converter in the TOML of its job config (torchtitan/config/job_config.py of 2025:
# [model] converters and the [quantize.linear.float8] section), the spelling autofit's torchtitan export writes; its
# current config (torchtitan/components/quantization/float8.py, a Python config registry) takes the same fields as
# Float8LinearConverter.Config(recipe_name=..., filter_fqns=[...]), and recipes "rowwise" and "rowwise_with_gw_hp"
# only: tensorwise and the float8 all-gather left it in 2026
TITAN_CONVERTER = "quantize.linear.float8"
TITAN_RECIPES = ("rowwise", "rowwise_with_gw_hp")


def torchtitan_float8(value: Float8) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """torchtitan's sections for ``value`` (its converter and recipe; the output head by torchtitan's own name,
    "output") and the export's notes on what torchtitan cannot take."""
    section: dict[str, Any] = {"recipe_name": value.recipe, "filter_fqns": ["output", *value.skip]}
    if value.all_gather:
        section["enable_fsdp_float8_all_gather"] = True
    notes = [f"float8 as torchtitan's TOML config spelled it ([model] converters, [{TITAN_CONVERTER}]); its current "
             "config registry takes the same fields as Float8LinearConverter.Config(recipe_name=..., filter_fqns="
             "[...]) and needs model_compile_enabled=True for speed"]
    if value.recipe not in TITAN_RECIPES:
        notes.append(f"torchtitan's current Float8LinearConverter accepts recipe_name {' or '.join(TITAN_RECIPES)}; "
                     f"{value.recipe!r} (and the float8 all-gather) needs a torchtitan of 2025")
    return {"model": {"converters": [TITAN_CONVERTER]}, TITAN_CONVERTER: section}, notes


def require_fp8(gpu: Any) -> None:
    """A typed error where ``gpu`` (a catalog GPUSpec) has no FP8 tensor cores: float8 training cannot run there."""
    if gpu is not None and not getattr(gpu, "fp8_flops", 0):
        raise UnsupportedFeatureError(
            f"{gpu.name} has no FP8 tensor cores (float8 matmuls need NVIDIA Ada or Hopper or later, or AMD "
            "MI300 or later): leave float8 out, or plan for a card that has them (H100, H200, B200, L40S, RTX 4090, "
            "MI300X)")


RUNG_RECIPE = "tensorwise"  # the recipe of the rung plan(allow="float8") opens: torchao's default, its fastest


@dataclasses.dataclass(frozen=True, kw_only=True)
class Float8Training(OptInFeature):
    """Float8 training; its value is a :class:`Float8` (None: the linears train in their own precision). The user
    fixes it (``float8=``, every candidate converted) or opens its rung (``plan(allow="float8")``), a speed rung:
    the planner plans with it beside the plan without it and takes the faster (Note [speed rungs], planner.py)."""

    # ---- the rung -------------------------------------------------------------------------------------------------
    def resolve(self, model: nn.Module, batch: Batch, target: Batch | None, loss_fn: Any, optimizer: OptimizerSpec,
                allowed: bool) -> Float8 | None:
        if not allowed or not any(type(m) is nn.Linear for m in model.modules()):
            return None  # a speed rung: an infeasible budget does not name it as one that might fit
        try:
            value = as_float8(RUNG_RECIPE)
        except UnsupportedFeatureError:
            return None
        return value if converted_linears(model, value) else None

    def not_applicable(self, optimizer: OptimizerSpec) -> str:
        return ("allow 'float8' does not apply: it needs torchao 0.9 or later installed and linear layers whose "
                "dimensions are multiples of 16 besides the output head (Note [Float8 training], "
                "autofit/features/float8.py)")

    def rung_what(self, value: Float8) -> str:
        return f"float8 linears ({value.label()})"

    def request_for(self, request: Any, value: Float8) -> Any:
        require_fp8(getattr(request.device, "gpu", None))
        return self.carry(request, value)

    def climbed(self, value: Float8, user: Any) -> str:
        return (f"rung 'float8' taken: the linears train in float8 ({value.label()}; torchao's Float8Linear, "
                "converted by the trainer before the layout), their matmuls at the card's FP8 rate (Note [Float8 "
                "training]); it changes numerics")

    # ---- the stages -----------------------------------------------------------------------------------------------
    def from_user(self, value: Any, gpu: Any) -> Float8 | None:
        value = as_float8(value)
        require_fp8(gpu if value is not None else None)
        return value

    def gloo_refusal(self, config: StepConfig) -> str | None:
        value = self.in_force(config)
        if value is None or not value.all_gather:
            return None
        return ("FSDP2's float8 all-gather does not run on gloo ('Invalid scalar type'); estimate it, or measure on "
                "GPUs (Note [Float8 training])")

    def convert(self, config: StepConfig, model: nn.Module) -> None:
        value = self.in_force(config)
        if value is not None:
            convert(model, value)

    def estimate_notes(self, config: StepConfig) -> tuple[str, ...]:
        value = self.in_force(config)
        if value is None:
            return ()
        import torchao  # noqa: PLC0415 - converted already, so installed

        return (f"float8 training ({value.label()}): the linears run torchao {torchao.__version__}'s Float8Linear, "
                "simulated as that release runs it, what it saves for backward included (Note [Float8 training])",)

    def plan_rows(self, plan: Any) -> tuple[tuple[str, str], ...]:
        value = self.in_force(plan)
        if value is None:
            return ()
        return (("float8", f"{value.label()} (torchao Float8Linear, applied by the trainer before the layout)"),)

    def export_notes(self, plan: Any, framework: str) -> tuple[str, ...]:
        value = self.in_force(plan)
        if value is None or framework == "torchtitan":
            return ()
        return (f"the plan trains the linear layers in float8 ({value.label()}); {framework} has no setting for it: "
                "convert the model with torchao.float8.convert_to_float8_training(model, config=Float8LinearConfig."
                f"from_recipe_name({value.recipe!r})) before the framework wraps it, skipping the output head",)

    def export_sections(self, plan: Any, framework: str) -> tuple[dict[str, dict[str, Any]], tuple[str, ...]]:
        value = self.in_force(plan)
        if value is None or framework != "torchtitan":
            return {}, ()
        sections, notes = torchtitan_float8(value)
        return sections, tuple(notes)

    def outside_wrap(self, plan: Any, callback: str) -> str | None:
        value = self.in_force(plan)
        if value is None:
            return None
        return (f"the plan trains the linear layers in float8 ({value.label()}): convert the model with "
                "torchao.float8.convert_to_float8_training before training (the callback does not swap modules)")

    def to_json(self, value: Float8 | None) -> dict[str, Any] | None:
        return None if value is None else {"recipe": value.recipe, "skip": list(value.skip),
                                           "all_gather": value.all_gather}

    def from_json(self, data: Any) -> Float8 | None:
        return None if data is None else Float8(recipe=data["recipe"], skip=tuple(data["skip"]),
                                                all_gather=bool(data["all_gather"]))


FLOAT8 = Float8Training(
    name="float8", field="float8", allow_field="allow_float8", row_after="optimizer", user_setting=True,
    replaces="the model's linear layers", for_speed=True, own_field=False,
    # Float8Linear's weights and inputs: mm becomes _scaled_mm on the float8 data and scales
    seen_through=(("torchao.float8.float8_training_tensor", "Float8TrainingTensor"),))
