"""A simulated step takes the model's eager code path where a library asks "am I traced?" (Note [am I traced],
autofit/simulate/traced_checks.py): the attention inputs of the simulated step equal a real step's, and the
estimate equals the CPU allocator's peak of one real step, for every decoder family of the offline table built
tiny from its config with ``use_cache=False`` (what fine-tuning scripts set), Qwen3-MoE and Whisper."""

from __future__ import annotations

import contextlib
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import autofit
from autofit.core._torch import FakeTensorMode
from autofit.simulate.traced_checks import TRANSFORMERS_CHECK, eager_answers
from autofit.simulate.value_twins import ValueTwins

_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_inner=128,
              ffn_dim=128, word_embed_proj_dim=64, num_local_experts=4, num_experts=4, moe_intermediate_size=64,
              num_experts_per_tok=2, use_cache=False, max_position_embeddings=512, n_positions=512,
              pad_token_id=None)
_ROWS, _SEQ, _VOCAB = 4, 64, 256
DECODERS = ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "mistral", "mixtral", "gpt2",
            "gpt_neox", "opt")


def _family_config(model_type: str) -> dict:
    from autofit.cli.hf_checkpoints import TABLE

    if model_type == "qwen3_moe":  # not in the offline table
        return {}
    return next(dict(c.config) for c in TABLE if c.model_type == model_type)


def _build(model_type: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ids = torch.randint(0, _VOCAB, (_ROWS, _SEQ))
    if model_type == "whisper":
        config = transformers.WhisperConfig(
            vocab_size=_VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
            max_source_positions=32, max_target_positions=128, use_cache=False, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, decoder_start_token_id=1, layerdrop=0.0, encoder_layerdrop=0.0, decoder_layerdrop=0.0)
        model = transformers.WhisperForConditionalGeneration(config)
        return model, {"input_features": torch.randn(_ROWS, 16, 64), "decoder_input_ids": ids, "labels": ids.clone()}
    kwargs = {k: v for k, v in _family_config(model_type).items() if k != "model_type"}
    kwargs.update(_SMALL)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    return transformers.AutoModelForCausalLM.from_config(config), {"input_ids": ids, "labels": ids.clone()}


class _AttentionCalls(TorchFunctionMode):
    """(query shape, mask shape or None, is_causal) of every SDPA call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
            self.calls.append((tuple(args[0].shape), None if mask is None else tuple(mask.shape), bool(causal)))
        return func(*args, **kwargs)


@contextlib.contextmanager
def _masks_made(model, made: list):
    """Record what the model's mask builders (``create_causal_mask``, ``create_sliding_window_causal_mask``, ...,
    imported by name into its modeling module) return: None, or the mask's shape and dtype."""
    module = sys.modules[type(model).__module__]
    names = [n for n in dir(module) if n.startswith("create_") and n.endswith("mask")]
    originals = {n: getattr(module, n) for n in names}

    def recording(name, fn):
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            masks = out.values() if isinstance(out, dict) else [out]
            made.append((name, tuple(None if m is None else (tuple(m.shape), m.dtype) for m in masks)))
            return out
        return wrapper

    for n, fn in originals.items():
        setattr(module, n, recording(n, fn))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(module, n, fn)


def _attention_inputs_agree(model, sample) -> autofit.MemoryEstimate:
    sim_masks, real_masks = [], []
    with _AttentionCalls() as simulated, _masks_made(model, sim_masks):
        est = autofit.estimate(model, sample, step=_ROWS, optimizer="adam")
    with _AttentionCalls() as real, _masks_made(model, real_masks):
        model(**sample).loss.backward()
    model.zero_grad(set_to_none=True)
    # the simulation runs two micro-batches of the window (WINDOW_MICRO_BATCHES): every one of its calls is a call
    # of the real step, mask and is_causal included (with the traced branch: a (B, 1, S, S) mask, is_causal False)
    assert real.calls or real_masks  # eager attention (Gemma 2) makes no SDPA call; its masks are compared
    assert set(simulated.calls) == set(real.calls)
    assert set(sim_masks) == set(real_masks)
    return est


@pytest.mark.sim
def test_simulated_attention_inputs_equal_a_real_steps():
    _attention_inputs_agree(*_build("llama"))


# estimate and measure take 5 to 30 s each on two shared cores
@pytest.mark.sim
@pytest.mark.slow
@pytest.mark.parametrize("model_type", (*DECODERS, "qwen3_moe", "whisper"))
def test_simulated_step_equals_one_real_step_with_use_cache_off(model_type):
    model, sample = _build(model_type)
    est = _attention_inputs_agree(model, sample)
    meas = autofit.measure(model, sample, step=_ROWS, optimizer="adam")
    assert abs(est.peak_bytes - meas.peak_bytes) <= 0.001 * meas.peak_bytes


def test_position_ids_of_one_sequence_per_row_are_not_packed_in_a_simulation():
    # masking_utils.find_packed_sequence_indices: an eager step reads the values and returns None; a FakeTensor
    # counts as tracing (import_utils.is_tracing -> is_fake_tensor) and gets the packed-sequence mask
    masking_utils = pytest.importorskip("transformers.masking_utils")
    import_utils = pytest.importorskip(TRANSFORMERS_CHECK[0])
    original = getattr(import_utils, TRANSFORMERS_CHECK[1])
    real = torch.arange(_SEQ).expand(_ROWS, _SEQ)
    assert masking_utils.find_packed_sequence_indices(real) is None
    fake_mode = FakeTensorMode()
    fake = fake_mode.from_tensor(real)
    unknown = fake_mode.from_tensor(real.clone())  # no twin: its values are not known
    twins = ValueTwins()
    twins.add(fake, real)
    with fake_mode, twins:
        assert masking_utils.find_packed_sequence_indices(fake) is not None  # the traced branch
        with eager_answers(twins):
            assert masking_utils.find_packed_sequence_indices(fake) is None
            assert import_utils.is_tracing(unknown)
    assert getattr(import_utils, TRANSFORMERS_CHECK[1]) is original


def test_interpreter_tracing_checks_answer_false_in_an_eager_simulation():
    # Note [am I traced]: these look at the interpreter, not the tensors; an eager training step and its
    # simulation both answer False
    seen = []

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen.append((torch.compiler.is_compiling(), torch.jit.is_tracing(), torch.jit.is_scripting()))
            return x * 2

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), Probe())
    with FakeTensorMode() as mode, ValueTwins() as twins, eager_answers(twins):
        net_fake = torch.nn.Linear(4, 4)
        Probe()(net_fake(mode.from_tensor(torch.randn(2, 4))))
    net(torch.randn(2, 4))
    assert seen and set(seen) == {(False, False, False)}
