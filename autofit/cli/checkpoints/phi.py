"""Microsoft's Phi-2, Phi-3 / 3.5 mini, Phi-4 and Phi-4-mini, from each repository's ``config.json``."""

from __future__ import annotations

from typing import Any

from autofit.cli.checkpoints.entry import Checkpoint

__all__ = ["CHECKPOINTS"]


def _phi3(layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int, positions: int,
          rope_theta: float, **extra: Any) -> dict[str, Any]:
    # Phi3ForCausalLM: fused qkv and gate/up projections, no biases, RMSNorm 1e-5, untied embeddings
    return {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "num_hidden_layers": layers,
            "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
            "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": positions,
            "rope_theta": rope_theta, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu",
            "attention_bias": False, **extra}


_PHI35_LONG = [1.08, 1.11, 1.14, 1.34, 1.59, 1.6, 1.62, 2.62, 3.23, 3.23, 4.79, 7.4, 7.7, 9.09, 12.2, 17.67, 24.46,
               28.57, 30.42, 30.84, 32.59, 32.93, 42.32, 44.96, 50.34, 50.45, 57.55, 57.93, 58.21, 60.14, 62.61, 62.62,
               62.71, 63.14, 63.14, 63.77, 63.93, 63.96, 63.97, 64.03, 64.07, 64.08, 64.12, 64.41, 64.48, 64.51, 64.53,
               64.84]
_PHI35_SHORT = [1.0, 1.02, 1.03, 1.03, 1.05, 1.05, 1.05, 1.05, 1.05, 1.07, 1.1, 1.11, 1.16, 1.16, 1.17, 1.29, 1.34,
                1.68, 1.79, 1.82, 1.85, 1.88, 1.91, 1.94, 1.99, 2.02, 2.02, 2.02, 2.02, 2.02, 2.02, 2.03, 2.03, 2.03,
                2.03, 2.03, 2.03, 2.03, 2.03, 2.03, 2.08, 2.09, 2.19, 2.22, 2.59, 2.73, 2.75, 2.84]

CHECKPOINTS: tuple[Checkpoint, ...] = (
    # microsoft/phi-2/config.json: parallel attention + MLP with one LayerNorm, biases everywhere (the output layer
    # too), rotary on 40 % of each 80-wide head, GELU-new MLP of 4 x hidden, vocab 51200, 2048 positions
    Checkpoint(name="microsoft/phi-2", family="Phi", dtype="float16", config={
        "model_type": "phi", "architectures": ["PhiForCausalLM"], "num_hidden_layers": 32, "hidden_size": 2560,
        "intermediate_size": 10240, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 51200,
        "max_position_embeddings": 2048, "partial_rotary_factor": 0.4, "rope_theta": 10000.0,
        "layer_norm_eps": 1e-5, "hidden_act": "gelu_new", "qk_layernorm": False, "tie_word_embeddings": False,
        "resid_pdrop": 0.1, "embd_pdrop": 0.0, "attention_dropout": 0.0, "bos_token_id": 50256,
        "eos_token_id": 50256}),
    # microsoft/Phi-3-mini-4k-instruct/config.json: 32 layers of 3072, 32 heads without grouping, vocab 32064,
    # 4096 positions with a 2047-token window
    Checkpoint(name="microsoft/Phi-3-mini-4k-instruct", family="Phi", dtype="bfloat16", config=_phi3(
        32, 3072, 8192, 32, 32, 32064, 4096, 10000.0, original_max_position_embeddings=4096, sliding_window=2047,
        bos_token_id=1, eos_token_id=32000, pad_token_id=32000)),
    # microsoft/Phi-3.5-mini-instruct/config.json: Phi-3-mini's shapes stretched to 131072 positions by "longrope"
    # (one RoPE rescaling factor per frequency, 48 for a 96-wide head; the published values are these two-decimal
    # numbers stored as float32, 1.0800000429153442 for 1.08)
    Checkpoint(name="microsoft/Phi-3.5-mini-instruct", family="Phi", dtype="bfloat16", config=_phi3(
        32, 3072, 8192, 32, 32, 32064, 131072, 10000.0, original_max_position_embeddings=4096,
        sliding_window=262144, bos_token_id=1, eos_token_id=32000, pad_token_id=32000,
        rope_scaling={"type": "longrope", "long_factor": _PHI35_LONG, "short_factor": _PHI35_SHORT})),
    # microsoft/phi-4/config.json: 40 layers of 5120, 40 query / 10 KV heads, vocab 100352, 16384 positions
    Checkpoint(name="microsoft/phi-4", family="Phi", dtype="bfloat16", config=_phi3(
        40, 5120, 17920, 40, 10, 100352, 16384, 250000.0, original_max_position_embeddings=16384,
        sliding_window=None, bos_token_id=100257, eos_token_id=100265, pad_token_id=100349)),
    # microsoft/Phi-4-mini-instruct/config.json: 32 layers of 3072, 24 query / 8 KV heads of 128, rotary on 75 % of
    # each head, vocab 200064 with tied embeddings, 131072 positions from 4096. Its "longrope" rescaling (two lists
    # of 48 factors) is left out: it decides no shape, and its values were not at hand to copy
    Checkpoint(name="microsoft/Phi-4-mini-instruct", family="Phi", dtype="bfloat16", config=_phi3(
        32, 3072, 8192, 24, 8, 200064, 131072, 10000.0, original_max_position_embeddings=4096,
        partial_rotary_factor=0.75, tie_word_embeddings=True, sliding_window=262144, bos_token_id=199999,
        eos_token_id=199999, pad_token_id=199999)),
)
