"""The published GPU memory figures ``published.py`` compares autofit with: what ran, what was measured, the number,
its source and its uncertainty, and how to rebuild the run from its configuration (no weights, no hub access).

Model configurations are written out from the published ``config.json`` of each model (the numbers that matter for
memory: vocabulary, hidden size, layers, heads, MLP size, positions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import autofit
from autofit.options import as_step

from benchmarks.vit import VIT_L_16_PARAMETERS, VitL16

__all__ = ["CASES", "Case"]

Built = tuple[torch.nn.Module, Any, dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class Case:
    name: str
    source: str  # URL or repository + path, and the exact place of the figure
    ran: str  # what ran, in words
    gpu: str  # autofit catalog name of the GPU that ran it
    measures: str  # "allocated", "reserved" or "nvidia-smi"
    published_bytes: int
    unit: str  # "MB" (10^6) or "MiB" (2^20): how the source printed it
    uncertainty_bytes: int
    uncertainty: str
    build: Callable[[], Built]
    context_mib: float | None = None  # the CUDA context the source measured (nvidia-smi cases)
    outside_bytes: int = 0  # tensors the source kept alive outside the step (counted by its figure, not by a step)
    why: str = ""  # for a case outside the goal: the reason, in a sentence
    ranks: int = 1  # a multi-GPU run: the figure is one rank's (benchmarks/published_multi_gpu.py)
    # the run set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (Note [expandable segments as an input])
    expandable_segments: bool = False

    def __post_init__(self) -> None:
        if self.measures not in ("allocated", "reserved", "nvidia-smi"):
            raise ValueError(f"Case {self.name}: measures must be allocated, reserved or nvidia-smi")


def _meta(factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    with torch.device("meta"):
        return factory().train()


# --- Hugging Face models, from their config.json --------------------------------------------------------------------

def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    # openai-community/gpt2 config.json: n_layer 12, n_head 12, n_embd 768, n_positions 1024, vocab 50257
    config = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)
    return _meta(lambda: GPT2LMHeadModel(config))


def _bert(cls_name: str, *, hidden: int, layers: int, heads: int, intermediate: int, attn: str, **extra):
    import transformers

    # google-bert/bert-{base,large}-uncased config.json: vocab 30522, 512 positions, 2 token types, GELU
    config = transformers.BertConfig(vocab_size=30522, hidden_size=hidden, num_hidden_layers=layers,
                                     num_attention_heads=heads, intermediate_size=intermediate,
                                     max_position_embeddings=512, type_vocab_size=2, **extra)
    config._attn_implementation = attn
    return _meta(lambda: getattr(transformers, cls_name)(config))


class _SoftmaxSavingInput(torch.autograd.Function):
    """Softmax as torch < 1.11 differentiated it: ``SoftmaxBackward`` kept ``self`` (the input) as well as the
    result, because tools/autograd/derivatives.yaml wrote ``self: _softmax_backward_data(grad, result, dim, self)``
    though the kernel reads only the result (pytorch/pytorch#64000, "Softmax/logsoftmax use more memory for backward
    than needed", 2021-08-26; fixed by #65242, which passes ``self.scalar_type()`` instead, first released in 1.11:
    transformers' pytorch_utils.softmax_backward_data calls ``_softmax_backward_data(..., self)`` under
    ``is_torch_less_than_1_11`` and ``self.dtype`` otherwise)."""

    @staticmethod
    def forward(ctx, scores, dim):
        probs = torch.softmax(scores, dim)
        ctx.save_for_backward(scores, probs)
        ctx.dim = dim
        return probs

    @staticmethod
    def backward(ctx, grad):
        scores, probs = ctx.saved_tensors
        return torch._softmax_backward_data(grad, probs, ctx.dim, scores.dtype), None


def _bert_self_attention(*, softmax_saves_input: bool) -> str:
    """BertSelfAttention.forward of transformers 4.1x to 4.3x (before its SDPA path), registered as an attention
    implementation; returns its name. Scores / sqrt(d) plus the extended mask, softmax, dropout, times value. With no
    ``attention_mask`` in the batch BertModel made ``torch.ones((B, S))`` and ``get_extended_attention_mask`` turned it
    into a (B, 1, 1, S) additive mask in the parameters' dtype (fp32), so under fp16 autocast the scores were promoted
    to fp32 before the softmax. ``softmax_saves_input``: the softmax keeps its input for backward, as torch < 1.11
    did (``_SoftmaxSavingInput``)."""
    from transformers import AttentionInterface

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        scores = torch.matmul(query, key.transpose(2, 3)) / query.size(-1) ** 0.5
        if attention_mask is None:
            attention_mask = torch.zeros((query.size(0), 1, 1, key.size(2)), dtype=torch.float32,
                                         device=query.device)
        scores = scores + attention_mask
        probs = _SoftmaxSavingInput.apply(scores, -1) if softmax_saves_input else torch.softmax(scores, -1)
        probs = F.dropout(probs, p=dropout, training=module.training)
        return torch.matmul(probs, value).transpose(1, 2).contiguous(), probs

    name = "bert-4.x-torch-1.10" if softmax_saves_input else "bert-4.x"
    AttentionInterface.register(name, attention)
    return name


def _adamw_torch(params):
    """HF Trainer's default ``optim="adamw_torch"`` (transformers >= 4.38 or so): torch.optim.AdamW, lr 5e-5, with no
    implementation flag, so autofit simulates what torch picks on CUDA (foreach: ``_default_to_fused_or_foreach`` in
    torch/optim/optimizer.py)."""
    return torch.optim.AdamW(params, lr=5e-5, weight_decay=0.0)


def _adamw_per_parameter(params):
    """transformers.AdamW (``optim="adamw_hf"``, the Trainer default in 2022) stepped parameter by parameter; torch
    1.10's AdamW did the same: no multi-tensor intermediates."""
    return torch.optim.AdamW(params, lr=5e-5, foreach=False)


# HF Trainer defaults: torch AdamW, max_grad_norm 1.0 (clip_grad_norm_ before every optimizer step)
_TRAINER_DEFAULTS = {"step": 2, "optimizer": _adamw_torch, "clip_grad_norm": 1.0}


def _optimum_gpt2() -> Built:
    ids = torch.randint(0, 50257, (2, 16))
    return _gpt2(), {"input_ids": ids, "labels": ids}, _TRAINER_DEFAULTS


def _optimum_bert() -> Built:
    model = _bert("BertForMaskedLM", hidden=768, layers=12, heads=12, intermediate=3072, attn="sdpa")
    ids = torch.randint(0, 30522, (2, 16))
    return model, {"input_ids": ids, "labels": ids}, _TRAINER_DEFAULTS


def _adafactor(params):
    """HF Trainer's ``optim="adafactor"``: transformers.Adafactor(scale_parameter=False, relative_step=False),
    lr 5e-5 (transformers/trainer_optimizer.py, ``_get_adafactor``); per-parameter, factored second moments."""
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=5e-5, scale_parameter=False, relative_step=False)


def _anatomy(micro: int, accumulation: int = 1, precision: str = "fp32", checkpoint: bool = False,
             optimizer: Callable = _adamw_per_parameter) -> Callable[[], Built]:
    """The 2022 Trainer called ``model.zero_grad()``, whose default in torch 1.10 was ``set_to_none=False``
    (torch/nn/modules/module.py, ``Module.zero_grad``; True since torch 2.0): gradients stay allocated, zeroed, through
    the next forward. autofit's step sets them to None, so an accumulation window of at least 2 stands in for it: its
    last micro-batch runs forward and backward with every gradient already allocated, as each step did then."""
    accumulation = max(accumulation, 2)

    def build() -> Built:
        model = _bert("BertForSequenceClassification", hidden=1024, layers=24, heads=16, intermediate=4096,
                      attn=_bert_self_attention(softmax_saves_input=True), num_labels=2)
        sample = {"input_ids": torch.randint(100, 30000, (4, 512)), "labels": torch.zeros(4, dtype=torch.long)}
        layers = tuple(f"bert.encoder.layer.{i}" for i in range(24)) if checkpoint else ()
        return model, sample, {"precision": precision, "optimizer": optimizer,
                               "step": autofit.Step(micro_batch_size=micro,
                                                    accumulation_steps=accumulation, checkpoint=layers),
                               "clip_grad_norm": 1.0}

    return build


def _anatomy_rerun(micro: int = 4, accumulation: int = 1, precision: str = "fp32", checkpoint: bool = False,
                   optimizer: Callable = _adamw_per_parameter) -> Callable[[], Built]:
    """The anatomy notebook as rerun in 2023 on torch 2.0.1: ``zero_grad`` sets gradients to None (the default since
    2.0), the softmax saves only its output (since 1.11), Trainer's default ``optim="adamw_hf"`` still
    (transformers.AdamW: the notebook prints its deprecation warning), stepped parameter by parameter."""

    def build() -> Built:
        model = _bert("BertForSequenceClassification", hidden=1024, layers=24, heads=16, intermediate=4096,
                      attn=_bert_self_attention(softmax_saves_input=False), num_labels=2)
        sample = {"input_ids": torch.randint(100, 30000, (micro, 512)),
                  "labels": torch.zeros(micro, dtype=torch.long)}
        layers = tuple(f"bert.encoder.layer.{i}" for i in range(24)) if checkpoint else ()
        return model, sample, {"precision": precision, "optimizer": optimizer,
                               "step": autofit.Step(micro_batch_size=micro,
                                                    accumulation_steps=accumulation, checkpoint=layers),
                               "clip_grad_norm": 1.0}

    return build


# --- PyTorch's AMP recipe (recipes_source/recipes/amp_recipe.py) -------------------------------------------------

_AMP_DATA = 50 * 2 * 512 * 4096 * 4  # data and targets: 50 batches each of 512 x 4096 fp32, made on the GPU first


def _amp_recipe(precision: str) -> Callable[[], Built]:
    """make_model(4096, 4096, 3): Linear, ReLU, Linear, ReLU, Linear; MSELoss; SGD(lr=0.001) (no state); batch 512.
    torch 1.11's ``opt.zero_grad()`` kept gradients allocated (set_to_none=False): accumulation 2 stands in for it,
    as in ``_anatomy``."""

    def build() -> Built:
        def net() -> torch.nn.Module:
            return torch.nn.Sequential(torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                                       torch.nn.ReLU(), torch.nn.Linear(4096, 4096))

        return (_meta(net), torch.randn(512, 4096),
                # the recipe's batches are made beforehand and counted in outside_bytes: the estimate holds one
                {"target": torch.randn(512, 4096),
                 "step": autofit.Step(micro_batch_size=512,
                                      accumulation_steps=2, inputs="micro-batch"), "precision": precision,
                 "loss_fn": F.mse_loss,
                 "optimizer": lambda params: torch.optim.SGD(params, lr=1e-3)})

    return build


# --- torchvision vit_l_16 (benchmarks/vit.py) ---------------------------------------------------------------------

def _vit_tutorial() -> Built:
    model = _meta(VitL16)
    assert sum(p.numel() for p in model.parameters()) == VIT_L_16_PARAMETERS
    return (model, torch.rand(1, 3, 224, 224),
            {"step": 1, "loss_fn": lambda out: out.sum(),
             # torch.optim.Adam(model.parameters()): on CUDA torch picks foreach, and so does autofit's CUDA step
             "optimizer": "adam"})


def _fabric_vit(batch: int, precision: str) -> Callable[[], Built]:
    """rasbt/pytorch-memory-optim's Fabric scripts: torchvision vit_l_16 with its head replaced by Linear(1024, 10),
    ``torch.optim.Adam`` (foreach on CUDA), ``F.cross_entropy`` over CIFAR-10 labels, and the loop ``logits =
    model(features)``, ``loss = ...``, ``optimizer.zero_grad()``, ``fabric.backward(loss)``, ``optimizer.step()``:
    zero_grad after the forward, so the last step's gradients are alive through it (Note [where zero_grad falls],
    autofit/training/step.py). Fabric's "16-mixed" is autocast fp16 with a GradScaler; "bf16-true" converts the
    parameters (and so the gradients and Adam's state) and the inputs to bf16 and runs without autocast: the model
    built in bf16, computing as built ("fp32": no autocast)."""
    true_bf16 = precision == "bf16-true"

    def build() -> Built:
        model = _meta(lambda: VitL16(classes=10))
        if true_bf16:
            model = model.to(torch.bfloat16)
        policy = "fp32" if true_bf16 else precision
        return (model, torch.rand(batch, 3, 224, 224, dtype=torch.bfloat16 if true_bf16 else torch.float32),
                {"target": torch.randint(0, 10, (batch,)), "loss_fn": F.cross_entropy,
                 "optimizer": "adam", "precision": policy, "step": autofit.Step(micro_batch_size=batch,
                                                                                zero_grad="after-forward")})

    return build


_FABRIC = ("rasbt/pytorch-memory-optim (Sebastian Raschka), logs.md at commit 2d1ae1e: 'Memory used' printed as "
           "torch.cuda.max_memory_reserved() / 1e9 after one epoch of CIFAR-10 at 224x224 (torch "
           "2.1.0.dev20230623+cu118, lightning 2.1.0.dev0), the scripts 01-2_pytorch-fabric.py, "
           "02_mixed-precision.py, 03-bfloat16.py and 04-lower-batchsize.py (batch 16 per the log's 2812 batches)")
_FABRIC_UNC = ("printed to 10 MB; the GPU is an A100 (size not stated; the figures do not depend on it); one "
               "epoch of the whole loop, whose eval-mode argmax and validation forwards (no_grad) hold less than "
               "the training step: ±1 %")

_OPTIMUM = ("huggingface/optimum-benchmark, training scenario (optimum_benchmark/scenarios/training/config.py: "
            "per_device_train_batch_size 2, dataset sequence_length 16, 140 steps) with memory tracking "
            "(optimum_benchmark/trackers/memory.py: torch.cuda.max_memory_allocated() / 1e6 after "
            "reset_peak_memory_stats, over the whole trainer.train()); figure as quoted in issue 9")
_ANATOMY = ("Hugging Face transformers docs, 'Model training anatomy' (docs/source/en/model_memory_anatomy.md) and "
            "'Methods and tools for efficient training on a single GPU' (docs/source/en/perf_train_gpu_one.md, "
            "v4.2x): google-bert/bert-large-uncased sequence classification, 512 random sequences of 512 tokens, "
            "Trainer, Tesla V100-SXM2 16 GB, driver 460.91, CUDA 11.2 (Jan 2022); pynvml used // 1024**2 printed "
            "as 'MB', after trainer.train(); the same page measures the context at 1343 MiB")
_ANATOMY_UNC = ("nvidia-smi counts the whole GPU (one process here): reserved + context (measured on the page: "
                "1343 MiB); 'MB' is MiB, floored (±1 MiB); 2022 software (torch 1.10 at the latest: 1.11 came out "
                "on 2022-03-10; transformers 4.1x's BertSelfAttention, rebuilt in _bert_self_attention, whose "
                "softmax kept its input for backward; transformers' own AdamW): ±2 % for what the allocator of "
                "that torch version reserved")

_RERUN = ("the anatomy notebook (as _ANATOMY) rerun by a reader on 2 x RTX 3090 with torch 2.0.1+cu117 and Python "
          "3.8 (2023), GitHub anmechkoe/GPTlearning, 'GPT学习代码/exp13-accelerate/' (commit 3766829): install.ipynb "
          "prints the GPUs and torch version; 1.baseline.ipynb and 4.mixed-precision-training.ipynb, first training "
          "cell of each (a fresh kernel), print NVML used // 1024**2 'MB' summed over both GPUs (the second idle: "
          "the process sets CUDA_VISIBLE_DEVICES=0), 620 before torch and 1276 after torch.ones((1, 1)).to('cuda:0')")
_RERUN_UNC = ("nvidia-smi over both GPUs: the context is taken as the notebook's own 1276 MiB figure (both GPUs' idle "
              "use plus GPU 0's context, lazily loaded modules since CUDA 11.7: kernels loaded later in the run, "
              "cuBLAS's among them, are not in it); 'MB' is MiB, floored; transformers version not printed "
              "(4.2x-4.3x: the Trainer's default optimizer is still transformers.AdamW): ±2 %")

_RERUN_LAZY_WHY = (
    "the term is the CUDA context's growth after the notebook measured it: the 1276 MiB was read after "
    "torch.ones((1, 1)), and with lazy module loading (CUDA >= 11.7; torch >= 1.13 sets CUDA_MODULE_LOADING=LAZY, "
    "pytorch/pytorch#86509: 287 MB lazy against 667 MB eager after one randn().cuda()) a kernel's module is loaded "
    "into the context when it first runs, so cuBLAS's and the step's own kernels are loaded later and counted by "
    "the nvidia-smi figure after training but not by the context taken here. No figure for that growth is "
    "published for this run; every rerun row is low by 240 to 560 MiB, and {need} MiB more would bring this one "
    "within 5 %")

_AMP = ("PyTorch recipe 'Automatic Mixed Precision' (pytorch/tutorials recipes_source/recipes/amp_recipe.py: "
        "end_timer_and_print prints torch.cuda.max_memory_allocated() after reset_peak_memory_stats), as run and "
        "published in a public GitHub README 'Comparison for training CNN models using Tensor Cores with PyTorch' "
        "(Tesla T4, PyTorch 1.11, driver 470.57.02, CUDA 11.4), found by full-text search for the printed figure; "
        "the index does not name its repository")
_AMP_UNC = ("exact bytes; the step is the recipe's (its helper is unchanged in the tutorials repository); the peak "
            "counts the 100 data/target batches made before the timer (838.9 MB, added to autofit's figure); "
            "torch 1.11 cuBLAS workspace through the allocator or not: ±8.5 MB (±0.6 %)")


# --- torchao's low-bit optimizer README (timm ViT-H) and torchtune's optimization ladder (Llama 3.2 3B) ----------

_TORCHAO = ("pytorch/ao torchao/optim/README.md, 'Benchmarks', first table (commit 36027d82, "
            "https://github.com/pytorch/ao/blob/main/torchao/optim/README.md): timm vit_huge_patch14_224.orig_in21k "
            "fine-tuned on resisc45 (45 classes), PyTorch 2.4, BF16 AMP, compiled model, batch 8, 4070Ti SUPER; "
            "benchmarks/benchmark_low_bit_adam.py prints torch.cuda.max_memory_allocated() / 1e9")
_TORCHAO_UNC = ("GB = 10^9 with two decimals (±0.005 GB); a 4070Ti SUPER (AD103, 16 GB) is not in the catalog: "
                "the RTX 4090 (AD102, same sm_89 allocator and cuBLAS terms) stands in; the model runs compiled "
                "(fullgraph); these cases estimate it uncompiled (compile=True, which estimates what inductor "
                "compiles for the CPU, docs/fine-tuning.md, has not been run on them)")


def _vit_h() -> torch.nn.Module:
    """timm's vit_huge_patch14_224 (ViT-H/14: patch 14, hidden 1280, 32 blocks, 16 heads, MLP 5120, class token,
    pre-norm LayerNorm eps 1e-6), here with timm's num_classes=45: 630.8 M parameters, the README's '630M'."""
    return _meta(lambda: VitL16(patch=14, layers=32, hidden=1280, heads=16, mlp=5120, classes=45))


def _torchao_vit(optimizer: Callable) -> Callable[[], Built]:
    def build() -> Built:
        return (_vit_h(), torch.rand(8, 3, 224, 224),
                {"step": 8, "target": torch.zeros(8, dtype=torch.long), "precision": "bf16",
                 "optimizer": optimizer})

    return build


def _compiled(build: Callable[[], Built]) -> Callable[[], Built]:
    """The same run estimated as compiled (``compile=True``): on a CUDA target the larger of inductor's CPU lowering
    and the eager step (Note [compiled models on a GPU target], autofit/simulate/compiled_model.py)."""

    def compiled() -> Built:
        model, sample, kwargs = build()
        step = as_step(kwargs.get("step"))  # a Step, or the micro-batch size alone
        return model, sample, {**kwargs, "step": dataclasses.replace(step, compile=True)}

    return compiled


def _fused_adamw(params):
    """benchmark_low_bit_adam.py OPTIM_MAP["AdamW"]: torch.optim.AdamW(fused=True), lr 1e-4 (its default)."""
    return torch.optim.AdamW(params, lr=1e-4, fused=True)


def _bnb_adamw8bit(params):
    """OPTIM_MAP["AdamW8bitBnb"]: bitsandbytes.optim.AdamW8bit."""
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=1e-4)


_TORCHTUNE = ("pytorch/torchtune README.md, 'Optimization flags' table (added in commit 1814feb1, 2024-11-18; "
              "https://github.com/pytorch/torchtune#optimization-flags): full_finetune_single_device, Llama 3.2 3B, "
              "batch 2, packed to 4096 tokens, bf16 parameters, A100, each row adding one technique; 'Peak Memory "
              "Active (GiB)', the recipe's memory_stats()['active_bytes.all.peak'] (~ max_memory_allocated)")
_TORCHTUNE_UNC = ("GiB with one decimal (±0.05 GiB); every row from '+ Compile' on runs torch.compile; these cases "
                  "estimate the model uncompiled (compile=True not run on them) and the loss eagerly; A100 40 or 80 GB not said (the same allocator); torchtune's own Llama "
                  "modules, estimated here as transformers' LlamaForCausalLM with the same shapes")


_COMPILED_LOSS = (
    "torchtune compiles its loss's per-chunk upcast and cross-entropy (training/_compile.py, compile_loss); "
    "compiled, a chunk saves its bf16 logits and two (N, 1) fp32 vectors for backward, eager saves the fp32 "
    "log-probabilities (both read with saved_tensors_hooks on the CPU, 2026-11-24), and autofit runs a compiled "
    "plain function eagerly (docs/fine-tuning.md): 8 chunks x 2 x 512 x 128256 x 4 B = 3.91 GiB autofit holds at "
    "the loss that the published run does not"
)


def _llama_3b(dtype: torch.dtype = torch.bfloat16):
    import transformers

    # meta-llama/Llama-3.2-3B config.json: hidden 3072, 28 layers, 24 heads, 8 kv heads, intermediate 8192,
    # vocab 128256, tied embeddings, rope theta 500000
    config = transformers.LlamaConfig(vocab_size=128256, hidden_size=3072, intermediate_size=8192,
                                      num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                                      max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
                                      rms_norm_eps=1e-5, attn_implementation="sdpa")
    return _meta(lambda: transformers.LlamaForCausalLM(config).to(dtype))


def _chunked_output_loss(output, target):
    """torchtune's CEWithChunkedOutputLoss (torchtune/modules/loss/ce_chunked_output_loss.py), num_output_chunks 8:
    the bf16 logits in 8 chunks along the sequence, each upcast to fp32 on its own, summed cross-entropy over the
    tokens that are not -100, divided by their count. The model here returns the whole logits (torchtune's returns
    the list of chunks: the same bytes)."""
    logits = output.logits if hasattr(output, "logits") else output
    labels = torch.nn.functional.pad(target, (0, 1), value=-100)[..., 1:]
    total = 0
    for chunk, lab in zip(logits.chunk(8, dim=1), labels.chunk(8, dim=1)):
        total = total + F.cross_entropy(chunk.float().reshape(-1, chunk.shape[-1]), lab.reshape(-1),
                                        ignore_index=-100, reduction="sum")
    return total / labels.ne(-100).sum()


def _torchtune(*, checkpoint: bool = True, in_backward: bool = False, lora: bool = False) -> Callable[[], Built]:
    def build() -> Built:
        model = _llama_3b()
        if lora:  # recipes/configs/llama3_2/3B_lora_single_device.yaml at 1814feb1: r 64, alpha 128, q, v and
            # output projections, and the MLP
            from peft import LoraConfig, get_peft_model

            # torchtune builds the model, adapters included, under torch.set_default_dtype(bf16)
            # (lora_finetune_single_device.py, _setup_model): bf16 adapters. peft upcasts bf16 adapters to fp32
            # unless told not to (get_peft_model's autocast_adapter_dtype).
            model = get_peft_model(model, LoraConfig(r=64, lora_alpha=128, target_modules=[
                "q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]), autocast_adapter_dtype=False)
        ids = torch.zeros(2, 4096, dtype=torch.long)
        layers = tuple(f"{'base_model.model.' if lora else ''}model.layers.{i}" for i in range(28))
        return model, {"input_ids": ids}, {
            "target": ids, "loss_fn": _chunked_output_loss,
            "step": autofit.Step(micro_batch_size=2,
                                 checkpoint=layers if checkpoint else (), optimizer_in_backward=in_backward),
            # the rows override 3B_full_single_device.yaml's PagedAdamW8bit with torch.optim.AdamW (lr 2e-5, torch's
            # choice of implementation: foreach on CUDA); 3B_lora_single_device.yaml has AdamW(fused=True, lr 3e-4,
            # weight_decay 0.01)
            "optimizer": (lambda params: torch.optim.AdamW(params, lr=3e-4, weight_decay=0.01, fused=True)) if lora
            else (lambda params: torch.optim.AdamW(params, lr=2e-5)),
        }

    return build

CASES: tuple[Case, ...] = (
    Case(name="optimum-gpt2", source=_OPTIMUM, gpu="A100-80GB", measures="allocated",
         ran="openai-community/gpt2 causal LM, HF Trainer defaults (torch AdamW, fp32, max_grad_norm 1.0), "
             "batch 2 x 16 tokens",
         published_bytes=2_506_740_000, unit="MB", uncertainty_bytes=26_000_000,
         uncertainty="MB = 10^6 (trackers/memory.py); GPU not stated: the cuBLAS workspace is 8.1 MiB before "
                     "sm90 and 32 MiB on sm90 (±1 %)",
         build=_optimum_gpt2),
    Case(name="optimum-bert-mlm", source=_OPTIMUM, gpu="A100-80GB", measures="allocated",
         ran="google-bert/bert-base-uncased masked LM, HF Trainer defaults (torch AdamW, fp32, max_grad_norm "
             "1.0), batch 2 x 16 tokens",
         published_bytes=2_195_350_000, unit="MB", uncertainty_bytes=26_000_000,
         uncertainty="as optimum-gpt2 (±1 % for the GPU's cuBLAS workspace)",
         build=_optimum_bert),
    Case(name="tutorial-vit_l_16-adam", gpu="A100-80GB", measures="allocated",
         source="pytorch/tutorials intermediate_source/optimizer_step_in_backward_tutorial.py ('How to save memory "
                "by fusing the optimizer step into the backward pass'), first memory snapshot",
         ran="torchvision vit_l_16, batch 1 of 224x224, torch.optim.Adam (foreach), loss logits.sum(), fp32",
         published_bytes=6_000_000_000, unit="MB", uncertainty_bytes=300_000_000,
         uncertainty="'~6GB' read off the CUDA memory visualizer: ±0.3 GB; it is 1.2 weights + 1.2 grads + "
                     "2.4 Adam state + 1.2 foreach intermediates (5 x 304.3M x 4 B = 6.09 GB)",
         build=_vit_tutorial),
    Case(name="fabric-vit_l_16-fp32-b64", source=_FABRIC, gpu="A100-80GB", measures="reserved",
         ran="torchvision vit_l_16 (10 classes), batch 64 of 224x224, Adam, fp32, Fabric, zero_grad after forward",
         published_bytes=26_840_000_000, unit="MB", uncertainty_bytes=268_000_000, uncertainty=_FABRIC_UNC,
         build=_fabric_vit(64, "fp32")),
    Case(name="fabric-vit_l_16-16-mixed-b64", source=_FABRIC, gpu="A100-80GB", measures="reserved",
         ran="as fabric-vit_l_16-fp32-b64 with precision='16-mixed' (autocast fp16, GradScaler)",
         published_bytes=18_210_000_000, unit="MB", uncertainty_bytes=182_000_000, uncertainty=_FABRIC_UNC,
         build=_fabric_vit(64, "fp16"),
         why="not explained (2026-11-28): counted in the loop's order (the last step's gradients through the forward, and the allocator as the previous backward left it: Note [the next step's allocator]) the row rose from -11.9 % to -5.3 %; the rest is not found (issue 61)"),
    Case(name="fabric-vit_l_16-bf16-true-b64", source=_FABRIC, gpu="A100-80GB", measures="reserved",
         ran="as fabric-vit_l_16-fp32-b64 with precision='bf16-true' (parameters, gradients, Adam state in bf16)",
         published_bytes=13_820_000_000, unit="MB", uncertainty_bytes=138_000_000, uncertainty=_FABRIC_UNC,
         build=_fabric_vit(64, "bf16-true"),
         why="not explained (2026-11-28): counted in the loop's order (the last step's gradients through the forward, and the allocator as the previous backward left it: Note [the next step's allocator]) the row rose from -11.4 % to -6.1 %; the rest is not found (issue 61)"),
    Case(name="fabric-vit_l_16-bf16-true-b16", source=_FABRIC, gpu="A100-80GB", measures="reserved",
         ran="as fabric-vit_l_16-bf16-true-b64 at batch 16",
         published_bytes=5_690_000_000, unit="MB", uncertainty_bytes=57_000_000, uncertainty=_FABRIC_UNC,
         build=_fabric_vit(16, "bf16-true"),
         why="not explained (2026-11-28): counted in the loop's order (the last step's gradients through the forward, and the allocator as the previous backward left it: Note [the next step's allocator]) the row rose from -18.5 % to -6.6 %; the rest is not found (issue 61)"),
    Case(name="hf-anatomy-bert-large-b4", source=_ANATOMY, gpu="V100-16GB", measures="nvidia-smi",
         ran="bert-large-uncased seq. classification, batch 4 x 512, fp32, AdamW (transformers'), max_grad_norm 1.0",
         published_bytes=14949 * 2**20, unit="MiB", uncertainty_bytes=300 * 2**20, uncertainty=_ANATOMY_UNC,
         build=_anatomy(4), context_mib=1343),
    Case(name="hf-anatomy-bert-large-b1xga4", source=_ANATOMY, gpu="V100-16GB", measures="nvidia-smi",
         ran="as hf-anatomy-bert-large-b4 with per_device_train_batch_size 1, gradient_accumulation_steps 4",
         published_bytes=8681 * 2**20, unit="MiB", uncertainty_bytes=175 * 2**20, uncertainty=_ANATOMY_UNC,
         build=_anatomy(1, 4), context_mib=1343),
    Case(name="hf-anatomy-bert-large-b4-fp16", source=_ANATOMY, gpu="V100-16GB", measures="nvidia-smi",
         ran="as hf-anatomy-bert-large-b4 with fp16=True (torch.cuda.amp autocast + GradScaler)",
         published_bytes=13939 * 2**20, unit="MiB", uncertainty_bytes=280 * 2**20, uncertainty=_ANATOMY_UNC,
         build=_anatomy(4, precision="fp16"), context_mib=1343),
    Case(name="hf-anatomy-bert-large-b1xga4-gc-fp16", source=_ANATOMY, gpu="V100-16GB", measures="nvidia-smi",
         ran="as hf-anatomy-bert-large-b4 with batch 1 x accumulation 4, gradient_checkpointing (every BertLayer), "
             "fp16=True",
         published_bytes=7275 * 2**20, unit="MiB", uncertainty_bytes=145 * 2**20, uncertainty=_ANATOMY_UNC,
         build=_anatomy(1, 4, "fp16", checkpoint=True), context_mib=1343),
    Case(name="hf-anatomy-bert-large-b1xga4-gc", source=_ANATOMY, gpu="V100-16GB", measures="nvidia-smi",
         ran="as hf-anatomy-bert-large-b4 with batch 1 x accumulation 4 and gradient_checkpointing, fp32",
         published_bytes=6775 * 2**20, unit="MiB", uncertainty_bytes=135 * 2**20, uncertainty=_ANATOMY_UNC,
         build=_anatomy(1, 4, checkpoint=True), context_mib=1343),
    Case(name="hf-anatomy-bert-large-b4-adafactor", source=_ANATOMY, gpu="V100-16GB", measures="nvidia-smi",
         ran="as hf-anatomy-bert-large-b4 with optim='adafactor' (transformers.Adafactor), fp32",
         published_bytes=12295 * 2**20, unit="MiB", uncertainty_bytes=245 * 2**20, uncertainty=_ANATOMY_UNC,
         build=_anatomy(4, optimizer=_adafactor), context_mib=1343),
    Case(name="hf-anatomy-bert-large-b1xga4-gc-fp16-adafactor", source=_ANATOMY, gpu="V100-16GB",
         measures="nvidia-smi",
         ran="as hf-anatomy-bert-large-b4 with batch 1 x accumulation 4, gradient_checkpointing, fp16=True and "
             "optim='adafactor'",
         published_bytes=4847 * 2**20, unit="MiB", uncertainty_bytes=100 * 2**20, uncertainty=_ANATOMY_UNC,
         build=_anatomy(1, 4, "fp16", checkpoint=True, optimizer=_adafactor), context_mib=1343),
    Case(name="anatomy-rerun-bert-large-b4", source=_RERUN + "; 1.baseline.ipynb: 12852 MB after trainer.train()",
         gpu="RTX-3090", measures="nvidia-smi",
         ran="bert-large-uncased seq. classification (dropout 0.1), batch 4 x 512, fp32, Trainer defaults of 2023 "
             "(transformers.AdamW, max_grad_norm 1.0), torch 2.0.1",
         published_bytes=12852 * 2**20, unit="MiB", uncertainty_bytes=257 * 2**20, uncertainty=_RERUN_UNC,
         build=_anatomy_rerun(), context_mib=1276),
    Case(name="anatomy-rerun-bert-large-b4-fp16",
         source=_RERUN + "; 4.mixed-precision-training.ipynb, first training cell: 11224 MB",
         gpu="RTX-3090", measures="nvidia-smi",
         ran="as anatomy-rerun-bert-large-b4 with fp16=True (torch.cuda.amp autocast + GradScaler)",
         published_bytes=11224 * 2**20, unit="MiB", uncertainty_bytes=224 * 2**20, uncertainty=_RERUN_UNC,
         build=_anatomy_rerun(precision="fp16"), context_mib=1276),
    Case(name="anatomy-rerun-bert-large-b1xga4",
         source=_RERUN + "; 2.gradient-accumulation.ipynb, first training cell: 8590 MB",
         gpu="RTX-3090", measures="nvidia-smi",
         ran="as anatomy-rerun-bert-large-b4 with batch 1 x accumulation 4",
         published_bytes=8590 * 2**20, unit="MiB", uncertainty_bytes=172 * 2**20, uncertainty=_RERUN_UNC,
         build=_anatomy_rerun(1, 4), context_mib=1276),
    Case(name="anatomy-rerun-bert-large-b8xga8",
         source=_RERUN + "; 2.gradient-accumulation.ipynb, second training cell (a fresh kernel: execution "
                         "count 6 again): 20314 MB",
         gpu="RTX-3090", measures="nvidia-smi",
         ran="as anatomy-rerun-bert-large-b4 with batch 8 x accumulation 8",
         published_bytes=20314 * 2**20, unit="MiB", uncertainty_bytes=406 * 2**20, uncertainty=_RERUN_UNC,
         build=_anatomy_rerun(8, 8), context_mib=1276),
    Case(name="anatomy-rerun-bert-large-b8xga8-gc",
         source=_RERUN + "; 3.gradient-checkpointing.ipynb, second training cell (a fresh kernel): 8030 MB",
         gpu="RTX-3090", measures="nvidia-smi",
         ran="as anatomy-rerun-bert-large-b4 with batch 8 x accumulation 8 and gradient_checkpointing (every "
             "BertLayer)",
         published_bytes=8030 * 2**20, unit="MiB", uncertainty_bytes=161 * 2**20, uncertainty=_RERUN_UNC,
         why=_RERUN_LAZY_WHY.format(need=155),
         build=_anatomy_rerun(8, 8, checkpoint=True), context_mib=1276),
    Case(name="anatomy-rerun-bert-large-b1xga4-gc-fp16",
         source=_RERUN + "; 4.mixed-precision-training.ipynb, second training cell (a fresh kernel): 7574 MB",
         gpu="RTX-3090", measures="nvidia-smi",
         ran="as anatomy-rerun-bert-large-b4 with batch 1 x accumulation 4, gradient_checkpointing and fp16=True",
         published_bytes=7574 * 2**20, unit="MiB", uncertainty_bytes=151 * 2**20, uncertainty=_RERUN_UNC,
         build=_anatomy_rerun(1, 4, "fp16", checkpoint=True), context_mib=1276),
    Case(name="anatomy-rerun-bert-large-b4-adafactor",
         source=_RERUN + "; 5.optimizer.ipynb, first training cell: 10440 MB",
         gpu="RTX-3090", measures="nvidia-smi",
         ran="as anatomy-rerun-bert-large-b4 with optim='adafactor'",
         published_bytes=10440 * 2**20, unit="MiB", uncertainty_bytes=209 * 2**20, uncertainty=_RERUN_UNC,
         build=_anatomy_rerun(optimizer=_adafactor), context_mib=1276),
    Case(name="anatomy-rerun-bert-large-b1xga4-gc-fp16-adafactor",
         source=_RERUN + "; 5.optimizer.ipynb, second training cell (a fresh kernel): 5142 MB",
         gpu="RTX-3090", measures="nvidia-smi",
         ran="as anatomy-rerun-bert-large-b4 with batch 1 x accumulation 4, gradient_checkpointing, fp16=True and "
             "optim='adafactor'",
         published_bytes=5142 * 2**20, unit="MiB", uncertainty_bytes=103 * 2**20, uncertainty=_RERUN_UNC,
         why=_RERUN_LAZY_WHY.format(need=111),
         build=_anatomy_rerun(1, 4, "fp16", checkpoint=True, optimizer=_adafactor), context_mib=1276),
    Case(name="amp-recipe-t4-fp32", source=_AMP, gpu="T4", measures="allocated",
         ran="PyTorch AMP recipe, 'Default precision': 3 x Linear(4096, 4096) with ReLU, batch 512, MSE, SGD, fp32, "
             "3 epochs x 50 batches, data and targets made on the GPU beforehand",
         published_bytes=1_350_681_600, unit="MB", uncertainty_bytes=9_000_000, uncertainty=_AMP_UNC,
         build=_amp_recipe("fp32"), outside_bytes=_AMP_DATA - 2 * 512 * 4096 * 4),
    Case(name="amp-recipe-t4-fp16", source=_AMP, gpu="T4", measures="allocated",
         ran="PyTorch AMP recipe, 'All together': the same with torch.cuda.amp.autocast (fp16) and GradScaler, "
             "a new model made after the fp32 section in the same process",
         published_bytes=1_577_232_384, unit="MB", uncertainty_bytes=9_000_000, uncertainty=_AMP_UNC,
         build=_amp_recipe("fp16"), outside_bytes=_AMP_DATA - 2 * 512 * 4096 * 4,
         why="not a missing term of the step: the recipe is a script, and its globals `output` and `loss` from the "
             "fp32 section keep that section's autograd graph, whose AccumulateGrad nodes hold the old model's "
             "parameters (201.4 MB) and their zeroed gradients (201.4 MB), alive until the first fp16 iteration "
             "reassigns them. By hand, that first forward holds 3 x 201.4 (old weights and gradients, new weights) "
             "+ 838.9 data + 100.7 fp16 weight casts + 25.2 activations + 8.5 cuBLAS workspace = 1,577.4 MB against "
             "1,577.2 MB published; the steady-state step autofit models peaks lower (its figure is right for a "
             "run that does not keep the old graph alive)."),
    Case(name="torchao-vit_h-fused-adamw", source=_TORCHAO, gpu="RTX-4090", measures="allocated",
         ran="timm ViT-H/14, 45 classes, batch 8 x 224x224, BF16 autocast, torch.optim.AdamW(fused=True), compiled",
         published_bytes=12_230_000_000, unit="MB", uncertainty_bytes=5_000_000, uncertainty=_TORCHAO_UNC,
         build=_torchao_vit(_fused_adamw)),
    Case(name="torchao-vit_h-fused-adamw-compiled", source=_TORCHAO, gpu="RTX-4090", measures="allocated",
         ran="as torchao-vit_h-fused-adamw, estimated as compiled (compile=True), as the run was",
         published_bytes=12_230_000_000, unit="MB", uncertainty_bytes=5_000_000, uncertainty=_TORCHAO_UNC,
         build=_compiled(_torchao_vit(_fused_adamw)),
         why="above by construction: on a CUDA target a compiled step is estimated as the larger of inductor's CPU "
             "lowering and the eager step, an upper bound (Note [compiled models on a GPU target]); here the CPU "
             "lowering, 12,711 MB with its peak in forward, against 12,202 MB eager (-0.2 %). The term is what "
             "inductor's CPU lowering holds at the forward peak beyond its CUDA lowering (its CPU decompositions, "
             "partitioner choices and C++ kernels' fusions), 481 MB above the published compiled run, which only a GPU "
             "run can split further (about 3 min to simulate on two busy cores)"),
    Case(name="torchao-vit_h-bnb-adamw8bit", source=_TORCHAO, gpu="RTX-4090", measures="allocated",
         ran="as torchao-vit_h-fused-adamw with bitsandbytes.optim.AdamW8bit",
         published_bytes=8_320_000_000, unit="MB", uncertainty_bytes=5_000_000, uncertainty=_TORCHAO_UNC,
         build=_torchao_vit(_bnb_adamw8bit)),
    Case(name="torchtune-3b-activation-checkpointing", source=_TORCHTUNE, gpu="A100-80GB", measures="allocated",
         ran="Llama 3.2 3B, bf16, batch 2 x 4096, compiled, CEWithChunkedOutputLoss (8 chunks), every layer "
             "checkpointed, torch.optim.AdamW",
         published_bytes=round(24.9 * 2**30), unit="MiB", uncertainty_bytes=round(0.05 * 2**30),
         uncertainty=_TORCHTUNE_UNC, build=_torchtune(),
         why="partly explained (2026-11-24): autofit's peak is the optimizer step, where torch's foreach "
             "AdamW adds one bf16 copy of the state (5.98 GiB) to 6.0 parameters + 6.0 gradients + 12.0 "
             "state; the published 24.9 GiB leaves no room for it. With AdamW(fused=True) autofit gives "
             "25.83 GiB (+3.7 %), its peak then at the loss in forward, which the compiled loss lowers (see "
             "torchtune-3b-lora); which AdamW implementation the row ran is not published"),
    Case(name="torchtune-3b-optimizer-in-backward", source=_TORCHTUNE, gpu="A100-80GB", measures="allocated",
         ran="as torchtune-3b-activation-checkpointing with the optimizer step fused into backward",
         published_bytes=round(23.1 * 2**30), unit="MiB", uncertainty_bytes=round(0.05 * 2**30),
         uncertainty=_TORCHTUNE_UNC, build=_torchtune(in_backward=True),
         why="mostly explained (2026-11-24): the peak is in forward, at the loss; " + _COMPILED_LOSS + "; "
             "without them 26,454 - 4,004 MiB = 22,450 MiB, -5.1 %: the rest is not explained"),
    Case(name="torchtune-3b-lora", source=_TORCHTUNE, gpu="A100-80GB", measures="allocated",
         ran="Llama 3.2 3B LoRA (r 64, alpha 128 on q, v, output projections and the MLP), bf16, batch 2 x 4096, "
             "compiled, "
             "chunked loss, every layer checkpointed, AdamW(fused=True); the table's activation offloading left out",
         published_bytes=round(8.5 * 2**30), unit="MiB", uncertainty_bytes=round(0.05 * 2**30),
         uncertainty=_TORCHTUNE_UNC + "; this row also offloads the checkpointed layers' inputs to the host "
                     "(about 28 x 2 x 4096 x 3072 x 2 B = 1.4 GB on the device otherwise)",
         build=_torchtune(lora=True),
         why="mostly explained (2026-11-24): the peak is in forward, at the loss; " + _COMPILED_LOSS + "; "
             "and the row offloads the checkpointed layers' inputs (28 x 2 x 4096 x 3072 x 2 B = 1.31 GiB). "
             "Without both: 14.27 - 3.91 - 1.31 = 9.05 GiB, +6.5 %: the rest is not explained"),
)
