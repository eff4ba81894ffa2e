"""Small models for the sharded-training tests (importable by the spawned gloo workers, tests/dist_workers.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from zoo import ZooCase

__all__ = ["EXTRA_CASES", "WideBlocks", "wide_blocks", "tiny_llama"]


class _Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.relu(self.up(x)))


class WideBlocks(nn.Module):
    """Four wide residual MLP blocks over 64 tokens of 128 features, a 10-class head on their mean: parameters
    (8.4 MB in fp32) large against one row's activations, as in a 7B language model trained on 8 GPUs. A flat
    (rows, 64 * 128) input, so the batch has no length dim to tabulate."""

    def __init__(self, dim: int = 128, hidden: int = 2048, layers: int = 4, tokens: int = 64) -> None:
        super().__init__()
        self.dim, self.tokens = dim, tokens
        self.blocks = nn.ModuleList(_Block(dim, hidden) for _ in range(layers))
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.shape[0], self.tokens, self.dim)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


def _cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)


def wide_blocks(device: str | None = None) -> ZooCase:
    """:class:`WideBlocks` (on ``device``, "meta" for planning without weights), 8 rows and class targets."""
    torch.manual_seed(0)
    with torch.device(device or "cpu"):
        model = WideBlocks()
    sample = torch.randn(8, 64 * 128)
    target = torch.randint(0, 10, (8,))
    return ZooCase("wide_blocks", model, sample, target, checkpoint=("blocks.0",), loss_fn=_cross_entropy)


def tiny_llama(device: str | None = None, heads: int = 4, kv_heads: int = 4, vocab: int = 128,
               **config_fields) -> ZooCase:
    """A two-layer Llama built from its config (hidden 64, MLP 128, vocab 128; no weights downloaded): the model
    carries ``config.base_model_tp_plan``, the tensor-parallel plan autofit reads. 4 rows of 32 tokens, labels =
    input ids (the model's own shifted loss)."""
    import pytest

    transformers = pytest.importorskip("transformers", reason="the test extras' transformers builds the tiny Llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=64,
                         attn_implementation="sdpa", **config_fields)
    with torch.device(device or "cpu"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (4, 32))
    return ZooCase("tiny_llama", model, {"input_ids": ids, "labels": ids.clone()}, None, checkpoint=())


def tiny_llama_vocab(device: str | None = None) -> ZooCase:
    """tiny_llama with a 512-word vocabulary: its embedding and head (512 x 64 each) are its largest weights, the
    ones the vocabulary split cuts (tests/test_tensor_parallel_vocab.py)."""
    return tiny_llama(device, vocab=512)


EXTRA_CASES = {"wide_blocks": wide_blocks, "tiny_llama": tiny_llama, "tiny_llama_vocab": tiny_llama_vocab}


def tiny_llama_pipeline(device: str | None = None, layers: int = 4, vocab: int = 128) -> ZooCase:
    """A four-layer (or ``layers``) Llama for pipeline stages (autofit/parallel/pipeline.py): hidden 64, MLP 128,
    vocab 128 (or ``vocab``: a heavier head), its head not tied to its embedding (the two sit on the first and the
    last stage); the sample is 4 rows of 16 token ids (below 128) and the target the same ids (the default loss:
    cross-entropy of the logits against them), the one input a first stage takes."""
    import pytest

    transformers = pytest.importorskip("transformers", reason="the test extras' transformers builds the tiny Llama")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, attn_implementation="sdpa",
                                      tie_word_embeddings=False, use_cache=False)
    with torch.device(device or "cpu"):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 128, (4, 16))
    return ZooCase("tiny_llama_pipeline", model, ids, ids.clone(), checkpoint=tuple(f"model.layers.{i}"
                                                                                      for i in range(layers)))


EXTRA_CASES["tiny_llama_pipeline"] = tiny_llama_pipeline
EXTRA_CASES["tiny_llama_pipeline_16384"] = lambda: tiny_llama_pipeline(vocab=16384)  # a head heavier than a layer
