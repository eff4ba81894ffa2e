"""The plans issue 24 asks to see (benchmarks/fine_tuning_plans.py): a Llama-3.2-3B-shaped model built on the meta
device, full fine-tuning on a 16 GiB budget with the opt-in rungs allowed, and peft LoRA r=16 on 12 GiB. Truths by
hand: the parameter count of Llama 3.2 3B (3,212,749,824 with tied embeddings, meta-llama/Llama-3.2-3B's model card:
3.21 B), 2 bytes per bf16 value, and the budgets."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from benchmarks.fine_tuning_plans import full_fine_tuning_16gb, llama_3b, lora_12gb  # noqa: E402

pytestmark = pytest.mark.slow  # minutes: a 28-layer model analysed on fake tensors, rung by rung

N = 3_212_749_824  # parameters of Llama 3.2 3B, tied embeddings


def test_the_model_is_llama_3_2_3b_shaped():
    assert sum(p.numel() for p in llama_3b().parameters()) == N


@pytest.mark.slow(seconds=45)
def test_full_fine_tuning_on_16gb_climbs_both_rungs():
    plan = full_fine_tuning_16gb()
    assert plan.device_bytes <= 16 * 2**30
    assert plan.low_bit_optimizer == "bitsandbytes.optim.AdamW8bit"
    assert plan.chunked_loss is not None and plan.chunked_loss.head == "lm_head"
    assert any("rung 'chunked-loss' climbed" in n and "saves" in n for n in plan.notes), plan.notes
    assert any("rung '8bit-optimizer' climbed" in n and "saves" in n for n in plan.notes), plan.notes
    # pure bf16 parameters: 2 bytes each, by hand
    assert plan.precision.stored == "bf16"
    assert plan.estimate.breakdown["parameters"] == pytest.approx(2 * N, rel=0.001)


@pytest.mark.slow(seconds=45)
def test_lora_r16_on_12gb():
    pytest.importorskip("peft")
    plan = lora_12gb()
    assert plan.device_bytes <= 12 * 2**30
    assert plan.estimate.breakdown["parameters"] >= 2 * N  # the bf16 base, and the adapters
