"""Sequence parallel on top of tensor parallel: which modules take which layout, derived from the norms a plan
marks, the styles torch lacks a static form for, and the check that the sequence splits evenly. Used by
``tensor_parallel.resolve_tensor_plan`` and ``torch_style``, so the simulation and the trainer apply the same
layout (docs/multi-gpu.md, "Sequence parallel").

Note [sequence parallel]
~~~~~~~~~~~~~~~~~~~~~~~~
Sequence parallel (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
section 4.2.2; torch's ``SequenceParallel``) splits what tensor parallel leaves whole inside a block, the norms and
the residual stream between the split layers, along the sequence: each rank of a tensor-parallel group holds 1/T of
the tokens there. The user asks for it by giving the blocks' norms the style "sequence_parallel" (transformers'
name; torch's ``SequenceParallel()`` object is accepted too). The rest follows from the block plan, as torchtitan's
``parallelize_llama`` lays it out by hand, and autofit derives it (``derive_sequence_parallel``), so the simulation and
the trainer apply the same styles:

- each block's norms: ``SequenceParallel()`` (their input a shard of the sequence, their output a DTensor sharded
  along it);
- each child of a block that holds column-parallel layers (the attention, the MLP), "sequence_gather": its first
  input all-gathered along the sequence into a replicated DTensor (``PrepareModuleInput``'s redistribution, on the
  first positional input or, when called with keywords only, the keyword ``forward`` names first: Hugging Face
  calls its attention with ``hidden_states=``). Its backward is one reduce-scatter of the summed gradients of the
  column-parallel layers, where tensor parallel alone all-reduces each of them;
- the row-parallel layer of each such child, "rowwise_sequence": ``RowwiseParallel(output_layouts=Shard(1))``, its
  partial output reduce-scattered along the sequence instead of all-reduced, so the residual add runs on shards;
- the first block, "sequence_shard": its input (whole, as the embedding leaves it, so the model still derives
  positions and its causal mask from the whole length) cut to the rank's shard, no communication;
- the module that follows the last block (the final norm), "sequence_gather_whole": its input all-gathered back
  to a whole local tensor; it runs whole, as does the head after it, whatever its own style.

Refused, naming the module: a norm with a parameter that is not 1-D, a norm outside the blocks of one list (but
the final norm), a block of that list without a sequence-parallel norm, a child with column-parallel layers but
not exactly one row-parallel one, a row-parallel layer elsewhere in a block, column-parallel layers directly in a
block, and a list followed by no module with parameters or by a split one. The sequence dim is dim 1 (batch first, as Hugging Face's and torchtitan's models lay
out hidden states); T must divide the sequence length (torch's ``Shard`` splits unevenly otherwise, checked where
the sample is known, ``require_sequence_split``).
"""

from __future__ import annotations

from torch import nn

from autofit.core.errors import InvalidInputError, UnsupportedModelError

__all__ = ["SEQUENCE_DIM", "is_sequence_parallel", "require_sequence_split", "sequence_style",
           "derive_sequence_parallel", "block_norms"]

SEQUENCE_DIM = 1  # batch first: Hugging Face's and torchtitan's hidden states are (batch, sequence, hidden)


def sequence_style(style: str):
    """The torch ``ParallelStyle`` of a sequence-parallel style name; None for another name."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

    if style == "sequence_parallel":
        return SequenceParallel(sequence_dim=SEQUENCE_DIM)
    if style == "rowwise_sequence":
        return RowwiseParallel(output_layouts=Shard(SEQUENCE_DIM))
    if style == "sequence_gather":
        return _first_input_layout(Shard(SEQUENCE_DIM), Replicate(), local=False)
    if style == "sequence_gather_whole":
        return _first_input_layout(Shard(SEQUENCE_DIM), Replicate(), local=True)
    if style == "sequence_shard":
        return _first_input_layout(Replicate(), Shard(SEQUENCE_DIM), local=True)
    return None


def is_sequence_parallel(plan: tuple[tuple[str, str], ...]) -> bool:
    """Whether a resolved plan runs sequence parallel (Note [sequence parallel])."""
    return any(style == "sequence_parallel" for _, style in plan)


def require_sequence_split(plan: tuple[tuple[str, str], ...], tensor_parallel: int, tensors, what: str) -> None:
    """Sequence parallel splits dim 1 of the hidden states evenly over the T ranks of a group (torch's
    ``DTensor.from_local`` takes each rank's shard as 1/T of the whole): every input of two or more dims must have
    a length there that T divides (Note [sequence parallel]). A typed error naming the length and the fix."""
    if not is_sequence_parallel(plan):
        return
    for tensor in tensors:
        if tensor.dim() >= 2 and tensor.shape[SEQUENCE_DIM] % tensor_parallel:
            raise InvalidInputError(
                f"sequence parallel splits the sequence (dim {SEQUENCE_DIM}) over the {tensor_parallel} ranks of a "
                f"tensor-parallel group, and {what} has {tensor.shape[SEQUENCE_DIM]} there (shape "
                f"{tuple(tensor.shape)}): pad it to a multiple of {tensor_parallel}, or leave sequence parallel out")


def _first_input_layout(source, target, *, local: bool):
    """A ``ParallelStyle`` that redistributes a module's first input from ``source`` to ``target`` over the tp mesh
    (the redistribution torch's ``PrepareModuleInput`` runs), the input found where the call puts it: the first
    positional argument, or the keyword that ``forward`` names first when the call passes keywords only (Note
    [sequence parallel]). ``PrepareModuleInput`` needs that choice fixed in advance; models call the same kind of
    module both ways (Hugging Face: ``self_attn(hidden_states=...)``, ``mlp(hidden_states)``)."""
    import inspect

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ParallelStyle

    def relayout(x, mesh):
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (source,), run_check=False)
        if x.placements != (target,):
            x = x.redistribute(placements=(target,))
        return x.to_local() if local else x

    class FirstInputLayout(ParallelStyle):
        def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
            first = next(iter(inspect.signature(module.forward).parameters))

            def hook(_module, args, kwargs):
                if args:
                    return (relayout(args[0], device_mesh), *args[1:]), kwargs
                if first not in kwargs:
                    raise UnsupportedModelError(
                        f"sequence parallel: {type(module).__name__} was called without its first input "
                        f"{first!r}, the hidden states autofit re-lays out (Note [sequence parallel])")
                return args, {**kwargs, first: relayout(kwargs[first], device_mesh)}

            module.register_forward_pre_hook(hook, with_kwargs=True)
            return module

        def __repr__(self) -> str:
            return f"FirstInputLayout({source} -> {target}, local={local})"

    return FirstInputLayout()


def _parent(name: str) -> str:
    return name.rpartition(".")[0]


def derive_sequence_parallel(model: nn.Module, found: list[tuple[str, str]],
                             source: str) -> tuple[tuple[str, str], ...]:
    """The plan with sequence parallel's derived styles (Note [sequence parallel]), in module order. Typed errors for
    the structures it does not cover, naming the module."""
    styles = dict(found)
    norms = [name for name, style in found if style == "sequence_parallel"]
    modules = dict(model.named_modules())
    lists = {_parent(_parent(n)) for n in norms if isinstance(modules.get(_parent(_parent(n))), nn.ModuleList)}
    if len(lists) != 1:
        raise UnsupportedModelError(
            f"{source} gives 'sequence_parallel' to {', '.join(map(repr, norms))}: autofit runs sequence parallel "
            "on the norms of the blocks of one nn.ModuleList (a Llama's model.layers.*.input_layernorm and "
            "post_attention_layernorm; Note [sequence parallel]); name those norms")
    prefix = lists.pop()
    final = _after_blocks(modules, prefix, styles)
    stray = [n for n in norms if n != final and _parent(_parent(n)) != prefix]
    if stray:
        raise UnsupportedModelError(
            f"sequence parallel: {', '.join(map(repr, stray))} is not a norm of a block of {prefix!r} nor the "
            f"module after them ({final!r}); Note [sequence parallel]")
    blocks = [f"{prefix}.{child}" for child, _ in modules[prefix].named_children()]
    derived: dict[str, str] = {blocks[0]: "sequence_shard", final: "sequence_gather_whole"}
    for block in blocks:
        derived.update(_block_styles(block, {n: s for n, s in styles.items() if n.startswith(block + ".")}, source))
    merged = {**styles, **derived}
    whole = [n for n, s in merged.items() if s == "rowwise" and n.startswith(prefix + ".")]
    if whole:
        raise UnsupportedModelError(
            f"sequence parallel: the row-parallel {whole[0]!r} is not the one output of a module with "
            "column-parallel layers, so its whole output would meet the residual stream's shard (Note [sequence "
            "parallel])")
    return tuple((name, merged[name]) for name in modules if name in merged)


def _after_blocks(modules: dict[str, nn.Module], prefix: str, styles: dict[str, str]) -> str:
    """The module after the blocks' list ``prefix`` in its parent (the final norm), where the sequence is gathered:
    the first later sibling with parameters, which must not be split."""
    outer, _, list_name = prefix.rpartition(".")
    children = list(modules[outer].named_children())
    index = next(i for i, (child, _) in enumerate(children) if child == list_name)
    following = [child for child, m in children[index + 1:] if any(True for _ in m.parameters())]
    if not following:
        raise UnsupportedModelError(
            f"sequence parallel: nothing with parameters follows {prefix!r}; autofit gathers the sequence at the "
            "module after the last block (the final norm; Note [sequence parallel])")
    final = f"{outer}.{following[0]}" if outer else following[0]
    if styles.get(final, "sequence_parallel") != "sequence_parallel":
        raise UnsupportedModelError(
            f"sequence parallel: {final!r}, the module after the last block, is split {styles[final]!r}; autofit "
            "gathers the sequence there (Note [sequence parallel]): leave it whole")
    return final


def _block_styles(block: str, inside: dict[str, str], source: str) -> dict[str, str]:
    """One block's derived styles from its split layers ``inside`` it: each child holding column-parallel layers
    gathers its input, and its one row-parallel layer reduce-scatters its output."""
    if "sequence_parallel" not in inside.values():
        raise UnsupportedModelError(
            f"sequence parallel: block {block!r} has no 'sequence_parallel' norm in {source}; every block of the "
            "list takes it (Note [sequence parallel]): give the pattern over all of them")
    derived = {}
    for name, style in inside.items():
        if style == "colwise" and _parent(name) == block:
            raise UnsupportedModelError(
                f"sequence parallel: the column-parallel {name!r} is a child of its block {block!r}, not of a "
                "module whose input autofit can gather (an attention or an MLP; Note [sequence parallel])")
    for child in sorted({_parent(n) for n, s in inside.items() if s == "colwise"}):
        rows = [n for n, s in inside.items() if s == "rowwise" and n.startswith(child + ".")]
        if len(rows) != 1:
            raise UnsupportedModelError(
                f"sequence parallel: {child!r} holds column-parallel layers and {len(rows)} row-parallel ones; "
                "autofit reduce-scatters the one row-parallel output that returns to the residual stream "
                "(Note [sequence parallel])")
        derived[child] = "sequence_gather"
        derived[rows[0]] = "rowwise_sequence"
    return derived


def block_norms(model: nn.Module, split: list[str]) -> dict[str, str]:
    """"sequence_parallel" for each norm (a child whose parameters are all 1-D) of the blocks that hold the modules
    named in ``split``, a block being the nearest ancestor that is an entry of an ``nn.ModuleList``."""
    modules = dict(model.named_modules())
    blocks: set[str] = set()
    for name in split:
        while name and not isinstance(modules[_parent(name)], nn.ModuleList):
            name = _parent(name)
        if name:
            blocks.add(name)
    return {f"{block}.{child}": "sequence_parallel" for block in sorted(blocks)
            for child, m in modules[block].named_children()
            if any(True for _ in m.parameters()) and all(p.dim() == 1 for p in m.parameters())}
