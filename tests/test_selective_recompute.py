"""Selective recomputation (issue 27, autofit/training/recompute.py): the policy, the bytes the analysis says it keeps (against
a hand computation), the three-choice checkpoint MILP (against brute force), the estimate (against the CPU allocator
through ``autofit.measure``), and plans for a Llama- and a GPT-2-shaped model (gradients against a plain full-batch
step)."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy

import autofit
from autofit.analyse.recompute_costs import recompute_costs
from autofit.core.errors import InvalidInputError
from autofit.emit.export import EXPORTERS
from autofit.training.recompute import SAVED_OPS, selective_policy
from autofit.solve.checkpoint_milp import CheckpointProblem, brute_force_checkpoint, solve_checkpoint
from autofit.training.step import make_step_config

transformers = pytest.importorskip("transformers")

TOLERANCE = 0.005  # estimate against measure (the bar)


# ---- the policy -----------------------------------------------------------------------------------------------------
def test_policy_keeps_matmul_and_attention_and_recomputes_pointwise_ops() -> None:
    aten = torch.ops.aten
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default,
               aten._scaled_dot_product_flash_attention_for_cpu.default):
        assert selective_policy(None, op) is CheckpointPolicy.MUST_SAVE, op
    for op in (aten.mul.Tensor, aten.add.Tensor, aten.silu.default, aten.gelu.default, aten.rsqrt.default,
               aten._softmax.default, aten.native_dropout.default):
        assert selective_policy(None, op) is CheckpointPolicy.PREFER_RECOMPUTE, op
    # the CPU kernel of scaled_dot_product_attention on this build is among the kept ops
    assert aten._scaled_dot_product_flash_attention_for_cpu in SAVED_OPS


def test_checkpoint_mapping_and_bad_policy() -> None:
    config = make_step_config(micro_batch_size=2, checkpoint={"a": "full", "b": "selective"})
    assert (config.checkpoint, config.selective) == (("a", "b"), ("b",))
    with pytest.raises(InvalidInputError, match="policy of 'a'"):
        make_step_config(micro_batch_size=2, checkpoint={"a": "ops"})
    with pytest.raises(InvalidInputError, match="selective"):
        autofit.training.step.StepConfig(micro_batch_size=2, checkpoint=("a",), selective=("b",))


# ---- what the analysis says a selective recomputation keeps: a hand computation ------------------------------------
D, S = 16, 8  # width and sequence length of the residual MLP below


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def _square_mean(output: torch.Tensor) -> torch.Tensor:
    return output.pow(2).mean()


@pytest.mark.sim
def test_kept_bytes_of_a_residual_mlp_by_hand() -> None:
    # In blocks.0, per sample (fp32, 4 bytes): fc1's addmm output (S x 4D) is saved by gelu, gelu's output (S x 4D)
    # by fc2's matmul: full recomputation drops both, 2 x S x 4D x 4 B. A selective one keeps fc1's output (an addmm)
    # and also fc2's (an addmm), which the plain run frees after the residual add but the checkpoint's storage holds
    # until the block's backward: S x (4D + D) x 4 B kept (torch/utils/checkpoint.py, _CachingTorchDispatchMode).
    torch.manual_seed(0)
    analysis = autofit.analyse(Residual(), torch.randn(4, S, D), loss_fn=_square_mean)
    call = next(c for c in analysis.profile.calls if c.name == "blocks.0" and c.micro == 0)
    assert call.saved[1] == 2 * S * 4 * D * 4
    assert call.kept[1] == S * (4 * D + D) * 4
    assert call.kept[0] == 0 and call.saved[0] == 0
    # the same per policy, at b = 5, with the block's input (S x D) that every policy holds; FLOPs: the two addmm
    # (2 x rows x in x out each, torch/utils/flop_counter.py addmm_flop) are the only ones the registry counts, and
    # the selective recomputation reruns neither
    costs = recompute_costs(analysis, "blocks.0", 5)
    rows, x = 5 * S, 5 * S * D * 4
    assert (costs.held_none, costs.held_selective, costs.held_full) == (
        x + 5 * 2 * S * 4 * D * 4, x + 5 * S * 5 * D * 4, x)
    assert costs.full_flops == 2 * (2 * rows * D * 4 * D)
    assert costs.selective_flops == 0 and 0 < costs.selective_ops < costs.full_ops


@pytest.mark.sim
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_residual_mlp_estimate_matches_measure(policy: str) -> None:
    torch.manual_seed(0)
    model, x = Residual(), torch.randn(8, S, D)
    checkpoint = {"blocks.0": policy, "blocks.1": policy}
    est = autofit.estimate(model, x, step=autofit.Step(micro_batch_size=8, checkpoint=checkpoint), loss_fn=_square_mean)
    meas = autofit.measure(model, x, step=autofit.Step(micro_batch_size=8, checkpoint=checkpoint), loss_fn=_square_mean)
    assert abs(est.peak_bytes / meas.peak_bytes - 1) <= TOLERANCE, (est.peak_bytes, meas.peak_bytes)


# ---- the three-choice MILP against brute force -----------------------------------------------------------------------
def _three_choice_problem(rng: np.random.Generator) -> CheckpointProblem:
    """Modules each as a full unit and a selective one (less dropped, cheaper), some nested."""
    modules = int(rng.integers(1, 6))
    rows = int(rng.integers(1, 6))
    base = rng.integers(10_000, 1_000_000, size=rows).astype(float)
    full = np.where(rng.random((rows, modules)) < 0.6, -rng.integers(0, 300_000, size=(rows, modules)), 0)
    positive = rng.random((rows, modules)) < 0.15
    full[positive] = rng.integers(0, 50_000, size=int(positive.sum()))
    share = rng.random(modules)  # the part of a module's drop a selective recomputation keeps
    # whole bytes, as real tables have (CheckpointProblem.peak truncates to int)
    selective = np.where(full < 0, np.ceil(full * (1 - share[None, :])), full)
    coef = np.hstack([full, selective]).astype(float)
    full_cost = rng.integers(1, 8, size=modules).astype(float)
    costs = np.concatenate([full_cost, np.floor(full_cost * rng.random(modules))])
    names = tuple(f"m{i}" for i in range(modules)) * 2
    nested = [(a, d) for a in range(modules) for d in range(modules) if a != d and rng.random() < 0.1]
    exclusive = tuple((a + i * modules, d + j * modules) for a, d in nested for i in (0, 1) for j in (0, 1))
    groups = tuple((m, m + modules) for m in range(modules))
    return CheckpointProblem(names, costs, base, coef, exclusive, ("full",) * modules + ("selective",) * modules,
                             groups)


@pytest.mark.sim  # hundreds of MILPs against brute force: near the quick budget
def test_three_choice_milp_agrees_with_brute_force() -> None:
    rng = np.random.default_rng(20261124)
    checked = feasible = selective = 0
    for trial in range(250):
        problem = _three_choice_problem(rng)
        n = len(problem.names)
        peaks = [problem.peak(c) for r in range(n + 1) for c in itertools.combinations(range(n), r)
                 if problem.allowed(c)]
        for budget in {int(rng.integers(int(min(peaks) * 0.9), int(problem.peak(()) * 1.05) + 2)),
                       int(rng.choice(peaks))}:
            milp, brute = solve_checkpoint(problem, budget), brute_force_checkpoint(problem, budget)
            where = f"trial {trial}, budget {budget}: milp {milp}, brute {brute}"
            checked += 1
            assert (milp is None) == (brute is None), where
            if milp is None:
                continue
            feasible += 1
            selective += any(problem.policy(i) == "selective" for i in milp)
            assert problem.allowed(milp), where  # one policy per module, nesting respected
            assert problem.peak(milp) <= budget, where
            assert problem.cost(milp) == pytest.approx(problem.cost(brute), abs=1e-9), where
    assert checked >= 300 and feasible >= 150 and selective >= 30, (checked, feasible, selective)


def test_one_policy_per_module_even_when_both_would_help() -> None:
    # one module, one stretch: full drops 60, selective drops 30; together they would drop 90 and cost 1 + 0:
    # forbidden, so at budget 30 (needs a drop of 70) nothing fits
    problem = CheckpointProblem(("m", "m"), np.array([1.0, 0.0]), np.array([100.0]), np.array([[-60.0, -30.0]]),
                                (), ("full", "selective"), ((0, 1),))
    assert solve_checkpoint(problem, 70) == (1,)  # selective is enough and cheaper
    assert solve_checkpoint(problem, 40) == (0,)
    assert solve_checkpoint(problem, 30) is None
    assert brute_force_checkpoint(problem, 30) is None


# ---- plans for a Llama- and a GPT-2-shaped model ---------------------------------------------------------------------
ROWS, LENGTH, VOCAB = 8, 128, 128


def _tokens() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def _llama() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=LENGTH))


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=LENGTH, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


BUILDERS = {"llama": (_llama, "model.layers"), "gpt2": (_gpt2, "transformer.h")}


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_selective_layers_estimate_matches_measure(arch: str) -> None:
    build, layers = BUILDERS[arch]
    model, sample = build(), _tokens()
    checkpoint = {f"{layers}.{i}": "selective" for i in range(2)}
    est = autofit.estimate(model, sample, step=autofit.Step(micro_batch_size=ROWS, checkpoint=checkpoint))
    meas = autofit.measure(model, sample, step=autofit.Step(micro_batch_size=ROWS, checkpoint=checkpoint))
    assert abs(est.peak_bytes / meas.peak_bytes - 1) <= TOLERANCE, (est.peak_bytes, meas.peak_bytes)
    # selective lies between none and full, measured
    full = autofit.measure(model, sample, step=autofit.Step(micro_batch_size=ROWS, checkpoint=list(checkpoint)))
    none = autofit.measure(model, sample, step=ROWS)
    assert full.peak_bytes < meas.peak_bytes < none.peak_bytes, (full.peak_bytes, meas.peak_bytes, none.peak_bytes)


def _sgd_step(model: nn.Module, step) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    step(opt)


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_selective_plan_beats_module_level_and_fits(arch: str) -> None:
    build, _ = BUILDERS[arch]
    model, sample = build(), _tokens()
    # a budget where the whole batch does not fit as one micro-batch without recomputation
    plain = autofit.estimate(model, sample, step=ROWS).peak_bytes
    budget = int(plain * 0.8)
    plan = autofit.plan(model, sample, budget=budget, device="cpu", precision="fp32", optimizer="adamw")
    assert plan.checkpoint and plan.selective, str(plan)
    # the same run searched module-level recomputation only: slower (time model) under the same budget
    assert plan.module_level_step_seconds is not None, str(plan)
    assert plan.predicted_step_seconds < plan.module_level_step_seconds, str(plan)
    line = next(ln for ln in str(plan).splitlines() if ln.strip().startswith("checkpointed"))
    assert "(selective)" in line or f"{len(plan.selective)} selective" in line, line
    exports = {name: export(plan) for name, export in EXPORTERS.items()}
    assert exports["hf"]["autofit_checkpoint_policies"] == plan.checkpoint_policies
    assert exports["lightning"]["autofit_checkpoint_policies"] == plan.checkpoint_policies
    assert any("no op-level policy" in n for n in exports["deepspeed"]["autofit_notes"])
    again = autofit.Plan.from_json(plan.to_json())
    assert again.selective == plan.selective and again.checkpoint_policies == plan.checkpoint_policies
    # the CPU allocator's peak of exactly this step fits, and the estimate is within 0.5 % of it
    knobs = dict(step=autofit.Step(micro_batch_size=plan.micro_batch_size,
                                   accumulation_steps=plan.gradient_accumulation_steps,
                                   checkpoint=plan.checkpoint_policies))
    meas = autofit.measure(model, sample, **knobs)
    est = autofit.estimate(model, sample, **knobs)
    assert abs(est.peak_bytes / meas.peak_bytes - 1) <= TOLERANCE, (est.peak_bytes, meas.peak_bytes)
    if plan.gradient_accumulation_steps == 1:  # measure holds one micro-batch's rows, the trainer the whole batch
        assert meas.peak_bytes <= budget, (meas.peak_bytes, budget)
    # gradients: the plan's trainer against a plain full-batch step (SGD: parameters move by lr x gradient)
    ref, ours = copy.deepcopy(model), copy.deepcopy(model)

    def plain_step(opt):
        ref(**sample).loss.backward()
        opt.step()

    _sgd_step(ref, plain_step)
    _sgd_step(ours, lambda opt: plan.wrap(ours, opt).step(sample))
    for (name, a), b, b0 in zip(ours.named_parameters(), ref.parameters(), model.parameters()):
        assert not torch.equal(b, b0), name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


def test_cli_groups_recomputed_modules_by_policy() -> None:
    from types import SimpleNamespace

    from autofit.cli.render import _recomputed

    plan = SimpleNamespace(checkpoint=("model.layers.0", "model.layers.1", "model.layers.2.mlp"),
                           checkpoint_policy=lambda n: "full" if n.endswith("mlp") else "selective")
    assert _recomputed(plan).splitlines() == ["model.layers.2.mlp (full)", "model.layers.* x 2 (selective)"]
