"""Tiny configurations of current Hugging Face architectures, built from configs in code (no hub, no weights).

Each factory seeds the RNG and returns (model, sample) with the model's own loss (``output.loss``): a dense decoder,
a sliding-window decoder, a mixture-of-experts decoder, a state-space model, an encoder-decoder text model, a speech
model, a vision transformer and a dual encoder. Sizes are chosen so estimate + measure of all of them, in two
precisions, take well under a minute on two CPU cores.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

__all__ = ["ARCHS", "mixtral", "token_batch"]

ARCHS: dict[str, Callable[[], tuple[torch.nn.Module, Any]]] = {}
_VOCAB, _BATCH, _SEQ = 128, 2, 16


def _register(fn):
    if fn.__name__ in ARCHS:
        raise ValueError(f"architecture {fn.__name__!r} registered twice")

    def seeded(*args, **kwargs):
        torch.manual_seed(0)
        return fn(*args, **kwargs)

    seeded.__name__ = fn.__name__
    ARCHS[fn.__name__] = seeded
    return seeded


def token_batch(ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, _VOCAB, (_BATCH, _SEQ)) if ids is None else ids
    return {"input_ids": ids, "labels": ids.clone()}


_DECODER = dict(vocab_size=_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64)


@_register
def llama():
    """Dense decoder (RMSNorm, rotary, grouped-query attention, SwiGLU)."""
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_DECODER)), token_batch()


@_register
def mistral_sliding():
    """Sliding-window decoder: the window (8) is shorter than the sequence (16)."""
    config = transformers.MistralConfig(**_DECODER, sliding_window=8)
    return transformers.MistralForCausalLM(config), token_batch()


@_register
def mixtral(experts_implementation: str | None = None):
    """Mixture of experts: 4 experts, top-2 routing (transformers' grouped-GEMM path unless told otherwise)."""
    config = transformers.MixtralConfig(**_DECODER, num_local_experts=4, num_experts_per_tok=2)
    if experts_implementation is not None:
        config._experts_implementation = experts_implementation
    return transformers.MixtralForCausalLM(config), token_batch()


@_register
def mamba():
    """State-space model, the slow path (no mamba_ssm / causal_conv1d kernels on the CPU)."""
    config = transformers.MambaConfig(vocab_size=_VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                                      conv_kernel=4)
    return transformers.MambaForCausalLM(config), token_batch()


@_register
def t5():
    """Encoder-decoder text model (relative position buckets, labels shifted into decoder inputs)."""
    config = transformers.T5Config(vocab_size=_VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0, pad_token_id=0)
    return transformers.T5ForConditionalGeneration(config), token_batch()


@_register
def whisper():
    """Speech encoder-decoder: log-mel features (8 bins x 32 frames) in, tokens out."""
    config = transformers.WhisperConfig(vocab_size=_VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2,
                                        decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                                        encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
                                        max_target_positions=32, pad_token_id=0, decoder_start_token_id=1,
                                        bos_token_id=1, eos_token_id=2)
    labels = torch.randint(3, _VOCAB, (_BATCH, 8))
    return transformers.WhisperForConditionalGeneration(config), {"input_features": torch.randn(_BATCH, 8, 32),
                                                                   "labels": labels}


@_register
def vit():
    """Vision transformer classifier on 16x16 images, 4x4 patches."""
    config = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=64, num_labels=5)
    return transformers.ViTForImageClassification(config), {"pixel_values": torch.randn(_BATCH, 3, 16, 16),
                                                            "labels": torch.randint(0, 5, (_BATCH,))}


@_register
def clip():
    """Dual encoder (text and vision towers, contrastive loss)."""
    text = dict(vocab_size=_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=32)
    vision = dict(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4)
    config = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    return transformers.CLIPModel(config), {"input_ids": torch.randint(0, _VOCAB, (_BATCH, _SEQ)),
                                            "pixel_values": torch.randn(_BATCH, 3, 16, 16), "return_loss": True}
