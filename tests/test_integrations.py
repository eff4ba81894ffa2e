"""Plans applied inside Hugging Face's Trainer and Lightning's Trainer, trained for a few steps on the CPU.

The truths are the libraries' own behaviour, not autofit's output: the optimizer steps they count, the batches
they feed (forward calls seen by hooks), torch's checkpoint semantics (a module inside a recomputed one runs its
forward twice per micro-batch, once more in backward), the dtype autocast gives, and parity with an unpatched run.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import set_checkpoint_early_stop

import autofit
from autofit.core.errors import InvalidInputError
from autofit.emit.export import to_hf_training_arguments
from autofit.options import Options
from autofit.planner import plan_with_analysis
from autofit.request import make_request

ROWS, SEQ, BATCH = 16, 16, 8


def _accumulating_plan(model, sample, precision, **kw) -> autofit.Plan:
    """A plan that accumulates and checkpoints: the budget lies between the peaks of the two largest front entries
    that accumulate, so the larger of them fits only with some of its activations recomputed."""
    options = Options.of(device="cpu", precision=precision)
    full, _ = plan_with_analysis(make_request(model, sample, "4GB", options=options, batch_size=BATCH, **kw))
    smaller = sorted((alt.peak_bytes for alt in full.frontier if alt.micro_batch_size < BATCH), reverse=True)
    assert len(smaller) >= 2, "the front should offer smaller micro-batches"
    plan = autofit.plan(model, sample, (smaller[0] + smaller[1]) // 2, batch_size=BATCH, device="cpu",
                        precision=precision, **kw)
    assert plan.gradient_accumulation_steps > 1 and plan.checkpoint
    return plan


def _half_batch_plan(model, sample, checkpoint: tuple[str, ...], precision, **kw) -> autofit.Plan:
    """A plan of two micro-batches of BATCH // 2 with the given modules checkpointed (Lightning's DataLoader cannot
    split a batch unevenly): the budget is that configuration's modelled peak on the front plus a quarter of a row
    (the front is modelled; the plan's peak is verified by a simulation, so the budget needs a little room)."""
    options = Options.of(device="cpu", precision=precision, savers=autofit.Savers(checkpoint=checkpoint))
    full, _ = plan_with_analysis(make_request(model, sample, "4GB", options=options, batch_size=BATCH, **kw))
    peak = {alt.micro_batch_size: alt.peak_bytes for alt in full.frontier}
    assert BATCH // 2 in peak and BATCH in peak, "the front should offer the whole batch and half of it"
    budget = peak[BATCH // 2] + (peak[BATCH] - peak[BATCH // 2]) // (4 * (BATCH - BATCH // 2))
    plan = autofit.plan(model, sample, budget, batch_size=BATCH, device="cpu", precision=precision,
                        savers=autofit.Savers(checkpoint=checkpoint), **kw)
    assert (plan.micro_batch_size, plan.gradient_accumulation_steps, plan.checkpoint) == (BATCH // 2, 2, checkpoint)
    return plan


def _count_forwards(model: nn.Module) -> dict[str, int]:
    counts = {name: 0 for name, _ in model.named_modules()}
    for name, module in model.named_modules():
        module.register_forward_hook(lambda m, i, o, name=name: counts.__setitem__(name, counts[name] + 1))
    return counts


def _expected_forwards(plain: dict[str, int], checkpoint: tuple[str, ...]) -> dict[str, int]:
    """From the forward calls of a run without checkpointing: torch.utils.checkpoint (non-reentrant) reruns the
    checkpointed module's forward in backward, so the hooks of every module strictly inside it fire twice; the
    checkpointed module's own hook fires once (its __call__ runs once, the recomputation calls the original forward
    directly). Recomputation stops early once it has what backward needs unless early stop is off (the tests turn
    it off with torch.utils.checkpoint.set_checkpoint_early_stop(False), see torch/utils/checkpoint.py)."""
    def inside(name: str) -> bool:
        return any(name.startswith(c + ".") for c in checkpoint)

    return {name: n * (2 if inside(name) else 1) for name, n in plain.items()}


def _instance_forwards(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if "forward" in m.__dict__]


# ---- Hugging Face ---------------------------------------------------------------------------------------------


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=SEQ,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return transformers, transformers.GPT2LMHeadModel(config)


def _hf_train(transformers, model, args, callbacks, data):
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train()
    return trainer


@pytest.mark.sim
def test_hf_trainer_runs_the_plan_and_checkpoints_exactly_its_modules(tmp_path):
    transformers, model = _tiny_gpt2()
    from autofit.integrations.hf import AutofitCallback, training_arguments

    ids = torch.randint(0, 100, (ROWS, SEQ))
    data = [{"input_ids": row, "labels": row} for row in ids]
    plan = _accumulating_plan(model, {"input_ids": ids[:2], "labels": ids[:2]}, precision="fp32")
    args = training_arguments(plan, transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no", logging_strategy="no",
        num_train_epochs=1, learning_rate=1e-2, disable_tqdm=True, seed=0, data_seed=0, dataloader_drop_last=True))
    assert args.gradient_checkpointing is False  # HF's switch would recompute every layer, not the plan's modules
    reference = copy.deepcopy(model)
    counts, plain = _count_forwards(model), _count_forwards(reference)

    with set_checkpoint_early_stop(False):
        trainer = _hf_train(transformers, model, args, [AutofitCallback(plan)], data)
    _hf_train(transformers, reference, args, [], data)  # the same training without the plan's checkpointing

    assert trainer.state.global_step == ROWS // plan.batch_size  # one optimizer step per effective batch
    assert plain["lm_head"] == ROWS // plan.micro_batch_size  # HF fed the plan's micro-batches
    assert counts == _expected_forwards(plain, plan.checkpoint)  # exactly the plan's modules were recomputed
    assert _instance_forwards(model) == []  # the patch is gone after train()
    # recomputation changes memory, not arithmetic
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.sim
def test_hf_callback_refuses_arguments_that_are_not_the_plans(tmp_path):
    transformers, model = _tiny_gpt2()
    from autofit.integrations.hf import AutofitCallback

    ids = torch.randint(0, 100, (4, SEQ))
    plan = autofit.plan(model, {"input_ids": ids[:2], "labels": ids[:2]}, "4GB", batch_size=4, device="cpu",
                        precision="fp32")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], save_strategy="no",
                                          per_device_train_batch_size=plan.micro_batch_size + 1)
    with pytest.raises(InvalidInputError, match="per_device_train_batch_size"):
        _hf_train(transformers, model, args, [AutofitCallback(plan)], [{"input_ids": r, "labels": r} for r in ids])


@pytest.mark.sim
def test_hf_export_leaves_hf_checkpointing_off():
    _, model = _tiny_gpt2()
    ids = torch.randint(0, 100, (2, SEQ))
    plan = autofit.plan(model, {"input_ids": ids, "labels": ids}, "4GB", batch_size=4, device="cpu",
                        savers=autofit.Savers(checkpoint=("transformer.h.0.mlp",)))
    exported = to_hf_training_arguments(plan)
    assert exported["training_arguments"]["activation_checkpointing"] is False
    assert exported["autofit_checkpoint_modules"] == ["transformer.h.0.mlp"]


# ---- Lightning ------------------------------------------------------------------------------------------------


def _lightning_module(pl):
    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            # per-token layers over 128 tokens: activations, not parameters, decide the peak
            self.net = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Sequential(nn.Linear(256, 256), nn.GELU()),
                                     nn.Linear(256, 4))

        def forward(self, x):
            return self.net(x).mean(1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    return Classifier()


@pytest.mark.sim
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_lightning_callback_sets_accumulation_precision_and_checkpointing(precision):
    pl = pytest.importorskip("lightning.pytorch")
    from autofit.integrations.lightning import AutofitLightningCallback

    module = _lightning_module(pl)
    x, y = torch.randn(ROWS, 128, 32), torch.randint(0, 4, (ROWS,))
    plan = _half_batch_plan(module, x[:2], ("net.2",), target=y[:2], loss_fn=nn.functional.cross_entropy,
                            precision=precision, optimizer="sgd")
    counts = _count_forwards(module)
    dtypes = set()
    module.net[0].register_forward_hook(lambda m, i, o: dtypes.add(o.dtype))
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=plan.micro_batch_size)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[AutofitLightningCallback(plan)])
    with set_checkpoint_early_stop(False):
        trainer.fit(module, loader)

    assert trainer.accumulate_grad_batches == plan.gradient_accumulation_steps
    assert trainer.global_step == ROWS // plan.batch_size
    assert trainer.precision == {"fp32": "32-true", "bf16": "bf16-mixed"}[precision]
    assert dtypes == {torch.float32 if precision == "fp32" else torch.bfloat16}  # autocast really ran
    plain = {name: ROWS // plan.micro_batch_size for name, _ in module.named_modules()}  # all run once per batch
    assert counts == _expected_forwards(plain, plan.checkpoint)
    assert _instance_forwards(module) == []


@pytest.mark.sim
def test_lightning_callback_checks_the_dataloader_batch():
    pl = pytest.importorskip("lightning.pytorch")
    from autofit.integrations.lightning import AutofitLightningCallback

    module = _lightning_module(pl)
    x, y = torch.randn(ROWS, 128, 32), torch.randint(0, 4, (ROWS,))
    plan = _half_batch_plan(module, x[:2], ("net.2",), target=y[:2], loss_fn=nn.functional.cross_entropy,
                            precision="fp32", optimizer="sgd")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    trainer = pl.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[AutofitLightningCallback(plan)])
    with pytest.raises(InvalidInputError, match="batch_size=plan.micro_batch_size"):
        trainer.fit(module, loader)


@pytest.mark.parametrize("module,attribute,package", [("autofit.integrations.hf", "AutofitCallback", "transformers"),
                                                      ("autofit.integrations.lightning", "AutofitLightningCallback",
                                                       "lightning")])
def test_a_missing_library_is_a_typed_error_naming_the_install(monkeypatch, module, attribute, package):
    import importlib
    import sys

    try:
        integration = importlib.import_module(module)
    except InvalidInputError as e:  # an environment without the library: importing says so already
        assert f"needs {package}: pip install" in str(e), e
        return
    # the class is built (and kept) on first use: drop a built one without building it (getattr would)
    monkeypatch.delitem(vars(integration), attribute, raising=False)
    for name in ("transformers", "lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)  # import of a None entry raises ImportError
    with pytest.raises(InvalidInputError, match=f"needs {package}: pip install"):
        getattr(integration, attribute)


@pytest.mark.sim
def test_plan_patches_offloads_the_plans_modules_as_the_trainer_does(monkeypatch):
    """A callback's loop runs the step the plan verified: its offloaded modules' forwards run under the host
    context (``save_on_cpu``), each once per call and no other module's, and leaving the patch restores them."""
    import contextlib
    from dataclasses import replace

    import autofit.training.activation_offload as offload
    from autofit.integrations import plan_patches

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(8, 16)
    plan = autofit.plan(model, x, "1GB", batch_size=8, device="cpu", precision="fp32",
                        loss_fn=lambda out: out.sum())
    plan = replace(plan, offload=("0",))
    assert plan.step.offload == ("0",)
    entered = []

    def spy(device, *args, **kwargs):
        entered.append(device)
        return contextlib.nullcontext()

    monkeypatch.setattr(offload, "saved_on_host", spy)
    with plan_patches(plan, model) as patched:
        patched(x).sum().backward()
        patched(x).sum().backward()
    assert entered == ["cpu", "cpu"]
    assert all("forward" not in m.__dict__ for m in model)


@pytest.mark.sim
def test_a_plan_that_keeps_its_states_on_the_host_is_refused_by_every_callback():
    """FSDP2 on one process with the parameters, gradients and optimizer state in host memory (``offload_states``,
    Note [offload]) fits only as ``fully_shard`` with ``CPUOffloadPolicy`` lays the model out, which ``wrap()`` does
    and another loop does not: the callbacks let such a plan through (only FSDP2 over several ranks was refused), and
    Hugging Face's or Lightning's Trainer then trained the whole model on the GPU, over the plan's budget."""
    from autofit.integrations import checked_plan, plan_patches
    from autofit.parallel.layout import Parallel

    model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    plan = autofit.plan(model, torch.randn(4, 16), "1GB", target=torch.randint(0, 4, (4,)), device="cpu",
                        precision="fp32")
    on_host = dataclasses.replace(plan, parallel=Parallel(strategy="fsdp2", world_size=1, offload_states=True,
                                                          shard_units=("",)))
    with pytest.raises(InvalidInputError, match="keeps the parameters, gradients and optimizer state in host memory"):
        checked_plan(on_host, "AutofitCallback")
    with pytest.raises(InvalidInputError, match="plan.wrap"):
        plan_patches(on_host, model)
    # FSDP2 over several ranks, refused as before, by the callbacks' construction too
    sharded = dataclasses.replace(plan, parallel=Parallel(strategy="fsdp2", world_size=2, shard_units=("",)))
    with pytest.raises(InvalidInputError, match="shards the model over 2 ranks"):
        checked_plan(sharded, "AutofitLightningCallback")


def test_the_layout_says_which_loops_and_how_many_processes_can_run_it():
    """The integrations ask the layout (issue 54): ``Parallel.refuse_for_callback`` refuses FSDP2 for every loop but
    ``wrap()``'s, ``Parallel.other_ranks`` words a job of another size; the messages are the integrations' own."""
    from autofit.parallel.layout import Parallel

    for runs in (Parallel(), Parallel(strategy="ddp", world_size=2)):
        runs.refuse_for_callback("AutofitCallback")  # whole replicas: any loop applies them
    with pytest.raises(InvalidInputError) as e:
        Parallel(strategy="fsdp2", world_size=4, shard_units=("",)).refuse_for_callback("AutofitCallback")
    assert str(e.value) == ("this plan shards the model over 4 ranks, which AutofitCallback does not apply: train it "
                            "with plan.wrap(model, optimizer)")
    with pytest.raises(InvalidInputError) as e:
        Parallel(strategy="fsdp2", offload_states=True, shard_units=("",)).refuse_for_callback("another loop")
    assert str(e.value) == ("this plan keeps the parameters, gradients and optimizer state in host memory (FSDP2's "
                            "CPUOffloadPolicy), which another loop does not apply: train it with "
                            "plan.wrap(model, optimizer)")
    ddp = Parallel(strategy="ddp", world_size=2)
    assert ddp.other_ranks(2, "{ranks} for {planned}") is None
    assert ddp.other_ranks(1, "world_size={ranks} (the plan is for {planned} processes)") == (
        "world_size=1 (the plan is for 2 processes)")
