"""The optimizer step, gradient clipping and GradScaler as torch runs them on the target device.

Each expected figure is a hand computation from the torch source named in the test (no GPU needed: the simulation
runs torch's own optimizer code on fake CPU tensors, see Note [optimizer implementation on the target] in
``autofit/simulate/foreach.py``); on the CPU target, the CPU allocator (``autofit.measure``) is the oracle.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import autofit
from autofit.training.batch import as_batch
from autofit.device import resolve_device
from autofit.core.errors import InvalidInputError
from autofit.simulate.run import simulate_step
from autofit.simulate.timeline import EventKind, Phase
from autofit.training.step import make_step_config
from autofit.options import STEP_GROUPS, gather


def _mlp(layers: int = 6, width: int = 64) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


class _TwoDtypes(nn.Module):
    """One fp32 and one bf16 layer in one param group: ``_group_tensors_by_device_and_dtype`` makes two groups."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.b = nn.Linear(64, 64).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).bfloat16()).float()


def _loss(output: torch.Tensor) -> torch.Tensor:
    return output.sum()


def _param_bytes(model: nn.Module) -> list[int]:
    return sorted(p.numel() * p.element_size() for p in model.parameters())


def _simulate(model: nn.Module, device: str, optimizer, **kw):
    config = make_step_config(micro_batch_size=2, optimizer=optimizer, device=device, **kw)
    rules = resolve_device(config.device, config.gpu).simulation_rules
    return simulate_step(model, as_batch(torch.randn(2, 64)), None, _loss, config, probe_kernels=False,
                         device_rules=rules)


def _optimizer_ops(sim) -> list[str]:
    return [op.name for op in sim.timeline.ops if op.phase == Phase.OPTIMIZER]


def _optimizer_tensors(sim) -> list[int]:
    """Sizes of the non-scalar tensors the optimizer phase creates (scalars: step counts, norms, found_inf)."""
    return sorted(s.nbytes for s in sim.timeline.storages if s.phase == Phase.OPTIMIZER and s.nbytes > 16)


def _peak_temporaries_in_optimizer(sim) -> int:
    """Largest sum of optimizer-phase tensors alive at once (replayed from the timeline's events)."""
    live, peak = 0, 0
    for kind, value in sim.timeline.events:
        if kind == EventKind.OP:
            continue
        record = sim.timeline.storages[value]
        if record.phase != Phase.OPTIMIZER:
            continue
        live += record.nbytes if kind == EventKind.ALLOC else -record.nbytes
        peak = max(peak, live)
    return peak


# ---- the optimizer implementation ------------------------------------------------------------------------------

@pytest.mark.sim
@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_cuda_default_adam_is_foreach_with_one_parameter_sized_copy(name):
    """torch/optim/adam.py ``adam``: foreach and fused unset -> ``_default_to_fused_or_foreach`` -> foreach on CUDA.
    ``_multi_tensor_adam`` (not capturable, no amsgrad) updates exp_avg / exp_avg_sq / params in place and allocates
    one list, ``exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)``: one tensor per parameter, same size."""
    model = _mlp()
    sim = _simulate(model, "cuda", name)
    ops = _optimizer_ops(sim)
    assert "_foreach_sqrt" in ops and "sqrt" not in ops
    assert _optimizer_tensors(sim) == _param_bytes(model)
    assert _peak_temporaries_in_optimizer(sim) == sum(_param_bytes(model))
    est = autofit.estimate(model, torch.randn(2, 64), step=2, loss_fn=_loss, optimizer=name,
                           device="A100-80GB")
    assert est.peak_phase == "optimizer"
    assert est.breakdown["temporaries"] == sum(_param_bytes(model))


@pytest.mark.sim
def test_cpu_target_keeps_the_for_loop_and_the_allocator_agrees():
    """On cpu ``_get_foreach_kernels_supported_devices`` has no "cpu": ``_single_tensor_adam``, whose
    ``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`` makes two temporaries of one parameter's size
    while the previous parameter's ``denom`` is still bound: at most a weight's two (64*64*4 each) plus the previous
    layer's bias denom (64*4). The CPU allocator is the oracle for the whole step."""
    model = _mlp()
    sim = _simulate(model, "cpu", "adamw")
    ops = _optimizer_ops(sim)
    assert "sqrt" in ops and "_foreach_sqrt" not in ops
    assert _peak_temporaries_in_optimizer(sim) == 2 * 64 * 64 * 4 + 64 * 4
    kw = dict(step=2, loss_fn=_loss, optimizer="adamw", device="cpu")
    x = torch.randn(2, 64)
    assert autofit.estimate(model, x, **kw).peak_bytes == autofit.measure(model, x, **kw).peak_bytes


@pytest.mark.sim
def test_foreach_lists_of_consecutive_dtype_groups_are_alive_together():
    """``Optimizer._group_tensors_by_device_and_dtype`` splits fp32 and bf16 parameters into two groups; the loop
    in ``_multi_tensor_adam`` rebinds ``exp_avg_sq_sqrt`` per group, so the first group's list is freed only after
    the second group's is allocated: the peak holds both (64*64+64)*4 + (64*64+64)*2 bytes."""
    model = _TwoDtypes()
    sim = _simulate(model, "cuda", "adamw")
    assert _peak_temporaries_in_optimizer(sim) == (64 * 64 + 64) * 4 + (64 * 64 + 64) * 2


@pytest.mark.sim
def test_cuda_default_sgd_with_momentum_is_foreach_and_in_place():
    """torch/optim/sgd.py ``_multi_tensor_sgd`` with momentum (no nesterov, float lr): ``_foreach_mul_`` /
    ``_foreach_add_`` on the momentum buffers, then ``_foreach_add_(params, bufs, alpha=-lr)``: nothing allocated."""
    sim = _simulate(_mlp(), "cuda", "sgd")
    assert "_foreach_add_" in _optimizer_ops(sim)
    assert _optimizer_tensors(sim) == []


@pytest.mark.sim
@pytest.mark.parametrize("factory, present, absent", [
    # the user's foreach=False: ``adam`` keeps it (only None is defaulted)
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=False), "sqrt", "_foreach_sqrt"),
    # fused=True: ``_fused_adam`` calls ``torch._fused_adamw_``, which updates everything in place
    (lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), "_fused_adamw_", "_foreach_sqrt"),
    # a Tensor lr without capturable: adam.py "Do not flip on foreach for the unsupported case"
    (lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-3)), "sqrt", "_foreach_sqrt"),
])
def test_cuda_target_honours_what_torch_would_do_with_the_users_flags(factory, present, absent):
    sim = _simulate(_mlp(), "cuda", factory)
    ops = _optimizer_ops(sim)
    assert present in ops and absent not in ops


@pytest.mark.sim
def test_fused_adamw_allocates_no_parameter_sized_temporaries():
    """``torch._fused_adamw_`` (aten/src/ATen/native/cuda/fused_adamw_impl.cu) writes params and state in place."""
    sim = _simulate(_mlp(), "cuda", lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True))
    assert _optimizer_tensors(sim) == []


@pytest.mark.sim
def test_simulation_restores_torch_selection_afterwards():
    import torch.optim.optimizer as optimizer_module
    import torch.utils._foreach_utils as foreach_utils

    before = (list(optimizer_module._foreach_supported_types), list(foreach_utils._foreach_supported_types),
              optimizer_module._get_foreach_kernels_supported_devices())
    _simulate(_mlp(), "cuda", "adamw")
    assert (list(optimizer_module._foreach_supported_types), list(foreach_utils._foreach_supported_types),
            optimizer_module._get_foreach_kernels_supported_devices()) == before
    assert "cpu" not in optimizer_module._get_foreach_kernels_supported_devices()


# ---- gradient clipping and the GradScaler ---------------------------------------------------------------------

@pytest.mark.sim
def test_clip_grad_norm_uses_foreach_norms_one_scalar_per_gradient():
    """torch/nn/utils/clip_grad.py ``_get_total_norm``: ``torch._foreach_norm`` over the gradients of each
    (device, dtype) group, one 0-dim tensor per gradient (``_has_foreach_support``: cuda and cpu); then
    ``_clip_grads_with_norm_`` scales in place with ``torch._foreach_mul_``. The total norm is
    ``vector_norm(torch.stack([vector_norm(g) for g in norms]))``."""
    model = _mlp()
    sim = _simulate(model, "cuda", "sgd", clip_grad_norm=1.0)
    ops = _optimizer_ops(sim)
    assert "_foreach_norm" in ops and "_foreach_mul_" in ops
    norm_op = ops.index("_foreach_norm")
    norm_index = [i for i, op in enumerate(sim.timeline.ops) if op.phase == Phase.OPTIMIZER][norm_op]
    norms = [s.nbytes for s in sim.timeline.storages if s.op == norm_index]
    assert norms == [4] * len(list(model.parameters()))
    # beyond scalars, only ``torch.stack`` of the per-gradient norms: no parameter-sized tensor
    assert _optimizer_tensors(sim) == [4 * len(norms)]


@pytest.mark.sim
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_clipping_on_the_cpu_matches_the_allocator(optimizer):
    model, x = _mlp(), torch.randn(2, 64)
    kw = dict(step=autofit.Step(micro_batch_size=2, clip_grad_norm=0.5), loss_fn=_loss, optimizer=optimizer,
              device="cpu")
    measured = autofit.measure(model, x, **kw).peak_bytes
    assert autofit.estimate(model, x, **kw).peak_bytes == measured
    # the old keyword of estimate folds into the Step's field, naming the new spelling (Note [flat keywords])
    with pytest.warns(FutureWarning, match=r"write step=autofit\.Step\(clip_grad_norm=0\.5\)"):
        flat = autofit.estimate(model, x, step=2, clip_grad_norm=0.5, loss_fn=_loss, optimizer=optimizer, device="cpu")
    assert flat.peak_bytes == measured
    with pytest.warns(FutureWarning):
        assert gather("estimate", {"step": 2}, {"clip_grad_norm": 0.5}, groups=STEP_GROUPS)["step"] == kw["step"]


@pytest.mark.sim
def test_fp16_step_unscales_and_checks_for_inf_before_clipping():
    """torch/amp/grad_scaler.py: ``unscale_`` runs ``torch._amp_foreach_non_finite_check_and_unscale_`` per
    (device, dtype) group; the AMP recipe clips after it; ``update`` runs ``torch._amp_update_scale_``."""
    sim = _simulate(_mlp(), "cuda", "adamw", precision="fp16", clip_grad_norm=1.0)
    ops = _optimizer_ops(sim)
    order = [ops.index(name) for name in ("_amp_foreach_non_finite_check_and_unscale_", "_foreach_norm",
                                          "_foreach_sqrt", "_amp_update_scale_")]
    assert order == sorted(order)
    assert ops.count("_amp_foreach_non_finite_check_and_unscale_") == 1  # scaler.step does not unscale again


@pytest.mark.parametrize("bad", [0, -1.0, "1.0", True])
def test_clip_grad_norm_must_be_positive(bad):
    with pytest.raises(InvalidInputError, match="clip_grad_norm"):
        make_step_config(micro_batch_size=1, clip_grad_norm=bad)


@pytest.mark.sim
def test_trainer_clips_exactly_like_clip_grad_norm_():
    """The trainer's step equals a plain step with ``torch.nn.utils.clip_grad_norm_`` before ``optimizer.step``."""
    model, x = _mlp(), torch.randn(8, 64)
    plan = autofit.plan(model, x, "1GB", batch_size=8, loss_fn=_loss, device="cpu", precision="fp32",
                        optimizer="sgd", clip_grad_norm=0.01)
    assert plan.clip_grad_norm == 0.01
    assert autofit.Plan.from_json(plan.to_json()).clip_grad_norm == 0.01
    reference = copy.deepcopy(model)
    trainer = plan.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=_loss)
    trainer.step(x)
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    _loss(reference(x)).backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01)
    assert norm > 0.01  # the clip did act
    opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)
