"""The fine-tuning stack on the CPU allocator (issue 24): quantized layers (bitsandbytes 4-bit and 8-bit, alone and
under peft LoRA), optimizers that read values or keep low-bit state (Adafactor, bitsandbytes and torchao 8-bit and
4-bit), and compiled models. Each estimate is held to ``autofit.measure`` (the allocator's own record), within
0.5 %. Tiny models built from configs; the libraries are optional (``pip install torch-autofit[finetune]``)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import autofit
from autofit.core.errors import UnsupportedModelError

transformers = pytest.importorskip("transformers")

# minutes in all (torchao compiles its optimizer step per shape): with the whole suite, on the oldest torch
pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _compile_in_this_thread():
    """The compiles these tests make (torch.compile of a model, torchao's steps) leave no inductor thread pool
    behind: its non-daemon worker would keep later tests' plans from forking simulation workers
    (tests/test_plan_speed.py)."""
    from autofit.core._torch_compile import compile_in_this_thread

    with compile_in_this_thread():
        yield

TOLERANCE = 0.005


def _close(est, meas) -> None:
    error = est.peak_bytes / meas.peak_bytes - 1
    assert abs(error) <= TOLERANCE, (est.peak_bytes, meas.peak_bytes, f"{100 * error:+.3f} %", dict(est.breakdown))


def _llama(hidden: int = 64):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=128)
    return transformers.LlamaForCausalLM(config)


def _tokens(rows: int, length: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (rows, length), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def _quantize(model: nn.Module, kind: str, double_quant: bool = True) -> nn.Module:
    """Every linear layer but the head replaced by bitsandbytes' 4-bit (nf4/fp4) or 8-bit layer, as
    transformers' BitsAndBytesConfig does, quantized on the CPU."""
    bnb = pytest.importorskip("bitsandbytes")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear) or name == "lm_head":
                continue
            if kind == "int8":
                layer = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=child.bias is not None,
                                            has_fp16_weights=False)
                layer.weight = bnb.nn.Int8Params(child.weight.data.clone(), requires_grad=False,
                                                 has_fp16_weights=False)
            else:
                layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=torch.float32, quant_type=kind,
                                          compress_statistics=double_quant)
                layer.weight = bnb.nn.Params4bit(child.weight.data.clone(), requires_grad=False, quant_type=kind,
                                                 compress_statistics=double_quant)
            setattr(module, name, layer.to("cpu"))  # .to quantizes
    return model


def _trainable_norms(model: nn.Module) -> nn.Module:
    for name, p in model.named_parameters():
        p.requires_grad_("norm" in name)
    return model


# ---- quantized layers ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind, double_quant, hidden, rows, length", [
    ("nf4", True, 64, 4, 64),     # activations at the peak
    ("nf4", True, 256, 1, 16),    # the dequantized weight (gemm_4bit's scratch) at the peak
    ("fp4", False, 256, 1, 16),
    ("int8", False, 256, 1, 16),
])
def test_quantized_llama_estimate_matches_measure(kind, double_quant, hidden, rows, length) -> None:
    model = _trainable_norms(_quantize(_llama(hidden), kind, double_quant))
    sample = _tokens(rows, length)
    est = autofit.estimate(model, sample, step=rows)
    meas = autofit.measure(model, sample, step=rows)
    _close(est, meas)


def test_quantization_statistics_are_counted_with_the_parameters() -> None:
    """The 4-bit weight's statistics (its nf4 code book; double quantization: 8-bit absmax, fp32 second-level
    absmax, code book and offset; bitsandbytes/functional.py, QuantState) are memory the parameter's storage does
    not show; they are counted, here by hand from the fields QuantState has."""
    model = _quantize(_llama(64), "nf4")
    layers = [m for m in model.modules() if type(m).__name__ == "Linear4bit"]
    packed = sum(m.weight.numel() for m in layers)  # uint8, two 4-bit values each
    blocks = sum(m.weight.numel() * 2 // 64 for m in layers)  # one 8-bit absmax per block of 64 values
    ours = {id(t.untyped_storage()): t.untyped_storage().nbytes()
            for m in layers for t in (m.weight.quant_state.code, m.weight.quant_state.absmax,
                                      m.weight.quant_state.state2.absmax,
                                      m.weight.quant_state.state2.code, m.weight.quant_state.offset)}
    assert blocks <= sum(ours.values())
    others = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "proj" not in n)
    est = autofit.estimate(model, _tokens(2, 16), step=2, optimizer="sgd")
    assert est.breakdown["parameters"] == packed + sum(ours.values()) + others


def test_peft_qlora_estimate_plan_and_trainer() -> None:
    peft = pytest.importorskip("peft")
    model = _quantize(_llama(64), "nf4")
    for p in model.parameters():
        p.requires_grad_(False)
    model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    sample = _tokens(4, 64)
    est = autofit.estimate(model, sample, step=4)
    meas = autofit.measure(model, sample, step=4)
    _close(est, meas)
    plan = autofit.plan(model, sample, budget=int(meas.peak_bytes * 0.6), device="cpu", precision="fp32")
    assert plan.peak_bytes <= plan.budget_bytes
    trainable = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trainable]
    loss = plan.wrap(model, torch.optim.AdamW(trainable, lr=1e-3)).step(sample)
    assert torch.isfinite(torch.as_tensor(loss))
    assert any(not torch.equal(a, p) for a, p in zip(before, trainable))


# ---- optimizers ------------------------------------------------------------------------------------------------------
def _optimizer(name: str):
    if name == "adafactor":
        return lambda params: torch.optim.Adafactor(params, lr=1e-2)
    if name.startswith("bnb"):
        bnb = pytest.importorskip("bitsandbytes")
        cls = {"bnb-adamw8bit": bnb.optim.AdamW8bit, "bnb-paged-adamw8bit": bnb.optim.PagedAdamW8bit}[name]
        return lambda params: cls(params, lr=1e-3)
    optim = pytest.importorskip("torchao.optim")
    cls = {"ao-adamw8bit": optim.AdamW8bit, "ao-adamw4bit": optim.AdamW4bit}[name]
    return lambda params: cls(params, lr=1e-3)


@pytest.mark.parametrize("name", ["adafactor", "bnb-adamw8bit", "bnb-paged-adamw8bit", "ao-adamw8bit",
                                  "ao-adamw4bit"])
def test_optimizer_step_and_state_match_measure(name) -> None:
    """Two 512 x 512 linears and two rows: the peak is the optimizer step, so the state's bytes and the step's
    scratch (bitsandbytes' CPU update, torchao's compiled step) both decide it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512, bias=False), nn.Linear(512, 512, bias=False))
    kw = dict(step=2, optimizer=_optimizer(name), loss_fn=lambda out: out.square().mean())
    meas = autofit.measure(model, torch.randn(2, 512), **kw)
    est = autofit.estimate(model, torch.randn(2, 512), **kw)
    assert meas.breakdown["optimizer_state"] == est.breakdown["optimizer_state"]
    _close(est, meas)


@pytest.mark.parametrize("name", ["adafactor", "bnb-adamw8bit", "ao-adamw8bit"])
def test_optimizer_on_tiny_llama(name) -> None:
    model = _llama(64)
    sample = _tokens(4, 64)
    kw = dict(step=4, optimizer=_optimizer(name))
    _close(autofit.estimate(model, sample, **kw), autofit.measure(model, sample, **kw))


class _ReadsValues(torch.optim.SGD):
    """An optimizer autofit knows nothing about that reads a value in its step."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.norm().item() > 1e9:
                    p.grad.zero_()
        return super().step(closure)


def test_optimizer_reading_values_runs_for_real_or_is_refused() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    kw = dict(step=4, optimizer=lambda ps: _ReadsValues(ps, lr=0.1, momentum=0.9),
              loss_fn=lambda out: out.square().mean())
    est = autofit.estimate(model, torch.randn(4, 64), **kw)
    assert any("_ReadsValues" in note and "for real" in note for note in est.notes)
    _close(est, autofit.measure(model, torch.randn(4, 64), **kw))
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    with pytest.raises(UnsupportedModelError, match="_ReadsValues"):
        autofit.estimate(meta, torch.randn(4, 64), **kw)


class _Broken(torch.optim.SGD):
    def step(self, closure=None):
        raise RuntimeError("no kernel for this device")


def test_optimizer_that_cannot_step_gets_a_typed_error() -> None:
    model = nn.Linear(8, 8)
    with pytest.raises(UnsupportedModelError, match="_Broken"):
        autofit.estimate(model, torch.randn(2, 8), step=2, loss_fn=lambda out: out.sum(),
                         optimizer=lambda ps: _Broken(ps, lr=0.1))


# ---- torch.compile ---------------------------------------------------------------------------------------------------
def test_compiled_model_counts_its_gradients_and_optimizer_state() -> None:
    """A compiled model's copy runs the copy's parameters (Note [compiled models]): gradients and optimizer state
    are counted, with a note; where the peak is the optimizer step, compilation does not change it (the estimate
    equals the eager model's) and it matches ``measure`` of the compiled model. Where compilation changes the peak:
    tests/test_compile.py. Needs a C compiler for inductor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    kw = dict(step=8, loss_fn=lambda out: out.square().mean())
    sample = torch.randn(8, 256)
    eager = autofit.estimate(model, sample, **kw)
    compiled = torch.compile(model)
    est = autofit.estimate(compiled, sample, **kw)
    assert est.peak_bytes == eager.peak_bytes
    assert est.breakdown["optimizer_state"] >= 2 * est.breakdown["parameters"]  # AdamW: two moments (+ steps)
    assert any("torch.compile" in note for note in est.notes)
    _close(est, autofit.measure(compiled, sample, **kw))
