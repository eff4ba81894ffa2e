"""A batch that is not dim 0 (Note [the batch dimension], autofit/training/batch.py): ``nn.LSTM``'s default input is
time-major, (seq, batch, feature). Split along dim 0 it was cut along time: a micro-batch of 4 "rows" was 4 time
steps of every sequence, so the estimate priced another step and the trainer trained on another loss. The truths:
the allocator (``measure``) for the estimate, a plain full-batch PyTorch step for the trainer's update."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autofit
from autofit.core.errors import InvalidInputError
from autofit.emit.plan import Plan
from autofit.training.batch import as_batches

SEQ, BATCH, FEATURES, HIDDEN, CLASSES = 24, 8, 16, 64, 5
TOLERANCE = 0.01  # as tests/test_accuracy.py
LR = 0.1


class Tagger(nn.Module):
    """One label per time step: (seq, batch, feature) in, (seq, batch, classes) out."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(FEATURES, HIDDEN)  # batch_first=False: time-major
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0])


class LastStep(Tagger):
    """One label per sequence, read off the last time step: (batch, classes) out, a (batch,) target."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.lstm(x)[0][-1])


def _tokens(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, CLASSES), target.reshape(-1))


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SEQ, BATCH, FEATURES, generator=g)
    return x, torch.randint(0, CLASSES, (SEQ, BATCH), generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g)


@pytest.mark.sim
@pytest.mark.parametrize("per_sequence", [False, True], ids=["per-step-target", "per-sequence-target"])
def test_time_major_estimate_matches_measure(per_sequence: bool) -> None:
    torch.manual_seed(0)
    x, tags, labels = _data()
    model, target = (LastStep(), labels) if per_sequence else (Tagger(), tags)
    dims = (1, 0) if per_sequence else 1
    kw = dict(target=target, loss_fn=F.cross_entropy if per_sequence else _tokens,
              optimizer="adam", batch_dim=dims, step=autofit.Step(micro_batch_size=4, accumulation_steps=2))
    est = autofit.estimate(model, x, **kw)
    meas = autofit.measure(model, x, **kw)
    error = (est.peak_bytes - meas.peak_bytes) / meas.peak_bytes
    assert abs(error) <= TOLERANCE, f"estimate {est.peak_bytes:,} B vs measured {meas.peak_bytes:,} B ({error:+.2%})"


@pytest.mark.sim
def test_time_major_trainer_matches_a_full_batch_step() -> None:
    torch.manual_seed(0)
    x, tags, _ = _data()
    model = Tagger()
    planned = autofit.plan(model, x, "1GB", target=tags, loss_fn=_tokens, optimizer="sgd", device="cpu",
                           precision="fp32", batch_dim=1)
    assert planned.batch_dim == (1, 1)
    assert Plan.from_json(planned.to_json()).batch_dim == (1, 1)
    # two micro-batches of 4 sequences each, whatever the budget allowed
    plan = replace(Plan.from_json(planned.to_json()), micro_batch_size=4, gradient_accumulation_steps=2,
                   last_micro_batch_size=4)

    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    ref_loss = _tokens(ref(x), tags)
    ref_loss.backward()
    opt.step()
    trainer = plan.wrap(ours, torch.optim.SGD(ours.parameters(), lr=LR), loss_fn=_tokens)
    loss = trainer.step(x, tags)
    assert trainer.micro_batches == 2
    trainer.unwrap()
    assert loss == pytest.approx(float(ref_loss.detach()), rel=1e-6)
    for (name, a), b, b0 in zip(ours.named_parameters(), ref.parameters(), model.parameters()):
        assert not torch.equal(b, b0), name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_batch_dim_rows_and_refusals() -> None:
    x, tags, labels = _data()
    batch, target = as_batches(x, tags, batch_dim=1)
    assert batch.size == BATCH and target.size == BATCH
    micro = batch.slice(2, 5)
    assert tuple(micro.args[0].shape) == (SEQ, 3, FEATURES)
    assert torch.equal(micro.args[0], x[:, 2:5])  # whole sequences, rows 2..4
    assert torch.equal(batch.resize(10).args[0][:, 8:], x[:, :2])  # resized by repeating rows, not time steps
    with pytest.raises(InvalidInputError, match=r"batch_dim=\(inputs', target's\)"):
        as_batches(x, labels, batch_dim=1)  # a (batch,) target has no dim 1
    assert as_batches(x, labels, batch_dim=(1, 0))[0].size == BATCH
    for bad in (-1, "1", (1,), (1, 0, 0), True):
        with pytest.raises(InvalidInputError, match="batch_dim must be"):
            as_batches(x, tags, batch_dim=bad)


FACTORY_SOURCE = f'''
import torch
from torch import nn

def tagger():
    torch.manual_seed(0)
    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM({FEATURES}, {HIDDEN})
            self.head = nn.Linear({HIDDEN}, {CLASSES})
        def forward(self, x):
            return self.head(self.lstm(x)[0][-1])
    g = torch.Generator().manual_seed(0)
    return Tagger(), torch.randn({SEQ}, {BATCH}, {FEATURES}, generator=g), torch.randint(0, {CLASSES}, ({BATCH},))
'''


def _cli(tmp_path, *args: str):
    from typer.testing import CliRunner

    from autofit.cli.app import app

    factory = tmp_path / "time_major.py"
    factory.write_text(FACTORY_SOURCE)
    return CliRunner().invoke(app, ["plan", f"{factory}:tagger", "--budget", "1GB", "--batch-size", str(BATCH),
                                    "--device", "cpu", "--precision", "fp32", *args], catch_exceptions=False)


@pytest.mark.sim
def test_cli_plan_batch_dim_is_recorded(tmp_path) -> None:
    # the factory's target is one label per sequence, (batch,): the inputs' batch is dim 1, the target's dim 0
    result = _cli(tmp_path, "--batch-dim", "1,0", "--json")
    assert result.exit_code == 0, result.output
    plan = Plan.from_json(result.stdout[result.stdout.index("{"):])
    assert plan.batch_dim == (1, 0) and plan.batch_size == BATCH
    refused = _cli(tmp_path, "--batch-dim", "1")  # then the (batch,) target has no dim 1: named, exit 2
    assert refused.exit_code == 2 and "batch_dim=(inputs', target's)" in refused.output


def test_cli_batch_dim_with_generated_inputs_is_refused(tmp_path) -> None:
    result = _cli(tmp_path, "--batch-dim", "1", "--input-shape", "24,16")
    assert result.exit_code == 2 and "--batch-dim" in result.output and "Traceback" not in result.output
