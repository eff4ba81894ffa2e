"""Bad input gets a typed error that names the problem and says what to do.

Every check asserts the autofit error class (a raw ``ValueError`` or ``RuntimeError`` from deep inside torch does not
pass: ``InvalidInputError`` and ``LossError`` subclass ``ValueError``, ``ForwardError`` subclasses ``RuntimeError``, so
``pytest.raises`` on the autofit class rejects the builtin one) and that the message mentions the offending value and
the remedy. Each case runs through every entry point it applies to: ``estimate``, ``measure``, ``analyse`` and
``plan(device="cpu")``.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator

import pytest
import torch
from torch import nn

import autofit
from autofit.core.units import parse_budget

try:
    from tests.zoo import ZOO
except ImportError:  # tests/ on sys.path rather than the repository root
    from zoo import ZOO


# ---- a tiny model whose submodule ``blocks.1.bad`` can be made to raise ----------------------------------------------
class _Raises(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("bad things happened in forward")


class _Block(nn.Module):
    def __init__(self, bad: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bad = _Raises() if bad else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bad(torch.relu(self.lin(x)))


class _Net(nn.Module):
    def __init__(self, bad: bool = False) -> None:
        super().__init__()
        self.blocks = nn.Sequential(_Block(), _Block(bad), _Block())
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _sample() -> torch.Tensor:
    return torch.randn(4, 4)


def _labels(n: int = 4) -> torch.Tensor:
    return torch.randint(0, 3, (n,))


# ---- the entry points, called the same way -------------------------------------------------------------------------
def _estimate(model, sample, **kw):
    return autofit.estimate(model, sample, **_one_step(kw))


def _measure(model, sample, **kw):
    return autofit.measure(model, sample, **_one_step(kw))


def _one_step(kw):
    """The entry points called the same way: the step's knobs of a test go into estimate's and measure's Step (as
    ``_plan`` puts ``checkpoint`` into its Savers)."""
    kw.setdefault("micro_batch_size", 2)
    step = {k: kw.pop(k) for k in ("micro_batch_size", "checkpoint", "accumulation_steps") if k in kw}
    return dict(kw, step=autofit.Step(**step))


def _analyse(model, sample, **kw):
    return autofit.analyse(model, sample, **kw)


def _plan(model, sample, **kw):
    kw.setdefault("batch_size", 4)
    if "checkpoint" in kw:  # a keyword of estimate and measure; plan takes it in its Savers
        kw["savers"] = autofit.Savers(checkpoint=kw.pop("checkpoint"))
    return autofit.plan(model, sample, kw.pop("budget", "1GB"), device="cpu", **kw)


ALL = {"estimate": _estimate, "measure": _measure, "analyse": _analyse, "plan": _plan}
STEP = {"estimate": _estimate, "measure": _measure}  # the entry points that take micro_batch_size, device=...
WITH_CHECKPOINT = {"estimate": _estimate, "measure": _measure, "plan": _plan}


@contextlib.contextmanager
def raises(cls: type[Exception], *fragments: str) -> Iterator[pytest.ExceptionInfo]:
    """``pytest.raises(cls)`` that also checks the message mentions every fragment."""
    with pytest.raises(cls) as info:
        yield info
    message = str(info.value)
    assert isinstance(info.value, autofit.AutofitError)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} is not in the message: {message!r}"


# ---- the sample and the target --------------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ALL)
def test_sample_without_batch_dimension(entry: str) -> None:
    with raises(autofit.InvalidInputError, "sample", "shape ()", "unsqueeze(0)"):
        ALL[entry](_Net(), torch.tensor(1.0), target=_labels())


@pytest.mark.parametrize(
    ("sample", "fragments"),
    [
        ("a string", ("sample", "str", "a tensor, a tuple of positional inputs or a dict of keyword inputs")),
        ([1, 2, 3], ("sample", "no tensor", "dim 0 is the batch")),
        ({}, ("sample", "no tensor", "dim 0 is the batch")),
        ({0: torch.randn(4, 4)}, ("sample", "keyword names", "strings")),
    ],
    ids=["string", "list-of-ints", "empty-dict", "dict-int-keys"],
)
@pytest.mark.parametrize("entry", ALL)
def test_sample_of_the_wrong_type(entry: str, sample, fragments: tuple[str, ...]) -> None:
    with raises(autofit.InvalidInputError, *fragments):
        ALL[entry](_Net(), sample, target=_labels())


@pytest.mark.parametrize("entry", ALL)
def test_target_batch_size_differs_from_sample(entry: str) -> None:
    with raises(autofit.InvalidInputError, "target has 5 rows", "the sample has 4", "one target row per sample row"):
        ALL[entry](_Net(), _sample(), target=_labels(5))


@pytest.mark.parametrize("entry", ALL)
def test_target_without_batch_dimension(entry: str) -> None:
    with raises(autofit.InvalidInputError, "target", "shape ()"):
        ALL[entry](_Net(), _sample(), target=torch.tensor(1))


# ---- the loss -------------------------------------------------------------------------------------------------------
@pytest.mark.sim
@pytest.mark.parametrize("entry", ALL)
def test_loss_that_is_not_a_scalar(entry: str) -> None:
    with raises(autofit.LossError, "must be a scalar", ".mean()") as info:
        ALL[entry](_Net(), _sample(), target=_labels(), loss_fn=lambda out, t: (out ** 2).sum(dim=1))
    assert re.search(r"shape \(\d+,\)", str(info.value)), "the message should give the loss's shape"


@pytest.mark.sim
@pytest.mark.parametrize("entry", ALL)
def test_a_loss_of_output_and_target_without_a_target(entry: str) -> None:
    # autofit calls loss_fn(output) when no target is given: a two-argument loss used to fail with Python's TypeError
    with raises(autofit.LossError, "loss_fn(out, t)", "no target was given", "target="):
        ALL[entry](_Net(), _sample(), loss_fn=lambda out, t: out.sum())


@pytest.mark.sim
@pytest.mark.parametrize("entry", ALL)
def test_a_loss_of_the_output_alone_with_a_target(entry: str) -> None:
    with raises(autofit.LossError, "loss_fn(out)", "a target was given"):
        ALL[entry](_Net(), _sample(), target=_labels(), loss_fn=lambda out: out.sum())


def test_a_loss_whose_own_type_error_is_its_own() -> None:
    # only a call the signature refuses becomes a LossError; a TypeError raised inside the loss stays the user's
    from autofit.training.loss import compute_loss

    def loss(out, t):
        raise TypeError("inside the loss")

    with pytest.raises(TypeError, match="inside the loss"):
        compute_loss(loss, torch.ones(2, requires_grad=True), torch.ones(2))


@pytest.mark.sim
@pytest.mark.parametrize("entry", ALL)
def test_loss_that_is_not_floating(entry: str) -> None:
    with raises(autofit.LossError, "torch.int64", "floating point"):
        ALL[entry](_Net(), _sample(), target=_labels(), loss_fn=lambda out, t: out.argmax(dim=1).sum())


@pytest.mark.sim
@pytest.mark.parametrize("entry", ALL)
def test_loss_that_does_not_require_grad(entry: str) -> None:
    with raises(autofit.LossError, "does not require grad", "frozen"):
        ALL[entry](_Net(), _sample(), target=_labels(), loss_fn=lambda out, t: out.detach().sum())


@pytest.mark.sim
@pytest.mark.parametrize("entry", ALL)
def test_all_parameters_frozen(entry: str) -> None:
    model = _Net().requires_grad_(False)
    with raises(autofit.LossError, "does not require grad", "frozen"):
        ALL[entry](model, _sample(), target=_labels())


@pytest.mark.sim
@pytest.mark.parametrize("entry", ALL)
def test_loss_fn_returning_a_python_number(entry: str) -> None:
    with raises(autofit.LossError, "loss_fn returned float", "scalar tensor"):
        ALL[entry](_Net(), _sample(), target=_labels(), loss_fn=lambda out, t: 1.0)


@pytest.mark.sim
@pytest.mark.parametrize("entry", ALL)
def test_loss_fn_that_raises(entry: str) -> None:
    def loss_fn(out, t):
        return out.sum() / 0 + {}["missing"]

    with raises(autofit.ForwardError, "loss", "KeyError") as info:
        ALL[entry](_Net(), _sample(), target=_labels(), loss_fn=loss_fn)
    assert isinstance(info.value.__cause__, KeyError)
    assert info.value.module is None  # no module of the model was running


@pytest.mark.sim
@pytest.mark.parametrize("entry", ALL)
def test_default_loss_that_does_not_fit_the_output(entry: str) -> None:
    # integer target of shape (4, 2) against logits (4, 3): the default cross-entropy cannot pair them
    with raises(autofit.LossError, "cross-entropy", "loss_fn="):
        ALL[entry](_Net(), _sample(), target=torch.randint(0, 3, (4, 2)))


@pytest.mark.sim
@pytest.mark.parametrize("entry", ALL)
def test_no_loss_derivable_without_target(entry: str) -> None:
    with raises(autofit.LossError, "no loss could be derived", "loss_fn="):
        ALL[entry](_Net(), _sample())


# ---- a forward that raises ------------------------------------------------------------------------------------------
@pytest.mark.sim
@pytest.mark.parametrize("entry", [*STEP, "analyse", "plan"])
def test_forward_that_raises_names_the_innermost_module(entry: str) -> None:
    with raises(autofit.ForwardError, "'blocks.1.bad'", "ValueError", "bad things happened in forward") as info:
        ALL[entry](_Net(bad=True), _sample(), target=_labels())
    assert info.value.module == "blocks.1.bad"
    assert isinstance(info.value.__cause__, ValueError)


@pytest.mark.sim
@pytest.mark.parametrize("entry", STEP)
def test_forward_that_raises_inside_a_checkpointed_module(entry: str) -> None:
    with raises(autofit.ForwardError, "'blocks.1.bad'", "ValueError") as info:
        STEP[entry](_Net(bad=True), _sample(), target=_labels(), checkpoint=("blocks.1",))
    assert info.value.module == "blocks.1.bad"


@pytest.mark.sim
@pytest.mark.parametrize("entry", ["estimate", "analyse"])
def test_data_dependent_model_on_meta_device(entry: str) -> None:
    """Fake tensors cannot run ``if h.norm() > c``; the real fallback needs weights the meta device lacks."""
    case = ZOO["data_dependent"]()
    with torch.device("meta"):
        model = type(case.model)()
    with raises(autofit.UnsupportedModelError, "meta", "to_empty"):
        ALL[entry](model, case.sample, target=case.target)


# ---- names: optimizer, precision, checkpoint ----------------------------------------------------------------------
@pytest.mark.parametrize("entry", ALL)
def test_unknown_optimizer_name(entry: str) -> None:
    with raises(autofit.InvalidInputError, "'adamx'", "adamw", "sgd"):
        ALL[entry](_Net(), _sample(), target=_labels(), optimizer="adamx")


@pytest.mark.parametrize("entry", ALL)
def test_optimizer_passed_as_an_instance(entry: str) -> None:
    model = _Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with raises(autofit.InvalidInputError, "optimizer instance", "type(opt)", "lambda params"):
        ALL[entry](model, _sample(), target=_labels(), optimizer=opt)


@pytest.mark.parametrize("entry", ALL)
def test_optimizer_of_the_wrong_type(entry: str) -> None:
    with raises(autofit.InvalidInputError, "optimizer", "int"):
        ALL[entry](_Net(), _sample(), target=_labels(), optimizer=3)


@pytest.mark.sim
@pytest.mark.parametrize("entry", STEP)
def test_optimizer_factory_returning_something_else(entry: str) -> None:
    with raises(autofit.InvalidInputError, "returned list", "torch.optim.Optimizer"):
        STEP[entry](_Net(), _sample(), target=_labels(), optimizer=lambda params: list(params))


@pytest.mark.parametrize("precision", ["fp8", "float64", 16])
@pytest.mark.parametrize("entry", ALL)
def test_unknown_precision(entry: str, precision) -> None:
    with raises(autofit.InvalidInputError, repr(precision), "'fp32'", "'bf16'", "'fp16'"):
        ALL[entry](_Net(), _sample(), target=_labels(), precision=precision)


def test_precision_policy_with_unknown_name() -> None:
    with raises(autofit.InvalidInputError, "'fp8'", "fp32"):
        autofit.PrecisionPolicy(name="fp8")


@pytest.mark.sim
@pytest.mark.parametrize("entry", STEP)
def test_precision_policy_pinning_an_unknown_module(entry: str) -> None:
    policy = autofit.PrecisionPolicy(name="bf16", fp32_modules=("blocks.1.lln",))
    with raises(autofit.InvalidInputError, "fp32_modules", "'blocks.1.lln'", "did you mean", "'blocks.1.lin'"):
        STEP[entry](_Net(), _sample(), target=_labels(), precision=policy)


@pytest.mark.sim
@pytest.mark.parametrize("entry", WITH_CHECKPOINT)
def test_unknown_checkpoint_module_suggests_close_names(entry: str) -> None:
    with raises(autofit.InvalidInputError, "checkpoint", "'blocks.1.lln'", "did you mean", "'blocks.1.lin'"):
        WITH_CHECKPOINT[entry](_Net(), _sample(), target=_labels(), checkpoint=("blocks.0", "blocks.1.lln"))


@pytest.mark.sim
@pytest.mark.parametrize("entry", WITH_CHECKPOINT)
def test_checkpoint_of_the_whole_model(entry: str) -> None:
    with raises(autofit.InvalidInputError, "checkpoint", "whole model", "name a submodule"):
        WITH_CHECKPOINT[entry](_Net(), _sample(), target=_labels(), checkpoint=("",))


@pytest.mark.parametrize("checkpoint", [5, [1, 2]], ids=["int", "list-of-ints"])
@pytest.mark.parametrize("entry", WITH_CHECKPOINT)
def test_checkpoint_that_is_not_module_names(entry: str, checkpoint) -> None:
    with raises(autofit.InvalidInputError, "checkpoint", "module", "names"):
        WITH_CHECKPOINT[entry](_Net(), _sample(), target=_labels(), checkpoint=checkpoint)


# ---- sizes ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [0, -1, 2.0, 2.5, True, "2", None], ids=repr)
@pytest.mark.parametrize("entry", STEP)
def test_bad_micro_batch_size(entry: str, size) -> None:
    with raises(autofit.InvalidInputError, "micro_batch_size", repr(size)):
        STEP[entry](_Net(), _sample(), target=_labels(), micro_batch_size=size)


@pytest.mark.parametrize("steps", [0, -2, 1.0, True], ids=repr)
@pytest.mark.parametrize("entry", STEP)
def test_bad_accumulation_steps(entry: str, steps) -> None:
    with raises(autofit.InvalidInputError, "accumulation_steps", repr(steps)):
        STEP[entry](_Net(), _sample(), target=_labels(), accumulation_steps=steps)


@pytest.mark.parametrize("batch_size", [0, -4, 4.0, True, "4"], ids=repr)
def test_bad_plan_batch_size(batch_size) -> None:
    with raises(autofit.InvalidInputError, "batch_size", repr(batch_size)):
        _plan(_Net(), _sample(), target=_labels(), batch_size=batch_size)


@pytest.mark.parametrize("world_size", [0, 2.0, True], ids=repr)
def test_bad_plan_world_size(world_size) -> None:
    with raises(autofit.InvalidInputError, "world_size", repr(world_size)):
        _plan(_Net(), _sample(), target=_labels(), layout=autofit.Layout(world_size=world_size))


# ---- budgets and devices --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("budget", "fragments"),
    [
        ("8 gigs", ("'gigs'", "'8 gigs'", "GB", "GiB")),
        ("-1GB", ("'-1GB'", "positive")),
        ("0GB", ("'0GB'", "positive")),
        (0, ("budget", "positive")),
        ("", ("''", "'8GB'")),
        ("lots", ("'lots'", "'8GB'")),
        ("inf", ("budget", "finite")),
        ("150%", ("'150%'", "(0, 100]")),
        ("0%", ("'0%'", "(0, 100]")),
        ("ninety%", ("'ninety%'", "'90%'")),
        (None, ("budget", "NoneType", "'8GB'")),
    ],
    ids=repr,
)
def test_bad_plan_budget(budget, fragments: tuple[str, ...]) -> None:
    with raises(autofit.InvalidInputError, *fragments):
        _plan(_Net(), _sample(), target=_labels(), budget=budget)


def test_percentage_budget_without_a_device_total() -> None:
    with raises(autofit.InvalidInputError, "'90%'", "percentage", "gpu=", "'8GB'"):
        parse_budget("90%")


@pytest.mark.sim
def test_percentage_budget_on_cpu_is_a_share_of_host_memory() -> None:
    """On device="cpu" the device total is the host's memory, so "90%" is read, not refused."""
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    plan = _plan(_Net(), _sample(), target=_labels(), budget="90%")
    assert abs(plan.budget_bytes - 0.9 * host) <= 1
    assert plan.peak_bytes <= plan.budget_bytes


@pytest.mark.sim
def test_budget_too_small_is_infeasible_with_the_smallest_budget_that_works() -> None:
    with raises(autofit.InfeasibleBudgetError, "no configuration fits", "smallest reachable peak") as info:
        _plan(_Net(), _sample(), target=_labels(), budget="1KB")
    error = info.value
    assert error.budget_bytes == 1000
    assert error.min_budget_bytes > error.budget_bytes
    assert f"{error.min_budget_bytes:,} bytes" in str(error)
    # the budget it names does fit
    plan = _plan(_Net(), _sample(), target=_labels(), budget=error.min_budget_bytes)
    assert plan.device_bytes <= error.min_budget_bytes


@pytest.mark.parametrize("entry", [*STEP, "plan"])
def test_unknown_device(entry: str) -> None:
    call = ALL[entry]
    if entry == "plan":
        with raises(autofit.InvalidInputError, "device", "'tpu'", "'cpu'"):
            autofit.plan(_Net(), _sample(), "1GB", target=_labels(), device="tpu")
    else:
        with raises(autofit.InvalidInputError, "device", "'tpu'", "cpu"):
            call(_Net(), _sample(), target=_labels(), device="tpu")


def test_gpu_name_with_cpu_device() -> None:
    with raises(autofit.InvalidInputError, "gpu=", "device='cuda'"):
        autofit.plan(_Net(), _sample(), "1GB", target=_labels(), device=autofit.Device(kind="cpu", gpu="A100-80GB"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_measure_on_cuda_without_a_gpu() -> None:
    with raises(autofit.InvalidInputError, "device='cuda'", "no"):
        _measure(_Net(), _sample(), target=_labels(), device="cuda")


# ---- the model ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", [None, "resnet", lambda x: x, nn.Linear], ids=["None", "str", "function", "class"])
@pytest.mark.parametrize("entry", ALL)
def test_model_that_is_not_a_module(entry: str, model) -> None:
    with raises(autofit.InvalidInputError, "torch.nn.Module", type(model).__name__):
        ALL[entry](model, _sample(), target=_labels())


def test_measure_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = _Net()
    with raises(autofit.UnsupportedModelError, "meta", "to_empty"):
        _measure(model, _sample(), target=_labels())


@pytest.mark.sim
def test_infeasible_fsdp2_plan_does_not_advise_the_sharding_it_does():
    """Sixteen 256 x 256 layers under FSDP2 over 2 ranks with a 1 MB budget: AdamW's state, already sharded, dominates
    the smallest peak; the advice names more ranks and smaller state, not "shard it across GPUs"."""
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(16)])
    x = torch.randn(1, 256)
    with pytest.raises(autofit.InfeasibleBudgetError) as caught:
        autofit.plan(model, x, "1MB", batch_size=4, target=torch.randn(1, 256), loss_fn=nn.functional.mse_loss,
                     device="cpu", layout=autofit.Layout(world_size=2, strategy="fsdp2"), precision="fp32")
    message = str(caught.value)
    assert caught.value.dominant == "optimizer_state", message
    assert "sharded over 2 ranks already" in message and "more ranks" in message
    assert "shard it across GPUs" not in message


@pytest.mark.sim
def test_infeasible_plan_names_its_layout_as_the_plan_table_does():
    """Tensor parallel over both ranks (no FSDP2 shard dim: every rank holds half of each layer, none shards the
    states) with a 1 MB budget. The message named the layout by its strategy field, "fsdp2 over 2 ranks", a layout
    the plan did not try; it names it as the plan table does, "tp 2", with its ranks."""
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
    x = torch.randn(1, 256)
    layout = autofit.Layout(world_size=2, strategy="fsdp2", tensor_parallel=2,
                            tensor_parallel_plan={"0": "colwise", "2": "rowwise"})
    with pytest.raises(autofit.InfeasibleBudgetError) as caught:
        autofit.plan(model, x, "1MB", batch_size=2, target=torch.randn(1, 256), loss_fn=nn.functional.mse_loss,
                     device="cpu", layout=layout, precision="fp32")
    message = str(caught.value)
    assert "tp 2 over 2 ranks" in message, message
    assert "fsdp2" not in message, message
