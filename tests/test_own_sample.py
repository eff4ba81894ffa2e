"""A plan fits its own sample (issue 55, Note [rows that differ], autofit/solve/estimator.py): a model that trims
padding to the longest row of its micro-batch, with a sample whose long rows come last. The simulation used to run
only the sample's first rows (short) while the trainer runs every micro-batch of the sample; the CPU allocator's
record of the trainer's real step on that same sample is the truth."""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import autofit
import autofit.simulate.run as run
from autofit.emit.trainer import Trainer
from autofit.measure.allocator import measure_callable
from autofit.simulate.sample_rows import sample_micro_batches
from autofit.training.batch import as_batch, micro_batch_bounds

ROWS, LENGTH, SHORT, VOCAB, DIM = 32, 256, 4, 64, 32
BUDGET = 1_000_000


class TrimsPadding(nn.Module):
    """Slices the sequence to the longest real row of the micro-batch (a common speed trick)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, attention_mask, labels):
        longest = int(attention_mask.sum(1).max())
        ids, labels = input_ids[:, :longest], labels[:, :longest]
        logits = self.head(self.mlp(self.emb(ids)))
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)}


class ChecksMask(TrimsPadding):
    """Reads the mask's values (``mask.all()``, as Hugging Face models do to drop an all-ones mask) with every row
    answering alike: the rows do not change the step."""

    def forward(self, input_ids, attention_mask, labels):
        if bool(attention_mask.all()):
            attention_mask = None
        logits = self.head(self.mlp(self.emb(input_ids)))
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())}


class ReadsNothing(TrimsPadding):
    def forward(self, input_ids, attention_mask, labels):
        logits = self.head(self.mlp(self.emb(input_ids * attention_mask)))
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)}


def _sample(long_last: bool = True) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (ROWS, LENGTH), generator=g)
    real = torch.full((ROWS,), SHORT)
    real[ROWS // 2:] = LENGTH  # the long rows last
    if not long_last:
        real = real.flip(0)
    mask = (torch.arange(LENGTH)[None, :] < real[:, None]).long()
    return {"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _measured(plan, model, sample) -> int:
    """The CPU allocator's peak of the trainer's real step on ``sample``."""
    ours = copy.deepcopy(model)
    with plan.wrap(ours, torch.optim.SGD(ours.parameters(), lr=0.1)) as trainer:
        live = [*ours.parameters(), *ours.buffers(), *as_batch(sample).tensors()]
        return measure_callable(lambda: trainer.step(sample), live)


def _plan(model, sample):
    return autofit.plan(model, sample, BUDGET, device="cpu", optimizer="sgd", precision="fp32")


@pytest.mark.slow
def test_a_plan_holds_the_largest_micro_batch_of_its_own_sample_and_says_the_rows_differ():
    # Before (issue 55): planned 1 x 32 at a predicted 370,444 B (the first rows, 4 tokens long), and the trainer's
    # real step on the same sample peaked at 821,004 B (2.2x the prediction), with no note. After: 1 x 32 at
    # 871,052 B, measured 821,004 B, the note naming micro-batch 17 (row 16). With rows of 320 tokens the plan
    # before was the same at 419,596 B and the real step 1,001,228 B, over the budget; after, the planner says no
    # configuration fits 1,000,000 B.
    torch.manual_seed(0)
    model, sample = TrimsPadding(), _sample()
    plan = _plan(model, sample)
    measured = _measured(plan, model, sample)
    assert measured <= plan.device_bytes <= BUDGET, (
        f"{plan.micro_batch_size} x {plan.gradient_accumulation_steps}: planned {plan.device_bytes:,} B, the "
        f"trainer's step on the sample measured {measured:,} B")
    notes = [n for n in plan.notes if n.startswith("the rows differ")]
    assert notes and "the largest is micro-batch" in notes[0], plan.notes
    # the largest micro-batch named is one of the long rows' (the second half of the sample)
    first_row = int(re.search(r"the largest is micro-batch \d+ of \d+ \(rows? (\d+)", notes[0]).group(1))
    assert first_row + plan.micro_batch_size > ROWS // 2, notes[0]


@pytest.mark.slow
def test_a_model_whose_reads_every_micro_batch_answers_alike_simulates_once_per_estimate(monkeypatch):
    """``mask.all()`` is read, but every micro-batch of the sample answers it alike: no micro-batch is simulated
    beyond the first rows (the reads, run on each micro-batch's rows, tell them apart), and no note."""
    calls = []
    real = run._simulate_step
    monkeypatch.setattr(run, "_simulate_step", lambda *a, **k: calls.append(a[1]) or real(*a, **k))
    sample = _sample()
    sample["attention_mask"] = torch.ones_like(sample["attention_mask"])
    est = autofit.estimate(ChecksMask(), sample, step=4, optimizer="sgd")
    assert len(calls) == 1
    from autofit.solve.estimator import Estimator
    seen = []
    monkeypatch.setattr(Estimator, "_largest_rows",
                        lambda self, first, *a: seen.append(first.row_reader) or first)
    plan = _plan(ChecksMask(), sample)
    assert seen and all(r == "" for r in seen), seen  # the reads were seen (at the top level)...
    assert not any(n.startswith("the rows differ") for n in plan.notes)
    assert est.peak_bytes > 0


@pytest.mark.sim
def test_a_model_that_reads_no_values_takes_the_path_it_always_took(monkeypatch):
    """No value of the rows read: ``Simulation.row_reader`` is None and not one simulation more is run."""
    from autofit.solve.estimator import Estimator
    more = []
    monkeypatch.setattr(Estimator, "_largest_rows", lambda self, *a: more.append(a) or a[0])
    plan = _plan(ReadsNothing(), _sample())
    assert not more
    assert not any(n.startswith("the rows differ") for n in plan.notes)


@pytest.mark.parametrize("batch_rows, rows, least, bounds", [
    (32, 6, 1, [(0, 6), (6, 12), (12, 18), (18, 24), (24, 30), (30, 32)]),
    (10, 4, 3, [(0, 4), (4, 7), (7, 10)]),  # the rest of 2 < 3 takes one row from the micro-batch before
    (9, 4, 2, [(0, 4), (4, 7), (7, 9)]),
    (8, 8, 2, [(0, 8)]),
    (7, 3, 3, [(0, 3), (3, 6), (6, 7)]),  # the one before cannot give 2 rows and keep 3: left as it is
])
def test_micro_batch_bounds_are_the_trainers(batch_rows, rows, least, bounds):
    # by hand (Note [micro-batches a model refuses]); the trainer cuts by the same function
    trainer = SimpleNamespace(plan=SimpleNamespace(min_rows=least))
    assert micro_batch_bounds(batch_rows, rows, least) == bounds
    assert Trainer._bounds(trainer, batch_rows, rows) == bounds


def test_the_sample_micro_batches_by_hand():
    """Rows 0..5 of a sample whose rows 0-2 are alike and 3-5 are alike; 2 ranks of 3 rows, micro-batches of 2:
    rank 0 cuts rows 0-1 and 2, rank 1 rows 3-4 and 5; the last of each is resized to 2 rows (repeated)."""
    values = torch.tensor([[0], [0], [0], [1], [1], [1]])
    batch = as_batch((values,))
    rows = sample_micro_batches(batch, None, batch_size=6, per_rank=3, micro=2)
    assert [r.label for r in rows] == ["micro-batch 1 of 2 of rank 0 (rows 0 to 1)",
                                       "micro-batch 2 of 2 of rank 0 (row 2)",
                                       "micro-batch 1 of 2 of rank 1 (rows 3 to 4)",
                                       "micro-batch 2 of 2 of rank 1 (row 5)"]
    assert [r.distinct for r in rows] == [True, False, True, False]
    assert [r.batch.args[0].flatten().tolist() for r in rows] == [[0, 0], [0, 0], [1, 1], [1, 1]]
    # a sample of 3 rows for a batch of 4: the sample repeated to the batch
    rows = sample_micro_batches(as_batch((values[2:5],)), None, batch_size=4, per_rank=4, micro=3)
    assert [r.label for r in rows] == ["micro-batch 1 of 2 (rows 0 to 2)",
                                       "micro-batch 2 of 2 (row 3 of the sample repeated)"]
    assert [r.batch.args[0].flatten().tolist() for r in rows] == [[0, 1, 1], [0, 0, 0]]


class _Program:
    """A stand-in for RowProgram whose one read answers ``value > 4`` (a long row, say)."""

    def __init__(self, answer: bool, usable: bool = True) -> None:
        self.answer, self.usable, self.unpickled = answer, usable, not usable

    def same_answers(self, inputs) -> bool:
        return self.usable and bool(inputs[0].max() > 4) == self.answer


def test_each_step_runs_one_micro_batch_per_answer_and_the_first_again_without_its_program():
    """Rows 0, 0, 5, 7, 9, 1 in micro-batches of 1: the read tells 'long' (5, 7, 9) from 'short' (0, 1), so besides
    the first rows one micro-batch runs (row 2, the first long one). A first result whose program did not come back
    from a worker (not usable) is run again here, which keeps it."""
    from autofit.simulate.sample_rows import each_step
    batch = as_batch((torch.tensor([[0], [0], [5], [7], [9], [1]]),))
    rows = sample_micro_batches(batch, None, batch_size=6, per_rank=6, micro=1)
    ran = []

    def run(r):
        ran.append(r.label)
        return _Program(bool(r.batch.args[0].max() > 4))

    done = each_step(rows, _Program(False, usable=False), run, lambda p: p)
    assert ran == ["micro-batch 1 of 6 (row 0)", "micro-batch 3 of 6 (row 2)"]
    assert [r.label for r, _ in done] == ran


def _simulation_of(monkeypatch, model, sample, micro: int):
    """The Simulation ``autofit.estimate`` makes of ``sample``'s first ``micro`` rows."""
    import autofit.api as api
    sims = []
    real = api.simulate_step
    monkeypatch.setattr(api, "simulate_step", lambda *a, **k: sims.append(real(*a, **k)) or sims[-1])
    autofit.estimate(model, sample, step=micro, optimizer="sgd")
    return sims[-1]


@pytest.mark.sim
def test_the_reads_run_again_on_other_rows_answer_as_those_rows_would(monkeypatch):
    """The program of the padding-trimming model's reads, recorded on short rows, run on other rows: the same
    answer for other short rows, another for a long row (hand truth: the longest mask of each)."""
    sample = _sample()
    sim = _simulation_of(monkeypatch, TrimsPadding(), sample, micro=2)
    assert sim.row_reader == "" and sim.row_program.usable
    rows = sample_micro_batches(as_batch(sample), None, batch_size=ROWS, per_rank=ROWS, micro=2)
    same = [sim.row_program.same_answers(r.batch.tensors()) for r in rows]
    # rows 0-15 are SHORT long, 16-31 LENGTH: micro-batches 1-8 answer as the first, 9-16 do not
    assert same == [True] * 8 + [False] * 8


@pytest.mark.sim
def test_a_program_past_its_bytes_stops_but_the_read_still_counts(monkeypatch):
    import autofit.simulate.value_twins as value_twins
    monkeypatch.setattr(value_twins, "MAX_PROGRAM_BYTES", -1)
    sim = _simulation_of(monkeypatch, TrimsPadding(), _sample(), micro=2)
    assert sim.row_reader == "" and not sim.row_program.usable and not sim.row_program.steps
