"""LoRA and QLoRA on ``hf:`` models (``--lora``, ``--lora-targets``, ``--qlora``; :func:`autofit.hf_model`), built on
the meta device. Truths: hand counts of the adapters' parameters (r x (in + out) per adapted linear layer) and of
NF4's bytes (half a byte a weight, one 8-bit absmax per block of 64, double quantization's fp32 absmax per 256
blocks and code books), and ``autofit.measure`` (the CPU allocator) on the same tiny model quantized for real by
bitsandbytes on the CPU, prepared and adapted by peft's own functions."""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import autofit
from autofit.cli.app import app

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

QWEN05 = "Qwen/Qwen2.5-0.5B"
# Qwen2.5-0.5B: 24 layers of width 896, 2 KV heads of 64 (k / v project 896 -> 128), MLP 4864
_WIDE, _KV, _MLP, _LAYERS = 896, 128, 4864, 24
_SHAPES = {"q_proj": (_WIDE, _WIDE), "k_proj": (_WIDE, _KV), "v_proj": (_WIDE, _KV), "o_proj": (_WIDE, _WIDE),
           "gate_proj": (_WIDE, _MLP), "up_proj": (_WIDE, _MLP), "down_proj": (_MLP, _WIDE)}


def _lora_params(rank: int, targets) -> int:
    """LoRA's A (in x r) and B (r x out) per adapted layer, in every layer: r x (in + out)."""
    return _LAYERS * sum(rank * (i + o) for name, (i, o) in _SHAPES.items() if name in targets)


def _trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_lora_adds_peft_default_targets_hand_count():
    """peft's default for qwen2 is q_proj and v_proj (peft/utils/constants.py)."""
    model = autofit.hf_model(QWEN05, lora=16)
    assert _trainable(model) == _lora_params(16, ("q_proj", "v_proj")) == 1_081_344
    assert all(p.device.type == "meta" for p in model.parameters())


def test_lora_all_linear_and_listed_targets():
    assert _trainable(autofit.hf_model(QWEN05, lora=8, lora_targets="all-linear")) == _lora_params(8, _SHAPES)
    listed = autofit.hf_model(QWEN05, lora=4, lora_targets=["q_proj", "down_proj"], lora_alpha=8)
    assert _trainable(listed) == _lora_params(4, ("q_proj", "down_proj"))


def _nf4_bytes(n: int) -> int:
    """One Linear4bit weight of n values, NF4 with double quantization (bitsandbytes/functional.py quantize_4bit,
    QuantState): n / 2 packed bytes; one absmax per block of 64, itself quantized to 8 bits; one fp32 absmax per 256
    of those; the 256-entry fp32 code book of the second level, the 16-entry fp32 NF4 code book, an fp32 offset."""
    blocks = math.ceil(n / 64)
    return n // 2 + blocks + 4 * math.ceil(blocks / 256) + 4 * 256 + 4 * 16 + 4


@pytest.mark.sim
def test_qlora_parameter_bytes_hand_count():
    model = autofit.hf_model(QWEN05, lora=16, qlora=True)
    four_bit = [m for m in model.modules() if type(m).__module__.startswith("bitsandbytes")]
    assert len(four_bit) == 7 * _LAYERS  # every linear layer but the (tied) output
    quantized = _LAYERS * sum(_nf4_bytes(i * o) for i, o in _SHAPES.values())
    # q/k/v biases: cast to fp32 by peft's prepare_model_for_kbit_training, back to bf16 (the compute dtype) by the
    # layer's first forward (bitsandbytes' Linear4bit.forward), and so bf16 in every step after
    biases = _LAYERS * (_WIDE + 2 * _KV)
    others = 151936 * _WIDE + _LAYERS * 2 * _WIDE + _WIDE  # embedding (tied) and RMSNorms: fp32 after that cast
    lora = _lora_params(16, ("q_proj", "v_proj"))  # peft keeps adapters in fp32
    assert _trainable(model) == lora
    est = autofit.estimate(model, _tokens(151936, 1, 8), step=1, optimizer="sgd")
    assert est.breakdown["parameters"] == quantized + 2 * biases + 4 * (others + lora)


def _tokens(vocab: int, rows: int, length: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


_TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 256,
         "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 128}


def _real_qlora(rank: int) -> nn.Module:
    """The tiny model with real weights, its linear layers quantized by bitsandbytes on the CPU as transformers'
    BitsAndBytesConfig(load_in_4bit, nf4, double quant) does, then peft's prepare_model_for_kbit_training and
    get_peft_model with peft's default targets."""
    bnb = pytest.importorskip("bitsandbytes")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{k: v for k, v in _TINY.items() if k != "model_type"})
    model = transformers.LlamaForCausalLM(config)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and name != "lm_head":
                layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=torch.float32, quant_type="nf4", compress_statistics=True)
                layer.weight = bnb.nn.Params4bit(child.weight.data.clone(), requires_grad=False, quant_type="nf4",
                                                 compress_statistics=True)
                setattr(module, name, layer.to("cpu"))  # .to quantizes
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return peft.get_peft_model(model, peft.LoraConfig(r=rank))


@pytest.mark.sim
def test_qlora_states_on_the_host_are_refused_and_a_plan_names_its_smallest_budget(tmp_path):
    """FSDP2 turns every parameter into a plain nn.Parameter DTensor (torch's _fsdp_param.py, _init_sharded_param),
    which drops Params4bit's quant_state (Accelerate leaves such weights out of sharding: accelerate#3987): FSDP2's
    CPU offload of a QLoRA model is refused by name, not a crash inside bitsandbytes' forward, and the planner does not
    climb to that rung: a 1-byte budget names the smallest budget, as without offload."""
    pytest.importorskip("bitsandbytes")
    (tmp_path / "config.json").write_text(json.dumps(_TINY))
    model = autofit.hf_model(str(tmp_path), lora=8, qlora=True)
    sample = _tokens(128, 2, 16)
    with pytest.raises(autofit.UnsupportedModelError, match="bitsandbytes quantized weights.*quant_state"):
        autofit.estimate(model, sample, device=autofit.Device(gpu="RTX-4090"),
                         step=autofit.Step(micro_batch_size=1, offload_states=True))
    with pytest.raises(autofit.InfeasibleBudgetError) as refused:
        autofit.plan(model, sample, 1, batch_size=2, device=autofit.Device(gpu="RTX-4090"))
    with pytest.raises(autofit.InfeasibleBudgetError) as without:
        autofit.plan(model, sample, 1, batch_size=2, device=autofit.Device(gpu="RTX-4090"),
                     savers=autofit.Savers(offload=False))
    assert refused.value.min_budget_bytes == without.value.min_budget_bytes


@pytest.mark.sim
@pytest.mark.parametrize("rows, length", [(4, 64), (1, 16)])
def test_qlora_on_meta_estimate_matches_measure_of_the_real_model(tmp_path, rows, length):
    pytest.importorskip("bitsandbytes")
    (tmp_path / "config.json").write_text(json.dumps(_TINY))
    on_meta = autofit.hf_model(str(tmp_path), lora=8, qlora=True)
    real = _real_qlora(8)
    assert _trainable(on_meta) == _trainable(real)
    import bitsandbytes as bnb

    assert all(c.device.type == "cpu" for c in bnb.functional.name2qmap.values())  # the cache left as found
    sample = _tokens(128, rows, length)
    est = autofit.estimate(on_meta, sample, step=rows)
    meas = autofit.measure(real, sample, step=rows)
    error = est.peak_bytes / meas.peak_bytes - 1
    assert abs(error) <= 0.005, (est.peak_bytes, meas.peak_bytes, f"{100 * error:+.3f} %", dict(est.breakdown))


@pytest.mark.sim
def test_an_unquantized_4bit_layer_gets_a_typed_error_naming_the_fix():
    bnb = pytest.importorskip("bitsandbytes")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    config = transformers.LlamaConfig(**{k: v for k, v in _TINY.items() if k != "model_type"})
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model.model.layers[0].self_attn.q_proj = bnb.nn.Linear4bit(256, 256, bias=False, quant_type="nf4",
                                                               device="meta")
    with pytest.raises(autofit.UnsupportedModelError, match="never quantized.*quantize_4bit.*qlora=True"):
        autofit.estimate(model, _tokens(128, 1, 8), step=1)


runner = CliRunner()


@pytest.mark.sim
def test_cli_lora_and_qlora_say_what_they_built():
    base = ["estimate", "hf:" + QWEN05, "-m", "1", "--input-shape", "8", "--device", "cpu"]
    lora = runner.invoke(app, [*base, "--lora", "16"], catch_exceptions=False)
    assert lora.exit_code == 0, lora.output
    assert "LoRA r=16 on q_proj,v_proj (peft's default for qwen2)" in " ".join(lora.output.split())
    qlora = runner.invoke(app, [*base, "--lora", "16", "--lora-targets", "all-linear", "--qlora", "--json"],
                          catch_exceptions=False)
    assert qlora.exit_code == 0, qlora.output
    assert "QLoRA r=16" in json.loads(qlora.stdout)["model"]


@pytest.mark.parametrize("args, words", [
    (["--qlora"], "--qlora needs --lora RANK"),
    (["--lora", "0"], "positive integer"),
    (["--lora", "8", "--lora-targets", "nope_proj"], "--lora-targets nope_proj"),
])
def test_cli_bad_adapter_flags_exit_2(args, words):
    result = runner.invoke(app, ["estimate", "hf:" + QWEN05, "-m", "1", "--input-shape", "8", "--device", "cpu",
                                 *args])
    assert result.exit_code == 2 and words in " ".join(result.output.split()), result.output


def test_lora_on_a_factory_is_refused():
    result = runner.invoke(app, ["estimate", "examples/factories.py:mlp", "-m", "1", "--input-shape", "128",
                                 "--device", "cpu", "--lora", "8"])
    assert result.exit_code == 2 and "--lora applies to hf:" in " ".join(result.output.split())


# ---- LoRA over an int8 base (load_in_8bit; Note [8-bit LoRA on meta]) -------------------------------------------
def _int8_bytes(i: int, o: int) -> int:
    """One Linear8bitLt weight of o rows x i columns: CB, 1 int8 byte a weight, and SCB, one fp32 absmax a row
    (bitsandbytes/_ops.py, the fake kernel of int8_vectorwise_quant: ``out_row`` int8 of A's shape, ``row_stats``
    fp32 of A.numel() // A.shape[-1]; Int8Params._quantize, bitsandbytes/nn/modules.py, keeps both)."""
    return i * o + 4 * o


@pytest.mark.sim
def test_int8_lora_parameter_bytes_hand_count():
    pytest.importorskip("bitsandbytes")
    model = autofit.hf_model(QWEN05, lora=16, load_in_8bit=True)
    eight_bit = [m for m in model.modules() if type(m).__module__.startswith("bitsandbytes")]
    assert len(eight_bit) == 7 * _LAYERS  # every linear layer but the (tied) output
    quantized = _LAYERS * sum(_int8_bytes(i, o) for i, o in _SHAPES.values())
    # everything else fp32, as peft's prepare_model_for_kbit_training casts it: q/k/v biases, the (tied) embedding,
    # the RMSNorms; the adapters fp32 too
    biases = _LAYERS * (_WIDE + 2 * _KV)
    others = 151936 * _WIDE + _LAYERS * 2 * _WIDE + _WIDE
    lora = _lora_params(16, ("q_proj", "v_proj"))
    assert _trainable(model) == lora
    est = autofit.estimate(model, _tokens(151936, 1, 8), step=1, optimizer="sgd")
    assert est.breakdown["parameters"] == quantized + 4 * (biases + others + lora)


def _real_int8_lora(rank: int) -> nn.Module:
    """The tiny model with real weights in fp16, its linear layers quantized by bitsandbytes on the CPU as
    transformers' BitsAndBytesConfig(load_in_8bit=True) does (Int8Params(has_fp16_weights=False), quantized by
    ``.to``), then peft's prepare_model_for_kbit_training and get_peft_model with peft's default targets."""
    bnb = pytest.importorskip("bitsandbytes")
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{k: v for k, v in _TINY.items() if k != "model_type"})
    model = transformers.LlamaForCausalLM(config).to(torch.float16)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and name != "lm_head":
                layer = bnb.nn.Linear8bitLt(child.in_features, child.out_features, bias=child.bias is not None,
                                            has_fp16_weights=False, threshold=6.0)
                layer.weight = bnb.nn.Int8Params(child.weight.data.clone(), requires_grad=False,
                                                 has_fp16_weights=False)
                setattr(module, name, layer.to("cpu"))  # .to quantizes
    assert isinstance(model.model.layers[0].self_attn.q_proj.weight.SCB, torch.Tensor)  # quantized for real
    model.is_loaded_in_8bit = True
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return peft.get_peft_model(model, peft.LoraConfig(r=rank))


@pytest.mark.sim
@pytest.mark.parametrize("rows, length", [(4, 64), (1, 16)])
def test_int8_lora_on_meta_estimate_matches_measure_of_the_real_model(tmp_path, rows, length):
    pytest.importorskip("bitsandbytes")
    (tmp_path / "config.json").write_text(json.dumps({**_TINY, "dtype": "float16"}))
    on_meta = autofit.hf_model(str(tmp_path), lora=8, load_in_8bit=True)
    real = _real_int8_lora(8)
    assert _trainable(on_meta) == _trainable(real)
    assert [(n, p.dtype, p.shape) for n, p in on_meta.named_parameters()] == [
        (n, p.dtype, p.shape) for n, p in real.named_parameters()]
    sample = _tokens(128, rows, length)
    est = autofit.estimate(on_meta, sample, step=rows)
    meas = autofit.measure(real, sample, step=rows)
    error = est.peak_bytes / meas.peak_bytes - 1
    assert abs(error) <= 0.005, (est.peak_bytes, meas.peak_bytes, f"{100 * error:+.3f} %", dict(est.breakdown))


def test_int8_needs_a_rank_and_is_not_4bit_too():
    with pytest.raises(autofit.InvalidInputError, match="8-bit base .* needs a LoRA rank"):
        autofit.hf_model(QWEN05, load_in_8bit=True)
    with pytest.raises(autofit.InvalidInputError, match="4-bit .* or 8-bit"):
        autofit.hf_model(QWEN05, lora=8, qlora=True, load_in_8bit=True)


@pytest.mark.sim
@pytest.mark.parametrize("flags, words", [
    (["--lora", "8", "--dtype", "fp32"], "fp32, as --dtype says"),
    (["--lora", "8", "--qlora"], "QLoRA r=8"),
])
def test_cli_verify_takes_the_adapter_and_dtype_flags(tmp_path, flags, words):
    """``autofit verify`` builds the model ``plan`` builds from the same flags, gives it real weights (the 4-bit
    ones quantized by bitsandbytes on the CPU) and runs it: the measured peak (the CPU allocator) is within 1 % of
    the plan's."""
    if "--qlora" in flags:
        pytest.importorskip("bitsandbytes")
    (tmp_path / "config.json").write_text(json.dumps({**_TINY, "dtype": "bfloat16"}))
    result = runner.invoke(app, ["verify", f"hf:{tmp_path}", "--budget", "200MB", "-n", "4", "--input-shape", "32",
                                 "--steps", "1", *flags])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert words in text and "LoRA r=8" in text
    rows = {line.split("│")[1].strip(): line.split("│")[3].strip() for line in result.output.splitlines()
            if line.count("│") >= 4}
    predicted, measured = (int(rows[k].replace(",", "")) for k in ("predicted peak", "measured peak"))
    assert abs(predicted / measured - 1) <= 0.01, (predicted, measured)
