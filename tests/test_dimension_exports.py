"""A layout dimension's part of the exports (Note [layout dimensions], ``Dimension.export``): a new dimension writes
its own keys and notes, and ``Layout.export`` merges them with the built-in dimensions' without a change to
autofit/. The truths are written by hand: torchtitan's [parallelism] keys (torchtitan/config/job_config.py, class
Parallelism, which has ``context_parallel_degree`` beside the data-parallel and tensor degrees) in mesh order, and
the order the notes are documented in."""

from __future__ import annotations

import pytest

from autofit.parallel import DIMENSIONS, Dimension, ExportFragment, ExportInputs, Placement, Registry
from autofit.parallel.exports import merge_settings


class _Context(Dimension):
    """A toy context-parallel dimension: its ranks share their rows; torchtitan takes its degree, DeepSpeed cannot
    express it."""

    def export(self, framework, layout, placement, inputs):
        if framework == "torchtitan":
            return ExportFragment({"parallelism": {"context_parallel_degree": placement.degree}},
                                  (f"toy note: context {placement.degree}",))
        if framework == "deepspeed":
            return ExportFragment(unexpressed=("toy: DeepSpeed's config has no context parallel",))
        return ExportFragment()


def _layout(raf):
    local = Registry(DIMENSIONS)  # autofit's dimensions, copied: the toy never reaches DIMENSIONS
    local.register(_Context(name="cp", mesh_rank=3, shares_rows=True, field="context_parallel"))
    # 8 ranks: dp_shard takes 8 / (2 x 2) = 2; a tensor plan without the embedding / head split or the norms
    shard = Placement("dp_shard", None, (("reshard_after_forward", raf),))
    tensor = Placement("tp", 2, (("plan", (("blocks.0.fc", "colwise"),)),))
    return local.layout(8, [Placement("dp_replicate", 1), shard, Placement("cp", 2), tensor])


def test_a_new_dimension_writes_its_keys_in_mesh_order():
    fragment = _layout(True).export("torchtitan", ExportInputs(precision="bf16"))
    parallelism = fragment.settings["parallelism"]
    # the mesh's order: dp_replicate, dp_shard (with FSDP's reshard), cp, tp
    assert list(parallelism.items()) == [("data_parallel_replicate_degree", 1), ("data_parallel_shard_degree", 2),
                                         ("fsdp_reshard_after_forward", "always"), ("context_parallel_degree", 2),
                                         ("tensor_parallel_degree", 2)]
    assert fragment.settings["training"] == {"mixed_precision_param": "bfloat16"}
    # the notes innermost first: tensor parallel's (its plan splits fewer modules than torchtitan's), then the toy's
    assert len(fragment.notes) == 2
    assert fragment.notes[0].startswith("torchtitan's tensor-parallel plan also splits the embedding")
    assert fragment.notes[1] == "toy note: context 2"
    assert fragment.unexpressed == ()


def test_what_a_framework_cannot_express_comes_after_the_notes():
    fragment = _layout(False).export("deepspeed", ExportInputs())
    assert fragment.settings == {"zero_optimization": {"stage": 2}}  # ZeRO-2's nearest stage
    assert [n.split(":")[0] for n in fragment.notes] == ["reshard_after_forward=False"]
    # innermost first: tensor parallel (mesh rank 4), then the toy (3)
    assert len(fragment.unexpressed) == 2
    assert fragment.unexpressed[0].startswith("tensor parallel 2 is not exported")
    assert fragment.unexpressed[1] == "toy: DeepSpeed's config has no context parallel"


def test_one_process_exports_nothing_and_an_unknown_framework_is_refused():
    one = DIMENSIONS.layout(1, ())
    assert one.export("accelerate", ExportInputs()) == ExportFragment()
    with pytest.raises(ValueError, match="unknown export framework 'megatron'"):
        one.export("megatron", ExportInputs())


def test_settings_merge_key_by_key_keeping_each_keys_place():
    into = {"a": 1, "zero": {"stage": 0}, "b": 2}
    merge_settings(into, {"zero": {"stage": 3, "offload_param": {"device": "cpu"}}, "a": 5, "c": {"x": 1}})
    assert list(into.items()) == [("a", 5), ("zero", {"stage": 3, "offload_param": {"device": "cpu"}}), ("b", 2),
                                  ("c", {"x": 1})]
    source = {"k": {"v": True}}
    merged = merge_settings({}, source)
    merged["k"]["v"] = False  # a copy: the fragment's own mapping is left as it was
    assert source == {"k": {"v": True}}


def test_what_every_layout_exports_is_the_layouts():
    """The ranks and nodes every layout writes (``Parallel.export_ranks``, placed by ``emit/export.py``), by hand:
    the samples of a step over the data ranks (a tensor-parallel group's ranks train the same rows), the processes
    and nodes; Lightning's devices only with a strategy; Hugging Face's launcher counts them."""
    from autofit.parallel.layout import Parallel

    tp = Parallel(strategy="fsdp2", world_size=8, gpus_per_node=4, shard_units=("a",), tensor_parallel=2,
                  tensor_plan=(("a", "colwise"),))
    assert tp.export_ranks("deepspeed", 3, 2) == {"train_batch_size": 24}
    assert tp.export_ranks("torchtitan", 3, 2) == {"training": {"global_batch_size": 24}}
    assert tp.export_ranks("accelerate", 3, 2) == {"config_file": {"num_machines": 2, "num_processes": 8}}
    assert tp.export_ranks("lightning", 3, 2) == {"trainer": {"devices": 4, "num_nodes": 2}}
    assert tp.export_ranks("hf", 3, 2) == {}
    assert tp.batch_words(3, 2) == "3 x 2 x 4 = 24 samples per step"
    assert Parallel(strategy="ddp", world_size=4).export_ranks("lightning", 1, 1) == {"trainer": {"devices": 4}}
    assert Parallel().export_ranks("lightning", 1, 1) == {}
    assert Parallel().export_ranks("accelerate", 1, 1) == {"config_file": {"num_machines": 1, "num_processes": 1}}
    with pytest.raises(KeyError):  # as EXPORTERS refuses a framework it does not know
        Parallel().export_ranks("megatron", 1, 1)
