"""The plan in words: the rows ``str(plan)`` and the CLI's table show (:class:`PlanText`, a base of
:class:`~autofit.emit.plan.Plan`, whose fields its methods read), and the other configurations a plan reports beside
its own: the points of the memory/time front (:class:`Alternative`) and the best without each rung it climbed
(:class:`Forgone`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autofit.core.units import format_bytes, format_mib
from autofit.features import FEATURES
from autofit.training.config import ZeroGrad

__all__ = ["Alternative", "Forgone", "PlanText"]


@dataclass(frozen=True, kw_only=True)
class Alternative:
    """A point of the memory/time front: another configuration and what the models predict for it."""

    precision: str
    micro_batch_size: int
    gradient_accumulation_steps: int
    checkpoint: tuple[str, ...]
    # on the device (what the budget is checked against): modelled, except the chosen configuration's row, which
    # is its verified figure, the plan's device_bytes (Note [one configuration, one figure], emit/assemble.py)
    peak_bytes: int
    step_seconds: float  # modelled step time
    selective: tuple[str, ...] = ()  # those of checkpoint recomputed selectively
    op_selective: tuple[str, ...] = ()  # those of checkpoint recomputed by torchtitan's per-op policy


@dataclass(frozen=True, kw_only=True)
class Forgone:
    """The best the planner found without a rung the plan climbed (Note [the ladder]: the states on the host, a lower
    stored precision, an opt-in rung): the plan's configuration run without it, estimated in full, so a user sees
    what the rung buys. ``fits``: whether that figure fits the budget (the ladder climbs only where nothing fits, so
    it usually does not); ``gpus``: for a multi-GPU job with its states on the host because their share alone
    misses the budget, the fewest GPUs whose share would fit each (Note [ruled out by arithmetic]: a floor, below it
    offload is needed); None where the states fit already and the rest needed the host."""

    without: str  # the rung, as the plan's notes name it ("the states on the host", "stored bf16", ...)
    fits: bool
    precision: str | None = None  # None: no configuration estimated (the rung's states alone miss the budget)
    micro_batch_size: int = 0
    gradient_accumulation_steps: int = 0
    checkpoint: tuple[str, ...] = ()
    peak_bytes: int = 0  # allocated, ~ torch.cuda.max_memory_allocated
    device_bytes: int = 0  # what the budget is checked against
    step_seconds: float | None = None  # modelled; None where no configuration was estimated
    gpus: int | None = None


class PlanText:
    """The plan's rows and ``str(plan)``: a base of :class:`~autofit.emit.plan.Plan`, whose fields they read."""

    # ---- the human table the CLI prints ---------------------------------------------------------------------------
    def memory_rows(self, fmt) -> list[tuple[str, str]]:
        """The three figures as (label, value) rows, each saying what it compares with; ``fmt`` formats bytes."""
        if not self.device.caching_allocator:
            return [("peak (CPU allocator)", fmt(self.device_bytes))]
        return [
            ("peak allocated", f"{fmt(self.peak_allocated_bytes)} (~ torch.cuda.max_memory_allocated)"),
            ("peak reserved", f"{fmt(self.peak_reserved_bytes)} (~ torch.cuda.max_memory_reserved)"),
            ("on the device", f"{fmt(self.device_bytes)} (~ nvidia-smi: reserved + CUDA context; the budget "
                              "applies to this)"),
        ]

    def budget_text(self, fmt, used_where: str = "") -> str:
        """The budget, the share of it the plan uses and the margin it keeps free; ``fmt`` formats bytes."""
        used = f"{100 * self.device_bytes / self.budget_bytes:.0f} % used{used_where}"
        if self.margin_bytes:
            used += f"; {fmt(self.margin_bytes)} margin kept free for what is not modelled"
        return f"{fmt(self.budget_bytes)} ({used})"

    def rows_by_length_text(self) -> str:
        """``length: rows`` for each tabulated length, longest first (what ``micro_batch_size_for`` reads)."""
        return ", ".join(f"{n}: {r}" for n, r in self.rows_by_length) + " (length: rows per micro-batch)"

    def summary_rows(self, fmt: Callable[[int], str], *, modules: Callable[[tuple[str, ...]], str] | None = None,
                     budget_where: str = "") -> list[tuple[str, str]]:
        """The plan's knobs and figures as (name, value) rows: what ``str(plan)`` and the CLI's table both show.
        ``fmt`` renders bytes; ``modules`` renders a list of module names (default: joined, cut at 100 characters);
        ``budget_where`` is appended to the budget's share ("on the device")."""
        def joined(names: tuple[str, ...]) -> str:
            text = ", ".join(f"{n} ({self.checkpoint_policy(n)})" for n in names)
            return text if len(text) <= 100 else f"{len(names)} modules ({_policy_counts(self)}): {text[:90]}..."

        rows = [
            ("effective batch", f"{self.batch_size}"),
            ("micro-batch", f"{self.micro_batch_size}"),
            ("accumulation steps", f"{self.gradient_accumulation_steps}" + (
                f" (last micro-batch {self.last_micro_batch_size})"
                if self.last_micro_batch_size != self.micro_batch_size else "")),
            ("precision", str(self.precision)),
            ("checkpointed modules", (modules or joined)(self.checkpoint) if self.checkpoint else "none"),
            ("optimizer", self.optimizer),
            ("device", self.device + (f" ({self.gpu})" if self.gpu else "")),
            *self.memory_rows(fmt),
            ("budget", self.budget_text(fmt, budget_where)),
            ("gradient clipping", "none" if self.clip_grad_norm is None else f"clip_grad_norm_ to {self.clip_grad_norm:g}"),
            *([("zero_grad", _ZERO_GRAD_ROWS[self.zero_grad])] if self.zero_grad is not ZeroGrad.AFTER_STEP else []),
            # what the plan keeps in host memory: the states' and the host's rows are the layout's; the offloaded
            # activations' row is their step feature's (features/activation_offload.py)
            *self.parallel.host_rows(self.host_bytes, self.estimate.host_pinned_bytes, self.host_budget_bytes, fmt),
            ("predicted step time", f"{self.predicted_step_seconds:.3g} s (time model, for ranking)"),
        ]
        _feature_rows(self, rows)
        if len(self.rows_by_length) > 1:
            rows.insert(2, ("rows by length", self.rows_by_length_text()))
        head, sync = self.parallel.table_rows(self.batch_size, self.layout)  # the layout's own rows
        rows[1:1] = head
        after = next(i for i, (k, _) in enumerate(rows) if k == "accumulation steps") + 1
        rows[after:after] = sync
        return rows

    def __str__(self) -> str:
        rows = self.summary_rows(format_bytes)
        width = max(len(k) for k, _ in rows)
        lines = ["autofit plan", *(f"  {k:<{width}}  {v}" for k, v in rows), "", str(self.estimate)]
        if self.frontier:
            lines += ["", "alternatives (front: chosen row verified, others modelled):",
                      f"  {'precision':<9} {'micro':>5} {'accum':>5} {'ckpt':>4} {'peak MiB':>10} {'step s':>9}"]
            for a in self.frontier:
                lines.append(f"  {a.precision:<9} {a.micro_batch_size:>5} {a.gradient_accumulation_steps:>5} "
                             f"{len(a.checkpoint):>4} {format_mib(a.peak_bytes):>10} {a.step_seconds:>9.3g}")
        if self.alternatives:
            lines += ["", "without the rung the plan climbed (estimated in full):",
                      *(f"  {row}" for row in forgone_rows(self, format_bytes))]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def forgone_rows(plan: PlanText, fmt: Callable[[int], str]) -> list[str]:
    """One line per :class:`Forgone` of ``plan``: what the plan would be without the rung, whether it fits, its peak
    and step time, against the plan's own (``fmt`` formats bytes)."""
    rows = []
    for a in plan.alternatives:
        if a.precision is None:
            what = f"without {a.without}: the states alone miss the budget"
        else:
            verdict = "fits" if a.fits else "does not fit"
            what = (f"without {a.without}: {a.micro_batch_size} x {a.gradient_accumulation_steps} ({a.precision}, "
                    f"{len(a.checkpoint)} recomputed) {verdict}, {fmt(a.device_bytes)} on the device against "
                    f"{fmt(plan.budget_bytes - plan.margin_bytes)}, {a.step_seconds:.3g} s per step against "
                    f"{plan.predicted_step_seconds:.3g} s")
        if a.gpus is not None:
            what += (f"; fewer than {a.gpus} GPUs cannot keep the states on the GPUs (their share alone misses "
                     "the budget)")
        rows.append(what)
    return rows


# the row str(plan) and the CLI's table show for an order other than the default (Note [where zero_grad falls])
_ZERO_GRAD_ROWS = {
    ZeroGrad.BEFORE_FORWARD: "before forward (the PyTorch tutorials' order)",
    ZeroGrad.AFTER_FORWARD: "after forward, before backward (Lightning's order): last step's gradients live "
                            "through forward",
}


def _feature_rows(plan: PlanText, rows: list[tuple[str, str]]) -> None:
    """Each step feature's rows in ``rows`` (Note [step features]): one named as a row already there replaces it
    (the optimizer the trainer builds), another goes after the row its feature names (Feature.row_after; by
    default after the step's knobs, before the device)."""
    for feature in FEATURES:
        for name, value in feature.plan_rows(plan):
            at = next((i for i, (k, _) in enumerate(rows) if k == name), None)
            if at is not None:
                rows[at] = (name, value)
            else:
                after = (feature.row_after,) if isinstance(feature.row_after, str) else feature.row_after
                at = (next(i for i, (k, _) in enumerate(rows) if k == "device") if after is None
                      else next(i for name in after for i, (k, _) in enumerate(rows) if k == name) + 1)
                rows.insert(at, (name, value))


def _policy_counts(plan: PlanText) -> str:
    selective, ops = len(plan.selective), len(plan.op_selective)
    counts = f"{len(plan.checkpoint) - selective - ops} full, {selective} selective"
    return counts + (f", {ops} op-selective" if ops else "")
