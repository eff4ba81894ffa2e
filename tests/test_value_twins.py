"""Value reads that depend only on constants and inputs, answered inside the fake simulation (Note [value twins],
autofit/simulate/value_twins.py): torch's own nn.Transformer, built on the meta device, estimates and plans; a read
that depends on a weight still refuses, saying so."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autofit
from autofit.core.errors import UnsupportedModelError

pytestmark = pytest.mark.sim  # the simulation tier (tests/conftest.py)


class Seq2Seq(nn.Module):
    """nn.Transformer between token embeddings and a vocabulary head; the causal target mask is built in forward
    from constants (nn.Transformer.generate_square_subsequent_mask), and nn.TransformerDecoder checks whether it is
    causal by comparing values (torch/nn/modules/transformer.py, _detect_is_causal_mask)."""

    def __init__(self, vocab: int = 1000, d_model: int = 64, layers: int = 2, heads: int = 4, ff: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.transformer = nn.Transformer(d_model, heads, layers, layers, ff, batch_first=True)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.head(self.transformer(self.embed(src), self.embed(tgt), tgt_mask=mask))


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def _tokens(rows: int, length: int, vocab: int = 1000) -> torch.Tensor:
    return torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(0))


class WeightGate(nn.Module):
    """Branches on a weight's value: no constant or input decides it, so a meta model cannot be simulated."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.linear.weight.sum() > 0:
            return self.linear(x)
        return self.linear(x).relu()


def test_nn_transformer_estimate_on_fake_tensors_equals_the_cpu_allocator():
    """With real weights the step used to run for real (the value read); now it is simulated on fake tensors, and
    the estimate is the allocator's own record."""
    torch.manual_seed(0)
    model = Seq2Seq()
    src, tgt = _tokens(4, 32), _tokens(4, 32)
    est = autofit.estimate(model, (src, tgt), step=4, target=tgt, loss_fn=_loss)
    measured = autofit.measure(model, (src, tgt), step=4, target=tgt, loss_fn=_loss)
    assert est.method == "fake"
    assert abs(est.peak_bytes - measured.peak_bytes) <= 0.005 * measured.peak_bytes, (est.peak_bytes,
                                                                                       measured.peak_bytes)


def test_nn_transformer_on_meta_estimates_as_built_on_the_cpu():
    torch.manual_seed(0)
    real = Seq2Seq()
    with torch.device("meta"):
        meta = Seq2Seq()
    src, tgt = _tokens(4, 32), _tokens(4, 32)
    on_meta = autofit.estimate(meta, (src, tgt), step=2, target=tgt, loss_fn=_loss)
    measured = autofit.measure(real, (src, tgt), step=2, target=tgt, loss_fn=_loss)
    assert abs(on_meta.peak_bytes - measured.peak_bytes) <= 0.005 * measured.peak_bytes


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_nn_transformer_on_meta_plans_at_world_size_2(strategy):
    with torch.device("meta"):
        model = Seq2Seq()
    src, tgt = _tokens(4, 32), _tokens(4, 32)
    plan = autofit.plan(model, (src, tgt), "64MB", batch_size=8, target=tgt, loss_fn=_loss, device="cpu",
                        precision="fp32", layout=autofit.Layout(world_size=2, strategy=strategy))
    assert plan.parallel.strategy == strategy and plan.device_bytes <= plan.budget_bytes


def test_a_value_read_from_a_weight_still_refuses_on_meta():
    with torch.device("meta"):
        model = WeightGate()
    with pytest.raises(UnsupportedModelError, match="computed from its weights") as info:
        autofit.estimate(model, torch.randn(4, 16), step=4, loss_fn=lambda out: out.sum())
    assert "meta" in str(info.value)  # and what to do: build it with real weights


def test_a_value_read_from_a_weight_runs_for_real_with_real_weights():
    torch.manual_seed(0)
    model = WeightGate()
    est = autofit.estimate(model, torch.randn(4, 16), step=4, loss_fn=lambda out: out.sum())
    assert est.method == "real"


def test_a_twin_written_by_an_op_without_twins_is_forgotten():
    """An in-place write whose other input has no values (a weight) leaves the written tensor's values unknown: a
    read of it, or of a view of it, refuses instead of answering from a stale twin."""

    class Stale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            counts = torch.zeros(8)
            view = counts[:4]
            counts.add_(self.scale.detach())  # a weight's values, written into a constant
            if view.sum() > 0:
                return x * self.scale
            return x

    with torch.device("meta"):
        model = Stale()
    with pytest.raises(UnsupportedModelError, match="computed from its weights"):
        autofit.estimate(model, torch.randn(2, 8), step=2, loss_fn=lambda out: out.sum())


@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow(seconds=50)),
                                      pytest.param("fsdp2", marks=pytest.mark.slow(seconds=130))])
def test_a_1b_nn_transformer_on_meta_estimates_and_plans_at_world_size_2(strategy):
    """Issue 26's model: 32 encoder + 32 decoder layers, d_model 1024 (about 1 B parameters), on the meta device."""
    with torch.device("meta"):
        model = Seq2Seq(vocab=32000, d_model=1024, layers=32, heads=16, ff=4096)
    params = sum(p.numel() for p in model.parameters())
    assert 0.9e9 < params < 1.3e9, params
    src, tgt = _tokens(2, 512, 32000), _tokens(2, 512, 32000)
    est = autofit.estimate(model, (src, tgt), step=1, target=tgt, loss_fn=_loss, device="A100-80GB",
                           precision="bf16", layout=autofit.Layout(world_size=2, strategy=strategy))
    plan = autofit.plan(model, (src, tgt), "80GB", batch_size=8, target=tgt, loss_fn=_loss, device="A100-80GB",
                        layout=autofit.Layout(world_size=2, strategy=strategy))
    assert est.device_bytes > 0 and plan.device_bytes <= plan.budget_bytes


class _Shift(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1  # one fused C++ kernel under inductor


class CompiledThenRead(nn.Module):
    """A compiled module without weights, whose output the eager code then reads: the compiled code's values are
    not simulated (Note [values inside compiled code], autofit/core/_torch_compile.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = torch.compile(_Shift())
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.shift(x)
        if (y > 0).all():
            return self.linear(y)
        return self.linear(y).relu()


def test_a_value_read_of_what_compiled_code_computed_refuses_instead_of_answering_from_garbage():
    """The kernel-free wrapper writes nothing into its buffers: a twin of one would be uninitialised memory, and a
    read of it would answer from garbage. Before the twins stood aside in compiled code this estimate succeeded."""
    pytest.importorskip("torch._inductor")
    with torch.device("meta"):
        model = CompiledThenRead()
    with pytest.raises(UnsupportedModelError, match="by compiled code"):
        autofit.estimate(model, torch.rand(4, 8), step=4, loss_fn=lambda out: out.sum())


def test_a_compiled_model_whose_eager_code_reads_a_compiled_value_gets_the_typed_refusal_on_meta():
    """compile=True compiles the step in an untracked warm-up before the tracked one. nn.Transformer's causal-mask
    check breaks the graph and reads the mask, which the compiled graph before the break computed: no values there
    (Note [values inside compiled code]), so on meta the estimate refuses with the typed error that names compiled
    code. Before, the warm-up ran outside the twins and the error handling, and torch's
    DataDependentOutputException escaped from the fake tensor."""
    pytest.importorskip("torch._inductor")
    with torch.device("meta"):
        model = Seq2Seq(d_model=32, layers=1, heads=2, ff=64)
    src, tgt = _tokens(2, 16), _tokens(2, 16)
    with pytest.raises(UnsupportedModelError, match="by compiled code"):
        autofit.estimate(model, (src, tgt), target=tgt, loss_fn=_loss,
                         step=autofit.Step(micro_batch_size=2, compile=True))
    # with real weights the step runs for real instead (Note [data-dependent models]), and the notes say why
    torch.manual_seed(0)
    est = autofit.estimate(Seq2Seq(d_model=32, layers=1, heads=2, ff=64), (src, tgt),
                           target=tgt, loss_fn=_loss, step=autofit.Step(micro_batch_size=2, compile=True))
    assert est.method == "real" and any("by compiled code" in note for note in est.notes)
