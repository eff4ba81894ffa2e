"""``autofit plan`` and ``autofit verify``: parse, call the library, render. Exit codes: 0 plan printed, 2 usage or
bad input, 3 infeasible budget (the message names the smallest budget that works). The commands' own errors are one
line starting with ``error:``, no traceback, on stdout (stderr with ``--json``); click's usage errors (a missing or
malformed option) go to stderr with the usage line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from autofit.cli.render import render_plan
from autofit.cli.specs import load_spec, parse_dtype, parse_overrides, parse_shape
from autofit.errors import AutofitError, InfeasibleBudgetError, InvalidInputError
from autofit.export import EXPORTERS
from autofit.units import format_bytes

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Plan PyTorch training to fit a memory budget: micro-batch, accumulation, precision, "
                       "activation checkpointing.")

EXIT_INPUT, EXIT_INFEASIBLE = 2, 3

ModelArg = Annotated[str, typer.Argument(help="pkg.module:factory, file.py:factory, torchvision:NAME or hf:MODEL_TYPE")]
BudgetOpt = Annotated[str, typer.Option("--budget", "-b", help="per device: '8GB' (10^9), '8GiB' (2^30), bytes, or "
                                        "'90%' of the GPU (of host memory with --device cpu)")]
BatchOpt = Annotated[int, typer.Option("--batch-size", "-n", help="effective batch: samples per optimizer step")]
ShapeOpt = Annotated[Optional[list[str]], typer.Option("--input-shape", help="one sample's shape without the batch "
                                                       "dimension, e.g. 3,224,224 (repeat for several inputs)")]
DtypeOpt = Annotated[Optional[str], typer.Option("--input-dtype",
                                                  help="dtype of generated inputs: float32, int64, ...")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu or cuda")]
GpuOpt = Annotated[Optional[str], typer.Option("--gpu", help="GPU model for device cuda, e.g. A100-80GB")]
PrecisionOpt = Annotated[str, typer.Option("--precision", help="auto, fp32, bf16 or fp16")]
OptimizerOpt = Annotated[str, typer.Option("--optimizer", help="adamw, adam or sgd")]
ConfigOpt = Annotated[Optional[list[str]], typer.Option("--config", help="hf:/torchvision: config override key=value")]
WorldOpt = Annotated[int, typer.Option("--world-size", help="processes (GPUs) training together; batch-size is global")]
StrategyOpt = Annotated[Optional[str], typer.Option("--strategy", help="ddp or fsdp2 (default: autofit chooses when "
                                                    "--world-size > 1)")]


def _fail(console: Console, message: str, code: int) -> None:
    console.print(f"[bold red]error:[/] {message}", soft_wrap=True)
    raise typer.Exit(code)


def _infeasible(e: InfeasibleBudgetError) -> str:
    """The planner's message, then the smallest budget that works (as the planner words it, one sentence each)."""
    message = str(e).rstrip()
    if not message.endswith("."):
        message += "."
    return f"{message} Smallest budget that works: {format_bytes(e.min_budget_bytes)} ({e.min_budget_bytes} bytes)."


def _spec(model: str, input_shape, input_dtype, config):
    shapes = [parse_shape(s) for s in input_shape or []]
    dtype = parse_dtype(input_dtype) if input_dtype else None
    try:
        return load_spec(model, input_shapes=shapes or None, input_dtype=dtype,
                         config=parse_overrides(config or []))
    except AutofitError:
        raise
    except Exception as e:  # noqa: BLE001 - the user's factory (or file) failed: say so in one line
        raise InvalidInputError(f"building MODEL {model!r} failed: {type(e).__name__}: {e}") from e


@app.command()
def plan(
    model: ModelArg, budget: BudgetOpt, batch_size: BatchOpt, input_shape: ShapeOpt = None,
    input_dtype: DtypeOpt = None, device: DeviceOpt = "cuda", gpu: GpuOpt = None, precision: PrecisionOpt = "auto",
    optimizer: OptimizerOpt = "adamw", config: ConfigOpt = None, world_size: WorldOpt = 1,
    strategy: StrategyOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the plan as JSON (integer bytes)")] = False,
    plot: Annotated[Optional[Path], typer.Option("--plot",
                                                 help="write memory per layer and the front to a PNG")] = None,
    export: Annotated[Optional[str], typer.Option("--export", help="also print the plan as hf, deepspeed or "
                                                  "lightning arguments")] = None,
) -> None:
    """Print the plan for MODEL: the knobs, the predicted peak and its breakdown, the largest layers, the front."""
    from autofit.planner import plan_with_analysis

    console = Console(stderr=as_json)
    try:
        if export is not None and export not in EXPORTERS:
            raise typer.BadParameter(f"--export must be one of {', '.join(EXPORTERS)}")
        with console.status("tracing the model...", spinner="dots"):
            spec = _spec(model, input_shape, input_dtype, config)
        with console.status("analysing and solving (fake tensors, no memory allocated)...", spinner="dots"):
            result, analyses = plan_with_analysis(
                spec.model, spec.sample, budget, batch_size=batch_size, target=spec.target, optimizer=optimizer,
                precision=precision, device=device, gpu=gpu, world_size=world_size, strategy=strategy,
            )
    except InfeasibleBudgetError as e:
        _fail(console, _infeasible(e), EXIT_INFEASIBLE)
    except (AutofitError, typer.BadParameter) as e:
        _fail(console, str(e), EXIT_INPUT)
    if as_json:
        sys.stdout.write(result.to_json() + "\n")
    else:
        render_plan(console, result, spec.description, analyses[result.precision.name].table)
    if export is not None:
        out = Console() if not as_json else Console(stderr=True)
        out.print_json(json.dumps(EXPORTERS[export](result)))
    if plot is not None:
        from autofit.cli.plot import write_plot

        try:
            write_plot(plot, result, analyses[result.precision.name].table)
        except ImportError:
            _fail(console, "--plot needs matplotlib: pip install 'torch-autofit[plot]'", EXIT_INPUT)
        console.print(f"wrote {plot}")


@app.command()
def verify(
    model: ModelArg, budget: BudgetOpt, batch_size: BatchOpt, input_shape: ShapeOpt = None,
    input_dtype: DtypeOpt = None, precision: PrecisionOpt = "auto", optimizer: OptimizerOpt = "adamw",
    config: ConfigOpt = None, steps: Annotated[int, typer.Option("--steps", help="real steps to run")] = 3,
) -> None:
    """Plan for this machine's device, run the plan for a few real steps, print predicted vs measured peak."""
    import torch

    from autofit.cli.verify import run_verification
    from autofit.planner import plan as make_plan

    console = Console()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        spec = _spec(model, input_shape, input_dtype, config)
        with console.status(f"planning for {device}...", spinner="dots"):
            result = make_plan(spec.model, spec.sample, budget, batch_size=batch_size, target=spec.target,
                               optimizer=optimizer, precision=precision, device=device)
        with console.status(f"running {steps} real steps...", spinner="dots"):
            report = run_verification(spec, result, steps=steps)
    except InfeasibleBudgetError as e:
        _fail(console, _infeasible(e), EXIT_INFEASIBLE)
    except AutofitError as e:
        _fail(console, str(e), EXIT_INPUT)
    console.print(report)


def main() -> None:
    try:
        app()
    except typer.BadParameter as e:  # raised outside a command (option parsing)
        Console(stderr=True).print(f"[bold red]error:[/] {e}")
        sys.exit(EXIT_INPUT)
