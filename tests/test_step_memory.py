"""The layout's share of a step's memory (autofit/parallel/step_memory.py): the terms the ladder's floors, the host
check and the large-term notes ask the layout for, each over what the caller counted of the model."""

from __future__ import annotations

from torch import nn

from autofit.parallel.layout import Parallel
from autofit.parallel.step_memory import (analysis_words, deferred_floor_bytes, deferred_gradients_bytes,
                                          gathered_bytes, gpus_for_states_bytes, host_states_note, node_bytes,
                                          rank_states_bytes, reducing_notes, rung_what)

ZERO3 = Parallel(strategy="fsdp2", world_size=8, gpus_per_node=4)
ZERO2 = Parallel(strategy="fsdp2", world_size=8, reshard_after_forward=False)
DDP = Parallel(strategy="ddp", world_size=4)


def test_a_rank_holds_the_states_over_the_shard_group_and_keeps_gathered_its_share():
    assert rank_states_bytes(ZERO3, 800) == 100
    assert rank_states_bytes(DDP, 800) == 800  # whole replicas
    assert gathered_bytes(ZERO2, lambda: 640) == 640  # ZeRO-2 keeps every parameter gathered

    def never() -> int:
        raise AssertionError("ZeRO-3 keeps nothing gathered: the model is not counted")
    assert gathered_bytes(ZERO3, never) == 0
    assert deferred_floor_bytes(ZERO3, 800, 400) == 800 - 50
    assert deferred_floor_bytes(ZERO3, 10, 800) == 0  # never below nothing


def test_more_ranks_shard_only_fsdp2s_states_and_a_node_holds_its_ranks_host_bytes():
    assert gpus_for_states_bytes(DDP, lambda: 100, lambda: 10) is None
    assert gpus_for_states_bytes(ZERO3, lambda: 100, lambda: 0) is None  # no room beside what is gathered
    assert gpus_for_states_bytes(ZERO3, lambda: 100, lambda: 1000) == 8  # fits already: the ranks it has
    assert gpus_for_states_bytes(ZERO3, lambda: 100, lambda: 50) == 16  # 800 B over ranks of 50 B
    assert node_bytes(ZERO3, 10) == 40 and node_bytes(Parallel(), 10) == 10


def test_deferred_gradients_and_the_layouts_words():
    model = nn.Linear(4, 4)  # 20 trained parameters of 4 bytes
    assert deferred_gradients_bytes(ZERO3, model, 2, autocast=False) == 80
    assert deferred_gradients_bytes(ZERO3, model, 1, autocast=False) == 0  # one micro-batch: nothing deferred
    reducing = ZERO3.reducing_every_micro_batch()
    assert deferred_gradients_bytes(reducing, model, 2, autocast=False) == 0
    assert rung_what(reducing, "stored bf16") == "FSDP2 reducing every micro-batch"
    assert rung_what(ZERO3, "stored bf16") == "stored bf16"
    assert reducing_notes(reducing, 2) and not reducing_notes(reducing, 1) and not reducing_notes(ZERO3, 2)
    assert analysis_words(Parallel()) == ""
    assert analysis_words(ZERO3) == " (fsdp2 over 8)"
    assert analysis_words(reducing) == " (fsdp2 over 8, reducing every micro-batch)"
    host = ZERO3.states_on_host(lambda: ())
    assert analysis_words(host) == " (states on the host)"
    assert host_states_note(ZERO3, "x") is None and "(x)" in host_states_note(host, "x")
