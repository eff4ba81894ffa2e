"""Which card to rent: the time of one plan against the comparison of four cards (``autofit.compare``), in one run.

    python benchmarks/compare_cards.py                                     # SmolLM2-135M, LoRA 16, 8 x 512 tokens
    python benchmarks/compare_cards.py hf:meta-llama/Meta-Llama-3-8B --lora 16 --length 2048 --batch-size 8
    python benchmarks/compare_cards.py ... --separate                      # also four separate plans

Times, in one process, after a warm-up plan of another card (imports, the first trace): one plan for the first card
(``autofit.plan``), then ``autofit.compare`` over the cards (the plans share the analysis and the simulations the
card does not change: Note [one analysis for several cards], autofit/core/shared.py), then, with ``--separate``,
one plan per card as four calls would run them. Prints the comparison's table and the times; each row of the
comparison is checked against the single plan of its card where one was made (micro-batch, accumulation, peak on
the device, recomputed modules).
"""

from __future__ import annotations

import argparse
import time

import autofit
from autofit.cli.adapters import Adapter
from autofit.cli.specs import load_spec
from autofit.compare import compare

CARDS = ("RTX-4090", "L40S", "A100-80GB", "H100")
PRICES = {"RTX-4090": 0.69, "L40S": 0.99, "A100-80GB": 1.79, "H100": 2.99}  # example figures, USD per card-hour


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="hf:HuggingFaceTB/SmolLM2-135M")
    parser.add_argument("--lora", type=int, default=16, help="LoRA rank (0: full fine-tuning)")
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--budget", default="90%")
    parser.add_argument("--separate", action="store_true", help="also time one plan per card, separately")
    args = parser.parse_args()

    spec = load_spec(args.model, input_shapes=[(args.length,)], adapter=Adapter(rank=args.lora or None))
    common = dict(batch_size=args.batch_size, target=spec.target, loss_fn=spec.loss_fn)

    def one(card: str) -> autofit.Plan:
        return autofit.plan(spec.model, spec.sample, args.budget, device=autofit.Device(gpu=card), **common)

    def timed(f):
        start = time.perf_counter()
        try:
            value = f()
        except autofit.InfeasibleBudgetError as e:
            value = e
        return value, time.perf_counter() - start

    _, warm = timed(lambda: one("RTX-3090"))
    single, t_one = timed(lambda: one(CARDS[0]))
    rows, t_compare = timed(lambda: compare(spec.model, spec.sample, args.budget, gpus=CARDS, prices=PRICES,
                                            **common))
    separate = []
    if args.separate:
        for card in CARDS:
            separate.append(timed(lambda card=card: one(card)))

    print(f"{spec.description}, {args.batch_size} x {args.length} tokens, budget {args.budget}")
    print(f"{'card':<12}{'fits':>5}{'micro x acc':>13}{'peak GiB':>10}{'step s':>9}{'tok/s':>10}{'$/M tok':>9}")
    for r in rows:
        micro = f"{r.micro_batch_size} x {r.accumulation_steps}" if r.fits else "-"
        print(f"{r.gpu:<12}{'yes' if r.fits else 'no':>5}{micro:>13}"
              f"{(r.device_bytes or 0) / 2**30:>10.2f}{r.step_seconds or 0:>9.3g}{r.items_per_second or 0:>10.0f}"
              f"{r.cost_per_million if r.cost_per_million is not None else float('nan'):>9.3f}")
    # each row against the single plan of its card where one was made (a checkpoint MILP stopped by its wall-clock
    # limit may pick another set under another load, alone or compared: Note [one analysis for several cards])
    singles = {CARDS[0]: single} | ({card: plan for card, (plan, _) in zip(CARDS, separate)} if separate else {})
    for card, plan in singles.items():
        if isinstance(plan, autofit.Plan):
            row = next(r for r in rows if r.gpu == autofit.gpu_spec(card).name)
            same = (row.micro_batch_size, row.accumulation_steps, row.device_bytes, row.plan.checkpoint) == (
                plan.micro_batch_size, plan.gradient_accumulation_steps, plan.device_bytes, plan.checkpoint)
            print(f"{card} row equals its single plan: {same}")
    print(f"warm-up plan (RTX-3090)      {warm:8.1f} s")
    print(f"one plan ({CARDS[0]})         {t_one:8.1f} s")
    print(f"comparison of {len(CARDS)} cards       {t_compare:8.1f} s   ratio {t_compare / t_one:.2f}")
    if separate:
        total = sum(t for _, t in separate)
        print(f"{len(CARDS)} separate plans            {total:8.1f} s   ratio {total / t_one:.2f}")


if __name__ == "__main__":
    main()
