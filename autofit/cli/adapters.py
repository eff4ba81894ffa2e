"""LoRA and QLoRA on a model built on the meta device (``--lora``, ``--qlora``, :func:`autofit.hf_model`).

LoRA is peft's own: ``peft.get_peft_model(model, LoraConfig(r=..., target_modules=...))``, so the adapters' shapes,
dtypes (peft upcasts them to fp32: ``autocast_adapter_dtype=True``) and which layers they wrap are peft's. The
default targets are peft's for the architecture (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``: q_proj and
v_proj for Llama, Qwen2, Mistral), or every linear layer but the output ("all-linear") where peft has none.

Note [QLoRA on meta]
    QLoRA as transformers' ``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=<the load dtype>)`` then peft's
    ``prepare_model_for_kbit_training`` and ``get_peft_model`` build it: every ``nn.Linear`` but the output layer
    becomes a bitsandbytes ``Linear4bit``; every other bf16 / fp16 parameter is cast to fp32 by
    ``prepare_model_for_kbit_training`` (peft/utils/other.py: "cast all non INT8 parameters to fp32"); gradient
    checkpointing is left to the plan, not switched on as that function's default does.
    A ``Linear4bit`` made with ``device="meta"`` holds a ``Params4bit`` that was never quantized: its
    ``quant_state`` is None and its forward fails (``matmul_4bit`` asserts a quant_state). bitsandbytes' own
    ``quantize_4bit`` runs on meta tensors (its ops have fake kernels): it returns the packed uint8 weight
    (numel / 2 bytes) and a QuantState whose absmax (one per block of 64; with double quantization 8-bit absmax,
    an fp32 second-level absmax per 256 blocks, code books and offset) are meta tensors of the real shapes. A
    ``Params4bit`` made from those is what ``.to("cuda")`` would give, on meta: autofit counts its bytes and
    statistics as for a real one, and the forward and backward run on meta like any other layer.

Note [8-bit LoRA on meta]
    LoRA over an 8-bit base as transformers' ``BitsAndBytesConfig(load_in_8bit=True)`` builds it (its defaults:
    ``llm_int8_threshold=6.0``, ``llm_int8_has_fp16_weight=False``, the output layer skipped), then peft's
    ``prepare_model_for_kbit_training`` and ``get_peft_model``: every ``nn.Linear`` but the output layer becomes a
    bitsandbytes ``Linear8bitLt`` whose ``Int8Params`` holds ``CB`` (the int8 weight: 1 byte per weight, the
    parameter's own storage) and ``SCB`` (one fp32 absmax scale per output row: bitsandbytes/_ops.py, the fake
    kernel of ``int8_vectorwise_quant``, ``row_stats = torch.empty(A.numel() // A.shape[-1], dtype=torch.float32)``;
    ``Int8Params._quantize`` in bitsandbytes/nn/modules.py stores both). That op has a fake kernel, so on a meta
    weight it returns meta ``CB`` and ``SCB`` of the real shapes: an ``Int8Params`` made from them is what
    ``.to("cuda")`` would give, on meta (autofit/capture/model_copy.py carries ``CB`` and ``SCB`` to the fake twin).
    What the simulated step runs: bitsandbytes picks ``MatMul8bitFp`` (dequantize the weight, then a plain matmul)
    for a layer in training on the CPU, and ``MatMul8bitLt`` (the activations quantized to int8, int8 matmul) on a
    GPU (bitsandbytes/autograd/_functions.py, ``matmul``). Both keep the layer's input for backward and dequantize
    the weight in backward; their forward temporaries differ (the dequantized weight on the CPU, the int8 input
    and its outlier columns on the GPU), which a GPU plan does not model yet.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autofit.core.errors import InvalidInputError

__all__ = ["Adapter", "apply_adapter", "lora_default_targets", "quantize_4bit_on_meta", "quantize_8bit_on_meta"]

QUANT_TYPE, BLOCKSIZE = "nf4", 64  # QLoRA's: 4-bit NormalFloat in blocks of 64, double-quantized statistics
INT8_THRESHOLD = 6.0  # transformers' BitsAndBytesConfig(llm_int8_threshold=6.0): LLM.int8()'s outlier threshold


@dataclass(frozen=True)
class Adapter:
    """LoRA of rank ``rank`` (None: no adapter) on ``targets`` (None: peft's default for the architecture, else
    "all-linear"), with a 4-bit NF4 base when ``qlora``, an int8 base (LLM.int8()) when ``int8``."""

    rank: int | None = None
    targets: tuple[str, ...] | str | None = None
    alpha: float | None = None
    qlora: bool = False
    int8: bool = False

    def __post_init__(self) -> None:
        if self.rank is not None and (isinstance(self.rank, bool) or not isinstance(self.rank, int)
                                      or self.rank < 1):
            raise InvalidInputError(f"--lora {self.rank!r}: the rank must be a positive integer, e.g. --lora 16")
        if self.qlora and self.rank is None:
            raise InvalidInputError("--qlora needs --lora RANK: QLoRA trains LoRA adapters on the 4-bit base")
        if self.int8 and self.rank is None:
            raise InvalidInputError("an 8-bit base (load_in_8bit) needs a LoRA rank: autofit plans LoRA adapters "
                                    "over int8 weights, which cannot themselves be trained")
        if self.int8 and self.qlora:
            raise InvalidInputError("the base is either 4-bit (qlora, load_in_4bit) or 8-bit (load_in_8bit), not "
                                    "both")
        if self.rank is None and (self.targets is not None or self.alpha is not None):
            raise InvalidInputError("--lora-targets and lora_alpha need --lora RANK")


def _peft():
    try:
        import peft
    except ImportError as e:
        raise InvalidInputError("--lora needs peft installed (pip install 'torch-autofit[finetune]')") from e
    return peft


def _bnb():
    try:
        import logging

        import bitsandbytes
    except ImportError as e:
        raise InvalidInputError("--qlora needs bitsandbytes installed (pip install 'torch-autofit[finetune]')") from e
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # CPU kernel notices are not the plan
    return bitsandbytes


def lora_default_targets(model: nn.Module) -> tuple[str, ...] | str:
    """peft's default LoRA targets for ``model``'s architecture, or "all-linear" where peft has none."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping

    kind = getattr(getattr(model, "config", None), "model_type", None)
    return tuple(mapping[kind]) if kind in mapping else "all-linear"


def quantize_4bit_on_meta(linear: nn.Linear, compute_dtype: torch.dtype) -> nn.Module:
    """``linear`` as bitsandbytes' NF4 ``Linear4bit`` with a quantized weight on meta (Note [QLoRA on meta])."""
    bnb = _bnb()
    layer = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                              compute_dtype=compute_dtype, compress_statistics=True, quant_type=QUANT_TYPE,
                              quant_storage=torch.uint8, device="meta")
    weight = torch.empty(linear.out_features, linear.in_features, dtype=compute_dtype, device="meta")
    # quantize_blockwise (the second level) caches its code book on the device of its first call, for every later
    # call on any device: a meta one would break the next real quantization, so the cache is left as it was found
    cache = bnb.functional.name2qmap
    before = dict(cache)
    try:
        packed, state = bnb.functional.quantize_4bit(weight, blocksize=BLOCKSIZE, compress_statistics=True,
                                                     quant_type=QUANT_TYPE, quant_storage=torch.uint8)
    finally:
        cache.clear()
        cache.update(before)
    layer.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state, blocksize=BLOCKSIZE,
                                     compress_statistics=True, quant_type=QUANT_TYPE, quant_storage=torch.uint8,
                                     module=layer, bnb_quantized=True)
    layer.quant_state = state
    if linear.bias is not None:
        layer.bias = nn.Parameter(torch.empty_like(linear.bias), requires_grad=False)
    return layer


def quantize_8bit_on_meta(linear: nn.Linear) -> nn.Module:
    """``linear`` as bitsandbytes' ``Linear8bitLt`` with an int8 weight and its row scales on meta (Note [8-bit LoRA
    on meta])."""
    bnb = _bnb()
    layer = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                has_fp16_weights=False, threshold=INT8_THRESHOLD, device="meta")
    # Int8Params._quantize casts the weight to fp16 before quantizing it
    weight = torch.empty(linear.out_features, linear.in_features, dtype=torch.float16, device="meta")
    packed, scales, _ = bnb.functional.int8_vectorwise_quant(weight)
    layer.weight = bnb.nn.Int8Params(packed, requires_grad=False, has_fp16_weights=False, CB=packed, SCB=scales)
    if linear.bias is not None:
        layer.bias = nn.Parameter(torch.empty_like(linear.bias), requires_grad=False)
    return layer


def _quantize(model: nn.Module, compute_dtype: torch.dtype, bits: int) -> None:
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child is not output:  # transformers keeps the output layer unquantized
                setattr(module, name, quantize_4bit_on_meta(child, compute_dtype) if bits == 4 else
                        quantize_8bit_on_meta(child))
    # as transformers marks a model loaded in 4 or 8 bits (peft reads it)
    setattr(model, "is_loaded_in_4bit" if bits == 4 else "is_loaded_in_8bit", True)


def apply_adapter(model: nn.Module, adapter: Adapter) -> tuple[nn.Module, str]:
    """``model`` (on meta) with ``adapter`` applied, and words for the model line."""
    if adapter.rank is None:
        return model, ""
    peft = _peft()
    targets = adapter.targets if adapter.targets is not None else lora_default_targets(model)
    words = "all-linear" if targets == "all-linear" else ",".join(targets)
    if adapter.targets is None:
        words += " (peft's default for " + (getattr(model.config, "model_type", "the model") if
                                            targets != "all-linear" else "a model peft has no default for") + ")"
    if adapter.qlora or adapter.int8:
        load = next(model.parameters()).dtype
        _quantize(model, load, 4 if adapter.qlora else 8)
        # peft's prepare_model_for_kbit_training: freeze, cast bf16 / fp16 parameters that are not quantized to fp32
        with torch.device("meta"):
            model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        # that cast makes a 4-bit layer's bias fp32 (an 8-bit one's follows its input's dtype, fp32 here); its first forward casts it back to the compute dtype for good
        # (bitsandbytes/nn/modules.py, Linear4bit.forward: "bias.data = bias.data.to(x.dtype)"): the steady state
        for module in model.modules():
            if isinstance(module, _bnb().nn.Linear4bit) and module.bias is not None:
                module.bias.data = module.bias.data.to(module.compute_dtype)
    kwargs = {} if adapter.alpha is None else {"lora_alpha": adapter.alpha}
    config = peft.LoraConfig(r=adapter.rank, target_modules=list(targets) if targets != "all-linear" else targets,
                             **kwargs)
    try:
        with torch.device("meta"):
            model = peft.get_peft_model(model, config)
    except ValueError as e:  # a target that matches no module
        raise InvalidInputError(f"--lora-targets {words}: {e}") from e
    kind = (f"QLoRA r={adapter.rank} (NF4 base, double-quantized; other weights fp32 as peft's "
            "prepare_model_for_kbit_training casts them)" if adapter.qlora else
            f"LoRA r={adapter.rank} (int8 base, LLM.int8(); other weights fp32 as peft's "
            "prepare_model_for_kbit_training casts them)" if adapter.int8 else f"LoRA r={adapter.rank}")
    return model, f"{kind} on {words}"
