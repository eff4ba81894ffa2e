"""``estimate``, ``measure``, ``analyse`` and ``plan`` leave the user's model, sample and target as they found them.

estimate, measure and plan must leave the user's model unchanged (parameters, buffers, hooks, training mode): the
user plans and then trains the same model. A snapshot taken before each call is compared after it: parameter and buffer values bit for bit, their
identity, version counters and ``requires_grad``; ``.grad`` (None stays None, an existing gradient stays the same
tensor with the same bits); every hook dict of every module and of the parameters (same hooks, same order); the
training mode and class of every submodule; each module's ``__dict__`` keys (no ``forward`` left behind by checkpoint
or fp32 patching); and the sample and target tensors. Models come from the zoo: one with BatchNorm (running stats and
``num_batches_tracked`` would move if a real forward ran on the user's model), one with dict inputs, and the
data-dependent one (estimated by a real run on a copy). Each call checkpoints the case's modules, so the patching
path runs. Models built on the meta device work with ``estimate`` and ``analyse``; ``measure`` refuses them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import autofit

try:
    from tests.zoo import ZOO, ZooCase
except ImportError:  # tests/ on sys.path rather than the repository root
    from zoo import ZOO, ZooCase

CASES = ("resnet_bn", "hf_dict", "data_dependent")


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (exact equality, NaN and -0.0 included); meta tensors have none."""
    if t.is_meta:
        return torch.empty(0, dtype=torch.uint8)
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).clone()


def _hook_dicts(obj: Any) -> dict[str, list[tuple[Any, Any]]]:
    """Every hook registry on a module or tensor: name -> [(handle id, hook object)] in registration order."""
    names = [n for n in vars(obj) if "hook" in n] if isinstance(obj, nn.Module) else \
        ["_backward_hooks", "_post_accumulate_grad_hooks"]
    found = {}
    for name in names:
        value = getattr(obj, name, None)
        if isinstance(value, dict):
            found[name] = list(value.items())
        elif value is not None:
            found[name] = [(None, value)]
    return found


def _same_objects(before: list[tuple[Any, Any]], after: list[tuple[Any, Any]]) -> bool:
    return len(before) == len(after) and all(k1 == k2 and v1 is v2 for (k1, v1), (k2, v2) in zip(before, after))


@dataclass
class _TensorState:
    obj: torch.Tensor
    version: int
    bits: torch.Tensor
    requires_grad: bool
    dtype: torch.dtype
    device: torch.device


def _tensor_state(t: torch.Tensor) -> _TensorState:
    return _TensorState(t, t._version, _bits(t), t.requires_grad, t.dtype, t.device)


def _assert_tensor_same(what: str, before: _TensorState, now: torch.Tensor) -> None:
    assert now is before.obj, f"{what} was replaced by another tensor"
    assert now._version == before.version, f"{what} was modified in place ({before.version} -> {now._version})"
    assert now.requires_grad == before.requires_grad, f"{what}.requires_grad changed"
    assert (now.dtype, now.device) == (before.dtype, before.device), f"{what} changed dtype or device"
    assert torch.equal(_bits(now), before.bits), f"{what} changed value"


@dataclass
class _Snapshot:
    modules: list[tuple[str, nn.Module, type, bool, tuple[str, ...], dict]]
    params: dict[str, tuple[_TensorState, _TensorState | None, dict]]
    buffers: dict[str, _TensorState]
    inputs: list[tuple[Any, _TensorState]]
    containers: list[tuple[Any, list[tuple[Any, Any]]]]
    global_hooks: dict[str, list[tuple[Any, Any]]]


def _inputs(*values: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor)]


def _containers(*values: Any) -> list[tuple[Any, list[tuple[Any, Any]]]]:
    """Dicts and lists the user handed in, with their entries (autofit must not add, drop or replace any)."""
    out = []
    for value in values:
        if isinstance(value, dict):
            out.append((value, list(value.items())))
        elif isinstance(value, list):
            out.append((value, list(enumerate(value))))
    return out


def _global_hooks() -> dict[str, list[tuple[Any, Any]]]:
    module = torch.nn.modules.module
    names = [n for n in vars(module) if n.startswith("_global_") and "hook" in n]
    return {n: list(getattr(module, n).items()) for n in names if isinstance(getattr(module, n), dict)}


def snapshot(model: nn.Module, *inputs: Any) -> _Snapshot:
    modules = [(name, m, type(m), m.training, tuple(vars(m)), _hook_dicts(m)) for name, m in model.named_modules()]
    params = {
        name: (_tensor_state(p), None if p.grad is None else _tensor_state(p.grad), _hook_dicts(p))
        for name, p in model.named_parameters()
    }
    buffers = {name: _tensor_state(b) for name, b in model.named_buffers()}
    tensors = [(t, _tensor_state(t)) for t in _inputs(*inputs)]
    return _Snapshot(modules, params, buffers, tensors, _containers(*inputs), _global_hooks())


def assert_unchanged(model: nn.Module, before: _Snapshot) -> None:
    now = list(model.named_modules())
    assert [n for n, _ in now] == [n for n, *_ in before.modules], "the module tree changed"
    for (name, module), (_, obj, cls, training, keys, hooks) in zip(now, before.modules):
        where = f"module {name or '(root)'!r}"
        assert module is obj, f"{where} was replaced"
        assert type(module) is cls, f"{where} changed class to {type(module).__name__}"
        assert module.training == training, f"{where} changed training mode to {module.training}"
        assert tuple(vars(module)) == keys, (
            f"{where} __dict__ keys changed: added {sorted(set(vars(module)) - set(keys))}, "
            f"removed {sorted(set(keys) - set(vars(module)))}"
        )
        assert "forward" not in vars(module) or "forward" in keys, f"{where} kept a patched forward"
        now_hooks = _hook_dicts(module)
        assert now_hooks.keys() == hooks.keys(), f"{where} hook registries changed"
        for registry, entries in hooks.items():
            assert _same_objects(entries, now_hooks[registry]), f"{where}.{registry} changed"

    named = dict(model.named_parameters())
    assert list(named) == list(before.params), "the parameter list changed"
    for name, (state, grad, hooks) in before.params.items():
        p = named[name]
        _assert_tensor_same(f"parameter {name!r}", state, p)
        assert isinstance(p, nn.Parameter)
        if grad is None:
            assert p.grad is None, f"parameter {name!r} gained a .grad"
        else:
            assert p.grad is not None, f"parameter {name!r} lost its .grad"
            _assert_tensor_same(f"{name!r}.grad", grad, p.grad)
        now_hooks = _hook_dicts(p)
        for registry, entries in hooks.items():
            assert _same_objects(entries, now_hooks[registry]), f"parameter {name!r}.{registry} changed"

    buffers = dict(model.named_buffers())
    assert list(buffers) == list(before.buffers), "the buffer list changed"
    for name, state in before.buffers.items():
        _assert_tensor_same(f"buffer {name!r}", state, buffers[name])

    for i, (t, state) in enumerate(before.inputs):
        _assert_tensor_same(f"input tensor #{i}", state, t)
    for container, entries in before.containers:
        now_entries = list(container.items()) if isinstance(container, dict) else list(enumerate(container))
        assert _same_objects(entries, now_entries), f"the {type(container).__name__} handed in was changed"

    now_global = _global_hooks()
    for registry, entries in before.global_hooks.items():
        assert _same_objects(entries, now_global[registry]), f"global {registry} changed"


# ---- dressing a model up with state autofit must not touch ---------------------------------------------------------
def _dress(model: nn.Module) -> None:
    """Hooks of every kind, a mix of train/eval submodules, and some parameters holding gradients."""
    calls: list[str] = []
    modules = [m for n, m in model.named_modules() if n]
    for i, m in enumerate(modules[:4]):
        m.register_forward_pre_hook(lambda mod, args: calls.append("pre"))
        m.register_forward_hook(lambda mod, args, out: calls.append("post"))
        if i % 2 == 0:
            m.register_forward_hook(lambda mod, args, kwargs, out: None, with_kwargs=True)
    model.register_forward_pre_hook(lambda mod, args: None)
    # the last leaf with weights: its input requires grad, so a full backward hook has something to report
    leaf = next(m for m in reversed(modules) if not list(m.children()) and list(m.parameters(recurse=False)))
    leaf.register_full_backward_hook(lambda mod, gin, gout: None)
    leaf.register_full_backward_pre_hook(lambda mod, gout: None)
    params = [p for p in model.parameters() if p.requires_grad]
    params[0].register_hook(lambda g: None)
    params[-1].register_post_accumulate_grad_hook(lambda p: None)
    for p in params[::2]:  # every other parameter has a gradient from an earlier step; the rest have None
        p.grad = torch.full_like(p, 0.25)
    model.train()
    for m in modules[1::3]:
        m.eval()  # a mixed model: the snapshot checks each submodule's own mode


def _calls(case: ZooCase) -> dict[str, Any]:
    common = dict(target=case.target, loss_fn=case.loss_fn)
    return {
        "estimate": lambda: autofit.estimate(case.model, case.sample,
                                             step=autofit.Step(micro_batch_size=case.micro_batch_size,
                                                               checkpoint=case.checkpoint), **common),
        "measure": lambda: autofit.measure(case.model, case.sample,
                                           step=autofit.Step(micro_batch_size=case.micro_batch_size,
                                                             checkpoint=case.checkpoint), **common),
        "analyse": lambda: autofit.analyse(case.model, case.sample, **common),
        "plan": lambda: autofit.plan(case.model, case.sample, "1GB", batch_size=8, device="cpu",
                                     savers=autofit.Savers(checkpoint=case.checkpoint), precision="fp32", **common),
    }


@pytest.mark.sim
@pytest.mark.parametrize("entry", ["estimate", "measure", "analyse", "plan"])
@pytest.mark.parametrize("name", CASES)
def test_model_and_sample_unchanged(name: str, entry: str) -> None:
    case = ZOO[name]()
    _dress(case.model)
    before = snapshot(case.model, case.sample, case.target)
    rng = torch.get_rng_state
    _calls(case)[entry]()
    assert_unchanged(case.model, before)
    assert torch.get_rng_state is rng, "torch.get_rng_state was left patched"
    assert torch.is_grad_enabled()


@pytest.mark.sim
def test_fp32_pinned_modules_and_bf16_leave_the_model_unchanged() -> None:
    """The fp32 pin is a second instance-level ``forward`` patch, next to checkpointing; both must come off."""
    case = ZOO["resnet_bn"]()
    _dress(case.model)
    before = snapshot(case.model, case.sample, case.target)
    policy = autofit.PrecisionPolicy(name="bf16", fp32_modules=("head", "layers.1"))
    for fn in (autofit.estimate, autofit.measure):
        fn(case.model, case.sample, target=case.target, precision=policy,
           step=autofit.Step(micro_batch_size=2, checkpoint=("layers.0", "layers.2"), accumulation_steps=2))
        assert_unchanged(case.model, before)
        assert not torch.is_autocast_enabled("cpu")


@pytest.mark.sim
def test_model_with_its_own_forward_override_keeps_it() -> None:
    """A model whose user already set an instance ``forward`` gets that same function back after patching."""
    case = ZOO["resnet_bn"]()
    block = case.model.layers[0]
    original = block.forward

    def own_forward(x):
        return original(x)

    block.forward = own_forward
    before = snapshot(case.model, case.sample, case.target)
    autofit.estimate(case.model, case.sample, target=case.target,
                     step=autofit.Step(micro_batch_size=2, checkpoint=("layers.0",)))
    autofit.measure(case.model, case.sample, target=case.target,
                    step=autofit.Step(micro_batch_size=2, checkpoint=("layers.0",)))
    assert_unchanged(case.model, before)
    assert block.__dict__["forward"] is own_forward


class _Raises(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")


@pytest.mark.sim
@pytest.mark.parametrize("entry", ["estimate", "measure", "analyse"])
def test_failing_forward_leaves_the_model_unchanged(entry: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Sequential(nn.Linear(4, 4), _Raises()))
    _dress(model)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    before = snapshot(model, x, y)
    with pytest.raises(autofit.ForwardError):
        if entry == "analyse":
            autofit.analyse(model, x, target=y)
        else:
            getattr(autofit, entry)(model, x, target=y, step=autofit.Step(micro_batch_size=2, checkpoint=("2", "1")))
    assert_unchanged(model, before)


# ---- models on the meta device -------------------------------------------------------------------------------------
def _meta_twin(case: ZooCase) -> nn.Module:
    """The case's architecture, built again on the meta device (same shapes and dtypes, no storage)."""
    with torch.device("meta"):
        return type(case.model)()


@pytest.mark.sim
@pytest.mark.parametrize("name", ["resnet_bn", "gpt_sdpa"])
def test_meta_model_estimate_and_analyse(name: str) -> None:
    case = ZOO[name]()
    meta = _meta_twin(case)
    assert all(p.is_meta for p in meta.parameters())
    before = snapshot(meta, case.sample, case.target)
    kwargs = dict(target=case.target, step=autofit.Step(micro_batch_size=2, checkpoint=case.checkpoint))
    est = autofit.estimate(meta, case.sample, **kwargs)
    # shapes and dtypes are all an estimate reads: the meta model and the real one give the same number
    assert est.peak_bytes == autofit.estimate(case.model, case.sample, **kwargs).peak_bytes
    params = sum(p.numel() * p.element_size() for p in meta.parameters())
    assert est.peak_bytes > 2 * params  # at least parameters, gradients and optimizer state
    analysis = autofit.analyse(meta, case.sample, target=case.target)
    assert analysis.table.row("").param_bytes == params
    assert_unchanged(meta, before)
    assert all(p.is_meta for p in meta.parameters()) and all(b.is_meta for b in meta.buffers())


def test_meta_model_measure_is_unsupported() -> None:
    case = ZOO["resnet_bn"]()
    meta = _meta_twin(case)
    before = snapshot(meta, case.sample, case.target)
    with pytest.raises(autofit.UnsupportedModelError) as info:
        autofit.measure(meta, case.sample, target=case.target, step=2)
    assert "meta" in str(info.value) and "to_empty" in str(info.value)
    assert_unchanged(meta, before)
