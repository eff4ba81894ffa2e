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

Note [the dtype a checkpoint loads in]
    The model is built in the dtype ``from_pretrained(NAME)`` gives with the INSTALLED transformers and no ``dtype``
    argument, since that is the model the user will train (``--dtype`` / ``dtype=`` overrides it):
    - transformers 5.x: ``from_pretrained``'s ``dtype`` defaults to ``"auto"`` (transformers 5.24,
      modeling_utils.py, PreTrainedModel.from_pretrained: ``if dtype is None: dtype = "auto"``, line 4187), and
      ``_get_dtype`` resolves ``"auto"`` to ``config.dtype`` (lines 829-831: ``if dtype == "auto": if
      hasattr(config, "dtype") and config.dtype is not None: dtype = config.dtype``), else to the dtype of the
      weights' first floating tensor (lines 833-844). ``config.dtype`` is ``config.json``'s ``torch_dtype`` /
      ``dtype`` (configuration_utils.py lines 438-448). So bf16 for Llama 3.x, Qwen2.5 / 3, Gemma 3.
      ``from_config`` agrees: ``_from_config`` takes ``dtype = kwargs.pop("dtype", config.dtype)`` (line 1402).
    - transformers 4.x: ``from_pretrained``'s ``torch_dtype`` defaulted to None, and the model was built in
      torch's default dtype, fp32 ("If not specified - the model will get loaded in torch.float (fp32)", its
      docstring); only ``torch_dtype="auto"`` read the config. (4.x's ``_from_config`` did take
      ``config.torch_dtype``, but a user loads weights with ``from_pretrained``.)
    A config that names no dtype (GPT-2's, BERT's, a model type's defaults) is built in fp32: "auto" falls back to
    the weights, which autofit does not read, and those checkpoints' weights are fp32 (the offline table records
    each entry's dtype, autofit/cli/checkpoints/entry.py).
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

__all__ = ["resolve_config", "offline_config", "build_model", "model_from_config", "default_task", "HFModel",
           "DTYPES", "load_dtype", "hf_model"]

# --dtype's values; "auto" is Note [the dtype a checkpoint loads in]
DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16,
                                         "fp16": torch.float16}
_SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclass(frozen=True)
class HFModel:
    model: torch.nn.Module
    sample: dict[str, torch.Tensor]
    task: str
    source: str  # where the config came from: "offline table", "cache", "directory", "model type", "hub"
    dtype: str = ""  # the parameters' dtype and why, e.g. "bf16, as transformers 5.24 loads it"
    adapter: str = ""  # the adapter applied, e.g. "LoRA r=16 on q_proj,v_proj (peft's default for qwen2)"


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


def _transformers_version() -> str:
    return _transformers().__version__


def _config_dtype(config) -> torch.dtype | None:
    # 5.x keeps config.json's torch_dtype as config.dtype, 4.x as config.torch_dtype (a str or a torch.dtype);
    # read from __dict__: 5.x's torch_dtype property warns that it is deprecated
    value = vars(config).get("dtype") or vars(config).get("torch_dtype")
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else None


def load_dtype(config, requested: str | torch.dtype = "auto") -> tuple[torch.dtype, str]:
    """The dtype ``hf:`` builds ``config``'s model in, and the words that say why (Note [the dtype a checkpoint
    loads in]): ``requested`` is ``--dtype``'s value (auto, fp32, bf16, fp16) or a torch dtype."""
    if isinstance(requested, torch.dtype):
        if requested not in _SHORT:
            raise InvalidInputError(f"dtype {requested} is not a floating-point dtype a checkpoint loads in: use "
                                    "torch.float32, torch.bfloat16 or torch.float16")
        return requested, f"{_SHORT[requested]}, as asked"
    if requested not in DTYPES:
        raise InvalidInputError(f"unknown --dtype {requested!r}: use one of {', '.join(DTYPES)}")
    if DTYPES[requested] is not None:
        return DTYPES[requested], f"{requested}, as --dtype says"
    version = _transformers_version()
    short = ".".join(version.split(".")[:2])
    if int(version.split(".")[0]) < 5:  # from_pretrained without torch_dtype: torch's default
        return torch.float32, f"fp32, as transformers {short} loads it (its default; --dtype to change)"
    dtype = _config_dtype(config)
    if dtype not in _SHORT:  # no dtype in the config: fp32, the weights' dtype for such checkpoints
        return torch.float32, f"fp32, as transformers {short} loads it (the config names no dtype)"
    return dtype, f"{_SHORT[dtype]}, as transformers {short} loads it"


def model_from_config(config, task: str | None = None, *, name: str = "MODEL",
                      dtype: torch.dtype | None = None) -> tuple[torch.nn.Module, str]:
    """The model for ``config`` on the meta device with the task's head (the checkpoint's own head when ``task`` is
    None), and that task. ``autofit models`` counts parameters on it. Built in ``dtype``, else in the dtype the
    installed transformers loads the checkpoint in (:func:`load_dtype`)."""
    transformers = _transformers()
    task = task or default_task(config)
    if task in ("causal-lm", "masked-lm", "seq2seq-lm") and _is_vision(config):
        raise InvalidInputError(f"--task {task} needs a text model; {name!r} is a vision model: use classification")
    head = _head(transformers, config, task)
    dtype = dtype or load_dtype(config)[0]
    # 5.x's _from_config takes dtype=, 4.x's torch_dtype= (5.x still reads torch_dtype, with a warning)
    key = "torch_dtype" if int(_transformers_version().split(".")[0]) < 5 else "dtype"
    with torch.device("meta"):
        try:
            return head.from_config(config, **{key: dtype}), task
        except ValueError as e:
            raise InvalidInputError(f"transformers has no {task} head for {type(config).__name__}: choose another "
                                    f"--task ({', '.join([*_HEADS, 'classification', 'regression'])})") from e


def build_model(name: str, overrides: dict[str, Any], *, task: str | None, shape: tuple[int, ...] | None,
                rows: int, dtype: str | torch.dtype = "auto", adapter=None) -> HFModel:
    """The model on the meta device with the task's head, in ``dtype`` (Note [the dtype a checkpoint loads in]), with
    ``adapter`` (:class:`autofit.cli.adapters.Adapter`: LoRA / QLoRA) applied, and a sample whose ``labels`` make it
    return its loss."""
    from autofit.cli.adapters import apply_adapter

    config, source = resolve_config(name, overrides)
    resolved, why = load_dtype(config, dtype)
    model, task = model_from_config(config, task, name=name, dtype=resolved)
    words = ""
    if adapter is not None:
        model, words = apply_adapter(model, adapter)
    return HFModel(model, _sample(config, task, shape, rows), task, source, why, words)


def hf_model(name: str, *, dtype: str | torch.dtype = "auto", task: str | None = "causal-lm", lora: int | None = None,
             lora_targets: str | list[str] | tuple[str, ...] | None = None, lora_alpha: float | None = None,
             qlora: bool = False, load_in_8bit: bool = False) -> torch.nn.Module:
    """The Hugging Face model ``name`` on the meta device, as ``hf:NAME`` builds it: nothing is downloaded but a
    config, and the common checkpoints need not even that (the offline table, ``autofit models``).

    ``dtype``: "auto" (the dtype the installed transformers' ``from_pretrained`` loads the checkpoint in: its
    ``config.json`` dtype from transformers 5, bf16 for Llama 3 / Qwen2.5), "fp32", "bf16", "fp16" or a torch dtype.
    ``task``: the head ("causal-lm", "masked-lm", "seq2seq-lm", "classification", "regression"; None: the
    checkpoint's own). ``lora``: a LoRA rank, applied with peft on ``lora_targets`` (module names, or "all-linear";
    None: peft's default for the architecture, or all-linear where peft has none) with ``lora_alpha`` (None: peft's
    default). ``qlora``: the base's linear layers in bitsandbytes' 4-bit NF4 under the adapters (needs ``lora``;
    Note [QLoRA on meta] in autofit/cli/adapters.py). ``load_in_8bit``: the base's linear layers in bitsandbytes'
    int8 (LLM.int8(), transformers' ``BitsAndBytesConfig(load_in_8bit=True)``) under the adapters (needs ``lora``;
    Note [8-bit LoRA on meta]).

    Plan it with a batch of token ids (and ``labels`` for the loss), e.g.
    ``ids = torch.randint(0, model.config.vocab_size, (2, 4096)); autofit.plan(model, {"input_ids": ids,
    "labels": ids}, "24GB", batch_size=64, gpu="RTX-4090")``.
    """
    from autofit.cli.adapters import Adapter

    if isinstance(lora_targets, str) and lora_targets != "all-linear":
        lora_targets = tuple(t.strip() for t in lora_targets.split(",") if t.strip())
    elif isinstance(lora_targets, list):
        lora_targets = tuple(lora_targets)
    adapter = Adapter(rank=lora, targets=lora_targets, alpha=lora_alpha, qlora=qlora, int8=load_in_8bit)
    return build_model(name, {}, task=task, shape=None, rows=1, dtype=dtype, adapter=adapter).model
