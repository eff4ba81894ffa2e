"""Tensor parallelism (Megatron-LM's column / row split of the linear layers of a transformer block), applied with
torch's own ``torch.distributed.tensor.parallel.parallelize_module``: shared by the simulation (on the fake process
group) and the distributed trainer, so both split exactly alike (docs/multi-gpu.md, "Tensor parallel").

Note [tensor parallel plan]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Which linear layers are split comes from the model, never guessed:

- a Hugging Face model carries one in ``config.base_model_tp_plan`` (``{"layers.*.self_attn.q_proj": "colwise", ...}``,
  keys relative to the base model, ``model.base_model``). transformers' own ``from_pretrained(tp_plan="auto")``
  maps the names to its styles (``transformers.distributed.tensor_parallel``); autofit maps the two plain ones to
  torch's: "colwise" -> ``ColwiseParallel()`` (weight split by output features, local output) and "rowwise" ->
  ``RowwiseParallel()`` (weight split by input features, its output all-reduced). Any other style in the plan
  (packed, MoE, gather, sequence-parallel styles) is refused, naming it: autofit keeps to what it simulates exactly.
- otherwise the user passes ``tensor_parallel_plan={module name pattern: "colwise" | "rowwise"}`` (fnmatch
  patterns over qualified names; ``ColwiseParallel()`` / ``RowwiseParallel()`` with their default layouts are
  accepted for the strings).

Everything the plan leaves out (embeddings, norms, the output head) is replicated on every rank of a tensor-parallel
group; its gradient is the same on each of them, because every rank of the group sees the same samples and the
activations entering and leaving the split layers are whole (the row-parallel output is all-reduced, the gradient of
the column-parallel input too: ``DTensor.from_local``'s backward). Attention then runs ``heads / T`` local heads:
Hugging Face's attention reshapes with ``view(*shape, -1, head_dim)``, so the local head count follows the split,
which is why the query and key/value head counts must both divide by T (torchtitan's ``parallelize_llama`` divides
``n_heads`` and ``n_kv_heads`` the same way). A model that reshapes by a head count it stored fails in the
simulation with the shapes named.

Order (torchtitan's ``parallelize_llama``): tensor parallel over the mesh's "tp" dim first, then ``fully_shard`` over
its "dp_shard" dim; the mesh is ``(world_size // T, T)``, so the T ranks of a tensor-parallel group are consecutive
(one node's GPUs) and ranks ``r`` and ``r + T`` hold the same slice of the weights.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn

from autofit.core.errors import InvalidInputError, UnsupportedModelError, require_int

__all__ = ["resolve_tensor_plan", "apply_tensor_parallel", "require_tensor_parallel", "TP_STYLES"]

TP_STYLES = ("colwise", "rowwise")


def require_tensor_parallel(strategy: object, world_size: int, tensor_parallel: object, replicate: int = 1,
                            offload_states: bool = False, prefix: str = "") -> None:
    """``tensor_parallel`` T: an int dividing ``world_size``; T > 1 needs strategy 'fsdp2' (FSDP2 over the other
    ``world_size // T`` ranks, none when T == world_size) and neither HSDP nor the states on the host."""
    require_int(f"{prefix}tensor_parallel", tensor_parallel)
    if tensor_parallel == 1:
        return
    if strategy != "fsdp2":
        raise InvalidInputError(
            f"{prefix}tensor_parallel={tensor_parallel} composes with FSDP2 (torchtitan's layout): pass "
            f"strategy='fsdp2' (with world_size == tensor_parallel for tensor parallel alone), got {strategy!r}")
    if world_size % tensor_parallel:
        raise InvalidInputError(
            f"{prefix}tensor_parallel {tensor_parallel} does not divide world_size {world_size}: the mesh is "
            f"(world_size // tensor_parallel, tensor_parallel); use a divisor such as the GPUs of one node")
    if replicate != 1 or offload_states:
        raise InvalidInputError(
            f"{prefix}tensor_parallel={tensor_parallel} with {'replicate' if replicate != 1 else 'offload_states'}: "
            "autofit simulates tensor parallel with FSDP2 over one shard dim only (no HSDP, no CPU offload); "
            "leave replicate=1 and offload_states=False")


def _style_name(pattern: str, style: object) -> str:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if isinstance(style, str) and style in TP_STYLES:
        return style
    # only the default layouts: those are what the simulation and the trainer rebuild from the name
    if type(style) is ColwiseParallel and style.input_layouts == (Replicate(),) \
            and style.output_layouts == (Shard(-1),) and style.use_local_output:
        return "colwise"
    if type(style) is RowwiseParallel and style.input_layouts == (Shard(-1),) \
            and style.output_layouts == (Replicate(),) and style.use_local_output:
        return "rowwise"
    raise UnsupportedModelError(
        f"tensor parallel style {style!r} for {pattern!r}: autofit simulates 'colwise' (ColwiseParallel()) and "
        "'rowwise' (RowwiseParallel()) with their default layouts only (Note [tensor parallel plan]); give those, "
        "or leave the module out of the plan (it is then replicated)")


def _model_plan(model: nn.Module) -> tuple[dict[str, str], str]:
    """The Hugging Face model's own plan, keys made qualified names of ``model``; ({}, '') when it has none."""
    config = getattr(model, "config", None)
    plan = getattr(config, "base_model_tp_plan", None)
    base = getattr(model, "base_model", None)
    if not plan or not isinstance(base, nn.Module):
        return {}, ""
    prefix = next((name for name, m in model.named_modules() if m is base), "")
    return {(f"{prefix}.{k}" if prefix else k): v for k, v in plan.items()}, "config.base_model_tp_plan"


def resolve_tensor_plan(model: nn.Module, tensor_parallel: int,
                        plan: Mapping[str, object] | None = None) -> tuple[tuple[str, str], ...]:
    """The modules to split and how: ``((qualified name, "colwise" | "rowwise"), ...)`` in module order, from
    ``plan`` (patterns) or the model's own (Note [tensor parallel plan]). Typed errors for a model without a plan,
    a style autofit does not simulate, a pattern that matches nothing, a split that is not even, and attention
    heads that T does not divide."""
    if tensor_parallel == 1:
        return ()
    source = "tensor_parallel_plan"
    if plan is None:
        plan, source = _model_plan(model)
        if not plan:
            raise UnsupportedModelError(
                f"tensor_parallel={tensor_parallel} needs a plan of which linear layers to split, and "
                f"{type(model).__name__} carries none (no config.base_model_tp_plan): pass tensor_parallel_plan="
                "{'layers.*.attn.q_proj': 'colwise', ..., 'layers.*.attn.out_proj': 'rowwise'}")
    styles = {pattern: _style_name(pattern, style) for pattern, style in plan.items()}
    found: list[tuple[str, str]] = []
    matched: set[str] = set()
    for name, module in model.named_modules():
        hits = [p for p in styles if fnmatch.fnmatchcase(name, p)]
        if not hits:
            continue
        matched.update(hits)
        style = styles[hits[0]]
        if not isinstance(module, nn.Linear):
            raise UnsupportedModelError(
                f"{source} splits {name!r} ({type(module).__name__}) {style}: autofit splits nn.Linear layers only; "
                "leave it out of the plan (it is then replicated)")
        features = module.out_features if style == "colwise" else module.in_features
        if features % tensor_parallel:
            raise UnsupportedModelError(
                f"{name!r} has {features} {'output' if style == 'colwise' else 'input'} features, which "
                f"tensor_parallel={tensor_parallel} does not divide: choose a tensor-parallel degree that divides it")
        found.append((name, style))
    unmatched = sorted(set(styles) - matched)
    if unmatched:
        raise InvalidInputError(f"{source} pattern(s) {', '.join(map(repr, unmatched))} match no module of "
                                f"{type(model).__name__}: patterns are fnmatch patterns over qualified module names")
    _require_heads(model, tensor_parallel)
    return tuple(found)


def _require_heads(model: nn.Module, tensor_parallel: int) -> None:
    """Column-parallel q/k/v leave ``heads / T`` heads on each rank (Note [tensor parallel plan])."""
    config = getattr(model, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % tensor_parallel:
            raise UnsupportedModelError(
                f"config.{field} = {heads} is not divisible by tensor_parallel={tensor_parallel}: each rank would "
                f"hold a fraction of a head; choose a tensor-parallel degree that divides {heads}")


def apply_tensor_parallel(model: nn.Module, plan: tuple[tuple[str, str], ...], tp_mesh) -> nn.Module:
    """``parallelize_module`` over the 1-D ``tp_mesh`` with the resolved plan, in place (before ``fully_shard``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    make = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return parallelize_module(model, tp_mesh, {name: make[style]() for name, style in plan})
