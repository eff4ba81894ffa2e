"""The offline table of Hugging Face checkpoints (autofit/cli/hf_checkpoints.py): every family's model, built on the
meta device from the table, has the parameter count its authors published. The figures are the model cards', the
papers', or the Hub's own count of the published weights (the "Model size: N params" a model page shows, read from
the safetensors files), each with its source; the tolerance is half a unit of the figure's last digit (published
"0.49B" -> 0.49e9 +- 0.005e9), so the check is as strict as the figure allows."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from autofit.cli.hf_checkpoints import CHECKPOINTS, TABLE, checkpoint_config, find_checkpoint

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")


@dataclass(frozen=True, kw_only=True)
class Published:
    name: str
    figure: str  # as published: "0.49B", "129M", or an exact integer
    source: str
    count: str = "total"  # total, non-embedding, embedding, active (MoE: per token)
    head: str = "AutoModelForCausalLM"
    significant: int | None = None  # digits that count when the figure ends in zeros ("110M" as two digits)

    @property
    def bounds(self) -> tuple[float, float]:
        """The figure's rounding interval: "0.49B" -> [0.485e9, 0.495e9]; an exact integer -> itself."""
        text = self.figure.replace(",", "")
        if text.isdigit():
            return float(text), float(text)
        number, unit = text[:-1].replace(",", ""), {"M": 1e6, "B": 1e9}[text[-1]]
        decimals = len(number.split(".")[1]) if "." in number else 0
        if self.significant is not None:
            decimals = self.significant - len(number.split(".")[0])
        half = 0.5 * 10 ** -decimals
        return (float(number) - half) * unit, (float(number) + half) * unit


PUBLISHED = [
    # Qwen model cards, "Number of Parameters: X (Y non-embedding)"
    Published(name="Qwen/Qwen2.5-0.5B", figure="0.49B", source="Qwen2.5-0.5B card"),
    Published(name="Qwen/Qwen2.5-0.5B", figure="0.36B", count="non-embedding", source="Qwen2.5-0.5B card"),
    Published(name="Qwen/Qwen2.5-1.5B", figure="1.54B", source="Qwen2.5-1.5B card"),
    Published(name="Qwen/Qwen2.5-1.5B", figure="1.31B", count="non-embedding", source="Qwen2.5-1.5B card"),
    Published(name="Qwen/Qwen2.5-3B", figure="3.09B", source="Qwen2.5-3B card"),
    Published(name="Qwen/Qwen2.5-3B", figure="2.77B", count="non-embedding", source="Qwen2.5-3B card"),
    # (the 7B card's total, "7.61B", is the count 7,615,616,512 cut rather than rounded; its non-embedding figure
    # is rounded)
    Published(name="Qwen/Qwen2.5-7B", figure="6.53B", count="non-embedding", source="Qwen2.5-7B card"),
    Published(name="Qwen/Qwen2-0.5B", figure="0.49B", source="Qwen2 blog post, model table"),
    Published(name="Qwen/Qwen3-0.6B", figure="0.6B", source="Qwen3-0.6B card"),
    Published(name="Qwen/Qwen3-0.6B", figure="0.44B", count="non-embedding", source="Qwen3-0.6B card"),
    Published(name="Qwen/Qwen3-1.7B", figure="1.4B", count="non-embedding", source="Qwen3-1.7B card"),
    Published(name="Qwen/Qwen3-4B", figure="3.6B", count="non-embedding", source="Qwen3-4B card"),
    Published(name="Qwen/Qwen3-8B", figure="8.2B", source="Qwen3-8B card"),
    Published(name="Qwen/Qwen3-8B", figure="6.95B", count="non-embedding", source="Qwen3-8B card"),
    Published(name="Qwen/Qwen3-14B", figure="13.2B", count="non-embedding", source="Qwen3-14B card"),
    Published(name="Qwen/Qwen3-32B", figure="31.2B", count="non-embedding", source="Qwen3-32B card"),
    # Gemma papers count embeddings apart. Their embedding figures use the 256128-entry vocabulary of the original
    # checkpoints (the Hub's config.json says 256000), their non-embedding figures are exact integers.
    Published(name="google/gemma-2b", figure="1,981,884,416", count="non-embedding",
              source="Gemma report (arXiv 2403.08295), Table 2"),
    Published(name="google/gemma-7b", figure="7,751,248,896", count="non-embedding",
              source="Gemma report (arXiv 2403.08295), Table 2"),
    Published(name="google/gemma-2-2b", figure="2,024,517,888", count="non-embedding",
              source="Gemma 2 report (arXiv 2408.00118), Table 2"),
    Published(name="google/gemma-2-2b", figure="2.61B", source="Hub page of google/gemma-2-2b"),
    Published(name="google/gemma-2-9b", figure="8,324,201,984", count="non-embedding",
              source="Gemma 2 report (arXiv 2408.00118), Table 2"),
    Published(name="google/gemma-2-27b", figure="26,047,480,320", count="non-embedding",
              source="Gemma 2 report (arXiv 2408.00118), Table 2"),
    Published(name="google/gemma-3-1b-pt", figure="302M", count="embedding",
              source="Gemma 3 report (arXiv 2503.19786), Table 1"),
    Published(name="google/gemma-3-1b-pt", figure="698M", count="non-embedding",
              source="Gemma 3 report (arXiv 2503.19786), Table 1"),
    # the vision-language sizes: the report counts the language model's non-embedding parameters apart from the
    # vision encoder (417M); the Hub counts the whole checkpoint
    *(Published(name=f"google/gemma-3-{size}-it", figure=figure, count="language non-embedding",
                source="Gemma 3 report (arXiv 2503.19786), Table 1")
      for size, figure in [("4b", "3,209M"), ("12b", "10,759M"), ("27b", "25,600M")]),
    Published(name="google/gemma-3-4b-it", figure="417M", count="vision",
              source="Gemma 3 report (arXiv 2503.19786), Table 1: vision encoder"),
    *(Published(name=f"google/gemma-3-{size}-it", figure=figure, source=f"Hub page of google/gemma-3-{size}-it")
      for size, figure in [("4b", "4.3B"), ("12b", "12.2B"), ("27b", "27.4B")]),
    # Phi
    Published(name="microsoft/phi-2", figure="2.78B", source="Hub page of microsoft/phi-2"),
    Published(name="microsoft/Phi-3-mini-4k-instruct", figure="3.8B",
              source="Phi-3 report (arXiv 2404.14219): phi-3-mini, 3.8 billion parameters"),
    Published(name="microsoft/Phi-3.5-mini-instruct", figure="3.8B", source="Phi-3.5-mini-instruct card"),
    Published(name="microsoft/phi-4", figure="14.7B", source="Hub page of microsoft/phi-4"),
    Published(name="microsoft/Phi-4-mini-instruct", figure="3.8B",
              source="Phi-4-mini-instruct card: a 3.8B-parameter dense decoder-only Transformer"),
    # Qwen3 mixtures of experts: the cards' "Number of Parameters: X in total and Y activated" and non-embedding
    # figures (the 30B-A3B's "3.3B activated" is 3,353M cut, not rounded: not checked)
    Published(name="Qwen/Qwen3-30B-A3B", figure="30.5B", source="Qwen3-30B-A3B card"),
    Published(name="Qwen/Qwen3-30B-A3B", figure="29.9B", count="non-embedding", source="Qwen3-30B-A3B card"),
    Published(name="Qwen/Qwen3-235B-A22B", figure="235B", source="Qwen3-235B-A22B card"),
    Published(name="Qwen/Qwen3-235B-A22B", figure="234B", count="non-embedding", source="Qwen3-235B-A22B card"),
    Published(name="Qwen/Qwen3-235B-A22B", figure="22B", count="active", source="Qwen3-235B-A22B card"),
    # Llama
    Published(name="meta-llama/Llama-3.2-3B", figure="3.21B", source="Llama 3.2 card, model information table"),
    Published(name="meta-llama/Llama-3.1-8B", figure="8,030,261,248",
              source="Hub page of meta-llama/Llama-3.1-8B (8.03B), the same shapes as Meta-Llama-3-8B"),
    Published(name="meta-llama/Llama-3.3-70B-Instruct", figure="70.6B", source="Hub page of Llama-3.3-70B-Instruct"),
    Published(name="meta-llama/Llama-3.1-405B", figure="406B", source="Hub page of meta-llama/Llama-3.1-405B"),
    Published(name="HuggingFaceTB/SmolLM3-3B", figure="3.08B", source="Hub page of HuggingFaceTB/SmolLM3-3B"),
    Published(name="TinyLlama/TinyLlama-1.1B-Chat-v1.0", figure="1.1B", source="TinyLlama card"),
    Published(name="HuggingFaceTB/SmolLM2-135M", figure="135M", source="SmolLM2 card"),
    Published(name="HuggingFaceTB/SmolLM2-360M", figure="362M", source="Hub page of SmolLM2-360M"),
    Published(name="HuggingFaceTB/SmolLM-1.7B", figure="1.7B", source="SmolLM blog post / card"),
    # Mistral AI
    Published(name="mistralai/Mistral-7B-v0.3", figure="7.25B", source="Hub page of mistralai/Mistral-7B-v0.3"),
    Published(name="mistralai/Mixtral-8x7B-v0.1", figure="46.7B",
              source="Mixtral of experts blog post: 46.7B total parameters"),
    Published(name="mistralai/Mixtral-8x7B-v0.1", figure="12.9B", count="active",
              source="Mixtral of experts blog post: only uses 12.9B parameters per token"),
    Published(name="mistralai/Mixtral-8x22B-v0.1", figure="141B", source="Mixtral 8x22B blog post"),
    Published(name="mistralai/Mixtral-8x22B-v0.1", figure="39B", count="active", source="Mixtral 8x22B blog post"),
    Published(name="mistralai/Mistral-Nemo-Base-2407", figure="12B", source="Mistral NeMo card: 12B"),
    Published(name="mistralai/Mistral-Small-24B-Base-2501", figure="23.6B",
              source="Hub page of mistralai/Mistral-Small-24B-Base-2501"),
    Published(name="mistralai/Mistral-Small-Instruct-2409", figure="22.2B",
              source="Hub page of mistralai/Mistral-Small-Instruct-2409"),
    # DeepSeek
    Published(name="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", figure="1.78B",
              source="Hub page of DeepSeek-R1-Distill-Qwen-1.5B"),
    Published(name="deepseek-ai/DeepSeek-R1-Distill-Qwen-7B", figure="7.62B",
              source="Hub page of DeepSeek-R1-Distill-Qwen-7B"),
    Published(name="deepseek-ai/deepseek-coder-6.7b-base", figure="6.7B", source="DeepSeek Coder card"),
    Published(name="deepseek-ai/deepseek-coder-1.3b-base", figure="1.3B", source="DeepSeek Coder card"),
    Published(name="deepseek-ai/deepseek-llm-7b-base", figure="7B", source="DeepSeek LLM card"),
    Published(name="deepseek-ai/DeepSeek-V2-Lite", figure="15.7B",
              source="DeepSeek-V2-Lite card: 15.7B total parameters"),
    Published(name="deepseek-ai/DeepSeek-V3", figure="671B",
              source="DeepSeek-V3 report (arXiv 2412.19437): 671B total parameters (the Hub's 685B adds the MTP "
                     "module, which transformers does not build)"),
    # Pythia's card lists exact totals
    *(Published(name=f"EleutherAI/pythia-{size}", figure=figure, source="Pythia card, model table (total params)")
      for size, figure in [("70m", "70,426,624"), ("160m", "162,322,944"), ("410m", "405,334,016"),
                           ("1b", "1,011,781,632"), ("1.4b", "1,414,647,808"), ("2.8b", "2,775,208,960"),
                           ("6.9b", "6,857,302,016"), ("12b", "11,846,072,320")]),
    Published(name="state-spaces/mamba-130m-hf", figure="129M", source="Hub page of state-spaces/mamba-130m-hf"),
    # the classic checkpoints (their published counts, as tests/test_cli_hf_names.py has them)
    Published(name="gpt2", figure="124M", source="GPT-2 small, 124M"),
    Published(name="t5-small", figure="60.5M", source="Hub page of google-t5/t5-small", head="AutoModelForSeq2SeqLM"),
    Published(name="facebook/opt-125m", figure="125M", source="OPT paper, Table 1"),
    # encoders (headless models: what the cards count)
    Published(name="bert-base-uncased", figure="110M", source="BERT paper: BERT-base 110M (two figures)",
              head="AutoModel", significant=2),
    Published(name="roberta-base", figure="125M", source="RoBERTa card", head="AutoModel"),
    Published(name="distilbert-base-uncased", figure="66M", source="DistilBERT paper: 66M", head="AutoModel"),
    Published(name="microsoft/deberta-v3-base", figure="98M", count="embedding", head="AutoModel",
              source="DeBERTa-v3-base card: 98M parameters in the Embedding layer"),
    Published(name="microsoft/deberta-v3-large", figure="131M", count="embedding", head="AutoModel",
              source="DeBERTa-v3-large card: 131M parameters in the Embedding layer"),
    Published(name="answerdotai/ModernBERT-base", figure="149M", source="ModernBERT card", head="AutoModel"),
    Published(name="answerdotai/ModernBERT-large", figure="395M", source="ModernBERT card", head="AutoModel"),
    # vision
    Published(name="google/vit-base-patch16-224", figure="86M", source="ViT paper, Table 1: ViT-Base",
              head="AutoModel"),
    Published(name="google/vit-huge-patch14-224-in21k", figure="632M", source="ViT paper, Table 1: ViT-Huge",
              head="AutoModel"),
    Published(name="facebook/dinov2-small", figure="22.1M", source="Hub page of facebook/dinov2-small",
              head="AutoModel"),
    Published(name="facebook/dinov2-giant", figure="1.14B", source="Hub page of facebook/dinov2-giant",
              head="AutoModel"),
]


def _build(name: str, head: str):
    kwargs = checkpoint_config(name)
    config = transformers.AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    with torch.device("meta"):
        return getattr(transformers, head).from_config(config)


def _count(model, count: str) -> int:
    params = list(model.parameters())  # tied embeddings are one parameter, counted once
    total = sum(p.numel() for p in params)
    if count == "total":
        return total
    embeddings = {id(model.get_input_embeddings().weight): model.get_input_embeddings().weight}
    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if output is not None:
        embeddings[id(output.weight)] = output.weight
    embedding = sum(w.numel() for w in embeddings.values())
    if count == "embedding":
        return model.get_input_embeddings().weight.numel()
    if count == "non-embedding":
        return total - embedding
    if count == "active":  # a token passes through num_experts_per_tok of the experts of each layer
        config = model.config
        n = getattr(config, "num_local_experts", None) or config.num_experts
        experts = model.model.layers[0].mlp.experts
        per_expert = sum(p.numel() for p in experts.parameters()) // n
        idle = n - config.num_experts_per_tok
        return total - config.num_hidden_layers * idle * per_expert
    if count == "language non-embedding":  # a vision-language model's language model, without its embedding
        language = model.model.language_model
        return sum(p.numel() for p in language.parameters()) - language.get_input_embeddings().weight.numel()
    if count == "vision":
        return sum(p.numel() for p in model.model.vision_tower.parameters())
    raise ValueError(count)


@pytest.mark.parametrize("published", PUBLISHED, ids=lambda p: f"{p.name}:{p.count}")
def test_parameter_count_matches_the_published_one(published):
    low, high = published.bounds
    count = _count(_build(published.name, published.head), published.count)
    assert low <= count <= high, (f"{published.name} {published.count}: built {count:,}, published "
                                  f"{published.figure} ({published.source})")


def test_every_family_has_a_published_count():
    """A family added to the table without a figure to check it against fails here."""
    checked = {find_checkpoint(p.name).family for p in PUBLISHED}
    assert {entry.family for entry in TABLE} <= checked, {entry.family for entry in TABLE} - checked


def test_the_table_covers_forty_causal_lms_beside_encoders_and_vision_models():
    causal = [e for e in TABLE if any(a.endswith("ForCausalLM") for a in e.config.get("architectures", ()))]
    assert len(causal) >= 40
    families = {e.family for e in causal}
    assert {"Qwen2", "Qwen2.5", "Qwen3", "Gemma", "Gemma 2", "Gemma 3", "Phi", "Llama", "Mistral", "Mixtral",
            "DeepSeek", "DeepSeek-R1-Distill", "SmolLM", "SmolLM2", "Pythia", "Mamba", "TinyLlama", "Qwen3-MoE",
            "DeepSeek-V2", "DeepSeek-V3", "SmolLM3"} <= families
    assert {"BERT", "RoBERTa", "DistilBERT", "DeBERTa-v3", "ModernBERT", "ViT", "DINOv2"} <= {e.family for e in TABLE}


@pytest.mark.parametrize("alias,name", [("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B"),
                                        ("Qwen/Qwen3-8B-Base", "Qwen/Qwen3-8B"),
                                        ("google/gemma-2-2b-it", "google/gemma-2-2b"),
                                        ("google/gemma-3-1b-it", "google/gemma-3-1b-pt"),
                                        ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B"),
                                        ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mistralai/Mixtral-8x7B-v0.1"),
                                        ("EleutherAI/pythia-160m-deduped", "EleutherAI/pythia-160m"),
                                        ("gpt2", "openai-community/gpt2"),
                                        ("google/gemma-3-4b-it", "google/gemma-3-4b-pt"),
                                        ("Qwen/Qwen3-30B-A3B-Instruct-2507", "Qwen/Qwen3-30B-A3B"),
                                        ("deepseek-ai/DeepSeek-R1", "deepseek-ai/DeepSeek-V3")])
def test_instruct_and_legacy_names_share_their_base_entry(alias, name):
    assert find_checkpoint(alias) is find_checkpoint(name) and CHECKPOINTS[alias] == CHECKPOINTS[name]


@pytest.mark.parametrize("given,name", [
    ("Qwen/Qwen3-8b", "Qwen/Qwen3-8B"), ("qwen/qwen3-8b", "Qwen/Qwen3-8B"), ("GPT2", "gpt2"),
    ("microsoft/phi-4-mini-instruct", "microsoft/Phi-4-mini-instruct"),
    ("meta-llama/llama-3.1-8b-instruct", "meta-llama/Llama-3.1-8B-Instruct"),
    # one close match: the same words but for separators and variant words
    ("google/gemma-3-4b", "google/gemma-3-4b-pt"), ("microsoft/phi-4-mini", "microsoft/Phi-4-mini-instruct"),
    ("Qwen/Qwen3_8B", "Qwen/Qwen3-8B"), ("meta-llama/Llama-2-7b", "meta-llama/Llama-2-7b-hf"),
])
def test_names_match_case_insensitively_or_by_one_close_match(given, name):
    from autofit.cli.hf_checkpoints import match_checkpoint

    found, note = match_checkpoint(given)
    assert find_checkpoint(found) is find_checkpoint(name) and given in note


@pytest.mark.parametrize("given", ["Qwen/Qwen3-7B", "mistralai/Mistral-Small-24B-Instruct", "llama", "LLAMA"])
def test_no_match_for_other_numbers_or_several_entries(given):
    """A size that is not in the table never falls back to a neighbour; model types are not checkpoints."""
    from autofit.cli.hf_checkpoints import match_checkpoint

    assert match_checkpoint(given) is None
