"""Tensor parallelism (Megatron-LM's column / row split of the linear layers of a transformer block, and the
vocabulary split of the embedding and the output head), applied with torch's own
``torch.distributed.tensor.parallel.parallelize_module``: shared by the simulation (on the fake process group) and
the distributed trainer, so both split exactly alike (docs/multi-gpu.md, "Tensor parallel").

Note [tensor parallel plan]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Which modules are split comes from the model, never guessed:

- a Hugging Face model carries one in ``config.base_model_tp_plan`` (``{"layers.*.self_attn.q_proj": "colwise", ...}``,
  keys relative to the base model, ``model.base_model``). transformers' own ``from_pretrained(tp_plan="auto")``
  maps the names to its styles (``transformers.distributed.tensor_parallel``, ``ALL_PARALLEL_STYLES``); autofit maps
  the names whose meaning torch's own styles reproduce exactly, and simulates those (``_STYLES``):

  ============================================  ===============  ================================================
  name (transformers' meaning)                  module           torch style autofit applies
  ============================================  ===============  ================================================
  "colwise": weight split by output features,   nn.Linear        ``ColwiseParallel()``
  input whole, output local
  "rowwise": weight split by input features,    nn.Linear        ``RowwiseParallel()``
  local input, output all-reduced
  "colwise_rep" = "colwise_gather_output":      nn.Linear        ``ColwiseParallel(output_layouts=Replicate())``
  split by output features, output all-gathered
  (the output head: the logits come whole, so
  the ordinary loss runs on every rank)
  "embedding_rowwise": the vocabulary split,    nn.Embedding     ``RowwiseParallel(input_layouts=Replicate())``
  token ids whole, the partial lookups summed                    (torch splits an embedding's rows, masks the ids
                                                                 outside its slice, all-reduces the output)
  "sequence_parallel": a norm inside a block    a norm (every    ``SequenceParallel()``, and what it implies for
  runs on its rank's 1/T of the sequence        parameter 1-D)   the rest of the block (Note [sequence parallel])
  ============================================  ===============  ================================================

  Any other style is refused, naming it: packed and MoE styles, "all_reduce", "replicate", "rowwise_rep" /
  "rowwise_split_input" (not simulated; on an nn.Embedding transformers' ``RowwiseParallel`` splits the hidden dim,
  not the vocabulary: the vocabulary split is "embedding_rowwise"), "embedding_colwise". The vocabulary-split
  embedding refuses ``padding_idx`` (torch's sharded embedding masks ids by the rank's slice; a padding row's zero
  gradient is not re-indexed) and a head tied to it. Each mapped style is checked against the CPU allocator on every
  rank of a gloo job, to the byte (tests/test_tensor_parallel.py, tests/test_tensor_parallel_vocab.py,
  tests/test_sequence_parallel.py); the gathered head needed the simulated ``wait_tensor`` to return its input, as
  torch's does (autofit/capture/corrections.py).
- otherwise the user passes ``tensor_parallel_plan={module name pattern: style}`` (fnmatch patterns over qualified
  names) with the names above, or torch's style objects with exactly those layouts: ``ColwiseParallel()``,
  ``RowwiseParallel()``, ``ColwiseParallel(output_layouts=Replicate())`` on a linear layer and
  ``RowwiseParallel(input_layouts=Replicate())`` on an embedding. A Hugging Face model's own plan leaves out the
  embedding and the head (transformers keeps the head's "colwise_gather_output" in the model class's ``_tp_plan``,
  not in the config): to split them, pass the whole plan, e.g. Llama's config plan plus
  ``{"model.embed_tokens": "embedding_rowwise", "lm_head": "colwise_rep"}``.

Everything the plan leaves out (the norms, unless sequence parallel: Note [sequence parallel] in
autofit/parallel/sequence_parallel.py; the embedding and the output head unless split) is replicated on every
rank of a tensor-parallel group; its gradient is the same on each of them, because every rank of the group sees the
same samples and the activations entering and leaving the split modules are whole (the row-parallel and
vocabulary-split outputs are all-reduced, the "colwise_rep" output all-gathered, the gradient of a column-parallel
input all-reduced: ``DTensor.from_local``'s backward). Attention then runs ``heads / T`` local heads: Hugging Face's
attention reshapes with ``view(*shape, -1, head_dim)``, so the local head count follows the split, which is why the
query and key/value head counts must both divide by T (torchtitan's ``parallelize_llama`` divides ``n_heads`` and
``n_kv_heads`` the same way). A model that reshapes by a head count it stored fails in the simulation with the shapes
named.

Order (torchtitan's ``parallelize_llama``): tensor parallel over the mesh's "tp" dim first, then ``fully_shard`` over
its "dp_shard" dim; the mesh is ``(world_size // T, T)``, so the T ranks of a tensor-parallel group are consecutive
(one node's GPUs) and ranks ``r`` and ``r + T`` hold the same slice of the weights.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn

from autofit.core.errors import InvalidInputError, UnsupportedModelError
from autofit.parallel.sequence_parallel import (SEQUENCE_DIM, block_norms, derive_sequence_parallel,
                                                is_sequence_parallel, sequence_style)

__all__ = ["resolve_tensor_plan", "apply_tensor_parallel", "torch_style", "TP_STYLES",
           "sequence_parallel_plan"]

# autofit's style name -> the module type it splits (Note [tensor parallel plan]); transformers' other names for them
_STYLES = {"colwise": nn.Linear, "rowwise": nn.Linear, "colwise_rep": nn.Linear, "embedding_rowwise": nn.Embedding,
           "sequence_parallel": nn.Module}
_ALIASES = {"colwise_gather_output": "colwise_rep"}
TP_STYLES = tuple(_STYLES)


def torch_style(style: str):
    """The torch ``ParallelStyle`` an autofit style name stands for (Note [tensor parallel plan])."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return RowwiseParallel()
    if style == "colwise_rep":
        return ColwiseParallel(output_layouts=Replicate())
    if style == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate())
    made = sequence_style(style)  # sequence parallel's styles (Note [sequence parallel])
    if made is not None:
        return made
    raise InvalidInputError(f"unknown tensor parallel style {style!r}: one of {', '.join(TP_STYLES)}")


def _style_name(pattern: str, style: object) -> str:
    from torch.distributed.tensor.parallel import ParallelStyle

    if isinstance(style, str) and _ALIASES.get(style, style) in _STYLES:
        return _ALIASES.get(style, style)
    if isinstance(style, ParallelStyle):
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import SequenceParallel

        if type(style) is SequenceParallel and style.sequence_sharding == (Shard(SEQUENCE_DIM),) \
                and not style.use_local_output:
            return "sequence_parallel"
        # only the layouts a name stands for: those are what the simulation and the trainer rebuild from the name
        for name in ("colwise", "rowwise", "colwise_rep", "embedding_rowwise"):
            made = torch_style(name)
            if type(style) is type(made) and style.input_layouts == made.input_layouts \
                    and style.output_layouts == made.output_layouts and style.use_local_output:
                return name
    raise UnsupportedModelError(
        f"tensor parallel style {style!r} for {pattern!r}: autofit simulates 'colwise', 'rowwise', 'colwise_rep' "
        "(= 'colwise_gather_output') on linear layers, 'embedding_rowwise' on an nn.Embedding and "
        "'sequence_parallel' on the norms of the blocks, or torch's ColwiseParallel() / RowwiseParallel() / "
        "ColwiseParallel(output_layouts=Replicate()) / RowwiseParallel(input_layouts=Replicate()) / "
        "SequenceParallel() (Note [tensor parallel plan]); give one of those, or leave the module out of the plan "
        "(it is then replicated)")


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
    """The modules to split and how: ``((qualified name, style), ...)`` in module order, each style one of
    ``TP_STYLES``, from ``plan`` (patterns) or the model's own (Note [tensor parallel plan]). Typed errors for a
    model without a plan, a style autofit does not simulate or a module of another type than its style splits, a
    pattern that matches nothing, a split that is not even, attention heads that T does not divide, and a split
    weight tied to another module's."""
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
        _require_splittable(source, name, module, style, tensor_parallel)
        found.append((name, style))
    unmatched = sorted(set(styles) - matched)
    if unmatched:
        raise InvalidInputError(f"{source} pattern(s) {', '.join(map(repr, unmatched))} match no module of "
                                f"{type(model).__name__}: patterns are fnmatch patterns over qualified module names")
    _require_heads(model, tensor_parallel)
    _require_untied(model, found)
    if is_sequence_parallel(found):
        return derive_sequence_parallel(model, found, source)
    return tuple(found)


def sequence_parallel_plan(model: nn.Module, plan: Mapping[str, object] | None = None) -> dict[str, object]:
    """``plan`` (default: the model's own, Note [tensor parallel plan]) with "sequence_parallel" on the norms of the
    blocks it splits: each block's children whose parameters are all 1-D (a Llama's ``input_layernorm`` and
    ``post_attention_layernorm``). Pass the result as ``tensor_parallel_plan`` (the CLI's ``--sequence-parallel``);
    Note [sequence parallel] says what follows from it."""
    base = dict(plan) if plan is not None else _model_plan(model)[0]
    if not base:
        raise UnsupportedModelError(
            f"sequence parallel needs a tensor-parallel plan of which linear layers to split, and "
            f"{type(model).__name__} carries none (no config.base_model_tp_plan): pass one")
    norms = block_norms(model, [name for name, _ in model.named_modules()
                                if any(fnmatch.fnmatchcase(name, p) for p in base)])
    if not norms:
        raise UnsupportedModelError(
            f"sequence parallel: the blocks {type(model).__name__}'s plan splits have no norm (a child whose "
            "parameters are all 1-D) to run on a share of the sequence (Note [sequence parallel])")
    return {**base, **norms}


def _require_splittable(source: str, name: str, module: nn.Module, style: str, tensor_parallel: int) -> None:
    """The module is of the type its style splits, evenly by T, and nothing torch's split would get wrong."""
    kind = _STYLES[style]
    if style == "sequence_parallel":
        shapes = [tuple(p.shape) for p in module.parameters()]
        if any(len(shape) != 1 for shape in shapes):
            raise UnsupportedModelError(
                f"{source} gives {name!r} ({type(module).__name__}) 'sequence_parallel', a style for norms, whose "
                f"parameters are 1-D (its are {shapes}; Note [sequence parallel])")
        return
    if not isinstance(module, kind):
        raise UnsupportedModelError(
            f"{source} splits {name!r} ({type(module).__name__}) {style!r}, a style for {kind.__name__} "
            "(Note [tensor parallel plan]); give the style of its type, or leave it out of the plan (it is then "
            "replicated)")
    if kind is nn.Embedding:
        if module.padding_idx is not None or module.max_norm is not None or module.sparse:
            raise UnsupportedModelError(
                f"{name!r} ({module}) splits its vocabulary with padding_idx, max_norm or sparse gradients set: "
                "torch's sharded embedding masks the ids by each rank's slice and does not re-index those; leave "
                "it out of the plan (it is then replicated)")
        features, what = module.num_embeddings, "vocabulary rows"
    elif style == "rowwise":
        features, what = module.in_features, "input features"
    else:
        features, what = module.out_features, "output features"
    if features % tensor_parallel:
        raise UnsupportedModelError(
            f"{name!r} has {features} {what}, which tensor_parallel={tensor_parallel} does not divide: choose a "
            "tensor-parallel degree that divides it")


def _require_untied(model: nn.Module, found: list[tuple[str, str]]) -> None:
    """A parameter shared by two modules (a head tied to its embedding) would be split twice: refused, naming it."""
    owner: dict[int, str] = {}
    split = {name for name, _ in found}
    for name, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False):
            if id(p) in owner and (name in split or owner[id(p)] in split) and owner[id(p)] != name:
                raise UnsupportedModelError(
                    f"{name}.{pname} is the same parameter as {owner[id(p)]}'s (tied weights) and the tensor "
                    "parallel plan splits one of them: torch would distribute it twice; untie them "
                    "(tie_word_embeddings=False) or leave both out of the plan")
            owner.setdefault(id(p), name)


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
    from torch.distributed.tensor.parallel import parallelize_module

    return parallelize_module(model, tp_mesh, {name: torch_style(style) for name, style in plan})
