"""torch.compile on the CPU: the estimate of a compiled step (inductor, kernels left out) against ``measure`` of the
compiled step, and the eager estimate beside it; with the seconds each took. Prints a table, asserts nothing.

    python benchmarks/compile.py            # the rows of docs/fine-tuning.md, "torch.compile" (about 3 minutes)
"""

from __future__ import annotations

import time

import torch
from torch import nn

import autofit


class Pointwise(nn.Module):
    """Two linears around a chain of pointwise ops that inductor fuses into one kernel."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 512), nn.Linear(512, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = torch.sigmoid(h) * h * 2 + 1
        return self.b(torch.tanh(h) * h)


def cases():
    square = lambda out: out.square().mean()  # noqa: E731
    torch.manual_seed(0)
    yield ("MLP 256-1024-256, 8 rows", nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256)),
           torch.randn(8, 256), dict(step=8, loss_fn=square))
    yield "pointwise chain 64-512-64, 512 rows", Pointwise(), torch.randn(512, 64), dict(step=512,
                                                                                          loss_fn=square)
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)
    ids = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(1))
    yield ("tiny Llama 1 layer, hidden 64, 8 x 128", transformers.LlamaForCausalLM(config), ids,
           dict(step=8, loss_fn=lambda out: out.logits.float().square().mean()))


def main() -> None:
    print("| model | measure, compiled (B) | estimate, compiled (B) | error | eager estimate | estimate s | measure s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, model, sample, kw in cases():
        compiled = torch.compile(model)
        t0 = time.perf_counter()
        est = autofit.estimate(compiled, sample, **kw)
        t1 = time.perf_counter()
        meas = autofit.measure(compiled, sample, **kw)
        t2 = time.perf_counter()
        eager = autofit.estimate(model, sample, **kw)
        error, eager_error = (100 * (e.peak_bytes / meas.peak_bytes - 1) for e in (est, eager))
        print(f"| {name} | {meas.peak_bytes:,} | {est.peak_bytes:,} | {error:+.3f} % | {eager_error:+.1f} % "
              f"| {t1 - t0:.1f} | {t2 - t1:.1f} |")


if __name__ == "__main__":
    main()
