"""``autofit plan --gpu A,B,C`` (or ``--gpu all``): one plan per card, side by side (``autofit.compare``), as a rich
table or a JSON list. The numbers come from :func:`autofit.compare.compare`; this module only parses and renders."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from autofit.compare import TOKENS, CardRow
from autofit.core.errors import InvalidInputError
from autofit.core.units import format_bytes

__all__ = ["several_cards", "check_compare_flags", "render_rows", "rows_json"]


def several_cards(gpu: str | None, price: Sequence[str] | None) -> bool:
    """Whether ``--gpu`` asks for a comparison: several cards (comma separated), ``all``, or any ``--price``."""
    if gpu is None:
        return bool(price)
    return "," in gpu or gpu.strip().lower() == "all" or bool(price)


def check_compare_flags(gpu: str | None, *, device: str, gpu_memory: str | None, export, plot, write) -> None:
    """The flags a comparison cannot take, named with what to do instead."""
    if gpu is None:
        raise InvalidInputError("--price compares cards: name them with --gpu, e.g. --gpu RTX-4090,A100-80GB")
    if device != "cuda":
        raise InvalidInputError("--gpu with several cards compares GPUs: leave out --device cpu")
    for flag, given in (("--gpu-memory", gpu_memory), ("--export", export), ("--plot", plot), ("--write", write)):
        if given:
            raise InvalidInputError(f"{flag} applies to one card's plan: compare first, then plan the card you pick "
                                    "with --gpu CARD and " + flag)


def _money(x: float | None) -> str:
    return "-" if x is None else f"{x:,.4g}"


def render_rows(console: Console, rows: Sequence[CardRow], description: str, budget: str) -> None:
    """The comparison as one table: a row per card, sorted as ``compare`` sorts them."""
    unit = rows[0].unit if rows else TOKENS
    per = "tok/s" if unit == TOKENS else "samples/s"
    priced = any(r.price_per_hour is not None for r in rows)
    table = Table(title=f"which card: {escape(description)}", title_justify="left")
    for name, justify in (("card", "left"), ("fits", "left"), ("layout", "left"), ("precision", "left"),
                          ("micro x accum", "right"), ("peak on device", "right"), ("step s", "right"),
                          (per, "right"), ("$/hour", "right"), (f"$/M {unit}", "right")):
        table.add_column(name, justify=justify)
    for r in rows:
        if r.plan is None:
            fits = "no" if r.min_budget_bytes is None else f"no: needs {format_bytes(r.min_budget_bytes)}"
            table.add_row(r.gpu, escape(fits), "-", "-", "-", "-", "-", "-", _money(r.price_per_hour), "-")
            continue
        table.add_row(r.gpu, "yes", escape(r.layout or ""), r.plan.precision.label,
                      f"{r.micro_batch_size} x {r.accumulation_steps}", format_bytes(r.device_bytes),
                      f"{r.step_seconds:.3g}", f"{r.items_per_second:,.0f}", _money(r.price_per_hour),
                      _money(r.cost_per_million))
    console.print(table)
    what = ("tokens: rows x the sample's sequence length, padding included" if unit == TOKENS
            else "samples: the sample has no sequence dimension")
    order = ("sorted by cost per million " + unit + " (cards without a --price after)" if priced
             else "sorted by throughput (give --price CARD=USD_PER_HOUR for the cost)")
    budget_words = (f"budget {budget} of each card" if budget.strip().endswith("%")
                    else f"budget {budget} on every card")
    console.print(f"{budget_words}; throughput in {what}; step time from the time model (for ranking); {order}; "
                  "prices are yours, none are built in", highlight=False, markup=False, soft_wrap=True)
    for r in rows:
        if r.plan is None and r.why:
            console.print(f"{r.gpu}: {r.why}", highlight=False, markup=False, soft_wrap=True)


def rows_json(rows: Sequence[CardRow]) -> None:
    """The comparison as a JSON list, one object per card (integer bytes), in the table's order."""
    sys.stdout.write(json.dumps([r.to_dict() for r in rows]) + "\n")

