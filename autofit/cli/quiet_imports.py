"""Third-party import noise the user did not cause, dropped at the one place autofit imports transformers.

Note [import noise]
    Building an ``hf:`` model imports ``transformers.modeling_utils``, whose quantizers import torchao when it is
    installed (transformers/quantizers/quantizer_torchao.py, at import). torchao 0.18 then logs a warning for each
    CUDA kernel library it cannot load on this machine (``Failed to load .../torchao/_C_mxfp8...so``), and
    registers enums with ``torch.utils._pytree.register_constant``, which torch 2.13 answers with a deprecation
    warning per enum. Neither is about the user's model or command. Those records alone are dropped, by a filter on
    the two loggers while the import runs; every other message of those loggers, and every later one, passes. Log
    levels are never changed: they are the application's to set, never a library's.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__ = ["quiet_third_party_imports", "NOISE"]

# logger -> (parts that all appear in a record to drop)
NOISE: dict[str, tuple[tuple[str, ...], ...]] = {
    "torchao": (("Failed to load ", "torchao", "_C"),),
    "torch.utils._pytree": (("is an Enum subclass and is now natively supported by torch.compile",),),
}


class _Drop(logging.Filter):
    def __init__(self, patterns: tuple[tuple[str, ...], ...]) -> None:
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(all(part in message for part in parts) for parts in self.patterns)


@contextlib.contextmanager
def quiet_third_party_imports() -> Iterator[None]:
    """Drop the known import-time lines of Note [import noise] inside the block."""
    filters = [(logging.getLogger(name), _Drop(patterns)) for name, patterns in NOISE.items()]
    for logger, drop in filters:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger, drop in filters:
            logger.removeFilter(drop)
