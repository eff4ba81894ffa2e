"""torchvision's ``vit_l_16``, rebuilt from its published architecture without torchvision (no weights).

torchvision/models/vision_transformer.py (``VisionTransformer``, ``EncoderBlock``, ``MLPBlock``, ``vit_l_16``):
a 16x16 stride-16 patch convolution ``conv_proj`` to hidden 1024, a learned class token, learned position embeddings
(1, 197, 1024), 24 encoder blocks (pre-norm LayerNorm eps 1e-6, ``nn.MultiheadAttention(1024, 16,
batch_first=True)`` called with ``need_weights=False``, dropout 0, MLP 1024 -> 4096 -> 1024 with exact GELU), a
final LayerNorm and a 1000-class head on the class token. 304,326,632 parameters (torchvision's docs, "ViT_L_16").
Parameter names follow torchvision's so a state dict would load.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["VIT_L_16_PARAMETERS", "VitL16"]

VIT_L_16_PARAMETERS = 304_326_632


class _MLP(nn.Sequential):
    def __init__(self, hidden: int, mlp: int) -> None:
        super().__init__(nn.Linear(hidden, mlp), nn.GELU(), nn.Dropout(0.0), nn.Linear(mlp, hidden), nn.Dropout(0.0))


class _Block(nn.Module):
    def __init__(self, hidden: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(hidden, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(hidden, heads, dropout=0.0, batch_first=True)
        self.dropout = nn.Dropout(0.0)
        self.ln_2 = nn.LayerNorm(hidden, eps=1e-6)
        self.mlp = _MLP(hidden, mlp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        y, _ = self.self_attention(y, y, y, need_weights=False)
        x = self.dropout(y) + x
        return x + self.mlp(self.ln_2(x))


class _Encoder(nn.Module):
    def __init__(self, seq: int, layers: int, hidden: int, heads: int, mlp: int) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq, hidden).normal_(std=0.02))
        self.dropout = nn.Dropout(0.0)
        self.layers = nn.Sequential(*[_Block(hidden, heads, mlp) for _ in range(layers)])
        self.ln = nn.LayerNorm(hidden, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(self.layers(self.dropout(x + self.pos_embedding)))


class VitL16(nn.Module):
    def __init__(self, image: int = 224, patch: int = 16, layers: int = 24, hidden: int = 1024, heads: int = 16,
                 mlp: int = 4096, classes: int = 1000) -> None:
        super().__init__()
        self.patch = patch
        self.conv_proj = nn.Conv2d(3, hidden, kernel_size=patch, stride=patch)
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden))
        self.encoder = _Encoder((image // patch) ** 2 + 1, layers, hidden, heads, mlp)
        self.heads = nn.Sequential()
        self.heads.add_module("head", nn.Linear(hidden, classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x)  # (n, hidden, 14, 14)
        x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)  # (n, 196, hidden), as torchvision's _process_input
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1)
        return self.heads(self.encoder(x)[:, 0])
