"""Where the bytes of a training step go. A documented str enum, as PyTorch's MemTracker keeps its ``_MemRefType``."""

from __future__ import annotations

from enum import Enum

__all__ = ["Category"]


class Category(str, Enum):
    """Memory categories of an estimate's breakdown. Values are the keys users see in tables and JSON."""

    PARAMETERS = "parameters"  # nn.Parameter storages
    BUFFERS = "buffers"  # registered buffers and plain tensor attributes of modules
    GRADIENTS = "gradients"  # .grad of parameters (live from their backward until zero_grad)
    OPTIMIZER_STATE = "optimizer_state"  # exp_avg, exp_avg_sq, momentum buffers, step counters, GradScaler state
    INPUTS = "inputs"  # the micro-batch's inputs and targets
    ACTIVATIONS = "activations"  # tensors made in forward and still alive: saved for backward, outputs, the loss
    AUTOCAST_CACHE = "autocast_cache"  # low-precision copies of weights that autocast keeps until it exits
    TEMPORARIES = "temporaries"  # tensors made in backward or the optimizer step that are not gradients or state
    WORKSPACE = "workspace"  # scratch memory allocated and freed inside one kernel (oneDNN scratchpads, reorders)
    # CUDA-only terms (see autofit.cuda): the caching allocator rounds blocks and keeps a reserve.
    ALLOCATOR_ROUNDING = "allocator_rounding"
    CUBLAS_WORKSPACE = "cublas_workspace"
    CUDA_CONTEXT = "cuda_context"
    FRAGMENTATION = "fragmentation"
    # measure() cannot attribute what the allocator saw during the step; it reports it under one name.
    STEP = "step"
    # measure(): what earlier steps left alive that no category above holds (a hook's list of gradients, a retained
    # gradient), read from the allocator's record of the warm-up (Note [memory from before the window])
    KEPT = "kept"

    def __str__(self) -> str:
        return self.value
