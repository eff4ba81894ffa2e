"""Check autofit's CUDA memory model and time model on a real GPU: predicted against measured, configuration by
configuration.

For every case of ``tests/zoo.py`` plus a small Llama (``benchmarks/llama.py``), in fp32 and in bf16 autocast (fp16
where the GPU has no bf16), without and with the case's checkpointed modules, at two micro-batch sizes, one row
compares:

- alloc: the estimate's ``peak_allocated_bytes`` against ``torch.cuda.max_memory_allocated()`` over real
  steady-state steps of the emitted trainer (after warm-up steps, so the optimizer state exists; everything alive
  counts: weights, optimizer state, inputs, the cuBLAS workspace). The optimizer is torch's default on CUDA
  (foreach AdamW), as in the estimate;
- reserved: the estimate's ``peak_reserved_bytes`` (allocated plus the allocator's reserve) against
  ``torch.cuda.max_memory_reserved()``;
- device: ``device_bytes`` (reserved plus the CUDA context) against what the process holds on the GPU in all
  (NVML's per-process figure when ``pynvml`` is installed and sees this process; else reserved plus the context
  measured once at start-up);
- measure: ``autofit.measure(..., device="cuda").peak_bytes`` (autofit's own measurement:
  ``torch.cuda.max_memory_allocated()`` over its measured steps);
- time: the plan's ``predicted_step_seconds`` (``autofit.plan`` with the whole device as budget, this precision and
  checkpoint, ``batch_size`` = the micro-batch) against ``plan.wrap(...).step`` timed with CUDA events after warm-up.

Errors are (predicted - measured) / measured. Nothing is asserted: this is a report. Start-up lines give the GPU
autofit detects (``autofit.cuda.target.resolve_gpu(None)``), the CUDA context it measures against the model's
assumption, and how many cuBLAS workspaces the allocator holds (autofit assumes one per process).

    python benchmarks/gpu_validate.py                        # everything (~15 min: each row is also simulated)
    python benchmarks/gpu_validate.py --cases gpt_sdpa,llama # a subset ("llama" is the Llama case)
    python benchmarks/gpu_validate.py --no-time              # memory only
    python benchmarks/gpu_validate.py --clip-grad-norm 1.0   # with gradient clipping, as HF Trainer does

``pytest -m gpu`` (tests/test_gpu.py) runs the same rows for a few cases and asserts the design's tolerances.

Without a CUDA device it prints "no CUDA device: nothing to validate" and exits 0.
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import autofit  # noqa: E402
from autofit.training.batch import as_batch  # noqa: E402
from autofit.cuda.allocator import round_size  # noqa: E402
from autofit.cuda.model import context_bytes, cublas_workspace_bytes  # noqa: E402
from autofit.cuda.target import resolve_gpu  # noqa: E402
from autofit.training.optim import as_optimizer_spec  # noqa: E402
from autofit.core.units import format_bytes  # noqa: E402
from benchmarks.llama import Llama, LlamaConfig  # noqa: E402
from zoo import ZOO, ZooCase  # noqa: E402 - tests/zoo.py

OPTIMIZER = "adamw"
MiB = 1 << 20


# ---- the cases ---------------------------------------------------------------------------------------------------
def llama_case() -> ZooCase:
    """A small Llama (4 layers, hidden 256, 4 heads of 64: flash attention on sm80+), next-token loss."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8000, hidden_size=256, intermediate_size=688, num_layers=4, num_heads=4,
                      max_seq_len=512)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), target[:, 1:].flatten())

    return ZooCase("llama", Llama(cfg), ids, ids.clone(), checkpoint=tuple(f"layers.{i}" for i in range(4)),
                   loss_fn=loss_fn, micro_batch_size=2)


def cases(names: list[str] | None) -> dict[str, Any]:
    factories: dict[str, Any] = dict(ZOO)
    factories["llama"] = llama_case
    if names:
        unknown = sorted(set(names) - set(factories))
        if unknown:
            raise SystemExit(f"unknown case(s) {', '.join(unknown)}: choose from {', '.join(factories)}")
        factories = {n: factories[n] for n in names}
    return factories


# ---- what the process holds on the device ------------------------------------------------------------------------
class DeviceMemory:
    """The process's device memory: NVML's per-process figure when NVML lists this process, else the device's used
    memory (``torch.cuda.mem_get_info``) minus what was in use before this process touched the GPU (read through
    NVML before CUDA is initialised; 0 without ``pynvml``, i.e. the GPU is assumed to be otherwise idle).

    Create it before anything initialises CUDA in this process (``torch.cuda.is_available()`` does not)."""

    def __init__(self) -> None:
        self.nvml = None
        self.used_before: dict[str, int] = {}  # device UUID -> bytes in use before this process's context
        self.handle = None
        self.others = 0
        self.how = "mem_get_info (no pynvml: assumes no other process uses the GPU)"
        try:
            import pynvml

            pynvml.nvmlInit()
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = pynvml.nvmlDeviceGetUUID(handle)
                uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
                self.used_before[uuid] = pynvml.nvmlDeviceGetMemoryInfo(handle).used
            self.nvml = pynvml
        except Exception:  # noqa: BLE001 - no pynvml or no NVML: fall back to mem_get_info alone
            self.nvml = None

    def attach(self, device: torch.device) -> None:
        """Find this process's device in NVML (after CUDA is initialised: CUDA_VISIBLE_DEVICES renumbers devices)."""
        if self.nvml is None:
            return
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
        try:
            self.handle = self.nvml.nvmlDeviceGetHandleByUUID(uuid)
            self.others = self.used_before.get(uuid, 0)
            self.how = "mem_get_info minus the device's use before start-up (NVML)"
        except Exception:  # noqa: BLE001 - MIG slices and some containers hide the UUID
            self.nvml = None

    def process_bytes(self) -> int:
        if self.nvml is not None:
            try:
                for proc in self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
                    if proc.pid == os.getpid() and proc.usedGpuMemory:
                        self.how = "NVML, this process"
                        return int(proc.usedGpuMemory)
            except Exception:  # noqa: BLE001 - containers often hide pids or the figure: fall back
                pass
        free, total = torch.cuda.mem_get_info()
        return total - free - self.others


def warm_up_libraries(device: torch.device) -> None:
    """Load what the first steps would load anyway (cuBLAS and cuDNN handles, their workspaces, lazy kernels), so
    that the context measured next is the one the steps run with."""
    for dtype in (torch.float32, torch.float16):
        a = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
        (a @ a).sum().backward()
        x = torch.randn(2, 3, 8, 8, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(4, 3, 3, 3, device=device, dtype=dtype, requires_grad=True)
        F.conv2d(x, w).sum().backward()
    torch.cuda.synchronize(device)
    del a, x, w
    gc.collect()


def cublas_workspaces(workspace: int) -> int:
    """Blocks of exactly the cuBLAS workspace's size that the allocator holds (one per cuBLAS handle and stream:
    CublasHandlePool.cpp keys them by (handle, stream); autograd's backward thread has its own handle)."""
    size = round_size(workspace)
    return sum(1 for segment in torch.cuda.memory_snapshot() for block in segment["blocks"]
               if block["state"] == "active_allocated" and block["size"] == size)


# ---- one configuration -------------------------------------------------------------------------------------------
@dataclass
class Row:
    case: str
    precision: str
    checkpointed: bool
    micro: int
    est_alloc: int = 0
    est_reserved: int = 0
    est_device: int = 0
    alloc: int = 0
    reserved: int = 0
    device: int = 0
    measured: int = 0  # autofit.measure
    predicted_s: float = float("nan")
    measured_s: float = float("nan")
    note: str = ""


def _on(device: torch.device, value: Any) -> Any:
    return None if value is None else as_batch(value).map_tensors(lambda t: t.to(device)).value


def _resized(value: Any, rows: int, what: str) -> Any:
    return None if value is None else as_batch(value, what=what).resize(rows).value


def run_config(case: ZooCase, precision: str, checkpoint: tuple[str, ...], micro: int, *, steps: int, time_it: bool,
               memory: DeviceMemory, context: int, device: torch.device, clip_grad_norm: float | None = None) -> Row:
    row = Row(case.name, precision, bool(checkpoint), micro)
    common = dict(target=case.target, loss_fn=case.loss_fn, optimizer=OPTIMIZER, precision=precision,
                  device="cuda",
                  step=autofit.Step(micro_batch_size=micro, checkpoint=checkpoint, clip_grad_norm=clip_grad_norm))
    est = autofit.estimate(case.model, case.sample, **common)
    row.est_alloc, row.est_reserved, row.est_device = est.peak_allocated_bytes, est.peak_reserved_bytes, \
        est.device_bytes

    meas = autofit.measure(case.model, case.sample, steps=2, **common)
    row.measured = meas.peak_bytes
    _release()

    plan = autofit.plan(case.model, case.sample, "100%", batch_size=micro, target=case.target,
                        loss_fn=case.loss_fn, optimizer=OPTIMIZER, precision=precision,
                        device="cuda", clip_grad_norm=clip_grad_norm,
                        savers=autofit.Savers(checkpoint=checkpoint or None))
    row.predicted_s = plan.predicted_step_seconds
    if (plan.micro_batch_size, plan.gradient_accumulation_steps) != (micro, 1):
        row.note = f"plan chose {plan.micro_batch_size}x{plan.gradient_accumulation_steps}"

    model = copy.deepcopy(case.model).to(device)
    optimizer = as_optimizer_spec(OPTIMIZER).build(model.parameters())
    trainer = plan.wrap(model, optimizer, loss_fn=case.loss_fn)
    inputs = _on(device, _resized(case.sample, micro, "sample"))
    target = _on(device, _resized(case.target, micro, "target"))
    try:
        for _ in range(2):  # warm-up: optimizer state, autotuning, lazily loaded kernels
            trainer.step(inputs, target)
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps if time_it else 1):
            trainer.step(inputs, target)
        end.record()
        torch.cuda.synchronize(device)
        row.alloc = torch.cuda.max_memory_allocated(device)
        row.reserved = torch.cuda.max_memory_reserved(device)
        row.device = memory.process_bytes() if memory.nvml is not None else row.reserved + context
        if time_it:
            row.measured_s = start.elapsed_time(end) / 1000 / steps
    finally:
        trainer.unwrap()
        del model, optimizer, trainer, inputs, target
        _release()
    return row


def _release() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the next configuration starts from the workspace's segments only


# ---- the report --------------------------------------------------------------------------------------------------
def _error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured if measured else float("nan")


HEADER = (f"{'case':<15} {'prec':<4} {'ckpt':<4} {'mb':>3} | {'alloc est':>10} {'max_alloc':>10} {'err':>7} | "
          f"{'resv est':>10} {'max_resv':>10} {'err':>7} | {'dev est':>10} {'device':>10} {'err':>7} | "
          f"{'measure()':>10} | {'pred s':>8} {'meas s':>8} {'ratio':>6}")


def format_row(r: Row) -> str:
    def mib(n: int) -> str:
        return f"{n / MiB:10.1f}"

    def pct(p: float, m: float) -> str:
        return f"{100 * _error(p, m):+6.1f}%"

    ratio = r.predicted_s / r.measured_s if r.measured_s == r.measured_s and r.measured_s else float("nan")
    return (f"{r.case:<15} {r.precision:<4} {'yes' if r.checkpointed else 'no':<4} {r.micro:>3} | "
            f"{mib(r.est_alloc)} {mib(r.alloc)} {pct(r.est_alloc, r.alloc)} | "
            f"{mib(r.est_reserved)} {mib(r.reserved)} {pct(r.est_reserved, r.reserved)} | "
            f"{mib(r.est_device)} {mib(r.device)} {pct(r.est_device, r.device)} | {mib(r.measured)} | "
            f"{r.predicted_s:8.4f} {r.measured_s:8.4f} {ratio:6.2f}" + (f"  {r.note}" if r.note else ""))


def summary(rows: list[Row]) -> list[str]:
    def med(values: list[float]) -> str:
        values = [abs(v) for v in values if v == v]
        return f"{100 * statistics.median(values):.1f} %" if values else "n/a"

    lines = [f"median |error| over {len(rows)} configurations (sizes in MiB above):",
             f"  max_memory_allocated  {med([_error(r.est_alloc, r.alloc) for r in rows])}",
             f"  max_memory_reserved   {med([_error(r.est_reserved, r.reserved) for r in rows])}",
             f"  device total          {med([_error(r.est_device, r.device) for r in rows])}"]
    ratios = [r.predicted_s / r.measured_s for r in rows if r.measured_s == r.measured_s and r.measured_s]
    if ratios:
        lines.append(f"  step time: predicted / measured, median {statistics.median(ratios):.2f} "
                     f"(range {min(ratios):.2f} to {max(ratios):.2f}; the time model ranks, it is not a stopwatch)")
    return lines


def open_device() -> tuple[DeviceMemory, torch.device, int]:
    """(memory reader, device, measured CUDA context bytes), with cuBLAS/cuDNN loaded. Call it before anything
    initialises CUDA in this process, so NVML can tell the device's use before this process's context."""
    memory = DeviceMemory()
    device = torch.device("cuda", torch.cuda.current_device())
    memory.attach(device)
    warm_up_libraries(device)
    _release()
    context = memory.process_bytes() - torch.cuda.memory_reserved(device)
    return memory, device, context


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", help="comma-separated case names (zoo names, or llama); default: all")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration (default: 10)")
    parser.add_argument("--no-time", action="store_true", help="skip the step-time comparison")
    parser.add_argument("--clip-grad-norm", type=float, default=None,
                        help="clip gradients to this norm in the step (HF Trainer: 1.0); default: no clipping")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to validate")
        return 0
    warnings.filterwarnings("ignore")
    memory, device, context = open_device()
    spec, note = resolve_gpu(None)
    props = torch.cuda.get_device_properties(device)
    print(f"device: {props.name}, {format_bytes(props.total_memory)}, sm {props.major}.{props.minor}; "
          f"autofit models it as {spec.name} ({spec.source})" + (f"; {note}" if note else ""))

    print(f"CUDA context (with cuBLAS/cuDNN loaded): measured {format_bytes(context)} by {memory.how}; "
          f"autofit assumes {format_bytes(context_bytes())} (set AUTOFIT_CUDA_CONTEXT_MIB={context / MiB:.0f} "
          "to use the measured value)")
    workspace = cublas_workspace_bytes(spec)
    print(f"cuBLAS workspaces held by the allocator: {cublas_workspaces(workspace)} x {workspace:,} bytes "
          "(autofit counts one)")
    precisions = ["fp32", "bf16" if spec.supports_bf16 else "fp16"]
    print(f"optimizer {OPTIMIZER}; precisions {', '.join(precisions)}; sizes in MiB\n")

    print(HEADER)
    print("-" * len(HEADER))
    rows: list[Row] = []
    for name, factory in cases(args.cases.split(",") if args.cases else None).items():
        case = factory()
        for precision in precisions:
            for checkpoint in ((), case.checkpoint):
                for micro in (case.micro_batch_size, 4 * case.micro_batch_size):
                    try:
                        row = run_config(case, precision, checkpoint, micro, steps=args.steps,
                                         time_it=not args.no_time, memory=memory, context=context, device=device,
                                         clip_grad_norm=args.clip_grad_norm)
                    except Exception as e:  # noqa: BLE001 - a report goes on past one failing configuration
                        _release()
                        print(f"{name:<15} {precision:<4} {'yes' if checkpoint else 'no':<4} {micro:>3} | "
                              f"error: {type(e).__name__}: {e}", flush=True)
                        continue
                    rows.append(row)
                    print(format_row(row), flush=True)
    print()
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
