"""``--plot``: saved activation memory per layer and the memory/time front, as one PNG (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path

from autofit.analyse.table import LayerTable
from autofit.emit.plan import Plan
from autofit.core.units import MiB

__all__ = ["write_plot"]


def write_plot(path: Path, plan: Plan, layers: LayerTable) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batch = plan.micro_batch_size
    rows = layers.largest(20, batch=batch)
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    left.barh([r.name for r in reversed(rows)], [r.saved_bytes(batch) / MiB for r in reversed(rows)])
    left.set_xlabel(f"saved for backward at micro-batch {batch} (MiB)")
    left.set_title("activation memory per layer")
    if plan.frontier:
        right.plot([a.peak_bytes / MiB for a in plan.frontier], [a.step_seconds for a in plan.frontier], "o-")
    right.axvline(plan.budget_bytes / MiB, color="red", linestyle="--", label="budget")
    right.plot([plan.device_bytes / MiB], [plan.predicted_step_seconds], "g*", markersize=14, label="chosen")
    right.set_xlabel("predicted peak (MiB)")
    right.set_ylabel("predicted step time (s)")
    right.set_title("memory / time front")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
