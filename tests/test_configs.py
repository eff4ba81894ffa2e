"""The front door: training configs of five frameworks read into one typed value, written back with only what the
plan changes, and checked on a card (autofit/cli/configs/). The truths: the fixtures' own values, counted by hand
from tests/configs/*; the written files parsed by plain parsers (and transformers' HfArgumentParser); the estimate
a config check prints against ``autofit.estimate`` called with the same knobs by hand."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest
import yaml

from autofit.core.errors import InvalidInputError
from autofit.cli.configs.detect import detect, load, read_config
from autofit.cli.configs.writeback import FsdpKnobs, PlanKnobs, plan_changes, render, write_config

HERE = Path(__file__).parent / "configs"
TINY = HERE / "tiny-llama"

# file -> (framework, model, sequence, micro-batch, accumulation, data ranks, adapter (kind, rank, alpha) or None,
#          precision, model dtype, checkpointing, optimizer (name, bits, paged), packing), read by hand
EXPECTED = {
    "axolotl_qlora_8b.yml": ("axolotl", "hf:meta-llama/Meta-Llama-3-8B", 4096, 2, 4, 1, ("qlora", 32, 16.0), "bf16",
                             "bf16", "full", ("adamw", 32, True), True),
    "axolotl_full.yml": ("axolotl", "hf:Qwen/Qwen2.5-0.5B", 2048, 1, 8, 1, None, "bf16", "bf16", "none",
                         ("adamw", 32, False), True),
    "llamafactory_qlora_8b.yaml": ("llama-factory", "hf:meta-llama/Meta-Llama-3-8B-Instruct", 2048, 1, 8, 1,
                                   ("qlora", 8, 16.0), "bf16", "bf16", "full", ("adamw", 32, False), False),
    "llamafactory_full.yaml": ("llama-factory", "hf:Qwen/Qwen2.5-0.5B-Instruct", 2048, 1, 2, 1, None, "bf16", "fp32",
                               "full", ("adamw", 32, False), False),
    "torchtune_qlora_8b.yaml": ("torchtune", "hf:meta-llama/Meta-Llama-3.1-8B-Instruct", 2048, 2, 8, 1,
                                ("qlora", 8, 16.0), "fp32", "bf16", "full", ("adamw", 32, False), False),
    "torchtune_full.yaml": ("torchtune", "hf:Qwen/Qwen2.5-0.5B-Instruct", 2048, 2, 8, 1, None, "fp32", "bf16", "none",
                            ("adamw", 32, False), False),
    "trl_qlora_8b.yaml": ("trl", "hf:meta-llama/Llama-3.1-8B", 2048, 4, 4, 1, ("qlora", 16, 32.0), "bf16", "bf16",
                          "full", ("adamw", 8, True), True),
    "trl_full.json": ("trl", "hf:Qwen/Qwen2.5-0.5B", 1024, 8, 2, 1, None, "bf16", None, "none", ("adamw", 32, False),
                      False),
    # torchtitan's mode "selective" with selective_ac_option "op" is its per-op policy, autofit's "op-selective"
    "torchtitan_8b.toml": ("torchtitan", "hf:meta-llama/Llama-3.1-8B", 8192, 1, 8, 8, None, "bf16", "fp32",
                           "op-selective", ("adamw", 32, False), False),
    "torchtitan_full.toml": ("torchtitan", "hf:Qwen/Qwen3-0.6B", 4096, 4, 8, 1, None, "bf16", "fp32", "op-selective",
                             ("adamw", 32, False), False),
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fields_read(name):
    (framework, model, seq, micro, accum, ranks, adapter, precision, dtype, ckpt, optimizer,
     packing) = EXPECTED[name]
    c = read_config(HERE / name)
    assert (c.framework, c.model, c.sequence_length, c.micro_batch_size, c.accumulation_steps, c.data_ranks) == (
        framework, model, seq, micro, accum, ranks)
    assert c.effective_batch == micro * accum * ranks
    assert (None if c.adapter is None else (c.adapter.kind, c.adapter.rank, c.adapter.alpha)) == adapter
    assert (c.precision, c.model_dtype, c.checkpointing) == (precision, dtype, ckpt)
    assert (c.optimizer, c.optimizer_bits, c.paged_optimizer) == optimizer
    assert c.packing is packing
    assert c.unknown == ()  # every key of the fixtures is read, set aside as irrelevant, or named unmodelled
    read = {r.key for r in c.readings}
    assert read and all(line for line in c.lines())
    # the keys that carry the batch are listed as read
    batch_keys = {"axolotl": "micro_batch_size", "llama-factory": "per_device_train_batch_size",
                  "torchtune": "batch_size", "trl": "per_device_train_batch_size",
                  "torchtitan": "training.local_batch_size"}
    assert batch_keys[framework] in read


def test_launch_ranks():
    """A per-device batch multiplies by the ranks the launcher gives; torchtitan's stated global batch stays."""
    axolotl = read_config(HERE / "axolotl_full.yml", data_ranks=4)
    assert (axolotl.micro_batch_size, axolotl.accumulation_steps, axolotl.effective_batch) == (1, 8, 32)
    titan = read_config(HERE / "torchtitan_full.toml", data_ranks=4)  # global 32, local 4
    assert (titan.micro_batch_size, titan.accumulation_steps, titan.effective_batch) == (4, 2, 32)
    with pytest.raises(InvalidInputError, match="not a multiple"):
        read_config(HERE / "torchtitan_full.toml", data_ranks=3)


def test_adapter_targets():
    assert read_config(HERE / "torchtune_qlora_8b.yaml").adapter.targets == (
        "q_proj", "v_proj", "o_proj", "gate_proj", "down_proj", "up_proj")  # lora_attn_modules + apply_lora_to_mlp
    assert read_config(HERE / "axolotl_qlora_8b.yml").adapter.targets == ("all-linear",)  # lora_target_linear
    assert read_config(HERE / "trl_qlora_8b.yaml").adapter.dropout == 0.05


def test_torchtune_chunked_loss_named():
    c = read_config(HERE / "torchtune_full.yaml")
    assert [k for k, _ in c.unmodelled] == ["loss._component_"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_detection(name):
    data, fmt = load(HERE / name)
    assert detect(data, fmt) == EXPECTED[name][0]


def test_detection_refuses_other_files(tmp_path):
    other = tmp_path / "x.yaml"
    other.write_text("foo: 1\nbar: [1, 2]\n")
    with pytest.raises(InvalidInputError, match="cannot tell which framework"):
        read_config(other)
    bad = tmp_path / "x.cfg"
    bad.write_text("a=1")
    with pytest.raises(InvalidInputError, match=r"\.yaml"):
        read_config(bad)


@pytest.mark.parametrize("name,key,value", [
    ("axolotl_full.yml", "activation_offloading", "true"),
    ("axolotl_full.yml", "my_memory_trick", "true"),
    ("llamafactory_full.yaml", "use_unsloth", "true"),
    ("torchtune_full.yaml", "enable_activation_offloading", "True"),
])
def test_memory_keys_named(tmp_path, name, key, value):
    path = tmp_path / name
    text = (HERE / name).read_text()
    if f"\n{key}:" in text:  # the fixture has it off: turn it on
        path.write_text(render(HERE / name, {key: True}))
    else:
        path.write_text(text + f"\n{key}: {value}\n")
    c = read_config(path)
    assert key in {k for k, _ in c.unmodelled} | set(c.unknown)
    assert any(key in line for line in c.lines())


def test_torchtitan_unknown_key_named(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text((HERE / "torchtitan_full.toml").read_text() + "\n[memory_trick]\nenable = true\n")
    assert read_config(path).unknown == ("memory_trick.enable",)


def _flat(data, prefix=""):
    out = {}
    for k, v in data.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _parse(path: Path):
    text = path.read_text()
    if path.suffix == ".toml":
        return tomllib.loads(text)
    if path.suffix == ".json":
        return json.loads(text)
    return yaml.safe_load(text)


# a plan's knobs, written back by hand: the config's effective batch split 1 x (micro x accumulation), recomputation
# flipped, 8-bit AdamW
def _knobs(c, **kw):
    total = c.micro_batch_size * c.accumulation_steps
    return PlanKnobs(micro_batch_size=1, accumulation_steps=total, data_ranks=c.data_ranks, precision=c.precision,
                     stored=None, checkpointing=c.checkpointing == "none", eight_bit_optimizer=True, **kw)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_written_back_changes_only_the_plans_keys(tmp_path, name):
    c = read_config(HERE / name)
    knobs = _knobs(c, fsdp=FsdpKnobs(True, False) if c.sharding else None)
    changes = plan_changes(c, knobs)
    out = write_config(c.path, changes, tmp_path / name)
    before, after = _flat(_parse(HERE / name)), _flat(_parse(out))
    differ = {k for k in before.keys() | after.keys() if before.get(k, "absent") != after.get(k, "absent")}
    assert differ == set(changes) and changes
    again = read_config(out)
    assert again.effective_batch == c.effective_batch  # the effective batch unchanged
    assert (again.micro_batch_size, again.checkpointing != "none") == (1, c.checkpointing == "none")
    # comments kept: every comment line of the input is still in the output
    comments = [line.strip() for line in (HERE / name).read_text().splitlines() if line.strip().startswith("#")]
    assert all(line in out.read_text() for line in comments)


def test_written_training_arguments_load_with_hf_argument_parser(tmp_path):
    transformers = pytest.importorskip("transformers")
    for name in ("trl_full.json", "trl_qlora_8b.yaml"):
        c = read_config(HERE / name)
        out = write_config(c.path, plan_changes(c, _knobs(c)), tmp_path / name)
        parser = transformers.HfArgumentParser(transformers.TrainingArguments)
        # use_cpu: TrainingArguments refuses bf16 on a machine without a GPU, such as this one
        (args,) = parser.parse_dict({**_parse(out), "use_cpu": True}, allow_extra_keys=True)
        assert args.per_device_train_batch_size == 1
        assert args.gradient_accumulation_steps == c.micro_batch_size * c.accumulation_steps
        assert args.gradient_checkpointing is (c.checkpointing == "none")
        # the 8-bit rung: written where the config's optimizer was 32-bit, kept where it was 8-bit already
        assert args.optim == ("adamw_bnb_8bit" if c.optimizer_bits == 32 else _parse(HERE / name)["optim"])


def test_written_back_refuses_another_batch():
    c = read_config(HERE / "axolotl_full.yml")
    knobs = PlanKnobs(micro_batch_size=3, accumulation_steps=1, data_ranks=1, precision="bf16", stored=None,
                      checkpointing=False)
    with pytest.raises(InvalidInputError, match="effective batch"):
        plan_changes(c, knobs)


def test_render_keeps_yaml_layout():
    c = read_config(HERE / "axolotl_qlora_8b.yml")
    text = render(c.path, {"micro_batch_size": 1, "gradient_accumulation_steps": 8})
    original = (HERE / "axolotl_qlora_8b.yml").read_text().splitlines()
    changed = [a for a, b in zip(original, text.splitlines()) if a != b]
    assert changed == ["gradient_accumulation_steps: 4", "micro_batch_size: 2"]


def _tiny(tmp_path, name: str, **changes) -> Path:
    """A fixture with its model swapped for the tiny local config (a plan in seconds), and other keys changed."""
    key = {"axolotl_full.yml": "base_model", "trl_full.json": "model_name_or_path",
           "llamafactory_full.yaml": "model_name_or_path"}[name]
    path = tmp_path / name
    path.write_text(render(HERE / name, {key: str(TINY), **changes}))
    return path


# ---- plans and checks of the full fine-tune configs, the model swapped for tests/configs/tiny-llama -----------------
MODEL_KEY = {"axolotl_full.yml": "base_model", "llamafactory_full.yaml": "model_name_or_path",
             "trl_full.json": "model_name_or_path", "torchtune_full.yaml": "checkpointer.checkpoint_dir",
             "torchtitan_full.toml": "model.hf_assets_path"}
SEQ_KEY = {"axolotl_full.yml": "sequence_len", "llamafactory_full.yaml": "cutoff_len", "trl_full.json": "max_length",
           "torchtune_full.yaml": "tokenizer.max_seq_len", "torchtitan_full.toml": "training.seq_len"}


def tiny(tmp_path, name: str, seq: int = 256, **changes) -> Path:
    """The fixture ``name`` with the tiny local model, ``seq`` tokens per row and ``changes`` (dotted keys)."""
    path = tmp_path / name
    path.write_text(render(HERE / name, {MODEL_KEY[name]: str(TINY), SEQ_KEY[name]: seq, **changes}))
    return path


@pytest.mark.sim
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODEL_KEY))
def test_plan_written_back_fits_as_written(tmp_path, name):
    """The plan of a config, written back: the file parses, differs from the input in the plan's keys only, keeps
    the effective batch, and -- estimated as written, by autofit.check_config's own estimate call -- fits the
    budget the plan was made for."""
    import autofit

    source = tiny(tmp_path, name)
    out = tmp_path / f"planned{source.suffix}"
    result = autofit.plan_config(source, "700MiB", gpu="RTX-4090", write=out)
    before, after = _flat(_parse(source)), _flat(_parse(out))
    differ = {k for k in before.keys() | after.keys() if before.get(k, "absent") != after.get(k, "absent")}
    assert differ == set(result.changes)
    written = read_config(out)
    assert written.effective_batch == result.config.effective_batch == result.plan.batch_size
    assert (written.micro_batch_size, written.accumulation_steps) == (
        result.plan.even_split or (result.plan.micro_batch_size, result.plan.gradient_accumulation_steps))
    check = autofit.check_config(out, "RTX-4090")
    assert check.estimate.device_bytes <= result.plan.budget_bytes, (check.estimate.device_bytes, result.plan)


def _cli(*args):
    from typer.testing import CliRunner

    from autofit.cli.app import app

    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.sim
def test_check_exit_codes(tmp_path):
    """0 fits, 3 does not, 2 bad input; the figures are autofit.estimate's with the config's knobs, called by hand."""
    import torch

    import autofit
    from autofit.cli.specs import load_spec

    fits = tiny(tmp_path, "axolotl_full.yml", micro_batch_size=2)
    result = _cli("check", fits, "--gpu", "RTX-4090", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    spec = load_spec(f"hf:{TINY}", input_shapes=[(256,)], task="causal-lm")
    spec.model.to(torch.bfloat16)  # axolotl loads the weights in bf16 under bf16: auto
    by_hand = autofit.estimate(spec.model, spec.sample, precision="bf16",
                               optimizer="adamw", device=autofit.Device(kind="cuda", gpu="RTX-4090"),
                               step=autofit.Step(micro_batch_size=2, accumulation_steps=8, clip_grad_norm=1.0))
    assert data["fits"] is True and data["device_bytes"] == by_hand.device_bytes
    assert data["capacity_bytes"] == autofit.gpu_spec("RTX-4090").memory_bytes
    big = tmp_path / "big"
    big.mkdir()
    over = tiny(big, "axolotl_full.yml", seq=512, micro_batch_size=512)
    result = _cli("check", over, "--gpu", "RTX-4090")
    assert result.exit_code == 3, result.output
    assert "does NOT fit" in result.output and "peak by category" in result.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("micro_batch_size: [1\n")
    result = _cli("check", bad, "--gpu", "RTX-4090")
    assert result.exit_code == 2 and "error:" in result.output


@pytest.mark.sim
def test_check_names_unknown_memory_keys(tmp_path):
    path = tiny(tmp_path, "axolotl_full.yml", micro_batch_size=2, activation_offloading=True, my_memory_trick=True)
    result = _cli("check", path, "--gpu", "RTX-4090")
    assert result.exit_code == 0, result.output
    assert "not modelled: activation_offloading" in result.output
    assert "unknown key (may change memory, not read): my_memory_trick" in result.output


def test_adapter_configs_need_hf_model(monkeypatch):
    """Without autofit.hf_model (the lora branch), a LoRA config is a typed error naming what is missing; with it,
    the adapter's rank, targets, alpha and 4-bit base reach it as its keywords."""
    import autofit
    from autofit.core.errors import UnsupportedModelError
    from autofit.cli.configs.run import model_spec

    config = read_config(HERE / "axolotl_qlora_8b.yml")
    if "hf_model" not in autofit.__all__:
        with pytest.raises(UnsupportedModelError, match=r"autofit.hf_model\(name, lora=RANK"):
            model_spec(config)
    seen = {}

    def fake(name, **kw):
        seen.update(kw, name=name)
        raise RuntimeError("stop")

    monkeypatch.setattr(autofit, "hf_model", fake, raising=False)
    with pytest.raises(RuntimeError, match="stop"):
        model_spec(config)
    # axolotl's lora_target_linear: every linear layer (hf_model's "all-linear"); bf16: the weights loaded in bf16
    assert seen == {"name": "meta-llama/Meta-Llama-3-8B", "dtype": "bf16", "task": "causal-lm", "lora": 32,
                    "lora_targets": "all-linear", "lora_alpha": 16.0, "qlora": True, "load_in_8bit": False}
    seen.clear()
    with pytest.raises(RuntimeError, match="stop"):
        model_spec(read_config(HERE / "torchtune_qlora_8b.yaml"))
    assert seen["lora_targets"] == ["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj", "up_proj"]


@pytest.mark.sim
def test_cli_plan_from_and_write(tmp_path):
    source = tiny(tmp_path, "torchtitan_full.toml")
    out = tmp_path / "out.toml"
    result = _cli("plan", "--from", source, "--budget", "700MiB", "--gpu", "RTX-4090", "--write", out, "--quiet")
    assert result.exit_code == 0, result.output
    assert f"read {source}: torchtitan config" in result.output and f"wrote {out}" in result.output
    assert read_config(out).effective_batch == read_config(source).effective_batch == 32
    assert all(line in out.read_text() for line in source.read_text().splitlines() if line.startswith("#"))
    refused = _cli("plan", "hf:gpt2", "--from", source, "--budget", "700MiB")
    assert refused.exit_code == 2 and "drop MODEL" in refused.output
    alone = _cli("plan", "hf:gpt2", "--budget", "1GB", "--write", out)
    assert alone.exit_code == 2 and "--write writes back the config given with --from" in alone.output


@pytest.mark.sim
def test_check_keeps_the_configs_offload(tmp_path):
    """torchtitan's enable_cpu_offload reaches the estimate: autofit.estimate called by hand with the config's knobs
    and offload_states=True gives the same figures, and the states leave the device for the host."""
    import autofit
    from autofit.cli.configs.run import model_spec
    from autofit.parallel.choices import shard_units

    path = tiny(tmp_path, "torchtitan_full.toml", **{"training.enable_cpu_offload": True})
    check = autofit.check_config(path, "RTX-4090")
    spec = model_spec(check.config)
    knobs = dict(precision="bf16", optimizer="adamw",
                 device=autofit.Device(kind="cuda", gpu="RTX-4090"),
                 step=autofit.Step(micro_batch_size=4, accumulation_steps=8, clip_grad_norm=1.0,
                                   checkpoint={u: "op-selective" for u in shard_units(spec.model)}))
    by_hand = autofit.estimate(spec.model, spec.sample,
                               **dict(knobs, step=dataclasses.replace(knobs["step"], offload_states=True)))
    kept = autofit.estimate(spec.model, spec.sample, **knobs)
    assert (check.estimate.device_bytes, check.estimate.host_bytes) == (by_hand.device_bytes, by_hand.host_bytes)
    assert by_hand.host_bytes > 0 and by_hand.device_bytes < kept.device_bytes


@pytest.mark.parametrize("name, changes", [
    ("axolotl_qlora_8b.yml", {"adapter": "lora", "load_in_4bit": False, "load_in_8bit": True}),
    ("llamafactory_qlora_8b.yaml", {"quantization_bit": 8}),
    ("trl_qlora_8b.yaml", {"load_in_4bit": False, "load_in_8bit": True}),
])
def test_an_8bit_base_reaches_hf_model(tmp_path, monkeypatch, name, changes):
    """load_in_8bit (axolotl, TRL) and quantization_bit: 8 (LLaMA-Factory) build LoRA over an int8 base, not a
    16-bit one: hf_model gets load_in_8bit=True (and not qlora)."""
    import autofit
    from autofit.cli.configs.run import model_spec

    path = tmp_path / name
    path.write_text(render(HERE / name, changes))
    config = read_config(path)
    assert config.adapter.quantized_bits == 8
    seen = {}

    def fake(name, **kw):
        seen.update(kw)
        raise RuntimeError("stop")

    monkeypatch.setattr(autofit, "hf_model", fake, raising=False)
    with pytest.raises(RuntimeError, match="stop"):
        model_spec(config)
    assert (seen["load_in_8bit"], seen["qlora"]) == (True, False)


@pytest.mark.parametrize("name, changes, key", [
    ("llamafactory_qlora_8b.yaml", {"quantization_method": "hqq"}, "quantization_method"),
    ("llamafactory_qlora_8b.yaml", {"double_quantization": False}, "double_quantization"),
    ("axolotl_full.yml", {"load_in_8bit": True}, "load_in_8bit"),
])
def test_quantization_keys_not_built_are_named(tmp_path, name, changes, key):
    path = tmp_path / name
    path.write_text(render(HERE / name, changes))
    c = read_config(path)
    assert key in {k for k, _ in c.unmodelled} and c.unknown == ()


def test_llamafactory_quantization_bit_autofit_cannot_build_is_refused(tmp_path):
    path = tmp_path / "q.yaml"
    path.write_text(render(HERE / "llamafactory_qlora_8b.yaml", {"quantization_bit": 2}))
    with pytest.raises(InvalidInputError, match="quantization_bit 2.*4 or 8"):
        read_config(path)


@pytest.mark.sim
def test_an_8bit_lora_config_builds_int8_weights_hand_count(tmp_path):
    """axolotl's adapter: lora with load_in_8bit, its model swapped for tests/configs/tiny-llama: the config's model
    holds one int8 byte a base weight and one fp32 scale a row (bitsandbytes' Int8Params CB and SCB), the rest fp32
    (peft's prepare_model_for_kbit_training), and rank-32 adapters on every linear layer but the output."""
    import autofit
    from autofit.cli.configs.run import model_spec

    path = tmp_path / "a.yml"
    path.write_text(render(HERE / "axolotl_qlora_8b.yml", {"base_model": str(TINY), "sequence_len": 64,
                                                           "adapter": "lora", "load_in_4bit": False,
                                                           "load_in_8bit": True}))
    spec = model_spec(read_config(path))
    # tests/configs/tiny-llama: width 128, MLP 256, 2 layers, 2 KV heads of 32 (k / v: 128 -> 64), vocab 8192
    shapes = [(128, 128), (128, 64), (128, 64), (128, 128), (128, 256), (128, 256), (256, 128)]  # (in, out)
    int8 = 2 * sum(i * o + 4 * o for i, o in shapes)
    lora = 2 * sum(32 * (i + o) for i, o in shapes)
    others = 2 * 8192 * 128 + 5 * 128  # embedding, output layer (untied), 5 RMSNorms
    est = autofit.estimate(spec.model, spec.sample, step=1, optimizer="sgd")
    assert est.breakdown["parameters"] == int8 + 4 * (lora + others)
    assert "over an int8 base" in spec.description


def _titan_float8(tmp_path, **section):
    """torchtitan_full.toml (the tiny local model) with its float8 converter turned on and ``section`` in
    [quantize.linear.float8]."""
    changes = {"model.converters": ["quantize.linear.float8"]}
    changes.update({f"quantize.linear.float8.{k}": v for k, v in section.items()})
    return tiny(tmp_path, "torchtitan_full.toml", **changes)


def test_torchtitans_float8_converter_is_read(tmp_path):
    """[model] converters = ["quantize.linear.float8"] and its section (torchtitan's Float8LinearConverter): the
    recipe (none: torchao's default, tensorwise), filter_fqns less torchtitan's head "output" (autofit always leaves
    the head), the float8 all-gather; without the converter the section changes nothing, as in torchtitan."""
    config = read_config(_titan_float8(tmp_path, recipe_name="rowwise", filter_fqns=["output", "auto_filter_small_kn"]))
    assert config.float8 == ("rowwise", ("auto_filter_small_kn",), False)
    assert not config.unknown and not [k for k, _ in config.unmodelled if "float8" in k or "converters" in k]
    default = read_config(_titan_float8(tmp_path, enable_fsdp_float8_all_gather=True))
    assert default.float8 == ("tensorwise", (), True)
    off = read_config(tiny(tmp_path, "torchtitan_full.toml", **{"quantize.linear.float8.recipe_name": "rowwise"}))
    assert off.float8 is None and not off.unknown
    other = read_config(tiny(tmp_path, "torchtitan_full.toml", **{"model.converters": ["quantize.linear.mx"]}))
    assert other.float8 is None and ("model.converters", "'quantize.linear.mx': not modelled (autofit plans "
                                                         "Float8 only)") in other.unmodelled


@pytest.mark.sim
def test_check_keeps_the_configs_float8(tmp_path):
    """The converter reaches the estimate: autofit.estimate called by hand with the config's knobs and
    Step(float8=Float8("rowwise")) gives check's figures, which differ from the same step without float8."""
    pytest.importorskip("torchao.float8")
    import autofit
    from autofit.cli.configs.run import model_spec
    from autofit.features.float8 import Float8
    from autofit.parallel.choices import shard_units

    check = autofit.check_config(_titan_float8(tmp_path, recipe_name="rowwise"), "RTX-4090")
    spec = model_spec(check.config)
    step = autofit.Step(micro_batch_size=4, accumulation_steps=8, clip_grad_norm=1.0,
                        checkpoint={u: "op-selective" for u in shard_units(spec.model)})
    knobs = dict(precision="bf16", optimizer="adamw", device=autofit.Device(kind="cuda", gpu="RTX-4090"))
    by_hand = autofit.estimate(spec.model, spec.sample, step=dataclasses.replace(step, float8=Float8(recipe="rowwise")),
                               **knobs)
    plain = autofit.estimate(spec.model, spec.sample, step=step, **knobs)
    figures = lambda e: (e.peak_allocated_bytes, e.peak_reserved_bytes, e.device_bytes)  # noqa: E731
    assert figures(check.estimate) == figures(by_hand)
    assert by_hand.peak_reserved_bytes != plain.peak_reserved_bytes  # its casts' pages (the peak is at the head)
    assert any("float8 training (rowwise" in n for n in check.estimate.notes)


def test_a_flag_for_a_feature_the_config_turns_on_is_refused(tmp_path):
    result = _cli("plan", "--from", _titan_float8(tmp_path), "--budget", "8GB", "--gpu", "H100", "--float8", "rowwise")
    assert result.exit_code == 2 and "turns on float8 itself" in result.output and "drop its flag" in result.output


@pytest.mark.sim
def test_a_float8_plan_writes_torchtitans_converter_back(tmp_path):
    """A plan that trains in float8 (the rung, or Savers(float8=...)) written back to a torchtitan config without
    the converter: [model] converters and [quantize.linear.float8] as torchtitan's job config spells them (the export's
    sections: Feature.export_sections), its other converters kept; the written file reads back as the plan's
    Float8."""
    pytest.importorskip("torchao.float8")
    import autofit
    from autofit.cli.configs.run import model_spec
    from autofit.cli.configs.writeback import knobs_of

    source = tiny(tmp_path, "torchtitan_full.toml", **{"model.converters": ["quantize.linear.mx"]})
    config = read_config(source)
    spec = model_spec(config)
    plan = autofit.plan(spec.model, spec.sample, "4GB", batch_size=config.effective_batch, target=spec.target,
                        loss_fn=spec.loss_fn, device="H100", precision="bf16",
                        savers=autofit.Savers(float8="rowwise", checkpoint="none"))
    knobs = knobs_of(plan, config)
    changes = plan_changes(config, knobs)
    assert changes["model.converters"] == ["quantize.linear.mx", "quantize.linear.float8"]
    assert changes["quantize.linear.float8.recipe_name"] == "rowwise"
    assert changes["quantize.linear.float8.filter_fqns"] == ["output"]  # torchtitan's head, as its default
    assert not any("convert the model with torchao" in n for n in knobs.notes)
    out = tmp_path / "written.toml"
    write_config(source, changes, out)
    assert read_config(out).float8 == ("rowwise", (), False)
