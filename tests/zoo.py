"""A zoo of small, deterministic architectures that the accuracy tests run ``estimate`` and ``measure`` on.

Each factory seeds the RNG and builds a fresh model, sample and target, so two calls give identical cases. Every case
is tiny (a few thousand to a few hundred thousand parameters, batch 4, 16-32 px images, sequences of 16) so one
``measure`` plus one ``estimate`` takes well under a second on two CPU cores; together they cover the layer types and
control flow that memory estimators get wrong (in-place ops, concatenation, shared modules, RNNs, data-dependent
branches, tied weights, dict inputs and outputs).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["ZooCase", "ZOO", "cpu_cannot_run"]


@dataclass(frozen=True)
class ZooCase:
    name: str
    model: nn.Module
    sample: Any  # tensor / tuple / dict; dim 0 is the batch
    target: Any | None
    checkpoint: tuple[str, ...]  # qualified module names recomputed in the "some blocks checkpointed" variant
    loss_fn: Callable | None = None
    micro_batch_size: int = 4


ZOO: dict[str, Callable[[], ZooCase]] = {}


def _register(factory: Callable[[], ZooCase]) -> Callable[[], ZooCase]:
    name = factory.__name__
    if name in ZOO:
        raise ValueError(f"zoo case {name!r} registered twice")

    def seeded() -> ZooCase:
        torch.manual_seed(0)
        case = factory()
        assert case.name == name, (case.name, name)
        return case

    seeded.__name__ = name
    ZOO[name] = seeded
    return seeded


def _images(batch: int = 4, channels: int = 3, size: int = 16) -> torch.Tensor:
    return torch.randn(batch, channels, size, size)


def _labels(batch: int = 4, classes: int = 10) -> torch.Tensor:
    return torch.randint(0, classes, (batch,))


# ---- convolutional networks ---------------------------------------------------------------------------------------
class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, width: int = 8, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layers = nn.Sequential(
            _BasicBlock(width, width, 1), _BasicBlock(width, 2 * width, 2), _BasicBlock(2 * width, 2 * width, 1)
        )
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers(self.stem(x))
        return self.head(h.mean(dim=(2, 3)))


@_register
def resnet_bn() -> ZooCase:
    """CNN with BatchNorm and residual connections (ResNet basic blocks, one with a projection shortcut)."""
    return ZooCase("resnet_bn", ResNet(), _images(), _labels(), checkpoint=("layers.0", "layers.2"))


class _DenseLayer(nn.Module):
    def __init__(self, cin: int, growth: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm2d(cin)
        self.conv = nn.Conv2d(cin, growth, 3, 1, 1, bias=False)

    def forward(self, *features: torch.Tensor) -> torch.Tensor:
        # the features arrive as separate tensors, not the block's list: checkpoint recomputes with the arguments it
        # was first called with, and that list grows afterwards (torchvision's DenseNet unpacks them the same way)
        x = torch.cat(features, dim=1)  # DenseNet: every layer sees the concatenation of all earlier outputs
        return self.conv(F.relu(self.bn(x)))


class _DenseBlock(nn.Module):
    def __init__(self, cin: int, growth: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_DenseLayer(cin + i * growth, growth) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(*features))
        return torch.cat(features, dim=1)


class DenseNet(nn.Module):
    def __init__(self, growth: int = 6, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.block1 = _DenseBlock(8, growth, 3)
        c1 = 8 + 3 * growth
        self.transition = nn.Sequential(nn.BatchNorm2d(c1), nn.ReLU(), nn.Conv2d(c1, 12, 1, bias=False),
                                        nn.AvgPool2d(2))
        self.block2 = _DenseBlock(12, growth, 3)
        self.norm = nn.BatchNorm2d(12 + 3 * growth)
        self.head = nn.Linear(12 + 3 * growth, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block2(self.transition(self.block1(self.stem(x))))
        h = F.adaptive_avg_pool2d(F.relu(self.norm(h)), 1).flatten(1)
        return self.head(h)


@_register
def densenet() -> ZooCase:
    """DenseNet-style concatenation of all earlier feature maps, with BatchNorm and a pooling transition."""
    return ZooCase("densenet", DenseNet(), _images(), _labels(), checkpoint=("block1.layers.1", "block2"))


class _DepthwiseSeparable(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.depthwise = nn.Conv2d(cin, cin, 3, stride, 1, groups=cin, bias=False)
        self.bn1 = nn.BatchNorm2d(cin)
        self.pointwise = nn.Conv2d(cin, cout, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu6(self.bn1(self.depthwise(x)))
        return F.relu6(self.bn2(self.pointwise(x)))


class MobileNet(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU6())
        self.blocks = nn.Sequential(
            _DepthwiseSeparable(8, 16, 1), _DepthwiseSeparable(16, 24, 2), _DepthwiseSeparable(24, 24, 1),
            _DepthwiseSeparable(24, 32, 2),
        )
        self.head = nn.Linear(32, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1).flatten(1))


@_register
def mobilenet() -> ZooCase:
    """Depthwise-separable convolutions (MobileNet v1 blocks: depthwise 3x3, pointwise 1x1, BN, ReLU6)."""
    return ZooCase("mobilenet", MobileNet(), _images(size=32), _labels(), checkpoint=("blocks.1", "blocks.2"))


class _InplaceBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, 1, 1)
        self.act = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.conv1(x))
        h = self.conv2(h)
        h += x  # in-place residual add
        h.mul_(0.5)
        return F.relu_(h)


class InplaceNet(nn.Module):
    def __init__(self, channels: int = 12, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, 1, 1), nn.ReLU(inplace=True))
        self.blocks = nn.Sequential(*(_InplaceBlock(channels) for _ in range(3)))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x))
        return self.head(h.mean(dim=(2, 3)))


@_register
def inplace_cnn() -> ZooCase:
    """In-place activations (ReLU(inplace=True), F.relu_) and in-place adds and multiplies on activations."""
    return ZooCase("inplace_cnn", InplaceNet(), _images(), _labels(), checkpoint=("blocks.1",))


class _UNetBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, 1, 1)
        self.norm1 = nn.GroupNorm(4, cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1)
        self.norm2 = nn.GroupNorm(4, cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.silu(self.norm1(self.conv1(x)))
        return F.silu(self.norm2(self.conv2(x)))


class UNet(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.down1 = _UNetBlock(3, width)
        self.down2 = _UNetBlock(width, 2 * width)
        self.mid = _UNetBlock(2 * width, 2 * width)
        self.up2 = _UNetBlock(4 * width, width)
        self.up1 = _UNetBlock(2 * width, width)
        self.upconv = nn.ConvTranspose2d(width, width, 2, stride=2)
        self.out = nn.Conv2d(width, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(x)  # 16x16
        d2 = self.down2(F.max_pool2d(d1, 2))  # 8x8
        m = self.mid(F.max_pool2d(d2, 2))  # 4x4
        u2 = self.up2(torch.cat([F.interpolate(m, scale_factor=2, mode="nearest"), d2], dim=1))  # 8x8
        u1 = self.up1(torch.cat([self.upconv(u2), d1], dim=1))  # 16x16
        return self.out(u1)


@_register
def unet() -> ZooCase:
    """A small U-Net: GroupNorm blocks, max-pool down, nearest and transposed-conv up, skip concatenation;
    float target (MSE loss)."""
    x = _images()
    target = torch.randn(4, 1, 16, 16)
    return ZooCase("unet", UNet(), x, target, checkpoint=("down2", "up2"))


# ---- transformers -------------------------------------------------------------------------------------------------
class _CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, d))


class _GPTBlock(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = _CausalSelfAttention(dim, heads, dropout)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim), nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2, seq: int = 16,
                 tied: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList(_GPTBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.tok.weight  # tied input / output embedding

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _tokens(batch: int = 4, seq: int = 16, vocab: int = 64) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq))


@_register
def gpt_sdpa() -> ZooCase:
    """Hand-written decoder: causal F.scaled_dot_product_attention (with attention dropout), LayerNorm, GELU MLP."""
    idx = _tokens()
    return ZooCase("gpt_sdpa", GPT(), idx, _tokens(), checkpoint=("blocks.0",))


@_register
def tied_lm() -> ZooCase:
    """Embedding language model whose output projection shares the input embedding's weight (tied weights)."""
    idx = _tokens()
    return ZooCase("tied_lm", GPT(layers=1, tied=True), idx, _tokens(), checkpoint=("blocks.0.mlp",))


class TorchEncoder(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 2, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=64, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(idx)).mean(dim=1))


@_register
def torch_encoder() -> ZooCase:
    """nn.TransformerEncoder of nn.TransformerEncoderLayer (post-norm, ReLU, dropout), sequence classification."""
    return ZooCase("torch_encoder", TorchEncoder(), _tokens(), _labels(classes=5),
                   checkpoint=("encoder.layers.1",))


class ViT(nn.Module):
    def __init__(self, size: int = 32, patch: int = 8, dim: int = 32, heads: int = 4, layers: int = 2,
                 classes: int = 10) -> None:
        super().__init__()
        self.patch_embed = nn.Conv2d(3, dim, patch, stride=patch)
        n = (size // patch) ** 2
        self.cls = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos = nn.Parameter(torch.randn(1, n + 1, dim) * 0.02)
        layer = nn.TransformerEncoderLayer(dim, heads, dim_feedforward=2 * dim, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch_embed(x).flatten(2).transpose(1, 2)  # (B, N, D)
        h = torch.cat([self.cls.expand(h.shape[0], -1, -1), h], dim=1) + self.pos
        h = self.encoder(h)
        return self.head(self.norm(h[:, 0]))


@_register
def vit() -> ZooCase:
    """ViT: convolutional patch embedding, class token, learned positions, pre-norm GELU encoder."""
    return ZooCase("vit", ViT(), _images(size=32), _labels(), checkpoint=("encoder.layers.0",))


@dataclass
class _LMOutput:
    loss: torch.Tensor | None
    logits: torch.Tensor


class HFStyleLM(nn.Module):
    """Hugging Face calling convention: keyword inputs, labels inside the batch, the loss returned by the model."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, return_dict: bool = True) -> None:
        super().__init__()
        self.return_dict = return_dict
        self.embed = nn.Embedding(vocab, dim)
        self.layer = _GPTBlock(dim, heads, dropout=0.0)
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                labels: torch.Tensor | None = None):
        h = self.embed(input_ids)
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1).to(h.dtype)
        logits = self.lm_head(self.norm(self.layer(h)))
        loss = None
        if labels is not None:
            shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1])
            loss = F.cross_entropy(shift_logits, labels[:, 1:].reshape(-1), ignore_index=-100)
        if self.return_dict:
            return {"loss": loss, "logits": logits}
        return _LMOutput(loss, logits)


def _hf_batch() -> dict[str, torch.Tensor]:
    ids = _tokens()
    mask = torch.ones_like(ids)
    mask[:, -3:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@_register
def hf_dict() -> ZooCase:
    """Dict inputs (input_ids, attention_mask, labels) and a dict output carrying the loss; no target."""
    return ZooCase("hf_dict", HFStyleLM(return_dict=True), _hf_batch(), None, checkpoint=("layer",))


@_register
def hf_dataclass() -> ZooCase:
    """Same calling convention, output as a dataclass with a ``.loss`` attribute (ModelOutput style)."""
    return ZooCase("hf_dataclass", HFStyleLM(return_dict=False), _hf_batch(), None, checkpoint=("layer.mlp",))


# ---- sharing, recurrence, data-dependent control flow --------------------------------------------------------------
class SharedTwice(nn.Module):
    def __init__(self, dim: int = 48, classes: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(20, dim)
        self.block = nn.Sequential(nn.Linear(dim, 2 * dim), nn.LayerNorm(2 * dim), nn.Tanh(), nn.Dropout(0.2),
                                   nn.Linear(2 * dim, dim))
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.inp(x))
        h = h + self.block(h)  # the same module (same weights) runs twice in one forward
        h = h + self.block(h)
        return self.head(h)


@_register
def shared_twice() -> ZooCase:
    """One module called twice in a forward (weight sharing: its gradient accumulates over both calls)."""
    return ZooCase("shared_twice", SharedTwice(), torch.randn(8, 20), _labels(8), checkpoint=("block",),
                   micro_batch_size=8)


class RNNClassifier(nn.Module):
    def __init__(self, kind: str, vocab: int = 64, dim: int = 24, hidden: int = 32, classes: int = 5) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        cls = {"lstm": nn.LSTM, "gru": nn.GRU}[kind]
        self.rnn = cls(dim, hidden, num_layers=2, batch_first=True, dropout=0.1 if kind == "lstm" else 0.0)
        self.head = nn.Linear(hidden, classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.embed(idx))
        return self.head(out[:, -1])


@_register
def lstm() -> ZooCase:
    """nn.LSTM with 2 layers (inter-layer dropout), last step classified."""
    return ZooCase("lstm", RNNClassifier("lstm"), _tokens(), _labels(classes=5), checkpoint=("rnn",))


@_register
def gru() -> ZooCase:
    """nn.GRU with 2 layers."""
    return ZooCase("gru", RNNClassifier("gru"), _tokens(), _labels(classes=5), checkpoint=("rnn",))


class DataDependent(nn.Module):
    """Branch on an activation's norm and loop as many times as the input says (``.item()``)."""

    def __init__(self, dim: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(16, dim)
        self.big = nn.Sequential(nn.Linear(dim, 4 * dim), nn.ReLU(), nn.Linear(4 * dim, dim))
        self.small = nn.Linear(dim, dim)
        self.step = nn.Sequential(nn.Linear(dim, dim), nn.LayerNorm(dim), nn.ReLU())
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        if h.norm() > 1.0:  # the norm of a (4, 32) ReLU activation of unit-variance inputs is ~10: always taken
            h = h + self.big(h)
        else:
            h = self.small(h)
        # the loop count comes from the data: the inputs' last column holds it (integral values, 3 here)
        for _ in range(int(x[:, -1].max().item())):
            h = h + self.step(h)
        return self.head(h)


@_register
def data_dependent() -> ZooCase:
    """Data-dependent control flow: ``if h.norm() > c`` and a loop count from ``.item()`` (fake tensors cannot run
    it, so the estimator falls back to a real run)."""
    x = torch.randn(4, 16)
    x[:, -1] = torch.tensor([1.0, 3.0, 2.0, 0.0])
    return ZooCase("data_dependent", DataDependent(), x, _labels(), checkpoint=("big",))


class ConvAutoencoder(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Conv2d(3, width, 3, 2, 1), nn.LayerNorm([width, 16, 16]), nn.GELU(),
            nn.Conv2d(width, 2 * width, 3, 2, 1), nn.GELU(),
        )
        self.decoder = nn.Sequential(
            nn.ConvTranspose2d(2 * width, width, 2, stride=2), nn.GELU(),
            nn.ConvTranspose2d(width, 3, 2, stride=2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(x))


@_register
def autoencoder() -> ZooCase:
    """Convolutional autoencoder reconstructing its 32x32 input (float target, MSE over a full-resolution output),
    with a LayerNorm over (C, H, W) and transposed-convolution upsampling."""
    x = _images(size=32)
    return ZooCase("autoencoder", ConvAutoencoder(), x, x.clone(), checkpoint=("encoder",))


_AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


@functools.cache
def cpu_cannot_run(name: str, precision: str) -> str | None:
    """Why this CPU cannot run zoo case ``name``'s forward and backward in ``precision`` (its first error line), or None
    when it can. Asked of the machine directly, with torch alone: oneDNN has bf16 and fp16 kernels only on some CPUs
    (an AVX2-only CPU has no bf16 LSTM), so a test whose truth is a real step skips where the step cannot run."""
    if precision not in _AUTOCAST:
        return None
    case = ZOO[name]()
    model = copy.deepcopy(case.model)
    rows = case.micro_batch_size
    sample = case.sample
    try:
        with torch.autocast("cpu", dtype=_AUTOCAST[precision]):
            if isinstance(sample, dict):
                out = model(**{k: v[:rows] for k, v in sample.items()})
            elif isinstance(sample, tuple):
                out = model(*(v[:rows] for v in sample))
            else:
                out = model(sample[:rows])
        leaves = [out] if isinstance(out, torch.Tensor) else [v for v in (out.values() if isinstance(out, dict)
                                                                           else vars(out).values())
                                                              if isinstance(v, torch.Tensor)]
        sum(t.float().sum() for t in leaves if t.is_floating_point()).backward()
    except RuntimeError as e:
        return f"this CPU ({torch.backends.cpu.get_cpu_capability()}) cannot run {name} in {precision}: " + \
            str(e).splitlines()[0]
    return None
