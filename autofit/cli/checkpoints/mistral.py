"""Mistral 7B, Mistral NeMo, Mistral Small (22B, 24B) and Mixtral, from each repository's ``config.json``; ``-Instruct`` variants share the
entry of the base model of the same version."""

from __future__ import annotations

from typing import Any

from autofit.cli.checkpoints.entry import Checkpoint

__all__ = ["CHECKPOINTS"]


def _mistral(layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int, positions: int,
             rope_theta: float, window: int | None, **extra: Any) -> dict[str, Any]:
    # MistralForCausalLM: Llama-like (RMSNorm 1e-5, SwiGLU, untied) with grouped-query attention
    return {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "num_hidden_layers": layers,
            "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
            "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": positions,
            "sliding_window": window, "rms_norm_eps": 1e-5, "rope_theta": rope_theta, "tie_word_embeddings": False,
            **extra}


def _mixtral(layers: int, hidden: int, inter: int, heads: int, vocab: int, positions: int) -> dict[str, Any]:
    # MixtralForCausalLM: Mistral's attention (8 KV heads, no window), 8 SwiGLU experts per layer of which the router
    # picks 2 per token, auxiliary load-balancing loss 0.02, RoPE base 1e6
    return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "num_hidden_layers": layers,
            "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
            "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": vocab,
            "max_position_embeddings": positions, "sliding_window": None, "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "output_router_logits": False,
            "tie_word_embeddings": False}


_AI = "mistralai"  # every entry's config.json says "torch_dtype": "bfloat16"

CHECKPOINTS: tuple[Checkpoint, ...] = (
    # v0.1: a 4096-token sliding window, RoPE base 1e4, vocab 32000
    Checkpoint(name=f"{_AI}/Mistral-7B-v0.1", family="Mistral", dtype="bfloat16", aliases=(f"{_AI}/Mistral-7B-Instruct-v0.1",),
               config=_mistral(32, 4096, 14336, 32, 8, 32000, 32768, 10000.0, 4096)),
    # Instruct v0.2: no window, RoPE base 1e6 (its base model was not published on the Hub)
    Checkpoint(name=f"{_AI}/Mistral-7B-Instruct-v0.2", family="Mistral", dtype="bfloat16",
               config=_mistral(32, 4096, 14336, 32, 8, 32000, 32768, 1000000.0, None)),
    # v0.3: v0.2 with the vocabulary extended to 32768
    Checkpoint(name=f"{_AI}/Mistral-7B-v0.3", family="Mistral", dtype="bfloat16", aliases=(f"{_AI}/Mistral-7B-Instruct-v0.3",),
               config=_mistral(32, 4096, 14336, 32, 8, 32768, 32768, 1000000.0, None)),
    # Mistral NeMo 12B: 40 layers of 5120 with 32 heads of 128 (narrower than the width), vocab 131072
    Checkpoint(name=f"{_AI}/Mistral-Nemo-Base-2407", family="Mistral", dtype="bfloat16",
               aliases=(f"{_AI}/Mistral-Nemo-Instruct-2407",),
               config=_mistral(40, 5120, 14336, 32, 8, 131072, 1024000, 1000000.0, None, head_dim=128)),
    # Mistral Small (September 2024), 22B: 56 layers of 6144, 48 query / 8 KV heads, vocab 32768, no window
    Checkpoint(name=f"{_AI}/Mistral-Small-Instruct-2409", family="Mistral", dtype="bfloat16",
               config=_mistral(56, 6144, 16384, 48, 8, 32768, 32768, 1000000.0, None)),
    # Mistral Small 3 (January 2025), 24B: 40 layers of 5120 with 32 heads of 128, an MLP of 32768, vocab 131072,
    # RoPE base 1e8 (Mistral Small 3.1 / 3.2 are vision-language models, Mistral3ForConditionalGeneration: not here)
    Checkpoint(name=f"{_AI}/Mistral-Small-24B-Base-2501", family="Mistral", dtype="bfloat16",
               aliases=(f"{_AI}/Mistral-Small-24B-Instruct-2501",),
               config=_mistral(40, 5120, 32768, 32, 8, 131072, 32768, 100000000.0, None, head_dim=128)),
    Checkpoint(name=f"{_AI}/Mixtral-8x7B-v0.1", family="Mixtral", dtype="bfloat16", aliases=(f"{_AI}/Mixtral-8x7B-Instruct-v0.1",),
               config=_mixtral(32, 4096, 14336, 32, 32000, 32768)),
    Checkpoint(name=f"{_AI}/Mixtral-8x22B-v0.1", family="Mixtral", dtype="bfloat16",
               config=_mixtral(56, 6144, 16384, 48, 32000, 65536)),
)
