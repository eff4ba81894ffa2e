"""Pipeline parallelism (issue 59), its first piece: a model cut into the stages a pipeline rank runs.

Work in progress: nothing in the planner, the simulation, ``measure`` or the trainers uses this module yet, and no
layout offers a pipeline; it is the piece they will all stand on. See Note [pipeline stages].

Note [pipeline stages]
    torch's ``PipelineStage`` (torch/distributed/pipelining/stage.py) runs one module per stage: its forward takes
    what the previous stage sent (the first stage: the micro-batch's inputs) and returns what it sends on (the last:
    the output the schedule's loss reads). torchtitan cuts its own models by deleting the layers a stage does not
    hold and setting the embedding, final norm and head of the middle stages to None, which its ``forward`` skips
    (torchtitan/distributed/pipeline_parallel.py, ``pipeline_module_split``). A Hugging Face decoder declares the
    same cut (``config.base_model_pp_plan``: ``embed_tokens`` takes ``input_ids`` and gives ``inputs_embeds``,
    ``layers`` take and give ``hidden_states``, ``norm`` gives ``hidden_states``; ``_pp_plan``: ``lm_head`` gives
    ``logits``), and its base model's ``forward`` takes ``inputs_embeds`` in place of ``input_ids`` and loops over
    ``self.layers`` (transformers 5, ``LlamaModel.forward``). So a stage here is the decoder with its ``layers``
    cut to the stage's run: the first stage embeds, a later one is given the hidden states as ``inputs_embeds``;
    the embedding only on the first (a later one holds none), the final norm and the head only on the last (an
    earlier one has an identity norm and no head). Each stage
    computes its own rotary embeddings and causal mask from the hidden states' shape, as the whole model does, so
    the stages chained compute exactly the whole model's logits (tests/test_pipeline_stages.py). A stage shares
    its modules (and so its parameters) with the model it was cut from: a pipeline rank keeps only its own.
"""

from __future__ import annotations

import copy

from torch import nn

from autofit.core.errors import UnsupportedModelError

__all__ = ["decoder_stages", "layer_split"]


def layer_split(layers: int, stages: int) -> list[range]:
    """The layers of each stage, an even split by count with the remainder on the first stages (torchtitan's
    default, ``generate_llm_fqn_per_model_part`` without weights for the embedding and head)."""
    if not 1 <= stages <= layers:
        raise UnsupportedModelError(f"{layers} layers cannot be split over {stages} pipeline stages: give at most "
                                    f"{layers} stages")
    size, extra = divmod(layers, stages)
    bounds, start = [], 0
    for s in range(stages):
        end = start + size + (1 if s < extra else 0)
        bounds.append(range(start, end))
        start = end
    return bounds


class _Stage(nn.Module):
    """One stage of a Hugging Face decoder (Note [pipeline stages])."""

    def __init__(self, base: nn.Module, head: nn.Module | None, first: bool) -> None:
        super().__init__()
        self.base, self.head, self.first = base, head, first

    def forward(self, x):
        given = {"input_ids": x} if self.first else {"inputs_embeds": x}
        hidden = self.base(**given, use_cache=False).last_hidden_state
        return hidden if self.head is None else self.head(hidden)


def decoder_stages(model: nn.Module, stages: int) -> list[nn.Module]:
    """``model`` (a Hugging Face causal LM whose config declares ``base_model_pp_plan``) cut into ``stages``
    modules that share its parameters, in order (Note [pipeline stages])."""
    plan = getattr(getattr(model, "config", None), "base_model_pp_plan", None)
    base = getattr(model, "base_model", None)
    head = getattr(model, "lm_head", None)
    if not plan or base is None or head is None or not isinstance(getattr(base, "layers", None), nn.ModuleList):
        raise UnsupportedModelError(
            f"{type(model).__name__} cannot be cut into pipeline stages: autofit cuts Hugging Face causal LMs whose "
            "config declares base_model_pp_plan (embed_tokens, layers, norm) and whose head is lm_head")
    cut = []
    for s, layers in enumerate(layer_split(len(base.layers), stages)):
        part = copy.copy(base)  # a shallow copy: the same submodules, in a module dict of its own
        part._modules = dict(base._modules)
        part.layers = nn.ModuleList(base.layers[i] for i in layers)
        last = s == stages - 1
        if s > 0:  # given the hidden states: its forward never reads the embedding, which the first stage keeps
            part.embed_tokens = None
        if not last:
            part.norm = nn.Identity()
        cut.append(_Stage(part, head if last else None, first=s == 0))
    return cut
