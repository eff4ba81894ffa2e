"""A plan that needs ``expandable_segments:True`` states it everywhere and its trainer puts it in place (Note
[expandable segments as a plan knob] in autofit/device.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

import autofit
from autofit.core import _torch
from autofit.core.errors import AllocatorSettingError
from autofit.core.report import EXPANDABLE_SEGMENTS
from autofit.emit import trainer as trainer_module
from autofit.emit.export import EXPORTERS, to_torchtitan_toml


@pytest.fixture(scope="module")
def plans():
    """A small CPU plan, and the same plan as one on CUDA that needs expandable segments."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    plan = autofit.plan(model, torch.randn(8, 16), "1GB", target=torch.randint(0, 4, (8,)),
                        loss_fn=nn.CrossEntropyLoss(), precision="fp32", device="cpu")
    needs = replace(plan, device="cuda", estimate=replace(plan.estimate, alloc_conf=EXPANDABLE_SEGMENTS))
    return model, plan, needs


@pytest.fixture
def settings():
    """The allocator's settings restored after the test (they are process-wide)."""
    before = _torch.allocator_settings()
    yield
    _torch.set_allocator_settings(before or "expandable_segments:False")


def test_the_plan_states_the_setting_in_its_table_json_and_exports(plans):
    _, plain, needs = plans
    assert plain.alloc_conf == "" and "CUDA allocator" not in str(plain)
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in str(needs)
    assert autofit.Plan.from_json(needs.to_json()).alloc_conf == EXPANDABLE_SEGMENTS
    assert autofit.Plan.from_json(plain.to_json()).alloc_conf == ""
    for name, export in EXPORTERS.items():
        text = str(export(needs))
        assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in text, name
        assert "PYTORCH_CUDA_ALLOC_CONF" not in str(export(plain)), name
    assert "# launch with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in to_torchtitan_toml(needs)


def test_wrap_sets_it_before_anything_is_allocated(plans, settings):
    model, plain, needs = plans
    _torch.set_allocator_settings("expandable_segments:False")
    plain.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "expandable_segments:True" not in _torch.allocator_settings()
    needs.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert "expandable_segments:True" in _torch.allocator_settings()


def test_wrap_refuses_when_cuda_memory_came_first(plans, settings, monkeypatch):
    # what a process with the model already on the GPU sees: CUDA initialised, memory reserved
    model, _, needs = plans
    _torch.set_allocator_settings("expandable_segments:False")
    cuda = trainer_module.torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(cuda, "memory_reserved", lambda *a, **k: 1 << 30)
    with pytest.raises(AllocatorSettingError, match="export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"):
        needs.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_the_hugging_face_callback_sets_it_too(plans, settings):
    pytest.importorskip("transformers")
    from autofit.integrations.hf import AutofitCallback

    _, _, needs = plans
    _torch.set_allocator_settings("expandable_segments:False")
    AutofitCallback(needs)
    assert "expandable_segments:True" in _torch.allocator_settings()
