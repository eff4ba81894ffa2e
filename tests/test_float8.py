"""Float8 training (autofit/features/float8.py, Note [Float8 training]): torchao's Float8Linear swapped in before the
layout. The truths: the CPU allocator (``autofit.measure`` runs the converted copy for real, torchao's
``_scaled_mm`` included), torchao's own source for what FSDP2's float8 all-gather moves (gloo cannot run it), a
hand count of the layers' elements, and torchtitan's filter rule (``module_filter_fn``: both dimensions multiples of
16, the listed names skipped)."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from torch import nn

import autofit
from autofit.core.errors import InvalidInputError, UnsupportedFeatureError
from autofit.parallel.layout import Parallel

torchao_float8 = pytest.importorskip("torchao.float8")

from autofit.features.float8 import (  # noqa: E402
    FLOAT8, Float8, as_float8, converted_linears, gathered_bytes, recipe_names, require_fp8)

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# the steps that run on this CPU (estimate and measure on a CPU target) need oneDNN's float8 matmul (Note [CPU
# kernels]): absent under ONEDNN_MAX_CPU_ISA=AVX2, where the simulation refuses (test_a_cpu_without_fp8_kernels_...)
from autofit.core.cpu import fp8_matmul  # noqa: E402

cpu_fp8 = pytest.mark.skipif(not fp8_matmul(), reason="this CPU's oneDNN has no float8 matmul (torch._scaled_mm)")


def _llama() -> nn.Module:
    from benchmarks.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                             num_kv_heads=2))


@pytest.mark.sim
@pytest.mark.parametrize("checkpoint", [(), ("layers.0", "layers.1")], ids=["kept", "recomputed"])
@pytest.mark.parametrize("recipe", RECIPES)
@cpu_fp8
def test_a_converted_llama_estimates_within_half_a_percent_of_measure(recipe, checkpoint):
    """benchmarks/llama.py's Llama (hidden 64, 2 layers), 2 rows of 32 tokens, fp32, AdamW: every linear but the
    head converted. Before the tracker saw inside Float8TrainingTensor's dispatch (Note [subclasses that compute in
    plain ops]) the estimate missed the _scaled_mm kernels' outputs' copies and scratch: tensorwise -1.33 % (-3.46 %
    recomputed), rowwise -1.03 % (-3.07 %), rowwise_with_gw_hp 0.00 % (-1.99 %); now byte for byte."""
    model = _llama()
    ids = torch.randint(0, 256, (2, 32))
    kw = dict(target=ids, step=autofit.Step(micro_batch_size=2, checkpoint=checkpoint, float8=recipe))
    predicted = autofit.estimate(model, ids, **kw)
    measured = autofit.measure(model, ids, **kw).peak_bytes
    assert abs(predicted.peak_bytes - measured) <= 0.005 * measured, (predicted.peak_bytes, measured)
    assert any("float8 training" in n and recipe in n for n in predicted.notes)
    # the user's model is left as it was: the copies were converted, not it
    assert all(type(m) is nn.Linear for m in model.modules() if isinstance(m, nn.Linear))


@pytest.mark.sim
@cpu_fp8
def test_float8_changes_what_the_step_holds():
    """The conversion reaches the simulation: the same step without float8 peaks elsewhere (torchao 0.18 saves the
    high-precision input and weight and adds the float8 casts and _scaled_mm's copies on top)."""
    model = _llama()
    ids = torch.randint(0, 256, (2, 32))
    plain = autofit.estimate(model, ids, target=ids, step=2).peak_bytes
    converted = autofit.estimate(model, ids, target=ids,
                                 step=autofit.Step(micro_batch_size=2, float8="tensorwise")).peak_bytes
    assert converted != plain


def _forward_gathers(model: nn.Module, float8) -> list[int]:
    """The bytes of each buffer FSDP2 all-gathers into in the simulated forward (the storage the ``empty`` before
    each ``all_gather_copy_in`` made), one rank of 2."""
    from autofit.simulate.run import simulate_step
    from autofit.parallel.choices import shard_units
    from autofit.training.step import make_step_config
    from autofit.validate import as_inputs

    ids = torch.randint(0, 256, (2, 32))
    batch, target = as_inputs(ids, ids, None, 0)
    config = make_step_config(micro_batch_size=2, float8=float8,
                              layout=Parallel(strategy="fsdp2", world_size=2, shard_units=shard_units(model)))
    timeline = simulate_step(model, batch, target, None, config).timeline
    made = {}
    for s in timeline.storages:
        made.setdefault(s.op, []).append(s.nbytes)
    sizes = []
    for i, op in enumerate(timeline.ops):
        if op.name == "all_gather_copy_in" and op.phase == 1:
            empty = max(j for j in range(i) if timeline.ops[j].name == "empty")
            sizes.extend(made[empty])
    return sizes


@pytest.mark.sim
@cpu_fp8
def test_float8_all_gather_gathers_one_byte_per_converted_element():
    """FSDP2's float8 all-gather (tensorwise, torchao/float8/fsdp_utils.py: ``fsdp_pre_all_gather`` returns the
    float8 data, 1 byte per element; the scale comes from an all-reduced amax, not gathered). gloo cannot run it
    ("Invalid scalar type"), so the simulation on a fake process group is held to a hand count. One block of the
    Llama: q and o 64 x 64, k and v 32 x 64, gate, up and down 128 x 64 (36,864 elements, all converted) and two
    norms of 64 (fp32, 4 bytes each). The root unit (embedding, final norm, head: 32,832 elements) is not
    converted and gathers 4 bytes each either way."""
    block_linears = 2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64
    assert block_linears == 36_864
    root = (256 * 64 + 64 + 64 * 256) * 4
    plain = _forward_gathers(_llama(), None)
    assert plain == [root, (block_linears + 128) * 4, (block_linears + 128) * 4]
    converted = _forward_gathers(_llama(), Float8(recipe="tensorwise", all_gather=True))
    assert converted == [root, block_linears * 1 + 128 * 4, block_linears * 1 + 128 * 4]
    # the feature's own count (the collectives' bytes), against the same hand count
    assert gathered_bytes(block_linears, True, Float8(all_gather=True), 4) == block_linears
    assert gathered_bytes(block_linears, True, Float8(), 2) == 2 * block_linears


def test_the_filter_is_torchtitans():
    """torchtitan's module_filter_fn: both dimensions multiples of 16, names containing a skipped string left; here
    the output head too (found by its place). Subclasses of nn.Linear (other libraries' layers) are not swapped."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(64, 128)
            self.odd = nn.Linear(128, 100)  # 100 is not a multiple of 16
            self.attn_wk = nn.Linear(100, 64)
            self.keep = nn.Linear(64, 64)
            self.head = nn.Linear(64, 32)

        def forward(self, x):
            return self.head(self.keep(self.attn_wk(self.odd(self.up(x)))))

    net = Net()
    assert converted_linears(net, Float8()) == ("up", "keep")
    assert converted_linears(net, Float8(skip=("ke",))) == ("up",)
    from autofit.features.float8 import convert

    assert convert(net, Float8()) == ("up", "keep")
    assert type(net.up).__name__ == "Float8Linear" and type(net.head) is nn.Linear
    assert convert(net, Float8()) == ()  # a converted model stays as it is (the distributed trainer passes twice)


def test_recipes_are_the_installed_torchaos():
    from torchao.float8.config import Float8LinearRecipeName

    assert recipe_names() == tuple(r.value for r in Float8LinearRecipeName)
    assert set(RECIPES) <= set(recipe_names())
    assert as_float8("rowwise") == Float8(recipe="rowwise")
    assert as_float8(None) is None


def test_bad_float8_values_say_what_to_give():
    with pytest.raises(InvalidInputError, match="'tensorwise'"):
        as_float8("columnwise")
    if importlib.util.find_spec("torchao.prototype.moe_training") is not None:  # where torchao 0.18 keeps MX training
        from torchao.prototype.moe_training.config import MXFP8TrainingRecipe

        mx = next(iter(MXFP8TrainingRecipe)).value  # "mxfp8_rceil" in 0.18
        with pytest.raises(InvalidInputError, match="MXFP8TrainingOpConfig.*does not plan"):
            as_float8(mx)
    with pytest.raises(InvalidInputError, match="only 'tensorwise'"):
        Float8(recipe="rowwise", all_gather=True)
    with pytest.raises(InvalidInputError, match="recipe name"):
        as_float8(8)


def test_cards_without_fp8_refuse_float8():
    from autofit.cuda.catalog import gpu_spec

    with pytest.raises(UnsupportedFeatureError, match="A100.*no FP8 tensor cores"):
        require_fp8(gpu_spec("A100-80GB"))
    for card in ("H100", "H200", "B200", "L40S", "RTX-4090", "MI300X"):
        require_fp8(gpu_spec(card))  # no error


def test_without_torchao_float8_is_refused(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import fails as when torchao is not installed
    with pytest.raises(UnsupportedFeatureError, match="pip install torchao"):
        as_float8("tensorwise")


def _matmuls(recipe: str) -> list[tuple[str, str, int]]:
    """(op, precision, FLOPs) of the matmuls of a converted 256 -> 512 linear in a simulated step over 64 rows, for
    an H100, bf16 autocast (the head, 512 -> 16, is left in bf16: its matmuls have other FLOPs)."""
    from autofit.analyse.table import precision_of
    from autofit.device import resolve_device
    from autofit.simulate.run import simulate_step
    from autofit.training.step import make_step_config
    from autofit.validate import as_inputs

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body, self.head = nn.Linear(256, 512, bias=False), nn.Linear(512, 16)  # the head stays

        def forward(self, x):
            return self.head(torch.relu(self.body(x)))

    model = Net()
    batch, _ = as_inputs(torch.randn(64, 256), None, None, 0)
    config = make_step_config(micro_batch_size=64, precision="bf16", device="cuda", gpu="H100",
                              float8=as_float8(recipe))
    timeline = simulate_step(model, batch, None, lambda out: out.float().square().mean(), config,
                             device_rules=resolve_device("cuda", "H100").simulation_rules).timeline
    return [(op.name, precision_of(op.dtype), op.flops) for op in timeline.ops
            if op.name in ("_scaled_mm", "mm", "addmm") and op.flops == 2 * 64 * 256 * 512]  # the body's


@pytest.mark.sim
@pytest.mark.parametrize("recipe, fp8_matmuls", [("tensorwise", 3), ("rowwise", 3), ("rowwise_with_gw_hp", 2)])
def test_converted_matmuls_are_priced_at_the_cards_fp8_rate(recipe, fp8_matmuls):
    """Each of the linear's three matmuls (output, input gradient, weight gradient: 2 x 64 x 256 x 512 FLOPs each,
    counted by hand) runs as torchao's recipe says: in float8 (``_scaled_mm``), except rowwise_with_gw_hp's weight
    gradient, kept in high precision (torchao's config: ``cast_config_*_for_grad_weight`` disabled). The time model
    prices float8 at the card's dense FP8 rate: H100 SXM 1979 TFLOP/s, twice its 989 bf16 (NVIDIA's H100
    datasheet, cited in autofit/cuda/cards.py)."""
    from autofit.device import resolve_device

    matmuls = _matmuls(recipe)
    assert len(matmuls) == 3 and all(flops == 2 * 64 * 256 * 512 for _, _, flops in matmuls), matmuls
    assert sum(p == "fp8" for _, p, _ in matmuls) == fp8_matmuls
    assert all(name == "_scaled_mm" for name, p, _ in matmuls if p == "fp8")
    rates = resolve_device("cuda", "H100").throughput.flops_per_second
    assert rates["fp8"] == 1979e12 and rates["bf16"] == 989e12


def test_an_fp8_op_costs_its_flops_at_the_fp8_rate():
    """The roofline of one op of 1.979 TFLOPs: 1 s at the fp8 rate of an H100, 2 s had it run in bf16."""
    import numpy as np

    from autofit.analyse.table import OpCosts
    from autofit.device import Throughput
    from autofit.solve.time_model import TimeModel

    tp = Throughput(name="hand", flops_per_second={"fp8": 1979e12, "bf16": 989.5e12}, bytes_per_second=float("inf"),
                    op_overhead_seconds=0.0)
    for precision, seconds in (("fp8", 1.0), ("bf16", 2.0)):
        ops = OpCosts(flops_fixed=np.full(1, 1979e12), flops_per_sample=np.zeros(1), bytes_fixed=np.zeros(1),
                      bytes_per_sample=np.zeros(1), precision=(precision,), forward=np.ones(1, dtype=bool),
                      module=("0",))
        assert TimeModel(tp, ops).step_time(precision, 1, 1).total == pytest.approx(seconds)


# ---- the command line, the plan, the trainer and the speed rung ----------------------------------------------------

MLP = f"{__import__('pathlib').Path(__file__).resolve().parent.parent / 'examples' / 'factories.py'}:mlp"


@pytest.mark.sim
@cpu_fp8
def test_the_cli_estimate_takes_float8_as_the_library_does():
    """``autofit estimate --float8 rowwise`` on examples/factories.py's MLP (Linear(128, 256) converted, Linear(256,
    1) left: 1 is no multiple of 16): the library's figures for the same arguments."""
    import json

    from typer.testing import CliRunner

    from autofit.cli.app import app
    from autofit.cli.specs import load_spec

    result = CliRunner().invoke(app, ["estimate", MLP, "--input-shape", "128", "-m", "16", "--device", "cpu",
                                      "--float8", "rowwise", "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout[result.stdout.index("{"):])
    spec = load_spec(MLP, input_shapes=[(128,)])
    est = autofit.estimate(spec.model, spec.sample, target=spec.target, loss_fn=spec.loss_fn,
                           step=autofit.Step(micro_batch_size=16, float8="rowwise"))
    assert data["float8"] == "rowwise" and data["peak_allocated_bytes"] == est.peak_allocated_bytes
    assert converted_linears(spec.model, Float8(recipe="rowwise")) == ("0",)


def test_the_cli_plan_refuses_float8_on_a_card_without_fp8():
    from typer.testing import CliRunner

    from autofit.cli.app import app

    result = CliRunner().invoke(app, ["plan", MLP, "--input-shape", "128", "--batch-size", "16", "--budget", "8GB",
                                      "--gpu", "A100-80GB", "--float8", "tensorwise"])
    assert result.exit_code != 0 and "no FP8 tensor cores" in result.output


@pytest.mark.sim
@cpu_fp8
def test_a_float8_plan_round_trips_and_its_trainer_converts_before_training():
    """A CPU plan with Savers(float8="tensorwise"): its JSON keeps the value, its table names it, and wrap() swaps the
    model's blocks' linears for torchao's (the head left), then trains a step."""
    model = _llama()
    ids = torch.randint(0, 256, (4, 32))
    plan = autofit.plan(model, ids, "8GB", target=ids, device="cpu", savers=autofit.Savers(float8="tensorwise"))
    assert plan.float8 == Float8(recipe="tensorwise") and FLOAT8.in_force(plan.step) == plan.float8
    assert autofit.Plan.from_json(plan.to_json()).float8 == plan.float8
    assert "float8" in str(plan)
    trainer = plan.wrap(model, torch.optim.AdamW(model.parameters()))
    kinds = {name: type(m).__name__ for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    assert kinds.pop("lm_head") == "Linear" and set(kinds.values()) == {"Float8Linear"}
    assert torch.isfinite(torch.tensor(trainer.step(ids, ids)))


def test_the_speed_rung_takes_the_faster_plan_and_says_what_it_bought():
    """Note [speed rungs] on hand-made plans: with float8 0.5 s against 1 s without, taken; 2 s against 1 s, not
    taken; only the float8 plan fits, taken; a card without FP8, not taken, the note says why."""
    import dataclasses

    from autofit.core.errors import InfeasibleBudgetError
    from autofit.cuda.catalog import gpu_spec
    from autofit.planner import _with_speed_rungs

    @dataclasses.dataclass(frozen=True)
    class Request:  # Float8 is carried in more_features (Note [carried features]): what allow= opened, in force
        device: object
        more_features: tuple = (("allow_float8", Float8()),)
        allow_chunked_loss: object = None
        allow_eight_bit: object = None

    @dataclasses.dataclass(frozen=True)
    class Planned:
        predicted_step_seconds: float
        peak_bytes: int = 2**30
        notes: tuple = ()

    class Device:
        gpu = gpu_spec("H100")

    def planner(without, with_float8):
        def planned(request):
            seconds = with_float8 if FLOAT8.in_force(request) is not None else without
            if seconds is None:
                raise InfeasibleBudgetError("nothing fits", min_budget_bytes=2**40, budget_bytes=2**30)
            return Planned(seconds), {}
        return planned

    faster, _ = _with_speed_rungs(Request(Device()), planner(1.0, 0.5))
    assert faster.predicted_step_seconds == 0.5 and "rung 'float8' taken" in faster.notes[-1]
    assert "0.5 s" in faster.notes[-1] and "1 s" in faster.notes[-1]
    slower, _ = _with_speed_rungs(Request(Device()), planner(1.0, 2.0))
    assert slower.predicted_step_seconds == 1.0 and "not taken, no faster" in slower.notes[-1]
    only, _ = _with_speed_rungs(Request(Device()), planner(None, 3.0))
    assert only.predicted_step_seconds == 3.0 and "nothing fits without it" in only.notes[-1]
    with pytest.raises(InfeasibleBudgetError):
        _with_speed_rungs(Request(Device()), planner(None, None))

    class A100:
        gpu = gpu_spec("A100-80GB")

    kept, _ = _with_speed_rungs(Request(A100()), planner(1.0, 0.5))
    assert kept.predicted_step_seconds == 1.0 and "no FP8 tensor cores" in kept.notes[-1]
    fixed, _ = _with_speed_rungs(Request(Device(), more_features=(("allow_float8", Float8()), ("float8", Float8()))),
                                 planner(1.0, 0.5))
    assert fixed.notes == ()  # the user fixed it: planned once, with it


def test_the_float8_all_gather_needs_fsdp2_and_is_not_measured_on_gloo():
    from autofit.training.step import make_step_config

    with pytest.raises(InvalidInputError, match="strategy='fsdp2'"):
        make_step_config(micro_batch_size=1, float8=Float8(all_gather=True),
                         layout=Parallel(strategy="ddp", world_size=2))
    with pytest.raises(InvalidInputError, match="gloo"):
        autofit.measure(nn.Linear(64, 64), torch.randn(4, 64),
                        loss_fn=lambda out: out.sum(), layout=autofit.Layout(world_size=2, strategy="fsdp2"),
                        step=autofit.Step(micro_batch_size=2, float8=Float8(all_gather=True)))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@cpu_fp8
def test_fsdp2_over_converted_linears_within_half_a_percent_of_each_rank(recipe):
    """Converted before the layout, as torchtitan converts before parallelize: FSDP2 over 2 gloo ranks shards and
    gathers the Float8Linear's (high-precision) parameters; every rank's CPU allocator against the one simulated
    rank (1,941,024 B tensorwise, 1,934,340 B rowwise on torch 2.13 / torchao 0.18: equal)."""
    model = _llama()
    ids = torch.randint(0, 256, (4, 32))
    kw = dict(target=ids, layout=autofit.Layout(world_size=2, strategy="fsdp2"),
              step=autofit.Step(micro_batch_size=2, float8=recipe))
    predicted = autofit.estimate(model, ids, **kw).peak_bytes
    for peak in autofit.measure(model, ids, **kw).rank_peaks:
        assert abs(predicted - peak) <= 0.005 * peak, (predicted, peak)


@pytest.mark.sim
def test_a_cpu_without_fp8_kernels_refuses_a_cpu_estimate(monkeypatch):
    """Where oneDNN has no float8 matmul (ONEDNN_MAX_CPU_ISA=AVX2: "could not create a primitive descriptor"), a
    CPU-target estimate refuses as for bf16 (Note [CPU kernels]), naming _scaled_mm and the module."""
    import autofit.core.cpu as cpu
    from autofit.core.errors import UnsupportedPrecisionError

    monkeypatch.setattr(cpu, "fp8_matmul", lambda: False)
    ids = torch.randint(0, 256, (2, 32))
    with pytest.raises(UnsupportedPrecisionError, match="no fp8 kernel for aten::_scaled_mm in module 'layers.0"):
        autofit.estimate(_llama(), ids, target=ids, step=autofit.Step(micro_batch_size=2, float8="tensorwise"))


@cpu_fp8
@pytest.mark.slow
def test_tensor_parallel_under_fsdp2_over_converted_linears_within_half_a_percent():
    """A Hugging Face tiny Llama (hidden 64, 2 layers), 4 gloo ranks: tensor parallel 2 (its own tp plan) under FSDP2
    over 2, tensorwise. Every rank measures 1,079,872 B; the estimate is 1,083,948 B (+0.38 %), its peak at a
    backward _scaled_mm whose CPU kernel's probed scratch (53,260 B) the split run does not take in full. The same
    layout without float8 is exact (1,043,484 B)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (4, 32))
    sample = {"input_ids": ids, "labels": ids}
    kw = dict(layout=autofit.Layout(world_size=4, strategy="fsdp2", tensor_parallel=2),
              step=autofit.Step(micro_batch_size=2, float8="tensorwise"))
    predicted = autofit.estimate(model, sample, **kw).peak_bytes
    for peak in autofit.measure(model, sample, **kw).rank_peaks:
        assert abs(predicted - peak) <= 0.005 * peak, (predicted, peak)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
@cpu_fp8
def test_a_compiled_converted_llama_estimates_what_measure_measures(recipe):
    """The same Llama, compiled (``compile=True``): inductor fuses torchao's casts into its C++ kernels and calls
    ``_scaled_mm`` as an extern ``out=`` kernel. ``measure`` compiles and runs it for real (about 20 s each);
    the estimate runs inductor's wrapper without kernels. Byte for byte on 2026-11-30: tensorwise 1,941,748 B,
    rowwise 1,858,700 B, rowwise_with_gw_hp 1,975,188 B."""
    model = _llama()
    ids = torch.randint(0, 256, (2, 32))
    kw = dict(target=ids, step=autofit.Step(micro_batch_size=2, float8=recipe, compile=True))
    predicted = autofit.estimate(model, ids, **kw).peak_bytes
    measured = autofit.measure(model, ids, **kw).peak_bytes
    assert abs(predicted - measured) <= 0.005 * measured, (predicted, measured)


def test_a_simulated_compile_never_runs_the_real_fp8_matmul(monkeypatch):
    """``_scaled_mm.out`` (the extern kernel inductor's wrapper calls) has no meta kernel in torch, so fake tensors
    ran the real CPU kernel on zero-filled full-size copies (FakeTensorMode's unsafe fallback): 119 of 129 s of one
    8B-shaped block at 8192 tokens. While a simulation compiles it has one that returns ``out``; after, torch's
    dispatcher is as it was."""
    import torch._subclasses.fake_tensor as fake_tensor
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autofit.core._torch_compile import _out_kernels_on_meta

    def no_fallback(*args, **kwargs):
        raise AssertionError("the real kernel ran on fake tensors")

    monkeypatch.setattr(fake_tensor, "run_fallback_kernel", no_fallback)
    name = torch.ops.aten._scaled_mm.out.name()
    had_meta = torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta")
    with FakeTensorMode():
        a = torch.empty(8192, 4096, dtype=torch.float8_e4m3fn)
        b = torch.empty(14336, 4096, dtype=torch.float8_e4m3fn).t()
        scale = torch.ones((), dtype=torch.float32)
        out = torch.empty(8192, 14336, dtype=torch.bfloat16)
        with _out_kernels_on_meta():
            got = torch.ops.aten._scaled_mm.out(a, b, scale, scale, out_dtype=torch.bfloat16, out=out)
        assert got is out
        if not had_meta:  # the meta kernel leaves with the simulation
            with pytest.raises(AssertionError, match="the real kernel ran"):
                torch.ops.aten._scaled_mm.out(a, b, scale, scale, out_dtype=torch.bfloat16, out=out)
    assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "Meta") == had_meta
