"""Which card to rent (issue 57): ``autofit.compare`` and ``autofit plan --gpu A,B,C --price ...``.

The truths: each card's row against the single-card ``autofit.plan`` of the same model (the planner's ordinary path,
run outside any sharing), the cost per million tokens worked by hand from the plan's step time, the catalog's list,
and the number of times the analysis stage runs, counted by wrapping the stage function."""

from __future__ import annotations

import importlib
import json
import shlex
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from typer.testing import CliRunner

import autofit
from autofit.cli.app import app
from autofit.compare import SAMPLES, TOKENS, cards, parse_prices
from autofit.cuda.catalog import GPUS

HERE = Path(__file__).resolve().parent
runner = CliRunner()
FOUR = ("RTX-4090", "L40S", "A100-80GB", "H100")
PRICES = {"RTX-4090": 0.69, "L40S": 0.99, "A100-80GB": 1.79, "H100": 2.99}


def tiny_llama():
    """A two-layer Llama built from its config (hidden 64, vocab 128), 4 rows of 32 tokens (the CLI factory)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                                      attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (4, 32))
    return model, {"input_ids": ids, "labels": ids.clone()}


def tiny_mlp():
    """Feature vectors, no sequence: throughput in samples."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    return model, torch.randn(16, 256), torch.randint(0, 10, (16,))


def _single(model, sample, budget, card, **kw):
    try:
        return autofit.plan(model, sample, budget, device=autofit.Device(gpu=card), **kw)
    except autofit.InfeasibleBudgetError as e:
        return e


# ---- (a) rows against single plans, (b) the cost by hand, (c) the order --------------------------------------------

# 538 MiB: below the quick path's 540 MiB, so every card is analysed and searched (the H100's workspace misses it:
# its single plan climbs every rung to name its smallest budget, about 60 s)
@pytest.mark.parametrize("budget", [pytest.param("90%", marks=pytest.mark.sim),
                                    pytest.param("538MiB", marks=pytest.mark.slow)])
def test_each_row_is_the_single_plan_of_its_card(budget):
    model, sample = tiny_llama()
    rows = autofit.compare(model, sample, budget, gpus=FOUR, batch_size=16, prices=PRICES)
    assert sorted(r.gpu for r in rows) == sorted(autofit.gpu_spec(c).name for c in FOUR)
    for row in rows:
        single = _single(model, sample, budget, row.gpu, batch_size=16)
        if isinstance(single, autofit.InfeasibleBudgetError):
            assert not row.fits and row.plan is None and row.min_budget_bytes == single.min_budget_bytes
            continue
        assert row.fits
        assert (row.device_bytes, row.micro_batch_size, row.accumulation_steps) == (
            single.device_bytes, single.micro_batch_size, single.gradient_accumulation_steps)
        assert row.plan.peak_bytes == single.peak_bytes and row.plan.checkpoint == single.checkpoint
        assert row.step_seconds == single.predicted_step_seconds
        # (b) tokens per step = 16 rows x 32 tokens; cost = price / 3600 x step time / tokens per step x 10^6
        assert row.unit == TOKENS and row.items_per_step == 16 * 32
        assert row.cost_per_million == pytest.approx(
            PRICES[next(c for c in FOUR if autofit.gpu_spec(c).name == row.gpu)] / 3600
            * single.predicted_step_seconds / (16 * 32) * 1e6)
        assert row.items_per_second == pytest.approx(16 * 32 / single.predicted_step_seconds)
    if budget == "538MiB":
        assert any(not r.fits for r in rows) and any(r.fits for r in rows)
    # (c) cards with a plan first, cheapest first; cards without a plan last
    planned = [r for r in rows if r.plan is not None]
    assert rows[:len(planned)] == tuple(planned)
    costs = [r.cost_per_million for r in planned]
    assert costs == sorted(costs)


@pytest.mark.sim
def test_without_prices_rows_go_by_throughput_and_priceless_cards_after_priced_ones():
    model, sample = tiny_llama()
    rows = autofit.compare(model, sample, "90%", gpus=FOUR, batch_size=16)
    speeds = [r.items_per_second for r in rows]
    assert speeds == sorted(speeds, reverse=True) and all(r.cost_per_million is None for r in rows)
    rows = autofit.compare(model, sample, "90%", gpus=FOUR, batch_size=16, prices=["L40S=0.99"])
    assert rows[0].gpu == "L40S" and rows[0].cost_per_million is not None
    assert all(r.cost_per_million is None for r in rows[1:])
    later = [r.items_per_second for r in rows[1:]]
    assert later == sorted(later, reverse=True)


@pytest.mark.sim
def test_a_sample_without_a_sequence_counts_samples():
    model, sample, target = tiny_mlp()
    rows = autofit.compare(model, sample, "90%", gpus="RTX-4090,H100", target=target, prices={"RTX-4090": 1.0})
    assert all(r.unit == SAMPLES and r.items_per_step == 16 for r in rows)
    row = next(r for r in rows if r.gpu == "RTX-4090")
    assert row.cost_per_million == pytest.approx(1.0 / 3600 * row.plan.predicted_step_seconds / 16 * 1e6)


# ---- what cards of one group share: the analysis and the full simulations -------------------------------------------

@pytest.mark.sim  # four single plans and a comparison at a budget the quick path misses
def test_cards_of_one_group_analyse_once_and_share_simulations(monkeypatch):
    """Counted by wrapping the stage functions: four cards whose attention kernels agree analyse the model once in
    a comparison, against once per card alone, and run fewer full simulations (Note [one analysis for several
    cards]); the rows equal the single plans (``test_each_row_is_the_single_plan_of_its_card``)."""
    analyse = importlib.import_module("autofit.analyse.analyse")
    run = importlib.import_module("autofit.simulate.run")
    analyses, simulations = [], []
    real_analyse, real_step = analyse._analyse, run._hooked_step

    def counted_analyse(*args, **kwargs):
        analyses.append(kwargs.get("device_rules"))
        return real_analyse(*args, **kwargs)

    def counted_step(*args, **kwargs):
        simulations.append(kwargs.get("observer"))
        return real_step(*args, **kwargs)

    monkeypatch.setattr(analyse, "_analyse", counted_analyse)
    monkeypatch.setattr(run, "_hooked_step", counted_step)
    model, sample = tiny_llama()
    cards = ("RTX-4090", "L40S", "A100-80GB", "L4")  # sm89, sm89, sm80, sm89: the same attention kernels
    for card in cards:
        _single(model, sample, "538MiB", card, batch_size=16)
    alone_simulations = len(simulations)
    assert len(analyses) == len(cards)  # the quick path misses at 538 MiB: one precision analysed per plan
    analyses.clear(), simulations.clear()
    rows = autofit.compare(model, sample, "538MiB", gpus=cards, batch_size=16)
    assert all(r.fits for r in rows)  # each card searched and verified: its own plan
    assert len(analyses) == 1
    assert len(simulations) < alone_simulations, (len(simulations), alone_simulations)


def test_an_analysis_with_torch_ops_in_its_graph_is_kept_as_a_copy():
    """The memo keeps a pickle (every answer a fresh copy). A traced graph names torch's operators; pickled by value
    an operator drags in its dispatch table, whose decorated decompositions do not pickle (the analysis of any model
    trained with a cross-entropy loss was then not shared). The copy names the very operators torch holds."""
    from autofit.core.shared import _fresh, _frozen
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten._log_softmax.default, (x, -1, False))
    graph.output(graph.call_function(torch.ops.aten.nll_loss_forward.default, (y, x, None, 1, -100)))
    with pytest.raises(Exception):  # what the memo met before: the default pickler refuses the operator
        import pickle
        pickle.dumps(torch.ops.aten.nll_loss_forward.default)
    frozen = _frozen({"graph": graph})
    assert frozen is not None
    copy = _fresh(frozen)["graph"]
    assert copy is not graph
    assert [n.target for n in copy.nodes if n.op == "call_function"] == [
        torch.ops.aten._log_softmax.default, torch.ops.aten.nll_loss_forward.default]
    assert all(a is b for a, b in zip([n.target for n in copy.nodes if n.op == "call_function"],
                                      [torch.ops.aten._log_softmax.default, torch.ops.aten.nll_loss_forward.default]))


@pytest.mark.sim
def test_a_size_budget_applies_to_every_card_and_a_smaller_card_says_so():
    model, sample, target = tiny_mlp()
    rows = autofit.compare(model, sample, "30GiB", gpus="RTX-4090,A100-80GB", target=target)
    big, small = rows
    assert big.gpu == "A100-80GB" and big.fits and big.budget_bytes == 30 * 2**30
    assert small.gpu == "RTX-4090" and not small.fits and small.plan is None
    assert "more than the card's memory, 24.00 GiB" in small.why
    shares = autofit.compare(model, sample, "50%", gpus="RTX-4090,A100-80GB", target=target)
    assert {r.gpu: r.budget_bytes for r in shares} == {"RTX-4090": 12 * 2**30, "A100-80GB": 40 * 2**30}


# ---- (d) typed errors, (e) the catalog ----------------------------------------------------------------------------

def test_a_price_for_a_card_not_compared_is_refused_naming_it():
    with pytest.raises(autofit.InvalidInputError, match=r"price is given for H200.*not among the cards"):
        autofit.compare(nn.Linear(2, 2), torch.zeros(2, 2), "90%", gpus=FOUR, prices={"H200": 3.5})


@pytest.mark.parametrize("text, message", [
    ("RTX-4090", r"--price 'RTX-4090': give CARD=USD_PER_HOUR"),
    ("RTX-4090=cheap", r"price of RTX-4090: 'cheap' is not a number"),
    ("RTX-4090=-1", r"must be a finite number of dollars >= 0"),
    ("=0.5", r"give CARD=USD_PER_HOUR"),
])
def test_bad_price_text_is_refused(text, message):
    with pytest.raises(autofit.InvalidInputError, match=message):
        parse_prices([text])


def test_prices_read_repeated_and_comma_separated_by_catalog_name():
    assert parse_prices(["RTX-4090=0.69,L40S=0.99", "h100=$2.99"]) == {"RTX-4090": 0.69, "L40S": 0.99,
                                                                      "H100-80GB": 2.99}


def test_an_unknown_card_in_the_list_names_the_near_miss():
    with pytest.raises(autofit.InvalidInputError, match=r"unknown GPU 'RTX-4900', did you mean 'RTX-4090'\?"):
        cards("L40S,RTX-4900")
    with pytest.raises(autofit.InvalidInputError, match=r"unknown GPU 'L40X', did you mean 'L40'\?"):
        cards(["L40X"])


def test_all_is_the_catalog():
    assert cards("all") == tuple(GPUS) and cards(" ALL ") == tuple(GPUS)
    assert cards("4090, rtx4090,A100") == ("RTX-4090", "A100-80GB")  # names resolved, duplicates dropped


@pytest.mark.sim  # every card of the catalog: 27 plans of a two-layer Llama, from three analyses' worth of work
def test_the_cli_all_covers_the_catalog_as_json():
    result = runner.invoke(app, ["plan", f"{HERE / 'test_compare_cards.py'}:tiny_llama", "--budget", "90%", "-n",
                                 "16", "--gpu", "all", "--json", "-q"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout.strip().splitlines()[-1])
    assert sorted(r["gpu"] for r in rows) == sorted(GPUS)
    assert all(r["fits"] and r["unit"] == "tokens" and r["items_per_step"] == 16 * 32 for r in rows)


# ---- (f) the command line ------------------------------------------------------------------------------------------

@pytest.mark.sim
def test_the_cli_table_on_a_tiny_model():
    args = ["plan", f"{HERE / 'test_compare_cards.py'}:tiny_llama", "--budget", "90%", "-n", "16",
            "--gpu", "RTX-4090,L40S,A100-80GB,H100", "--price", "RTX-4090=0.69", "--price", "L40S=0.99,H100=2.99", "-q"]
    result = runner.invoke(app, args, env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    out = result.output
    for header in ("card", "fits", "layout", "micro x accum", "peak on device", "step s", "tok/s", "$/M tokens"):
        assert header in out
    lines = [line for line in out.splitlines() if re.match(r"│ (RTX-4090|L40S|A100-80GB|H100-80GB) ", line)]
    assert [line.split("│")[1].strip() for line in lines][-1] == "A100-80GB"  # the card without a price last
    a100 = lines[-1].split("│")
    assert a100[-2].strip() == "-" and a100[-3].strip() == "-"  # no price, no cost: a dash
    assert "budget 90% of each card" in out and "none are built in" in out
    json_rows = json.loads(runner.invoke(app, [*args, "--json"]).stdout.strip().splitlines()[-1])
    assert [r["gpu"] for r in json_rows] == [line.split("│")[1].strip() for line in lines]


def test_the_cli_refuses_what_belongs_to_one_card():
    result = runner.invoke(app, ["plan", "hf:gpt2", "--budget", "90%", "-n", "4", "--input-shape", "32",
                                 "--gpu", "RTX-4090,L40S", "--export", "hf"])
    assert result.exit_code == 2 and "--export applies to one card's plan" in result.output
    result = runner.invoke(app, ["plan", "hf:gpt2", "--budget", "90%", "-n", "4", "--input-shape", "32",
                                 "--gpu", "RTX-4090,L40S", "--price", "H100=2.99"])
    assert result.exit_code == 2 and "price is given for H100-80GB" in result.output


def test_the_recipe_command_parses():
    text = (HERE.parent / "docs" / "recipes.md").read_text()
    block = re.search(r"### Which card to rent.*?```sh\n(.*?)```", text, re.S).group(1)
    args = shlex.split(block.replace("\\\n", " "))[1:]
    import typer

    command = typer.main.get_command(app).commands[args[0]]
    ctx = command.make_context(args[0], list(args[1:]))
    assert cards(ctx.params["gpu"]) == ("RTX-4090", "L40S", "A100-80GB", "H100-80GB")
    assert set(parse_prices(ctx.params["price"])) == {"RTX-4090", "L40S", "A100-80GB", "H100-80GB"}


# ---- item 5: the note of a GPU name ---------------------------------------------------------------------------------

def test_a_name_of_one_card_gets_no_note_and_a_family_gets_each_value():
    # the model spec fails after the note is printed: the command's own behaviour, no planning
    result = runner.invoke(app, ["plan", "no_such_module_x:f", "--budget", "90%", "-n", "4", "--gpu", "RTX4090"])
    assert result.exit_code == 2 and "note:" not in result.output and "RTX-3090" not in result.output
    result = runner.invoke(app, ["plan", "no_such_module_x:f", "--budget", "90%", "-n", "4", "--gpu", "H100"])
    assert ("note: --gpu H100 means the H100-80GB; for the H100-PCIe say --gpu H100-PCIe, for the H100-NVL say "
            "--gpu H100-NVL") in result.output
    result = runner.invoke(app, ["plan", "no_such_module_x:f", "--budget", "90%", "-n", "4", "--gpu", "rtx6000"])
    assert "note: --gpu rtx6000 means the RTX-6000-Ada" in result.output and "RTX-3090" not in result.output


@pytest.mark.parametrize("parallel, words", [
    (dict(), "1 GPU"),
    (dict(strategy="ddp", world_size=4), "ddp"),
    (dict(strategy="fsdp2", world_size=8), "fsdp2 (ZeRO-3)"),
    (dict(strategy="fsdp2", world_size=8, offload_states=True), "fsdp2 (ZeRO-3), states on the host"),
    (dict(strategy="fsdp2", world_size=8, reshard_after_forward=False), "fsdp2 (ZeRO-2)"),
])
def test_a_cards_layout_in_words(parallel, words):
    """A row's layout column (``autofit compare``'s table, its JSON): "1 GPU" for one process, the plan's layout in
    words otherwise, ", states on the host" where the plan keeps its states there: written out by hand."""
    from autofit.compare import CardRow
    from autofit.core.report import MemoryEstimate
    from autofit.parallel.layout import Parallel
    from autofit.training.precision import PrecisionPolicy

    plan = autofit.Plan(
        micro_batch_size=1, gradient_accumulation_steps=1, batch_size=8, last_micro_batch_size=1,
        precision=PrecisionPolicy(name="fp32"), checkpoint=(), peak_bytes=1, device_bytes=1, budget_bytes=1,
        device="cuda", optimizer="adamw", predicted_step_seconds=1.0,
        estimate=MemoryEstimate(peak_bytes=1, breakdown={}), parallel=Parallel(**parallel))
    assert CardRow(gpu="H100", fits=True, budget_bytes=1, plan=plan).layout == words
