"""The user's random state, given back as it was after autofit's entry points (Note [the user's random state]).

Note [the user's random state]
    ``plan``, ``estimate``, ``analyse`` and ``measure`` run the user's forward many times, on fake tensors, on value
    twins (Note [value twins]) and for real on copies: a dropout, a ``torch.randn`` in a VAE's reparameterisation,
    a ``torch.rand`` of a LayerDrop draw each advance the process's generators. Left so, a seeded script trains on
    other draws once a plan is added before its loop (``torch.manual_seed(0); plan(...); train()`` differs from
    ``torch.manual_seed(0); train()``), though a plan changes nothing of the model. So each entry point saves the
    generators a user seeds (``torch.manual_seed`` sets the CPU one and every CUDA one; Python's ``random.seed``;
    NumPy's legacy global ``np.random.seed``) on entry and restores them on exit, on success, error and interrupt
    alike. A CUDA generator is saved only where CUDA was initialised already (asking for its state would initialise
    it); where the entry point initialised CUDA itself, each CUDA generator is seeded again with its initial seed
    (the seed a ``torch.manual_seed`` queued before CUDA started, or torch's default), as it stood when it was
    made: no draw of the user's had reached it. A generator object the user made
    (``torch.Generator()``, ``np.random.default_rng()``) is the user's to hold: what a model keeps of one is copied
    with the model, and the copy draws from its own.
"""

from __future__ import annotations

import contextlib
import functools
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

from autofit.core._torch import forget_dtensor_shardings

__all__ = ["user_rng_kept", "keeps_user_rng"]

T = TypeVar("T")


@contextlib.contextmanager
def user_rng_kept() -> Iterator[None]:
    """The global random generators as they were on entry, restored on exit (See Note [the user's random state])."""
    cpu = torch.get_rng_state()
    cuda_started = torch.cuda.is_available() and torch.cuda.is_initialized()
    cuda = torch.cuda.get_rng_state_all() if cuda_started else None
    python = random.getstate()
    numpy = sys.modules.get("numpy")  # a NumPy nobody imported holds no state to keep
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        elif torch.cuda.is_available() and torch.cuda.is_initialized():  # started inside: as new
            for generator in torch.cuda.default_generators:
                generator.manual_seed(generator.initial_seed())
        random.setstate(python)
        if numpy_state is not None:
            numpy.random.set_state(numpy_state)


def keeps_user_rng(entry: Callable[..., T]) -> Callable[..., T]:
    """An entry point that leaves the global random generators as it found them (Note [the user's random state]),
    and DTensor's cached shardings empty of the simulations' fake meshes (Note [one process, several simulated
    ranks], core/_torch.py)."""
    @functools.wraps(entry)
    def wrapped(*args: Any, **kwargs: Any) -> T:
        # and DTensor's sharding caches empty of the user's meshes on the way in and of the simulations' fake ones
        # on the way out (Note [one process, several simulated ranks], core/_torch.py)
        forget_dtensor_shardings()
        try:
            with user_rng_kept():
                return entry(*args, **kwargs)
        finally:
            forget_dtensor_shardings()
    return wrapped
