"""Rich tables for a plan: the knobs, the peak's breakdown, the largest layers, the alternatives. Units (MiB/GiB)
go in the column headers, as the issue asks; numbers are right-aligned."""

from __future__ import annotations

import re

from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table

from autofit.analyse.table import LayerTable
from autofit.cli.messages import console_for, say
from autofit.emit.plan import Plan
from autofit.training.recompute import POLICIES
from autofit.core.units import format_bytes, format_mib

__all__ = ["render_plan", "console_for", "group_names", "knobs_table", "lengths_table"]

def knobs_table(plan: Plan, model_description: str) -> Table:
    table = Table(title="autofit plan", show_header=False, title_justify="left")
    table.add_column("knob", style="bold")
    table.add_column("value")
    rows = plan.summary_rows(lambda n: f"{format_mib(n)} MiB", modules=lambda names: _recomputed(plan),
                             budget_where=" on the device")
    for key, value in rows:
        table.add_row(key, escape(value))  # a value citing a Note [name] stays whole
    return table


def breakdown_table(plan: Plan) -> Table:
    table = Table(title="predicted peak by category", title_justify="left")
    table.add_column("category")
    table.add_column("MiB", justify="right")
    table.add_column("share", justify="right")
    total = plan.estimate.device_bytes or 1
    for key, value in plan.estimate.breakdown.items():
        table.add_row(key, format_mib(value), f"{100 * value / total:.1f} %")
    label = "total (on the device)" if plan.device.caching_allocator else "total"
    table.add_row(f"[bold]{label}[/]", f"[bold]{format_mib(plan.estimate.device_bytes)}[/]", "100.0 %")
    return table


def _pattern(name: str) -> str:
    """'transformer.h.7.mlp.act' -> 'transformer.h.*.mlp.act': repeated layers share one row."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", name)


def _recomputed(plan: Plan) -> str:
    """The recomputed modules grouped, each group with its policy (full, selective or op-selective,
    autofit/training/recompute.py)."""
    if not plan.checkpoint:
        return "none"
    lines = []
    for policy in POLICIES:
        names = tuple(n for n in plan.checkpoint if plan.checkpoint_policy(n) == policy)
        lines += [f"{g} ({policy})" for g in group_names(names)]
    return "\n".join(lines)


def group_names(names: tuple[str, ...]) -> list[str]:
    """Module names grouped as the layer table groups them: 'model.layers.*.input_norm x 32', in first-seen order;
    a pattern that matches one module keeps its real name."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(_pattern(name), []).append(name)
    return [members[0] if len(members) == 1 else f"{pattern} x {len(members)}" for pattern, members in groups.items()]


def layers_table(layers: LayerTable, batch: int, limit: int = 8) -> Table:
    table = Table(title=f"largest layers by activation memory (micro-batch {batch}; per layer)",
                  title_justify="left")
    table.add_column("module", overflow="fold")  # full names in narrow terminals: fold, never cut
    table.add_column("type", overflow="fold")
    table.add_column("count", justify="right")
    table.add_column("saved MiB", justify="right")
    table.add_column("params MiB", justify="right")
    table.add_column("GFLOP", justify="right")
    groups: dict[tuple[str, str], list] = {}
    for row in layers.largest(len(layers.rows), batch=batch):
        groups.setdefault((_pattern(row.name), row.type), []).append(row)
    ranked = sorted(groups.items(), key=lambda kv: -max(r.saved_bytes(batch) for r in kv[1]))
    for (pattern, kind), rows in ranked[:limit]:
        first = max(rows, key=lambda r: r.saved_bytes(batch))
        table.add_row(pattern, kind, str(len(rows)), format_mib(first.saved_bytes(batch)), format_mib(first.param_bytes),
                      f"{first.flops(batch) / 1e9:.2f}")
    return table


def frontier_table(plan: Plan) -> Table:
    table = Table(title="alternatives (front: chosen row verified, others modelled)", title_justify="left")
    for column, justify in (("precision", "left"), ("micro", "right"), ("accum", "right"),
                            ("checkpointed", "right"), ("peak MiB", "right"), ("step s", "right")):
        table.add_column(column, justify=justify)
    for alt in plan.frontier:
        chosen = (alt.precision, alt.micro_batch_size, alt.checkpoint) == (
            plan.precision.label, plan.micro_batch_size, plan.checkpoint)
        style = "bold green" if chosen else None
        table.add_row(alt.precision, str(alt.micro_batch_size), str(alt.gradient_accumulation_steps),
                      str(len(alt.checkpoint)), format_mib(alt.peak_bytes), f"{alt.step_seconds:.3g}", style=style)
    return table


def forgone_table(plan: Plan) -> Table:
    """The best without each rung the plan climbed (autofit.emit.plan_text.Forgone), beside the plan: issue 56."""
    table = Table(title="without the rung the plan climbed (estimated in full)", title_justify="left")
    for column, justify in (("without", "left"), ("fits", "left"), ("precision", "left"), ("micro", "right"),
                            ("accum", "right"), ("checkpointed", "right"), ("on the device", "right"),
                            ("step s", "right"), ("GPUs to keep states on them", "right")):
        table.add_column(column, justify=justify)
    table.add_row("(the plan)", "yes", plan.precision.label, str(plan.micro_batch_size),
                  str(plan.gradient_accumulation_steps), str(len(plan.checkpoint)), format_bytes(plan.device_bytes),
                  f"{plan.predicted_step_seconds:.3g}", "", style="bold green")
    for a in plan.alternatives:
        known = a.precision is not None
        table.add_row(a.without, "yes" if a.fits else "no", a.precision or "-",
                      str(a.micro_batch_size) if known else "-", str(a.gradient_accumulation_steps) if known else "-",
                      str(len(a.checkpoint)) if known else "-", format_bytes(a.device_bytes) if known else "-",
                      f"{a.step_seconds:.3g}" if a.step_seconds is not None else "-",
                      "" if a.gpus is None else f">= {a.gpus}")
    return table


def lengths_table(plan: Plan) -> Table:
    """Rows per micro-batch at shorter lengths (Note [rows by length], autofit/solve/lengths.py)."""
    table = Table(title="rows per micro-batch by length (shorter batches)", title_justify="left")
    for column in ("length", "of the sample's", "rows per micro-batch", "micro-batches per batch"):
        table.add_column(column, justify="right")
    longest = plan.rows_by_length[0][0]
    per_rank = plan.batch_size // plan.parallel.data_ranks  # a tensor-parallel group's ranks share their rows
    for length, rows in plan.rows_by_length:
        share = "1" if length == longest else f"1/{round(longest / length)}"
        table.add_row(str(length), share, str(rows), str(-(-per_rank // rows)))
    return table


def render_plan(console: Console, plan: Plan, model_description: str, layers: LayerTable | None) -> None:
    # the model's description is a line of its own: as the table's title it would wrap at the table's width
    say(console, "model", model_description, "bold", flags=False)
    parts = [knobs_table(plan, model_description), breakdown_table(plan)]
    if layers is not None:
        parts.append(layers_table(layers, plan.micro_batch_size))
    if len(plan.rows_by_length) > 1:
        parts.append(lengths_table(plan))
    if plan.frontier:
        parts.append(frontier_table(plan))
    if plan.alternatives:
        parts.append(forgone_table(plan))
    console.print(Group(*parts))
    for note in plan.notes:  # escaped, in the command line's words: --host-budget, not host_budget= (messages.py)
        say(console, "note", note)
