"""Variable-length batches (Note [the length of a batch], Note [rows by length]): a causal LM planned at its longest
batch under a budget the full batch misses, then trained on shorter batches. The CPU allocator is the truth for each
step's peak, and one full-batch SGD step on the mean over real tokens is the truth for each update."""

from __future__ import annotations

import copy

import pytest
import torch

import autofit
from autofit.training.batch import as_batch
from autofit.core.errors import InvalidInputError
from autofit.training.length import batch_length, cut_to_length, length_spec
from autofit.measure.allocator import measure_callable
from autofit.solve.lengths import rows_by_length, rows_for_length, table_lengths

transformers = pytest.importorskip("transformers")

ROWS, LENGTH, VOCAB, LR = 16, 64, 64, 0.1


def _model():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _batch(length: int, seed: int) -> dict[str, torch.Tensor]:
    """A dynamically padded batch: each row's real length is drawn up to ``length``, labels -100 after it."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (ROWS, length), generator=g)
    real = torch.randint(1, length + 1, (ROWS,), generator=g)
    real[0] = length  # the longest row sets the batch's length, as a padding collator does
    mask = (torch.arange(length)[None, :] < real[:, None]).long()
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}


@pytest.fixture(scope="module")
def planned():
    """The plan at the longest batch under a budget a third of the way from the smallest one to the full batch's.
    fp32 without recomputation, so that the micro-batch is the knob and the reference step is exact."""
    model, sample = _model(), _batch(LENGTH, seed=0)
    knobs = dict(device="cpu", optimizer="sgd", precision="fp32", savers=autofit.Savers(checkpoint=None),
                 search=autofit.Search(variable_length=True))
    full = autofit.estimate(model, sample, step=ROWS, optimizer="sgd").peak_bytes
    with pytest.raises(autofit.InfeasibleBudgetError) as info:
        autofit.plan(model, sample, 1, **knobs)
    budget = info.value.min_budget_bytes + (full - info.value.min_budget_bytes) // 3
    return autofit.plan(model, sample, budget, **knobs), model, full


def _measured_step(trainer, model, inputs) -> int:
    live = [*model.parameters(), *model.buffers(), *as_batch(inputs).tensors()]
    return measure_callable(lambda: trainer.step(inputs), live)


@pytest.mark.sim
def test_shorter_batches_run_fewer_micro_batches_within_the_budget_and_equal_a_full_batch_step(planned):
    plan, model, full = planned
    assert full > plan.budget_bytes, "the full batch fits: the test does not bite"
    assert plan.micro_batch_size < ROWS and plan.lengths.length == LENGTH
    assert [n for n, _ in plan.rows_by_length] == [64, 32, 16, 8]
    micro_batches = {}
    for length in (LENGTH, LENGTH // 2, LENGTH // 4):
        inputs = _batch(length, seed=length)
        reference = copy.deepcopy(model)
        ours = copy.deepcopy(model)
        trainer = plan.wrap(ours, torch.optim.SGD(ours.parameters(), lr=LR))
        try:
            peak = _measured_step(trainer, ours, inputs)
            micro_batches[length] = trainer.micro_batches
        finally:
            trainer.unwrap()
        assert peak <= plan.budget_bytes, f"length {length}: measured {peak:,} B over the budget {plan.budget_bytes:,}"
        assert trainer.micro_batches == -(-ROWS // plan.micro_batch_size_for(length))

        # the truth: one SGD step on the whole batch, whose HF loss is the mean over its real (shifted) tokens
        opt = torch.optim.SGD(reference.parameters(), lr=LR)
        reference(**inputs).loss.backward()
        opt.step()
        for (name, a), b in zip(ours.named_parameters(), reference.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{length} {name}: {m}")
    assert micro_batches[LENGTH // 4] < micro_batches[LENGTH // 2] <= micro_batches[LENGTH], micro_batches


@pytest.mark.sim
def test_without_asking_no_table_is_estimated_and_every_batch_runs_the_plans_micro_batch(planned, monkeypatch):
    """The table is a dozen full estimates (450 s of a 405B plan): computed only when asked for (issue 56)."""
    import autofit.solve.finish as finish

    asked, model, _ = planned
    estimated = []
    real = finish._rows_peak
    monkeypatch.setattr(finish, "_rows_peak", lambda *a: estimated.append(a[-2:]) or real(*a))
    plan = autofit.plan(model, _batch(LENGTH, seed=0), asked.budget_bytes, device="cpu", optimizer="sgd",
                        precision="fp32", savers=autofit.Savers(checkpoint=None))
    assert estimated == [] and plan.rows_by_length == ()
    assert (plan.micro_batch_size, plan.device_bytes) == (asked.micro_batch_size, asked.device_bytes)
    assert plan.micro_batch_size_for(LENGTH // 4) == plan.micro_batch_size
    assert any("variable_length=True" in n for n in plan.notes), plan.notes


def test_a_batch_longer_than_the_plan_is_refused_naming_both_shapes(planned):
    plan, model, _ = planned
    ours = copy.deepcopy(model)
    trainer = plan.wrap(ours, torch.optim.SGD(ours.parameters(), lr=LR))
    before = [p.detach().clone() for p in ours.parameters()]
    longer = _batch(LENGTH + 8, seed=3)
    with pytest.raises(InvalidInputError, match=r"\(72,\).*\(64,\)"):
        trainer.step(longer)
    trainer.unwrap()
    assert all(torch.equal(a, b) for a, b in zip(before, ours.parameters())), "the refused step changed the model"
    with pytest.raises(InvalidInputError, match="72.*64"):
        plan.micro_batch_size_for(LENGTH + 8)


def test_the_table_is_in_the_json_str_and_round_trips(planned):
    plan = planned[0]
    again = autofit.Plan.from_json(plan.to_json())
    assert again.rows_by_length == plan.rows_by_length and again.lengths == plan.lengths
    assert "rows by length" in str(plan) and f"{LENGTH}: {plan.micro_batch_size}" in str(plan)
    old = plan.to_dict()
    del old["lengths"], old["rows_by_length"]  # a plan written before variable-length batches
    import json

    legacy = autofit.Plan.from_json(json.dumps(old))
    assert legacy.micro_batch_size_for(LENGTH // 4) == plan.micro_batch_size


# ---- the pieces, against hand computations ---------------------------------------------------------------------------
def test_length_rule_cuts_ids_masks_and_labels_together_and_leaves_images_alone():
    sample = {"input_ids": torch.zeros(4, 10, dtype=torch.long), "attention_mask": torch.ones(4, 10),
              "pixel_values": torch.zeros(4, 3, 10, 10), "row_label": torch.zeros(4)}
    spec = length_spec(as_batch(sample), None)
    assert spec.length == 10 and spec.length_tensors == (True, True, False, False)
    short = cut_to_length(as_batch(sample), spec, 3)
    assert short.kwargs["input_ids"].shape == (4, 3) and short.kwargs["attention_mask"].shape == (4, 3)
    assert short.kwargs["pixel_values"].shape == (4, 3, 10, 10)
    assert length_spec(as_batch(torch.zeros(2, 3, 8, 8)), None).length is None  # images: no length
    assert length_spec(as_batch(torch.zeros(2, 6)), None).length is None  # an MLP's [batch, features]: no length
    assert length_spec(as_batch(torch.zeros(2, 6, 100)), None).length is None  # [batch, channels, time]: none
    embeds = length_spec(as_batch({"inputs_embeds": torch.zeros(2, 7, 4), "labels": torch.zeros(2, 7).long()}), None)
    assert embeds.length == 7 and embeds.length_tensors == (True, True)
    assert batch_length(spec, short, None) == 3


def test_a_batch_of_another_structure_is_refused():
    spec = length_spec(as_batch({"input_ids": torch.zeros(4, 10, dtype=torch.long)}), None)
    with pytest.raises(InvalidInputError, match="same tensors"):
        batch_length(spec, as_batch({"input_ids": torch.zeros(4, 10, 2, dtype=torch.long)}), None)


def test_table_lengths_and_lookup_by_hand():
    assert table_lengths(100) == (100, 50, 25, 13)
    table = ((100, 2), (50, 4), (25, 7), (13, 9))
    assert [rows_for_length(table, n) for n in (100, 51, 50, 26, 25, 14, 13, 1)] == [2, 2, 4, 4, 7, 7, 9, 9]


def test_rows_by_length_takes_the_guess_when_it_fits_and_the_line_when_it_misses():
    # activations linear in rows x length: the guess rows(L) * L / l fits exactly, one estimate per length
    calls = []

    def linear(length, rows):
        calls.append((length, rows))
        return rows * length * 10

    assert rows_by_length(40, 2, 64, 1000, linear) == ((40, 2), (20, 4), (10, 8), (5, 16))
    assert len(calls) == 3
    # plus 100 bytes a row that do not shrink with the length: the guess misses, the line through the guess and the
    # floor finds the largest rows that fit (by hand: rows * (10 l + 100) <= 1000 gives 3 at l=20, 5 at l=10, 6 at
    # l=5), three estimates at most per length
    calls.clear()

    def per_row(length, rows):
        calls.append((length, rows))
        return rows * (length * 10 + 100)

    assert rows_by_length(40, 2, 64, 1000, per_row) == ((40, 2), (20, 3), (10, 5), (5, 6))
    assert len(calls) <= 9
    # one row count between the floor and a guess that misses: estimated at once, the floor not estimated (it fitted
    # at the longer length); none between: the guess alone. A batch of 4 rows, 4 rows never fitting, 3 fitting at 20
    calls.clear()

    def four_never(length, rows):
        calls.append((length, rows))
        return 2000 if rows == 4 else rows * length * 10

    assert rows_by_length(40, 2, 4, 1000, four_never) == ((40, 2), (20, 3), (10, 3), (5, 3))
    assert calls == [(20, 4), (20, 3), (10, 4), (5, 4)]
    # never more rows than the batch, never fewer than fit at a longer length
    assert rows_by_length(40, 2, 5, 1000, linear)[-1] == (5, 5)
    assert rows_by_length(40, 2, 64, 1000, lambda n, r: 10**9 if r > 2 else 0) == ((40, 2), (20, 2), (10, 2), (5, 2))
