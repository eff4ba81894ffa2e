"""The command line as people read it: --task for module-only factories, --version, help text, messages in CLI
words, one-line warnings, grouped checkpointed modules, piped tables, ambiguous GPU names."""

from __future__ import annotations

import io
import re
from importlib.metadata import version
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn
from typer.testing import CliRunner

import autofit
from autofit.cli.app import app
from autofit.cli.messages import cli_words, gpu_note, one_line_warnings
from autofit.cli.render import group_names
from autofit.cli.tasks import causal_lm_loss, masked_lm_loss, regression_loss

ROOT = Path(__file__).resolve().parent.parent
FACTORY = f"{ROOT / 'examples' / 'factories.py'}:small_cnn"
runner = CliRunner()

MODULE_ONLY = '''
import torch
from torch import nn

def classifier():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 5))

class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50)
    def forward(self, ids):
        return self.head(self.embed(ids))

def lm():
    return LM()
'''


@pytest.fixture()
def factories(tmp_path) -> Path:
    path = tmp_path / "module_only.py"
    path.write_text(MODULE_ONLY)
    return path


@pytest.mark.sim
@pytest.mark.parametrize("factory,task,shape", [("classifier", "classification", "16"),
                                                ("classifier", "regression", "16"),
                                                ("lm", "causal-lm", "12"), ("lm", "masked-lm", "12")])
def test_task_plans_a_factory_that_returns_only_a_model(factories, factory, task, shape):
    result = runner.invoke(app, ["plan", f"{factories}:{factory}", "--task", task, "--input-shape", shape,
                                 "--budget", "50MB", "--batch-size", "8", "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    assert autofit.Plan.from_json(result.stdout[result.stdout.index("{"):]).batch_size == 8


@pytest.mark.sim
def test_task_verify_trains_a_module_only_factory(factories):
    result = runner.invoke(app, ["verify", f"{factories}:lm", "--task", "causal-lm", "--input-shape", "12",
                                 "--budget", "50MB", "--batch-size", "4", "--steps", "1"])
    assert result.exit_code == 0, result.output
    assert "measured peak" in result.output


def test_unknown_task_exits_2(factories):
    result = runner.invoke(app, ["plan", f"{factories}:classifier", "--task", "ranking", "--input-shape", "16",
                                 "--budget", "50MB", "--batch-size", "8", "--device", "cpu"])
    assert result.exit_code == 2 and "classification" in result.output


def test_task_losses_match_hugging_face_and_hand_computation():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    ids = torch.randint(0, 40, (3, 10))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=40))
    out = gpt2(input_ids=ids, labels=ids)  # HF shifts the labels itself (ForCausalLMLoss)
    torch.testing.assert_close(causal_lm_loss(out, ids), out.loss)
    bert = transformers.BertForMaskedLM(transformers.BertConfig(num_hidden_layers=1, hidden_size=16,
                                                                num_attention_heads=2, intermediate_size=32,
                                                                vocab_size=40))
    labels = ids.masked_fill(torch.rand(ids.shape) < 0.5, -100)
    out = bert(input_ids=ids, labels=labels)
    torch.testing.assert_close(masked_lm_loss(out, labels), out.loss)
    pred, target = torch.tensor([[1.0, 3.0], [2.0, 2.0]]), torch.tensor([1.0, 0.0])
    assert regression_loss(pred, target).item() == pytest.approx((0 + 4 + 4 + 4) / 4)


def test_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"autofit {version('torch-autofit')}"


def test_help_shows_model_and_no_bool_metavar():
    result = runner.invoke(app, ["plan", "--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0
    # MODEL is optional since plan --from FILE reads the model from a training config
    assert re.search(r"Usage: \S+ plan \[OPTIONS\] \[MODEL\]", result.output), result.output  # runner: "root"
    assert "{model}" not in result.output.lower() and "<bool>" not in result.output


def test_messages_use_cli_flags():
    result = runner.invoke(app, ["plan", FACTORY, "--budget", "50MB", "--batch-size", "32", "--device", "cpu",
                                 "--world-size", "3"])
    assert result.exit_code == 2 and "--world-size 3" in result.output and "world_size" not in result.output
    assert cli_words("micro_batch_size and batch_size") == "micro_batch_size and --batch-size"


@pytest.mark.sim
def test_batch_norm_warning_is_one_line_without_a_source_path():
    model, sample, target = torch.nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(),
                                                nn.LazyLinear(2)), torch.randn(2, 3, 8, 8), torch.tensor([0, 1])
    model(sample)  # materialise the lazy layer
    plan = autofit.plan(model, sample, "1GB", batch_size=8, target=target, loss_fn=F.cross_entropy,
                        device="cpu", savers=autofit.Savers(checkpoint=None))
    # the same plan split in two micro-batches: the trainer warns that BatchNorm statistics are per micro-batch
    plan = autofit.Plan.from_json(plan.to_json().replace('"micro_batch_size": 8', '"micro_batch_size": 4')
                                  .replace('"gradient_accumulation_steps": 1', '"gradient_accumulation_steps": 2'))
    out = io.StringIO()
    with one_line_warnings(Console(file=out, width=80)):
        plan.wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=F.cross_entropy).unwrap()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warning: ") and "BatchNorm" in lines[0]
    assert ".py" not in lines[0] and "warnings.warn" not in lines[0]


def test_checkpointed_modules_are_grouped_like_the_layer_table():
    names = tuple(f"model.layers.{i}.input_norm" for i in range(32)) + ("model.norm",) + tuple(
        f"model.layers.{i}.mlp" for i in range(3))
    assert group_names(names) == ["model.layers.*.input_norm x 32", "model.norm", "model.layers.*.mlp x 3"]


@pytest.mark.slow
def test_piped_tables_keep_names_whole():
    pytest.importorskip("transformers")
    result = runner.invoke(app, ["plan", "hf:gpt2", "--config", "n_layer=2", "--config", "n_embd=64",
                                 "--config", "n_head=2", "--config", "vocab_size=1000", "--input-shape", "64",
                                 "--budget", "1GB", "--batch-size", "4", "--device", "cpu"],
                           env={"HF_HUB_OFFLINE": "1"})
    assert result.exit_code == 0, result.output
    table_names = re.findall(r"│ (transformer\S*|lm_head)\s", result.output)
    assert table_names, result.output
    known = {re.sub(r"\.\d+(?=\.|$)", ".*", n) for n in _gpt2_module_names()}
    assert set(table_names) <= known  # every name printed whole, none folded mid-word
    assert sum(line.startswith("model: ") for line in result.output.splitlines()) == 1


def _gpt2_module_names():
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2,
                                                                     vocab_size=1000))
    return [name for name, _ in model.named_modules() if name]


@pytest.mark.sim
def test_ambiguous_gpu_name_says_which_part():
    assert gpu_note("A100") == "--gpu A100 means the A100-80GB; for the A100-40GB say --gpu A100-40GB"
    assert gpu_note("V100").startswith("--gpu V100 means the V100-32GB") and gpu_note("A100-40GB") is None
    result = runner.invoke(app, ["plan", FACTORY, "--budget", "90%", "--batch-size", "32", "--gpu", "A100"])
    assert result.exit_code == 0 and "A100-80GB" in result.output and "A100-40GB" in result.output


def test_verify_materialises_tied_weights_tied():
    # issue 30's gpt2 case: to_empty untied lm_head from wte, and verify measured a model the plan was not made for
    from autofit.cli.verify import materialise

    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50, bias=False))
    model[1].weight = model[0].weight
    real = materialise(model, torch.device("cpu"))
    assert real[1].weight is real[0].weight and real[0].weight.device.type == "cpu"
    assert len(list(real.parameters())) == 1  # as many parameters as the planned (meta) model has


def test_the_lengths_table_counts_the_micro_batches_of_a_data_rank():
    """Rows per micro-batch at shorter lengths: a data-parallel rank's rows over them. Under tensor parallel T 2 over
    4 ranks two data ranks train 16 rows, 8 each (a tensor-parallel group's ranks share theirs): by hand 8 / 4 = 2
    micro-batches at the sample's length, 8 / 8 = 1 at half of it."""
    from dataclasses import replace

    from autofit.cli.render import lengths_table
    from autofit.core.report import MemoryEstimate
    from autofit.parallel.layout import Parallel
    from autofit.training.precision import PrecisionPolicy

    plan = autofit.Plan(micro_batch_size=4, gradient_accumulation_steps=2, batch_size=16, last_micro_batch_size=4,
                        precision=PrecisionPolicy(name="fp32"), checkpoint=(), peak_bytes=1, device_bytes=1,
                        budget_bytes=1, device="cpu", optimizer="adamw", predicted_step_seconds=0.0,
                        estimate=MemoryEstimate(peak_bytes=1, breakdown={}), rows_by_length=((128, 4), (64, 8)),
                        parallel=Parallel(strategy="fsdp2", world_size=4, tensor_parallel=2,
                                          tensor_plan=(("0", "colwise"),)))
    assert plan.parallel.data_ranks == 2
    assert list(lengths_table(plan).columns[3].cells) == ["2", "1"]
    one = replace(plan, parallel=Parallel())  # one process trains all 16: 4 and 2 micro-batches
    assert list(lengths_table(one).columns[3].cells) == ["4", "2"]
