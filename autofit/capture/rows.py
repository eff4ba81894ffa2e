"""The smallest micro-batch the model accepts: one row, or two (Note [micro-batches a model refuses]).

Note [micro-batches a model refuses]
    Some models train on a batch but refuse a micro-batch of one row: ``nn.BatchNorm1d`` after a global pool (and
    any batch norm whose input has one value per channel) raises "Expected more than 1 value per channel when
    training" (``_verify_batch_size`` in torch/nn/functional.py). The planner's candidates include micro-batches of
    one row and uneven windows whose last micro-batch has one row (13 rows as 3 x 5 ends with 1), which the trainer
    would run and crash on. So before the search, one forward of a fake copy of the model at one row, in the model's
    own training mode and without autograd, says whether it accepts one row; when it refuses, every candidate keeps
    at least two rows in each of its micro-batches (the analysis simulates two and three rows, so two are accepted
    wherever a plan exists): a window whose last micro-batch would hold fewer takes them from the micro-batch
    before (13 rows as 3 x 5 run as 3, 3, 3, 2, 2: the trainer's ``_bounds``), and micro-batches of two rows that
    cannot spare one are left out. No micro-batch then holds more rows than the plan simulated. The plan records
    ``min_rows`` and its notes say why. A forward that cannot run on fake tensors (it reads tensor values) is not
    decided here: its simulations run it for real and raise as before.
"""

from __future__ import annotations

import torch
from torch import nn

from autofit.capture.model_copy import fake_copy, fake_input
from autofit.core._torch import FakeTensorMode
from autofit.core.errors import ForwardError
from autofit.core.shared import shared
from autofit.training.batch import Batch
from autofit.training.step import forward_errors

__all__ = ["smallest_rows"]


def smallest_rows(model: nn.Module, batch: Batch) -> tuple[int, str | None]:
    """``(1, None)`` when the model's forward accepts one row, ``(2, why)`` when it refuses one row but accepts two
    (See Note [micro-batches a model refuses]). The same for every card: asked once for them all (Note [one analysis
    for several cards], autofit/core/shared.py)."""
    return shared("smallest_rows", lambda: _smallest_rows(model, batch), model=model, batch=batch, target=None,
                  loss_fn=None, config=None, device_rules=None)


def _smallest_rows(model: nn.Module, batch: Batch) -> tuple[int, str | None]:
    refused = _refusal(model, batch, 1)
    if refused is None or _refusal(model, batch, 2) is not None:  # failing at two as well: not about the rows
        return 1, None
    return 2, refused


def _refusal(model: nn.Module, batch: Batch, rows: int) -> str | None:
    """Why one training-mode forward of a fake copy at ``rows`` rows raises, or None when it runs (or cannot be
    decided on fake tensors)."""
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        work = fake_copy(model, fake_mode)
        with fake_mode, torch.no_grad(), forward_errors():
            batch.map_tensors(lambda t: fake_input(fake_mode, t)).resize(rows).call(work)
    except ForwardError as e:
        return str(e)
    except Exception:  # noqa: BLE001 - not decidable on fake tensors: the simulations run it and say
        return None
    return None
