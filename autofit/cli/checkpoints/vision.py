"""Vision transformers: ViT and DINOv2, from each repository's ``config.json``; float32 (DINOv2's config says so,
ViT's names no dtype and its weights are float32)."""

from __future__ import annotations

from autofit.cli.checkpoints.entry import Checkpoint

__all__ = ["CHECKPOINTS"]


def _vit(name: str, layers: int, hidden: int, heads: int, labels: int | None, patch: int = 16) -> Checkpoint:
    # google/vit-*-224[-in21k]/config.json: 224 x 224 images, intermediate 4 x hidden, 1000 ImageNet classes (the
    # -in21k checkpoints are headless: ViTModel)
    head = {"architectures": ["ViTForImageClassification"], "num_labels": labels} if labels else \
        {"architectures": ["ViTModel"]}
    return Checkpoint(name=name, family="ViT", dtype="float32", config={
        "model_type": "vit", "num_hidden_layers": layers, "hidden_size": hidden, "num_attention_heads": heads,
        "intermediate_size": 4 * hidden, "image_size": 224, "patch_size": patch, "num_channels": 3, **head})


def _dinov2(size: str, layers: int, hidden: int, heads: int, swiglu: bool = False) -> Checkpoint:
    # facebook/dinov2-*/config.json: 518 x 518 images in 14 x 14 patches, MLP ratio 4 (SwiGLU in giant), layer
    # scale 1.0, headless (Dinov2Model): hf: adds a classification head
    return Checkpoint(name=f"facebook/dinov2-{size}", family="DINOv2", dtype="float32", config={
        "model_type": "dinov2", "architectures": ["Dinov2Model"], "num_hidden_layers": layers, "hidden_size": hidden,
        "num_attention_heads": heads, "mlp_ratio": 4, "image_size": 518, "patch_size": 14, "num_channels": 3,
        "layerscale_value": 1.0, "layer_norm_eps": 1e-6, "qkv_bias": True, "use_swiglu_ffn": swiglu})


CHECKPOINTS: tuple[Checkpoint, ...] = (
    _vit("google/vit-base-patch16-224", 12, 768, 12, 1000),
    _vit("google/vit-base-patch16-224-in21k", 12, 768, 12, None),
    _vit("google/vit-large-patch16-224", 24, 1024, 16, 1000),
    _vit("google/vit-huge-patch14-224-in21k", 32, 1280, 16, None, patch=14),
    _dinov2("small", 12, 384, 6),
    _dinov2("base", 12, 768, 12),
    _dinov2("large", 24, 1024, 16),
    _dinov2("giant", 40, 1536, 24, swiglu=True),
)
