"""``hf:NAME``: a Hugging Face model built from its config on the meta device (nothing downloaded but a config).

NAME is resolved, first match wins (so the common checkpoints never touch the network):
1. a local directory holding ``config.json``: ``AutoConfig.from_pretrained(directory)``;
2. the local Hugging Face cache: ``AutoConfig.from_pretrained(NAME, local_files_only=True)``;
3. autofit's offline table of common checkpoints (:mod:`autofit.cli.hf_checkpoints`), names matched
   case-insensitively, and a unique close match (same numbers, another spelling) used with a note;
4. a model type transformers knows (``hf:llama``): ``AutoConfig.for_model(TYPE)``, its defaults;
5. the Hub, unless ``HF_HUB_OFFLINE`` is set or NAME is a typo of a table name (Note [near-miss names]):
   ``AutoConfig.from_pretrained(NAME)``.
An unknown name is one short line naming the closest known names and the ``hf:TYPE --config key=value`` form.
``--config`` keys the config class does not define are an error (a typo would otherwise be silently ignored).
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from autofit.cli.hf_checkpoints import CHECKPOINTS, checkpoint_config, match_checkpoint
from autofit.cli.hf_names import near_miss
from autofit.cli.quiet_imports import quiet_third_party_imports
from autofit.core.errors import InvalidInputError

__all__ = ["resolve_config", "offline_config", "build_model", "model_from_config", "default_task", "HFModel"]


@dataclass(frozen=True)
class HFModel:
    model: torch.nn.Module
    sample: dict[str, torch.Tensor]
    task: str
    source: str  # where the config came from: "offline table", "cache", "directory", "model type", "hub"


def _transformers():
    try:
        with quiet_third_party_imports():  # Note [import noise]: modeling_utils imports torchao's quantizer
            import transformers
            import transformers.modeling_utils  # noqa: F401
    except ImportError as e:
        raise InvalidInputError("hf:NAME needs transformers installed (pip install 'torch-autofit[hf]')") from e
    transformers.logging.set_verbosity_error()  # the command's output is the plan, not config chatter
    return transformers


def _offline() -> bool:
    from huggingface_hub import constants

    flag = os.environ.get("HF_HUB_OFFLINE", "")
    return constants.HF_HUB_OFFLINE or flag.upper() in ("1", "ON", "YES", "TRUE")


def _check_overrides(config, overrides: dict[str, Any]) -> None:
    for key in overrides:
        if not hasattr(config, key):
            fields = [k for k in config.to_dict() if not k.startswith("_")]
            close = difflib.get_close_matches(key, fields, n=2)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise InvalidInputError(f"--config {key}=...: {type(config).__name__} has no field {key!r}{hint}")


def _unknown(name: str, known_types, where: str | None = None) -> InvalidInputError:
    close = difflib.get_close_matches(name, [*CHECKPOINTS, *known_types], n=3, cutoff=0.5)
    where = where or ("offline, not cached" if _offline() else "not found locally or on the Hub")
    hint = f"closest: {', '.join(close)}; " if close else ""
    shown = name if len(name) <= 60 else name[:57] + "..."  # the message stays one short line
    return InvalidInputError(f"unknown Hugging Face name {shown!r} ({where}); {hint}or build from a model type: "
                             "hf:TYPE --config key=value (e.g. hf:llama --config num_hidden_layers=2)")


def resolve_config(name: str, overrides: dict[str, Any]):
    """The config for ``hf:NAME`` with ``--config`` overrides applied, and where it came from."""
    transformers = _transformers()
    auto, types = transformers.AutoConfig, transformers.CONFIG_MAPPING

    def pretrained(source: str, **kw):
        config = auto.from_pretrained(name, **kw)
        _check_overrides(config, overrides)
        return auto.from_pretrained(name, **kw, **overrides), source

    if (Path(name) / "config.json").is_file():
        return pretrained("directory")
    if "/" in name or name not in types:
        try:
            return pretrained("cache", local_files_only=True)
        except (OSError, ValueError):
            pass
    # a table name first (gpt2 is one, and a model type too), then a looser match unless it names a model type
    matched = match_checkpoint(name) if name in CHECKPOINTS or name not in types else None
    entry = checkpoint_config(matched[0]) if matched is not None else None
    if entry is not None or name in types:
        model_type = entry.pop("model_type") if entry is not None else name
        base = auto.for_model(model_type, **(entry or {}))
        _check_overrides(base, overrides)
        source = "model type defaults" if entry is None else "offline table" + (
            f" as {matched[0]}: {matched[1]}" if matched[1] else "")
        return auto.for_model(model_type, **{**(entry or {}), **overrides}), source
    typo = near_miss(name, CHECKPOINTS)  # answered offline, before the Hub's retries (Note [near-miss names])
    if typo is not None:
        raise _unknown(name, types.keys(), "a near miss of the offline table: the Hub was not asked")
    if not _offline():
        try:
            return pretrained("hub")
        except (OSError, ValueError):
            pass
    raise _unknown(name, types.keys())


def offline_config(name: str):
    """The config of the offline table's entry for ``name`` alone (no directory, cache or Hub), or None."""
    entry = checkpoint_config(name)
    if entry is None:
        return None
    return _transformers().AutoConfig.for_model(entry.pop("model_type"), **entry)


_HEADS = {"causal-lm": "AutoModelForCausalLM", "masked-lm": "AutoModelForMaskedLM",
          "seq2seq-lm": "AutoModelForSeq2SeqLM"}


def _is_vision(config) -> bool:
    return hasattr(config, "image_size") and hasattr(config, "num_channels") and not hasattr(config, "vocab_size")


def default_task(config) -> str:
    """The head the checkpoint was published with (``architectures``), else causal LM (seq2seq for T5-like), or
    masked LM for an encoder transformers has no causal-LM head for (DeBERTa-v3's config names no architecture)."""
    arch = (getattr(config, "architectures", None) or [""])[0]
    for suffix, task in (("ForMaskedLM", "masked-lm"), ("ForSequenceClassification", "classification"),
                         ("ForImageClassification", "classification")):
        if arch.endswith(suffix):
            return task
    if getattr(config, "is_encoder_decoder", False):
        return "seq2seq-lm"
    if _is_vision(config):
        return "classification"
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as causal
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES as masked

    kind = getattr(config, "model_type", "")
    return "masked-lm" if kind not in causal and kind in masked else "causal-lm"


def _head(transformers, config, task: str):
    if task in _HEADS:
        return getattr(transformers, _HEADS[task])
    if task == "regression":
        config.num_labels, config.problem_type = 1, "regression"
    if _is_vision(config):
        return transformers.AutoModelForImageClassification
    if getattr(config, "pad_token_id", None) is None:  # sequence classification finds each row's last real token
        config.pad_token_id = getattr(config, "eos_token_id", None) or 0
    return transformers.AutoModelForSequenceClassification


def _sample(config, task: str, shape: tuple[int, ...] | None, rows: int) -> dict[str, torch.Tensor]:
    if _is_vision(config):
        shape = shape or (config.num_channels, config.image_size, config.image_size)
        sample = {"pixel_values": torch.randn(rows, *shape)}
    else:  # a vision-language model's text fields are its text config's (Gemma 3 from 4B)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        positions = int(getattr(text, "max_position_embeddings", 0) or getattr(text, "n_positions", 0) or 512)
        seq = shape[0] if shape else min(positions, 1024)
        sample = {"input_ids": torch.randint(0, int(text.vocab_size), (rows, seq))}
    if task in ("causal-lm", "masked-lm", "seq2seq-lm"):
        sample["labels"] = sample["input_ids"].clone()
    elif task == "regression":
        sample["labels"] = torch.randn(rows)
    else:
        sample["labels"] = torch.randint(0, int(config.num_labels), (rows,))
    return sample


def model_from_config(config, task: str | None = None, *, name: str = "MODEL") -> tuple[torch.nn.Module, str]:
    """The model for ``config`` on the meta device with the task's head (the checkpoint's own head when ``task`` is
    None), and that task. ``autofit models`` counts parameters on it."""
    transformers = _transformers()
    task = task or default_task(config)
    if task in ("causal-lm", "masked-lm", "seq2seq-lm") and _is_vision(config):
        raise InvalidInputError(f"--task {task} needs a text model; {name!r} is a vision model: use classification")
    head = _head(transformers, config, task)
    with torch.device("meta"):
        try:
            return head.from_config(config), task
        except ValueError as e:
            raise InvalidInputError(f"transformers has no {task} head for {type(config).__name__}: choose another "
                                    f"--task ({', '.join([*_HEADS, 'classification', 'regression'])})") from e


def build_model(name: str, overrides: dict[str, Any], *, task: str | None, shape: tuple[int, ...] | None,
                rows: int) -> HFModel:
    """The model on the meta device with the task's head, and a sample whose ``labels`` make it return its loss."""
    config, source = resolve_config(name, overrides)
    model, task = model_from_config(config, task, name=name)
    return HFModel(model, _sample(config, task, shape, rows), task, source)
