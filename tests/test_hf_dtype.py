"""``hf:`` models in the dtype the installed transformers loads them in (Note [the dtype a checkpoint loads in],
autofit/cli/hf_spec.py), and ``--dtype`` / ``dtype=`` to override it. Truths: hand counts of Qwen2.5-0.5B's
parameters, the dtype each checkpoint's ``config.json`` publishes, and what transformers' own
``AutoModelForCausalLM.from_config`` builds on the meta device."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import autofit
from autofit.cli.app import app

transformers = pytest.importorskip("transformers")

# Qwen/Qwen2.5-0.5B by hand: embedding 151936 x 896 (tied to the output), 24 layers of q (896x896 + bias 896),
# k and v (896x128 + bias 128 each), o (896x896), gate / up / down (896x4864 each) and two RMSNorms (896 each), a final
# RMSNorm (896): 494,032,768 parameters, the "0.49B" of its model card.
_LAYER = (896 * 896 + 896) + 2 * (896 * 128 + 128) + 896 * 896 + 3 * 896 * 4864 + 2 * 896
QWEN05_PARAMS = 151936 * 896 + 24 * _LAYER + 896
QWEN05 = "Qwen/Qwen2.5-0.5B"


def test_qwen05_hand_count():
    assert QWEN05_PARAMS == 494_032_768


def _dtypes(model) -> set[torch.dtype]:
    return {p.dtype for p in model.parameters()}


def test_qwen_builds_in_bf16_as_transformers_5_loads_it():
    """Qwen2.5's config.json says "torch_dtype": "bfloat16"; transformers 5's from_pretrained loads in it."""
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4 loads in fp32 by default")
    model = autofit.hf_model(QWEN05)
    assert _dtypes(model) == {torch.bfloat16}
    assert sum(p.numel() * p.element_size() for p in model.parameters()) == QWEN05_PARAMS * 2


def test_the_dtype_is_what_transformers_from_config_builds_on_meta():
    """transformers' own path: AutoConfig.for_model with the published torch_dtype, then from_config under
    torch.device("meta") (from_config takes config.dtype)."""
    from autofit.cli.hf_spec import offline_config

    for name, published in ((QWEN05, torch.bfloat16), ("meta-llama/Llama-3.2-1B", torch.bfloat16),
                            ("google/gemma-3-270m", torch.bfloat16), ("gpt2", torch.float32),
                            ("EleutherAI/pythia-70m", torch.float16), ("google/gemma-2-2b", torch.float32),
                            ("google/gemma-2-2b-it", torch.bfloat16)):
        with torch.device("meta"):
            theirs = transformers.AutoModelForCausalLM.from_config(offline_config(name))
        ours = autofit.hf_model(name)
        assert _dtypes(theirs) == _dtypes(ours) == {published}, name


def test_dtype_overrides():
    for flag, dtype in (("fp32", torch.float32), ("fp16", torch.float16), (torch.float32, torch.float32)):
        model = autofit.hf_model(QWEN05, dtype=flag)
        assert _dtypes(model) == {dtype}
        assert sum(p.numel() * p.element_size() for p in model.parameters()) == QWEN05_PARAMS * dtype.itemsize
    with pytest.raises(autofit.InvalidInputError, match="--dtype"):
        autofit.hf_model(QWEN05, dtype="float8")


def test_a_local_config_without_a_dtype_builds_fp32_and_one_with_bf16(tmp_path):
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2}
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "config.json").write_text(json.dumps(config))
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    assert _dtypes(autofit.hf_model(str(tmp_path / "plain"))) == {torch.float32}
    expected = torch.bfloat16 if int(transformers.__version__.split(".")[0]) >= 5 else torch.float32
    assert _dtypes(autofit.hf_model(str(tmp_path / "half"))) == {expected}


def test_transformers_4_loaded_fp32_by_default(monkeypatch):
    """transformers 4's from_pretrained defaulted to torch_dtype=None: torch's default dtype, fp32."""
    from autofit.cli import hf_spec

    config = hf_spec.offline_config(QWEN05)
    monkeypatch.setattr(hf_spec, "_transformers_version", lambda: "4.46.3")
    dtype, why = hf_spec.load_dtype(config)
    assert dtype == torch.float32 and "transformers 4.46" in why


def test_every_table_entry_names_a_published_dtype():
    from autofit.cli.hf_checkpoints import TABLE, checkpoint_config

    for entry in TABLE:
        for name in (entry.name, *entry.aliases):
            assert checkpoint_config(name)["torch_dtype"] in ("float32", "bfloat16", "float16"), name


@pytest.mark.sim
def test_cli_counts_bf16_parameters_and_says_so():
    runner = CliRunner()
    args = ["estimate", "hf:" + QWEN05, "-m", "1", "--input-shape", "8", "--device", "cpu", "--optimizer", "sgd"]
    shown = runner.invoke(app, args, catch_exceptions=False)
    assert shown.exit_code == 0, shown.output
    assert f"bf16, as transformers {'.'.join(transformers.__version__.split('.')[:2])} loads it" in shown.output
    data = json.loads(runner.invoke(app, [*args, "--json"], catch_exceptions=False).stdout)
    assert data["breakdown"]["parameters"] == QWEN05_PARAMS * 2
    data = json.loads(runner.invoke(app, [*args, "--dtype", "fp32", "--json"], catch_exceptions=False).stdout)
    assert data["breakdown"]["parameters"] == QWEN05_PARAMS * 4


def test_dtype_on_a_factory_is_refused():
    result = CliRunner().invoke(app, ["estimate", "examples/factories.py:mlp", "-m", "1", "--input-shape", "128",
                                      "--device", "cpu", "--dtype", "bf16"])
    assert result.exit_code == 2 and "--dtype applies to hf:" in result.output
