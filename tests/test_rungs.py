"""The opt-in rungs of the ladder (issue 24; Note [the ladder], autofit/solve/ladder.py): ``plan(allow=...)`` with
"8bit-optimizer" (Note [8-bit optimizer state], autofit/training/optim.py) and "chunked-loss" (Note [chunked cross-entropy],
autofit/training/chunked_loss.py). Truths: the CPU allocator (``autofit.measure``, ``measure_callable`` around the trainer's
real step), a plain step of the same optimizer written out here, and the unchunked loss and gradients of torch."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autofit
from autofit.features import FEATURES
from autofit.training.batch import as_batch
from autofit.training.chunked_loss import LossChunks, chunked_cross_entropy
from autofit.core.errors import InfeasibleBudgetError, InvalidInputError, UnsupportedModelError
from autofit.measure.allocator import measure_callable
from autofit.training.step import make_step_config, run_micro_batch

TOLERANCE = 0.005


# ---- allow=... ---------------------------------------------------------------------------------------------------
def test_unknown_rung_is_a_typed_error_listing_the_rungs():
    model, x = nn.Linear(4, 4), torch.zeros(2, 4)
    with pytest.raises(InvalidInputError, match="unknown rung '8bit'.*'8bit-optimizer', 'chunked-loss'"):
        autofit.plan(model, x, "1GB", device="cpu", savers=autofit.Savers(allow=("8bit",)))
    with pytest.raises(InvalidInputError, match="sequence of rung names"):
        autofit.plan(model, x, "1GB", device="cpu", savers=autofit.Savers(allow=8))


def test_cli_allow_is_validated():
    from pathlib import Path

    from typer.testing import CliRunner

    from autofit.cli.app import app

    factory = f"{Path(__file__).resolve().parent.parent / 'examples' / 'factories.py'}:small_cnn"
    result = CliRunner().invoke(app, ["plan", factory, "--budget", "1GB", "--batch-size", "2", "--device", "cpu",
                                      "--allow", "8bit-optimizer", "--allow", "fast-math"])
    assert result.exit_code == 2, result.output  # an input error (tests/test_cli.py: EXIT_INPUT)
    assert "unknown rung 'fast-math'" in result.output and "8bit-optimizer" in result.output


# ---- the 8-bit optimizer rung ------------------------------------------------------------------------------------
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(512, 512) for _ in range(12)])


def _mlp_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 512, generator=g), torch.randn(8, 512, generator=g)


@pytest.mark.sim
def test_only_the_8bit_rung_fits_and_the_trainer_runs_it():
    bnb = pytest.importorskip("bitsandbytes")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    model, (x, y) = _mlp(), _mlp_data()
    # By hand: 12 x (512 x 512 + 512) fp32 parameters = 12.6 MB, as much again in gradients, AdamW's two moments
    # 25.2 MB: 50.4 MB before any activation, over 40 MB whatever the micro-batch or checkpointing; stepping in
    # backward drops the gradients but one, still 38 MB of states plus the step's scratch, and the plan proves it:
    budget = 40 * 10**6
    with pytest.raises(InfeasibleBudgetError) as e:
        autofit.plan(model, x, budget, target=y, device="cpu")
    assert budget < e.value.min_budget_bytes
    plan = autofit.plan(model, x, budget, target=y, device="cpu", savers=autofit.Savers(allow=("8bit-optimizer",)))
    assert plan.low_bit_optimizer == "bitsandbytes.optim.AdamW8bit" and plan.chunked_loss is None
    assert plan.device_bytes <= budget
    [note] = [n for n in plan.notes if "rung '8bit-optimizer' climbed" in n]
    assert "saves" in note
    assert autofit.Plan.from_json(plan.to_json()) == plan

    # the trainer swaps the AdamW it is given for the 8-bit one, and its real step fits and matches the estimate
    ours, reference = model, copy.deepcopy(model)
    trainer = plan.wrap(ours, torch.optim.AdamW(ours.parameters(), lr=1e-3))
    assert isinstance(trainer.optimizer, bnb.optim.AdamW8bit)
    trainer.step(x, y)  # warm-up: the state exists from here on, as in the plan's steady state
    plain = bnb.optim.AdamW8bit(reference.parameters(), lr=1e-3)  # AdamW's defaults: betas, eps, weight decay 0.01
    _plain_step(reference, plain, x, y)
    state = [v for s in trainer.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    live = [*ours.parameters(), *state, x, y]
    peak = measure_callable(lambda: trainer.step(x, y), live)
    _plain_step(reference, plain, x, y)
    assert peak <= budget
    assert abs(plan.peak_bytes / peak - 1) <= TOLERANCE, (plan.peak_bytes, peak)
    for a, b in zip(ours.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)  # float rounding of the micro-batch sums at most
    trainer.unwrap()


def _plain_step(model, optimizer, x, y) -> None:
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@pytest.mark.sim
def test_the_8bit_rung_does_not_apply_to_sgd_and_says_so():
    model, (x, y) = _mlp(), _mlp_data()
    with pytest.raises(InfeasibleBudgetError):
        autofit.plan(model, x, 10**6, target=y, device="cpu", optimizer="sgd",
                     savers=autofit.Savers(allow="8bit-optimizer"))
    plan = autofit.plan(model, x, "1GB", target=y, device="cpu", optimizer="sgd",
                        savers=autofit.Savers(allow="8bit-optimizer"))
    assert any("'8bit-optimizer' does not apply to optimizer 'sgd'" in n for n in plan.notes)


# ---- the chunked cross-entropy rung ------------------------------------------------------------------------------
def _llama(vocab: int = 8192):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(config)


def _tokens(rows: int = 4, length: int = 64, vocab: int = 8192) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :5] = -100  # a prompt the loss ignores
    return {"input_ids": ids, "labels": labels}


@pytest.mark.sim
def test_chunked_loss_estimate_equals_measure_and_saves_the_logits():
    model, batch = _llama(), _tokens()
    peaks = {}
    for chunked in (False, True):
        est = autofit.estimate(model, batch, step=autofit.Step(micro_batch_size=4, chunked_loss=chunked))
        meas = autofit.measure(model, batch, step=autofit.Step(micro_batch_size=4, chunked_loss=chunked))
        assert abs(est.peak_bytes / meas.peak_bytes - 1) <= TOLERANCE, (chunked, est.peak_bytes, meas.peak_bytes)
        peaks[chunked] = meas.peak_bytes
    # by hand: the logits are 4 x 64 x 8192 fp32 values = 8.4 MB; the unchunked step holds them, their fp32 copy
    # in the loss and gradients of that size; the chunked one an eighth of that at a time
    logits = 4 * 64 * 8192 * 4
    assert peaks[False] - peaks[True] >= 2 * logits, peaks


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


def test_chunked_loss_and_gradients_equal_the_unchunked_step_hf():
    model, batch = _llama(), _tokens()
    twin = copy.deepcopy(model)
    plain = run_micro_batch(model, as_batch(batch), None, None, make_step_config(micro_batch_size=4), "cpu",
                            features=FEATURES)
    config = make_step_config(micro_batch_size=4, chunked_loss=LossChunks(head="lm_head"))
    chunked = run_micro_batch(twin, as_batch(batch), None, None, config, "cpu", features=FEATURES)
    torch.testing.assert_close(chunked, plain)
    for a, b in zip(_grads(twin), _grads(model)):
        torch.testing.assert_close(a, b)


class _Lm(nn.Module):
    def __init__(self, vocab: int = 1000, dim: int = 32, transform: bool = False) -> None:
        super().__init__()
        self.embed, self.body, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, dim), nn.Linear(dim, vocab)
        self.transform = transform

    def forward(self, ids):
        logits = self.head(torch.tanh(self.body(self.embed(ids))))
        return 30 * torch.tanh(logits / 30) if self.transform else logits  # Gemma 2's soft-capping


@pytest.mark.sim
def test_chunked_default_loss_equals_cross_entropy_and_a_transformed_head_is_refused():
    torch.manual_seed(0)
    model = _Lm()
    twin = copy.deepcopy(model)
    g = torch.Generator().manual_seed(2)
    ids, target = torch.randint(0, 1000, (3, 50), generator=g), torch.randint(0, 1000, (3, 50), generator=g)
    target[0, :7] = -100
    plain = run_micro_batch(model, as_batch(ids), as_batch(target, what="target"), None,
                            make_step_config(micro_batch_size=3), "cpu", features=FEATURES)
    config = make_step_config(micro_batch_size=3, chunked_loss=LossChunks(head="head", chunks=7))  # uneven chunks
    chunked = run_micro_batch(twin, as_batch(ids), as_batch(target, what="target"), None, config, "cpu",
                              features=FEATURES)
    torch.testing.assert_close(chunked, plain)
    for a, b in zip(_grads(twin), _grads(model)):
        torch.testing.assert_close(a, b)
    # torch's own cross-entropy of the full logits, by a separate path
    h = torch.tanh(model.body(model.embed(ids)))
    full = F.cross_entropy(model.head(h).reshape(-1, 1000), target.reshape(-1))
    torch.testing.assert_close(chunked_cross_entropy(h, model.head.weight, model.head.bias, target, 4), full)

    capped = _Lm(transform=True)
    with pytest.raises(UnsupportedModelError, match="soft-capping"):
        autofit.estimate(capped, ids, target=target, step=autofit.Step(micro_batch_size=3, chunked_loss=True))
    with pytest.raises(InvalidInputError, match="chunked_loss=True needs the default loss"):
        autofit.estimate(model, ids, target=target, step=autofit.Step(micro_batch_size=3, chunked_loss=True),
                         loss_fn=lambda out, t: out.float().mean())


@pytest.mark.slow
def test_the_chunked_rung_is_climbed_when_nothing_else_fits():
    model, batch = _llama(), _tokens()
    batch_size = 4
    with pytest.raises(InfeasibleBudgetError) as e:  # the error names the smallest budget without the rung
        autofit.plan(model, batch, 10**5, device="cpu", batch_size=batch_size)
    budget = e.value.min_budget_bytes - 1
    with pytest.raises(InfeasibleBudgetError):
        autofit.plan(model, batch, budget, device="cpu", batch_size=batch_size)
    plan = autofit.plan(model, batch, budget, device="cpu", batch_size=batch_size,
                        savers=autofit.Savers(allow=("chunked-loss",)))
    assert plan.chunked_loss == LossChunks(head="lm_head") and plan.low_bit_optimizer is None
    [note] = [n for n in plan.notes if "rung 'chunked-loss' climbed" in n]
    assert "saves" in note and "8 chunks" in note
    assert autofit.Plan.from_json(plan.to_json()) == plan
    # the trainer runs the chunked step; one step of it equals a plain full-batch step of the model
    reference = copy.deepcopy(model)
    trainer = plan.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loss = trainer.step(batch)
    out = reference(**batch)
    out.loss.backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert loss == pytest.approx(float(out.loss.detach()), rel=1e-5)
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    trainer.unwrap()
