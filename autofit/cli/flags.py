"""The flags the commands share and how their text is read: the options and arguments (typer's ``Annotated``
types, each with its help text), the names the help lists without importing torch (``TASK_NAMES``,
``EXPORT_NAMES``), and the helpers that turn a flag's text into what the planner takes (``--gpu`` with
``--gpu-memory``, ``--nodes``, the layout flags, ``--batch-dim``, ``--zero-grad``'s default, MODEL and the flags
that build it). Used by autofit/cli/app.py's commands."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional, get_args

import typer

from autofit.core.errors import AutofitError, InvalidInputError

__all__ = [
    "AllowOpt", "BatchDimOpt", "BatchOpt", "BudgetOpt", "CompileOpt", "ConfigOpt", "DeviceOpt", "DtypeOpt",
    "EXPORT_NAMES", "FEATURE_FLAGS", "FromOpt", "GpuMemoryOpt", "GpuOpt", "HostBudgetOpt", "JsonOpt", "LoraOpt",
    "LoraTargetsOpt", "MarginOpt", "ModelArg", "ModelDtypeOpt", "NodesOpt", "OffloadOpt", "OptimizerOpt",
    "OptionalBatchOpt", "OptionalModelArg", "OverCapacityOpt", "PerNodeOpt", "PipelineLayersOpt", "PipelineOpt",
    "PlanGpuOpt", "PlanPipelineOpt", "PrecisionOpt", "PriceOpt", "QloraOpt", "QuietOpt", "ReplicateOpt", "ReshardOpt",
    "ScheduleOpt", "SequenceOpt", "ShapeOpt", "StoredOpt", "StrategyOpt", "TASK_NAMES", "TaskOpt", "TensorOpt",
    "VariableLengthOpt", "WorldOpt", "WriteOpt", "ZeroGradOpt", "batch_dims_option", "default_zero_grad",
    "feature_flag_names", "feature_flags", "gpu_option", "layout_option", "nodes_layout", "pipeline_layers",
    "spec_option",
]

TASK_NAMES = ("classification", "regression", "causal-lm", "masked-lm")  # autofit.cli.tasks.TASKS, without torch
EXPORT_NAMES = ("hf", "deepspeed", "lightning", "accelerate", "torchtitan")  # autofit.emit.export.EXPORTERS

ModelArg = Annotated[str, typer.Argument(metavar="MODEL", show_default=False,
                                         help="pkg.module:factory, file.py:factory, torchvision:NAME, hf:NAME (a "
                                              "checkpoint such as hf:Qwen/Qwen2.5-0.5B; 'autofit models' lists "
                                              "those known offline) or hf:TYPE --config k=v")]
BudgetOpt = Annotated[str, typer.Option("--budget", "-b", help="per device: '8GB' (8x10^9 bytes), '8GiB' (8x2^30), "
                                        "'565000000B', or '90%' of the GPU (of host memory with --device cpu); a "
                                        "number without a unit is refused")]
BatchOpt = Annotated[int, typer.Option("--batch-size", "-n", help="effective batch: samples per optimizer step")]
ShapeOpt = Annotated[Optional[list[str]], typer.Option("--input-shape", help="one sample's shape without the batch "
                                                       "dimension, e.g. 3,224,224 (repeat for several inputs)")]
DtypeOpt = Annotated[Optional[str], typer.Option("--input-dtype",
                                                  help="dtype of generated inputs: float32, int64, ...")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu or cuda")]
ModelDtypeOpt = Annotated[str, typer.Option("--dtype", help="hf: weights' dtype: auto (as the installed transformers "
                                            "loads the checkpoint: its config's dtype from transformers 5), fp32, "
                                            "bf16 or fp16")]
LoraOpt = Annotated[Optional[int], typer.Option("--lora", metavar="RANK", help="hf: add peft LoRA adapters of this "
                                                "rank and train only them")]
LoraTargetsOpt = Annotated[Optional[str], typer.Option(
    "--lora-targets", metavar="NAMES", help="with --lora: modules to adapt, comma-separated, or all-linear "
    "(default: peft's for the architecture, e.g. q_proj,v_proj for Llama and Qwen; all-linear where peft has none)")]
QloraOpt = Annotated[bool, typer.Option("--qlora", help="with --lora: the base's linear layers in 4-bit NF4 "
                                        "(bitsandbytes, double-quantized), as QLoRA loads them")]
GpuOpt = Annotated[Optional[str], typer.Option("--gpu", help="GPU model for device cuda, e.g. A100-80GB, RTX-3060, "
                                                "MI300X (default: this machine's GPU, else A100-80GB)")]
PlanGpuOpt = Annotated[Optional[str], typer.Option(
    "--gpu", help="GPU model for device cuda, e.g. A100-80GB, RTX-3060, MI300X (default: this machine's GPU, else "
    "A100-80GB); several, comma separated (RTX-4090,L40S,A100-80GB,H100), or all (the catalog): one plan per card "
    "in one table, sorted by throughput or, with --price, by cost (a % budget is a share of each card, a size "
    "applies to every card)")]
PriceOpt = Annotated[Optional[list[str]], typer.Option(
    "--price", metavar="CARD=USD_PER_HOUR", help="with --gpu: what one card costs per hour, e.g. RTX-4090=0.69 "
    "(repeatable, or comma separated): the table adds the cost per million tokens (or samples) and sorts by it. "
    "No prices are built in: they change")]
GpuMemoryOpt = Annotated[Optional[str], typer.Option(
    "--gpu-memory", help="a card not in the catalog: its memory, e.g. 12GiB (a vendor's '12 GB' card has 12GiB; "
    "12GB is 12x10^9 bytes); with --gpu, that card's other figures, else the A100-80GB's")]
PrecisionOpt = Annotated[str, typer.Option("--precision", help="auto, fp32, bf16 or fp16")]
OptimizerOpt = Annotated[str, typer.Option("--optimizer", help="adamw, adam or sgd")]
ConfigOpt = Annotated[Optional[list[str]], typer.Option("--config", metavar="KEY=VALUE",
                                                       help="hf:/torchvision: config override (repeatable)")]
TaskOpt = Annotated[Optional[str], typer.Option("--task", metavar="TASK", help=f"target and loss for a MODEL that "
                                                f"has none: {', '.join(TASK_NAMES)} (hf: picks the head)")]
WorldOpt = Annotated[int, typer.Option("--world-size", help="processes (GPUs) training together; --batch-size is "
                                                             "global")]
StoredOpt = Annotated[Optional[str], typer.Option(
    "--min-stored-precision", help="lowest stored precision of parameters/gradients/optimizer state the planner may "
    "choose when fp32 does not fit: fp32, fp32-master or bf16 (default: any)")]
OffloadOpt = Annotated[bool, typer.Option(
    "--offload/--no-offload", help="let the planner keep activations, or parameters, gradients and optimizer state, "
    "in host memory when that fits or is faster (GPU targets; docs/offload.md)")]
HostBudgetOpt = Annotated[Optional[str], typer.Option(
    "--host-budget", help="host memory (RAM) per node an offloading plan may use, e.g. 64GB (64x10^9 bytes) or 64GiB (default: the target "
    "GPU's host from the catalog, or this machine's RAM when the target is this machine's GPU; the plan says which)")]
MarginOpt = Annotated[Optional[str], typer.Option(
    "--margin", help="memory kept free for what the estimate does not model: '512MB' (512x10^6 bytes), '512MiB' or a "
    "share of the budget ('5%'); default 0, and 256 MiB for NCCL's buffers with --world-size > 1 on a GPU (docs/planner.md)")]
OverCapacityOpt = Annotated[bool, typer.Option(
    "--allow-over-capacity", help="accept a --budget above the GPU's memory (refused otherwise)")]
AllowOpt = Annotated[Optional[list[str]], typer.Option(
    "--allow", metavar="RUNG", help="a rung that changes numerics the planner may climb when nothing fits without "
    "it (repeatable): 8bit-optimizer, chunked-loss (docs/fine-tuning.md); float8, taken where its plan is faster "
    "(docs/float8.md)")]
CompileOpt = Annotated[bool, typer.Option(
    "--compile", help="train the model compiled (torch.compile, inductor): estimated as inductor compiles it, and "
    "the trainer compiles it (docs/fine-tuning.md)")]
# The flags of the step features carried in more_features (Note [carried features], autofit/features/base.py), by
# the feature's field: options of plan and estimate both (feature_flags), each handed to autofit.Step / Savers as the
# option of that name, which the feature reads (Feature.from_user). Declared here, not in the feature's module, so
# that the help lists them without importing torch (tests/test_features.py checks they are the registry's).
FEATURE_FLAGS: dict[str, Any] = {
    "float8": Annotated[Optional[str], typer.Option(
        "--float8", metavar="RECIPE", help="train the linear layers in float8 with this torchao recipe (tensorwise, "
        "rowwise, rowwise_with_gw_hp): converted before the layout, the output head left (docs/float8.md)")],
}


def feature_flag_names() -> dict[str, tuple[str, ...]]:
    """Each :data:`FEATURE_FLAGS` entry's option names, by field (in ``Annotated`` typer holds the first name as the
    option's ``default``)."""
    names = {}
    for field, annotation in FEATURE_FLAGS.items():
        info = get_args(annotation)[1]
        names[field] = (info.default, *info.param_decls)
    return names


def feature_flags(command: Callable[..., None]) -> Callable[..., None]:
    """``command`` (a typer command taking ``features``) with one option per :data:`FEATURE_FLAGS` entry after its
    own; the command gets their values as ``features``, ``{field: value}``."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != "features"]
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
             for name, annotation in FEATURE_FLAGS.items()]

    @functools.wraps(command)
    def with_flags(**kwargs: Any) -> None:
        features = {name: kwargs.pop(name) for name in FEATURE_FLAGS}
        return command(**kwargs, features=features)

    with_flags.__signature__ = signature.replace(parameters=own + added)  # type: ignore[attr-defined]
    with_flags.__annotations__ = {p.name: p.annotation for p in own + added}
    return with_flags
QuietOpt = Annotated[bool, typer.Option(
    "--quiet", "-q", help="no progress: neither the terminal's progress line nor, when stderr is not a terminal, "
    "the stage lines written there")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print the plan as JSON (integer bytes)")]
NodesOpt = Annotated[Optional[int], typer.Option(
    "--nodes", help="machines training together, --gpus-per-node each (world size = nodes x GPUs per node); "
    "collectives across nodes run at the catalog's network bandwidth (docs/multi-gpu.md)")]
PerNodeOpt = Annotated[Optional[int], typer.Option(
    "--gpus-per-node", help="GPUs (processes) per node, linked by NVLink (default: every rank on one node)")]
ReshardOpt = Annotated[str, typer.Option(
    "--reshard-after-forward", help="FSDP2: true (ZeRO-3), false (ZeRO-2), a group size, or auto (the planner "
    "chooses)")]
ReplicateOpt = Annotated[str, typer.Option(
    "--replicate", help="FSDP2: HSDP's replicate size (1: plain FSDP; usually the number of nodes), or auto")]
TensorOpt = Annotated[str, typer.Option(
    "--tensor-parallel", help="FSDP2 x tensor parallel T (T GPUs of a node split each block's linear layers; the "
    "model's own tp plan, e.g. a Hugging Face config's base_model_tp_plan), 1 for none, or auto (also 2, 4, 8)")]
PipelineOpt = Annotated[int, typer.Option(
    "--pipeline-parallel", help="pipeline stages P: the model cut into P stages, one per rank, run by torch's "
    "pipeline schedule (--schedule), the accumulation steps its micro-batches; FSDP2 over the world size // P ranks "
    "of each stage (1: none); plan chooses the micro-batches and recomputation for it")]
PlanPipelineOpt = Annotated[str, typer.Option(
    "--pipeline-parallel", help="pipeline stages P: the model cut into P stages, one per rank, run by torch's "
    "pipeline schedule (--schedule), the accumulation steps its micro-batches; FSDP2 over the world size // P ranks "
    "of each stage (1: none); plan chooses the micro-batches and recomputation for it; auto: also races P = 2, 4, "
    "8, 16 dividing --world-size beside no pipeline")]
ScheduleOpt = Annotated[str, typer.Option(
    "--schedule", help="with --pipeline-parallel: torch's schedule, GPipe, 1F1B, Interleaved1F1B, LoopedBFS, "
    "InterleavedZeroBubble, ZBVZeroBubble or DualPipeV (the last five hold two stages per rank); on plan also auto "
    "(every schedule raced, the fastest that fits kept)")]
PipelineLayersOpt = Annotated[Optional[str], typer.Option(
    "--pipeline-layers", metavar="N,N,...", help="with --pipeline-parallel: each stage's decoder layers in stage "
    "order, summing to the model's (P counts, 2P under the schedules that hold two stages per rank); default: an "
    "even split, the remainder on the first stages")]


def pipeline_layers(text: str | None) -> tuple[int, ...] | None:
    """``--pipeline-layers 15,16,16,15`` as ``Layout.pipeline_layers`` takes it; a typed error for anything else."""
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise InvalidInputError(f"--pipeline-layers {text!r}: each stage's decoder layers, comma-separated "
                                "integers in stage order (e.g. 15,16,16,15)") from None


SequenceOpt = Annotated[bool, typer.Option(
    "--sequence-parallel", help="with --tensor-parallel: the blocks' norms and residual stream split along the "
    "sequence too (torchtitan's layout; less activation memory, no more communication)")]
ZeroGradOpt = Annotated[Optional[str], typer.Option(
    "--zero-grad", help="where the training loop clears the gradients: after-step (after optimizer.step(): autofit's "
    "trainer, Hugging Face's Trainer), before-forward (the PyTorch tutorials' loop) or after-forward (Lightning's "
    "automatic optimization: last step's gradients live through forward). Default: after-step, and after-forward "
    "with --export lightning")]
BatchDimOpt = Annotated[str, typer.Option(
    "--batch-dim", help="the dim of the batch in the sample (and target) a factory returns: 0 (the default), 1 for "
    "time-major sequences (nn.LSTM's default), or 'INPUTS,TARGET' when they differ (1,0: one label per sequence); "
    "the plan records it for its trainer (Note [the batch dimension])")]
OptionalModelArg = Annotated[Optional[str], typer.Argument(
    metavar="MODEL", show_default=False, help="pkg.module:factory, file.py:factory, torchvision:NAME, hf:NAME (a "
                                              "checkpoint such as hf:Qwen/Qwen2.5-0.5B; 'autofit models' lists "
                                              "those known offline) or hf:TYPE --config k=v; none with --from FILE")]
OptionalBatchOpt = Annotated[Optional[int], typer.Option("--batch-size", "-n", help="effective batch: samples per "
                                                         "optimizer step (with --from: the config's)")]
FromOpt = Annotated[Optional[Path], typer.Option(
    "--from", metavar="FILE", help="plan the training config FILE: axolotl, LLaMA-Factory or torchtune YAML, TRL / "
    "Hugging Face TrainingArguments (JSON or YAML), torchtitan TOML; its model, sequence length, effective batch, "
    "adapter, precision and optimizer (docs/configs/)")]
WriteOpt = Annotated[Optional[Path], typer.Option(
    "--write", metavar="FILE", help="with --from: write the config back to FILE with only what the plan changes, "
                                    "comments and order kept")]
VariableLengthOpt = Annotated[bool, typer.Option(
    "--variable-length", help="also tabulate the rows per micro-batch that fit at 1/2, 1/4 and 1/8 of the input's "
    "length, for batches of varying length (a dozen more full simulations; docs/variable-length.md)")]
StrategyOpt = Annotated[Optional[str], typer.Option("--strategy", help="ddp or fsdp2 (default: autofit chooses when "
                                                    "--world-size > 1)")]


def default_zero_grad(export: str | None) -> str:
    """The order ``--zero-grad`` defaults to: Lightning's (after forward) when the plan is exported to Lightning,
    whose automatic optimization runs it (Note [where zero_grad falls]); else after the optimizer step."""
    return "after-forward" if export == "lightning" else "after-step"


def batch_dims_option(text: str) -> tuple[int, int]:
    """``--batch-dim``: "1" or "1,0", as ``batch_dim=`` takes it (Note [the batch dimension])."""
    from autofit.training.batch import as_batch_dims

    parts = [p.strip() for p in text.split(",")]
    if not 1 <= len(parts) <= 2 or not all(p.isdigit() for p in parts):
        raise InvalidInputError(f"--batch-dim must be a dim (1) or the inputs' and the target's (1,0), got {text!r}")
    return as_batch_dims(int(parts[0]) if len(parts) == 1 else tuple(int(p) for p in parts))


def spec_option(model: str, input_shape, input_dtype, config, task=None, *, model_dtype="auto", lora=None,
                lora_targets=None, qlora=False):
    from autofit.cli.adapters import Adapter
    from autofit.cli.specs import load_spec, parse_dtype, parse_overrides, parse_shape

    shapes = [parse_shape(s) for s in input_shape or []]
    dtype = parse_dtype(input_dtype) if input_dtype else None
    targets = None if lora_targets is None else (
        "all-linear" if lora_targets.strip() == "all-linear" else
        tuple(t.strip() for t in lora_targets.split(",") if t.strip()))
    adapter = Adapter(rank=lora, targets=targets, qlora=qlora)
    try:
        return load_spec(model, input_shapes=shapes or None, input_dtype=dtype,
                         config=parse_overrides(config or []), task=task, dtype=model_dtype, adapter=adapter)
    except AutofitError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's factory (or file) failed: say so in one line
        raise InvalidInputError(f"building MODEL {model!r} failed: {type(e).__name__}: {e}") from e


def gpu_option(gpu: str | None, gpu_memory: str | None):
    """``--gpu`` and ``--gpu-memory`` as ``plan(gpu=...)`` takes them: the name, or a card described by its memory
    (and the catalog card it is like)."""
    if gpu_memory is None:
        return gpu
    return {"memory": gpu_memory, **({"like": gpu} if gpu is not None else {})}


def nodes_layout(world_size: int, nodes: int | None, gpus_per_node: int | None) -> tuple[int, int | None]:
    """``--world-size`` from ``--nodes`` x ``--gpus-per-node`` when given (both, and agreeing with an explicit
    ``--world-size``), and the ranks per node the planner needs."""
    if nodes is None:
        return world_size, gpus_per_node
    if gpus_per_node is None:
        raise InvalidInputError("--nodes needs --gpus-per-node (world size = nodes x GPUs per node), e.g. "
                                "--nodes 4 --gpus-per-node 8")
    total = nodes * gpus_per_node
    if world_size not in (1, total):
        raise InvalidInputError(f"--world-size {world_size} disagrees with --nodes {nodes} x --gpus-per-node "
                                f"{gpus_per_node} = {total}: give one or the other")
    return total, gpus_per_node


def layout_option(flag: str, value: str, *, boolean: bool = False) -> object:
    """"auto", an int, or (``boolean``: --reshard-after-forward) true / false, as plan() takes them."""
    text = value.strip().lower()
    if text == "auto":
        return "auto"
    if boolean and text in ("true", "false"):
        return text == "true"
    try:
        return int(text)
    except ValueError:
        raise InvalidInputError(f"{flag} must be auto, {'true, false or ' if boolean else ''}an int, got "
                                f"{value!r}") from None
