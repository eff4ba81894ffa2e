"""The layout's answers to the planner (autofit/parallel/rungs.py) and to the depth extrapolation
(autofit/parallel/depth.py): each rule, on the layouts it tells apart."""

from __future__ import annotations

from dataclasses import replace

from autofit.parallel.depth import at_depth, renamed_in_depth
from autofit.parallel.layout import Parallel
from autofit.parallel.rungs import (analysed_windows, budget_error_at, climbed_for_memory, host_rung_loses,
                                    ladder_rungs, more_gpus, names_smallest_budget, node_host_words,
                                    one_process_features, priced_unanalysed, reducing_rival)

ONE = Parallel()
DDP = Parallel(strategy="ddp", world_size=4)
FSDP = Parallel(strategy="fsdp2", world_size=4, shard_units=("0", "1"))
REDUCING = replace(FSDP, reduce_every_micro_batch=True)
HOST = replace(FSDP, offload_states=True)
TP = Parallel(strategy="fsdp2", world_size=4, shard_units=("0", "1"), tensor_parallel=2,
              tensor_plan=(("0.fc", "colwise"), ("1.fc", "colwise")))


def test_what_is_planned_for_one_process_needs_no_strategy():
    assert one_process_features(ONE)
    assert not any(one_process_features(p) for p in (DDP, FSDP, HOST, Parallel(strategy="fsdp2", world_size=1,
                                                                                offload_states=True)))


def test_the_rival_that_reduces_every_micro_batch_needs_a_deferring_layout_and_two_micro_batches():
    assert reducing_rival(FSDP, 2) == REDUCING and reducing_rival(FSDP, 1) is None
    assert all(reducing_rival(p, 8) is None for p in (ONE, DDP, REDUCING, HOST))


def test_one_row_per_rank_analyses_only_the_step_of_one_micro_batch():
    assert analysed_windows(FSDP, 4) == (True, REDUCING)
    assert analysed_windows(FSDP, 1) == (False, REDUCING)
    assert analysed_windows(DDP, 1) == (True, None)


def test_the_ladder_rungs_of_a_layout():
    units = lambda: ("a", "b")  # noqa: E731
    assert ladder_rungs(FSDP, 4, True, units) == (REDUCING, HOST)
    assert ladder_rungs(FSDP, 1, False, units) == (None, None)
    assert ladder_rungs(ONE, 4, True, units) == (None, Parallel(strategy="fsdp2", shard_units=("a", "b"),
                                                                 offload_states=True))
    assert ladder_rungs(DDP, 4, True, units) == (None, None)


def test_the_quick_path_prices_no_tensor_parallel():
    assert priced_unanalysed(FSDP) and priced_unanalysed(ONE) and not priced_unanalysed(TP)


def test_the_layouts_climbed_for_memory():
    assert climbed_for_memory(HOST) and climbed_for_memory(REDUCING)
    assert not any(climbed_for_memory(p) for p in (ONE, DDP, FSDP))


def test_the_host_rung_loses_to_a_plan_on_the_gpus():
    assert host_rung_loses([HOST, FSDP]) and not host_rung_loses([HOST]) and not host_rung_loses([])


def test_only_the_layout_that_holds_least_names_the_smallest_budget_and_only_without_a_plan():
    assert names_smallest_budget(FSDP, planned=False) and not names_smallest_budget(FSDP, planned=True)
    assert not names_smallest_budget(replace(FSDP, reshard_after_forward=False), planned=False)


def test_the_words_and_ranks_of_an_infeasible_layout():
    assert budget_error_at(ONE) == ("", 0)
    assert budget_error_at(DDP) == (", ddp over 4 ranks", 0)
    assert budget_error_at(FSDP) == (", fsdp2 (ZeRO-3) over 4 ranks", 4)


def test_more_gpus_only_where_they_are_more():
    assert more_gpus(FSDP, 8) == 8 and more_gpus(FSDP, 4) is None and more_gpus(FSDP, None) is None


def test_the_host_memory_of_a_node_in_words():
    assert node_host_words(ONE, 2**30) == "1.00 GiB (1,073,741,824 bytes)"
    assert node_host_words(replace(HOST, gpus_per_node=2), 2**30) == (
        "1.00 GiB per rank, 2.00 GiB (2,147,483,648 bytes) for the 2 ranks of a node")


def test_a_cut_in_depth_renames_the_units_and_keeps_the_tensor_plan_as_named():
    assert renamed_in_depth(FSDP) == (("0", "1"),)
    cut = at_depth(TP, lambda names: names[:1], lambda name: name.startswith("0."))
    assert cut.shard_units == ("0",) and cut.tensor_plan == (("0.fc", "colwise"),)
