"""What a model's "am I being traced?" checks answer in a simulation: what they answer in a real eager step.

Note [am I traced]
    Libraries take another code path when they are traced or compiled, and some count a FakeTensor as tracing. A
    fake simulation must take the path the user's eager training step takes, or it measures another program.
    The checks a simulated step can meet, and what they answer in it:
    - ``torch.compiler.is_compiling()``, ``torch.compiler.is_dynamo_compiling()``, ``torch.jit.is_tracing()``,
      ``torch.jit.is_scripting()``, and transformers' ``is_torchdynamo_compiling`` (which asks the first): they
      look at the interpreter's state, not at tensors. An eager model's simulation runs no dynamo frame and no jit
      trace, so they answer False, as in training; a compiled model's simulation runs dynamo (Note [compiled code
      in a simulation], run.py), so they answer True, as in training. Nothing to change.
    - transformers' ``is_tracing(tensor)`` (``utils/import_utils.py``) is also true when ``tensor`` is a
      FakeTensor (``is_fake_tensor``). ``masking_utils.find_packed_sequence_indices`` then skips the check that
      the position ids hold one sequence per row and returns the packed-sequence mask; ``create_causal_mask``
      builds a full (B, 1, S, S) mask where the eager step passes ``attention_mask=None`` to SDPA with
      ``is_causal=True`` (``_ignore_causal_mask_sdpa`` declines the same way for a fake padding mask). SDPA turns
      the bool mask into an additive one and keeps it for backward in every layer: B * S^2 * 4 bytes more per
      layer, +5 % on a tiny Llama with ``use_cache=False``. The check exists because a traced graph cannot branch
      on values; an eager step can, and reads them.
    During a fake simulation transformers' ``is_fake_tensor`` (the one place ``is_tracing`` asks, looked up at call
    time) answers as the eager step would: False for a fake tensor whose values are known, i.e. that has a value
    twin (Note [value twins], value_twins.py: tensors computed from constants and the inputs only, as position ids
    and padding masks are), so the value read that follows is answered from the twin and the branch is the eager
    step's. A fake tensor without a twin (one computed from the weights) keeps answering True: the code then takes
    its traced branch, which reads no value, rather than a read that would stop the simulation. The patch holds
    the process-wide patch lock and is restored when the simulation ends. ``tests/test_traced_checks.py`` compares
    the mask and attention inputs of a simulated step with a real step's, and the estimates with ``measure``.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from autofit.core._torch import FakeTensor, patch
from autofit.simulate.value_twins import ValueTwins

__all__ = ["eager_answers", "TRANSFORMERS_CHECK"]

# (module, attribute) of the check that counts a FakeTensor as tracing (Note [am I traced])
TRANSFORMERS_CHECK = ("transformers.utils.import_utils", "is_fake_tensor")


@contextlib.contextmanager
def eager_answers(twins: ValueTwins) -> Iterator[None]:
    """While a fake step runs, tracing checks that look at a tensor answer as the eager step would (Note [am I
    traced]). Nothing changes where transformers is not imported or has no such check."""
    module = sys.modules.get(TRANSFORMERS_CHECK[0])
    if module is None or not callable(getattr(module, TRANSFORMERS_CHECK[1], None)):
        yield
        return

    def make(original):
        def is_fake_tensor(x) -> bool:
            if isinstance(x, FakeTensor) and twins.twin(x) is not None:
                return False  # its values are known: the eager step's branch, whose value read the twin answers
            return original(x)

        return is_fake_tensor

    with patch(module, TRANSFORMERS_CHECK[1], make):
        yield
