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


@pytest.mark.sim
def test_pure_bf16_is_chosen_when_16_bytes_per_parameter_cannot_fit():
    model, ids = _meta_llama()
    n = sum(p.numel() for p in model.parameters())
    budget = int(2.2 * GiB)
    assert 16 * n > budget > 8 * n  # by hand: fp32 and the fp32 master copy cannot fit, pure bf16 can
    plan = autofit.plan(model, ids, budget, batch_size=4, target=ids, device="A100-80GB")
    assert plan.precision.stored == "bf16" and plan.precision.name == "bf16"
    assert plan.device_bytes <= budget
    assert plan.estimate.breakdown["parameters"] == 2 * n and plan.estimate.breakdown["gradients"] == 2 * n
    assert "stored pure bf16" in str(plan) and autofit.Plan.from_json(plan.to_json()).precision == plan.precision
    assert any("skipped without analysis" in note for note in plan.notes)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # planning converted nothing of the user's


@pytest.mark.sim
def test_a_floor_keeps_the_master_copy_and_the_error_names_what_is_left():
    model, ids = _meta_llama()
    with pytest.raises(autofit.InfeasibleBudgetError) as info:
        autofit.plan(model, ids, int(2.2 * GiB), batch_size=4, target=ids, device="A100-80GB",
                     precision=autofit.Precision(min_stored="fp32-master"),
                     savers=autofit.Savers(offload=False))  # the states on the GPU: offload.md's case
    assert "bf16/bf16-master" in str(info.value)  # the lowest it was allowed to try
    assert "stored='bf16-master' or 'bf16'" not in str(info.value)  # no advice to do what it already did


def test_a_gpu_without_bf16_gets_the_fp16_master_copy_never_pure_fp16():
    from autofit.device import resolve_device
    from autofit.validate import stored_options

    model, _ = _meta_llama()
    assert [p.label for p in stored_options(model, "auto", resolve_device("cuda", "T4"), 1, None)] == \
        ["fp16/fp16-master"]
    assert [p.label for p in stored_options(model, "auto", resolve_device("cuda", "A100-80GB"), 1, None)] == \
        ["bf16/bf16-master", "bf16/bf16"]
    assert stored_options(model, "auto", resolve_device("cuda", "A100-80GB"), 1, "fp32") == ()
    assert stored_options(model, "auto", resolve_device("cpu"), 1, None) == ()  # the CPU keeps the model's dtype
    assert stored_options(model.to(torch.bfloat16), "auto", resolve_device("cuda", "A100-80GB"), 1, None) == ()
    with pytest.raises(autofit.InvalidInputError, match="min_stored_precision"):
        stored_options(model, "auto", resolve_device("cuda", "A100-80GB"), 1, "fp8")


@pytest.mark.slow(seconds=45)
def test_llama_7b_in_fp32_plans_for_one_a100_at_72_gib():
    """The issue's case: 6.74 B parameters built in fp32 (16 bytes per parameter: 100 GiB of states), one
    A100-80GB, a 72 GiB budget, effective batch 64 x 2048."""
    with torch.device("meta"):
        model = Llama(LlamaConfig())
    ids = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    plan = autofit.plan(model, ids, 72 * GiB, batch_size=64, target=ids, device="A100-80GB")
    assert plan.precision.stored == "bf16" and plan.device_bytes <= 72 * GiB
    n = sum(p.numel() for p in model.parameters())
    assert plan.estimate.breakdown["parameters"] == 2 * n


# ---- modules the user keeps in fp32 (Note [the cost of an fp32 pin]) ------------------------------------------------
def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=512, n_positions=32, n_embd=64, n_layer=2, n_head=2, bos_token_id=0,
                                     eos_token_id=0, use_cache=False)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 512, (4, 32))
    return model, {"input_ids": ids, "labels": ids}


def _pin_note(plan, label):
    import re

    note = next(n for n in plan.notes if n.startswith(f"fp32 pin {label} "))
    nbytes = int(re.search(r"\(([-+][0-9,]+) B\)", note).group(1).replace(",", ""))
    ms = float(re.search(r"([-+][0-9.e-]+) ms per step", note).group(1))
    return nbytes, ms


@pytest.mark.sim
def test_pins_by_class_and_name_and_their_memory_cost_against_the_allocator():
    model, sample = _tiny_gpt2()
    plan = autofit.plan(model, sample, "1GB", device="cpu",
                        precision=autofit.Precision(compute="bf16", fp32_modules=["LayerNorm", "lm_head"]),
                        savers=autofit.Savers(checkpoint=None))
    assert set(plan.precision.fp32_modules) == {"transformer.h.0.ln_1", "transformer.h.0.ln_2",
                                                "transformer.h.1.ln_1", "transformer.h.1.ln_2", "transformer.ln_f",
                                                "lm_head"}
    nbytes, _ = _pin_note(plan, "lm_head")
    knobs = dict(optimizer="adamw",
                 step=autofit.Step(micro_batch_size=plan.micro_batch_size,
                                   accumulation_steps=plan.gradient_accumulation_steps))
    pinned = autofit.measure(model, sample, precision=plan.precision, **knobs).peak_bytes
    unpinned_policy = autofit.PrecisionPolicy(name="bf16", fp32_modules=tuple(
        n for n in plan.precision.fp32_modules if n != "lm_head"))
    unpinned = autofit.measure(model, sample, precision=unpinned_policy, **knobs).peak_bytes
    assert nbytes == pinned - unpinned


@pytest.mark.sim
def test_pin_time_cost_is_the_roofline_of_its_flops_by_hand():
    model, sample = _tiny_gpt2()
    plan = autofit.plan(model, sample, "1GB", device="A100-80GB", precision=autofit.Precision(fp32_modules=["lm_head"]))
    _, ms = _pin_note(plan, "lm_head")
    # lm_head: forward 2 x tokens x 64 x 512 FLOPs, backward twice that (input and weight gradients), per micro-batch
    tokens = 4 * 32
    flops = 6 * tokens * 64 * 512
    by_hand = flops * (1 / 19.5e12 - 1 / 312e12) * 1e3  # A100 fp32 vs bf16 dense peaks (cuda/catalog.py)
    assert ms == pytest.approx(by_hand, rel=1e-2)


def test_unknown_pin_is_a_typed_error():
    model, sample = _tiny_gpt2()
    with pytest.raises(autofit.InvalidInputError, match="lm_haed"):
        autofit.plan(model, sample, "1GB", device="cpu", precision=autofit.Precision(fp32_modules=["lm_haed"]))


@pytest.mark.sim
def test_auto_pins_the_final_norm_and_head_when_memory_allows_and_not_otherwise():
    model, sample = _tiny_gpt2()
    knobs = dict(device="cpu", savers=autofit.Savers(checkpoint=None), optimizer="adamw")
    free = autofit.plan(model, sample, "1GB", precision=autofit.Precision(compute="bf16", fp32_modules="auto"), **knobs)
    assert free.precision.fp32_modules == ("transformer.ln_f", "lm_head")
    step = dict(optimizer="adamw",
                step=autofit.Step(micro_batch_size=free.micro_batch_size,
                                  accumulation_steps=free.gradient_accumulation_steps))
    measured = autofit.measure(model, sample, precision=free.precision, **step).peak_bytes
    # the plan's estimate is of the pinned step: as close to the allocator as the unpinned step's estimate (tiny GPT-2
    # on transformers 5.x is a few dozen bytes off either way)
    plain = autofit.PrecisionPolicy(name="bf16")
    offset = autofit.estimate(model, sample, precision=plain, **step).peak_bytes - \
        autofit.measure(model, sample, precision=plain, **step).peak_bytes
    assert free.peak_bytes - measured == offset and abs(offset) <= 64
    assert any(n.startswith("fp32 pin lm_head") for n in free.notes)


class _WideHead(torch.nn.Module):
    """A head fed by a bf16 activation: pinned, it copies its input to fp32 and writes fp32 outputs, so here the pin
    costs memory (its exact cost is the note's, held to the allocator in the test above)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(64, 1024)
        self.head = torch.nn.Linear(1024, 1024)

    def forward(self, x):
        return self.head(self.body(x))


@pytest.mark.sim
def test_auto_pins_are_left_out_when_they_do_not_fit():
    torch.manual_seed(0)
    model, x, y = _WideHead(), torch.randn(2048, 64), torch.randn(2048, 1024)
    knobs = dict(target=y, loss_fn=torch.nn.functional.mse_loss, device="cpu", savers=autofit.Savers(checkpoint=None),
                 optimizer="sgd")
    pins = autofit.Precision(compute="bf16", fp32_modules="auto")
    unpinned = autofit.plan(model, x, "1GB", precision="bf16", **knobs)
    pinned = autofit.plan(model, x, "1GB", precision=pins, **knobs)
    assert pinned.precision.fp32_modules == ("head",) and unpinned.micro_batch_size == pinned.micro_batch_size
    assert pinned.peak_bytes > unpinned.peak_bytes
    tight = autofit.plan(model, x, unpinned.peak_bytes, precision=pins, **knobs)
    assert tight.precision.fp32_modules == () and tight.peak_bytes <= unpinned.peak_bytes
    assert any("left out" in n for n in tight.notes)
