"""The command line's side of the front door: ``autofit plan --from FILE [--write OUT]`` and ``autofit check FILE
--gpu CARD``. Parsing stays in autofit/cli/app.py; this module turns a config into the plan command's inputs,
writes the config back, and renders the check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.table import Table

from autofit.core.errors import InvalidInputError
from autofit.core.units import format_mib

__all__ = ["plan_inputs", "write_back", "check", "EXIT_FITS", "EXIT_DOES_NOT_FIT"]

EXIT_FITS, EXIT_DOES_NOT_FIT = 0, 3


def _print_reading(console: Console, config) -> None:
    console.print(f"read {config.path}: {config.framework} config, "
                  f"effective batch {config.micro_batch_size} x {config.accumulation_steps} x {config.data_ranks} "
                  f"= {config.effective_batch}", highlight=False, markup=False)
    for line in config.lines():
        console.print(f"  {line}", highlight=False, markup=False)


def plan_inputs(path: Path, *, model: str | None, batch_size: int | None, world_size: int, precision: str,
                optimizer: str, console: Console) -> dict[str, Any]:
    """The plan command's inputs from the config at ``path``: its spec, effective batch, data ranks, precision and
    optimizer; flags that the config already answers are refused rather than silently preferred."""
    from autofit.cli.configs.detect import read_config
    from autofit.cli.configs.run import config_features, model_spec, optimizer_for, plan_precision

    if model is not None:
        raise InvalidInputError(f"--from {path} names the model; drop MODEL {model!r}")
    if batch_size is not None:
        raise InvalidInputError(f"--from {path}: the effective batch comes from the config (micro-batch x "
                                "accumulation x data ranks); drop --batch-size")
    config = read_config(path, data_ranks=world_size if world_size > 1 else None)
    _print_reading(console, config)
    return {"config": config, "spec": model_spec(config), "batch_size": config.effective_batch,
            "world_size": config.data_ranks,
            "precision": plan_precision(config) if precision == "auto" else precision,
            "optimizer": optimizer_for(config) if optimizer == "adamw" else optimizer,
            "features": config_features(config)}


def write_back(console: Console, config, plan, dest: Path) -> None:
    from autofit.cli.configs.writeback import knobs_of, plan_changes, write_config

    knobs = knobs_of(plan, config)
    changes = plan_changes(config, knobs)
    write_config(config.path, changes, dest)
    what = ", ".join(f"{k} = {v}" for k, v in changes.items()) or "nothing: the config fits as written"
    console.print(f"wrote {dest} ({what})", highlight=False, markup=False)
    for note in knobs.notes:
        console.print(f"note: {note}", highlight=False, markup=False)


def check(path: Path, gpu: str, *, world_size: int, as_json: bool, console: Console) -> int:
    """Estimate the config as written on ``gpu``; print the verdict, the peak and its breakdown; the exit code."""
    from autofit.cli.configs.run import check_config

    result = check_config(path, gpu, data_ranks=world_size if world_size > 1 else None)
    est, config = result.estimate, result.config
    if as_json:
        print(json.dumps({
            "fits": result.fits, "gpu": result.gpu, "capacity_bytes": result.capacity_bytes,
            "device_bytes": est.device_bytes, "peak_allocated_bytes": est.peak_allocated_bytes,
            "peak_reserved_bytes": est.peak_reserved_bytes, "breakdown": dict(est.breakdown),
            "framework": config.framework, "model": config.model, "read": [r.key for r in config.readings],
            "not_modelled": [k for k, _ in config.unmodelled], "unknown": list(config.unknown),
            "notes": list(config.notes) + list(est.notes)}))
    else:
        _print_reading(console, config)
        verdict = "fits" if result.fits else "does NOT fit"
        summary = Table(title=f"autofit check: {verdict} on {result.gpu}", show_header=False, title_justify="left")
        summary.add_column("figure", style="bold")
        summary.add_column("value")
        for key, value in (("on the device", f"{format_mib(est.device_bytes)} MiB of "
                                             f"{format_mib(result.capacity_bytes)} MiB"),
                           ("peak allocated", f"{format_mib(est.peak_allocated_bytes)} MiB"),
                           ("peak reserved", f"{format_mib(est.peak_reserved_bytes)} MiB"),
                           ("step", f"{config.micro_batch_size} x {config.accumulation_steps} accumulation, "
                                    f"{config.precision}, recompute {config.checkpointing}")):
            summary.add_row(key, value)
        breakdown = Table(title="peak by category", title_justify="left")
        breakdown.add_column("category")
        breakdown.add_column("MiB", justify="right")
        for key, value in est.breakdown.items():
            breakdown.add_row(key, format_mib(value))
        console.print(Group(summary, breakdown))
        if not result.fits:
            console.print(f"over by {format_mib(est.device_bytes - result.capacity_bytes)} MiB: run autofit plan "
                          f"--from {path} --gpu {gpu} --budget ... --write FILE for a config that fits",
                          highlight=False, markup=False)
    return EXIT_FITS if result.fits else EXIT_DOES_NOT_FIT
