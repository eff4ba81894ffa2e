"""How close autofit's estimate is to the CPU allocator, case by case, next to PyTorch's MemTracker.

For every case of ``tests/zoo.py`` and a few step configurations (fp32 / bf16 autocast, without / with the case's
checkpointed modules, Adam by default) it prints:

- measured: ``autofit.measure`` (real steps on the CPU; the allocator's high-water mark plus what was alive before
  the step: parameters, buffers, optimizer state, inputs): the ground truth;
- autofit: ``autofit.estimate`` (fake tensors, nothing allocated), its error and its wall time;
- MemTracker: ``torch.distributed._tools.mem_tracker.MemTracker`` under FakeTensorMode on the same step (see
  ``memtracker_baseline.py``), its error and wall time, or ``crash: <Exception>`` when it cannot run the model.

Error is (estimate - measured) / measured. Nothing is asserted: this is a report, the tests hold the tolerances.

    /work/venv/bin/python benchmarks/accuracy.py                   # every case, every configuration
    /work/venv/bin/python benchmarks/accuracy.py --cases vit,lstm  # a subset
    /work/venv/bin/python benchmarks/accuracy.py --no-memtracker   # autofit only (faster)
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402

import autofit  # noqa: E402
from benchmarks.memtracker_baseline import MemTrackerResult, memtracker_estimate  # noqa: E402

MiB = 2**20


@dataclass(frozen=True)
class StepSetting:
    """One configuration of the step, applied to a case."""

    precision: str
    checkpointed: bool
    optimizer: str

    @property
    def label(self) -> str:
        return f"{self.precision}{'+ckpt' if self.checkpointed else ''} {self.optimizer}"


@dataclass(frozen=True)
class Row:
    case: str
    setting: str
    measured: int | None
    autofit: int | None
    autofit_s: float
    method: str
    memtracker: MemTrackerResult | None
    problem: str = ""  # why a number is missing (measure or estimate raised)


def _settings(case, optimizer: str, precisions: list[str]) -> Iterator[StepSetting]:
    for precision in precisions:
        yield StepSetting(precision, False, optimizer)
        if case.checkpoint:
            yield StepSetting(precision, True, optimizer)


def _keywords(case, setting: StepSetting) -> dict:
    return dict(target=case.target, loss_fn=case.loss_fn,
                optimizer=setting.optimizer, precision=setting.precision,
                step=autofit.Step(micro_batch_size=case.micro_batch_size,
                                  checkpoint=case.checkpoint if setting.checkpointed else ()))


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """The CPU profiler that ``measure`` and estimate's kernel probes read prints two kineto lines per run straight
    to file descriptor 2; they would bury the table. Python exceptions still propagate (and are reported)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def run_row(case, setting: StepSetting, with_memtracker: bool) -> Row:
    """Measure, estimate and (optionally) MemTracker for one case and setting. A failure of one does not stop the
    others: it is reported under the row."""
    kw = _keywords(case, setting)
    problems = []
    try:
        with _quiet_stderr():
            measured = autofit.measure(case.model, case.sample, **kw).peak_bytes
    except Exception as e:  # noqa: BLE001 - reported in the table
        measured = None
        problems.append(f"measure raised {type(e).__name__}: {e}")
    gc.collect()
    start = time.perf_counter()
    try:
        with _quiet_stderr():  # the kernel probes run under the profiler too
            est = autofit.estimate(case.model, case.sample, **kw)
        estimate, method = est.peak_bytes, est.method
    except Exception as e:  # noqa: BLE001 - reported in the table
        estimate, method = None, ""
        problems.append(f"estimate raised {type(e).__name__}: {e}")
    seconds = time.perf_counter() - start
    gc.collect()
    tracked = memtracker_estimate(case.model, case.sample, checkpoint=kw["step"].checkpoint,
                                  **{k: v for k, v in kw.items() if k != "step"}) if with_memtracker else None
    return Row(case.name, setting.label, measured, estimate, seconds, method, tracked, "; ".join(problems))


def _err(estimate: int | None, measured: int | None) -> float | None:
    if estimate is None or not measured:
        return None
    return 100.0 * (estimate - measured) / measured


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MiB:.2f}"


def _pct(e: float | None) -> str:
    return "-" if e is None else f"{e:+.2f}%"


COLUMNS = [("case", 22, "<"), ("config", 15, "<"), ("measured MiB", 12, ">"), ("autofit MiB", 11, ">"),
           ("err", 8, ">"), ("s", 6, ">"), ("how", 4, "<"), ("MemTracker MiB", 18, ">"), ("err", 8, ">"),
           ("s", 6, ">")]


def _line(cells: list[str]) -> str:
    return "  ".join(f"{c:{align}{width}}" for c, (_, width, align) in zip(cells, COLUMNS))


def format_row(row: Row) -> str:
    mt = row.memtracker
    if mt is None:
        mt_cells = ["(skipped)", "-", "-"]
    elif mt.peak_bytes is None:
        mt_cells = [mt.error, "-", f"{mt.seconds:.1f}"]
    else:
        mt_cells = [_mib(mt.peak_bytes), _pct(_err(mt.peak_bytes, row.measured)), f"{mt.seconds:.1f}"]
    cells = [row.case, row.setting, _mib(row.measured), _mib(row.autofit), _pct(_err(row.autofit, row.measured)),
             f"{row.autofit_s:.1f}", row.method, *mt_cells]
    text = _line(cells)
    return f"{text}\n    ! {row.problem}" if row.problem else text


def summary(rows: list[Row]) -> list[str]:
    def stats(name: str, errors: list[float | None], failures: int) -> str:
        values = [abs(e) for e in errors if e is not None]
        if not values:
            return f"{name:<10} no estimates ({failures} failed)"
        return (f"{name:<10} max |error| {max(values):6.2f}%   mean |error| {statistics.fmean(values):6.2f}%   "
                f"over {len(values)} rows, {failures} failed")

    measured = [r for r in rows if r.measured is not None]
    lines = [stats("autofit", [_err(r.autofit, r.measured) for r in measured],
                   sum(r.autofit is None for r in measured))]
    tracked = [r for r in measured if r.memtracker is not None]
    if tracked:
        lines.append(stats("MemTracker", [_err(r.memtracker.peak_bytes, r.measured) for r in tracked],
                           sum(r.memtracker.peak_bytes is None for r in tracked)))
        both = [r for r in tracked if r.autofit is not None and r.memtracker.peak_bytes is not None]
        if both:
            lines.append(f"{'':<10} on the {len(both)} rows both ran: autofit mean |error| "
                         f"{statistics.fmean(abs(_err(r.autofit, r.measured)) for r in both):.2f}%, MemTracker "
                         f"{statistics.fmean(abs(_err(r.memtracker.peak_bytes, r.measured)) for r in both):.2f}%")
    autofit_s = [r.autofit_s for r in measured if r.autofit is not None]
    if autofit_s:
        lines.append(f"{'time':<10} autofit {sum(autofit_s):.1f} s in all (slowest {max(autofit_s):.1f} s)"
                     + (f", MemTracker {sum(r.memtracker.seconds for r in tracked):.1f} s" if tracked else ""))
    return lines


def load_zoo() -> dict[str, Callable]:
    try:
        from zoo import ZOO  # tests/zoo.py
    except ImportError as e:
        raise SystemExit(f"cannot import tests/zoo.py ({e}); the benchmark runs over its ZOO of cases") from e
    return ZOO


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated case names (default: all of tests/zoo.py's ZOO)")
    parser.add_argument("--optimizer", default="adam", help="optimizer name for every row (default: adam)")
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated (default: fp32,bf16)")
    parser.add_argument("--no-memtracker", action="store_true", help="skip PyTorch's MemTracker baseline")
    args = parser.parse_args(argv)

    zoo = load_zoo()
    names = list(zoo) if not args.cases else args.cases.split(",")
    unknown = [n for n in names if n not in zoo]
    if unknown:
        raise SystemExit(f"unknown case(s) {', '.join(unknown)}; the zoo has: {', '.join(zoo)}")
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; error = (estimate - measured) / measured; "
          "how: fake = fake tensors, real = data-dependent model run on the CPU")
    header = _line([c for c, _, _ in COLUMNS])
    print(header)
    print("-" * len(header), flush=True)
    rows: list[Row] = []
    start = time.perf_counter()
    for name in names:
        case = zoo[name]()
        for setting in _settings(case, args.optimizer, args.precisions.split(",")):
            row = run_row(case, setting, not args.no_memtracker)
            rows.append(row)
            print(format_row(row), flush=True)
    print("-" * len(header))
    for line in summary(rows):
        print(line)
    print(f"{'total':<10} {time.perf_counter() - start:.0f} s wall")


if __name__ == "__main__":
    main()
