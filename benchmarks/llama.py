"""A Llama-shaped decoder (RMSNorm, rotary embeddings, SwiGLU MLP, SDPA attention), built from a config.

No weights are downloaded: build it on the meta device for estimates (``with torch.device("meta"): ...``) or on
the CPU with random weights for measurements of small configurations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_layers: int = 32
    num_heads: int = 32
    num_kv_heads: int | None = None  # grouped-query attention (Llama-2-70B: 8); None: one per query head
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    eps: float = 1e-6


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # computed in fp32 as Llama's reference implementation does, cast back to the input dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads = cfg.num_heads
        self.kv_heads = cfg.num_kv_heads or cfg.num_heads
        kv_size = cfg.hidden_size // cfg.num_heads * self.kv_heads
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_size, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_size, bias=False)
        self.o_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        head_dim = d // self.heads
        q = self.q_proj(x).view(b, t, self.heads, head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, head_dim).transpose(1, 2)
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
        if self.kv_heads != self.heads:  # each key/value head serves heads / kv_heads query heads
            k, v = (z.repeat_interleave(self.heads // self.kv_heads, dim=1) for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.eps)
        self.attn = Attention(cfg)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        head_dim = cfg.hidden_size // cfg.num_heads
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        freqs = torch.outer(torch.arange(t, device=input_ids.device, dtype=torch.float32), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.embed(input_ids)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def llama_7b_config(**overrides) -> LlamaConfig:
    return LlamaConfig(**overrides)


def llama_70b_config(**overrides) -> LlamaConfig:
    """Llama-2-70B's shape (its config.json: 80 layers, hidden 8192, intermediate 28672, 64 heads, 8 key/value
    heads, vocab 32000): 68,976,648,192 parameters."""
    return LlamaConfig(**{**dict(hidden_size=8192, intermediate_size=28672, num_layers=80, num_heads=64,
                                 num_kv_heads=8), **overrides})


