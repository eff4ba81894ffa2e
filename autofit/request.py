"""The request: what the user asked ``plan`` for, validated once into a frozen value every later stage reads.

Everything a stage could reject is checked here (model, sample and target, budget, batch and world size, strategy,
precision, optimizer, checkpoint names), so the stages after it take typed values and never re-validate.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from autofit.training.batch import Batch, as_batch
from autofit.training.chunked_loss import LossChunks, chunkable
from autofit.core.cpu import cpu_kernels
from autofit.device import DeviceTarget, resolve_device
from autofit.core.errors import InvalidInputError, require_int, require_layout, require_strategy
from autofit.training.length import length_spec
from autofit.training.loss import LossFn
from autofit.training.optim import OptimizerSpec, as_optimizer_spec, eight_bit_possible, eight_bit_spec
from autofit.training.precision import PRECISION_NAMES, PrecisionPolicy, as_policy
from autofit.training.step import StepConfig, make_step_config, resolve_modules
from autofit.core.units import format_bytes, parse_budget

__all__ = ["ALLOW_NAMES", "allow_names", "Parallel", "PlanRequest", "make_request", "check_model", "as_inputs", "check_capacity", "check_positions",
           "margin_for", "NCCL_RESERVE_BYTES"]


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """How one rank's step is distributed: no strategy (one process), DDP or FSDP2 over ``world_size`` ranks."""

    strategy: str | None = None
    world_size: int = 1
    shard_units: tuple[str, ...] = ()  # FSDP2: the modules fully_shard wraps before the root
    offload_states: bool = False  # FSDP2's CPUOffloadPolicy: parameters, gradients and state on the host
    # FSDP2 reduce-scatters after every micro-batch, not only the window's last (Note [gradient sync under
    # accumulation], autofit/training/step.py): the ladder's rung after the model's own dtype
    reduce_every_micro_batch: bool = False
    # FSDP2 layout (docs/multi-gpu.md): True ZeRO-3, False ZeRO-2, an int the group parameters are resharded to after
    # forward; replicate > 1: HSDP over a (replicate, world_size // replicate) mesh
    reshard_after_forward: bool | int = True
    replicate: int = 1
    gpus_per_node: int = 0  # ranks per node (their collectives run over NVLink); 0: all ranks on one node

    @property
    def label(self) -> str:
        """The layout in words: 'fsdp2 (ZeRO-3) over 8 ranks', 'hsdp 2 x 4 (ZeRO-2)', 'ddp'."""
        if self.strategy is None:
            return "one process"
        if self.strategy == "ddp":
            return "ddp"
        raf = self.reshard_after_forward
        zero = "ZeRO-3" if raf is True else "ZeRO-2" if raf is False else f"resharded to {raf}"
        if self.replicate > 1:
            return f"hsdp {self.replicate} x {self.world_size // self.replicate} ({zero})"
        return f"fsdp2 ({zero}) over {self.world_size} ranks"


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    """The validated inputs of ``plan``; built by :func:`make_request`."""

    model: nn.Module
    batch: Batch
    target: Batch | None
    loss_fn: LossFn | None
    device: DeviceTarget  # resolved once: the CPU or one catalog GPU
    budget_bytes: int  # what the user gave, per device
    margin_bytes: int  # kept free for what the estimate does not model (Note [the margin]); plans fit the rest
    batch_size: int  # effective batch, all ranks
    per_rank: int  # samples per rank per optimizer step
    world_size: int
    strategies: tuple[str | None, ...]  # to plan, in order; the fastest wins
    gpus_per_node: int = 0  # ranks per node (0: one node)
    reshard_options: tuple[bool | int, ...] = (True,)  # FSDP2 reshard_after_forward values to plan
    replicate_options: tuple[int, ...] = (1,)  # HSDP replicate sizes to plan (1: plain FSDP)
    policies: tuple[PrecisionPolicy, ...]  # allowed compute precisions, preferred first
    optimizer: OptimizerSpec
    fixed_checkpoint: tuple[str, ...] | None  # None: the planner chooses; a tuple: exactly these modules
    clip_grad_norm: float | None  # max_norm of clip_grad_norm_ before each optimizer step (None: no clipping)
    quick: bool  # try the quick path first (Note [the quick path], solve/quick.py)
    auto_precision: bool  # the first policy is the device's fastest ("auto", or a single policy)
    notes: tuple[str, ...] = ()
    # Stored precisions the planner may turn to when the model's own does not fit, in order of risk (Note [stored
    # precision], autofit/training/stored.py): each a policy whose ``stored`` is set
    stored_options: tuple[PrecisionPolicy, ...] = ()
    # plan(fp32_modules=...): what the user named, and the qualified names each resolved to
    pins: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # plan(fp32_modules="auto"): the final norm and the output head, pinned only when the plan still fits with them
    optional_pins: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # plan(offload=...): whether the planner may keep activations or states in host memory (Note [offload]); only
    # on a GPU, whose host link the time model prices. host_budget_bytes: the host memory a plan may pin.
    offload: bool = False
    host_budget_bytes: int | None = None
    # plan(checkpoint={name: policy}): (names, those recomputed selectively), as make_step_config reads them
    fixed_policies: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    # plan(allow=...): the opt-in rungs that change numerics (Note [the ladder]), each resolved for this model: the
    # chunks of a chunked loss, and the 8-bit twin of the optimizer with its dotted class name; None where the rung
    # was not allowed or does not apply (the notes say why)
    allow_chunked_loss: LossChunks | None = None
    allow_eight_bit: tuple[OptimizerSpec, str] | None = None
    closed_rungs: tuple[str, ...] = ()  # rungs that would apply here but were not allowed (the error says so)
    # what a rung of the ladder set for the step it searches: the chunked loss, and the 8-bit optimizer's class
    chunked_loss: LossChunks | None = None
    low_bit_optimizer: str | None = None

    @property
    def fit_bytes(self) -> int:
        """What a plan's estimate must fit: the budget less the margin."""
        return self.budget_bytes - self.margin_bytes

    def step(self, parallel: Parallel) -> StepConfig:
        """The step every configuration of this request shares at ``parallel``'s layout: the knobs the user fixed
        (optimizer, clipping, the target) and the layout's. A stage or a search candidate sets the rest (micro-batch,
        accumulation, precision, recomputation, offload, in-backward stepping) with ``dataclasses.replace``, so the
        whole step travels as one value through the analysis, the search and the full estimates."""
        return make_step_config(
            micro_batch_size=1, optimizer=self.optimizer, device=self.device.kind, held_rows=self.per_rank,
            gpu=self.device.name, strategy=parallel.strategy, world_size=parallel.world_size,
            shard_units=parallel.shard_units, clip_grad_norm=self.clip_grad_norm,
            offload_states=parallel.offload_states,
            reduce_every_micro_batch=parallel.reduce_every_micro_batch,
            reshard_after_forward=parallel.reshard_after_forward, replicate=parallel.replicate,
            chunked_loss=self.chunked_loss)

    @property
    def allow_checkpoint(self) -> bool:
        return self.fixed_checkpoint is None

    @property
    def fixed_selective(self) -> tuple[str, ...]:
        """Those of the user's fixed checkpoint set given as ``{name: "selective"}`` (autofit/training/recompute.py)."""
        return self.fixed_policies[1]

    @property
    def row_bytes(self) -> int:
        """Bytes one sample adds to the inputs and targets (batch tensors only)."""
        total = 0
        for b in (self.batch, self.target):
            if b is None:
                continue
            for t in b.tensors():
                if t.dim() >= 1 and t.shape[0] == b.size:
                    total += t[:1].nelement() * t.element_size()
        return total


def check_model(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise InvalidInputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    return model


def as_inputs(sample: Any, target: Any) -> tuple[Batch, Batch | None]:
    """The sample and target as batches with the same number of rows."""
    batch = as_batch(sample)
    if target is None:
        return batch, None
    target_batch = as_batch(target, what="target")
    if target_batch.size != batch.size:
        raise InvalidInputError(
            f"target has {target_batch.size} rows along dim 0 but the sample has {batch.size}: "
            "give one target row per sample row"
        )
    return batch, target_batch


def make_request(
    model: Any, sample: Any, budget: int | str, *, batch_size: int | None, target: Any, loss_fn: LossFn | None,
    optimizer: Any, precision: Any, checkpoint: Any, device: str, gpu: str | None, world_size: int,
    strategy: str | None, quick: bool, clip_grad_norm: float | None = None,
    min_stored_precision: str | None = None, fp32_modules: Any = None, offload: Any = "auto",
    host_budget: int | str | None = None, margin: int | str | None = None, allow_over_capacity: bool = False,
    gpus_per_node: int | None = None, reshard_after_forward: Any = "auto", replicate: Any = "auto", allow: Any = (),
) -> PlanRequest:
    model = check_model(model)
    batch, target_batch = as_inputs(sample, target)
    target_device = resolve_device(device, gpu)
    budget_bytes = parse_budget(budget, device_total_bytes=target_device.total_bytes)
    check_capacity(budget_bytes, target_device, allow_over_capacity)
    check_positions(model, batch, target_batch)
    notes = [target_device.note] if target_device.note else []
    if batch_size is None:
        batch_size = batch.size
        notes.append(f"no batch_size given: planning for the sample's batch of {batch.size}")
    require_int("batch_size", batch_size)
    require_int("world_size", world_size)
    require_strategy(strategy)
    if strategy is not None and world_size == 1:
        raise InvalidInputError(f"strategy={strategy!r} needs world_size > 1 (the number of processes)")
    if batch_size % world_size:
        raise InvalidInputError(f"batch_size {batch_size} does not split evenly over world_size {world_size}")
    if offload not in ("auto", True, False):
        raise InvalidInputError(
            f"offload must be 'auto' (the planner may keep activations or states in host memory when that is what "
            f"fits, or is faster), True (the same) or False (never), got {offload!r}"
        )
    margin_bytes = margin_for(margin, budget_bytes, target_device, world_size)
    per_node, reshards, replicates = fsdp2_layouts(world_size, strategy, gpus_per_node, reshard_after_forward,
                                                   replicate)
    may_offload = offload is not False and target_device.kind == "cuda"
    host_budget_bytes = _host_budget(host_budget) if may_offload else None
    optional = auto_pins(model) if isinstance(fp32_modules, str) and fp32_modules == "auto" else ()
    pins = () if optional else fp32_module_names(model, fp32_modules)
    policies = _pinned(_precisions(precision, target_device), pins)
    notes += _cpu_precision_notes(precision, target_device)
    stored = _pinned(_stored_options(model, precision, target_device, world_size, min_stored_precision), pins)
    spec = as_optimizer_spec(optimizer)
    allowed = allow_names(allow)
    chunks = chunkable(model, batch, target_batch, loss_fn)
    eight_bit = eight_bit_spec(spec) if "8bit-optimizer" in allowed else eight_bit_possible(spec) or None
    closed = tuple(n for n, found in (("chunked-loss", chunks), ("8bit-optimizer", eight_bit))
                   if found is not None and n not in allowed)
    chunks, eight_bit = (chunks if "chunked-loss" in allowed else None), (
        eight_bit if "8bit-optimizer" in allowed else None)
    if "chunked-loss" in allowed:
        if chunks is None:
            notes.append("allow 'chunked-loss' does not apply: it needs the default loss (no loss_fn), an nn.Linear "
                         "output head, and an integer target or a Hugging Face causal LM given labels")
    if "8bit-optimizer" in allowed:
        if eight_bit is None:
            notes.append(f"allow '8bit-optimizer' does not apply to optimizer {spec.name!r}: it swaps torch.optim.AdamW "
                         "(or Adam without weight decay) for bitsandbytes' or torchao's 8-bit one, and needs one of "
                         "those libraries (Note [8-bit optimizer state], autofit/training/optim.py)")
    return PlanRequest(
        model=model, batch=batch, target=target_batch, loss_fn=loss_fn, device=target_device,
        budget_bytes=budget_bytes, margin_bytes=margin_bytes, batch_size=batch_size, per_rank=batch_size // world_size, world_size=world_size,
        strategies=(strategy,) if strategy is not None or world_size == 1 else ("ddp", "fsdp2"),
        policies=policies, optimizer=spec,
        fixed_checkpoint=_fixed_checkpoint(model, checkpoint), quick=quick,
        fixed_policies=_fixed_policies(checkpoint),
        # validated by the step's own rules (StepConfig), before any simulation
        clip_grad_norm=make_step_config(micro_batch_size=1, clip_grad_norm=clip_grad_norm).clip_grad_norm,
        auto_precision=isinstance(precision, (str, PrecisionPolicy)), notes=tuple(notes),
        stored_options=stored, pins=pins, optional_pins=optional, offload=may_offload,
        host_budget_bytes=host_budget_bytes, gpus_per_node=per_node, reshard_options=reshards,
        replicate_options=replicates, allow_chunked_loss=chunks, allow_eight_bit=eight_bit,
        closed_rungs=closed,
    )


def fsdp2_layouts(world_size: int, strategy: str | None, gpus_per_node: int | None, reshard_after_forward: Any,
                  replicate: Any) -> tuple[int, tuple[bool | int, ...], tuple[int, ...]]:
    """The ranks per node and the FSDP2 layouts to plan (docs/multi-gpu.md, "How the planner chooses"): with "auto",
    ZeRO-3 and ZeRO-2, and across nodes also the reshard to one node's GPUs and HSDP (replicate across nodes)."""
    per_node = world_size if gpus_per_node is None else require_int("gpus_per_node", gpus_per_node)
    if world_size % per_node:
        raise InvalidInputError(f"gpus_per_node {per_node} does not divide world_size {world_size}: world_size is "
                                "nodes x gpus_per_node")
    nodes = world_size // per_node
    if strategy == "ddp" and (reshard_after_forward != "auto" or replicate != "auto"):
        raise InvalidInputError("reshard_after_forward and replicate are FSDP2 layouts: leave them 'auto' with "
                                "strategy='ddp', or use strategy='fsdp2'")
    if replicate == "auto":
        replicates = (1, nodes) if nodes > 1 else (1,)
    else:
        replicates = (replicate,)
    if reshard_after_forward == "auto":
        reshards: tuple[bool | int, ...] = (True, False)
        if nodes > 1 and per_node > 1:
            reshards += (per_node,)  # the backward all-gather within a node, over NVLink
    else:
        reshards = (reshard_after_forward,)
    if world_size > 1 and strategy != "ddp":  # the explicit ones are checked here, before any simulation
        for raf in reshards:
            for r in replicates:
                if reshard_after_forward != "auto" or replicate != "auto":
                    require_layout("fsdp2", world_size, raf, r)
    return per_node, reshards, replicates


# plan(allow=...): the rungs that change numerics, climbed only when allowed (Note [the ladder])
ALLOW_NAMES = ("8bit-optimizer", "chunked-loss")


def allow_names(allow: Any) -> tuple[str, ...]:
    """``plan(allow=...)`` validated: a name or a sequence of names out of :data:`ALLOW_NAMES`."""
    if allow is None:
        return ()
    items = (allow,) if isinstance(allow, str) else allow
    try:
        items = tuple(items)
    except TypeError as e:
        raise InvalidInputError(f"allow must be a sequence of rung names ({', '.join(ALLOW_NAMES)}), got {allow!r}") from e
    for item in items:
        if item not in ALLOW_NAMES:
            raise InvalidInputError(
                f"allow: unknown rung {item!r}: the rungs that change numerics and need allowing are "
                f"{', '.join(repr(n) for n in ALLOW_NAMES)}"
            )
    return tuple(dict.fromkeys(items))


def check_capacity(budget_bytes: int, target: DeviceTarget, allow_over_capacity: bool = False) -> None:
    """A budget above the GPU's memory cannot be a budget for that GPU: a plan made for it would not fit the card.
    ``allow_over_capacity`` is for whoever means it (a catalog figure older than their card, say)."""
    if target.kind != "cuda" or allow_over_capacity or target.total_bytes is None:
        return
    if budget_bytes > target.total_bytes:
        raise InvalidInputError(
            f"budget {format_bytes(budget_bytes)} ({budget_bytes:,} bytes) is more than the {target.name}'s memory, "
            f"{format_bytes(target.total_bytes)} ({target.total_bytes:,} bytes): give a budget the card has (e.g. "
            "'90%'), name the GPU you train on (gpu=..., --gpu), or pass allow_over_capacity=True "
            "(--allow-over-capacity) if you really mean it"
        )


# Note [the margin]
#     A plan's estimate must fit the budget less a margin: memory the process uses that the estimate does not model.
#     On the CPU the allocator's record is the estimate's truth, so the default margin is 0. On a GPU, one process:
#     0 as well: what docs/cuda.md lists as not modelled there either never makes a step fail (a cuDNN engine whose
#     workspace does not fit is skipped for the next, Conv_v8.cpp try_configs) or is a setting the user changes
#     (allocator configuration, streams, CUDA graphs). With world_size > 1 the collectives' buffers live outside the
#     caching allocator: NCCL keeps, per communicator, one buffer of NCCL_BUFFSIZE (4 MiB by default, NCCL's
#     environment variable documentation) in each direction on each of up to NCCL_MAX_NCHANNELS = 32 channels for
#     its simple protocol: 2 x 32 x 4 MiB = 256 MiB, the default margin there. A user who measured their own gives
#     margin=... (bytes, a size such as "1GB", or a share of the budget such as "5%").
NCCL_RESERVE_BYTES = 2 * 32 * 4 * 2**20


def margin_for(margin: int | str | None, budget_bytes: int, target: DeviceTarget, world_size: int) -> int:
    """The bytes kept free (Note [the margin]): ``margin`` as given, or the default for this device and world."""
    if margin is None:
        return NCCL_RESERVE_BYTES if target.kind == "cuda" and world_size > 1 else 0
    if isinstance(margin, bool):
        raise InvalidInputError(f"margin must be bytes, a size such as '512MB' or a share such as '5%', got {margin!r}")
    if str(margin).strip() in ("0", "0.0", "0%", "0B"):
        return 0
    try:
        value = parse_budget(margin, device_total_bytes=budget_bytes)  # a percentage is a share of the budget
    except InvalidInputError as e:
        raise InvalidInputError(f"margin: {e} (bytes, a size such as '512MB', a share of the budget such as '5%', "
                                "or 0)") from e
    if value >= budget_bytes:
        raise InvalidInputError(
            f"margin {format_bytes(value)} leaves nothing of the budget {format_bytes(budget_bytes)}: give a margin "
            "smaller than the budget"
        )
    return value


def check_positions(model: nn.Module, batch: Batch, target: Batch | None) -> None:
    """The sample's sequence length against the model's learned position embeddings (GPT-2's ``wpe``, BERT's
    ``position_embeddings``, OPT's ``embed_positions``): a longer sequence would index past the table, so the real
    step fails however it is planned. Rotary and sinusoidal positions have no table and no such limit."""
    length = length_spec(batch, target).length
    if length is None:
        return
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if not isinstance(module, nn.Embedding) or leaf not in _POSITION_TABLES:
            continue
        # positions start after a padding index (RoBERTa) or at a fixed offset (OPT's learned positions)
        offset = getattr(module, "offset", None)
        if not isinstance(offset, int):
            offset = 0 if module.padding_idx is None else module.padding_idx + 1
        positions = module.num_embeddings - offset
        if length > positions:
            raise InvalidInputError(
                f"the sample's sequence length {length} is longer than the model's {positions} positions (learned "
                f"position embedding {name!r}): its forward would index past the table. Plan with sequences of at "
                f"most {positions} tokens (--input-shape {positions})"
            )


_POSITION_TABLES = frozenset({"wpe", "position_embeddings", "embed_positions", "pos_embed", "pos_embedding"})


def _host_budget(host_budget: int | str | None) -> int | None:
    """``plan(host_budget=...)``: bytes or a size string ("64GB"); default this machine's RAM, the host the plan is
    most likely made on (say the training machine's when it differs). None when the RAM cannot be read."""
    if host_budget is None:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None
    if isinstance(host_budget, str) and host_budget.strip().endswith("%"):
        raise InvalidInputError(f"host_budget must be bytes or a size such as '64GB', got {host_budget!r}")
    return parse_budget(host_budget, device_total_bytes=None)


def fp32_module_names(model: nn.Module, wanted: Any) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """``plan(fp32_modules=...)``: module classes, class names or qualified names that must compute in fp32, each
    resolved to the qualified names it covers: ``(("LayerNorm", ("ln_f",)), ("lm_head", ("lm_head",)))``."""
    if wanted is None:
        return ()
    items = (wanted,) if isinstance(wanted, (str, type)) else tuple(wanted)
    named = [(n, m) for n, m in model.named_modules() if n]
    found = []
    for item in items:
        if isinstance(item, type):
            names = tuple(n for n, m in named if isinstance(m, item))
            label = item.__name__
        elif isinstance(item, str):
            names = tuple(n for n, m in named if type(m).__name__ == item)
            if not names:  # not a class name: a qualified name (a typed error suggesting close names otherwise)
                resolve_modules(model, (item,), what="fp32_modules (a module class, class name or qualified name)")
                names = (item,)
            label = item
        else:
            raise InvalidInputError(f"fp32_modules must hold module classes, class names or qualified names, got "
                                    f"{item!r}")
        if not names:
            raise InvalidInputError(f"fp32_modules: the model has no module of type {label!r}")
        found.append((label, names))
    return tuple(found)


def auto_pins(model: nn.Module) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The modules ``fp32_modules="auto"`` pins when memory allows: the last norm and the last ``nn.Linear`` outside
    the repeated blocks (no numbered component in their names), as the final norm and the LM head of a transformer
    are (``transformer.ln_f`` and ``lm_head`` in GPT-2, ``model.norm`` and ``lm_head`` in Llama): the softmax over
    the vocabulary reads the head's logits, where fp32 matters most."""
    outside = [(n, m) for n, m in model.named_modules() if n and not any(part.isdigit() for part in n.split("."))]
    norms = [n for n, m in outside if "Norm" in type(m).__name__ and any(True for _ in m.parameters())]
    heads = [n for n, m in outside if isinstance(m, nn.Linear)]
    return tuple((n, (n,)) for n in (norms[-1:] + heads[-1:]))


def _pinned(policies: tuple[PrecisionPolicy, ...], pins) -> tuple[PrecisionPolicy, ...]:
    """Every autocast policy keeps the pinned modules in fp32 (an fp32 policy has no autocast to leave)."""
    names = tuple(dict.fromkeys(n for _, group in pins for n in group))
    if not names:
        return policies
    return tuple(replace(p, fp32_modules=tuple(dict.fromkeys(p.fp32_modules + names))) if p.autocast else p
                 for p in policies)


# The floors a user may set (plan(min_stored_precision=...)): the lowest stored precision the planner may choose.
STORED_FLOORS = {"fp32": (), "fp32-master": ("bf16-master", "fp16-master"),
                 "bf16": ("bf16-master", "fp16-master", "bf16")}


def _stored_options(model: nn.Module, precision: Any, target: DeviceTarget, world_size: int,
                    floor: str | None) -> tuple[PrecisionPolicy, ...]:
    """What the planner may store the parameters in when the model's own dtype does not fit, in order of risk
    (Note [stored precision]): only for precision="auto" on one GPU, for a model built in fp32 (a bf16 model is
    already at the lowest), bf16 choices only on GPUs with bf16 and never pure fp16."""
    if floor is not None and floor not in STORED_FLOORS:
        raise InvalidInputError(
            f"min_stored_precision must be one of {', '.join(STORED_FLOORS)} (or None: any), got {floor!r}"
        )
    allowed = STORED_FLOORS[floor or "bf16"]
    auto = isinstance(precision, str) and precision.strip().lower() == "auto"
    floating = [p for p in model.parameters() if p.is_floating_point()]
    if not auto or target.kind != "cuda" or world_size > 1 or not floating:
        return ()
    if sum(p.numel() for p in floating if p.dtype == torch.float32) * 2 < sum(p.numel() for p in floating):
        return ()
    if target.supports_bf16:
        names = [("bf16", "bf16-master"), ("bf16", "bf16")]
    else:
        names = [("fp16", "fp16-master")]
    return tuple(PrecisionPolicy(name=c, stored=s) for c, s in names if s in allowed)


def _cpu_precision_notes(precision: Any, target: DeviceTarget) -> list[str]:
    """precision="auto" on a CPU target leaves out bf16 where this CPU's oneDNN has no bf16 kernels (Note [CPU
    kernels], autofit/core/cpu.py): its bf16 matmuls run ATen's slow fallback, and its LSTM cannot run at all. Say so."""
    auto = isinstance(precision, str) and precision.strip().lower() == "auto"
    if not auto or target.kind != "cpu" or target.supports_bf16:
        return []
    return [f"precision 'auto' considered fp32 only: this CPU is {cpu_kernels().describe()}, and oneDNN runs bf16 "
            "only on CPUs with AVX-512; pass precision='bf16' to plan bf16 autocast anyway"]


def _precisions(precision: Any, target: DeviceTarget) -> tuple[PrecisionPolicy, ...]:
    if isinstance(precision, str) and precision.strip().lower() == "auto":
        return tuple(PrecisionPolicy(name=n) for n in target.default_precisions())
    if isinstance(precision, (list, tuple)):
        return tuple(as_policy(p) for p in precision)
    policy = as_policy(precision)
    if policy.name not in PRECISION_NAMES:
        raise InvalidInputError(f"unknown precision {precision!r}")
    return (policy,)


def _fixed_policies(checkpoint: Any) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if not isinstance(checkpoint, Mapping):
        return (), ()
    config = make_step_config(micro_batch_size=1, checkpoint=checkpoint)
    return config.checkpoint, config.selective


def _fixed_checkpoint(model: nn.Module, checkpoint: Any) -> tuple[str, ...] | None:
    """None: the planner chooses ("auto"); a tuple: exactly these modules (empty: no checkpointing)."""
    if checkpoint == "auto":
        return None
    if checkpoint in (None, False, "none"):
        return ()
    try:
        names = (checkpoint,) if isinstance(checkpoint, str) else tuple(checkpoint)
    except TypeError as e:
        raise InvalidInputError(
            f"checkpoint must be 'auto', None or a sequence of module names, got {checkpoint!r}"
        ) from e
    resolve_modules(model, names, what="checkpoint")
    return names
