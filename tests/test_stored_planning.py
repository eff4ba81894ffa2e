"""The planner chooses the stored precision (Note [stored precision]): in order of risk, only when the model's own
dtype does not fit, with a user floor. Truth: hand byte counts of parameters, gradients and AdamW state."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import autofit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.llama import Llama, LlamaConfig  # noqa: E402

GiB = 2**30


def _meta_llama(**overrides) -> tuple[torch.nn.Module, torch.Tensor]:
    config = LlamaConfig(**{"vocab_size": 32000, "hidden_size": 1536, "intermediate_size": 4096, "num_layers": 2,
                            "num_heads": 12, "max_seq_len": 256, **overrides})
    with torch.device("meta"):
        model = Llama(config)
    return model, torch.zeros(1, config.max_seq_len, dtype=torch.long, device="meta")


def test_pure_bf16_is_chosen_when_16_bytes_per_parameter_cannot_fit():
    model, ids = _meta_llama()
    n = sum(p.numel() for p in model.parameters())
    budget = int(2.2 * GiB)
    assert 16 * n > budget > 8 * n  # by hand: fp32 and the fp32 master copy cannot fit, pure bf16 can
    plan = autofit.plan(model, ids, budget, batch_size=4, target=ids, device="cuda", gpu="A100-80GB")
    assert plan.precision.stored == "bf16" and plan.precision.name == "bf16"
    assert plan.device_bytes <= budget
    assert plan.estimate.breakdown["parameters"] == 2 * n and plan.estimate.breakdown["gradients"] == 2 * n
    assert "stored pure bf16" in str(plan) and autofit.Plan.from_json(plan.to_json()).precision == plan.precision
    assert any("skipped without analysis" in note for note in plan.notes)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # planning converted nothing of the user's


def test_a_floor_keeps_the_master_copy_and_the_error_names_what_is_left():
    model, ids = _meta_llama()
    with pytest.raises(autofit.InfeasibleBudgetError) as info:
        autofit.plan(model, ids, int(2.2 * GiB), batch_size=4, target=ids, device="cuda", gpu="A100-80GB",
                     min_stored_precision="fp32-master")
    assert "bf16/bf16-master" in str(info.value)  # the lowest it was allowed to try
    assert "stored='bf16-master' or 'bf16'" not in str(info.value)  # no advice to do what it already did


def test_a_gpu_without_bf16_gets_the_fp16_master_copy_never_pure_fp16():
    from autofit.device import resolve_device
    from autofit.request import _stored_options

    model, _ = _meta_llama()
    assert [p.label for p in _stored_options(model, "auto", resolve_device("cuda", "T4"), 1, None)] == \
        ["fp16/fp16-master"]
    assert [p.label for p in _stored_options(model, "auto", resolve_device("cuda", "A100-80GB"), 1, None)] == \
        ["bf16/bf16-master", "bf16/bf16"]
    assert _stored_options(model, "auto", resolve_device("cuda", "A100-80GB"), 1, "fp32") == ()
    assert _stored_options(model, "auto", resolve_device("cpu"), 1, None) == ()  # the CPU keeps the model's dtype
    assert _stored_options(model.to(torch.bfloat16), "auto", resolve_device("cuda", "A100-80GB"), 1, None) == ()
    with pytest.raises(autofit.InvalidInputError, match="min_stored_precision"):
        _stored_options(model, "auto", resolve_device("cuda", "A100-80GB"), 1, "fp8")


@pytest.mark.slow
def test_llama_7b_in_fp32_plans_for_one_a100_at_72_gib():
    """The issue's case: 6.74 B parameters built in fp32 (16 bytes per parameter: 100 GiB of states), one
    A100-80GB, a 72 GiB budget, effective batch 64 x 2048."""
    with torch.device("meta"):
        model = Llama(LlamaConfig())
    ids = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    plan = autofit.plan(model, ids, 72 * GiB, batch_size=64, target=ids, device="cuda", gpu="A100-80GB")
    assert plan.precision.stored == "bf16" and plan.device_bytes <= 72 * GiB
    n = sum(p.numel() for p in model.parameters())
    assert plan.estimate.breakdown["parameters"] == 2 * n
