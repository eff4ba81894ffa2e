"""``autofit.compare``: which card to rent. One plan per card, side by side, from one shared analysis.

Each card's row is the planner's own plan for that card (:func:`autofit.plan` with ``device=Device(gpu=card)``);
the plans run one after another inside :func:`autofit.core.shared.sharing`, so the analysis and the full
simulations of a step run once for all the cards that simulate it alike (Note [one analysis for several cards],
autofit/core/shared.py), and each card pays only for what is its own: the allocator, the memory and time
models, the search. Prices are the user's (``prices={card: USD per hour}``): none are built in, they change.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from autofit.core import progress
from autofit.core.errors import HostMemoryError, InfeasibleBudgetError, InvalidInputError, UnsupportedPrecisionError
from autofit.core.units import format_bytes, parse_budget
from autofit.cuda.catalog import GPUS, gpu_spec
from autofit.emit.plan import Plan
from autofit.options import Device, Layout
from autofit.parallel.host import host_words

__all__ = ["CardRow", "compare", "cards", "parse_prices", "TOKENS", "SAMPLES"]

TOKENS, SAMPLES = "tokens", "samples"  # what a row's throughput counts


@dataclass(frozen=True, kw_only=True)
class CardRow:
    """One card's plan in a comparison. ``fits``: a plan exists under the budget; else ``min_budget_bytes`` is the
    smallest budget that works where the planner names one, and ``why`` says what failed. Throughput counts
    ``unit`` ("tokens": rows x the sample's sequence length, padding included; "samples" where the sample has no
    sequence dimension) per step of ``batch_size`` rows over ``world_size`` cards; ``cost_per_million`` is USD per
    million of them at ``price_per_hour`` per card (None without a price, or without a plan)."""

    gpu: str
    fits: bool
    budget_bytes: int
    world_size: int = 1
    plan: Plan | None = None
    min_budget_bytes: int | None = None
    why: str | None = None
    unit: str = SAMPLES
    items_per_step: int = 0
    price_per_hour: float | None = None

    @property
    def layout(self) -> str | None:
        """The layout in words ('1 GPU', 'fsdp2 (ZeRO-3)', ...; ', states on the host' when offloaded)."""
        if self.plan is None:
            return None
        layout = self.plan.parallel
        return layout.layout.words(after_forward=" after forward", alone="1 GPU") + host_words(layout)

    @property
    def micro_batch_size(self) -> int | None:
        return None if self.plan is None else self.plan.micro_batch_size

    @property
    def accumulation_steps(self) -> int | None:
        return None if self.plan is None else self.plan.gradient_accumulation_steps

    @property
    def device_bytes(self) -> int | None:
        """The plan's peak on the device (reserved + CUDA context: what the budget holds)."""
        return None if self.plan is None else self.plan.device_bytes

    @property
    def step_seconds(self) -> float | None:
        return None if self.plan is None else self.plan.predicted_step_seconds

    @property
    def items_per_second(self) -> float | None:
        """``unit`` per second, all cards of the step together."""
        if self.plan is None or not self.plan.predicted_step_seconds:
            return None
        return self.items_per_step / self.plan.predicted_step_seconds

    @property
    def cost_per_million(self) -> float | None:
        """USD per million ``unit``: ``world_size`` cards at ``price_per_hour`` for one step's seconds, per item."""
        if self.price_per_hour is None or self.plan is None or not self.items_per_step:
            return None
        return self.world_size * self.price_per_hour / 3600 * self.plan.predicted_step_seconds / self.items_per_step * 1e6

    def to_dict(self) -> dict[str, Any]:
        """The row as JSON takes it (integer bytes; None where there is no plan or no price)."""
        return dict(gpu=self.gpu, fits=self.fits, budget_bytes=self.budget_bytes, world_size=self.world_size,
                    min_budget_bytes=self.min_budget_bytes, why=self.why, layout=self.layout,
                    precision=None if self.plan is None else self.plan.precision.label,
                    micro_batch_size=self.micro_batch_size, gradient_accumulation_steps=self.accumulation_steps,
                    device_bytes=self.device_bytes, step_seconds=self.step_seconds, unit=self.unit,
                    items_per_step=self.items_per_step, items_per_second=self.items_per_second,
                    price_per_hour=self.price_per_hour, cost_per_million=self.cost_per_million)


def cards(gpus: str | Iterable[str]) -> tuple[str, ...]:
    """The catalog names of ``gpus``: "all" (every card of the catalog), a comma-separated string, or names; each
    resolved as ``gpu=`` resolves it (an unknown name raises naming the closest), duplicates dropped."""
    if isinstance(gpus, str):
        if gpus.strip().lower() == "all":
            return tuple(GPUS)
        gpus = [g for g in gpus.split(",")]
    names = [g.strip() for g in gpus if isinstance(g, str) and g.strip()]
    if not names:
        raise InvalidInputError("gpus: name at least one card, e.g. 'RTX-4090,A100-80GB', or 'all' for the catalog")
    return tuple(dict.fromkeys(gpu_spec(n).name for n in names))


def parse_prices(items: Iterable[str] | Mapping[str, Any] | None) -> dict[str, float]:
    """USD per hour per card, by catalog name: a mapping, or texts "CARD=USD" (each may hold several, comma
    separated: "RTX-4090=0.69,H100=2.99"). A malformed text or a negative price raises naming it."""
    if items is None:
        return {}
    pairs: list[tuple[str, Any]] = []
    if isinstance(items, Mapping):
        pairs = list(items.items())
    else:
        for text in items:
            for part in str(text).split(","):
                if not part.strip():
                    continue
                card, sep, value = part.partition("=")
                if not sep or not card.strip() or not value.strip():
                    raise InvalidInputError(f"--price {part.strip()!r}: give CARD=USD_PER_HOUR, e.g. RTX-4090=0.69")
                pairs.append((card.strip(), value.strip()))
    prices = {}
    for card, value in pairs:
        try:
            usd = float(str(value).strip().lstrip("$"))
        except ValueError:
            raise InvalidInputError(f"price of {card}: {value!r} is not a number of US dollars per hour, e.g. "
                                    f"{card}=0.69") from None
        if not math.isfinite(usd) or usd < 0:
            raise InvalidInputError(f"price of {card}: {value!r} must be a finite number of dollars >= 0")
        prices[gpu_spec(card).name] = usd
    return prices


def compare(model: Any, sample: Any, budget: int | str = "90%", *, gpus: str | Iterable[str],
            prices: Mapping[str, Any] | Iterable[str] | None = None, batch_size: int | None = None,
            device: Device | None = None, layout: Layout | int | None = None, **plan_options: Any,
            ) -> tuple[CardRow, ...]:
    """One plan per card of ``gpus`` (names, a comma-separated string, or "all" for the catalog), sorted: by cost per
    million tokens (or samples) where ``prices`` ({card: USD per hour}) are given, cards without a price after those
    with one; else by throughput; cards without a plan last.

    ``budget`` per card: a share ("90%") is of each card's memory; bytes or a size ("24GB") apply to every card as
    they are (a card with less memory cannot hold it: its row says so). ``device`` (``autofit.Device``: margin,
    host budget, ``allow_over_capacity``) applies to every card; its ``gpu`` is each card in turn. The other keywords
    are :func:`autofit.plan`'s (target, loss_fn, optimizer, precision, savers, search, ...), the same for every card.

    The plans share the analysis and the simulations where the card does not change them (Note [one analysis for
    several cards], autofit/core/shared.py): each row equals ``autofit.plan(..., device=Device(gpu=card))``."""
    from autofit.planner import plan
    from autofit.core.shared import sharing
    from autofit.training.length import length_spec
    from autofit.training.optim import as_optimizer_spec
    from autofit.validate import as_inputs

    names = cards(gpus)
    price = parse_prices(prices)
    unknown = [c for c in price if c not in names]
    if unknown:
        raise InvalidInputError(f"a price is given for {', '.join(unknown)}, which is not among the cards compared "
                                f"({', '.join(names)}): add it to the cards or drop its price")
    base = device if device is not None else Device()
    if not isinstance(base, Device):
        raise InvalidInputError(f"device must be an autofit.Device (its gpu is each card in turn), got {base!r}")
    if base.kind.split(":")[0] != "cuda":
        raise InvalidInputError("compare plans for GPUs: device must be a CUDA Device")
    # one optimizer spec for every card: the cards' steps are then equal, and their simulations shared
    plan_options["optimizer"] = as_optimizer_spec(plan_options.get("optimizer", "adamw"))
    world_size = layout if isinstance(layout, int) else (layout.world_size if layout is not None else 1)
    batch, target = as_inputs(sample, plan_options.get("target"), plan_options.get("shared"),
                              plan_options.get("batch_dim", 0))
    length = length_spec(batch, target).length  # Note [the length of a batch]
    rows_per_step = batch_size if batch_size is not None else batch.size
    unit, per_step = (TOKENS, rows_per_step * length) if length else (SAMPLES, rows_per_step)
    rows = []
    with sharing():
        for position, name in enumerate(names):
            spec = gpu_spec(name)
            budget_bytes = parse_budget(budget, device_total_bytes=spec.memory_bytes)
            row = CardRow(gpu=name, fits=False, budget_bytes=budget_bytes, world_size=world_size, unit=unit,
                          items_per_step=per_step, price_per_hour=price.get(name))
            if budget_bytes > spec.memory_bytes and not base.allow_over_capacity:
                rows.append(replace(row, why=f"budget {format_bytes(budget_bytes)} is more than the card's memory, "
                                             f"{format_bytes(spec.memory_bytes)}: a size applies to every card as it "
                                             "is (a share such as '90%' is of each card's own)"))
                continue
            progress.report(f"card {name}", position, len(names))  # the comparison, how far
            try:
                chosen = plan(model, sample, budget, batch_size=batch_size, layout=layout,
                              device=replace(base, kind="cuda", gpu=name), **plan_options)
            except InfeasibleBudgetError as e:
                rows.append(replace(row, min_budget_bytes=e.min_budget_bytes, why=str(e)))
                continue
            except (HostMemoryError, UnsupportedPrecisionError) as e:  # e.g. bf16 asked of a card without it
                rows.append(replace(row, why=str(e)))
                continue
            rows.append(replace(row, fits=True, plan=chosen))
    return tuple(sorted(rows, key=_order))


def _order(row: CardRow) -> tuple:
    """With a plan first; then by cost where priced (those without a price after), then by throughput."""
    cost = row.cost_per_million
    speed = row.items_per_second or 0.0
    return (row.plan is None, cost is None, cost if cost is not None else 0.0, -speed, row.gpu)
