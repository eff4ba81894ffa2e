"""The trainer and its inputs at the edges (issue 39): the default loss applies only where it is unambiguous, the
plan remembers its loss, ``wrap`` checks the optimizer and refuses a second wrap, ``unwrap`` restores in any order,
sum-reduced losses are not divided silently, ``plan.precision`` names the stored dtype, raw torch exceptions become
typed errors, and the batch dimension follows a written rule with a way to mark inputs as shared.

Each truth is independent of the code under test: plain PyTorch steps, hand-computed losses, the model's own state.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autofit
from autofit.core.report import MemoryEstimate
from autofit.emit.plan import Plan
from autofit.training.loss import default_loss
from autofit.training.precision import PrecisionPolicy


def _plan(*, micro: int, batch: int, optimizer: str = "sgd") -> Plan:
    """A plan with exactly these knobs (the planner's choice is not under test here)."""
    k = -(-batch // micro)
    return Plan(
        micro_batch_size=micro, gradient_accumulation_steps=k, batch_size=batch,
        last_micro_batch_size=batch - micro * (k - 1), precision=PrecisionPolicy(name="fp32"), checkpoint=(),
        peak_bytes=1, device_bytes=1, budget_bytes=1, device="cpu", optimizer=optimizer, predicted_step_seconds=0.0,
        estimate=MemoryEstimate(peak_bytes=1, breakdown={}),
    )


class FeaturesAndLogits(nn.Module):
    """Returns ``(features, logits)``: which one a loss is about, only the user knows."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Linear(8, 32)
        self.classifier = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor):
        h = self.features(x)
        return h, self.classifier(h)


def _classes(rows: int = 16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g), torch.randint(0, 4, (rows,), generator=g)


# ---- 1. the default loss only where it is unambiguous ----------------------------------------------------------------
@pytest.mark.sim
@pytest.mark.parametrize("entry", ["estimate", "plan"])
def test_a_tuple_output_without_loss_fn_is_refused_by_estimate_and_plan(entry: str) -> None:
    x, y = _classes()
    with pytest.raises(autofit.LossError, match=r"tuple of 2: \(Tensor \(\d+, 32\), Tensor \(\d+, 4\)\).*loss_fn="):
        if entry == "estimate":
            autofit.estimate(FeaturesAndLogits(), x, target=y, step=4)
        else:
            autofit.plan(FeaturesAndLogits(), x, "100MB", batch_size=16, target=y, device="cpu")


def test_a_tuple_output_without_loss_fn_is_refused_by_the_trainer_before_any_update() -> None:
    model, (x, y) = FeaturesAndLogits(), _classes()
    before = copy.deepcopy(model.state_dict())
    trainer = _plan(micro=8, batch=16).wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(autofit.LossError, match="tuple of 2.*loss_fn="):
        trainer.step(x, y)
    trainer.unwrap()
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


def test_with_a_loss_fn_the_tuple_model_trains_its_classifier_as_plain_torch_does() -> None:
    model, (x, y) = FeaturesAndLogits(), _classes()
    ref = copy.deepcopy(model)
    loss_fn = lambda out, t: F.cross_entropy(out[1], t)  # noqa: E731
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.cross_entropy(ref(x)[1], y).backward()
    opt.step()
    with _plan(micro=4, batch=16).wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=loss_fn) as t:
        t.step(x, y)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("output", [
    lambda logits: {"features": logits, "logits": logits},
    lambda logits: [logits],
])
def test_dict_and_list_outputs_without_a_loss_are_refused(output) -> None:
    logits = torch.randn(5, 4, requires_grad=True)
    with pytest.raises(autofit.LossError, match="loss_fn="):
        default_loss(output(logits), torch.randint(0, 4, (5,)))


def test_the_default_loss_still_reads_a_loss_a_tensor_and_hugging_face_logits() -> None:
    logits, y = torch.randn(5, 4, requires_grad=True), torch.randint(0, 4, (5,))
    truth = F.cross_entropy(logits, y)
    assert torch.equal(default_loss(logits, y), truth)
    assert default_loss({"loss": truth, "logits": logits}, y) is truth
    outputs = pytest.importorskip("transformers.modeling_outputs")
    assert torch.equal(default_loss(outputs.SequenceClassifierOutput(logits=logits), y), truth)
    hidden = outputs.BaseModelOutput(last_hidden_state=logits)  # no documented prediction: refused
    with pytest.raises(autofit.LossError, match="BaseModelOutput.*last_hidden_state.*loss_fn="):
        default_loss(hidden, y)


# ---- 2. the plan records its loss ------------------------------------------------------------------------------------
def _smoothed(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target, label_smoothing=0.2)


def _classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


@pytest.mark.sim
def test_the_plan_trains_with_the_loss_it_was_planned_with_and_its_json_names_it() -> None:
    model, (x, y) = _classifier(), _classes()
    plan = autofit.plan(model, x, "100MB", batch_size=16, target=y, loss_fn=_smoothed, optimizer="sgd", device="cpu")
    assert plan.loss == f"custom: {__name__}._smoothed"
    by_hand = F.cross_entropy(model(x), y, label_smoothing=0.2).item()  # the truth: the smoothed loss, by hand
    plain = F.cross_entropy(model(x), y).item()
    assert abs(by_hand - plain) > 1e-3  # the two losses differ, so the check below can fail
    with plan.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1)) as trainer:  # no loss_fn: the planned one
        assert trainer.step(x, y) == pytest.approx(by_hand, rel=1e-6)
    loaded = Plan.from_json(plan.to_json())
    assert loaded == plan and loaded.loss == plan.loss and loaded.loss_fn is None
    with pytest.raises(autofit.InvalidInputError, match=r"custom loss \(custom: .*_smoothed\).*loss_fn="):
        loaded.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with loaded.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_smoothed) as trainer:
        expected = F.cross_entropy(model(x), y, label_smoothing=0.2).item()
        assert trainer.step(x, y) == pytest.approx(expected, rel=1e-6)


def test_a_plan_of_the_default_loss_loaded_from_json_trains_with_the_default() -> None:
    model, (x, y) = _classifier(), _classes()
    plan = Plan.from_json(_plan(micro=8, batch=16).to_json())
    assert plan.loss == "default"
    expected = F.cross_entropy(model(x), y).item()
    with plan.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1)) as trainer:
        assert trainer.step(x, y) == pytest.approx(expected, rel=1e-6)


# ---- 3. wrap checks the optimizer and refuses a second wrap; unwrap restores in any order ----------------------------
def _checkpointed_plan() -> Plan:
    from dataclasses import replace

    return replace(_plan(micro=4, batch=16), checkpoint=("0",))


def _module_state(model: nn.Module) -> dict[str, tuple]:
    """What a trainer could leave behind: each module's instance attributes and hooks, and every tensor's value."""
    state = {name: (sorted(m.__dict__), len(m._forward_hooks), len(m._forward_pre_hooks))
             for name, m in model.named_modules()}
    state.update({name: (value.clone(),) for name, value in model.state_dict().items()})
    return state


def _same_state(a: dict[str, tuple], b: dict[str, tuple]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(x[0], y[0]) if isinstance(x[0], torch.Tensor) else x == y for x, y in zip(a.values(), b.values()))


def test_an_optimizer_over_another_model_is_refused_naming_the_missing_parameters() -> None:
    model, other = _classifier(), _classifier()
    with pytest.raises(autofit.InvalidInputError, match=r"param_groups\[0\]\['params'\]\[0\] \(shape \(32, 8\)\)"):
        _plan(micro=4, batch=16).wrap(model, torch.optim.SGD(other.parameters(), lr=0.1))
    partial = torch.optim.SGD(model[0].parameters(), lr=0.1)  # the head is left out
    with pytest.raises(autofit.InvalidInputError, match=r"does not step 2 trainable.*2\.weight, 2\.bias"):
        _plan(micro=4, batch=16).wrap(model, partial)
    model[2].requires_grad_(False)  # frozen: leaving it out is right
    with _plan(micro=4, batch=16).wrap(model, partial) as trainer:
        trainer.step(*_classes())
    assert all("forward" not in m.__dict__ for m in model.modules())


def test_a_second_wrap_of_a_wrapped_model_is_refused_and_the_first_unwraps_cleanly() -> None:
    model = _classifier()
    before = _module_state(model)
    plan = _checkpointed_plan()
    t1 = plan.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "forward" in model[0].__dict__  # the checkpoint patch is on: the check below is not vacuous
    with pytest.raises(autofit.AutofitError, match="already wrapped.*unwrap"):
        plan.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(autofit.AutofitError, match="module '0' is already wrapped"):
        plan.wrap(nn.Sequential(model[0]), torch.optim.SGD(model[0].parameters(), lr=0.1))
    t1.unwrap()
    assert "forward" not in model[0].__dict__
    assert _same_state(_module_state(model), before)


@pytest.mark.parametrize("order", ["first-then-second", "second-then-first"])
def test_two_trainers_in_turn_unwrap_in_either_order_and_the_live_one_still_trains(order: str) -> None:
    model, (x, y) = _classifier(), _classes()
    ref = copy.deepcopy(model)
    plan = _checkpointed_plan()
    t1 = plan.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    t1.unwrap()
    before = _module_state(model)
    t2 = plan.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if order == "first-then-second":
        t1.unwrap()  # stale: must not take t2's patches away
        assert "forward" in model[0].__dict__
        t2.step(x, y)
        t2.unwrap()
    else:
        t2.step(x, y)
        t2.unwrap()
        t1.unwrap()
    assert "forward" not in model[0].__dict__
    after = _module_state(model)
    assert {k: v for k, v in after.items() if not isinstance(v[0], torch.Tensor)} == \
        {k: v for k, v in before.items() if not isinstance(v[0], torch.Tensor)}
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)  # the truth: one plain full-batch step
    F.cross_entropy(ref(x), y).backward()
    opt.step()
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_a_step_after_unwrap_is_a_typed_error() -> None:
    model = _classifier()
    trainer = _plan(micro=4, batch=16).wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.unwrap()
    with pytest.raises(autofit.AutofitError, match="unwrapped.*plan.wrap"):
        trainer.step(*_classes())


# ---- 4. sum-reduced losses: never a silent 1/accumulation ------------------------------------------------------------
def _summed(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target, reduction="sum")


def _regression(rows: int = 16) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.0), nn.Linear(16, 2))
    return model, torch.randn(rows, 8), torch.randn(rows, 2)


def _plain_sum_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    """The truth: one plain PyTorch SGD step on the whole batch with the summed loss."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    _summed(ref(x), y).backward()
    opt.step()
    return ref


def _assert_same_parameters(model: nn.Module, ref: nn.Module) -> None:
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_loss_reduction_sum_matches_a_plain_full_batch_step_under_accumulation() -> None:
    model, x, y = _regression()
    ref = _plain_sum_step(model, x, y)
    with torch.no_grad():
        whole = _summed(model(x), y).item()  # the batch's summed loss before the step
    with _plan(micro=4, batch=16).wrap(model, torch.optim.SGD(model.parameters(), lr=0.01), loss_fn=_summed,
                                       loss_reduction="sum") as trainer:
        assert trainer.step(x, y) == pytest.approx(whole, rel=1e-5)
        assert trainer.micro_batches == 4
    _assert_same_parameters(model, ref)
    with pytest.raises(autofit.InvalidInputError, match="loss_reduction must be 'mean' or 'sum'"):
        _plan(micro=4, batch=16).wrap(model, torch.optim.SGD(model.parameters(), lr=0.01), loss_reduction="total")


@pytest.mark.sim
def test_plan_finds_a_summed_loss_and_its_trainer_steps_as_the_full_batch() -> None:
    from dataclasses import replace

    model, x, y = _regression()
    before = copy.deepcopy(model.state_dict())
    plan = autofit.plan(model, x, "100MB", batch_size=16, target=y, loss_fn=_summed, optimizer="sgd", device="cpu")
    assert plan.loss_reduction == "sum" and any("sum over rows" in n for n in plan.notes)
    assert Plan.from_json(plan.to_json()).loss_reduction == "sum"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # planning changed nothing
    assert model.training  # and left the mode as it was
    accumulating = replace(plan, micro_batch_size=4, gradient_accumulation_steps=4, last_micro_batch_size=4)
    ref = _plain_sum_step(model, x, y)
    with accumulating.wrap(model, torch.optim.SGD(model.parameters(), lr=0.01)) as trainer:
        trainer.step(x, y)
    _assert_same_parameters(model, ref)
    mean = autofit.plan(model, x, "100MB", batch_size=16, target=y, loss_fn=F.mse_loss, device="cpu")
    assert mean.loss_reduction == "mean"


# ---- 5. plan.precision names the stored dtype ------------------------------------------------------------------------
@pytest.mark.sim
@pytest.mark.parametrize(("dtype", "name"), [(torch.bfloat16, "bf16"), (torch.float64, "fp64")])
def test_plan_precision_names_the_dtype_the_parameters_are_stored_in(dtype: torch.dtype, name: str) -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4)).to(dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}  # the truth: what the model holds
    x, y = torch.randn(16, 8, dtype=dtype), torch.randint(0, 4, (16,))
    plan = autofit.plan(model, x, "1GB", batch_size=16, target=y, precision="fp32", device="cpu")
    assert plan.precision.built == name
    assert f"stored {name} (as built)" in str(plan.precision) and f"stored {name}" in str(plan)
    assert Plan.from_json(plan.to_json()).precision.built == name


def test_an_fp32_model_and_a_mixed_one_are_named_as_they_are() -> None:
    from autofit.training.precision import built_precision

    model = nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 4))
    assert built_precision(model.parameters()) is None
    model[0].to(torch.bfloat16)  # 8*32+32 bf16 values: 576 B; the fp32 head 132 values: 528 B
    assert built_precision(model.parameters()) == "bf16 + fp32"


# ---- 6. raw torch exceptions become typed errors naming the module or input and the fix ------------------------------
class _Bags(nn.Module):
    def __init__(self, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.bags = nn.EmbeddingBag(100, 16, sparse=sparse)
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.bags(ids))


def _entries():
    return {
        "estimate": lambda m, x, y: autofit.estimate(m, x, target=y, step=4, optimizer="sgd"),
        "measure": lambda m, x, y: autofit.measure(m, x, target=y, step=4, optimizer="sgd"),
        "plan": lambda m, x, y: autofit.plan(m, x, "1GB", batch_size=8, target=y, optimizer="sgd", device="cpu"),
        "plan without batch_size": lambda m, x, y: autofit.plan(m, x, "1GB", target=y, optimizer="sgd",
                                                                device="cpu"),
    }


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("entry", list(_entries()))
def test_a_scripted_submodule_is_named(entry: str) -> None:
    model = nn.Sequential(nn.Linear(8, 16), torch.jit.script(nn.Linear(16, 4)))
    with pytest.raises(autofit.UnsupportedModelError, match=r"module '1' is a TorchScript module.*eager module"):
        _entries()[entry](model, torch.randn(8, 8), torch.randint(0, 4, (8,)))


@pytest.mark.parametrize("entry", list(_entries()))
def test_a_model_without_parameters_is_named(entry: str) -> None:
    with pytest.raises(autofit.InvalidInputError, match=r"\(Identity\) has no parameters"):
        _entries()[entry](nn.Identity(), torch.randn(8, 8), torch.randn(8, 8))


@pytest.mark.parametrize("entry", list(_entries()))
def test_a_sample_of_zero_rows_names_the_sample_not_an_argument_never_given(entry: str) -> None:
    with pytest.raises(autofit.InvalidInputError, match=r"target has 0 rows along dim 0") as info:
        _entries()[entry](nn.Linear(8, 4), torch.randn(0, 8), torch.randint(0, 4, (0,)))
    assert "batch_size" not in str(info.value)
    with pytest.raises(autofit.InvalidInputError, match=r"sample has 0 rows along dim 0.*\(0, 8\)") as info:
        _entries()[entry](nn.Linear(8, 4), torch.randn(0, 8), None)
    assert "batch_size" not in str(info.value)


@pytest.mark.parametrize("entry", list(_entries()))
def test_a_sparse_embedding_bag_is_named_and_not_called_a_forward_failure(entry: str) -> None:
    with pytest.raises(autofit.UnsupportedModelError, match=r"module 'bags' \(EmbeddingBag\) has sparse=True.*"
                                                            r"sparse=False") as info:
        _entries()[entry](_Bags(sparse=True), torch.randint(0, 100, (8, 5)), torch.randint(0, 4, (8,)))
    assert not isinstance(info.value, autofit.ForwardError)


def test_the_trainer_trains_a_sparse_embedding_bag_as_plain_torch_does() -> None:
    model, ids, y = _Bags(sparse=True), torch.randint(0, 100, (8, 5)), torch.randint(0, 4, (8,))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.cross_entropy(ref(ids), y).backward()
    opt.step()
    with _plan(micro=4, batch=8).wrap(model, torch.optim.SGD(model.parameters(), lr=0.1)) as trainer:
        trainer.step(ids, y)
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


# ---- 7. the batch dimension: one rule, shared inputs, messages that list what was per-sample -----------------------
SEEN: list[tuple[tuple[int, ...], ...]] = []  # the shapes each forward received (a global: model copies share it)


class _Scaled(nn.Module):
    """``forward(scale, x)``: a one-element option first, the per-sample input second."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 4)

    def forward(self, scale: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        SEEN.append((tuple(scale.shape), tuple(x.shape)))
        return self.lin(x) * scale


class _Masked(nn.Module):
    """Attention over a shared (seq, seq) additive mask."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        SEEN.append((tuple(x.shape), tuple(mask.shape)))
        h = self.lin(x)
        return torch.softmax(h @ h.transpose(1, 2) + mask, -1) @ x


def _mean_of(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


def _ce(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


@pytest.mark.sim
def test_a_one_element_option_first_does_not_make_the_batch_one() -> None:
    scale, (x, y) = torch.tensor([2.0]), _classes()
    SEEN.clear()
    autofit.estimate(_Scaled(), (scale, x), target=y, step=4, loss_fn=_ce)  # the target's rows: 16
    assert SEEN and set(SEEN) == {((1,), (4, 8))}  # the truth: what the forward received
    SEEN.clear()
    est = autofit.estimate(_Scaled(), (scale, x), step=4, loss_fn=_mean_of, batch_dim=autofit.BatchDim(shared=(0,)))
    assert SEEN and set(SEEN) == {((1,), (4, 8))}
    SEEN.clear()
    est = autofit.estimate(_Scaled(), (scale, x), step=4, loss_fn=_mean_of)  # no target, no shared
    assert set(SEEN) == {((4,), (16, 8))}  # the rule read the first tensor: and the estimate says so
    assert any("per-sample (dim 0 = 1): input 0 (1,); passed whole: input 1 (16, 8)" in n for n in est.notes)


@pytest.mark.sim
def test_a_shared_square_mask_whose_side_equals_the_batch_is_named_in_the_error_and_passed_whole_when_shared() -> None:
    x, mask = torch.randn(6, 6, 8), torch.zeros(6, 6)
    listed = r"per-sample \(dim 0 = 6\): 'x' \(6, 6, 8\), 'mask' \(6, 6\).*shared="
    with pytest.raises(autofit.ForwardError, match=listed):
        autofit.estimate(_Masked(), {"x": x, "mask": mask}, step=2, loss_fn=_mean_of)
    SEEN.clear()
    autofit.estimate(_Masked(), {"x": x, "mask": mask}, step=2, loss_fn=_mean_of,
                     batch_dim=autofit.BatchDim(shared=("mask",)))
    assert SEEN and set(SEEN) == {((2, 6, 8), (6, 6))}
    SEEN.clear()
    autofit.measure(_Masked(), {"x": x, "mask": mask}, step=2, loss_fn=_mean_of,
                    batch_dim=autofit.BatchDim(shared="mask"))
    assert SEEN and set(SEEN) == {((2, 6, 8), (6, 6))}


@pytest.mark.sim
def test_a_plan_records_shared_inputs_and_its_trainer_steps_as_the_full_batch() -> None:
    from dataclasses import replace

    model, x, mask = _Masked(), torch.randn(6, 6, 8), torch.zeros(6, 6)
    mask[:, 0] = -1.0  # a mask that matters
    plan = autofit.plan(model, {"x": x, "mask": mask}, "100MB", batch_size=6, loss_fn=_mean_of, optimizer="sgd",
                        device="cpu", batch_dim=autofit.BatchDim(shared=("mask",)))
    assert plan.shared == ("mask",) and Plan.from_json(plan.to_json()).shared == ("mask",)
    ref = copy.deepcopy(model)  # the truth: one plain full-batch step
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _mean_of(ref(x, mask)).backward()
    opt.step()
    accumulating = replace(plan, micro_batch_size=2, gradient_accumulation_steps=3, last_micro_batch_size=2)
    SEEN.clear()
    with accumulating.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1)) as trainer:
        trainer.step({"x": x, "mask": mask})
    assert set(SEEN) == {((2, 6, 8), (6, 6))}
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_the_trainer_reads_the_batch_from_the_target_and_takes_shared_by_position() -> None:
    scale, (x, y) = torch.tensor([2.0]), _classes()
    model = _Scaled()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    _ce(ref(scale, x), y).backward()
    opt.step()
    SEEN.clear()
    with _plan(micro=4, batch=16).wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_ce) as trainer:
        trainer.step((scale, x), y)
    assert set(SEEN) == {((1,), (4, 8))}
    for (name, a), b in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, name=name: f"{name}: {m}")


def test_shared_names_what_the_sample_has() -> None:
    from autofit.training.batch import as_batch

    with pytest.raises(autofit.InvalidInputError, match=r"shared names \['y'\].*keys \['mask', 'x'\]"):
        as_batch({"x": torch.zeros(2, 3), "mask": torch.zeros(3, 3)}, shared=("y",))
    with pytest.raises(autofit.InvalidInputError, match=r"positions 0 to 1"):
        as_batch((torch.zeros(2, 3), torch.zeros(3, 3)), shared=2)
    with pytest.raises(autofit.InvalidInputError, match="target has 5 rows.*no input tensor has 5 rows.*per-sample"):
        from autofit.training.batch import as_batches

        as_batches((torch.zeros(4, 3), torch.zeros(3, 3)), torch.zeros(5))
