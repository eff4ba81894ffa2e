"""Note [a large term and its knob] (autofit/solve/terms.py): a category of the peak over a fifth of it is named in
the estimate's and the plan's notes with the knobs that lower it. Truths: byte counts by hand (4 B per fp32 value,
AdamW's two moments per parameter) and the share they make of the estimate's own peak."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autofit

pytestmark = pytest.mark.sim

WIDTH, DEPTH = 1024, 4
PARAMETERS = DEPTH * (WIDTH * WIDTH + WIDTH)  # 4,198,400


def _notes(notes, category: str) -> list[str]:
    return [n for n in notes if n.startswith(f"{category}: ") and "Note [a large term and its knob]" in n]


def test_an_estimate_names_each_category_over_a_fifth_with_its_knobs() -> None:
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)])
    est = autofit.estimate(model, torch.randn(8, WIDTH), step=8, loss_fn=lambda out: out.square().mean())
    # AdamW: two fp32 moments per parameter (+ one 4-byte step counter per parameter tensor, 8 of them)
    moments = 2 * 4 * PARAMETERS
    assert est.breakdown["optimizer_state"] == moments + 8 * 4
    assert moments > 0.2 * est.device_bytes  # by hand: 33.6 MB of a peak under 80 MB
    (note,) = _notes(est.notes, "optimizer_state")
    share = 100 * (moments + 32) / est.device_bytes
    assert note.startswith(f"optimizer_state: 32.03 MiB, {share:.0f} % of the peak: adamw's state, 2 values")
    assert "--offload-states" in note and "--strategy fsdp2" not in note  # on the CPU, no GPU knob
    # on a GPU the CUDA context (hundreds of MiB) joins the peak: four 4096-wide layers, 2 x 4 x 67,125,248 B of
    # moments (537 MB), are over a fifth of it, and the GPU knobs are named
    wide = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(DEPTH)])
    on_gpu = autofit.estimate(wide, torch.randn(8, 4096), step=8, device=autofit.Device(gpu="A100-80GB"),
                              loss_fn=lambda out: out.square().mean())
    (note,) = _notes(on_gpu.notes, "optimizer_state")
    assert on_gpu.breakdown["optimizer_state"] >= 2 * 4 * DEPTH * (4096 * 4096 + 4096)
    assert "--strategy fsdp2 --world-size N" in note
    (note,) = _notes(est.notes, "parameters")  # 4 B each: 16.8 MB, over a fifth
    assert note.startswith("parameters: 16.02 MiB,") and "--min-stored-precision" in note
    assert not _notes(est.notes, "inputs")  # 8 x 1024 x 4 B: far under a fifth
    # an estimate names the knobs the user holds: recomputation and the micro-batch are among them
    big = autofit.estimate(nn.Sequential(nn.Linear(64, 4096), nn.GELU(), nn.Linear(4096, 64)), torch.randn(512, 64),
                           step=512, loss_fn=lambda out: out.square().mean())
    (note,) = _notes(big.notes, "activations")
    assert "at micro-batch 512, nothing recomputed" in note and "--checkpoint" in note and "-m)" in note


def test_a_plan_names_its_large_terms_only_where_it_gave_something_up_for_memory() -> None:
    model = nn.Sequential(nn.Linear(64, 4096), nn.GELU(), nn.Linear(4096, 64))
    roomy = autofit.plan(model, torch.randn(512, 64), budget="1GB", batch_size=512, device="cpu",
                         loss_fn=lambda out: out.square().mean())
    assert roomy.micro_batch_size == 512 and not roomy.checkpoint  # nothing given up: no knob to name
    assert not [n for n in roomy.notes if "Note [a large term and its knob]" in n]
    # by hand: the hidden layer's output and GELU's, 512 x 4096 x 4 B = 8 MiB each, saved for backward at micro-batch
    # 512; a budget of 20 MB leaves no room for them whole
    tight = autofit.plan(model, torch.randn(512, 64), budget="20MB", batch_size=512, device="cpu",
                         loss_fn=lambda out: out.square().mean())
    assert tight.micro_batch_size < 512 or tight.checkpoint
    large = [n for n in tight.notes if "Note [a large term and its knob]" in n]
    assert large, tight.notes
    for note in large:
        assert "beyond the micro-batch and recomputation the search chose" in note
        assert "--checkpoint" not in note and "-m)" not in note and "--nodes" not in note  # the search's, or GPU's
