"""``autofit plan``, ``autofit estimate``, ``autofit verify`` and ``autofit models``: parse, call the library,
render. Exit codes: 0 plan (estimate, list) printed, 2 usage or bad input, 3 infeasible budget (the message names
the smallest budget that works), 4 (``verify``) the measured peak exceeds the budget. The commands' own errors are one line starting with ``error:``, no
traceback, on stdout (stderr with ``--json``); click's usage errors (a missing or malformed option) go to stderr with
the usage line. Output paths are checked before planning (:mod:`autofit.cli.outputs`). The flags the commands
share, and how their text is read, are :mod:`autofit.cli.flags`'s."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console

from autofit.cli.flags import (
    AllowOpt, BatchDimOpt, BatchOpt, BudgetOpt, CompileOpt, ConfigOpt, DeviceOpt, DtypeOpt, EXPORT_NAMES, FromOpt,
    GpuMemoryOpt, GpuOpt, HostBudgetOpt, JsonOpt, LoraOpt, LoraTargetsOpt, MarginOpt, ModelArg, ModelDtypeOpt, NodesOpt,
    OffloadOpt, OptimizerOpt, OptionalBatchOpt, OptionalModelArg, OverCapacityOpt, PerNodeOpt, PipelineLayersOpt,
    PipelineOpt, PlanGpuOpt, PlanPipelineOpt, PrecisionOpt, PriceOpt, QloraOpt, QuietOpt, ReplicateOpt, ReshardOpt,
    ScheduleOpt, SequenceOpt, ShapeOpt, StoredOpt, StrategyOpt, TaskOpt, TensorOpt, VariableLengthOpt, WorldOpt,
    WriteOpt, ZeroGradOpt, batch_dims_option, default_zero_grad, feature_flags, gpu_option, layout_option, nodes_layout,
    spec_option)
from autofit.cli.flags import pipeline_layers as parse_pipeline_layers
from autofit.cli.help import CONTEXT, Command, Group
from autofit.cli.messages import console_for, gpu_note, one_line_warnings, say
from autofit.cli.outputs import check_plot, parse_exports, write_exports
from autofit.cli.progress import planning_progress
from autofit.cli.sizes import SIZE_UNITS, check_sizes
from autofit.core.errors import AutofitError, HostMemoryError, InfeasibleBudgetError, InvalidInputError
from autofit.core.units import format_bytes

__all__ = ["app", "main", "run"]

# What runs torch (specs, tasks, rendering a plan, the planner) is imported inside the commands: `autofit --version`
# and `--help` load none of it (Note [a light import], autofit/__init__.py).

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, cls=Group, context_settings=CONTEXT,
                  help="Plan PyTorch training to fit a memory budget: micro-batch, accumulation, precision, "
                       f"activation checkpointing. Sizes: {SIZE_UNITS}.")

EXIT_INPUT, EXIT_INFEASIBLE, EXIT_OVER_BUDGET = 2, 3, 4


def _fail(console: Console, message: str, code: int) -> None:
    say(console, "error", message, "bold red")
    raise typer.Exit(code)


def _infeasible(e: InfeasibleBudgetError) -> str:
    """The planner's message, then the smallest budget that works (as the planner words it, one sentence each)."""
    message = str(e).rstrip()
    if not message.endswith("."):
        message += "."
    return f"{message} Smallest budget that works: {format_bytes(e.min_budget_bytes)} ({e.min_budget_bytes} bytes)."


def _config_features(path: Path, read: dict, flags: dict) -> dict:
    """The step features' options (FEATURE_FLAGS) with those the config at ``path`` turns on itself (torchtitan's
    float8 converter); a flag for one of those is refused, as --batch-size is, rather than silently preferred."""
    features = dict(flags)
    for name, value in read["features"].items():
        if flags.get(name) is not None:
            raise InvalidInputError(f"--from {path} turns on {name} itself ({value!r}); drop its flag")
        features[name] = value
    return features


def _version(value: bool) -> None:
    if value:
        try:
            typer.echo(f"autofit {package_version('torch-autofit')}")
        except PackageNotFoundError:  # running from a source tree that was never installed
            typer.echo("autofit (not installed)")
        raise typer.Exit()


@app.callback()
def _main(version: Annotated[bool, typer.Option("--version", "-V", callback=_version, is_eager=True,
                                                help="print the version and exit")] = False) -> None:
    """Plan PyTorch training to fit a memory budget: micro-batch, accumulation, precision, activation checkpointing.
    Sizes: GB = 10^9 bytes, GiB = 2^30 (as in every size flag); a number needs its unit (bytes: 565000000B)."""


@app.command(cls=Command)
@feature_flags  # the step features' own flags (--float8): FEATURE_FLAGS, autofit/cli/flags.py
def plan(
    budget: BudgetOpt, model: OptionalModelArg = None, batch_size: OptionalBatchOpt = None, input_shape: ShapeOpt = None,
    input_dtype: DtypeOpt = None, device: DeviceOpt = "cuda", gpu: PlanGpuOpt = None, gpu_memory: GpuMemoryOpt = None,
    price: PriceOpt = None, precision: PrecisionOpt = "auto",
    optimizer: OptimizerOpt = "adamw", config: ConfigOpt = None, task: TaskOpt = None, world_size: WorldOpt = 1,
    strategy: StrategyOpt = None, as_json: JsonOpt = False, min_stored_precision: StoredOpt = None,
    offload: OffloadOpt = True, host_budget: HostBudgetOpt = None, margin: MarginOpt = None,
    allow_over_capacity: OverCapacityOpt = False, nodes: NodesOpt = None, gpus_per_node: PerNodeOpt = None,
    reshard_after_forward: ReshardOpt = "auto", replicate: ReplicateOpt = "auto", allow: AllowOpt = None,
    tensor_parallel: TensorOpt = "1", sequence_parallel: SequenceOpt = False, compile: CompileOpt = False,
    pipeline_parallel: PlanPipelineOpt = "1", schedule: ScheduleOpt = "1F1B",
    pipeline_layers: PipelineLayersOpt = None, quiet: QuietOpt = False, zero_grad: ZeroGradOpt = None,
    batch_dim: BatchDimOpt = "0",
    model_dtype: ModelDtypeOpt = "auto", lora: LoraOpt = None, lora_targets: LoraTargetsOpt = None,
    qlora: QloraOpt = False,
    variable_length: VariableLengthOpt = False,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="write memory per layer and the front to a PNG "
                                                 "(the path is checked before planning)")] = None,
    export: Annotated[Optional[list[str]], typer.Option(
        "--export", metavar="NAME[=PATH]", help="also give the plan as hf (TrainingArguments JSON), deepspeed "
        "(JSON), accelerate (YAML), lightning (YAML) or torchtitan (TOML) settings: printed, or with =PATH written "
        "as the file that framework reads (repeatable; the paths are checked before planning)")] = None,
    from_file: FromOpt = None, write: WriteOpt = None, features: Optional[dict[str, Any]] = None,
) -> None:
    """Print the plan for MODEL: the knobs, the predicted peak and its breakdown, the largest layers, the front."""
    console = console_for(stderr=as_json)
    try:
        # the sizes first: a budget without a unit is refused before torch and the planner are imported (seconds)
        check_sizes(budget=budget, gpu_memory=gpu_memory, host_budget=host_budget, margin=margin)
        from autofit.cli.compare import check_compare_flags, render_rows, rows_json, several_cards
        from autofit.cli.estimate import sequence_option
        from autofit.cli.render import render_plan
        from autofit.options import Device, Layout, Options, Precision, Savers, Search
        from autofit.planner import plan_with_analysis
        from autofit.request import make_request

        exports = parse_exports(export, EXPORT_NAMES)
        if plot is not None:
            check_plot(plot)
        cards = several_cards(gpu, price)  # one plan per card, side by side (autofit/cli/compare.py)
        if cards:
            check_compare_flags(gpu, device=device, gpu_memory=gpu_memory, export=export, plot=plot, write=write)
        note = gpu_note(gpu) if device == "cuda" and not cards else None
        if note:
            say(console, "note", note)
        if write is not None and from_file is None:
            raise InvalidInputError("--write writes back the config given with --from FILE")
        if from_file is not None:  # the model, batch, ranks, precision and optimizer from the config
            from autofit.cli.configs.cli import plan_inputs

            with one_line_warnings(console):
                read = plan_inputs(from_file, model=model, batch_size=batch_size, world_size=world_size,
                                   precision=precision, optimizer=optimizer, console=console)
            spec, batch_size, world_size = read["spec"], read["batch_size"], read["world_size"]
            precision, optimizer, model = read["precision"], read["optimizer"], "hf:"
            features = _config_features(from_file, read, features or {})
        else:
            if model is None or batch_size is None:
                raise InvalidInputError("give MODEL and --batch-size, or a training config with --from FILE")
            with console.status("tracing the model...", spinner="dots"), one_line_warnings(console):
                spec = spec_option(model, input_shape, input_dtype, config, task, model_dtype=model_dtype, lora=lora,
                                   lora_targets=lora_targets, qlora=qlora)
        dims = batch_dims_option(batch_dim)
        if dims != (0, 0) and (input_shape or model.startswith(("hf:", "torchvision:"))):
            raise InvalidInputError("--batch-dim reads the sample a factory returns ((module, sample) or (module, "
                                    "sample, target)); generated inputs (--input-shape, hf:, torchvision:) are "
                                    "batch-first")
        world_size, gpus_per_node = nodes_layout(world_size, nodes, gpus_per_node)
        # the flags as the planner's option values (autofit/options.py): the one place they map
        options = dict(
            device=Device(kind=device, gpu=gpu_option(gpu, gpu_memory), margin=margin, host_budget=host_budget,
                          allow_over_capacity=allow_over_capacity),
            precision=Precision(compute=precision, min_stored=min_stored_precision),
            savers=Savers(offload="auto" if offload else False, allow=tuple(allow or ()), compile=compile,
                          **(features or {}), zero_grad=zero_grad or default_zero_grad(
                              "lightning" if any(n == "lightning" for n, _ in exports) else None)),
            layout=Layout(world_size=world_size, gpus_per_node=gpus_per_node, strategy=strategy,
                          reshard_after_forward=layout_option("--reshard-after-forward", reshard_after_forward,
                                                              boolean=True),
                          replicate=layout_option("--replicate", replicate),
                          tensor_parallel=layout_option("--tensor-parallel", tensor_parallel),
                          tensor_parallel_plan=sequence_option(spec.model, sequence_parallel, tensor_parallel),
                          pipeline_parallel=layout_option("--pipeline-parallel", pipeline_parallel),
                          pipeline_schedule=schedule, pipeline_layers=parse_pipeline_layers(pipeline_layers)),
            search=Search(variable_length=variable_length))
        if cards:
            from autofit.compare import compare

            options["device"] = replace(options["device"], gpu=None)  # each card in turn
            with planning_progress(console, quiet=quiet), one_line_warnings(console):
                rows = compare(spec.model, spec.sample, budget, gpus=gpu, prices=price, batch_size=batch_size,
                               target=spec.target, loss_fn=spec.loss_fn, optimizer=optimizer, batch_dim=dims,
                               **options)
        else:
            with planning_progress(console, quiet=quiet), one_line_warnings(console):
                result, analyses = plan_with_analysis(make_request(
                    spec.model, spec.sample, budget, options=Options.of(batch_dim=dims, **options),
                    batch_size=batch_size, target=spec.target, loss_fn=spec.loss_fn, optimizer=optimizer))
    except InfeasibleBudgetError as e:
        _fail(console, _infeasible(e), EXIT_INFEASIBLE)
    except HostMemoryError as e:  # fits the GPU only with more host memory than allowed: infeasible too
        _fail(console, str(e), EXIT_INFEASIBLE)
    except (AutofitError, typer.BadParameter) as e:
        _fail(console, str(e), EXIT_INPUT)
    if cards:
        rows_json(rows) if as_json else render_rows(console, rows, spec.description, budget)
        return
    if as_json:
        sys.stdout.write(result.to_json() + "\n")
    else:
        render_plan(console, result, spec.description, analyses[result.precision.label].table)
    if write is not None:
        from autofit.cli.configs.cli import write_back

        try:
            write_back(console_for(stderr=as_json), read["config"], result, write)
        except AutofitError as e:
            _fail(console, str(e), EXIT_INPUT)
    try:
        write_exports(console_for(stderr=as_json), result, exports)
    except InvalidInputError as e:
        _fail(console, str(e), EXIT_INPUT)
    if plot is not None:
        from autofit.cli.plot import write_plot

        try:
            write_plot(plot, result, analyses[result.precision.label].table)
        except OSError as e:  # checked before planning, but the disk may fill or the folder go meanwhile
            _fail(console, f"--plot {plot}: {e.strerror or e}", EXIT_INPUT)
        console.print(f"wrote {plot}", highlight=False, markup=False)


@app.command(cls=Command)
def verify(
    model: ModelArg, budget: BudgetOpt, batch_size: BatchOpt, input_shape: ShapeOpt = None,
    input_dtype: DtypeOpt = None, precision: PrecisionOpt = "auto", optimizer: OptimizerOpt = "adamw",
    config: ConfigOpt = None, task: TaskOpt = None, margin: MarginOpt = None,
    steps: Annotated[int, typer.Option("--steps", help="real steps to run")] = 3, quiet: QuietOpt = False,
    model_dtype: ModelDtypeOpt = "auto", lora: LoraOpt = None, lora_targets: LoraTargetsOpt = None,
    qlora: QloraOpt = False,
) -> None:
    """Plan for this machine's device, run the plan for a few real steps, print predicted vs measured peak. Exits 4
    when the measured peak exceeds the budget."""
    import torch

    from autofit.cli.verify import run_verification
    from autofit.options import Device
    from autofit.planner import plan as make_plan

    console = console_for()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        check_sizes(budget=budget, margin=margin)
        with one_line_warnings(console):
            spec = spec_option(model, input_shape, input_dtype, config, task, model_dtype=model_dtype, lora=lora,
                               lora_targets=lora_targets, qlora=qlora)
            with planning_progress(console, f"planning for {device}", quiet=quiet):
                result = make_plan(spec.model, spec.sample, budget, batch_size=batch_size, target=spec.target,
                                   loss_fn=spec.loss_fn, optimizer=optimizer, precision=precision,
                                   device=Device(kind=device, margin=margin))
            with console.status(f"running {steps} real steps...", spinner="dots"):
                report = run_verification(spec, result, steps=steps)
    except InfeasibleBudgetError as e:
        _fail(console, _infeasible(e), EXIT_INFEASIBLE)
    except AutofitError as e:
        _fail(console, str(e), EXIT_INPUT)
    console.print(report.table())
    if not report.fits:
        _fail(console, report.verdict(), EXIT_OVER_BUDGET)
    console.print(report.verdict(), highlight=False, markup=False)


@app.command(cls=Command)
@feature_flags  # the step features' own flags (--float8): FEATURE_FLAGS, autofit/cli/flags.py
def estimate(
    model: ModelArg,
    micro_batch_size: Annotated[int, typer.Option("--micro-batch-size", "-m", help="rows per micro-batch (per rank "
                                                  "with --world-size)")],
    batch_size: Annotated[Optional[int], typer.Option("--batch-size", "-n", help="effective batch over all ranks: "
                                                      "micro-batch x accumulation x world size (default: one "
                                                      "micro-batch per rank)")] = None,
    input_shape: ShapeOpt = None, input_dtype: DtypeOpt = None, device: DeviceOpt = "cuda", gpu: GpuOpt = None,
    gpu_memory: GpuMemoryOpt = None,
    precision: Annotated[str, typer.Option("--precision", help="fp32, bf16 or fp16")] = "fp32",
    optimizer: OptimizerOpt = "adamw", config: ConfigOpt = None, task: TaskOpt = None, world_size: WorldOpt = 1,
    strategy: Annotated[Optional[str], typer.Option("--strategy", help="ddp or fsdp2 (needs --world-size > 1)")]
    = None, nodes: NodesOpt = None, gpus_per_node: PerNodeOpt = None,
    reshard_after_forward: Annotated[str, typer.Option("--reshard-after-forward", help="FSDP2: true (ZeRO-3), "
                                                       "false (ZeRO-2) or a group size")] = "true",
    replicate: Annotated[str, typer.Option("--replicate", help="FSDP2: HSDP's replicate size (1: plain FSDP)")]
    = "1",
    checkpoint: Annotated[Optional[list[str]], typer.Option(
        "--checkpoint", metavar="NAME[:POLICY]", help="a module to recompute (repeatable); 'blocks' for the "
        "model's repeated blocks; ':selective' keeps its matmul and attention outputs, ':op-selective' recomputes "
        "as torchtitan's per-op policy (attention and every other matmul kept)")] = None,
    clip_grad_norm: Annotated[Optional[float], typer.Option("--clip-grad-norm", help="clip the gradients to this "
                                                             "norm before the step")] = None,
    tensor_parallel: Annotated[str, typer.Option("--tensor-parallel", help="tensor-parallel degree T (the model's "
                                                 "own tp plan; 1: none)")] = "1",
    pipeline_parallel: PipelineOpt = 1, schedule: ScheduleOpt = "1F1B", pipeline_layers: PipelineLayersOpt = None,
    sequence_parallel: SequenceOpt = False, compile: CompileOpt = False, zero_grad: ZeroGradOpt = None,
    model_dtype: ModelDtypeOpt = "auto", lora: LoraOpt = None, lora_targets: LoraTargetsOpt = None,
    qlora: QloraOpt = False,
    reduce_every_micro_batch: Annotated[bool, typer.Option(
        "--reduce-every-micro-batch/--defer-reduce", help="FSDP2 with accumulation: reduce-scatter the gradients "
        "after every micro-batch (torchtitan), or defer it to the last one (no_sync; every rank then holds its "
        "shard's unsharded fp32 gradients across micro-batches)")] = False,
    offload_activations: Annotated[Optional[list[str]], typer.Option(
        "--offload-activations", metavar="NAME", help="a module whose saved activations live in host memory "
        "(save_on_cpu; repeatable)")] = None,
    offload_states: Annotated[bool, typer.Option("--offload-states", help="parameters, gradients and optimizer "
                                                 "state in host memory (FSDP2's CPUOffloadPolicy)")] = False,
    optimizer_in_backward: Annotated[bool, typer.Option("--optimizer-in-backward", help="step each parameter in "
                                                        "backward and free its gradient")] = False,
    chunked_loss: Annotated[bool, typer.Option("--chunked-loss", help="the output head and cross-entropy in "
                                               "chunks of tokens")] = False,
    preallocated_grads: Annotated[bool, typer.Option("--preallocated-grads", help="gradients allocated before "
                                                     "forward, zeroed in place")] = False,
    inputs: Annotated[str, typer.Option("--inputs", help="rows resident: batch (the rank's whole batch, as the "
                                        "plan's trainer) or micro-batch")] = "batch",
    gradient_as_bucket_view: Annotated[bool, typer.Option(
        "--gradient-as-bucket-view/--no-gradient-as-bucket-view", help="DDP: gradients as views into its buckets "
        "(autofit's trainer) or torch's default, a second copy")] = True,
    expandable_segments: Annotated[bool, typer.Option(
        "--expandable-segments", help="the CUDA caching allocator runs with PYTORCH_CUDA_ALLOC_CONF="
        "expandable_segments:True (as torchtitan launches)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print the estimate as JSON (integer bytes)")] = False,
    features: Optional[dict[str, Any]] = None,
) -> None:
    """Print the predicted memory of one fixed configuration of MODEL, per rank: peak allocated, reserved and on the
    device, and the peak's breakdown by category. No search: the knobs are the flags'."""
    from autofit.cli.estimate import estimate_data, estimate_setup, estimate_tables, run_estimate

    console = console_for(stderr=as_json)
    try:
        check_sizes(gpu_memory=gpu_memory)
        note = gpu_note(gpu) if device == "cuda" else None
        if note:
            say(console, "note", note)
        with console.status("tracing the model...", spinner="dots"), one_line_warnings(console):
            spec = spec_option(model, input_shape, input_dtype, config, task, model_dtype=model_dtype, lora=lora,
                               lora_targets=lora_targets, qlora=qlora)
        world_size, _ = nodes_layout(world_size, nodes, gpus_per_node)
        setup = estimate_setup(
            spec, micro_batch_size=micro_batch_size, batch_size=batch_size, precision=precision,
            optimizer=optimizer, device=device, gpu=gpu_option(gpu, gpu_memory), world_size=world_size,
            strategy=strategy,
            reshard_after_forward=layout_option("--reshard-after-forward", reshard_after_forward, boolean=True),
            replicate=layout_option("--replicate", replicate), checkpoint=checkpoint, clip_grad_norm=clip_grad_norm,
            tensor_parallel=layout_option("--tensor-parallel", tensor_parallel), compile=compile,
            sequence_parallel=sequence_parallel, zero_grad=zero_grad or "after-step",
            pipeline_parallel=pipeline_parallel, pipeline_schedule=schedule,
            pipeline_layers=parse_pipeline_layers(pipeline_layers),
            reduce_every_micro_batch=reduce_every_micro_batch, offload=offload_activations,
            offload_states=offload_states, optimizer_in_backward=optimizer_in_backward, chunked_loss=chunked_loss,
            preallocated_grads=preallocated_grads, inputs=inputs, gradient_as_bucket_view=gradient_as_bucket_view,
            expandable_segments=expandable_segments, features=features or {})
        with console.status("simulating one step...", spinner="dots"), one_line_warnings(console):
            result = run_estimate(spec, setup)
    except AutofitError as e:
        _fail(console, str(e), EXIT_INPUT)
    if as_json:
        sys.stdout.write(json.dumps(estimate_data(result, setup, spec.description)) + "\n")
    else:
        console.print(estimate_tables(result, setup, spec.description))


@app.command(cls=Command)
def check(
    file: Annotated[Path, typer.Argument(metavar="FILE", show_default=False, help="a training config (as for plan "
                                         "--from)")],
    gpu: Annotated[str, typer.Option("--gpu", help="the card to check on, e.g. RTX-4090, A100-80GB, H100")],
    world_size: Annotated[int, typer.Option("--world-size", help="data-parallel ranks (default: the config's, "
                                            "else 1)")] = 1,
    as_json: Annotated[bool, typer.Option("--json", help="print the verdict as JSON (integer bytes)")] = False,
) -> None:
    """Estimate the training config FILE as written on the card --gpu: fits or not, the peak and its breakdown,
    what was read. Exits 0 when it fits, 3 when it does not, 2 on bad input."""
    from autofit.cli.configs.cli import check as run_check

    console = console_for(stderr=as_json)
    try:
        with console.status("simulating the config's step...", spinner="dots"), one_line_warnings(console):
            code = run_check(file, gpu, world_size=world_size, as_json=as_json, console=console)
    except AutofitError as e:
        _fail(console, str(e), EXIT_INPUT)
    raise typer.Exit(code)


@app.command(cls=Command)
def models(
    match: Annotated[Optional[str], typer.Argument(metavar="[MATCH]", show_default=False, help=(
        "only names, aliases or families containing this (case-insensitive), e.g. qwen, gemma-2, mistralai/"))] = None,
) -> None:
    """List the Hugging Face checkpoints hf:NAME knows offline: name, family, parameters, the model class it builds
    and the names that share the entry (instruct variants, legacy ids)."""
    from autofit.cli.models import model_rows, models_table

    console = console_for()
    try:
        with console.status("counting parameters on the meta device...", spinner="dots"), \
                one_line_warnings(console):
            rows = model_rows(match)
        if not rows:
            raise InvalidInputError(f"no checkpoint of the offline table matches {match!r}; 'autofit models' "
                                    "lists them all")
    except AutofitError as e:
        _fail(console, str(e), EXIT_INPUT)
    console.print(models_table(rows))


def main() -> None:
    try:
        app()
    except typer.BadParameter as e:  # raised outside a command (option parsing)
        say(Console(stderr=True), "error", str(e), "bold red")
        sys.exit(EXIT_INPUT)


def run() -> None:
    """The ``autofit`` command (console script and ``python -m autofit``): :func:`main`, with the collector frozen
    before the interpreter exits (Note [a quick exit])."""
    import gc

    try:
        main()
    finally:
        gc.freeze()


# Note [a quick exit]
#     A plan leaves a large heap (fake tensors' metadata, timelines, analyses: about 0.5 GB for Llama-3.1-8B), and at
#     exit the interpreter's last collections walk all of it: 1.8 s after an 8B plan, measured from the end of
#     ``main`` to the end of the process. ``gc.freeze()`` moves every object to the permanent generation, which no
#     collection visits: 0.27 s, the exit otherwise as usual (``atexit`` handlers, threads joined, streams flushed).
#     Only in the command: :func:`main`, which tests and embedders call in-process, leaves their collector alone.
