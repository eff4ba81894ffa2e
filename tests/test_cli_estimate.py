"""``autofit estimate``: one fixed configuration through the command line. Its figures are autofit.estimate's for the
same arguments, the state bytes of a small MLP are checked by hand, and bad input exits 2 with one line."""

from __future__ import annotations

import dataclasses

import json
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

import autofit
from autofit.cli.app import app
from autofit.cli.specs import load_spec

pytestmark = pytest.mark.sim  # the simulation tier (tests/conftest.py)

ROOT = Path(__file__).resolve().parent.parent
MLP = f"{ROOT / 'examples' / 'factories.py'}:mlp"  # Linear(128, 256), ReLU, Linear(256, 1), mean
runner = CliRunner()

# By hand: Linear(128, 256) holds 128 x 256 + 256 = 33,024 parameters, Linear(256, 1) 257: 33,281 fp32 = 133,124 B.
MLP_BYTES = (128 * 256 + 256 + 256 + 1) * 4
# FSDP2 over 2 ranks shards dim 0, padded to equal shards: rank 0 holds 128 of the 256 rows of the first weight and
# of its bias, and the single row of the second weight and of its bias (fully_shard's chunking: torch.chunk).
MLP_SHARD_BYTES = (128 * 128 + 128 + 256 + 1) * 4
STEP_BYTES = 4 * 4  # AdamW's per-parameter `step`, a 0-d fp32 tensor, for each of the 4 parameters


def _estimate(*args: str) -> dict:
    result = runner.invoke(app, ["estimate", *args, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout[result.stdout.index("{"):])


def test_state_bytes_of_an_mlp_match_a_hand_count():
    one = _estimate(MLP, "--input-shape", "128", "-m", "4", "--device", "cpu")
    assert one["layout"] == "one process" and one["micro_batch_size"] == 4 and one["accumulation_steps"] == 1
    assert one["breakdown"]["parameters"] == MLP_BYTES
    assert one["breakdown"]["gradients"] == MLP_BYTES
    assert one["breakdown"]["optimizer_state"] == 2 * MLP_BYTES + STEP_BYTES  # exp_avg and exp_avg_sq
    sharded = _estimate(MLP, "--input-shape", "128", "-m", "4", "-n", "16", "--device", "cpu", "--world-size", "2",
                        "--strategy", "fsdp2")
    assert sharded["accumulation_steps"] == 2 and sharded["layout"] == "fsdp2 (ZeRO-3) over 2 ranks"
    assert sharded["breakdown"]["optimizer_state"] == 2 * MLP_SHARD_BYTES + STEP_BYTES


@pytest.mark.parametrize("model, extra, kwargs", [
    (MLP, ["--input-shape", "128", "--checkpoint", "0", "--reshard-after-forward", "false"],
     {"checkpoint": ("0",), "reshard_after_forward": False}),
    ("hf:llama", ["--config", "num_hidden_layers=2", "--config", "hidden_size=64", "--config", "intermediate_size=128",
                  "--config", "num_attention_heads=4", "--config", "num_key_value_heads=2", "--config",
                  "vocab_size=512", "--input-shape", "16", "--checkpoint", "blocks:selective", "--precision", "bf16"],
     {"checkpoint": {"model.layers.0": "selective", "model.layers.1": "selective"}, "precision": "bf16"}),
    (MLP, ["--input-shape", "128", "--reduce-every-micro-batch"], {"reduce_every_micro_batch": True}),
])
def test_figures_equal_the_library_estimate(model, extra, kwargs):
    # the same configuration through autofit.estimate: one rank of FSDP2 over 2 on an H100, accumulation 2
    data = _estimate(model, *extra, "-m", "2", "-n", "8", "--gpu", "H100", "--world-size", "2", "--strategy", "fsdp2")
    config = [e.split("=", 1) for e in extra[1::2] if "=" in e and not e.startswith("model.")]
    spec = load_spec(model, input_shapes=[(int(extra[extra.index("--input-shape") + 1]),)],
                     config={k: int(v) for k, v in config})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kwargs = dict(kwargs)  # the layout's field of a case goes into its Layout, the step's knobs into its Step
        layout = autofit.Layout(world_size=2, strategy="fsdp2",
                                reshard_after_forward=kwargs.pop("reshard_after_forward", "auto"))
        step = autofit.Step(micro_batch_size=2, accumulation_steps=2,
                            **{k: kwargs.pop(k) for k in ("checkpoint", "reduce_every_micro_batch") if k in kwargs})
        est = autofit.estimate(spec.model, spec.sample, target=spec.target, loss_fn=spec.loss_fn, step=step,
                               device="H100-80GB", layout=layout, **kwargs)
    assert data["gpu"] == "H100-80GB" and data["batch_size"] == 8
    assert (data["peak_allocated_bytes"], data["peak_reserved_bytes"], data["device_bytes"]) == (
        est.peak_allocated_bytes, est.peak_reserved_bytes, est.device_bytes)
    assert data["breakdown"] == dict(est.breakdown)


def test_tensor_parallel_figures_equal_the_library_estimate():
    # FSDP2 over 2 data-parallel ranks x tensor parallel 2 (the Llama config's own tp plan): 4 ranks, and the global
    # batch 8 is 2 rows x 2 micro-batches x 2 data-parallel ranks (the ranks of a tp group share their rows)
    llama = ["--config", "num_hidden_layers=2", "--config", "hidden_size=64", "--config", "intermediate_size=128",
             "--config", "num_attention_heads=4", "--config", "num_key_value_heads=2", "--config", "vocab_size=512"]
    data = _estimate("hf:llama", *llama, "--input-shape", "16", "-m", "2", "-n", "8", "--gpu", "H100",
                     "--world-size", "4", "--strategy", "fsdp2", "--tensor-parallel", "2")
    spec = load_spec("hf:llama", input_shapes=[(16,)], config={k: int(v) for k, v in
                                                               (e.split("=") for e in llama[1::2])})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = autofit.estimate(spec.model, spec.sample, target=spec.target, loss_fn=spec.loss_fn,
                               step=autofit.Step(micro_batch_size=2, accumulation_steps=2), device="H100-80GB",
                               layout=autofit.Layout(world_size=4, strategy="fsdp2", tensor_parallel=2))
    assert data["accumulation_steps"] == 2 and data["batch_size"] == 8 and data["tensor_parallel"] == 2
    assert "tp 2" in data["layout"], data["layout"]
    assert (data["peak_allocated_bytes"], data["device_bytes"]) == (est.peak_allocated_bytes, est.device_bytes)
    assert data["breakdown"] == dict(est.breakdown)


def test_sequence_parallel_figures_equal_the_library_estimate():
    """--sequence-parallel: the model's own plan with its blocks' norms sequence-parallel (sequence_parallel_plan),
    the same figures as the library given that plan; the activations of a rank fall against tensor parallel
    alone, its parameters do not."""
    from autofit.parallel.tensor_parallel import sequence_parallel_plan

    llama = ["--config", "num_hidden_layers=2", "--config", "hidden_size=64", "--config", "intermediate_size=128",
             "--config", "num_attention_heads=4", "--config", "num_key_value_heads=2", "--config", "vocab_size=512"]
    common = ["hf:llama", *llama, "--input-shape", "16", "-m", "2", "--gpu", "H100", "--world-size", "4",
              "--strategy", "fsdp2", "--tensor-parallel", "2"]
    data, alone = _estimate(*common, "--sequence-parallel"), _estimate(*common)
    spec = load_spec("hf:llama", input_shapes=[(16,)], config={k: int(v) for k, v in
                                                               (e.split("=") for e in llama[1::2])})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        est = autofit.estimate(spec.model, spec.sample, target=spec.target, loss_fn=spec.loss_fn,
                               step=2, device="H100-80GB",
                               layout=autofit.Layout(world_size=4, strategy="fsdp2", tensor_parallel=2,
                                                     tensor_parallel_plan=sequence_parallel_plan(spec.model)))
    assert data["sequence_parallel"] is True and alone["sequence_parallel"] is False
    assert (data["peak_allocated_bytes"], data["device_bytes"]) == (est.peak_allocated_bytes, est.device_bytes)
    assert data["breakdown"]["parameters"] == alone["breakdown"]["parameters"]
    assert data["peak_allocated_bytes"] < alone["peak_allocated_bytes"]


def test_compile_figures_equal_the_library_estimate():
    data = _estimate(MLP, "--input-shape", "128", "-m", "4", "--device", "cpu", "--compile")
    spec = load_spec(MLP, input_shapes=[(128,)])
    est = autofit.estimate(spec.model, spec.sample, target=spec.target, loss_fn=spec.loss_fn,
                           device="cpu", step=autofit.Step(micro_batch_size=4, compile=True))
    assert data["compile"] is True and data["peak_allocated_bytes"] == est.peak_allocated_bytes
    assert data["breakdown"] == dict(est.breakdown)


@pytest.mark.parametrize("extra, words", [
    (["--world-size", "2", "--strategy", "fsdp2", "--reshard-after-forward", "auto"], "autofit plan"),
    (["--world-size", "2", "--strategy", "fsdp2", "--replicate", "3"], "replicate"),
    (["-n", "6"], "--batch-size 6"),
    (["--checkpoint", "0:sometimes"], "full, selective"),
    (["--checkpoint", "no.such.module"], "no.such.module"),
    (["--world-size", "2"], "strategy"),
    (["--precision", "auto"], "--precision auto"),
    (["--gpu", "Z80"], "Z80"),
    (["--world-size", "4", "--strategy", "fsdp2", "--tensor-parallel", "3"], "--tensor-parallel 3"),
    (["--world-size", "2", "--strategy", "fsdp2", "--sequence-parallel"], "--tensor-parallel T"),
])
def test_bad_input_exits_2_with_one_line(extra, words):
    result = runner.invoke(app, ["estimate", MLP, "--input-shape", "128", "-m", "4", *extra])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and words in result.output, result.output
    assert result.output.lstrip().startswith("error:")


def test_tables_name_the_layout_and_the_breakdown():
    result = runner.invoke(app, ["estimate", MLP, "--input-shape", "128", "-m", "4", "--gpu", "A100-80GB",
                                 "--world-size", "2", "--strategy", "ddp"])
    assert result.exit_code == 0, result.output
    for text in ("per rank", "cuda (A100-80GB)", "ddp over 2 ranks", "peak allocated", "peak reserved", "on the device", "parameters",
                 "cuda_context", "total"):
        assert text in result.output, result.output


def test_every_step_knob_of_the_python_estimate_has_a_flag():
    """Issue 56: each keyword of autofit.estimate is a step knob with a flag of ``autofit estimate``, or one of the
    documented exclusions (the model and its data); each flag named exists on the command."""
    import inspect

    import typer

    from autofit.cli.estimate import NOT_STEP_KNOBS, STEP_FLAGS

    # the keywords, the step's knobs (one Step, whose every field is a knob) in place of ``step``
    knobs = (set(inspect.signature(autofit.estimate).parameters) - {"step"}) | {
        f.name for f in dataclasses.fields(autofit.Step)}
    assert knobs - NOT_STEP_KNOBS == set(STEP_FLAGS), "a knob without a flag, or a flag for no knob"
    command = typer.main.get_command(app).commands["estimate"]
    flags = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
    missing = {knob: f for knob, fs in STEP_FLAGS.items() for f in fs if f not in flags}
    assert not missing, missing


def test_the_gradient_sync_is_shown_and_the_flag_switches_it():
    common = ["estimate", MLP, "--input-shape", "128", "-m", "1", "-n", "8", "--device", "cpu", "--world-size", "2",
              "--strategy", "fsdp2"]
    deferred = runner.invoke(app, common)
    reducing = runner.invoke(app, [*common, "--reduce-every-micro-batch"])
    assert deferred.exit_code == reducing.exit_code == 0, deferred.output + reducing.output
    assert "deferred to the last micro-batch" in deferred.output, deferred.output
    assert "after every micro-batch" in reducing.output, reducing.output
    data = _estimate(*common[1:], "--reduce-every-micro-batch")
    assert data["reduce_every_micro_batch"] is True
