"""An independent truth for a steady-state training step: a plain PyTorch loop (AdamW, cross-entropy, zero_grad
after the step) run under the CPU profiler, its Allocation events replayed in time order (DESIGN.md, "Ground truth
without a GPU"). Unlike one measured step, the window holds two whole steps after a warm-up, so what the first leaves
for the second (a tensor a hook keeps, then replaces) is allocated and freed inside the window: no event is missed."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


def _storage_bytes(tensors) -> int:
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def plain_steps_peak(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, *, steps: int = 2,
                     reset: Callable[[], None] = lambda: None) -> int:
    """The peak bytes of ``steps`` plain training steps after a warm-up one (which creates the optimizer state);
    ``reset()`` runs after the warm-up, to drop what the warm-up's hooks kept, so that every kept tensor is
    allocated inside the window. The peak is the running sum's maximum plus the bytes alive before the window:
    parameters, optimizer state, inputs and targets."""
    opt = torch.optim.AdamW(model.parameters())

    def step() -> None:
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        del loss
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    reset()
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    before = _storage_bytes([*model.parameters(), *model.buffers(), *state, x, y])
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for _ in range(steps):
            step()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            events.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    running = peak = 0
    for _, size in sorted(events):
        running += size
        peak = max(peak, running)
    return before + peak
