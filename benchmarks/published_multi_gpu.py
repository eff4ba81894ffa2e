"""Published per-GPU memory figures of multi-GPU runs (FSDP2), for ``published.py``: each case is one rank of the
job, estimated with ``autofit.estimate(..., layout=autofit.Layout(world_size=N, strategy="fsdp2"))`` (the same
``Case`` fields as ``published_cases.py``; ``ranks`` is the job's world size).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

import autofit
from benchmarks.published_cases import Built, Case, _meta

__all__ = ["MULTI_GPU_CASES"]


# --- torchtitan's Llama 3.1 8B on 8 H100s, FSDP2 (multi-GPU: one rank's figure) ------------------------------------

def _titan(table: int, gpus: int) -> str:
    return (f"pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table {table}, row 'FSDP' "
            "(https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md; torchtitan "
            f"9dec370, torch 1963fc8, 2024-12): Llama 3.1 8B, {gpus} H100s (96 GB HBM2e, 8 per Grand Teton host), "
            f"FSDP2 over {gpus}, local batch 2, train_configs/llama3_8b.toml (seq_len 8192, AdamW lr 3e-4 betas "
            "(0.9, 0.95) weight decay 0.1 foreach, max_norm 1.0, selective 'op' activation checkpointing, "
            "mixed_precision_param bfloat16, reduce float32); 'Memory(GiB)' is the trainer's log line, "
            "torch.cuda.memory_stats()['reserved_bytes.all.peak'] / 2^30 (torchtitan/metrics.py and train.py at "
            "9dec370), 'stable across the whole training process'")


_TITAN_UNC = ("GiB with one decimal (±0.05 GiB); a 96 GB H100 is not in the catalog: the 80 GB H100 SXM stands in (the "
              "same sm90 allocator and cuBLAS terms; the capacity changes neither); torchtitan's own Llama modules "
              "(fp32 weights, complex rotary table), rebuilt as transformers' LlamaForCausalLM with the same shapes; "
              "torchtitan leaves its last block unsharded after forward (one block's bf16 weights, 0.4 GiB), autofit "
              "reshards every block: ±1 %")

# torchtitan's _save_list at 9dec370 (torchtitan/parallelisms/parallelize_llama.py); the CPU flash kernel is the one
# the simulation runs in place of the CUDA ones
_TITAN_SAVE = {getattr(torch.ops.aten, n).default for n in (
    "mm", "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "abs", "max") if hasattr(torch.ops.aten, n)}


def _titan_op_policy():
    """torchtitan's selective 'op' policy (``_apply_ac_to_transformer_block``): keep the outputs of the ops in its
    save list, except every second ``mm``. Its counter is new at every checkpointed call (9dec370's
    ``selective_checkpointing_context_fn`` makes a ``defaultdict`` each time), counted apart in forward and
    recomputation: of a layer's 7 ``mm`` it keeps wq, wv, w1, w2. autofit's named policy "op-selective" is the same
    rule (Note [torchtitan's per-op policy]): the fsdp8 row estimates 84,184 MiB reserved either way (2026-11-29)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            counts[mode] += 1
        keep = func in _TITAN_SAVE and not (func == torch.ops.aten.mm.default and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


class _TitanCheckpoint(torch.nn.Module):
    """A transformer block recomputed as torchtitan's ``ptd_checkpoint_wrapper`` with the op policy does
    (non-reentrant checkpoint, ``preserve_rng_state=False``)."""

    def __init__(self, block: torch.nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.block, *args, use_reentrant=False, preserve_rng_state=False,
                          context_fn=_titan_op_policy, **kwargs)


def _titan_loss(output, labels):
    """torchtitan's loss_fn (train.py at 9dec370): cross-entropy of the logits upcast to fp32, over every token."""
    return F.cross_entropy(output.logits.flatten(0, 1).float(), labels.flatten(0, 1))


def _titan_8b(layers: int = 32, seq: int = 8192, world_size: int = 8) -> Callable[[], Built]:
    def build() -> Built:
        import transformers

        # torchtitan llama3_configs["8B"]: dim 4096, 32 layers, 32 heads, 8 kv heads, ffn_dim_multiplier 1.3 with
        # multiple_of 1024 (hidden 14336), rope theta 500000, vocab 128256 (its tokenizer), untied output
        config = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                          num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                          max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                                          tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
        model = _meta(lambda: transformers.LlamaForCausalLM(config))  # fp32 weights, as torchtitan builds them
        blocks = model.model.layers
        for i in range(len(blocks)):
            blocks[i] = _TitanCheckpoint(blocks[i])
        ids = torch.zeros(2, seq, dtype=torch.long)
        return model, {"input_ids": ids}, {
            "step": 2, "target": ids, "loss_fn": _titan_loss, "precision": "bf16",
            "clip_grad_norm": 1.0, "layout": autofit.Layout(world_size=world_size, strategy="fsdp2"),
            "optimizer": lambda params: torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                                          foreach=True)}

    return build


# --- torchao's mxfp8 table: Llama 3 8B on 8 B200s, torchtitan's recipe (per-op SAC, expandable segments) ----------

_AO_MX = ("pytorch/ao torchao/prototype/mx_formats/README.md, 'Training e2e benchmarks on NVIDIA B200', row "
          "'Llama3-8b | none (bfloat16)' (https://github.com/pytorch/ao/blob/main/torchao/prototype/mx_formats/"
          "README.md, added by pytorch/ao#2777, 2025-08-15): 8 power-limited B200s, local batch 1, seq_len 8192, "
          "100 steps, torch.compile, FSDP2, per-op SAC; torch 2.9.0.dev20250815+cu128, torchao 0.13.0+gite4e681be6, "
          "torchtitan 6fc499f6 (run_train.sh: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; "
          "train_configs/llama3_8b.toml: selective 'op', AdamW lr 3e-4 betas (0.9, 0.95) weight decay 0.1 eps 1e-8 "
          "fused, max_norm 1.0, mixed_precision_param bfloat16, reduce float32). 'Peak Memory (GB)' 33.71 is the "
          "largest 'memory: ...GiB' of torchtitan's log (benchmarks/float8/training/parse_torchtitan_logs.py), "
          "torch.cuda.memory_stats()['reserved_bytes.all.peak'] / 2^30")

_AO_MX_UNC = ("GiB with two decimals; the run compiled each block (torch.compile), which autofit estimates eager "
              "(inductor fuses the pointwise ops the policy recomputes, so eager holds at least as much); "
              "torchtitan's own Llama modules rebuilt as transformers' LlamaForCausalLM; torchtitan leaves its last "
              "block unsharded after forward (0.4 GiB): ±2 %")


def _titan_8b_op_sac(layers: int = 32, seq: int = 8192, world_size: int = 8, float8=None) -> Callable[[], Built]:
    """Llama 3 8B as torchtitan 6fc499f trains it: each block recomputed by its per-op policy, autofit's
    "op-selective" (Note [torchtitan's per-op policy], autofit/training/recompute.py); ``float8``: its linears
    converted (``autofit.features.float8.Float8``; torchtitan's filter skips the output head)."""
    def build() -> Built:
        import transformers

        config = transformers.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                          num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=8,
                                          max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
                                          tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
        model = _meta(lambda: transformers.LlamaForCausalLM(config))  # fp32 weights, as torchtitan builds them
        ids = torch.zeros(1, seq, dtype=torch.long)
        return model, {"input_ids": ids}, {
            "target": ids, "loss_fn": _titan_loss, "precision": "bf16",
            "clip_grad_norm": 1.0, "layout": autofit.Layout(world_size=world_size, strategy="fsdp2"),
            "step": autofit.Step(micro_batch_size=1, float8=float8,
                                 checkpoint={f"model.layers.{i}": "op-selective" for i in range(layers)}),
            "optimizer": lambda params: torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                                          eps=1e-8, fused=True)}

    return build


# --- torchao's float8 table: Llama 3 8B on 8 H100s, bf16 and two float8 recipes (issue 58) --------------------------

def _ao_float8(row: str) -> str:
    return ("pytorch/ao docs/source/workflows/training.md, 'e2e training benchmarks', 'NVIDIA H100', row "
            f"'Llama3-8b | {row}' (first published in torchao/float8/README.md by pytorch/ao#1793, 8c81863, "
            "2025-03-12): 8 H100s, local batch 1, seq_len 8192, 100 steps, torch.compile, FSDP2, per-op SAC; torch "
            "2.7.0a0+gitb98af95, torchao 0.10.0+git890e0ac8, torchtitan 0.0.2, launched by torchao's "
            "benchmarks/float8/training/float8_training_benchmark.sh (--training.compile; tensorwise adds "
            "enable_fsdp_float8_all_gather, precompute_float8_dynamic_scale_for_fsdp, "
            "force_recompute_fp8_weight_in_bwd) through torchtitan's run_train.sh "
            "(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; llama3_8b.toml at 54ef422: selective 'op', AdamW lr "
            "3e-4 eps 1e-8 fused, max_norm 1.0, bf16 parameters, fp32 reduce, loss not compiled). 'Peak Memory (GB)' "
            "is parse_torchtitan_logs.py's largest 'memory: ...GiB', torch.cuda.memory_stats()"
            "['reserved_bytes.all.peak'] / 2^30")


_AO_F8_UNC = ("GiB with two decimals; torchao 0.10's Float8Linear (890e0ac8) casts a tensorwise weight before its "
              "matmul function and saves the high-precision input and that float8 weight "
              "(matmul_with_hp_or_float8_args), where the installed 0.18 saves the high-precision weight and casts "
              "it again in backward; rowwise saves the high-precision input and weight in both. Inside a block the "
              "per-op policy recomputes, neither is kept past the block; torchtitan's own Llama modules rebuilt as "
              "transformers' LlamaForCausalLM; its last block left unsharded after forward (0.4 GiB): ±2 %")

_AO_F8_WHY = ("the run compiled every block (torch 2.7.0a0), which autofit estimates eager (compile=True on a GPU "
              "target is the larger of inductor's CPU lowering and eager: the eager step); each stream keeps the "
              "pages it mapped (FSDP2's all-gather stream 2.4 GiB, its reduce-scatter stream the 3.7 GiB of "
              "gradient shards: Note [expandable segments]); the float8 deltas against the bf16 twin are -0.21 and "
              "+0.10 GiB (published +0.12 and +0.14)")


def _float8_case(recipe: str, row: str, published_gib: float) -> Case:
    from autofit.features.float8 import Float8

    float8 = None if recipe == "bf16" else Float8(recipe=recipe, all_gather=recipe == "tensorwise")
    return Case(
        name=f"torchao-float8-llama3-8b-h100-fsdp8-{recipe}", source=_ao_float8(row), gpu="H100-80GB",
        measures="reserved",
        ran=(f"Llama 3 8B, FSDP2 over 8 H100s, batch 1 x 8192 per GPU, {row}, torchtitan's per-op selective "
             "recomputation of every block, AdamW (fused), clipping at 1.0, expandable segments"),
        published_bytes=round(published_gib * 2**30), unit="MiB", uncertainty_bytes=round(0.02 * published_gib * 2**30),
        uncertainty=_AO_F8_UNC, build=_titan_8b_op_sac(float8=float8), ranks=8, expandable_segments=True,
        why=_AO_F8_WHY)


MULTI_GPU_CASES: tuple[Case, ...] = (
    Case(name="torchtitan-llama3.1-8b-fsdp8", source=_titan(1, 8), gpu="H100-80GB", measures="reserved",
         ran="Llama 3.1 8B, FSDP2 over 8 GPUs (ZeRO-3, bf16 parameters, fp32 reduce), batch 2 x 8192 per GPU, "
             "torchtitan's selective op recomputation of every block, AdamW (foreach), clipping at 1.0, eager",
         published_bytes=round(82.4 * 2**30), unit="MiB", uncertainty_bytes=round(0.8 * 2**30),
         uncertainty=_TITAN_UNC, build=_titan_8b(), ranks=8),
    Case(name="torchtitan-llama3.1-8b-fsdp128", source=_titan(3, 128), gpu="H100-80GB",
         measures="reserved",
         ran="as torchtitan-llama3.1-8b-fsdp8 over 128 GPUs (16 hosts), FSDP2 over 128",
         published_bytes=round(67.0 * 2**30), unit="MiB", uncertainty_bytes=round(0.7 * 2**30),
         uncertainty=_TITAN_UNC, build=_titan_8b(world_size=128), ranks=128),
    Case(name="torchao-mx-llama3-8b-b200-fsdp8-bf16", source=_AO_MX, gpu="B200", measures="reserved",
         ran="Llama 3 8B, FSDP2 over 8 B200s, batch 1 x 8192 per GPU, bf16 mixed precision, torchtitan's per-op "
             "selective recomputation of every block, AdamW (fused), clipping at 1.0, expandable segments",
         published_bytes=round(33.71 * 2**30), unit="MiB", uncertainty_bytes=round(0.7 * 2**30),
         uncertainty=_AO_MX_UNC, build=_titan_8b_op_sac(), ranks=8, expandable_segments=True,
         why="the published run compiled every block and the loss (torchtitan 6fc499f: build_cross_entropy_loss "
             "wraps it in torch.compile), which fuses away the fp32 upcast of the logits that eager cross-entropy "
             "saves (8192 x 128256 x 4 B = 3.9 GiB, and as much again in its backward); autofit estimates the eager "
             "step, and compile=True on a GPU target is an upper bound only (Note [compiled models on a GPU "
             "target]). torchtitan 6fc499f also shards tok_embeddings and [norm, output] as FSDP units of their own, "
             "where autofit's layout has one root unit. Without the loss's 7.8 GiB, autofit's op-selective step "
             "is 41.6 GiB and its full recomputation 28.0: the published 33.7 keeps 5.7 GiB more than full "
             "recomputation where the eager per-op policy keeps 13.6, so the compiled policy of that torch 2.9 "
             "nightly kept less, which the H100 float8 rows (torch 2.7, loss not compiled) do not show"),
    _float8_case("bf16", "none (bfloat16)", 47.65),
    _float8_case("tensorwise", "tensorwise with float8 all-gather", 47.77),
    _float8_case("rowwise", "rowwise with bfloat16 all-gather", 47.79),
)
