"""torchtitan's per-op recomputation policy, "op-selective" (issue 58, Note [torchtitan's per-op policy] in
autofit/training/recompute.py): which matmuls it recomputes, counted by hand against torch's own checkpoint; the
estimate of a small Llama against the CPU allocator (``autofit.measure``); the CLI's spelling, the plan's JSON and the
torchtitan export."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy, checkpoint

import autofit
from autofit.core.errors import InvalidInputError
from autofit.training.recompute import POLICIES, op_selective_context, op_selective_policy
from autofit.training.step import make_step_config

TOLERANCE = 0.005  # estimate against measure (the bar)


# ---- which matmuls: a hand count against torch.utils.checkpoint ------------------------------------------------------
ROWS = 3
WIDTHS = (5, 7, 11, 13, 17)  # input, then the four matmuls' outputs: every shape tells its matmul apart


class FourMatmuls(nn.Module):
    """Four ``mm`` calls in a row, each output read by a ``sin`` (which saves it): the recomputation needs them all."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(a, b)) for a, b in zip(WIDTHS, WIDTHS[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            x = torch.sin(torch.mm(x, w))
        return x


class _Recomputed(TorchDispatchMode):
    """Records, during backward, which of the forward's matmuls run again: an ``mm`` whose second argument is one of
    the weights itself (the gradients' matmuls read the weights transposed, or not at all)."""

    def __init__(self, weights) -> None:
        super().__init__()
        self.weights, self.rerun = list(weights), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.mm.default:
            for i, w in enumerate(self.weights):
                if args[1].data_ptr() == w.data_ptr() and args[1].shape == w.shape and args[1].stride() == w.stride():
                    self.rerun.append(i + 1)
        return func(*args, **(kwargs or {}))


def _rerun_matmuls(context_fn, calls: int = 1) -> list[int]:
    """The matmuls (1-4, per call) torch's non-reentrant checkpoint runs again in backward under ``context_fn``."""
    torch.manual_seed(0)
    module = FourMatmuls()
    x = torch.randn(ROWS, WIDTHS[0], requires_grad=True)
    kwargs = {} if context_fn is None else {"context_fn": context_fn}
    out = sum(checkpoint(module, x, use_reentrant=False, **kwargs).sum() for _ in range(calls))
    mode = _Recomputed(module.weights)
    with mode:
        out.backward()
    return sorted(mode.rerun)


def test_op_selective_recomputes_every_second_matmul_by_hand() -> None:
    # torch's checkpoint without a policy reruns all four; "op-selective" keeps the outputs of the 1st and 3rd mm of
    # the call and reruns the 2nd and 4th (torchtitan: "Saves output of all compute ops, except every second mm")
    assert _rerun_matmuls(None) == [1, 2, 3, 4]
    assert _rerun_matmuls(op_selective_context) == [2, 4]
    # the count starts again at every checkpointed call: two calls rerun the 2nd and 4th of each
    assert _rerun_matmuls(op_selective_context, calls=2) == [2, 2, 4, 4]


def test_op_selective_keeps_two_of_four_outputs_by_hand() -> None:
    # the saved tensors the policy stores, counted at torch's checkpoint boundary: the storage that torch's
    # create_selective_checkpoint_contexts fills (its policy answers MUST_SAVE) holds two mm outputs, 3 x 7 and 3 x 13
    kept = []

    def recording(ctx, op, *args, **kwargs):
        policy = op_selective_policy(counts, ctx, op, *args, **kwargs)
        if policy is CheckpointPolicy.MUST_SAVE:
            kept.append(tuple(ctx.op_output.shape))
        return policy

    counts = [0, 0]
    context = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, recording)
    torch.manual_seed(0)
    module, x = FourMatmuls(), torch.randn(ROWS, WIDTHS[0], requires_grad=True)
    checkpoint(module, x, use_reentrant=False, context_fn=context).sum().backward()
    assert kept == [(ROWS, WIDTHS[1]), (ROWS, WIDTHS[3])]


def test_op_selective_save_list_follows_torchtitan() -> None:
    aten, counts = torch.ops.aten, [0, 0]
    forward = type("Ctx", (), {"is_recompute": False})()
    for op in (aten._scaled_dot_product_flash_attention.default, aten._scaled_dot_product_efficient_attention.default,
               aten._scaled_dot_product_flash_attention_for_cpu.default, aten.max.default,
               torch.ops._c10d_functional.reduce_scatter_tensor.default):
        assert op_selective_policy(counts, forward, op) is CheckpointPolicy.MUST_SAVE, op
    # matched by overload as torchtitan does: a linear with a bias (addmm), bmm and the pointwise ops are recomputed
    for op in (aten.addmm.default, aten.bmm.default, aten.max.dim, aten.silu.default, aten.mul.Tensor):
        assert op_selective_policy(counts, forward, op) is CheckpointPolicy.PREFER_RECOMPUTE, op
    assert counts == [0, 0]


def test_op_selective_is_a_checkpoint_policy() -> None:
    assert "op-selective" in POLICIES
    config = make_step_config(micro_batch_size=2, checkpoint={"a": "full", "b": "selective", "c": "op-selective"})
    assert (config.checkpoint, config.selective, config.op_selective) == (("a", "b", "c"), ("b",), ("c",))
    assert [config.policy(n) for n in "abc"] == ["full", "selective", "op-selective"]
    with pytest.raises(InvalidInputError, match="op-selective"):
        make_step_config(micro_batch_size=2, checkpoint={"a": "op"})
    with pytest.raises(InvalidInputError, match="op_selective names modules that are not recomputed"):
        autofit.training.step.StepConfig(micro_batch_size=2, checkpoint=("a",), op_selective=("b",))


# ---- a small Llama: the estimate against the CPU allocator -----------------------------------------------------------
LENGTH, VOCAB = 128, 128


def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=LENGTH))


def _tokens(rows: int = 8) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (rows, LENGTH), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.sim
def test_op_selective_llama_estimate_matches_measure() -> None:
    model, sample = _llama(), _tokens()
    policies = {f"model.layers.{i}": "op-selective" for i in range(2)}
    est = autofit.estimate(model, sample, step=autofit.Step(micro_batch_size=8, checkpoint=policies))
    meas = autofit.measure(model, sample, step=autofit.Step(micro_batch_size=8, checkpoint=policies))
    assert abs(est.peak_bytes / meas.peak_bytes - 1) <= TOLERANCE, (est.peak_bytes, meas.peak_bytes)
    # measured: it keeps less than "selective" (half the projections' outputs) and more than full recomputation
    selective = autofit.measure(model, sample,
                                step=autofit.Step(micro_batch_size=8, checkpoint=dict.fromkeys(policies, "selective")))
    full = autofit.measure(model, sample, step=autofit.Step(micro_batch_size=8, checkpoint=list(policies)))
    assert full.peak_bytes < meas.peak_bytes < selective.peak_bytes, (
        full.peak_bytes, meas.peak_bytes, selective.peak_bytes)


# ---- what the analysis says "op-selective" keeps: a hand count ------------------------------------------------------
D, S = 16, 8  # width and sequence length of the residual MLP below


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # without biases, as a Llama's projections: each linear of a (rows, S, D) input runs one aten.mm
        self.fc1, self.fc2 = nn.Linear(D, 4 * D, bias=False), nn.Linear(4 * D, D, bias=False)

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
def test_op_selective_kept_bytes_of_a_residual_mlp_by_hand() -> None:
    # In blocks.0, per sample (fp32, 4 bytes): full recomputation drops fc1's mm output (S x 4D, saved by gelu) and
    # gelu's (S x 4D, saved by fc2's mm). "selective" keeps both mm outputs, fc1's and fc2's (S x D, which only the
    # residual add reads): S x 5D x 4 B. "op-selective" keeps the 1st mm of the call, fc1's, and recomputes the 2nd,
    # fc2's: S x 4D x 4 B.
    torch.manual_seed(0)
    analysis = autofit.analyse(Residual(), torch.randn(4, S, D), loss_fn=_square_mean)
    call = next(c for c in analysis.profile.calls if c.name == "blocks.0" and c.micro == 0)
    assert call.saved[1] == 2 * S * 4 * D * 4
    assert call.kept[1] == S * 5 * D * 4
    assert call.kept_op[1] == S * 4 * D * 4 and call.kept_op[0] == 0
    # and the CPU allocator agrees with the estimate of the step
    x = torch.randn(8, S, D)
    policies = {"blocks.0": "op-selective", "blocks.1": "op-selective"}
    est = autofit.estimate(Residual(), x, loss_fn=_square_mean,
                           step=autofit.Step(micro_batch_size=8, checkpoint=policies))
    meas = autofit.measure(Residual(), x, loss_fn=_square_mean,
                           step=autofit.Step(micro_batch_size=8, checkpoint=policies))
    assert abs(est.peak_bytes / meas.peak_bytes - 1) <= TOLERANCE, (est.peak_bytes, meas.peak_bytes)


# ---- plan, JSON and the torchtitan export ----------------------------------------------------------------------------
@pytest.mark.sim
def test_plan_with_op_selective_layers_round_trips_and_exports() -> None:
    from autofit.emit.export import to_torchtitan_config

    model, sample = _llama(), _tokens()
    policies = {f"model.layers.{i}": "op-selective" for i in range(2)}
    plan = autofit.plan(model, sample, budget="1GB", device="cpu", precision="fp32",
                        savers=autofit.Savers(checkpoint=policies))
    assert plan.op_selective == tuple(policies) and plan.checkpoint_policies == policies
    assert "(op-selective)" in str(plan)
    assert plan.step.op_selective == tuple(policies)
    again = autofit.Plan.from_json(plan.to_json())
    assert again == plan and again.checkpoint_policies == policies
    # torchtitan's spelling of its own per-op policy (ActivationCheckpointConfig: mode, selective_ac_option)
    assert to_torchtitan_config(plan)["activation_checkpoint"] == {"mode": "selective", "selective_ac_option": "op"}
    # the CPU allocator's peak of the plan's step, against the plan's figure
    meas = autofit.measure(model, sample,
                           step=autofit.Step(micro_batch_size=plan.micro_batch_size,
                                             accumulation_steps=plan.gradient_accumulation_steps,
                                             checkpoint=plan.checkpoint_policies))
    assert abs(plan.peak_bytes / meas.peak_bytes - 1) <= TOLERANCE, (plan.peak_bytes, meas.peak_bytes)
    # the trainer runs the policy: one step's gradients equal a plain full-batch step's (SGD moves by lr x grad)
    import copy
    ref, ours = copy.deepcopy(model), copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    ref(**sample).loss.backward()
    opt.step()
    plan.wrap(ours, torch.optim.SGD(ours.parameters(), lr=0.5)).step(sample)
    for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


def test_cli_reads_op_selective() -> None:
    from types import SimpleNamespace

    from autofit.cli.estimate import _checkpoint
    from autofit.cli.render import _recomputed

    assert _checkpoint(None, ["a:op-selective", "b", "c:selective"]) == {
        "a": "op-selective", "b": "full", "c": "selective"}
    with pytest.raises(InvalidInputError, match="op-selective"):
        _checkpoint(None, ["a:op"])
    plan = SimpleNamespace(checkpoint=("m.layers.0", "m.layers.1"), checkpoint_policy=lambda n: "op-selective")
    assert _recomputed(plan).splitlines() == ["m.layers.* x 2 (op-selective)"]
