"""autofit's CUDA estimates against GPU memory figures that others measured and published.

Without a GPU on these machines, the GPU truth is what others measured and published (docs/published.md).
Every case below is rebuilt from its published configuration (config numbers written out here, no
hub access, no weights; models on the meta device), run through ``autofit.estimate(..., device=<the GPU>)``
with the same optimizer, precision, batch and step, and compared with the published figure:

- ``allocated``: ``torch.cuda.max_memory_allocated()`` (autofit: ``peak_bytes``, alias ``peak_allocated_bytes``);
- ``reserved``: ``torch.cuda.max_memory_reserved()`` (autofit: ``peak_reserved_bytes``);
- ``nvidia-smi``: what NVML reports the process (or the whole GPU) using: reserved plus the CUDA context
  (autofit: ``device_bytes``, with the context the source itself measured when it printed one).

Each case states its uncertainty: the rounding of the published number, MB meaning 10^6 or 2^20 bytes, figures read
off a plot, unknown GPU. Errors are (autofit - published) / published. The goal (docs/published.md):
within 3 % of allocated figures and 5 % of reserved ones; every case outside says why in its ``why`` line.
Multi-GPU cases (``published_multi_gpu.py``) compare one rank:
``estimate(..., layout=autofit.Layout(world_size=N, strategy=...))`` with the job's layout, against the per-GPU figure
the source printed (the largest rank's).
Nothing is asserted: this is a report. ``docs/published.md`` has a full run and discusses every row.

    python benchmarks/published.py                # all cases (two to three minutes)
    python benchmarks/published.py --cases gpt2   # those whose name contains "gpt2"
    python benchmarks/published.py --cases torchtitan   # the multi-GPU rows (about 30 s each)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch

import autofit
from benchmarks.published_cases import CASES as SINGLE_GPU_CASES, Case
from benchmarks.published_multi_gpu import MULTI_GPU_CASES

CASES = SINGLE_GPU_CASES + MULTI_GPU_CASES


@dataclass(frozen=True, kw_only=True)
class Row:
    case: Case
    autofit_bytes: int
    seconds: float
    phase: str
    error: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "error", (self.autofit_bytes - self.case.published_bytes) / self.case.published_bytes)


@contextlib.contextmanager
def _context_mib(mib: float | None) -> Iterator[None]:
    """The CUDA context the source measured, for nvidia-smi comparisons (``AUTOFIT_CUDA_CONTEXT_MIB``)."""
    old = os.environ.get("AUTOFIT_CUDA_CONTEXT_MIB")
    if mib is not None:
        os.environ["AUTOFIT_CUDA_CONTEXT_MIB"] = str(mib)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("AUTOFIT_CUDA_CONTEXT_MIB", None)
        else:
            os.environ["AUTOFIT_CUDA_CONTEXT_MIB"] = old


def _figure(est: Any, measures: str) -> int:
    """autofit's figure that matches what the source measured."""
    return {"allocated": est.peak_allocated_bytes, "reserved": est.peak_reserved_bytes,
            "nvidia-smi": est.device_bytes}[measures]


def run_case(case: Case) -> Row:
    model, sample, kwargs = case.build()
    start = time.perf_counter()
    with _context_mib(case.context_mib), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        device = autofit.Device(gpu=case.gpu, expandable_segments=True) if case.expandable_segments else case.gpu
        est = autofit.estimate(model, sample, device=device, **kwargs)
    figure = _figure(est, case.measures) + case.outside_bytes
    return Row(case=case, autofit_bytes=figure, seconds=time.perf_counter() - start,
               phase=est.peak_phase)


def _mb(n: int, unit: str) -> str:
    return f"{n / 1e6:,.0f} MB" if unit == "MB" else f"{n / 2**20:,.0f} MiB"


def render(rows: list[Row]) -> str:
    head = ("| case | GPU | measures | published | autofit | error | uncertainty | goal | peak in |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    lines = [head]
    for r in rows:
        c = r.case
        goal = 0.03 if c.measures == "allocated" else 0.05
        ok = "ok" if abs(r.error) <= goal else "OUT"
        gpu = c.gpu if c.ranks == 1 else f"{c.gpu}, rank of {c.ranks}"
        lines.append(f"| {c.name} | {gpu} | {c.measures} | {_mb(c.published_bytes, c.unit)} | "
                     f"{_mb(r.autofit_bytes, c.unit)} | {100 * r.error:+.1f} % | "
                     f"±{100 * c.uncertainty_bytes / c.published_bytes:.1f} % | {ok} (±{goal:.0%}) | {r.phase} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="", help="comma-separated substrings of case names")
    args = parser.parse_args(argv)
    wanted = [w for w in args.cases.split(",") if w]
    cases = [c for c in CASES if not wanted or any(w in c.name for w in wanted)]
    print(f"torch {torch.__version__}, autofit from {Path(autofit.__file__).parent}")
    start = time.perf_counter()
    rows = []
    for case in cases:
        row = run_case(case)
        rows.append(row)
        print(f"  {case.name}: {row.error:+.2%} ({row.seconds:.1f} s)", flush=True)
    print()
    print(render(rows))
    print()
    for r in rows:
        print(f"- {r.case.name}: {r.case.ran}\n  source: {r.case.source}\n  uncertainty: {r.case.uncertainty}")
        if r.case.why:
            print(f"  why: {r.case.why}")
    inside = [r for r in rows if abs(r.error) <= (0.03 if r.case.measures == "allocated" else 0.05)]
    print(f"\n{len(inside)} of {len(rows)} cases within the goal; "
          f"median |error| {sorted(abs(r.error) for r in rows)[len(rows) // 2]:.1%}; "
          f"total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
