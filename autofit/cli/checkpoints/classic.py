"""GPT-2, OPT, T5, Pythia (GPT-NeoX) and Mamba: the research checkpoints, from each repository's ``config.json``.
Their dtypes: GPT-2 and T5 name none and were saved in float32, OPT and Pythia say float16, Mamba float32."""

from __future__ import annotations

from autofit.cli.checkpoints.entry import Checkpoint

__all__ = ["CHECKPOINTS"]


def _short(name: str) -> tuple[str, ...]:
    """The legacy id without the organisation (``gpt2`` for ``openai-community/gpt2``): the Hub redirects it."""
    return (name.split("/", 1)[1],)


def _gpt2(name: str, n_layer: int, n_embd: int, n_head: int) -> Checkpoint:
    # openai-community/gpt2*/config.json: vocab 50257, 1024 positions, GELU-new MLP of 4 x n_embd
    return Checkpoint(name=name, family="GPT-2", aliases=_short(name), dtype="float32", config={
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": n_layer, "n_embd": n_embd,
        "n_head": n_head, "vocab_size": 50257, "n_positions": 1024, "n_ctx": 1024})


def _t5(name: str, layers: int, d_model: int, d_ff: int, heads: int, d_kv: int = 64) -> Checkpoint:
    # google-t5/t5-*/config.json: relu feed-forward, vocab 32128, as many decoder as encoder layers
    return Checkpoint(name=name, family="T5", aliases=_short(name), dtype="float32", config={
        "model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "num_layers": layers,
        "num_decoder_layers": layers, "d_model": d_model, "d_ff": d_ff, "num_heads": heads, "d_kv": d_kv,
        "vocab_size": 32128, "feed_forward_proj": "relu"})


def _opt(name: str, layers: int, hidden: int, heads: int, proj: int | None = None,
         pre_norm: bool = True) -> Checkpoint:
    # facebook/opt-*/config.json: 2048 positions, vocab 50272, ffn 4 x hidden; opt-350m projects embeddings
    # from 512 and normalises after each block (do_layer_norm_before false)
    return Checkpoint(name=name, family="OPT", dtype="float16", config={
        "model_type": "opt", "architectures": ["OPTForCausalLM"], "num_hidden_layers": layers, "hidden_size": hidden,
        "num_attention_heads": heads, "ffn_dim": 4 * hidden, "vocab_size": 50272, "max_position_embeddings": 2048,
        "word_embed_proj_dim": proj or hidden, "do_layer_norm_before": pre_norm})


def _pythia(size: str, layers: int, hidden: int, heads: int, vocab: int = 50304) -> Checkpoint:
    # EleutherAI/pythia-*/config.json: GPT-NeoX with parallel attention + MLP, rotary on a quarter of each head,
    # MLP of 4 x hidden, 2048 positions, untied output; the vocabulary is padded (50304; 50432 at 6.9b, 50688 at 12b).
    # The -deduped models (trained on the deduplicated Pile) have the same config.
    name = f"EleutherAI/pythia-{size}"
    return Checkpoint(name=name, family="Pythia", aliases=(f"{name}-deduped",), dtype="float16", config={
        "model_type": "gpt_neox", "architectures": ["GPTNeoXForCausalLM"], "num_hidden_layers": layers,
        "hidden_size": hidden, "num_attention_heads": heads, "intermediate_size": 4 * hidden, "vocab_size": vocab,
        "max_position_embeddings": 2048, "rotary_pct": 0.25, "rotary_emb_base": 10000, "use_parallel_residual": True,
        "layer_norm_eps": 1e-5, "hidden_act": "gelu", "tie_word_embeddings": False, "bos_token_id": 0,
        "eos_token_id": 0})


def _mamba(size: str, layers: int, hidden: int) -> Checkpoint:
    # state-spaces/mamba-*-hf/config.json: expand 2, state 16, conv kernel 4, dt rank ceil(hidden / 16), vocab 50277
    # padded to a multiple of 8 (50280), tied embeddings, no bias in the projections but in the convolution
    dt_rank = -(-hidden // 16)
    return Checkpoint(name=f"state-spaces/mamba-{size}-hf", family="Mamba", dtype="float32", config={
        "model_type": "mamba", "architectures": ["MambaForCausalLM"], "num_hidden_layers": layers,
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "expand": 2, "state_size": 16, "conv_kernel": 4,
        "time_step_rank": dt_rank, "vocab_size": 50280, "use_bias": False, "use_conv_bias": True,
        "layer_norm_epsilon": 1e-5, "residual_in_fp32": True, "tie_word_embeddings": True, "bos_token_id": 0,
        "eos_token_id": 0, "pad_token_id": 0})


CHECKPOINTS: tuple[Checkpoint, ...] = (
    _gpt2("openai-community/gpt2", 12, 768, 12),
    _gpt2("openai-community/gpt2-medium", 24, 1024, 16),
    _gpt2("openai-community/gpt2-large", 36, 1280, 20),
    _gpt2("openai-community/gpt2-xl", 48, 1600, 25),
    _gpt2("distilbert/distilgpt2", 6, 768, 12),
    _t5("google-t5/t5-small", 6, 512, 2048, 8),
    _t5("google-t5/t5-base", 12, 768, 3072, 12),
    _t5("google-t5/t5-large", 24, 1024, 4096, 16),
    _opt("facebook/opt-125m", 12, 768, 12),
    _opt("facebook/opt-350m", 24, 1024, 16, proj=512, pre_norm=False),
    _opt("facebook/opt-1.3b", 24, 2048, 32),
    _opt("facebook/opt-2.7b", 32, 2560, 32),
    _opt("facebook/opt-6.7b", 32, 4096, 32),
    _opt("facebook/opt-13b", 40, 5120, 40),
    _pythia("70m", 6, 512, 8),
    _pythia("160m", 12, 768, 12),
    _pythia("410m", 24, 1024, 16),
    _pythia("1b", 16, 2048, 8),
    _pythia("1.4b", 24, 2048, 16),
    _pythia("2.8b", 32, 2560, 32),
    _pythia("6.9b", 32, 4096, 32, vocab=50432),
    _pythia("12b", 36, 5120, 40, vocab=50688),
    _mamba("130m", 24, 768),
    _mamba("370m", 48, 1024),
    _mamba("790m", 48, 1536),
    _mamba("1.4b", 48, 2048),
    _mamba("2.8b", 64, 2560),
)
