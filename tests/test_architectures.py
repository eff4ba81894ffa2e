"""Reference tests on current Hugging Face architectures (tiny configs, tests/hf_archs.py): estimate against the CPU
allocator, the MoE routing question, and the fake-kernel corrections behind them (autofit/capture/corrections.py,
accumulation.py)."""

from __future__ import annotations

import pytest
import torch

import autofit
from autofit.capture import corrections
from autofit.simulate.probe import KernelProber
from autofit.simulate.routing import heavy_routing, heavy_routing_during

try:
    from tests.hf_archs import ARCHS, mixtral, token_batch
except ImportError:  # tests/ on sys.path rather than the repository root
    from hf_archs import ARCHS, mixtral, token_batch

TOLERANCE = 0.001  # 0.1 % of the measured peak


def _error(model, sample, **knobs) -> tuple[int, int]:
    meas = autofit.measure(model, sample, step=2, **knobs)
    est = autofit.estimate(model, sample, step=2, **knobs)
    return meas.peak_bytes, est.peak_bytes


@pytest.mark.sim
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(ARCHS))
def test_estimate_matches_measure(name: str, precision: str) -> None:
    model, sample = ARCHS[name]()
    measured, estimated = _error(model, sample, precision=precision)
    error = (estimated - measured) / measured
    assert abs(error) <= TOLERANCE, f"{name} {precision}: estimated {estimated:,} B, measured {measured:,} B " \
                                    f"({100 * error:+.3f} %)"


@pytest.mark.slow(seconds=40)
def test_grouped_mm_peak_does_not_depend_on_routing() -> None:
    """transformers' grouped-GEMM experts (the default in 5.x) sort the token-expert pairs and run one GEMM over all
    of them: every buffer is sized by tokens x top-k, whatever the routing. A batch of one repeated token routes
    every token to the same two experts; a random batch spreads them. Both are measured, estimated and planned."""
    model, random_batch = mixtral()
    uniform = token_batch(torch.full((2, 16), 7))
    assert _distinct_routings(model, uniform) == 1  # the premise: every token goes to the same experts
    assert _distinct_routings(model, random_batch) > 1
    peaks = {name: _error(model, s) for name, s in (("uniform", uniform), ("random", random_batch))}
    assert peaks["uniform"] == peaks["random"], peaks  # measured and estimated, equal across routings
    assert peaks["uniform"][0] == peaks["uniform"][1]
    # a budget that binds: 8 rows at once do not fit (about 1.7x the 2-row peak), 4 rows do (about 1.4x); the
    # planner then also captures and analyses the graph, which meets the grouped GEMM's fake kernel too
    budget = int(1.55 * peaks["uniform"][0])
    # both plans are asserted to run 4 x 2, so each batch's 4 x 2 step is measured once and held to both
    measured = {}
    for sample in (uniform, random_batch):
        plan = autofit.plan(model, sample, budget=budget, batch_size=8, device="cpu", precision="fp32",
                            savers=autofit.Savers(checkpoint=()))
        assert (plan.micro_batch_size, plan.gradient_accumulation_steps) == (4, 2)
        assert plan.peak_bytes <= budget
        for name, other in (("uniform", uniform), ("random", random_batch)):  # the plan for one batch holds for both
            if name not in measured:
                measured[name] = autofit.measure(model, other,
                                                 step=autofit.Step(micro_batch_size=4, accumulation_steps=2)).peak_bytes
            assert measured[name] <= plan.peak_bytes


def _distinct_routings(model, batch) -> int:
    """The most different expert sets the tokens of ``batch`` are routed to in any one layer."""
    seen: dict[int, set[tuple]] = {}

    def recorder(i):
        def record(_module, args):
            seen.setdefault(i, set()).update(tuple(sorted(row)) for row in args[1].tolist())
        return record

    handles = [layer.mlp.experts.register_forward_pre_hook(recorder(i)) for i, layer in enumerate(model.model.layers)]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in handles:
            h.remove()
    return max(len(s) for s in seen.values())


def test_grouped_mm_fake_kernel_matches_cpu_kernel() -> None:
    """The registered fake kernel gives the CPU kernel's output shape, strides and dtype (the meta kernel refuses
    fp32), in the three layouts an MoE forward and backward use."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_fn = corrections.CORRECTIONS[torch.ops.aten._grouped_mm.default].fake
    offs = torch.tensor([3, 5, 8], dtype=torch.int32)
    cases = [  # (mat_a, mat_b) as transformers passes them (weights transposed): 2d x 3d forward, 2d x 2d weight
        # gradient, and an output width (6 bf16 = 12 bytes) that the CPU kernel pads to 16 bytes
        (torch.randn(8, 8), torch.randn(3, 5, 8).transpose(-2, -1)),
        (torch.randn(4, 8), torch.randn(8, 4)),
        (torch.randn(8, 8, dtype=torch.bfloat16), torch.randn(3, 6, 8, dtype=torch.bfloat16).transpose(-2, -1)),
    ]
    for a, b in cases:
        real = torch._grouped_mm(a, b, offs)
        with FakeTensorMode() as mode:
            out = fake_fn(mode.from_tensor(a), mode.from_tensor(b), mode.from_tensor(offs))
        assert (out.shape, out.stride(), out.dtype) == (real.shape, real.stride(), real.dtype)


def test_corrections_refuse_duplicates_and_need_a_source() -> None:
    with pytest.raises(ValueError, match="already registered"):
        corrections.correction(torch.ops.aten._grouped_mm.default, kind="fake")(lambda: None)
    with pytest.raises(ValueError, match="docstring"):
        corrections.correction(torch.ops.aten.cosh.default, kind="probe")(lambda: None)
    assert torch.ops.aten.cosh.default not in corrections.CORRECTIONS


def test_grouped_mm_probe_uses_worst_case_offsets() -> None:
    """The probe's default integer fill (zeros) would make every group empty; the registered inputs put every row in
    one group, the largest GEMM any routing can ask for."""
    a, b, offs = torch.randn(8, 8), torch.randn(3, 5, 8).transpose(-2, -1), torch.zeros(3, dtype=torch.int32)
    (_, _, worst), _ = corrections.probe_inputs(torch.ops.aten._grouped_mm.default)((a, b, offs), {})
    assert worst.tolist() == [8, 8, 8]
    assert KernelProber().probe(torch.ops.aten._grouped_mm.default, (a, b, offs), {}) is not None


class _SelectLoop(torch.nn.Module):
    """The pattern of Mamba's slow selective scan: one tensor read step by step, so backward accumulates one
    full-size ``select_backward`` gradient per step into the same input buffer (Note [engine accumulation])."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8 * 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x).view(x.shape[0], 8, 64)
        state = torch.zeros(x.shape[0], 64)
        for i in range(8):
            state = state * 0.5 + h[:, i]
        return state.sum(-1)


@pytest.mark.sim
def test_in_place_gradient_accumulation() -> None:
    model = _SelectLoop()
    x, y = torch.randn(4, 8), torch.randn(4)
    kw = dict(step=4, target=y, loss_fn=torch.nn.functional.mse_loss)
    measured = autofit.measure(model, x, **kw).peak_bytes
    assert autofit.estimate(model, x, **kw).peak_bytes == measured


@pytest.mark.slow
def test_per_expert_loop_is_planned_for_the_heaviest_routing() -> None:
    """transformers' "eager" experts loop over the experts that were hit (``nonzero``: the real-run fallback), with
    buffers sized by each expert's tokens: the measured peak changes with the routing. The estimate reroutes the
    loops to the heaviest routing measured (Note [MoE routing]), so it is the same for every batch, covers both
    batches' measured peaks, and equals the allocator's peak when that routing is forced on the real model."""
    model, random_batch = mixtral("eager")
    uniform = token_batch(torch.full((2, 16), 7))
    measured = {name: autofit.measure(model, s, step=2).peak_bytes
                for name, s in (("uniform", uniform), ("random", random_batch))}
    assert measured["uniform"] != measured["random"], measured  # the peak does depend on the routing
    estimates = [autofit.estimate(model, s, step=2) for s in (uniform, random_batch)]
    assert estimates[0].peak_bytes == estimates[1].peak_bytes >= max(measured.values())
    assert any("heaviest routing" in note for note in estimates[0].notes), estimates[0].notes
    with heavy_routing_during(model) as rerouted:
        assert rerouted == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
        forced = autofit.measure(model, random_batch, step=2).peak_bytes
    assert estimates[0].peak_bytes == forced


def test_heavy_routing_hits_every_expert_and_fills_the_first() -> None:
    index = heavy_routing(tokens=32, top_k=2, experts=4)
    assert index.shape == (32, 2)
    assert all(len(set(row)) == 2 for row in index.tolist())  # top-k choices are distinct experts
    assert (index[:, 0] == 0).all()  # expert 0 receives every token
    assert set(index.flatten().tolist()) == {0, 1, 2, 3}  # every expert is hit


def _fake_grouped_mm_refuses_fp32() -> bool:
    """Whether this build's meta kernel of ``_grouped_mm`` is stricter than the CPU kernel (torch 2.13: bf16 only)."""
    from autofit.core._torch import FakeTensorMode

    with FakeTensorMode():
        a, b = torch.zeros(4, 8), torch.zeros(2, 8, 8)
        offs = torch.tensor([2, 4], dtype=torch.int32)
        try:
            torch.ops.aten._grouped_mm.default(a, b, offs)
        except RuntimeError:
            return True
    return False


@pytest.mark.sim
def test_uncorrected_strict_fake_kernel_falls_back_to_a_real_run(monkeypatch) -> None:
    """Without its registered correction, ``_grouped_mm``'s fake kernel refuses fp32 while the CPU kernel accepts
    it: the step runs for real, exactly, and the notes name the op."""
    monkeypatch.delitem(corrections.CORRECTIONS, torch.ops.aten._grouped_mm.default)
    if not _fake_grouped_mm_refuses_fp32():
        pytest.skip(f"torch {torch.__version__}'s fake _grouped_mm accepts fp32: there is nothing to fall back from")
    model, sample = mixtral()
    measured, estimated = _error(model, sample)
    assert estimated == measured
    est = autofit.estimate(model, sample, step=2)
    assert est.method == "real"
    assert any("cannot be simulated" in n and "aten._grouped_mm" in n for n in est.notes), est.notes


@pytest.mark.sim
def test_genuine_kernel_errors_stay_errors() -> None:
    """A fake kernel that refuses inputs the CPU kernel refuses too is a bug in the model, not in the simulation."""

    class Bad(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(5, 3))

        def forward(self, x):
            return x @ self.w  # (4, 8) @ (5, 3): wrong inner size

    with pytest.raises(autofit.ForwardError):
        autofit.estimate(Bad(), torch.randn(4, 8), step=4, loss_fn=lambda out: out.sum())
