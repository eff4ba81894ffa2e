"""Qwen2, Qwen2.5 and Qwen3 decoders (dense, and the Qwen3 mixtures of experts), from each repository's
``config.json``. The instruct models (``-Instruct``
for Qwen2 / 2.5; for Qwen3 the post-trained model is the plain name and the pre-trained one ends in ``-Base``) share
the entry: some say 32768 ``max_position_embeddings`` where the base says 131072, which changes no shape."""

from __future__ import annotations

from typing import Any

from autofit.cli.checkpoints.entry import Checkpoint

__all__ = ["CHECKPOINTS", "qwen2"]


def qwen2(layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int, positions: int, *, tied: bool,
          rope_theta: float = 1000000.0, rms_eps: float = 1e-6, window_layers: int | None = None,
          sliding_window: int | None = None) -> dict[str, Any]:
    """A ``Qwen2ForCausalLM`` config: biased q/k/v projections, SwiGLU, RMSNorm; the sliding window is off
    (``use_sliding_window`` false in every published config), so ``sliding_window`` changes nothing."""
    return {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "num_hidden_layers": layers,
            "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
            "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": positions,
            "rope_theta": rope_theta, "rms_norm_eps": rms_eps, "tie_word_embeddings": tied,
            "use_sliding_window": False, "sliding_window": sliding_window or positions,
            "max_window_layers": window_layers or layers, "hidden_act": "silu"}


def _qwen3(layers: int, hidden: int, inter: int, heads: int, *, tied: bool) -> dict[str, Any]:
    # Qwen/Qwen3-*/config.json: head_dim 128 whatever the width (q/k RMSNorm, no q/k/v bias), 8 KV heads, vocab
    # 151936, 40960 positions, RoPE base 1e6
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": layers,
            "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": tied, "attention_bias": False, "sliding_window": None,
            "use_sliding_window": False, "max_window_layers": layers, "hidden_act": "silu"}


def _qwen3_moe(layers: int, hidden: int, inter: int, expert_inter: int, heads: int) -> dict[str, Any]:
    # Qwen/Qwen3-30B-A3B and -235B-A22B/config.json: Qwen3's attention (head_dim 128, q/k RMSNorm) with 4 KV heads,
    # every layer a mixture of 128 SwiGLU experts of which the router picks 8 per token (probabilities
    # renormalised), no shared expert; auxiliary loss 0.001; "intermediate_size" is the unused dense width
    return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "num_hidden_layers": layers,
            "hidden_size": hidden, "intermediate_size": inter, "moe_intermediate_size": expert_inter,
            "num_attention_heads": heads, "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
            "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
            "router_aux_loss_coef": 0.001, "output_router_logits": False, "vocab_size": 151936,
            "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "attention_bias": False, "sliding_window": None,
            "use_sliding_window": False, "max_window_layers": layers, "hidden_act": "silu"}


def _entry(family: str, size: str, config: dict[str, Any], *more: str) -> Checkpoint:
    name = f"Qwen/{family.removesuffix('-MoE')}-{size}"
    alias = f"{name}-Base" if family.startswith("Qwen3") else f"{name}-Instruct"
    # every Qwen2 / 2.5 / 3 config.json says "torch_dtype": "bfloat16"
    return Checkpoint(name=name, family=family, config=config, dtype="bfloat16",
                      aliases=(alias, *(f"{name}-{m}" for m in more)))


CHECKPOINTS: tuple[Checkpoint, ...] = (
    # vocab 151936 up to 3B (tied embeddings), 152064 from 7B (untied)
    _entry("Qwen2", "0.5B", qwen2(24, 896, 4864, 14, 2, 151936, 131072, tied=True)),
    _entry("Qwen2", "1.5B", qwen2(28, 1536, 8960, 12, 2, 151936, 131072, tied=True)),
    _entry("Qwen2", "7B", qwen2(28, 3584, 18944, 28, 4, 152064, 131072, tied=False)),
    _entry("Qwen2.5", "0.5B", qwen2(24, 896, 4864, 14, 2, 151936, 32768, tied=True)),
    _entry("Qwen2.5", "1.5B", qwen2(28, 1536, 8960, 12, 2, 151936, 131072, tied=True, window_layers=21)),
    _entry("Qwen2.5", "3B", qwen2(36, 2048, 11008, 16, 2, 151936, 32768, tied=True, window_layers=70)),
    _entry("Qwen2.5", "7B", qwen2(28, 3584, 18944, 28, 4, 152064, 131072, tied=False)),
    _entry("Qwen2.5", "14B", qwen2(48, 5120, 13824, 40, 8, 152064, 131072, tied=False, rms_eps=1e-5)),
    _entry("Qwen2.5", "32B", qwen2(64, 5120, 27648, 40, 8, 152064, 131072, tied=False, rms_eps=1e-5)),
    _entry("Qwen2.5", "72B", qwen2(80, 8192, 29568, 64, 8, 152064, 131072, tied=False, rms_eps=1e-5)),
    _entry("Qwen3", "0.6B", _qwen3(28, 1024, 3072, 16, tied=True)),
    _entry("Qwen3", "1.7B", _qwen3(28, 2048, 6144, 16, tied=True)),
    # the July 2025 updates ("-Instruct-2507", "-Thinking-2507") differ only in 262144 positions
    _entry("Qwen3", "4B", _qwen3(36, 2560, 9728, 32, tied=True), "Instruct-2507", "Thinking-2507"),
    _entry("Qwen3", "8B", _qwen3(36, 4096, 12288, 32, tied=False)),
    _entry("Qwen3", "14B", _qwen3(40, 5120, 17408, 40, tied=False)),
    _entry("Qwen3", "32B", _qwen3(64, 5120, 25600, 64, tied=False)),
    _entry("Qwen3-MoE", "30B-A3B", _qwen3_moe(48, 2048, 6144, 768, 32), "Instruct-2507", "Thinking-2507"),
    _entry("Qwen3-MoE", "235B-A22B", _qwen3_moe(94, 4096, 12288, 1536, 64), "Instruct-2507", "Thinking-2507"),
)
