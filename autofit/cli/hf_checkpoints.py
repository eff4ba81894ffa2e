"""The configs of common Hugging Face checkpoints, so that ``hf:NAME`` plans offline: numbers only, no weights.

Each entry is the keyword arguments of ``transformers.AutoConfig.for_model(model_type, **kwargs)``, copied from the
checkpoint's ``config.json`` on the Hugging Face Hub (the fields that decide shapes; everything else keeps the config
class's default, which for these checkpoints is the published value). ``architectures`` is kept because it names the
head the checkpoint was trained with, and ``hf:`` builds that head unless ``--task`` says otherwise.

Names are the Hub's repository ids; the short legacy ids (``gpt2``, ``bert-base-uncased``, ``t5-small``) are aliases
of the organisation ids (``openai-community/gpt2``, ``google-bert/bert-base-uncased``, ``google-t5/t5-small``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["CHECKPOINTS", "checkpoint_config"]


def _gpt2(n_layer: int, n_embd: int, n_head: int) -> dict[str, Any]:
    # openai-community/gpt2*/config.json: vocab 50257, 1024 positions, GELU-new MLP of 4 x n_embd
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": n_layer, "n_embd": n_embd,
            "n_head": n_head, "vocab_size": 50257, "n_positions": 1024, "n_ctx": 1024}


def _bert(layers: int, hidden: int, heads: int, vocab: int) -> dict[str, Any]:
    # google-bert/bert-*/config.json: 512 positions, 2 token types, intermediate 4 x hidden
    return {"model_type": "bert", "architectures": ["BertForMaskedLM"], "num_hidden_layers": layers,
            "hidden_size": hidden, "num_attention_heads": heads, "intermediate_size": 4 * hidden,
            "vocab_size": vocab, "max_position_embeddings": 512, "type_vocab_size": 2}


def _roberta(layers: int, hidden: int, heads: int) -> dict[str, Any]:
    # FacebookAI/roberta-*/config.json: 514 positions (2 reserved for the padding offset), one token type
    return {"model_type": "roberta", "architectures": ["RobertaForMaskedLM"], "num_hidden_layers": layers,
            "hidden_size": hidden, "num_attention_heads": heads, "intermediate_size": 4 * hidden,
            "vocab_size": 50265, "max_position_embeddings": 514, "type_vocab_size": 1, "layer_norm_eps": 1e-5,
            "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2}


def _t5(layers: int, d_model: int, d_ff: int, heads: int, d_kv: int = 64) -> dict[str, Any]:
    # google-t5/t5-*/config.json: relu feed-forward, vocab 32128, as many decoder as encoder layers
    return {"model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "num_layers": layers,
            "num_decoder_layers": layers, "d_model": d_model, "d_ff": d_ff, "num_heads": heads, "d_kv": d_kv,
            "vocab_size": 32128, "feed_forward_proj": "relu"}


def _opt(layers: int, hidden: int, heads: int, proj: int | None = None, pre_norm: bool = True) -> dict[str, Any]:
    # facebook/opt-*/config.json: 2048 positions, vocab 50272, ffn 4 x hidden; opt-350m projects embeddings
    # from 512 and normalises after each block (do_layer_norm_before false)
    return {"model_type": "opt", "architectures": ["OPTForCausalLM"], "num_hidden_layers": layers,
            "hidden_size": hidden, "num_attention_heads": heads, "ffn_dim": 4 * hidden, "vocab_size": 50272,
            "max_position_embeddings": 2048, "word_embed_proj_dim": proj or hidden,
            "do_layer_norm_before": pre_norm}


def _llama(layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int, positions: int,
           rope_theta: float = 10000.0, **extra: Any) -> dict[str, Any]:
    # meta-llama/*/config.json: RMSNorm 1e-5, SwiGLU MLP of intermediate_size, untied embeddings
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers,
            "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
            "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": positions,
            "rms_norm_eps": 1e-5, "rope_theta": rope_theta, "tie_word_embeddings": False, **extra}


def _vit(layers: int, hidden: int, heads: int, labels: int | None) -> dict[str, Any]:
    # google/vit-*-patch16-224/config.json: 224 x 224 images, 16 x 16 patches, intermediate 4 x hidden, 1000
    # ImageNet classes (the -in21k checkpoints are headless: ViTModel)
    head = {"architectures": ["ViTForImageClassification"], "num_labels": labels} if labels else \
        {"architectures": ["ViTModel"]}
    return {"model_type": "vit", "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
            "intermediate_size": 4 * hidden, "image_size": 224, "patch_size": 16, "num_channels": 3, **head}


_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}

_TABLE: dict[str, dict[str, Any]] = {
    "openai-community/gpt2": _gpt2(12, 768, 12),
    "openai-community/gpt2-medium": _gpt2(24, 1024, 16),
    "openai-community/gpt2-large": _gpt2(36, 1280, 20),
    "openai-community/gpt2-xl": _gpt2(48, 1600, 25),
    "distilbert/distilgpt2": _gpt2(6, 768, 12),
    "google-bert/bert-base-uncased": _bert(12, 768, 12, 30522),
    "google-bert/bert-base-cased": _bert(12, 768, 12, 28996),
    "google-bert/bert-large-uncased": _bert(24, 1024, 16, 30522),
    "google-bert/bert-large-cased": _bert(24, 1024, 16, 28996),
    "FacebookAI/roberta-base": _roberta(12, 768, 12),
    "FacebookAI/roberta-large": _roberta(24, 1024, 16),
    "google-t5/t5-small": _t5(6, 512, 2048, 8),
    "google-t5/t5-base": _t5(12, 768, 3072, 12),
    "google-t5/t5-large": _t5(24, 1024, 4096, 16),
    "facebook/opt-125m": _opt(12, 768, 12),
    "facebook/opt-350m": _opt(24, 1024, 16, proj=512, pre_norm=False),
    "facebook/opt-1.3b": _opt(24, 2048, 32),
    "facebook/opt-2.7b": _opt(32, 2560, 32),
    "facebook/opt-6.7b": _opt(32, 4096, 32),
    "facebook/opt-13b": _opt(40, 5120, 40),
    "meta-llama/Llama-2-7b-hf": _llama(32, 4096, 11008, 32, 32, 32000, 4096),
    "meta-llama/Llama-2-13b-hf": _llama(40, 5120, 13824, 40, 40, 32000, 4096),
    "meta-llama/Llama-2-70b-hf": _llama(80, 8192, 28672, 64, 8, 32000, 4096),
    "meta-llama/Meta-Llama-3-8B": _llama(32, 4096, 14336, 32, 8, 128256, 8192, 500000.0),
    "meta-llama/Meta-Llama-3-70B": _llama(80, 8192, 28672, 64, 8, 128256, 8192, 500000.0),
    "meta-llama/Llama-3.1-8B": _llama(32, 4096, 14336, 32, 8, 128256, 131072, 500000.0,
                                      rope_scaling=_LLAMA31_ROPE),
    "meta-llama/Llama-3.1-70B": _llama(80, 8192, 28672, 64, 8, 128256, 131072, 500000.0,
                                       rope_scaling=_LLAMA31_ROPE),
    # mistralai/Mistral-7B-v0.1/config.json: Llama-like with grouped-query attention and a 4096-token window
    "mistralai/Mistral-7B-v0.1": {"model_type": "mistral", "architectures": ["MistralForCausalLM"],
                                  "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
                                  "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
                                  "max_position_embeddings": 32768, "sliding_window": 4096, "rms_norm_eps": 1e-5,
                                  "rope_theta": 10000.0, "tie_word_embeddings": False},
    "google/vit-base-patch16-224": _vit(12, 768, 12, 1000),
    "google/vit-base-patch16-224-in21k": _vit(12, 768, 12, None),
    "google/vit-large-patch16-224": _vit(24, 1024, 16, 1000),
}

_ALIASES = {name.split("/", 1)[1]: name for name in _TABLE
            if name.split("/", 1)[0] in ("openai-community", "distilbert", "google-bert", "FacebookAI", "google-t5")}

CHECKPOINTS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {**{name: MappingProxyType(kw) for name, kw in _TABLE.items()},
     **{alias: MappingProxyType(_TABLE[name]) for alias, name in _ALIASES.items()}}
)


def checkpoint_config(name: str) -> dict[str, Any] | None:
    """A copy of the table's entry for ``name`` (a Hub id or a legacy short id), or None."""
    entry = CHECKPOINTS.get(name)
    return None if entry is None else copy.deepcopy(dict(entry))
