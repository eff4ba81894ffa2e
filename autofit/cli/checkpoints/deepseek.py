"""DeepSeek's dense checkpoints: DeepSeek LLM 7B and DeepSeek Coder (Llama architecture) and the DeepSeek-R1
distillations into Qwen2.5 and Llama 3.x, from each repository's ``config.json``. The MoE models (V2, V3, R1
itself) are not in the table."""

from __future__ import annotations

from autofit.cli.checkpoints.entry import Checkpoint
from autofit.cli.checkpoints.llama import LLAMA31_ROPE, llama
from autofit.cli.checkpoints.qwen import qwen2

__all__ = ["CHECKPOINTS"]

_DS = "deepseek-ai"
# deepseek-coder-*-base/config.json: 16384 positions by linear RoPE interpolation (factor 4) over a base of 1e5,
# vocab 32256
_CODER_ROPE = {"type": "linear", "factor": 4.0}


def _distill(size: str, config: dict) -> Checkpoint:
    return Checkpoint(name=f"{_DS}/DeepSeek-R1-Distill-{size}", family="DeepSeek-R1-Distill", config=config)


CHECKPOINTS: tuple[Checkpoint, ...] = (
    Checkpoint(name=f"{_DS}/deepseek-llm-7b-base", family="DeepSeek", aliases=(f"{_DS}/deepseek-llm-7b-chat",),
               config=llama(30, 4096, 11008, 32, 32, 102400, 4096, rms_eps=1e-6, bos_token_id=100000,
                            eos_token_id=100001)),
    Checkpoint(name=f"{_DS}/deepseek-coder-1.3b-base", family="DeepSeek",
               aliases=(f"{_DS}/deepseek-coder-1.3b-instruct",),
               config=llama(24, 2048, 5504, 16, 16, 32256, 16384, 100000.0, rms_eps=1e-6,
                            rope_scaling=_CODER_ROPE)),
    Checkpoint(name=f"{_DS}/deepseek-coder-6.7b-base", family="DeepSeek",
               aliases=(f"{_DS}/deepseek-coder-6.7b-instruct",),
               config=llama(32, 4096, 11008, 32, 32, 32256, 16384, 100000.0, rms_eps=1e-6,
                            rope_scaling=_CODER_ROPE)),
    # The Qwen distillations keep their teacher's shapes (Qwen2.5-Math-1.5B, -Math-7B, -14B, -32B) but untie the
    # 1.5B's embeddings; RoPE base 1e4 at 1.5B / 7B
    _distill("Qwen-1.5B", qwen2(28, 1536, 8960, 12, 2, 151936, 131072, tied=False, rope_theta=10000.0,
                                window_layers=21, sliding_window=4096)),
    _distill("Qwen-7B", qwen2(28, 3584, 18944, 28, 4, 152064, 131072, tied=False, rope_theta=10000.0,
                              sliding_window=4096)),
    _distill("Qwen-14B", qwen2(48, 5120, 13824, 40, 8, 152064, 131072, tied=False, rms_eps=1e-5,
                               sliding_window=131072)),
    _distill("Qwen-32B", qwen2(64, 5120, 27648, 40, 8, 152064, 131072, tied=False, rms_eps=1e-5,
                               sliding_window=131072)),
    # The Llama distillations: Llama-3.1-8B and Llama-3.3-70B-Instruct's shapes and RoPE scaling
    _distill("Llama-8B", llama(32, 4096, 14336, 32, 8, 128256, 131072, 500000.0, rope_scaling=LLAMA31_ROPE)),
    _distill("Llama-70B", llama(80, 8192, 28672, 64, 8, 128256, 131072, 500000.0, rope_scaling=LLAMA31_ROPE)),
)
