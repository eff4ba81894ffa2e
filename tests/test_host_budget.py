"""The host budget of the target, not of the planning machine (Note [the host of the target], autofit/validate.py).
Truths: the catalog cards' published hosts (a DGX H100's 2 TB for 8 GPUs, an AWS g4dn.metal's 384 GiB for 8 T4),
this machine's RAM from os.sysconf, and the states' bytes counted by hand."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import autofit
from autofit.device import resolve_device
from autofit.validate import resolve_host_budget

GiB = 2**30
TiB = 2**40
MiB = 2**20


def _ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@pytest.fixture
def no_local_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _local_gpu(monkeypatch, name: str, mib: int, capability: tuple[int, int]) -> None:
    props = SimpleNamespace(name=name, total_memory=mib * MiB, major=capability[0], minor=capability[1])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)


def test_a_gpu_elsewhere_gets_its_platforms_host_share(no_local_gpu):
    # DGX H100 datasheet: 2 TB for 8 GPUs -> one rank 256 GiB, the 8 ranks of a node all 2 TiB
    h100 = resolve_device("cuda", "H100")
    assert not h100.local
    one, note = resolve_host_budget(None, h100, 1)
    assert one == 2 * TiB // 8 == 256 * GiB
    assert "DGX H100" in note and "not this machine's" in note and 'host_budget="' in note
    from autofit.cli.messages import cli_words

    assert '--host-budget "' in cli_words(note) and "host_budget" not in cli_words(note)  # the CLI's words
    assert resolve_host_budget(None, h100, 8)[0] == 2 * TiB
    # AWS g4dn.metal: 384 GiB for 8 T4
    assert resolve_host_budget(None, resolve_device("cuda", "T4"), 4)[0] == 4 * 384 * GiB // 8
    # a consumer card: an assumed workstation, twice the card's 24 GB rounded up to a power of two, said so
    budget, note = resolve_host_budget(None, resolve_device("cuda", "RTX-4090"), 1)
    assert budget == 64 * GiB and "assum" in note


def test_the_user_figure_wins_and_a_percentage_is_refused(no_local_gpu):
    h100 = resolve_device("cuda", "H100")
    assert resolve_host_budget("64GB", h100, 8) == (64 * 10**9, None)
    with pytest.raises(autofit.InvalidInputError, match="host_budget"):
        resolve_host_budget("50%", h100, 1)


def test_this_machines_gpu_gets_this_machines_ram(monkeypatch):
    _local_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", 81_090, (9, 0))
    for gpu in (None, "H100"):  # detected, or named and the same model as the one here
        device = resolve_device("cuda", gpu)
        assert device.local
        budget, note = resolve_host_budget(None, device, 8)
        assert budget == _ram() and "this machine's RAM" in note
    other = resolve_device("cuda", "A100-40GB")  # another model than the one here: planned for elsewhere
    assert not other.local and resolve_host_budget(None, other, 1)[0] == 1 * TiB // 8


def _wide() -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*[nn.Linear(8192, 8192) for _ in range(4)])


def test_states_alone_over_the_host_budget_are_refused_before_any_analysis(no_local_gpu, monkeypatch):
    """4 x (8192 x 8192 + 8192) = 268,468,224 fp32 parameters: AdamW's states are 16 bytes each (parameter,
    gradient, two moments) = 4.0005 GiB; even stored in bf16 they miss a 1.5 GB T4 budget, so they must go to the
    host, where 1 GB cannot hold them. The planner says so without simulating."""
    from autofit.planning import race as planner

    def analysed(*args, **kwargs):
        raise AssertionError("the planner analysed a layout")

    monkeypatch.setattr(planner, "plan_layout", analysed)
    params = 4 * (8192 * 8192 + 8192)
    with pytest.raises(autofit.HostMemoryError) as info:
        autofit.plan(_wide(), torch.randn(2, 8192), "1.5GB",
                     device=autofit.Device(gpu="T4", host_budget="1GB"), loss_fn=lambda o: o.sum())
    assert info.value.host_bytes == 16 * params and info.value.host_budget_bytes == 10**9
    assert 'host_budget="5GiB"' in str(info.value)  # 4.0005 GiB, rounded up to whole GiB
    assert "before any analysis" in str(info.value)


def test_a_budget_below_the_context_is_left_to_the_analysis(no_local_gpu, monkeypatch):
    """Under a budget that cannot hold the CUDA context the GPU budget is short first: no early host error."""
    from autofit.planning import race as planner

    called = []
    monkeypatch.setattr(planner, "plan_layout", lambda *a, **k: called.append(1) or (_ for _ in ()).throw(
        autofit.InvalidInputError("stop")))
    with pytest.raises(autofit.InvalidInputError, match="stop"):
        autofit.plan(_wide(), torch.randn(2, 8192), 1,
                     device=autofit.Device(gpu="T4", host_budget="1GB"), loss_fn=lambda o: o.sum())
    assert called


# ---- the command line --------------------------------------------------------------------------------------------
def _cli(*args: str):
    from typer.testing import CliRunner

    from autofit.cli.app import app

    return CliRunner().invoke(app, ["plan", *args], catch_exceptions=False)


@pytest.mark.sim
def test_the_cli_plan_says_which_host_it_assumed(no_local_gpu):
    from pathlib import Path

    factory = f"{Path(__file__).resolve().parent.parent / 'examples' / 'factories.py'}:small_cnn"
    result = _cli(factory, "--budget", "2GB", "--batch-size", "32", "--gpu", "T4")
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    # AWS g4dn.metal: 384 GiB for 8 T4 -> one rank's share, 48 GiB
    assert "host budget 48.00 GiB per node" in text and "g4dn.metal" in text and "--host-budget" in text, text


@pytest.mark.sim
def test_the_cli_refuses_states_over_the_host_budget_naming_a_host_budget(no_local_gpu):
    """gpt2-xl: 48 x (12 x 1600^2 + 13 x 1600) + 50257 x 1600 + 1024 x 1600 + 2 x 1600 = 1,557,611,200 parameters
    (its LM head is tied); AdamW's fp32 states, 16 bytes each, are 23.21 GiB, more than the --host-budget of 8GB,
    and not even in bf16 (8 bytes each) do they fit a 4 GB T4 budget. Known before any analysis."""
    result = _cli("hf:gpt2-xl", "--budget", "4GB", "--batch-size", "8", "--input-shape", "256", "--gpu", "T4",
                  "--host-budget", "8GB")
    assert result.exit_code == 3, result.output
    text = " ".join(result.output.split())
    assert "Known before any analysis" in text and '--host-budget "24GiB"' in text and "host_budget" not in text, text
