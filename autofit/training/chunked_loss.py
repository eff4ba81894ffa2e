"""Cross-entropy over the output head in chunks of tokens. See Note [chunked cross-entropy].

Note [chunked cross-entropy]
    At a 128k vocabulary the output head's logits dominate a language model's activations: N tokens x V classes,
    kept for backward, upcast to fp32 by the loss, and their gradient as large again. torchtune's
    ``CEWithChunkedOutputLoss`` (torchtune/modules/loss/ce_chunked_output_loss.py) splits the head's output into
    chunks so that each is upcast separately, but keeps every chunk's logits for backward. Here the head itself
    runs per chunk, in forward, and each chunk's gradients are made at once: its logits' gradient by autograd on
    the chunk alone, then the hidden states' gradient and the weight's (and bias'), accumulated in place into one
    buffer each, as Liger-Kernel's fused linear cross-entropy does. No logits are kept for backward, at any moment
    one chunk's logits and their gradient are live, not the whole of them, and backward only scales the gradients
    made in forward by the loss's incoming gradient. The price: the weight's gradient exists from the loss's
    forward on (it would from the start of backward anyway), in the weight's dtype, as autograd accumulates it.

    The step runs it in place of the head and the loss (:func:`chunked_step_loss`, called by
    ``autofit.training.step.run_micro_batch``, which estimate, measure and the trainer all run): the head's ``forward`` is
    replaced, for the call, by one that hands back its input (the final hidden states); the model's output must be
    that very tensor (a model that transforms the head's output, Gemma 2's logit soft-capping say, is refused with
    an :class:`UnsupportedModelError`). The loss is then the mean of the cross-entropy over the tokens that are not
    -100, exactly what the unchunked step computes, summed chunk by chunk:
      - the trainer's own loss: an integer target, ``F.cross_entropy(logits.reshape(-1, C), target.reshape(-1))``
        (autofit/training/loss.py);
      - a Hugging Face causal LM given ``labels``: they are taken out of the call (the model computes no loss) and
        shifted as ``ForCausalLMLoss`` does (transformers/loss/loss_utils.py: pad with -100, labels[..., 1:]), the
        logits upcast to fp32 before the cross-entropy as it does.
    Only the order of the sums differs from the unchunked step, so loss and gradients agree to float rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autofit.training.batch import Batch
from autofit.core.errors import InvalidInputError, UnsupportedModelError
from autofit.training.normalisation import IGNORE_INDEX, _hf_labels, _hf_loss_shifts_labels

__all__ = ["CHUNKS", "LossChunks", "chunked_cross_entropy", "chunked_step_loss", "chunkable", "output_head"]

CHUNKS = 8  # torchtune's CEWithChunkedOutputLoss default (num_output_chunks=8)


@dataclass(frozen=True, kw_only=True)
class LossChunks:
    """The step computes the output head and the cross-entropy in ``chunks`` chunks of tokens (Note [chunked
    cross-entropy]); ``head`` is the head's qualified name."""

    head: str
    chunks: int = CHUNKS

    def __post_init__(self) -> None:
        if not isinstance(self.chunks, int) or isinstance(self.chunks, bool) or self.chunks < 1:
            raise InvalidInputError(f"LossChunks.chunks must be a positive int, got {self.chunks!r}")
        if not isinstance(self.head, str) or not self.head:
            raise InvalidInputError(f"LossChunks.head must name the output head module, got {self.head!r}")


def output_head(model: nn.Module) -> str | None:
    """The qualified name of the model's output head: a Hugging Face model's output embeddings, else the last
    ``nn.Linear`` outside the repeated blocks (no numbered component in its name). None when there is none."""
    get = getattr(model, "get_output_embeddings", None)
    if callable(get):
        try:
            head = get()
        except (AttributeError, NotImplementedError):
            head = None
        if isinstance(head, nn.Linear):
            found = next((n for n, m in model.named_modules() if m is head and n), None)
            if found is not None:
                return found
    outside = [n for n, m in model.named_modules()
               if n and isinstance(m, nn.Linear) and not any(part.isdigit() for part in n.split("."))]
    return outside[-1] if outside else None


def chunkable(model: nn.Module, batch: Batch, target: Batch | None, loss_fn: Any) -> LossChunks | None:
    """The chunked loss this step can run (Note [chunked cross-entropy]), or None: it needs the default loss, an
    output head, and an integer target or a Hugging Face causal LM given ``labels``."""
    if loss_fn is not None:
        return None
    head = output_head(model)
    if head is None:
        return None
    if target is not None:
        value = target.value
        return LossChunks(head=head) if isinstance(value, torch.Tensor) and not value.is_floating_point() else None
    hf = _hf_model(model)
    if hf is not None and _hf_labels(hf, batch) is not None and _hf_loss_shifts_labels(hf):
        return LossChunks(head=head)
    return None


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          labels: torch.Tensor, chunks: int, *, upcast: bool = False) -> torch.Tensor:
    """Mean cross-entropy of ``F.linear(hidden, weight, bias)`` against ``labels`` over the labels that are not
    -100, the head and the loss run ``chunks`` times on as many slices of the tokens, their gradients made as they go
    (Note [chunked cross-entropy]). ``upcast``: the logits are converted to fp32 before the loss (Hugging Face's)."""
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1)
    if h.shape[0] != y.shape[0]:
        raise InvalidInputError(f"chunked cross-entropy: {h.shape[0]} hidden states but {y.shape[0]} labels")
    total = _ChunkedLinearCrossEntropy.apply(h, weight, bias, y, chunks, upcast)
    return total / y.ne(IGNORE_INDEX).sum()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """The summed cross-entropy of the head's logits, chunk by chunk; forward also makes the gradients of the hidden
    states, the weight and the bias (accumulated in place, one buffer each), which backward scales by the incoming
    gradient: no logits are saved, and at most one chunk's logits and their gradient are live."""

    @staticmethod
    def forward(ctx, h, weight, bias, y, chunks, upcast):  # noqa: D102 - see the class
        size = -(-h.shape[0] // chunks)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros_like(weight)
        grad_b = None if bias is None else torch.zeros_like(bias)
        total = None
        for start in range(0, h.shape[0], size):
            h_c, y_c = h[start:start + size], y[start:start + size]
            with torch.enable_grad():
                logits = F.linear(h_c, weight, bias).detach().requires_grad_()
                z = logits.float() if upcast else logits
                part = F.cross_entropy(z, y_c, ignore_index=IGNORE_INDEX, reduction="sum")
                (g,) = torch.autograd.grad(part, logits)
            del logits, z
            part = part.detach()
            total = part if total is None else total + part
            grad_h[start:start + size] = g @ weight.to(g.dtype)
            grad_w.addmm_(g.t().to(grad_w.dtype), h_c.to(grad_w.dtype))
            if grad_b is not None:
                grad_b += g.sum(0).to(grad_b.dtype)
            del g
        ctx.save_for_backward(grad_h, grad_w, grad_b)
        return total

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102 - see the class
        grad_h, grad_w, grad_b = ctx.saved_tensors
        return (grad_h.mul_(grad_out), grad_w.mul_(grad_out), None if grad_b is None else grad_b.mul_(grad_out),
                None, None, None)


def chunked_step_loss(model: nn.Module, batch: Batch, target: Any, chunks: LossChunks, *,
                      fp32_head: bool = False) -> torch.Tensor:
    """Forward of ``model`` on ``batch`` with its head deferred, then the chunked loss (Note [chunked
    cross-entropy]). ``target``: the target's value, or None for a Hugging Face model given ``labels``.
    ``fp32_head``: the head is pinned to fp32 (the precision's fp32_modules), so its chunks run without autocast."""
    head = dict(model.named_modules()).get(chunks.head)
    if not isinstance(head, nn.Linear):
        raise InvalidInputError(f"chunked loss: the model has no nn.Linear output head named {chunks.head!r}")
    if target is None:
        labels = batch.kwargs.get("labels") if batch.kind == "dict" else None
        if not isinstance(labels, torch.Tensor):
            raise InvalidInputError("chunked loss without a target needs a Hugging Face causal LM given labels=...")
        call = Batch(batch.args, {k: v for k, v in batch.kwargs.items() if k != "labels"}, batch.size, batch.kind)
        labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]  # ForCausalLMLoss's shift
        upcast = True
    else:
        call, labels, upcast = batch, target, False
    with _deferred(head) as seen:
        output = call.call(model)
    hidden = seen[0] if seen else None
    if hidden is None or _logits(output) is not hidden:
        raise UnsupportedModelError(
            f"chunked loss: the model's output is not what its head {chunks.head!r} returns (the model transforms "
            "the logits after the head, soft-capping say, or does not call it): leave 'chunked-loss' out of allow"
        )
    del output
    if not fp32_head:
        return chunked_cross_entropy(hidden, head.weight, head.bias, labels, chunks.chunks, upcast=upcast)
    with torch.autocast(hidden.device.type, enabled=False):
        return chunked_cross_entropy(hidden.float(), head.weight, head.bias, labels, chunks.chunks, upcast=upcast)


@contextlib.contextmanager
def _deferred(head: nn.Module) -> Iterator[list[torch.Tensor]]:
    """The head's forward hands back its input for the call (instance override, removed on exit)."""
    seen: list[torch.Tensor] = []
    had, old = "forward" in head.__dict__, head.__dict__.get("forward")

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(x)
        return x

    head.forward = forward
    try:
        yield seen
    finally:
        if had:
            head.forward = old
        else:
            del head.forward


def _logits(output: Any) -> Any:
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    return None


def _hf_model(model: nn.Module) -> nn.Module | None:
    """The Hugging Face model itself, or the one under a peft wrapper."""
    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    from autofit.training.normalisation import _is_hf_model

    return base if _is_hf_model(base) else None
