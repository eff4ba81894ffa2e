"""The Target stage: the device a plan targets (the CPU or one catalog GPU), resolved once per request, and the one
place its memory model is applied to what the simulation saw.

- :meth:`DeviceTarget.estimate`: a simulated step -> the :class:`MemoryEstimate` for this device (on CUDA the caching
  allocator, cuBLAS workspace and context of ``autofit.cuda.model``; on the CPU the allocator's own peak);
- :meth:`DeviceTarget.memory_terms`: the same model as a linear calibration the planner's memory model applies to
  every candidate without simulating it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import ClassVar

from autofit.core.categories import Category
from autofit.core.cpu import cpu_kernels
from autofit.core.errors import InvalidInputError
from autofit.core.report import EXPANDABLE_SEGMENTS, MemoryEstimate
from autofit.simulate.run import Simulation
from autofit.simulate.timeline import Phase, host_replay
from autofit.core.units import format_bytes

__all__ = ["DeviceTarget", "CPUTarget", "CUDATarget", "DeviceTerms", "Throughput", "CPU", "resolve_device",
           "NCCL_RESERVE_BYTES"]


@dataclass(frozen=True, kw_only=True)
class Throughput:
    """What the device does per second, by precision name ("fp32", "bf16", "fp16")."""

    name: str
    flops_per_second: Mapping[str, float]
    bytes_per_second: float  # memory bandwidth
    op_overhead_seconds: float  # fixed cost of launching one op
    saturation_flops: float = 0.0  # FLOPs per op at which the device reaches half its peak (0: always at peak)
    # host <-> device bytes per second per direction (PCIe, what offloading pays); None where host and device are one
    # memory (the CPU), so there is nothing to offload to
    host_transfer_bytes_per_second: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "flops_per_second", MappingProxyType(dict(self.flops_per_second)))


# A nominal CPU, compute-bound (bandwidth infinite: caches hide most memory traffic at these sizes, so ops without
# FLOPs cost only their launch, and the optimizer step costs nothing). Autocast to bf16/fp16 adds casts and does not
# speed up most CPU kernels, so low precision ranks slower per op (bf16 0.8x, fp16 0.5x the fp32 rate) and is chosen
# only when the memory it saves buys a faster configuration (a larger micro-batch, less recomputation). No knee:
# every op runs at the nominal rate. The absolute numbers only scale the printed seconds.
CPU = Throughput(
    # fp8: the CPU's _scaled_mm widens its float8 operands first (no float8 arithmetic on CPUs), ranked as fp16
    name="cpu", flops_per_second={"fp32": 1.0e11, "bf16": 0.8e11, "fp16": 0.5e11, "fp8": 0.5e11},
    bytes_per_second=float("inf"),
    op_overhead_seconds=1.0e-5,
)

@dataclass(frozen=True)
class DeviceTerms:
    """``device_bytes = scale * tensor_bytes + constant``: what the device adds to the tensors of a step, as the
    planner's memory model applies it (CPU: scale 1, constant 0)."""

    scale: float = 1.0
    constant: int = 0


# Note [expandable segments as a plan knob]
#     Under the default caching allocator a budget can fail that the step's blocks in use would fit: a live block
#     pins its whole segment, and which segments end up pinned depends on the history, so a smaller micro-batch can
#     need a larger budget (Llama-2-7B on an H200, fp16: 128.81 GiB at batch 1, 126.50 at batch 4, all of it the
#     optimizer step's 125.54 GiB allocated plus pinned segments; benchmarks/verdict_floors.py).
#     ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` maps pages on demand and unmaps free ones when a map fails
#     (Note [expandable segments], autofit/cuda/expandable.py), so what a budget must hold is close to the pages the
#     live blocks touch. It changes no number of the step, so it needs no opt-in: a configuration whose default
#     replay fails under the budget is replayed with it (``_under``), the smallest budget is the lower of the two
#     (``estimate``: the expandable replay is bisected only where the default floor leaves more than a page of
#     reserve), and the plan carries the setting (``MemoryEstimate.alloc_conf`` -> ``Plan.alloc_conf``) into
#     ``str(plan)``, the CLI, the JSON, the trainer (which sets it before the step allocates, or refuses) and the
#     exports (a note: they cannot set it). It is a knob of the verdict at a budget rather than a rung of the ladder
#     (Note [the ladder]): it changes only how the allocator places the same timeline, so it needs no new analysis
#     or search, and it applies to every rung's verified winner alike. It lowers the floors but does not make them
#     monotone in the batch (Note [the smallest budget], autofit/solve/verify.py, has the figures and the reason);
#     the gradients allocated before forward do (Note [gradients before forward as a plan knob],
#     autofit/solve/estimator.py), and where both are needed a plan sets both.
#     Not the default: plans that fit under the default allocator are unchanged. torchtitan's launcher sets it for
#     every run (``run_train.sh``: ``PYTORCH_ALLOC_CONF="expandable_segments:True"``, the device-generic name of
#     ``PYTORCH_CUDA_ALLOC_CONF`` that recent PyTorch reads too), but PyTorch keeps
#     it off by default: CUDA graph private pools do not use it (``alloc_block``: ``!p.pool->owner_PrivatePool``),
#     memory shared by CUDA IPC (``torch.multiprocessing``) needs plain segments, and a plan should change the
#     user's process only where the budget needs it.

# Note [expandable segments as an input]
#     A run that already sets the allocator (torchtitan's launcher, every published torchtitan row) is estimated as it
#     runs: ``Device(expandable_segments=True)`` (``estimate``, ``measure``, ``plan``; the CLI's
#     ``--expandable-segments``) replays the step's timeline with expandable segments throughout (Note [expandable
#     segments], autofit/cuda/expandable.py): reserved is the pages mapped at the high-water mark instead of the
#     plain segments that pinned blocks keep, and the estimate's ``alloc_conf`` says so. ``False``: the default
#     allocator, and a plan may not set it. ``None`` (the default): the default allocator for ``estimate`` and
#     ``measure``, and a plan sets it only where only it fits (Note [expandable segments as a plan knob]). The
#     setting changes no tensor of the step, only where the allocator places them, so the simulation is the same;
#     ``measure`` on a GPU puts it in place before the step allocates, as the trainer does
#     (autofit/features/allocator.py), and refuses where CUDA memory came first. The CPU has no caching allocator:
#     True is refused there.
_PAGE = 20 << 20  # kLargeBuffer: the expandable segment's page in the large pool

# NCCL's buffers per communicator, outside the caching allocator: the default margin of a multi-GPU plan (Note [the
# margin], autofit/validate.py)
NCCL_RESERVE_BYTES = 2 * 32 * 4 * 2**20

_PHASE_NAMES = {Phase.SETUP: "start", Phase.FORWARD: "forward", Phase.BACKWARD: "backward",
                Phase.OPTIMIZER: "optimizer"}


@dataclass(frozen=True)
class DeviceTarget:
    """The device a plan targets: :class:`CPUTarget` or :class:`CUDATarget` (a catalog GPU, ROCm included). The stages
    ask the target what they need to know of the device, through the methods and the class attributes below, and never
    compare its name: a new kind of device is one more subclass here."""

    kind: ClassVar[str]  # the name users and plans read ("cpu", "cuda"): StepConfig.device, MemoryEstimate.device
    # the auto precision climbs precisions as rungs: the fastest compute precision alone first, then each lower
    # stored precision (Note [stored precision], solve/ladder.py); on the CPU, fp32 leads and bf16 is one more choice
    precision_rungs: ClassVar[bool]
    host_offload: ClassVar[bool]  # the states may be offloaded to the host's memory (Note [offload])
    # device memory is the caching allocator's segments: the gradients allocated before forward may need fewer
    caching_allocator: ClassVar[bool]
    # the optimizers step with foreach kernels by default, which cannot mix DTensors and plain tensors (StepConfig)
    foreach_optimizers: ClassVar[bool]
    # the simulation runs this device's own kernels: they are probed (Note [CPU kernels]), and every figure of the
    # estimate is a tensor figure, which cut depths extrapolate (Note [cutting every run], solve/estimator.py)
    own_kernels: ClassVar[bool]

    total_bytes: int | None  # what "90%" budgets are a share of
    throughput: Throughput
    name: str | None = None  # the GPU model, e.g. "A100-80GB"
    supports_bf16: bool = True
    gpu: object | None = None  # the GPUSpec of a CUDA target
    note: str | None = None  # an assumption the plan should state (e.g. the default GPU)
    interconnect_bytes_per_second: float = 5e9  # between ranks (CPU processes: gloo over shared memory / TCP)
    network_bytes_per_second: float = 5e9  # between nodes, per rank (GPUs: the catalog's network figure)
    local: bool = True  # the target is this machine (the CPU, or the GPU detected here): its RAM is the host's
    # the caching allocator runs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (True) or without it (False);
    # None: without it, and a plan sets it where only it fits the budget (Note [expandable segments as an input])
    expandable_segments: bool | None = None

    def default_precisions(self) -> tuple[str, ...]:
        """"auto" precision, fastest first (the order the quick path and the search's tie-break use). On the CPU
        the time model rates bf16 at 0.8x and fp16 at 0.5x the fp32 FLOP rate (autocast adds casts and does not
        speed most CPU kernels up), so fp32 leads and bf16 wins only when the memory it saves buys a faster
        configuration: a larger micro-batch, or less recomputation. GPUs without bf16 (V100, T4) get fp16."""
        raise NotImplementedError

    @property
    def capacity_bytes(self) -> int | None:
        """The memory a budget may not exceed: a card's; None where a budget is only a share of the machine's."""
        return None

    def collective_reserve_bytes(self, world_size: int) -> int:
        """The default margin on ``world_size`` ranks: the collectives' buffers outside the allocator (Note [the
        margin], autofit/validate.py)."""
        return 0

    def auto_precision_notes(self) -> list[str]:
        """What precision="auto" leaves out on this device, for the plan's notes."""
        return []

    def estimate(self, sim: Simulation) -> MemoryEstimate:
        """The estimate of one simulated step on this device."""
        raise NotImplementedError

    def _peak(self, sim: Simulation) -> tuple[str, str]:
        """The phase and the op of ``sim``'s peak, in words."""
        ops = sim.timeline.ops
        at = ""
        if 0 <= sim.replay.peak_op < len(ops):
            op = ops[sim.replay.peak_op]
            at = f"{op.name} in {op.module or 'top level'}"
        phase = _PHASE_NAMES[sim.replay.peak_phase]
        return phase, at

    def simulation_rules(self, stack, config):
        """This device's part of a simulation (``simulate_step(device_rules=...)``): on CUDA, CUDA's autocast op
        policy, attention kernels and composite ops' CUDA branches on the CPU simulation (``autofit.cuda``). Returns
        the autocast caster whose weight cache must be cleared when each micro-batch's autocast region exits, or
        None."""
        return None

    @property
    def simulation_key(self) -> tuple | None:
        """What of this device a simulation reads (its ``simulation_rules``): targets with the same key simulate the
        same step alike (Note [one analysis for several cards], autofit/core/shared.py); None: not shared."""
        return None

    def memory_terms(self, analysis, rows: int) -> DeviceTerms:
        """CUDA: calibrate ``device_bytes = scale * tensor_bytes + constant`` on the analysed window with every tensor
        sized for ``rows`` (sizes are linear in the micro-batch, see analyse/profile.py). The constant is the cuBLAS
        workspace and the context; the scale (allocator rounding and fragmentation) comes from replaying the caching
        allocator over that window, as the smallest budget it runs under (Note [the smallest budget], solve/verify.py):
        what the verification checks a budget against. Calibrated on what a card with room to spare would reserve,
        the search found nothing at the 70B plan's 74 GiB (x 1.32 on its tensors), whose verified step runs under
        72 GiB with the allocator freeing cached segments (benchmarks/multi_gpu_70b.py)."""
        return DeviceTerms()


@dataclass(frozen=True)
class CPUTarget(DeviceTarget):
    """This machine's CPU: the simulation's allocator is the target's own."""

    kind: ClassVar[str] = "cpu"
    precision_rungs: ClassVar[bool] = False
    host_offload: ClassVar[bool] = False
    caching_allocator: ClassVar[bool] = False
    foreach_optimizers: ClassVar[bool] = False
    own_kernels: ClassVar[bool] = True

    def default_precisions(self) -> tuple[str, ...]:
        # bf16 only where this CPU's oneDNN has bf16 kernels (Note [CPU kernels])
        return ("fp32", "bf16") if self.supports_bf16 else ("fp32",)

    def auto_precision_notes(self) -> list[str]:
        """bf16 left out where this CPU's oneDNN has no bf16 kernels (Note [CPU kernels], autofit/core/cpu.py): its
        bf16 matmuls run ATen's slow fallback, and its LSTM cannot run at all."""
        if self.supports_bf16:
            return []
        return [f"precision 'auto' considered fp32 only: this CPU is {cpu_kernels().describe()}, and oneDNN runs bf16 "
                "only on CPUs with AVX-512; pass precision='bf16' to plan bf16 autocast anyway"]

    def estimate(self, sim: Simulation) -> MemoryEstimate:
        phase, at = self._peak(sim)
        return MemoryEstimate(peak_bytes=sim.replay.peak_bytes, breakdown=sim.replay.breakdown, device=self.kind,
                              peak_phase=phase, peak_at=at, method=sim.method, notes=sim.notes,
                              preallocated_grads=sim.preallocated_grads, input_rows=sim.input_rows,
                              rank_peaks=sim.rank_peaks)


@dataclass(frozen=True)
class CUDATarget(DeviceTarget):
    """One catalog GPU (ROCm's too: the same caching allocator through HIP): the CUDA memory model of
    ``autofit.cuda`` applied to the CPU simulation."""

    kind: ClassVar[str] = "cuda"
    precision_rungs: ClassVar[bool] = True
    host_offload: ClassVar[bool] = True
    caching_allocator: ClassVar[bool] = True
    foreach_optimizers: ClassVar[bool] = True
    own_kernels: ClassVar[bool] = False

    def default_precisions(self) -> tuple[str, ...]:
        return ("bf16", "fp32") if self.supports_bf16 else ("fp16", "fp32")

    @property
    def capacity_bytes(self) -> int | None:
        return self.total_bytes

    def collective_reserve_bytes(self, world_size: int) -> int:
        return NCCL_RESERVE_BYTES if world_size > 1 else 0

    def estimate(self, sim: Simulation) -> MemoryEstimate:
        phase, at = self._peak(sim)
        host, host_breakdown = host_replay(sim.timeline)
        from autofit.cuda.model import cuda_memory, cudnn_workspace_note, smallest_device_bytes

        expandable = bool(self.expandable_segments)  # Note [expandable segments as an input]
        peak, device_bytes, breakdown = cuda_memory(sim.timeline, sim.replay, self.gpu, expandable=expandable)
        notes = sim.notes + tuple(n for n in (self.note, cudnn_workspace_note(sim.timeline)) if n)
        reserved = device_bytes - breakdown[Category.CUDA_CONTEXT]  # cuda_memory: reserved + context
        floor = min(device_bytes, smallest_device_bytes(sim.timeline, self.gpu, expandable=expandable))
        # segments pinned: pages may need fewer, where the setting is still open
        if self.expandable_segments is None and floor - peak > breakdown[Category.CUDA_CONTEXT] + _PAGE:
            floor = min(floor, smallest_device_bytes(sim.timeline, self.gpu, expandable=True))
        est = MemoryEstimate(peak_bytes=peak, breakdown=breakdown, device="cuda", device_bytes=device_bytes,
                             peak_reserved_bytes=reserved, peak_phase=phase, peak_at=at, method=sim.method,
                             notes=notes, host_bytes=host, host_breakdown=host_breakdown, min_device_bytes=floor,
                             preallocated_grads=sim.preallocated_grads, input_rows=sim.input_rows,
                             alloc_conf=EXPANDABLE_SEGMENTS if expandable else "", rank_peaks=sim.rank_peaks)
        return replace(est, under=lambda budget: self._under(sim, est, budget))

    def _under(self, sim: Simulation, est: MemoryEstimate, budget: int) -> MemoryEstimate | None:
        """``est`` when the process may hold only ``budget`` device bytes (below ``est.device_bytes``): the caching
        allocator frees cached segments to stay under it (Note [allocating under a cap], autofit/cuda/allocator.py),
        and where that still runs out of memory, the same step with expandable segments (Note [expandable segments
        as a plan knob]); None when neither runs."""
        from autofit.cuda.model import cuda_memory_under

        expandable = bool(self.expandable_segments)
        under = cuda_memory_under(sim.timeline, sim.replay, self.gpu, budget, expandable=expandable)
        conf = EXPANDABLE_SEGMENTS if expandable else ""
        if under is not None:
            peak, device_bytes, breakdown, released = under
            note = (f"under {format_bytes(budget)} the caching allocator frees {released} cached segment(s) when a "
                    f"new one would not fit (cudaFree, then retry: release_cached_blocks), so the process holds "
                    f"{format_bytes(device_bytes)}; on a card with room to spare it would keep them, "
                    f"{format_bytes(est.device_bytes)}")
        elif self.expandable_segments is not None:  # the setting is the user's: nothing else to try
            return None
        else:
            under = cuda_memory_under(sim.timeline, sim.replay, self.gpu, budget, expandable=True)
            if under is None:
                return None
            peak, device_bytes, breakdown, released = under
            conf = EXPANDABLE_SEGMENTS
            note = (f"under {format_bytes(budget)} the default caching allocator runs out of memory (blocks in use "
                    f"pin segments it cannot free); with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True it maps "
                    f"pages on demand and unmaps free ones, and the process holds {format_bytes(device_bytes)}: "
                    f"the plan sets it (Note [expandable segments as a plan knob])")
        return replace(est, peak_bytes=peak, device_bytes=device_bytes, breakdown=breakdown,
                       peak_reserved_bytes=device_bytes - breakdown[Category.CUDA_CONTEXT], notes=est.notes + (note,),
                       alloc_conf=conf)

    @property
    def simulation_key(self) -> tuple | None:
        from autofit.cuda.kernels import kernel_key

        return ("cuda", kernel_key(self.gpu))

    def simulation_rules(self, stack, config):
        from autofit.cuda.autocast_policy import cuda_autocast_policy
        from autofit.cuda.device_paths import cuda_paths
        from autofit.cuda.kernels import cuda_kernels

        stack.enter_context(cuda_kernels(self.gpu))
        stack.enter_context(cuda_paths())
        if config.precision.autocast:
            return stack.enter_context(cuda_autocast_policy(config.precision.dtype, require_clear=True))
        return None

    def memory_terms(self, analysis, rows: int) -> DeviceTerms:
        from autofit.analyse.analyse import SIZES
        from autofit.analyse.profile import timeline_at
        from autofit.cuda.model import context_bytes, cublas_workspace_bytes, smallest_device_bytes
        from autofit.simulate.timeline import replay

        timeline = timeline_at(analysis.timeline, analysis.timeline_next, SIZES[0], rows)
        raw = replay(timeline)
        device_bytes = smallest_device_bytes(timeline, self.gpu)
        constant = context_bytes() + cublas_workspace_bytes(self.gpu)
        if len(analysis.profile.intercepts) > len(timeline.events):  # Note [the reserve of an extended analysis]
            whole = int(analysis.profile.live(rows).max())
            return DeviceTerms(scale=max(1.0, 1 + (device_bytes - constant - raw.peak_bytes) / max(whole, 1)),
                               constant=constant)
        return DeviceTerms(scale=max(1.0, (device_bytes - constant) / max(raw.peak_bytes, 1)), constant=constant)


    # Note [the reserve of an extended analysis]
    #     An analysis extended in depth (Note [extending an analysis in depth], analyse/depth.py) keeps the cut
    #     model's timeline: the allocator can only be replayed over the window of a few blocks. As a ratio, that
    #     window's reserve overstates the whole model's (the 70B shape: x 1.32 on 3 blocks, x 1.19 on all 80; the 8B
    #     Llama on 8 A100s planned 5.33 s a step with the ratio, 5.09 s simulated whole), because the reserve of the
    #     few blocks' transients and the states' rounding does not grow with the blocks' retained activations. The
    #     cut window's reserve in bytes is carried instead, over the whole window's tensors: a lower bound where the
    #     reserve grows with the depth. A model that is too optimistic only costs verifications (each winner is
    #     verified by a full estimate, solve/verify.py); one too pessimistic never tries the plans it rules out.

def _host_memory() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def resolve_device(device: str, gpu: str | None = None, expandable_segments: bool | None = None) -> DeviceTarget:
    """The target of ``device`` ("cpu" or "cuda") and ``gpu``; ``expandable_segments``: the CUDA caching allocator's
    setting the step runs with (Note [expandable segments as an input])."""
    kind = str(device).split(":")[0]
    if expandable_segments not in (None, True, False):
        raise InvalidInputError(f"expandable_segments must be True, False or None (the default allocator; a plan "
                                f"sets it where only it fits), got {expandable_segments!r}")
    if kind == "cpu":
        if gpu is not None:
            raise InvalidInputError("gpu= names a GPU model; it only applies with device='cuda'")
        if expandable_segments:
            raise InvalidInputError("expandable_segments=True is a setting of the CUDA caching allocator, which the "
                                    "CPU does not have: leave it out, or estimate for a GPU (device='cuda' or a "
                                    "catalog GPU)")
        return CPUTarget(_host_memory(), CPU, supports_bf16=cpu_kernels().native("bf16"))
    if kind == "cuda":
        return replace(_cuda(gpu), expandable_segments=expandable_segments)
    raise InvalidInputError(f"device must be 'cpu' or 'cuda', got {device!r}")


ROCM_NOTE = ("ROCm target: PyTorch's ROCm build runs the same caching allocator through HIP, so its rounding and "
             "segments are modelled as on CUDA, with ROCm's hipBLAS and hipBLASLt workspaces; the HIP context is "
             "assumed as large as a CUDA one (measure it and set AUTOFIT_CUDA_CONTEXT_MIB), and flash attention's "
             "scratch as CUDA's flash kernel's (docs/cuda.md, \"ROCm targets\")")


def _cuda(gpu) -> CUDATarget:
    from autofit.cuda.target import resolve_target_gpu

    spec, note, local = resolve_target_gpu(gpu)
    if spec.platform == "rocm":
        note = "; ".join(n for n in (note, ROCM_NOTE) if n)
    # fp32 matmuls run on fp32 cores: PyTorch's default torch.backends.cuda.matmul.allow_tf32 is False
    throughput = Throughput(
        name=spec.name,
        # fp8: the dense FP8 tensor rate (cards.py cites each), at which torchao's _scaled_mm runs; a card without
        # one refuses float8 before anything is priced (require_fp8, features/float8.py)
        flops_per_second={"fp32": spec.fp32_flops, "bf16": spec.bf16_flops or spec.fp32_flops,
                          "fp16": spec.fp16_flops, "fp8": spec.fp8_flops or spec.fp32_flops},
        bytes_per_second=spec.bandwidth,
        op_overhead_seconds=5e-6,  # kernel launch plus dispatcher, a few microseconds per op
        saturation_flops=2e9 * spec.fp16_flops / 312e12,  # see docs/planner.md, "time model"
        host_transfer_bytes_per_second=spec.host_transfer,
    )
    return CUDATarget(spec.memory_bytes, throughput, name=spec.name, supports_bf16=spec.supports_bf16,
                      gpu=spec, note=note, interconnect_bytes_per_second=spec.interconnect,
                      network_bytes_per_second=spec.network, local=local)
