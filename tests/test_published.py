"""autofit's CUDA estimate against GPU figures others measured and published (benchmarks/published_cases.py).

Only a fast case of each kind runs here (tests/test_published_cuda.py holds issue 9's three);
``benchmarks/published.py`` runs them all. The truth is the published figure (``torch.cuda.max_memory_allocated()``
or nvidia-smi), never autofit's own output.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.published import CASES, run_case

_BY_NAME = {case.name: case for case in CASES}


@pytest.mark.sim
@pytest.mark.parametrize("name, tolerance", [
    # exact bytes on a T4: 3 x Linear(4096, 4096), batch 512, fp32, SGD, gradients kept allocated (torch 1.11)
    ("amp-recipe-t4-fp32", 0.005),
    # nvidia-smi on a V100 (HF docs): bert-large, batch 1 x accumulation 4, the context the page measured (1343 MiB)
    ("hf-anatomy-bert-large-b1xga4", 0.05),
    # the same at batch 4 x 512 in fp16: dropout on CUDA keeps a 1-byte mask, and torch < 1.11's softmax kept its
    # input for backward (24 x 64 MiB of fp32 scores, issue 41); -12.5 % with the first and without the second
    ("hf-anatomy-bert-large-b4-fp16", 0.05),
    # the same notebook rerun on torch 2.0.1 (2 x RTX 3090): softmax saves only its output there, and the row lands
    # within the goal without that term (+9.5 % with it)
    ("anatomy-rerun-bert-large-b4", 0.05),
    # torchao's optimizer README: timm ViT-H, BF16 AMP, bitsandbytes AdamW8bit, max_memory_allocated (issue 24)
    pytest.param("torchao-vit_h-bnb-adamw8bit", 0.03, marks=pytest.mark.skipif(
        __import__("importlib").util.find_spec("bitsandbytes") is None, reason="needs bitsandbytes")),
])
def test_estimate_matches_published(name, tolerance):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = run_case(_BY_NAME[name])
    assert abs(row.error) <= tolerance, (
        f"{name}: autofit {row.autofit_bytes:,} vs published {row.case.published_bytes:,}")


def test_every_case_outside_the_goal_says_why():
    # a case may stay outside the 3 % / 5 % goal only with a sentence that explains it (issue 9's must-show)
    fp16 = _BY_NAME["amp-recipe-t4-fp16"]
    assert fp16.why and "AccumulateGrad" in fp16.why
    # the rerun rows outside the goal name the context's lazily loaded modules (issue 41)
    for name in ("anatomy-rerun-bert-large-b8xga8-gc", "anatomy-rerun-bert-large-b1xga4-gc-fp16-adafactor"):
        assert "lazy module loading" in _BY_NAME[name].why, name
    for case in CASES:
        assert case.source and case.uncertainty and case.uncertainty_bytes > 0, case.name


@pytest.mark.slow
@pytest.mark.parametrize("name", ["torchtitan-llama3.1-8b-fsdp8", "torchtitan-llama3.1-8b-fsdp128"])
def test_fsdp2_rank_matches_torchtitan(name):
    # torchtitan's published per-GPU reserved memory for Llama 3.1 8B on 8 and 128 H100s, FSDP2, batch 2 x 8192,
    # selective op recomputation (benchmarks/published_multi_gpu.py): the 5 % goal for reserved figures (about 50 s
    # each). At 8 GPUs it held only once the gradient shards FSDP2 allocates on its reduce-scatter stream were kept in
    # that stream's segments (Note [one pool per stream], autofit/cuda/allocator.py): -7.7 % before, -0.4 % after
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = run_case(_BY_NAME[name])
    assert abs(row.error) <= 0.05, f"autofit {row.autofit_bytes:,} vs published {row.case.published_bytes:,}"


def test_multi_gpu_cases_estimate_one_rank_of_the_published_layout():
    pytest.importorskip("transformers", reason="the published cases are Hugging Face models built from configs")
    # each multi-GPU case estimates the job's own layout (world size and strategy)
    multi = [c for c in CASES if c.ranks > 1]
    assert {c.name for c in multi} >= {"torchtitan-llama3.1-8b-fsdp8", "torchtitan-llama3.1-8b-fsdp128"}
    for case in multi:
        _, _, kwargs = case.build()
        assert kwargs["layout"].world_size == case.ranks and kwargs["layout"].strategy == "fsdp2", case.name


@pytest.mark.slow(seconds=180)
def test_compiled_vit_h_is_bounded_from_above():
    # torchao's ViT-H row ran compiled; on a CUDA target the compiled estimate is the larger of inductor's CPU
    # lowering and eager (Note [compiled models on a GPU target]): above the published figure (the safe side), by
    # 3.9 % (about 3 min on two busy cores: 187 s in a CI run)
    pytest.importorskip("transformers", reason="benchmarks.published imports the Hugging Face cases")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        row = run_case(_BY_NAME["torchao-vit_h-fused-adamw-compiled"])
    assert 0 <= row.error <= 0.05, f"autofit {row.autofit_bytes:,} vs published {row.case.published_bytes:,}"


@pytest.mark.slow(seconds=60)
def test_fabric_rows_count_the_gradients_that_live_through_forward():
    # rasbt/pytorch-memory-optim's Fabric scripts clear the gradients after the forward (issue 61): vit_l_16, batch
    # 64, fp32, Adam, max_memory_reserved. -5.6 % in autofit's default order, -1.1 % in the loop's; the bf16-true row
    # at batch 16 rises from -18.5 % to -6.6 % (outside the goal; its why says so)
    pytest.importorskip("transformers", reason="benchmarks.published imports the Hugging Face cases")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fp32 = run_case(_BY_NAME["fabric-vit_l_16-fp32-b64"])
        bf16 = run_case(_BY_NAME["fabric-vit_l_16-bf16-true-b16"])
    assert abs(fp32.error) <= 0.05, f"autofit {fp32.autofit_bytes:,} vs published {fp32.case.published_bytes:,}"
    assert abs(bf16.error) <= 0.07 and "issue 61" in bf16.case.why, bf16.error
