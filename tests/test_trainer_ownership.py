"""The trainer trains on what it made, and only that (issue 55). Each test runs ``trainer.step`` and plain PyTorch
on the same data and compares the parameters after:

- gradients found on the parameters before the first micro-batch (a GAN's generator loss leaving gradients in the
  discriminator; a sanity-check backward) are not trained on, and a micro-batch that raises leaves none behind
  (Note [the trainer owns its window], autofit/emit/trainer.py); the truth is the standard loop, which calls
  ``optimizer.zero_grad()`` before each step;
- torch's index-ignoring losses given as ``loss_fn`` are weighted by the targets they keep (Note [losses that
  ignore an index], autofit/training/normalisation.py); the truth is one full-batch step with the same loss;
- a checkpointed module's buffer writes land once per forward (Note [buffers under recomputation],
  autofit/training/recompute.py); the truth is the same loop without checkpointing;
- the caller's autocast does not reach an fp32 plan's step, and is as it was afterwards;
- spectral norm under accumulation warns; LBFGS is refused at ``wrap``.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autofit
from autofit.core.report import MemoryEstimate
from autofit.emit.plan import Plan
from autofit.training.precision import PrecisionPolicy

RTOL, ATOL = 1e-5, 1e-6  # fp32: only the order of additions differs from the reference
LR = 0.1


def _plan(*, micro: int, batch: int, checkpoint: tuple[str, ...] = (), preallocated_grads: bool = False) -> Plan:
    """A plan with exactly these knobs (the planner's choice is not under test here)."""
    k = -(-batch // micro)
    return Plan(
        micro_batch_size=micro, gradient_accumulation_steps=k, batch_size=batch,
        last_micro_batch_size=batch - micro * (k - 1), precision=PrecisionPolicy(name="fp32"), checkpoint=checkpoint,
        peak_bytes=1, device_bytes=1, budget_bytes=1, device="cpu", optimizer="sgd", predicted_step_seconds=0.0,
        estimate=MemoryEstimate(peak_bytes=1, breakdown={}, preallocated_grads=preallocated_grads),
    )


def _mlp(inp: int = 6, out: int = 3) -> nn.Module:
    return nn.Sequential(nn.Linear(inp, 16), nn.Tanh(), nn.Linear(16, out))


def _update_error(model: nn.Module, reference: nn.Module, start: nn.Module) -> float:
    """|model - reference| / |reference - start| over all parameters: how far off the update is, relative to it."""
    pairs = zip(model.parameters(), reference.parameters(), start.parameters())
    off = update = 0.0
    with torch.no_grad():
        for a, b, s in pairs:
            off, update = off + float((a - b).pow(2).sum()), update + float((b - s).pow(2).sum())
    return (off / update) ** 0.5


def _assert_same(model: nn.Module, reference: nn.Module) -> None:
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")


def _plain_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn=F.cross_entropy) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()
    optimizer.step()


# ---- the gradients of the window --------------------------------------------------------------------------------

def test_a_gan_with_one_trainer_per_network_trains_as_the_standard_loop() -> None:
    """The generator's loss runs through the discriminator, so its backward leaves gradients in it (before: the
    discriminator's update 293 % off the standard loop after 3 iterations, the generator's 12 %)."""
    torch.manual_seed(0)
    gen, disc = _mlp(4, 6), _mlp(6, 1)
    gen_ref, disc_ref = copy.deepcopy(gen), copy.deepcopy(disc)
    gen_start, disc_start = copy.deepcopy(gen), copy.deepcopy(disc)
    real, noise = torch.randn(3, 8, 6), torch.randn(3, 8, 4)
    labels = torch.cat([torch.ones(8, 1), torch.zeros(8, 1)])
    bce = F.binary_cross_entropy_with_logits

    d_trainer = _plan(micro=8, batch=16).wrap(disc, torch.optim.SGD(disc.parameters(), lr=LR), loss_fn=bce)
    g_trainer = _plan(micro=4, batch=8).wrap(gen, torch.optim.SGD(gen.parameters(), lr=LR),
                                             loss_fn=lambda fake: bce(disc(fake), torch.ones(fake.shape[0], 1)))
    for i in range(3):
        d_trainer.step(torch.cat([real[i], gen(noise[i]).detach()]), labels)
        g_trainer.step(noise[i])
    d_trainer.unwrap()
    g_trainer.unwrap()

    # the standard loop (pytorch/examples dcgan): zero_grad before each network's step
    d_opt = torch.optim.SGD(disc_ref.parameters(), lr=LR)
    g_opt = torch.optim.SGD(gen_ref.parameters(), lr=LR)
    for i in range(3):
        d_opt.zero_grad()
        bce(disc_ref(torch.cat([real[i], gen_ref(noise[i]).detach()])), labels).backward()
        d_opt.step()
        g_opt.zero_grad()
        bce(disc_ref(gen_ref(noise[i])), torch.ones(8, 1)).backward()
        g_opt.step()
    assert _update_error(disc, disc_ref, disc_start) < 1e-5
    assert _update_error(gen, gen_ref, gen_start) < 1e-5
    _assert_same(disc, disc_ref)
    _assert_same(gen, gen_ref)


@pytest.mark.parametrize("preallocated_grads", [False, True], ids=["freed", "preallocated"])
def test_a_sanity_check_backward_before_the_first_step_is_not_trained_on(preallocated_grads: bool) -> None:
    """Before: the update twice the plain one (100 % off), whichever way the plan keeps its gradients."""
    torch.manual_seed(0)
    model = _mlp()
    reference, start = copy.deepcopy(model), copy.deepcopy(model)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    trainer = _plan(micro=4, batch=8, preallocated_grads=preallocated_grads).wrap(
        model, torch.optim.SGD(model.parameters(), lr=LR))
    F.cross_entropy(model(x), y).backward()  # "does the loss go down?": a backward the user runs before training
    trainer.step(x, y)
    trainer.unwrap()
    _plain_step(reference, x, y)
    assert _update_error(model, reference, start) < 1e-5
    _assert_same(model, reference)


class _Flaky(nn.Module):
    """Raises in the forward whose number is ``fail_at``: an out-of-memory error the user catches and carries on."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()
        self.fail_at: int | None = None
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return self.net(x)


def test_a_micro_batch_that_raises_leaves_no_gradient_and_the_next_step_is_the_plain_step() -> None:
    """The first micro-batch's backward ran, the second raised (before: its gradient stayed, and the next step was
    55 % off the plain step)."""
    torch.manual_seed(0)
    model = _Flaky()
    reference, start = copy.deepcopy(model), copy.deepcopy(model)
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    trainer = _plan(micro=4, batch=8).wrap(model, torch.optim.SGD(model.parameters(), lr=LR))
    model.fail_at = 2
    with pytest.raises(RuntimeError, match="out of memory"):
        trainer.step(x, y)
    assert all(p.grad is None for p in model.parameters())  # nothing left of the failed window
    torch.testing.assert_close(list(model.parameters()), list(start.parameters()), rtol=0, atol=0)
    trainer.step(x, y)
    trainer.unwrap()
    _plain_step(reference, x, y)
    assert _update_error(model, reference, start) < 1e-5
    _assert_same(model, reference)


# ---- losses that ignore an index --------------------------------------------------------------------------------

_WEIGHT = torch.tensor([0.5, 1.0, 2.0, 1.5, 3.0])


@pytest.mark.parametrize("loss_fn", [
    F.cross_entropy,
    F.nll_loss,
    nn.CrossEntropyLoss(),
    nn.CrossEntropyLoss(ignore_index=0),
    nn.CrossEntropyLoss(weight=_WEIGHT, label_smoothing=0.1),
    nn.NLLLoss(weight=_WEIGHT, ignore_index=2),
    functools.partial(F.cross_entropy, ignore_index=0, label_smoothing=0.2),
], ids=["F.cross_entropy", "F.nll_loss", "CrossEntropyLoss", "CrossEntropyLoss(ignore_index=0)",
        "CrossEntropyLoss(weight,label_smoothing)", "NLLLoss(weight,ignore_index=2)", "partial(cross_entropy)"])
def test_an_index_ignoring_loss_fn_is_weighted_by_the_targets_it_keeps(loss_fn) -> None:
    """Micro-batches of 2 rows holding 0, 1, 2 and 1 kept targets (before, for F.cross_entropy: the update 41 % off
    the full-batch step; weighted by rows it is still so, checked below)."""
    torch.manual_seed(0)
    log_probs = getattr(loss_fn, "func", loss_fn) is F.nll_loss or isinstance(loss_fn, nn.NLLLoss)
    model = nn.Sequential(_mlp(6, 5), nn.LogSoftmax(-1)) if log_probs else _mlp(6, 5)
    reference, start = copy.deepcopy(model), copy.deepcopy(model)
    ignore = loss_fn.keywords.get("ignore_index", -100) if isinstance(loss_fn, functools.partial) else \
        getattr(loss_fn, "ignore_index", -100)
    x = torch.randn(8, 6)
    y = torch.tensor([ignore, ignore, ignore, 3, 4, 1, ignore, 4])  # kept per micro-batch of 2 rows: 0, 1, 2, 1
    trainer = _plan(micro=2, batch=8).wrap(model, torch.optim.SGD(model.parameters(), lr=LR), loss_fn=loss_fn)
    trainer.step(x, y)
    trainer.unwrap()
    _plain_step(reference, x, y, loss_fn)
    _assert_same(model, reference)

    # the data is uneven: weighting the micro-batches by rows would be far off
    by_rows = copy.deepcopy(start)
    optimizer = torch.optim.SGD(by_rows.parameters(), lr=LR)
    for rows in torch.arange(8).split(2):
        loss = loss_fn(by_rows(x[rows]), y[rows]) * len(rows) / 8
        if torch.isfinite(loss):  # an all-ignored micro-batch's mean is nan
            loss.backward()
    optimizer.step()
    assert _update_error(by_rows, reference, start) > 0.05


def _shifted(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A causal-LM loss of the user's own: position t predicts label t + 1."""
    return F.cross_entropy(output[:, :-1].reshape(-1, output.shape[-1]), target[:, 1:].reshape(-1))


class _Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 8)
        self.out = nn.Linear(8, 7)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.embed(tokens)))


def _padded_tokens() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    tokens = torch.randint(0, 7, (4, 6))
    labels = tokens.clone()
    labels[0, 2:] = -100  # rows keep 1, 5, 3 and 5 shifted labels
    labels[2, 4:] = -100
    return tokens, labels


def test_a_function_of_its_own_over_ignored_targets_is_refused_before_any_update() -> None:
    """A function that shifts the labels cannot be read for what it keeps; weighted by rows it was 16 % off the
    full-batch step. Refused at the first micro-batch whose target holds -100, parameters and gradients untouched."""
    model = _Tagger()
    start = copy.deepcopy(model)
    tokens, labels = _padded_tokens()
    trainer = _plan(micro=2, batch=4).wrap(model, torch.optim.SGD(model.parameters(), lr=LR), loss_fn=_shifted)
    with pytest.raises(autofit.LossError, match=r"F\.cross_entropy.*ignore_index=-100.*ItemMeanLoss"):
        trainer.step(tokens, labels)
    assert all(p.grad is None for p in model.parameters())
    torch.testing.assert_close(list(model.parameters()), list(start.parameters()), rtol=0, atol=0)

    # what the error asks for trains as the full-batch step
    loss_fn = autofit.ItemMeanLoss(_shifted, count_items=lambda inputs, target: target[:, 1:].ne(-100).sum())
    trainer.unwrap()
    counted = _plan(micro=2, batch=4).wrap(model, torch.optim.SGD(model.parameters(), lr=LR), loss_fn=loss_fn)
    counted.step(tokens, labels)
    counted.unwrap()
    reference = copy.deepcopy(start)
    _plain_step(reference, tokens, labels, _shifted)
    _assert_same(model, reference)


def test_a_function_of_its_own_is_not_refused_without_ignored_targets_or_with_one_micro_batch() -> None:
    model = _Tagger()
    tokens, labels = _padded_tokens()
    with _plan(micro=2, batch=4).wrap(model, torch.optim.SGD(model.parameters(), lr=LR), loss_fn=_shifted) as t:
        t.step(tokens, tokens)  # nothing ignored: rows weigh as the targets do
    with _plan(micro=4, batch=4).wrap(model, torch.optim.SGD(model.parameters(), lr=LR), loss_fn=_shifted) as t:
        t.step(tokens, labels)  # one micro-batch: its weight is 1 however it is counted


def test_a_sum_reduced_index_loss_is_not_taken_for_a_mean_over_targets() -> None:
    """``reduction="sum"`` adds up (Note [sum-reduced losses]); the target count does not apply to it."""
    torch.manual_seed(0)
    model = _mlp(6, 5)
    reference = copy.deepcopy(model)
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    x, y = torch.randn(8, 6), torch.tensor([-100, -100, -100, 3, 4, 1, 3, 4])
    trainer = _plan(micro=2, batch=8).wrap(model, torch.optim.SGD(model.parameters(), lr=LR), loss_fn=loss_fn,
                                           loss_reduction="sum")
    trainer.step(x, y)
    trainer.unwrap()
    _plain_step(reference, x, y, loss_fn)
    _assert_same(model, reference)


# ---- buffers under recomputation --------------------------------------------------------------------------------

class _Stateful(nn.Module):
    """A forward that writes buffers in every way: a counter in place, a counter by assignment that the output then
    reads, spectral norm's power iteration (its output reads the updated vectors), a codebook read before its
    moving average moves, a moving average with ``lerp_``, an InstanceNorm's running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.sn = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 8))
        self.inorm = nn.InstanceNorm1d(8, affine=True, track_running_stats=True)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("assigned", torch.zeros(()))
        self.register_buffer("codebook", torch.randn(4, 8))
        self.register_buffer("average", torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.assigned = self.assigned + 1
        h = self.sn(torch.tanh(self.fc(x))) * (1 + 0.5 * self.assigned)
        code = torch.cdist(h.detach(), self.codebook).argmin(1)
        h = h + 0.5 * self.codebook[code]
        with torch.no_grad():
            self.codebook.mul_(0.5).add_(0.5 * h.mean(0))
            self.average.lerp_(h.mean(0), 0.1)
        return h + self.inorm(torch.stack([h, h.roll(1, 1), h.roll(2, 1)], -1)).mean(-1)


class _StatefulNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = _Stateful()
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def test_a_recomputed_module_writes_its_buffers_once_per_forward_and_trains_as_without_recomputation() -> None:
    """Before: the counters at 4 after 2 steps (2 without recomputation), the codebook 0.84 off, spectral norm's
    vectors 1e-2, the update 29 % off; with the recomputation's writes only undone afterwards (it then read what
    the first forward wrote) the update was still 15 % off."""
    torch.manual_seed(0)
    model = _StatefulNet()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    trainer = _plan(micro=8, batch=8, checkpoint=("block",)).wrap(model, torch.optim.SGD(model.parameters(), lr=LR))
    for _ in range(2):
        trainer.step(x, y)
    trainer.unwrap()
    for _ in range(2):
        _plain_step(reference, x, y)
    for (name, a), b in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, name=name: f"buffer {name}: {m}")
    assert int(model.block.calls) == 2
    _assert_same(model, reference)


# ---- precision, warnings, optimizers ----------------------------------------------------------------------------

def test_an_fp32_plan_under_the_callers_autocast_steps_in_fp32_and_leaves_the_autocast_as_it_was() -> None:
    """Before: backward ran under the caller's bf16 autocast, the update 3.2e-3 off the fp32 step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 5))
    reference, start = copy.deepcopy(model), copy.deepcopy(model)
    x, y = torch.randn(8, 64), torch.randint(0, 5, (8,))
    trainer = _plan(micro=4, batch=8).wrap(model, torch.optim.SGD(model.parameters(), lr=LR))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trainer.step(x, y)
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    trainer.unwrap()
    _plain_step(reference, x, y)
    assert _update_error(model, reference, start) < 1e-5
    _assert_same(model, reference)


def test_spectral_norm_under_accumulation_warns_naming_the_module() -> None:
    """Each micro-batch runs a power iteration, so two micro-batches differ from one full-batch step (11 % of the
    update in the issue's case); BatchNorm warns the same way. One micro-batch: no warning."""
    model = nn.Sequential(nn.Linear(6, 8), nn.utils.parametrizations.spectral_norm(nn.Linear(8, 3)))
    with pytest.warns(UserWarning, match=r"spectral norm on '1'.*power iteration"):
        _plan(micro=4, batch=8).wrap(model, torch.optim.SGD(model.parameters(), lr=LR)).unwrap()
    older = nn.Sequential(nn.Linear(6, 8), nn.utils.spectral_norm(nn.Linear(8, 3)))
    with pytest.warns(UserWarning, match=r"spectral norm on '1'"):
        _plan(micro=4, batch=8).wrap(older, torch.optim.SGD(older.parameters(), lr=LR)).unwrap()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _plan(micro=8, batch=8).wrap(model, torch.optim.SGD(model.parameters(), lr=LR)).unwrap()


def test_an_optimizer_whose_step_needs_a_closure_is_refused_at_wrap() -> None:
    """Before: accepted, then a raw TypeError about the closure at the first step."""
    model = _mlp()
    with pytest.raises(autofit.InvalidInputError, match=r"LBFGS\.step needs a closure.*SGD, Adam"):
        _plan(micro=4, batch=8).wrap(model, torch.optim.LBFGS(model.parameters()))
    # nothing was patched: the model wraps again with an optimizer that steps without a closure
    _plan(micro=4, batch=8).wrap(model, torch.optim.SGD(model.parameters(), lr=LR)).unwrap()


@pytest.mark.sim
def test_the_copies_of_written_buffers_are_in_the_estimate_as_in_the_measured_step() -> None:
    """The simulation runs the same checkpoint wrapper, so the buffers it copies are counted as the real step
    allocates them (the allocator's own events, through ``measure``)."""
    torch.manual_seed(0)
    model = _StatefulNet()
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    kwargs = {"target": y, "step": autofit.Step(micro_batch_size=4, checkpoint=("block",)), "optimizer": "sgd"}
    estimate = autofit.estimate(model, x, **kwargs)
    measured = autofit.measure(model, x, **kwargs)
    assert estimate.peak_bytes == measured.peak_bytes, (estimate.peak_bytes, measured.peak_bytes)
