"""Plans at the top of the fine-tuning ladder (issue 24), for a Llama-3.2-3B-shaped model built on the meta device
from its config (no weights): full fine-tuning on a 16 GB budget with ``allow=("8bit-optimizer", "chunked-loss")``,
and a peft LoRA r=16 on a 12 GB card. Prints each plan.

    python benchmarks/fine_tuning_plans.py            # both
    python benchmarks/fine_tuning_plans.py full       # one

The 16 GB budget is planned on an L4 (24 GB, bf16): the catalog's 16 GB cards (V100-16GB, T4) have no bf16, and
in fp16 every lower stored precision keeps an fp32 master copy (Note [stored precision]), which alone is 12.8 GB for
3.2 B parameters. The 12 GB card is an RTX 3090's budget for the same reason (no 12 GB card in the catalog).
"""

from __future__ import annotations

import sys
import time

import torch

import autofit

# Llama 3.2 3B (meta-llama/Llama-3.2-3B config.json): hidden 3072, 28 layers, 24 heads, 8 kv heads, intermediate
# 8192, vocab 128256, tied embeddings, rope theta 500000, 131072 positions
SEQUENCE = 2048
BATCH = 1  # one sequence per optimizer step: stepping the optimizer in backward allows no accumulation


def llama_3b(dtype: torch.dtype = torch.float32):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
        num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
        rms_norm_eps=1e-5, attn_implementation="sdpa",
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    return model


def tokens(rows: int = 1, length: int = SEQUENCE) -> dict[str, torch.Tensor]:
    ids = torch.zeros(rows, length, dtype=torch.long)
    return {"input_ids": ids, "labels": ids.clone()}


def full_fine_tuning_16gb() -> autofit.Plan:
    """Full fine-tuning, AdamW, on a 16 GB budget: the planner climbs to pure bf16, the chunked loss and 8-bit
    AdamW, stepping in backward."""
    return autofit.plan(llama_3b(), tokens(), "16GiB", batch_size=BATCH, device="L4",
                        savers=autofit.Savers(allow=("8bit-optimizer", "chunked-loss")))


def lora_12gb() -> autofit.Plan:
    """peft LoRA r=16 on the attention and MLP projections of the bf16 model, AdamW on the adapters, 12 GB."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(llama_3b(torch.bfloat16), LoraConfig(
        r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"]))
    return autofit.plan(model, tokens(), "12GiB", batch_size=BATCH, device="RTX-3090")


CASES = {"full": full_fine_tuning_16gb, "lora": lora_12gb}


def main(names: list[str]) -> None:
    for name in names or list(CASES):
        start = time.perf_counter()
        plan = CASES[name]()
        print(f"== {name} ({time.perf_counter() - start:.0f} s to plan)\n{plan}\n")


if __name__ == "__main__":
    main(sys.argv[1:])
