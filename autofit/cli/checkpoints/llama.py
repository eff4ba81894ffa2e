"""Llama-architecture decoders: Meta's Llama 2 / 3 / 3.1 / 3.2 / 3.3, TinyLlama, SmolLM, SmolLM2 and SmolLM3, from
each repository's ``config.json``. :func:`llama` is also what DeepSeek's Llama-architecture checkpoints use.

Not in the table: Llama 3.2 Vision (``mllama``) and Llama 4 (Scout, Maverick: ``Llama4ForConditionalGeneration``).
transformers has their code, but their published configs carry per-layer lists (Llama 4's NoPE layers and chunked
attention, MoE interleaving) and vision towers whose every value was not at hand to copy; a wrong list would build
a model of the right size and the wrong activations, so they are left out rather than guessed."""

from __future__ import annotations

from typing import Any

from autofit.cli.checkpoints.entry import Checkpoint

__all__ = ["CHECKPOINTS", "llama", "LLAMA31_ROPE"]


def llama(layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int, positions: int,
          rope_theta: float = 10000.0, *, rms_eps: float = 1e-5, tied: bool = False, **extra: Any) -> dict[str, Any]:
    """A ``LlamaForCausalLM`` config: RMSNorm, SwiGLU MLP of ``inter``, grouped-query attention of ``kv`` heads."""
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": layers,
            "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
            "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": positions,
            "rms_norm_eps": rms_eps, "rope_theta": rope_theta, "tie_word_embeddings": tied, **extra}


def _rope_llama3(factor: float) -> dict[str, Any]:
    # meta-llama/Llama-3.1-* and 3.2-*/config.json "rope_scaling": 8x for 3.1 / 3.3, 32x for 3.2, from 8192
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


LLAMA31_ROPE = _rope_llama3(8.0)
_META = "meta-llama"


def _meta(name: str, config: dict[str, Any], *aliases: str, dtype: str = "bfloat16") -> Checkpoint:
    # config.json "torch_dtype": float16 for Llama 2 (and its chat models), bfloat16 from Llama 3 on
    return Checkpoint(name=f"{_META}/{name}", family="Llama", config=config, dtype=dtype,
                      aliases=tuple(f"{_META}/{a}" for a in aliases))


def _smollm(version: str, size: str, layers: int, hidden: int, inter: int, heads: int, kv: int,
            positions: int, rope_theta: float) -> Checkpoint:
    # HuggingFaceTB/SmolLM[2]-*/config.json: vocab 49152, tied embeddings, bfloat16; SmolLM2 trained to 8192
    # positions with a larger RoPE base
    name = f"HuggingFaceTB/{version}-{size}"
    return Checkpoint(name=name, family=version, aliases=(f"{name}-Instruct",), dtype="bfloat16",
                      config=llama(layers, hidden, inter, heads, kv, 49152, positions, rope_theta, tied=True,
                                   bos_token_id=0, eos_token_id=0))


_L3_8B = dict(layers=32, hidden=4096, inter=14336, heads=32, kv=8, vocab=128256)
_L3_70B = dict(layers=80, hidden=8192, inter=28672, heads=64, kv=8, vocab=128256)

CHECKPOINTS: tuple[Checkpoint, ...] = (
    _meta("Llama-2-7b-hf", llama(32, 4096, 11008, 32, 32, 32000, 4096), "Llama-2-7b-chat-hf", dtype="float16"),
    _meta("Llama-2-13b-hf", llama(40, 5120, 13824, 40, 40, 32000, 4096), "Llama-2-13b-chat-hf", dtype="float16"),
    _meta("Llama-2-70b-hf", llama(80, 8192, 28672, 64, 8, 32000, 4096), "Llama-2-70b-chat-hf", dtype="float16"),
    _meta("Meta-Llama-3-8B", llama(**_L3_8B, positions=8192, rope_theta=500000.0), "Meta-Llama-3-8B-Instruct"),
    _meta("Meta-Llama-3-70B", llama(**_L3_70B, positions=8192, rope_theta=500000.0), "Meta-Llama-3-70B-Instruct"),
    _meta("Llama-3.1-8B", llama(**_L3_8B, positions=131072, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE),
          "Llama-3.1-8B-Instruct", "Meta-Llama-3.1-8B", "Meta-Llama-3.1-8B-Instruct"),
    _meta("Llama-3.1-70B", llama(**_L3_70B, positions=131072, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE),
          "Llama-3.1-70B-Instruct", "Meta-Llama-3.1-70B", "Meta-Llama-3.1-70B-Instruct"),
    # meta-llama/Llama-3.1-405B/config.json: 126 layers of 16384, 128 query / 8 KV heads, an MLP of 53248
    _meta("Llama-3.1-405B", llama(126, 16384, 53248, 128, 8, 128256, 131072, 500000.0, rope_scaling=LLAMA31_ROPE),
          "Llama-3.1-405B-Instruct", "Meta-Llama-3.1-405B", "Meta-Llama-3.1-405B-Instruct"),
    # Llama 3.2 text models: tied embeddings, head_dim 64 (1B) / 128 (3B)
    _meta("Llama-3.2-1B", llama(16, 2048, 8192, 32, 8, 128256, 131072, 500000.0, tied=True, head_dim=64,
                                rope_scaling=_rope_llama3(32.0)), "Llama-3.2-1B-Instruct"),
    _meta("Llama-3.2-3B", llama(28, 3072, 8192, 24, 8, 128256, 131072, 500000.0, tied=True, head_dim=128,
                                rope_scaling=_rope_llama3(32.0)), "Llama-3.2-3B-Instruct"),
    # Llama 3.3 was published as an instruct model only; its shapes are Llama 3.1 70B's
    _meta("Llama-3.3-70B-Instruct", llama(**_L3_70B, positions=131072, rope_theta=500000.0,
                                          rope_scaling=LLAMA31_ROPE)),
    # TinyLlama/TinyLlama-1.1B-Chat-v1.0/config.json: 22 layers, 4 KV heads, 2048 positions; the base model at the
    # end of pre-training (intermediate-step-1431k-3T) has the same config but for its dtype (published in float32,
    # the chat model in bfloat16)
    Checkpoint(name="TinyLlama/TinyLlama-1.1B-Chat-v1.0", family="TinyLlama", dtype="bfloat16",
               aliases=("TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T",),
               alias_dtypes={"TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T": "float32"},
               config=llama(22, 2048, 5632, 32, 4, 32000, 2048)),
    _smollm("SmolLM", "135M", 30, 576, 1536, 9, 3, 2048, 10000.0),
    _smollm("SmolLM", "360M", 32, 960, 2560, 15, 5, 2048, 10000.0),
    _smollm("SmolLM", "1.7B", 24, 2048, 8192, 32, 32, 2048, 10000.0),
    _smollm("SmolLM2", "135M", 30, 576, 1536, 9, 3, 8192, 100000.0),
    _smollm("SmolLM2", "360M", 32, 960, 2560, 15, 5, 8192, 100000.0),
    _smollm("SmolLM2", "1.7B", 24, 2048, 8192, 32, 32, 8192, 130000.0),
    # HuggingFaceTB/SmolLM3-3B/config.json: 36 layers of 2048, 16 query / 4 KV heads, vocab 128256 tied, 65536
    # positions (RoPE base 5e6) with every fourth layer without RoPE (SmolLM3Config's default no_rope_layers)
    Checkpoint(name="HuggingFaceTB/SmolLM3-3B", family="SmolLM3", aliases=("HuggingFaceTB/SmolLM3-3B-Base",),
               dtype="bfloat16",
               config={"model_type": "smollm3", "architectures": ["SmolLM3ForCausalLM"], "num_hidden_layers": 36,
                       "hidden_size": 2048, "intermediate_size": 11008, "num_attention_heads": 16,
                       "num_key_value_heads": 4, "vocab_size": 128256, "max_position_embeddings": 65536,
                       "rope_theta": 5000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
                       "hidden_act": "silu"}),
)
