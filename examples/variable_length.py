"""Variable-length batches: plan once for the longest batch, and let each shorter batch run in fewer micro-batches.

    python examples/variable_length.py

A small GPT-2 (built from a config: no weights are downloaded) trains on sequences whose lengths follow a long-tailed
distribution. transformers' ``LengthGroupedSampler`` puts sequences of similar length in the same batch and
``DataCollatorForLanguageModeling`` pads each batch to its own longest sequence (labels -100 on the padding), so most
batches are much shorter than the longest. The plan is made once, for a batch at the maximum length; the trainer then
looks up how many rows fit per micro-batch at each batch's length (``plan.micro_batch_size_for``), and normalises the
loss over the batch's real tokens, so each step equals one full-batch step.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader
from transformers import DataCollatorForLanguageModeling, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast
from transformers.trainer_pt_utils import LengthGroupedSampler

import autofit

VOCAB, MAX_LENGTH, BATCH_SIZE, SEQUENCES = 128, 128, 16, 320


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer built in memory, only for its padding (the collator pads with it)."""
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")))
    tok.pad_token, tok.pad_token_id = "t0", 0
    return tok


def dataset(generator: torch.Generator) -> list[dict[str, list[int]]]:
    """Token sequences with log-normal lengths (median 24, a long tail), cut at MAX_LENGTH."""
    lengths = torch.distributions.LogNormal(torch.log(torch.tensor(24.0)), 0.8).sample((SEQUENCES,))
    lengths = lengths.clamp(4, MAX_LENGTH).long()
    lengths[0] = MAX_LENGTH  # at least one sequence at the maximum
    return [{"input_ids": torch.randint(1, VOCAB, (int(n),), generator=generator).tolist()} for n in lengths]


def main() -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=MAX_LENGTH, n_embd=64, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    data = dataset(torch.Generator().manual_seed(0))
    collate = DataCollatorForLanguageModeling(tokenizer(), mlm=False, return_tensors="pt")
    sampler = LengthGroupedSampler(BATCH_SIZE, lengths=[len(d["input_ids"]) for d in data],
                                   generator=torch.Generator().manual_seed(0))
    loader = DataLoader(data, batch_size=BATCH_SIZE, sampler=sampler, collate_fn=collate)

    # The sample is the longest batch: BATCH_SIZE rows at MAX_LENGTH. The budget, a quarter of what it needs in one
    # micro-batch, makes the plan split it.
    longest = collate([{"input_ids": [1] * MAX_LENGTH} for _ in range(BATCH_SIZE)])
    full = autofit.estimate(model, dict(longest), step=BATCH_SIZE).peak_bytes
    plan = autofit.plan(model, dict(longest), budget=full // 4, device="cpu", precision="fp32",
                        search=autofit.Search(variable_length=True))  # the rows-by-length table
    print(plan)

    trainer = plan.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    with trainer:
        for i, batch in enumerate(loader):
            length = batch["input_ids"].shape[1]
            loss = trainer.step(dict(batch))
            print(f"batch {i}: {batch['input_ids'].shape[0]} x {length} tokens -> {trainer.micro_batches} "
                  f"micro-batch(es) of up to {plan.micro_batch_size_for(length)} rows, loss {loss:.3f}")
    print(f"length-adapted: {len(loader)} batches trained within {plan.budget_bytes / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
