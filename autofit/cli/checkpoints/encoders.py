"""Encoders people fine-tune for classification: BERT, RoBERTa, DistilBERT, DeBERTa-v3, ModernBERT, from each
repository's ``config.json``. All float32 (ModernBERT's config says so; the others name no dtype and were saved in
float32)."""

from __future__ import annotations

from autofit.cli.checkpoints.entry import Checkpoint

__all__ = ["CHECKPOINTS"]


def _short(name: str) -> tuple[str, ...]:
    """The legacy id without the organisation (``bert-base-uncased``): the Hub redirects it."""
    return (name.split("/", 1)[1],)


def _bert(name: str, layers: int, hidden: int, heads: int, vocab: int) -> Checkpoint:
    # google-bert/bert-*/config.json: 512 positions, 2 token types, intermediate 4 x hidden
    return Checkpoint(name=name, dtype="float32", family="BERT", aliases=_short(name), config={
        "model_type": "bert", "architectures": ["BertForMaskedLM"], "num_hidden_layers": layers,
        "hidden_size": hidden, "num_attention_heads": heads, "intermediate_size": 4 * hidden, "vocab_size": vocab,
        "max_position_embeddings": 512, "type_vocab_size": 2})


def _roberta(name: str, layers: int, hidden: int, heads: int) -> Checkpoint:
    # FacebookAI/roberta-*/config.json (and distilbert/distilroberta-base): 514 positions (2 reserved for the padding
    # offset), one token type
    return Checkpoint(name=name, dtype="float32", family="RoBERTa", aliases=_short(name), config={
        "model_type": "roberta", "architectures": ["RobertaForMaskedLM"], "num_hidden_layers": layers,
        "hidden_size": hidden, "num_attention_heads": heads, "intermediate_size": 4 * hidden, "vocab_size": 50265,
        "max_position_embeddings": 514, "type_vocab_size": 1, "layer_norm_eps": 1e-5, "pad_token_id": 1,
        "bos_token_id": 0, "eos_token_id": 2})


def _distilbert(name: str, vocab: int) -> Checkpoint:
    # distilbert/distilbert-base-*/config.json: BERT-base halved to 6 layers, no token types, tied output
    return Checkpoint(name=name, dtype="float32", family="DistilBERT", aliases=_short(name), config={
        "model_type": "distilbert", "architectures": ["DistilBertForMaskedLM"], "n_layers": 6, "dim": 768,
        "n_heads": 12, "hidden_dim": 3072, "vocab_size": vocab, "max_position_embeddings": 512,
        "sinusoidal_pos_embds": False, "activation": "gelu", "pad_token_id": 0})


def _deberta_v3(size: str, layers: int, hidden: int, heads: int) -> Checkpoint:
    # microsoft/deberta-v3-*/config.json: disentangled attention over 256 relative-position buckets, keys shared
    # with positions, no absolute positions and no token types, vocab 128100. The config names no architecture (the
    # checkpoint was pre-trained as an ELECTRA-style discriminator), so hf: builds the masked-LM head.
    return Checkpoint(name=f"microsoft/deberta-v3-{size}", dtype="float32", family="DeBERTa-v3", config={
        "model_type": "deberta-v2", "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
        "intermediate_size": 4 * hidden, "vocab_size": 128100, "max_position_embeddings": 512,
        "relative_attention": True, "position_buckets": 256, "norm_rel_ebd": "layer_norm", "share_att_key": True,
        "pos_att_type": "p2c|c2p", "layer_norm_eps": 1e-7, "max_relative_positions": -1,
        "position_biased_input": False, "type_vocab_size": 0, "hidden_act": "gelu"})


def _modernbert(size: str, layers: int, hidden: int, heads: int, inter: int) -> Checkpoint:
    # answerdotai/ModernBERT-*/config.json: global attention every third layer, 128-token local windows between,
    # GeGLU MLP, no biases, 8192 positions (RoPE: 160k global, 10k local), vocab 50368
    return Checkpoint(name=f"answerdotai/ModernBERT-{size}", dtype="float32", family="ModernBERT", config={
        "model_type": "modernbert", "architectures": ["ModernBertForMaskedLM"], "num_hidden_layers": layers,
        "hidden_size": hidden, "num_attention_heads": heads, "intermediate_size": inter, "vocab_size": 50368,
        "max_position_embeddings": 8192, "global_attn_every_n_layers": 3, "local_attention": 128,
        "global_rope_theta": 160000.0, "local_rope_theta": 10000.0, "hidden_activation": "gelu",
        "attention_bias": False, "mlp_bias": False, "norm_bias": False, "norm_eps": 1e-5, "decoder_bias": True,
        "pad_token_id": 50283, "bos_token_id": 50281, "eos_token_id": 50282, "cls_token_id": 50281,
        "sep_token_id": 50282})


CHECKPOINTS: tuple[Checkpoint, ...] = (
    _bert("google-bert/bert-base-uncased", 12, 768, 12, 30522),
    _bert("google-bert/bert-base-cased", 12, 768, 12, 28996),
    _bert("google-bert/bert-large-uncased", 24, 1024, 16, 30522),
    _bert("google-bert/bert-large-cased", 24, 1024, 16, 28996),
    _roberta("FacebookAI/roberta-base", 12, 768, 12),
    _roberta("FacebookAI/roberta-large", 24, 1024, 16),
    _roberta("distilbert/distilroberta-base", 6, 768, 12),
    _distilbert("distilbert/distilbert-base-uncased", 30522),
    _distilbert("distilbert/distilbert-base-cased", 28996),
    _deberta_v3("xsmall", 12, 384, 6),
    _deberta_v3("small", 6, 768, 12),
    _deberta_v3("base", 12, 768, 12),
    _deberta_v3("large", 24, 1024, 16),
    _modernbert("base", 22, 768, 12, 1152),
    _modernbert("large", 28, 1024, 16, 2624),
)
