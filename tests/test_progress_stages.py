"""Issue 56: the stages that can take long (the layout race, the ladder's rungs, the checkpoint MILPs, the
verification) report what they do and how far, and a plan run with stderr piped (a log, slurm, CI) shows them as
lines while it runs. The truth is the process's own stderr, read as a user's log would be; no timing is asserted."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY_GPT2 = ["hf:gpt2", "--config", "n_layer=2", "--config", "n_embd=64", "--config", "n_head=2", "--config",
             "vocab_size=100", "--input-shape", "256", "--batch-size", "32", "--gpu", "A100-80GB", "--world-size", "2"]


@pytest.mark.slow(seconds=60)
def test_a_piped_plan_prints_its_stages_with_how_far_they_are():
    pytest.importorskip("transformers")
    # a budget the whole batch per rank misses (16 rows: 618,659,840 B on the device by `--budget 70GB`, plus the
    # 256 MiB margin the planner keeps free) and the smallest configuration fits (794 MiB by `--budget 600000000`),
    # so the planner races its layouts, climbs, solves checkpoint MILPs and verifies
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-m", "autofit", "plan", *TINY_GPT2, "--budget", "860000000B"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [m.group(1) for m in re.finditer(r"^\s*[\d.]+ s  (.*)$", run.stderr, re.M)]
    assert lines[0].startswith("planning") and lines[-1] == "planning done", run.stderr
    assert any(line.startswith("layout ") and line.endswith("/3]") for line in lines), run.stderr  # ddp, ZeRO-3, -2
    assert any(line.startswith("checkpoint MILP for the micro-batch") and "/" in line for line in lines), run.stderr
    assert any(line.startswith("verifying the fastest configuration") for line in lines), run.stderr
