"""``autofit verify``: run a plan for real on this machine's device and compare the peak with the prediction and the
budget. The verdict is the exit code: a measured peak over the budget fails (``autofit.cli.app``)."""

from __future__ import annotations

import torch
from rich.table import Table
from dataclasses import dataclass

from torch import nn

from autofit.training.batch import as_batch
from autofit.capture.model_copy import has_meta_tensors
from autofit.cli.specs import ModelSpec
from autofit.measure.allocator import measure_callable
from autofit.training.optim import OPTIMIZER_NAMES, as_optimizer_spec
from autofit.emit.plan import Plan
from autofit.core.errors import UnsupportedModelError
from autofit.core.units import format_mib

__all__ = ["Verification", "run_verification", "materialise"]


@dataclass(frozen=True)
class Verification:
    """What ``autofit verify`` ran: the plan's predicted peak, the measured one, and the budget they answer to."""

    predicted_bytes: int
    measured_bytes: int
    budget_bytes: int
    device: str
    description: str

    @property
    def fits(self) -> bool:
        return self.measured_bytes <= self.budget_bytes

    @property
    def error_percent(self) -> float:
        return 100 * (self.predicted_bytes - self.measured_bytes) / self.measured_bytes if self.measured_bytes else 0.0

    def verdict(self) -> str:
        """One line: fits with this much to spare, or over the budget by this much."""
        slack = self.budget_bytes - self.measured_bytes
        if self.fits:
            return (f"fits: measured peak {format_mib(self.measured_bytes, 2)} MiB, "
                    f"{format_mib(slack, 2)} MiB under the budget")
        return (f"over budget: the measured peak {format_mib(self.measured_bytes, 2)} MiB exceeds the budget "
                f"{format_mib(self.budget_bytes, 2)} MiB by {format_mib(-slack, 2)} MiB ({-slack:,} bytes, "
                f"{100 * -slack / self.budget_bytes:.1f} %)")

    def table(self) -> Table:
        table = Table(title=f"verify: {self.description} on {self.device}", title_justify="left")
        table.add_column("")
        table.add_column("MiB", justify="right")
        table.add_column("bytes", justify="right")
        table.add_row("predicted peak", format_mib(self.predicted_bytes, 2), f"{self.predicted_bytes:,}")
        table.add_row("measured peak", format_mib(self.measured_bytes, 2), f"{self.measured_bytes:,}")
        table.add_row("error", f"{self.error_percent:+.2f} %", "")
        table.add_row("budget", format_mib(self.budget_bytes, 2), f"{self.budget_bytes:,}")
        return table


def materialise(model: nn.Module, device: torch.device) -> nn.Module:
    """Real weights for a model built on the meta device: allocate, then each module's own initialiser. Tied weights
    stay tied: ``to_empty`` gives every module that shares a Parameter its own new one (GPT-2's ``lm_head`` and
    ``wte`` came apart, and the measured step carried 38.6 M parameters, their gradients and AdamW state that the
    plan, made for the tied model, rightly did not: issue 30's "-23.6 %")."""
    if not has_meta_tensors(model):
        return model.to(device)
    quantized = _quantized_layers(model)
    shared: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, p in module.named_parameters(recurse=False):
            shared.setdefault(id(p), []).append((module, name))
    model = model.to_empty(device=device)
    for users in shared.values():
        first_module, first_name = users[0]
        for module, name in users[1:]:
            setattr(module, name, getattr(first_module, first_name))
    replaced = {id(getattr(parent, name)) for parent, name, _ in quantized}
    for module in model.modules():
        reset = getattr(module, "reset_parameters", None)
        if callable(reset) and id(module) not in replaced:  # a quantized weight has no uniform_ of its own
            reset()
    for parent, name, layer in quantized:
        setattr(parent, name, _quantized_on(layer, device))
    return model


def _is_bitsandbytes(module: nn.Module) -> bool:
    return type(module).__module__.startswith("bitsandbytes")


def _quantized_layers(model: nn.Module) -> list[tuple[nn.Module, str, dict]]:
    """(parent, name, how it was quantized) of each bitsandbytes layer built on meta (``--qlora``, an 8-bit base):
    their weights are quantized from real ones on the device, as loading a checkpoint does, not allocated empty.
    Read before ``to_empty``, which turns their weights into plain parameters."""
    found = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if _is_bitsandbytes(child) and child.weight.device.type == "meta":
                w = child.weight
                how = dict(kind=type(child).__name__, shape=(child.in_features, child.out_features),
                           bias=None if child.bias is None else child.bias.dtype,
                           compute_dtype=getattr(child, "compute_dtype", None),
                           threshold=getattr(getattr(child, "state", None), "threshold", 0.0),
                           **{k: getattr(w, k, None) for k in ("blocksize", "compress_statistics", "quant_type",
                                                               "quant_storage")})
                found.append((parent, name, how))
    return found


def _quantized_on(how: dict, device: torch.device) -> nn.Module:
    """A bitsandbytes ``Linear4bit`` / ``Linear8bitLt`` as ``how`` describes, its weight quantized on ``device``
    from a freshly initialised one (``.to(device)`` quantizes, as transformers' loading does)."""
    import bitsandbytes as bnb

    (i, o), bias = how["shape"], how["bias"] is not None
    linear = nn.Linear(i, o, bias=False)
    if how["kind"] == "Linear4bit":
        quant = {k: how[k] for k in ("compress_statistics", "quant_type", "quant_storage")}
        new = bnb.nn.Linear4bit(i, o, bias=bias, compute_dtype=how["compute_dtype"], **quant)
        new.weight = bnb.nn.Params4bit(linear.weight.data.to(how["compute_dtype"]), requires_grad=False,
                                       blocksize=how["blocksize"], **quant)
    elif how["kind"] == "Linear8bitLt":
        new = bnb.nn.Linear8bitLt(i, o, bias=bias, has_fp16_weights=False, threshold=how["threshold"])
        new.weight = bnb.nn.Int8Params(linear.weight.data.to(torch.float16), requires_grad=False,
                                       has_fp16_weights=False)
    else:
        raise UnsupportedModelError(f"verify builds real weights for bitsandbytes' Linear4bit and Linear8bitLt, not "
                                    f"{how['kind']}: give a model with real weights")
    if bias:
        new.bias = nn.Parameter(torch.zeros(o, dtype=how["bias"]), requires_grad=False)
    return new.to(device)


def run_verification(spec: ModelSpec, plan: Plan, *, steps: int = 3) -> Verification:
    device = torch.device(plan.device if plan.device.available() else "cpu")
    model = materialise(spec.model, device)
    # the optimizer the plan was made for, built as autofit builds it (a custom optimizer's name falls back to AdamW)
    name = plan.optimizer if plan.optimizer in OPTIMIZER_NAMES else "adamw"
    optimizer = as_optimizer_spec(name).build(model.parameters())
    batch = as_batch(spec.sample).resize(plan.batch_size).map_tensors(lambda t: t.to(device))
    target = None if spec.target is None else as_batch(spec.target, what="target").resize(plan.batch_size)
    target = None if target is None else target.map_tensors(lambda t: t.to(device))
    inputs = batch.value
    trainer = plan.wrap(model, optimizer, loss_fn=spec.loss_fn)
    trainer.step(inputs, None if target is None else target.value)  # optimizer state now exists
    measured = 0
    for _ in range(steps):
        live = list(model.parameters()) + list(model.buffers()) + batch.tensors()
        live += [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        live += target.tensors() if target is not None else []
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            trainer.step(inputs, None if target is None else target.value)
            torch.cuda.synchronize()
            measured = max(measured, torch.cuda.max_memory_allocated())
        else:
            measured = max(measured, measure_callable(
                lambda: trainer.step(inputs, None if target is None else target.value), live))
    trainer.unwrap()
    # On the CPU the allocator's peak is what the budget holds. On a GPU the budget holds reserved memory plus the
    # context, which max_memory_allocated does not see: an allocated peak over the budget is over it for certain.
    return Verification(predicted_bytes=plan.peak_bytes, measured_bytes=measured, budget_bytes=plan.budget_bytes,
                        device=device.type, description=spec.description)
