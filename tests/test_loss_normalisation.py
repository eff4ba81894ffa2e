"""Token-mean losses under accumulation: one ``trainer.step`` equals one plain full-batch fp32 step when micro-batches
hold different numbers of real tokens (positions labelled -100 are ignored by F.cross_entropy and by Hugging Face
losses). The reference is plain PyTorch / transformers on the whole batch; the trainer weighs micro-batch i by
n_i / N (See Note [loss normalisation]). Each test also checks that weighting by rows, the accumulation bug of
transformers < 4.46 (huggingface/transformers#34191), would have failed it, so the data really is uneven.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autofit
from autofit.emit.plan import Plan
from autofit.training.precision import PrecisionPolicy
from autofit.core.report import MemoryEstimate

RTOL, ATOL = 1e-5, 1e-6  # fp32: only the order of additions differs from the full-batch step
LR = 0.1


def _plan(*, micro: int, batch: int) -> Plan:
    k = -(-batch // micro)
    return Plan(
        micro_batch_size=micro, gradient_accumulation_steps=k, batch_size=batch,
        last_micro_batch_size=batch - micro * (k - 1), precision=PrecisionPolicy(name="fp32"), checkpoint=(),
        peak_bytes=1, device_bytes=1, budget_bytes=1, device="cpu", optimizer="sgd", predicted_step_seconds=0.0,
        estimate=MemoryEstimate(peak_bytes=1, breakdown={}),
    )


def _call(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def _full_batch_step(model, inputs, target, loss_fn) -> float:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    output = _call(model, inputs)
    loss = output.loss if loss_fn is None else loss_fn(output, target)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _row_weighted_step(model, inputs, target, loss_fn, micro: int) -> None:
    """What the trainer did before: each micro-batch's mean weighted by its rows (the bug under test)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    rows = next(iter(inputs.values())).shape[0] if isinstance(inputs, dict) else inputs.shape[0]
    for start in range(0, rows, micro):
        part = {k: v[start:start + micro] for k, v in inputs.items()} if isinstance(inputs, dict) \
            else inputs[start:start + micro]
        part_target = None if target is None else _rows(target, start, start + micro)
        output = _call(model, part)
        loss = output.loss if loss_fn is None else loss_fn(output, part_target)
        n = (next(iter(part.values())) if isinstance(part, dict) else part).shape[0]
        (loss * (n / rows)).backward()
    opt.step()


def _rows(target, start, stop):
    return {k: v[start:stop] for k, v in target.items()} if isinstance(target, dict) else target[start:stop]


def _update_error(model, before, other) -> float:
    """Largest relative difference (in norm) between two parameter updates."""
    worst = 0.0
    for p0, a, b in zip(before.parameters(), model.parameters(), other.parameters()):
        ref = (b - p0).detach()
        if ref.norm() > 0:
            worst = max(worst, float(((a - p0) - ref).detach().norm() / ref.norm()))
    return worst


_SAME = object()


def _check(model, inputs, target, *, micro: int, loss_fn=None, trainer_loss_fn=_SAME) -> float:
    """Trainer vs full-batch step; returns how far row weighting lands from the full-batch step. The reference
    computes ``loss_fn`` (``output.loss`` when None); the trainer runs ``trainer_loss_fn`` (default: the same)."""
    if trainer_loss_fn is _SAME:
        trainer_loss_fn = loss_fn
    batch = next(iter(inputs.values())).shape[0] if isinstance(inputs, dict) else inputs.shape[0]
    before, ref, ours, rows = (copy.deepcopy(model) for _ in range(4))
    ref_loss = _full_batch_step(ref, inputs, target, loss_fn)
    trainer = _plan(micro=micro, batch=batch).wrap(ours, torch.optim.SGD(ours.parameters(), lr=LR),
                                                   loss_fn=trainer_loss_fn)
    our_loss = trainer.step(inputs, target)
    trainer.unwrap()
    assert our_loss == pytest.approx(ref_loss, rel=RTOL)
    for (name, a), b, b0 in zip(ours.named_parameters(), ref.parameters(), before.parameters()):
        if b.grad is None:
            continue
        assert not torch.equal(b, b0) or not b.grad.any(), f"{name}: the reference did not move it"
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=lambda m, name=name: f"{name}: {m}")
    _row_weighted_step(rows, inputs, target, loss_fn, micro)
    return _update_error(rows, before, ref)


def _pad(tokens: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """-100 after each row's real length."""
    labels = tokens.clone()
    for row, n in enumerate(lengths):
        labels[row, n:] = -100
    return labels


# ---- Hugging Face causal LM given labels ----------------------------------------------------------------------------
def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0,
                                     embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def test_hf_causal_lm_padded_labels_match_a_full_batch_step():
    model = _tiny_gpt2()
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (6, 12), generator=g)
    lengths = [12, 2, 9, 1, 12, 4]  # micro-batches of 4 + 2 (uneven last): 24 + 16 shifted tokens of 40
    mask = (_pad(ids, lengths) != -100).long()
    inputs = {"input_ids": ids, "attention_mask": mask, "labels": _pad(ids, lengths)}
    row_error = _check(model, inputs, None, micro=4)
    assert row_error > 0.2, f"row weighting lands {row_error:.1%} from the full-batch step: the test does not bite"


def test_hf_counts_shifted_labels():
    # ForCausalLMLoss predicts label t+1 from position t: the first label of each row is never a target
    from autofit.training.batch import as_batch
    from autofit.training.normalisation import count_items, item_counter

    model = _tiny_gpt2()
    labels = torch.tensor([[5, 6, 7, -100], [8, -100, -100, -100]])
    batch = as_batch({"input_ids": labels.clamp(min=0), "labels": labels})
    counter = item_counter(model, None, batch, None)
    assert count_items(counter, batch, None, [(0, 1), (1, 2)]) == (2, 0)  # by hand: [6, 7] and []


# ---- the default loss: cross-entropy against a -100-padded target ---------------------------------------------------
class TinyLM(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(idx))))


def _lm_data(lengths: list[int], seq: int = 10, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 32, (len(lengths), seq), generator=g)
    return idx, _pad(torch.randint(0, 32, (len(lengths), seq), generator=g), lengths)


def _default_ce(output, target):
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1))


def test_default_cross_entropy_against_padded_target_matches_a_full_batch_step():
    torch.manual_seed(0)
    idx, target = _lm_data([10, 1, 7, 2, 10, 3, 9])  # batch 7 in micro-batches of 3: 3 + 3 + 1
    # the reference computes the loss the default does; the trainer runs with loss_fn=None
    row_error = _check(TinyLM(), idx, target, micro=3, loss_fn=_default_ce, trainer_loss_fn=None)
    assert row_error > 0.2, f"row weighting lands {row_error:.1%} from the full-batch step: the test does not bite"


def test_micro_batch_of_padding_only_weighs_nothing():
    torch.manual_seed(0)
    idx, target = _lm_data([10, 4, 0, 0, 6, 3])  # the second micro-batch of 2 holds no token at all
    _check(TinyLM(), idx, target, micro=2, loss_fn=_default_ce, trainer_loss_fn=None)


def test_batch_without_any_item_is_an_error():
    torch.manual_seed(0)
    model = TinyLM()
    idx, target = _lm_data([0, 0, 0, 0])
    trainer = _plan(micro=2, batch=4).wrap(model, torch.optim.SGD(model.parameters(), lr=LR))
    with pytest.raises(autofit.InvalidInputError, match="no items"):
        trainer.step(idx, target)


# ---- a user's loss through the protocol --------------------------------------------------------------------------
def _masked_mse(output, target):
    """Mean squared error over the positions whose mask is set: an item mean, not a row mean."""
    mask = target["mask"]
    return ((output - target["y"]) ** 2 * mask.unsqueeze(-1)).sum() / (mask.sum() * output.shape[-1])


class TokenRegressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def _regression_data():
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(9, 8, 4, generator=g), torch.randn(9, 8, 3, generator=g)
    lengths = torch.tensor([8, 8, 8, 7, 1, 1, 2, 1, 8])  # micro-batches of 4: 31, 5 and 8 items
    mask = (torch.arange(8).unsqueeze(0) < lengths.unsqueeze(1)).float()
    return x, {"y": y, "mask": mask}


def test_user_loss_through_item_mean_protocol_matches_a_full_batch_step():
    torch.manual_seed(0)
    x, target = _regression_data()
    loss_fn = autofit.ItemMeanLoss(_masked_mse, count_items=lambda inputs, t: t["mask"].sum())
    row_error = _check(TokenRegressor(), x, target, micro=4, loss_fn=loss_fn)  # 4 + 4 + 1
    assert row_error > 0.2, f"row weighting lands {row_error:.1%} from the full-batch step: the test does not bite"


def test_any_loss_with_count_items_follows_the_protocol():
    torch.manual_seed(0)
    x, target = _regression_data()

    def loss_fn(output, t):
        return _masked_mse(output, t)

    loss_fn.count_items = lambda inputs, t: int(t["mask"].sum())
    _check(TokenRegressor(), x, target, micro=2, loss_fn=loss_fn)


def test_item_mean_loss_validates_its_fields():
    with pytest.raises(autofit.InvalidInputError, match="count_items"):
        autofit.ItemMeanLoss(_masked_mse, count_items=3)
    with pytest.raises(autofit.InvalidInputError, match="loss"):
        autofit.ItemMeanLoss("mse", count_items=len)
