"""The request's checks and resolutions, each a pure function of the user's arguments (request.py calls them once):
the model and sample, a budget against the card, the margin, position tables, the host budget, fp32 pins, the stored
precisions and compute precisions to try, a fixed checkpoint set, the FSDP2 layouts and the opt-in rungs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from autofit.training.batch import Batch, as_batches
from autofit.options import as_batch_dim
from autofit.core._torch_compile import compiled_in_place
from autofit.device import NCCL_RESERVE_BYTES, DeviceTarget
from autofit.core.errors import InvalidInputError, UnsupportedModelError
from autofit.features import feature_names
from autofit.training.length import length_spec
from autofit.training.precision import PRECISION_NAMES, PrecisionPolicy, as_policy
from autofit.training.config import make_step_config, resolve_modules
from autofit.core.units import format_bytes, parse_budget

__all__ = ["check_model", "as_inputs", "check_capacity", "check_positions", "margin_for", "NCCL_RESERVE_BYTES",
           "resolve_host_budget", "fp32_module_names", "auto_pins", "pinned", "stored_options", "cpu_precision_notes",
           "precisions", "fixed_checkpoint", "fixed_policies", "ALLOW_NAMES", "allow_names"]


def check_model(model: Any) -> nn.Module:
    if not isinstance(model, nn.Module):
        raise InvalidInputError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    in_place = compiled_in_place(model)
    if in_place:  # its copies would run eagerly, silently (see Note [inductor without kernels])
        raise UnsupportedModelError(
            f"{', '.join(in_place)}: compiled in place with nn.Module.compile(), which autofit does not estimate; "
            "pass torch.compile(model) instead, or the uncompiled model with compile=True")
    if next(model.parameters(), None) is None:  # torch's optimizer would raise "got an empty parameter list"
        raise InvalidInputError(
            f"the model ({type(model).__name__}) has no parameters: a training step has nothing to update; give "
            "the model that holds the weights you train")
    for name, module in model.named_modules():
        _check_module(name or "the model", module)
    return model


def _check_module(name: str, module: nn.Module) -> None:
    """Modules the step cannot copy onto fake tensors, named with the fix (rather than torch's own error from deep
    inside the simulation)."""
    where = name if name == "the model" else f"module {name!r}"
    if isinstance(module, torch.jit.ScriptModule):  # its parameters do not survive the copy as leaves
        raise UnsupportedModelError(
            f"{where} is a TorchScript module ({type(module).__name__}, from torch.jit.script or trace), which "
            "autofit cannot copy to simulate: plan with the eager module it was scripted from (the memory is the "
            "same), and script it after planning")
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse and module.weight.requires_grad:
        raise UnsupportedModelError(
            f"{where} ({type(module).__name__}) has sparse=True: its gradient is a sparse tensor, which the "
            "simulation (fake tensors) and the allocator measurement cannot hold. Plan a copy with sparse=False: it "
            "counts the dense gradient (the whole table), more than the sparse one (one row per lookup, with its "
            "index) while a step looks up fewer rows than the table holds; plan.wrap trains the sparse model as "
            "plain PyTorch does")


def as_inputs(sample: Any, target: Any, shared: Any = None, batch_dim: Any = 0) -> tuple[Batch, Batch | None]:
    """The sample and target as batches with the same number of rows (Note [the batch dimension],
    autofit/training/batch.py); ``batch_dim``: an ``autofit.BatchDim`` or its dim alone (autofit/options.py);
    ``shared`` names inputs passed whole, beside a dim (``analyse``'s keyword; None: the BatchDim's)."""
    rows = as_batch_dim(batch_dim)
    return as_batches(sample, target, shared=rows.shared if shared is None else shared, batch_dim=rows.dim)


# plan(allow=...): the rungs that change numerics, climbed only when allowed (Note [the ladder]): the step features'
# names (Note [step features]), sorted
ALLOW_NAMES = feature_names()


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
    capacity = target.capacity_bytes
    if allow_over_capacity or capacity is None:
        return
    if budget_bytes > capacity:
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
#     margin=... (bytes, a size such as "1GB", or a share of the budget such as "5%"). The figure is
#     NCCL_RESERVE_BYTES, the CUDA target's (DeviceTarget.collective_reserve_bytes, autofit/device.py).


def margin_for(margin: int | str | None, budget_bytes: int, target: DeviceTarget, world_size: int) -> int:
    """The bytes kept free (Note [the margin]): ``margin`` as given, or the default for this device and world."""
    if margin is None:
        return target.collective_reserve_bytes(world_size)
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


# Note [the host of the target]
#     A plan that keeps states or activations in host memory must fit the host of the machine that trains, and
#     planning mostly happens elsewhere: on a laptop, for a GPU server. So the default ``host_budget`` is this
#     machine's RAM only when the target is this machine (the CPU, or the GPU detected here: DeviceTarget.local);
#     for any other target it is the host of the platform the catalog card ships in (autofit/cuda/cards.py, each
#     figure cited: a DGX H100's 2 TB for 8 GPUs, an AWS g5.48xlarge's 768 GiB for 8 A10G), the GPUs' share of it
#     for the ranks of one node (one rank of a DGX H100: 256 GiB; eight: the node's 2 TiB). A plan for one GPU
#     gets one GPU's share, not the node's, since the other GPUs' jobs share that host. Cards sold for
#     workstations have no published system: a workstation with twice the card's memory (rounded up to a power of
#     two GiB) is assumed, and the note says so. The plan's notes name the figure and where it came from, and how
#     to give the training machine's (host_budget=, the CLI's --host-budget).
#     What the host must hold is known before any analysis where the states alone decide it (Note [the ladder],
#     solve/ladder.py): when no rung on the GPU can hold the parameters, gradients and optimizer state, they go to
#     the host, and if they alone exceed the host budget the plan is refused at once (solve/host.py), naming the
#     smallest host budget that could work.
def resolve_host_budget(host_budget: int | str | None, device: DeviceTarget,
                        ranks_per_node: int = 1) -> tuple[int | None, str | None]:
    """``plan(host_budget=...)``: bytes or a size string ("64GB"), and the note saying what was assumed when it was
    not given: this machine's RAM when the target is this machine, else the target's host (Note [the host of the
    target]). (None, None) when this machine's RAM cannot be read."""
    if host_budget is not None:
        if isinstance(host_budget, str) and host_budget.strip().endswith("%"):
            raise InvalidInputError(f"host_budget must be bytes or a size such as '64GB', got {host_budget!r}")
        return parse_budget(host_budget, device_total_bytes=None), None
    how = 'to plan for the training machine\'s RAM, give host_budget="..."'
    if device.local or device.gpu is None:
        try:
            ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None, None
        return ram, f"host budget {format_bytes(ram)}: this machine's RAM, the target's host; {how}"
    host = device.gpu.host_spec
    budget = host.for_ranks(ranks_per_node)
    if budget >= host.memory_bytes:
        share = "all of"
    else:
        share = "1 GPU's share of" if ranks_per_node == 1 else f"{ranks_per_node} GPUs' share of"
    where = f"assumed for the {device.name}" if host.assumed else f"the {device.name}'s host"
    return budget, (f"host budget {format_bytes(budget)} per node, {where}, not this machine's RAM: {share} "
                    f"{host.source}; {how}")


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


def pinned(policies: tuple[PrecisionPolicy, ...], pins) -> tuple[PrecisionPolicy, ...]:
    """Every autocast policy keeps the pinned modules in fp32 (an fp32 policy has no autocast to leave)."""
    names = tuple(dict.fromkeys(n for _, group in pins for n in group))
    if not names:
        return policies
    return tuple(replace(p, fp32_modules=tuple(dict.fromkeys(p.fp32_modules + names))) if p.autocast else p
                 for p in policies)


# The floors a user may set (plan(min_stored_precision=...)): the lowest stored precision the planner may choose.
STORED_FLOORS = {"fp32": (), "fp32-master": ("bf16-master", "fp16-master"),
                 "bf16": ("bf16-master", "fp16-master", "bf16")}


def stored_options(model: nn.Module, precision: Any, target: DeviceTarget, world_size: int,
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
    if not auto or not target.precision_rungs or world_size > 1 or not floating:
        return ()
    if sum(p.numel() for p in floating if p.dtype == torch.float32) * 2 < sum(p.numel() for p in floating):
        return ()
    if target.supports_bf16:
        names = [("bf16", "bf16-master"), ("bf16", "bf16")]
    else:
        names = [("fp16", "fp16-master")]
    return tuple(PrecisionPolicy(name=c, stored=s) for c, s in names if s in allowed)


def cpu_precision_notes(precision: Any, target: DeviceTarget) -> list[str]:
    """What precision="auto" leaves out on ``target`` (DeviceTarget.auto_precision_notes: bf16 on a CPU whose oneDNN
    has no bf16 kernels, Note [CPU kernels]). Say so."""
    auto = isinstance(precision, str) and precision.strip().lower() == "auto"
    return target.auto_precision_notes() if auto else []


def precisions(precision: Any, target: DeviceTarget) -> tuple[PrecisionPolicy, ...]:
    if isinstance(precision, str) and precision.strip().lower() == "auto":
        return tuple(PrecisionPolicy(name=n) for n in target.default_precisions())
    if isinstance(precision, (list, tuple)):
        return tuple(as_policy(p) for p in precision)
    policy = as_policy(precision)
    if policy.name not in PRECISION_NAMES:
        raise InvalidInputError(f"unknown precision {precision!r}")
    return (policy,)


def fixed_policies(checkpoint: Any) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    if not isinstance(checkpoint, Mapping):
        return (), (), ()
    config = make_step_config(micro_batch_size=1, checkpoint=checkpoint)
    return config.checkpoint, config.selective, config.op_selective


def fixed_checkpoint(model: nn.Module, checkpoint: Any) -> tuple[str, ...] | None:
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
