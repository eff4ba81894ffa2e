"""What this CPU's kernels run natively (autofit/core/cpu.py, Note [CPU kernels]), and what depends on it.

The truth each test compares with is the machine's own behaviour, asked with torch alone (does a bf16 autocast LSTM
run here?), never autofit's answer. To see a CPU with less than this one, a fresh process runs with
``ONEDNN_MAX_CPU_ISA=SSE41``: oneDNN then has no bf16 or fp16 kernels on any x86 CPU, as on an AVX2-only one.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from autofit.core.cpu import cpu_kernels

try:
    from tests.zoo import cpu_cannot_run
except ImportError:  # tests/ on sys.path rather than the repository root
    from zoo import cpu_cannot_run

ROOT = Path(__file__).resolve().parents[1]
X86 = platform.machine().lower() in ("x86_64", "amd64")
needs_x86 = pytest.mark.skipif(not X86, reason="ONEDNN_MAX_CPU_ISA caps oneDNN's ISA on x86 CPUs only")


@functools.cache
def _outputs(isa: str | None) -> dict[str, object]:
    """What each of the scripts below printed (its last line, JSON), all run in one fresh process whose oneDNN is
    capped at ``isa`` (None: as this process's). One process for all: each start imports torch and autofit again."""
    names = ("_LSTM_ERRORS", "_AUTO_ON_CPU") if isa is None else ("_FACTS", "_LSTM_ERRORS", "_AUTO_ON_CPU",
                                                                   "_SMALL_PROBES")
    code = "\n".join(f"def {name.lower()}():\n" + textwrap.indent(textwrap.dedent(globals()[name]), "    ")
                     + f"\nprint({name!r}, flush=True)\n{name.lower()}()" for name in names)
    lines = _run(code, isa).splitlines()
    return {lines[i]: json.loads(lines[i + 1]) for i in range(len(lines) - 1) if lines[i] in names}


def _run(code: str, isa: str | None) -> str:
    """Run ``code`` in a fresh Python (oneDNN reads its ISA cap once, at start) whose oneDNN is capped at ``isa``
    (None: as this process's, so that its answers compare with this process's machine), and return its stdout."""
    env = dict(os.environ)
    if isa is not None:
        env = {k: v for k, v in env.items() if k not in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")}
        env["ONEDNN_MAX_CPU_ISA"] = isa
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_the_bf16_answer_is_the_machines() -> None:
    # oneDNN's LSTM exists only as a oneDNN kernel: it runs in bf16 exactly where oneDNN has bf16 kernels
    assert cpu_kernels().bf16 == (cpu_cannot_run("lstm", "bf16") is None), cpu_cannot_run("lstm", "bf16")
    assert cpu_kernels().native("fp32")
    assert cpu_kernels().capability == torch.backends.cpu.get_cpu_capability()


_FACTS = """
    import json
    from autofit.core.cpu import cpu_kernels
    from zoo import cpu_cannot_run
    k = cpu_kernels()
    print(json.dumps([k.bf16, k.fp16, k.isa_cap, cpu_cannot_run("lstm", "bf16")]))
"""


@pytest.mark.slow
@needs_x86
def test_a_reduced_onednn_isa_has_no_bf16_kernels() -> None:
    bf16, fp16, cap, reason = _outputs("SSE41")["_FACTS"]
    assert (bf16, fp16, cap) == (False, False, "SSE41")
    assert reason is not None and "lstm" in reason  # the machine agrees: no bf16 LSTM under that cap


_LSTM_ERRORS = """
    import json
    import autofit
    from zoo import ZOO
    case = ZOO["lstm"]()
    kw = dict(micro_batch_size=case.micro_batch_size, target=case.target, loss_fn=case.loss_fn, precision="bf16")
    found = {}
    for name, call in (("estimate", autofit.estimate), ("measure", autofit.measure)):
        try:
            call(case.model, case.sample, device="cpu", **kw)
            found[name] = None
        except autofit.AutofitError as e:
            found[name] = [type(e).__name__, str(e), e.module, e.precision]
    found["cuda"] = autofit.estimate(case.model, case.sample, device="cuda", **kw).peak_bytes
    pinned = autofit.PrecisionPolicy(name="bf16", fp32_modules=("rnn",))
    kw["precision"] = pinned
    found["pinned"] = [autofit.estimate(case.model, case.sample, device="cpu", **kw).peak_bytes,
                       autofit.measure(case.model, case.sample, device="cpu", **kw).peak_bytes]
    print(json.dumps(found))
"""


def _check_lstm_errors(found: dict) -> None:
    for name in ("estimate", "measure"):
        kind, message, module, precision = found[name]
        assert kind == "UnsupportedPrecisionError", (name, message)
        assert (module, precision) == ("rnn", "bf16"), (name, message)
        assert "this CPU has no bf16 kernel" in message and "LSTM" in message, (name, message)
        assert "precision='fp32'" in message and "device='cuda'" in message, (name, message)
        assert "primitive descriptor" not in message, (name, message)  # oneDNN's words are not the message
    assert found["cuda"] > 0  # a GPU target needs no CPU kernel
    estimate, measured = found["pinned"]
    assert estimate == measured  # the way out the message offers runs, and is estimated exactly


@pytest.mark.sim  # plans in the fresh process these tests share (the first to ask pays for it)
def test_a_cpu_without_a_bf16_lstm_gets_a_typed_error() -> None:
    if cpu_cannot_run("lstm", "bf16") is None:
        pytest.skip("this CPU runs a bf16 LSTM (oneDNN has bf16 kernels here): no error to check in this process; "
                    "test_a_reduced_isa_gets_the_same_typed_error checks it under ONEDNN_MAX_CPU_ISA=SSE41")
    _check_lstm_errors(_outputs(None)["_LSTM_ERRORS"])


@pytest.mark.sim  # plans in the fresh process these tests share (the first to ask pays for it)
@needs_x86
def test_a_reduced_isa_gets_the_same_typed_error() -> None:
    _check_lstm_errors(_outputs("SSE41")["_LSTM_ERRORS"])


_AUTO_ON_CPU = """
    import json
    import autofit
    from autofit.options import Options
    from autofit.request import make_request
    from zoo import ZOO
    case = ZOO["lstm"]()
    kw = dict(batch_size=8, target=case.target, loss_fn=case.loss_fn, optimizer="sgd")
    options = Options.of(precision="auto", savers=autofit.Savers(checkpoint="auto"), device="cpu",
                         layout=autofit.Layout(world_size=1, strategy=None), search=autofit.Search(alternatives=False))
    request = make_request(case.model, case.sample, 10**10, options=options, **kw)
    plan = autofit.plan(case.model, case.sample, 10**10, device="cpu", **kw)
    print(json.dumps([[p.name for p in request.policies], plan.precision.name, list(plan.notes)]))
"""


def _check_auto(out: list, native_bf16: bool) -> None:
    policies, chosen, notes = out
    said = [n for n in notes if "precision 'auto' considered fp32 only" in n]
    if native_bf16:
        assert policies == ["fp32", "bf16"] and not said, (policies, notes)
    else:
        assert policies == ["fp32"] and chosen == "fp32", (policies, chosen)
        assert said and "AVX-512" in said[0], notes


@pytest.mark.slow
def test_auto_precision_on_a_cpu_target_considers_what_this_cpu_runs() -> None:
    _check_auto(_outputs(None)["_AUTO_ON_CPU"], native_bf16=cpu_cannot_run("lstm", "bf16") is None)


@pytest.mark.sim  # plans in the fresh process these tests share (the first to ask pays for it)
@needs_x86
def test_auto_precision_under_a_reduced_isa_is_fp32_only() -> None:
    _check_auto(_outputs("SSE41")["_AUTO_ON_CPU"], native_bf16=False)


_GPU_PLANS = """
    import json
    import autofit
    from zoo import ZOO
    plans = []
    for name, budget in (("lstm", "2GB"), ("resnet_bn", "2GB"), ("unet", "2GB")):
        case = ZOO[name]()
        plan = autofit.plan(case.model, case.sample, budget, batch_size=8, target=case.target,
                            loss_fn=case.loss_fn, optimizer="adamw", device="A100-80GB")
        plans.append(json.loads(plan.to_json()))
    print(json.dumps(plans))
"""


@pytest.mark.slow
@needs_x86
def test_gpu_target_plans_do_not_depend_on_the_planning_cpu() -> None:
    # docs/memory-model.md, "The planning machine's CPU": a GPU-target estimate runs no CPU kernel (fake tensors, no
    # probes), so oneDNN's ISA (its scratch sizes, its bf16 kernels) changes nothing. An LSTM (bf16 on the GPU,
    # no bf16 CPU kernel under SSE41), a convolutional net and a U-Net, planned as this process is and under SSE41.
    plain = json.loads(_run(_GPU_PLANS, None).splitlines()[-1])
    reduced = json.loads(_run(_GPU_PLANS, "SSE41").splitlines()[-1])
    assert [p["precision"] for p in plain] == [p["precision"] for p in reduced]
    assert plain == reduced


_SMALL_PROBES = """
    import json
    import autofit
    import autofit.simulate.probe as probe
    from autofit.simulate.run import _PROBER
    from zoo import ZOO
    found = []
    for name in ("gpt_sdpa", "tied_lm", "hf_dict"):
        case = ZOO[name]()
        kw = dict(micro_batch_size=case.micro_batch_size, target=case.target, loss_fn=case.loss_fn, precision="bf16",
                  optimizer="adamw", checkpoint=case.checkpoint)
        _PROBER.cache.clear(); _PROBER.small = 0
        small = autofit.estimate(case.model, case.sample, device="cpu", **kw)
        cut = _PROBER.small
        _PROBER.cache.clear()
        real = probe._reference_gemm
        probe._reference_gemm = lambda func, leaves: False  # every GEMM probed at full size, as before the note
        try:
            full = autofit.estimate(case.model, case.sample, device="cpu", **kw)
        finally:
            probe._reference_gemm = real
        found.append([name, cut, small.peak_bytes, full.peak_bytes, dict(small.breakdown), dict(full.breakdown)])
    print(json.dumps(found, default=str))
"""


@pytest.mark.sim  # plans in the fresh process these tests share (the first to ask pays for it)
@needs_x86
def test_small_gemm_probes_change_no_byte() -> None:
    # Note [small GEMM probes]: where oneDNN has no bf16 kernel (SSE41 cap), bf16 GEMMs are probed small and not run
    # at full size; the estimate must equal the one that probes every GEMM at full size
    for name, cut, small, full, small_parts, full_parts in _outputs("SSE41")["_SMALL_PROBES"]:
        assert cut > 0, name  # the note applied (the comparison is not vacuous)
        assert small == full and small_parts == full_parts, (name, small, full)
