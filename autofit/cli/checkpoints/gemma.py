"""Google's Gemma, Gemma 2 and Gemma 3 decoders, from each repository's ``config.json``. The instruction-tuned
``-it`` models share the entry of their pre-trained model (``gemma-3-*-pt`` is Gemma 3's base).

Gemma 3 from 4B up is a vision-language model: the checkpoint is a ``Gemma3ForConditionalGeneration`` (a SigLIP
vision tower of 417M parameters, a projector, and the language model), and that is what its entry builds, because
it is what loading the checkpoint gives (``AutoModelForCausalLM`` maps ``gemma3`` to it too). ``hf:`` plans it on
text (``input_ids`` and ``labels``): the vision tower and projector are held in memory but compute nothing, so they
get no gradients and no optimizer state. A plan for text-only fine-tuning of the language model alone (its weights
extracted into ``Gemma3ForCausalLM``) is ``hf:gemma3_text --config ...`` with the same text fields."""

from __future__ import annotations

from typing import Any

from autofit.cli.checkpoints.entry import Checkpoint

__all__ = ["CHECKPOINTS"]


def _gemma(layers: int, hidden: int, inter: int, heads: int, kv: int) -> dict[str, Any]:
    # google/gemma-{2b,7b}/config.json: head_dim 256, vocab 256000, 8192 positions, GeGLU, tied embeddings
    return {"model_type": "gemma", "architectures": ["GemmaForCausalLM"], "num_hidden_layers": layers,
            "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": 256, "vocab_size": 256000, "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "gelu", "tie_word_embeddings": True,
            "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}


def _gemma2(layers: int, hidden: int, inter: int, heads: int, kv: int, head_dim: int,
            query_scale: int) -> dict[str, Any]:
    # google/gemma-2-*/config.json: local (4096-token window) and global layers alternate, attention logits
    # soft-capped at 50 and final logits at 30, queries scaled by 1/sqrt(query_pre_attn_scalar), vocab 256000
    return {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"], "num_hidden_layers": layers,
            "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
            "num_key_value_heads": kv, "head_dim": head_dim, "query_pre_attn_scalar": query_scale,
            "vocab_size": 256000, "max_position_embeddings": 8192, "sliding_window": 4096,
            "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True,
            "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}


def _gemma3(layers: int, hidden: int, inter: int, heads: int) -> dict[str, Any]:
    # google/gemma-3-{270m,1b}-pt/config.json: one KV head of 256, five local layers (512-token window, RoPE base
    # 10k) per global one (RoPE base 1e6), q/k RMSNorm, no soft-capping, vocab 262144, 32768 positions
    return {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "num_hidden_layers": layers,
            "hidden_size": hidden, "intermediate_size": inter, "num_attention_heads": heads,
            "num_key_value_heads": 1, "head_dim": 256, "query_pre_attn_scalar": 256, "vocab_size": 262144,
            "max_position_embeddings": 32768, "sliding_window": 512, "sliding_window_pattern": 6,
            "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None,
            "attn_logit_softcapping": None, "final_logit_softcapping": None, "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "bos_token_id": 2,
            "eos_token_id": 1, "pad_token_id": 0}


def _gemma3_vlm(layers: int, hidden: int, inter: int, heads: int, kv: int, head_dim: int,
                query_scale: int) -> dict[str, Any]:
    # google/gemma-3-{4b,12b,27b}-pt/config.json: "text_config" gives the widths (the rest are Gemma3TextConfig's
    # defaults, the published values: vocab 262208 with the image tokens, 131072 positions by linear RoPE scaling x8,
    # a 1024-token window on five local layers per global one); "vision_config" is SigLIP-So400m at 896 pixels,
    # patches of 14, no pooling head; 256 soft tokens per image
    text = {"model_type": "gemma3_text", "num_hidden_layers": layers, "hidden_size": hidden,
            "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head_dim,
            "query_pre_attn_scalar": query_scale, "vocab_size": 262208, "max_position_embeddings": 131072,
            "sliding_window": 1024, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "rms_norm_eps": 1e-6,
            "hidden_activation": "gelu_pytorch_tanh", "attn_logit_softcapping": None, "final_logit_softcapping": None}
    vision = {"model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
              "num_hidden_layers": 27, "num_attention_heads": 16, "image_size": 896, "patch_size": 14,
              "vision_use_head": False, "layer_norm_eps": 1e-6}
    return {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": text,
            "vision_config": vision, "mm_tokens_per_image": 256, "boi_token_index": 255999,
            "eoi_token_index": 256000, "image_token_index": 262144}


def _entry(name: str, family: str, config: dict[str, Any], base_suffix: str = "", base_dtype: str = "bfloat16",
           ) -> Checkpoint:
    # config.json "torch_dtype": bfloat16 but for Gemma 2's pre-trained models, published in float32 (their -it
    # models in bfloat16)
    return Checkpoint(name=f"google/{name}{base_suffix}", family=family, config=config, dtype=base_dtype,
                      aliases=(f"google/{name}-it",), alias_dtypes={f"google/{name}-it": "bfloat16"})


CHECKPOINTS: tuple[Checkpoint, ...] = (
    _entry("gemma-2b", "Gemma", _gemma(18, 2048, 16384, 8, 1)),
    _entry("gemma-7b", "Gemma", _gemma(28, 3072, 24576, 16, 16)),
    _entry("gemma-2-2b", "Gemma 2", _gemma2(26, 2304, 9216, 8, 4, 256, 256), base_dtype="float32"),
    _entry("gemma-2-9b", "Gemma 2", _gemma2(42, 3584, 14336, 16, 8, 256, 224), base_dtype="float32"),
    _entry("gemma-2-27b", "Gemma 2", _gemma2(46, 4608, 36864, 32, 16, 128, 144), base_dtype="float32"),
    _entry("gemma-3-270m", "Gemma 3", _gemma3(18, 640, 2048, 4)),
    _entry("gemma-3-1b", "Gemma 3", _gemma3(26, 1152, 6912, 4), base_suffix="-pt"),
    # the vision-language sizes: 8 / 16 / 32 query heads over 4 / 8 / 16 KV heads; the 27B's heads are 128 wide
    # (narrower than 5376 / 32) and its queries scaled by 1/sqrt(168)
    _entry("gemma-3-4b", "Gemma 3", _gemma3_vlm(34, 2560, 10240, 8, 4, 256, 256), base_suffix="-pt"),
    _entry("gemma-3-12b", "Gemma 3", _gemma3_vlm(48, 3840, 15360, 16, 8, 256, 256), base_suffix="-pt"),
    _entry("gemma-3-27b", "Gemma 3", _gemma3_vlm(62, 5376, 21504, 32, 16, 128, 168), base_suffix="-pt"),
)
