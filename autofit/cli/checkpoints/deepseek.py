"""DeepSeek's checkpoints, from each repository's ``config.json``: DeepSeek LLM 7B and DeepSeek Coder (Llama
architecture), the DeepSeek-R1 distillations into Qwen2.5 and Llama 3.x, and the shapes of the mixtures of experts
with multi-head latent attention that transformers has the code of (``deepseek_v2``, ``deepseek_v3``): V2-Lite and
V3 (R1 shares V3's). V3's published weights are fp8 with block scales (``quantization_config``); the entry builds
the model in the dtype it is given, as one trains it, and leaves the multi-token-prediction layer out, as
transformers' DeepseekV3ForCausalLM does."""

from __future__ import annotations

from autofit.cli.checkpoints.entry import Checkpoint
from autofit.cli.checkpoints.llama import LLAMA31_ROPE, llama
from autofit.cli.checkpoints.qwen import qwen2

__all__ = ["CHECKPOINTS"]

_DS = "deepseek-ai"  # every entry's config.json says "torch_dtype": "bfloat16" (V3's weights are fp8 besides)
# deepseek-coder-*-base/config.json: 16384 positions by linear RoPE interpolation (factor 4) over a base of 1e5,
# vocab 32256
_CODER_ROPE = {"type": "linear", "factor": 4.0}


def _distill(size: str, config: dict) -> Checkpoint:
    return Checkpoint(name=f"{_DS}/DeepSeek-R1-Distill-{size}", family="DeepSeek-R1-Distill", dtype="bfloat16", config=config)


_YARN_V2 = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
            "mscale": 0.707, "mscale_all_dim": 0.707}
_YARN_V3 = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 1.0}


def _mla(layers: int, hidden: int, inter: int, expert_inter: int, heads: int, *, routed: int, shared: int,
         top_k: int, dense_layers: int, q_lora: int | None, vocab: int, **extra) -> dict:
    # multi-head latent attention: keys and values from a 512-wide latent (kv_lora_rank), heads of 128 + 64 rotary
    # (qk_nope / qk_rope) and values of 128; the first ``dense_layers`` layers dense, the rest routed experts plus
    # shared ones; 163840 positions by YaRN from 4096
    return {"num_hidden_layers": layers, "hidden_size": hidden, "intermediate_size": inter,
            "moe_intermediate_size": expert_inter, "num_attention_heads": heads, "num_key_value_heads": heads,
            "n_routed_experts": routed, "n_shared_experts": shared, "num_experts_per_tok": top_k,
            "first_k_dense_replace": dense_layers, "moe_layer_freq": 1, "q_lora_rank": q_lora, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": vocab,
            "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "attention_bias": False, "hidden_act": "silu", **extra}


CHECKPOINTS: tuple[Checkpoint, ...] = (
    Checkpoint(name=f"{_DS}/deepseek-llm-7b-base", family="DeepSeek", dtype="bfloat16", aliases=(f"{_DS}/deepseek-llm-7b-chat",),
               config=llama(30, 4096, 11008, 32, 32, 102400, 4096, rms_eps=1e-6, bos_token_id=100000,
                            eos_token_id=100001)),
    Checkpoint(name=f"{_DS}/deepseek-coder-1.3b-base", family="DeepSeek", dtype="bfloat16",
               aliases=(f"{_DS}/deepseek-coder-1.3b-instruct",),
               config=llama(24, 2048, 5504, 16, 16, 32256, 16384, 100000.0, rms_eps=1e-6,
                            rope_scaling=_CODER_ROPE)),
    Checkpoint(name=f"{_DS}/deepseek-coder-6.7b-base", family="DeepSeek", dtype="bfloat16",
               aliases=(f"{_DS}/deepseek-coder-6.7b-instruct",),
               config=llama(32, 4096, 11008, 32, 32, 32256, 16384, 100000.0, rms_eps=1e-6,
                            rope_scaling=_CODER_ROPE)),
    # The Qwen distillations keep their teacher's shapes (Qwen2.5-Math-1.5B, -Math-7B, -14B, -32B) but untie the
    # 1.5B's embeddings; RoPE base 1e4 at 1.5B / 7B
    _distill("Qwen-1.5B", qwen2(28, 1536, 8960, 12, 2, 151936, 131072, tied=False, rope_theta=10000.0,
                                window_layers=21, sliding_window=4096)),
    _distill("Qwen-7B", qwen2(28, 3584, 18944, 28, 4, 152064, 131072, tied=False, rope_theta=10000.0,
                              sliding_window=4096)),
    _distill("Qwen-14B", qwen2(48, 5120, 13824, 40, 8, 152064, 131072, tied=False, rms_eps=1e-5,
                               sliding_window=131072)),
    _distill("Qwen-32B", qwen2(64, 5120, 27648, 40, 8, 152064, 131072, tied=False, rms_eps=1e-5,
                               sliding_window=131072)),
    # The Llama distillations: Llama-3.1-8B and Llama-3.3-70B-Instruct's shapes and RoPE scaling
    _distill("Llama-8B", llama(32, 4096, 14336, 32, 8, 128256, 131072, 500000.0, rope_scaling=LLAMA31_ROPE)),
    _distill("Llama-70B", llama(80, 8192, 28672, 64, 8, 128256, 131072, 500000.0, rope_scaling=LLAMA31_ROPE)),
    # deepseek-ai/DeepSeek-V2-Lite/config.json: 27 layers of 2048, 16 heads, no query latent, 64 routed experts
    # (6 per token, softmax, greedy) and 2 shared of 1408, the first layer dense (10944); vocab 102400
    Checkpoint(name=f"{_DS}/DeepSeek-V2-Lite", family="DeepSeek-V2", dtype="bfloat16", aliases=(f"{_DS}/DeepSeek-V2-Lite-Chat",),
               config={"model_type": "deepseek_v2", "architectures": ["DeepseekV2ForCausalLM"], **_mla(
                   27, 2048, 10944, 1408, 16, routed=64, shared=2, top_k=6, dense_layers=1, q_lora=None,
                   vocab=102400, rope_theta=10000.0, rope_scaling=_YARN_V2, topk_method="greedy", n_group=1,
                   topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False, scoring_func="softmax",
                   aux_loss_alpha=0.001)}),
    # deepseek-ai/DeepSeek-V3/config.json: 61 layers of 7168, 128 heads, a 1536-wide query latent, 256 routed
    # experts of 2048 (8 per token from 4 of 8 groups, sigmoid scores, scaled by 2.5) and 1 shared, the first 3
    # layers dense (18432); vocab 129280. DeepSeek-R1 and the V3 updates publish the same shapes
    Checkpoint(name=f"{_DS}/DeepSeek-V3", family="DeepSeek-V3", dtype="bfloat16",
               aliases=(f"{_DS}/DeepSeek-V3-Base", f"{_DS}/DeepSeek-V3-0324", f"{_DS}/DeepSeek-R1",
                        f"{_DS}/DeepSeek-R1-0528"),
               config={"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], **_mla(
                   61, 7168, 18432, 2048, 128, routed=256, shared=1, top_k=8, dense_layers=3, q_lora=1536,
                   vocab=129280, rope_theta=10000.0, rope_scaling=_YARN_V3, topk_method="noaux_tc", n_group=8,
                   topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, scoring_func="sigmoid")}),
)
