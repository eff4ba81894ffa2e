"""Turn a MODEL argument into a model, an example batch, a target and a loss (pure data: tested without the CLI).

MODEL is one of
- ``pkg.module:factory`` or ``path/to/file.py:factory``: a callable returning a module, ``(module, sample)`` or
  ``(module, sample, target)``; ``--task`` supplies the target and loss a factory does not (autofit/cli/tasks.py);
- ``torchvision:NAME``: ``torchvision.models.get_model(NAME, weights=None)`` (random weights, never downloaded);
- ``hf:NAME``: a Hugging Face checkpoint name (``hf:bert-base-uncased``, ``hf:meta-llama/Llama-2-7b-hf``), a local
  directory with ``config.json``, or a model type (``hf:llama --config num_hidden_layers=2``); only the config is
  read, see autofit/cli/hf_spec.py.
Library models are built on the meta device: planning needs shapes, not weights.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autofit.cli import tasks
from autofit.core.errors import InvalidInputError

__all__ = ["ModelSpec", "load_spec", "parse_overrides", "SAMPLE_ROWS", "parse_dtype", "parse_shape"]

SAMPLE_ROWS = 2  # rows of the example batch autofit builds; it resizes them to every micro-batch it plans


@dataclass(frozen=True)
class ModelSpec:
    model: nn.Module
    sample: Any
    target: Any
    description: str
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None  # None: autofit's default (output.loss for HF models)


_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64,
           "int32": torch.int32, "long": torch.int64, "float": torch.float32}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise InvalidInputError(f"unknown --input-dtype {name!r}: use one of {', '.join(_DTYPES)}") from None


def parse_shape(text: str) -> tuple[int, ...]:
    """'3,224,224' or '3x224x224' -> (3, 224, 224): one sample's shape, without the batch dimension."""
    parts = [p for p in text.replace("x", ",").replace(" ", "").split(",") if p]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        raise InvalidInputError(f"cannot read --input-shape {text!r}: write sizes like 3,224,224") from None
    if not shape or any(s < 1 for s in shape):
        raise InvalidInputError(f"--input-shape {text!r} must list positive sizes, e.g. 3,224,224")
    return shape


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """--config key=value pairs; values are read as JSON when they parse (numbers, booleans), else as strings."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise InvalidInputError(f"--config {item!r} must look like key=value, e.g. n_layer=12")
        key, value = item.split("=", 1)
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def _random_input(shape: tuple[int, ...], dtype: torch.dtype, high: int = 1000) -> torch.Tensor:
    full = (SAMPLE_ROWS, *shape)
    if dtype.is_floating_point:
        return torch.randn(full, dtype=dtype)
    return torch.randint(0, high, full, dtype=dtype)


def load_spec(spec: str, *, input_shapes: list[tuple[int, ...]] | None = None, input_dtype: torch.dtype | None = None,
              config: dict[str, Any] | None = None, task: str | None = None, dtype: str = "auto",
              adapter=None) -> ModelSpec:
    """``dtype`` (--dtype) and ``adapter`` (--lora, --qlora: :class:`autofit.cli.adapters.Adapter`) apply to hf:
    models, which autofit builds; a factory builds its own model in its own dtype, with its own adapters."""
    if task is not None:
        tasks.check_task(task)
    hf = spec.startswith("hf:")
    if not hf and (dtype != "auto" or (adapter is not None and adapter.rank is not None)):
        flag = "--dtype" if dtype != "auto" else ("--qlora" if adapter.qlora else "--lora")
        raise InvalidInputError(f"{flag} applies to hf:NAME models; a factory returns its model as it built it "
                                "(apply peft's get_peft_model, or .to(dtype), in the factory)")
    if spec.startswith("torchvision:"):
        if task not in (None, "classification"):
            raise InvalidInputError(f"--task {task}: torchvision: models are planned as classifiers (their target is "
                                    "class labels); use a factory for another task")
        return _torchvision(spec.split(":", 1)[1], input_shapes, config or {})
    if spec.startswith("hf:"):
        return _huggingface(spec.split(":", 1)[1], input_shapes, config or {}, task, dtype, adapter)
    if ":" not in spec:
        raise InvalidInputError(
            f"cannot read MODEL {spec!r}: use pkg.module:factory, path/file.py:factory, torchvision:NAME or "
            "hf:NAME (a checkpoint name such as hf:gpt2, or hf:TYPE --config key=value)"
        )
    return _factory(spec, input_shapes, input_dtype, task)


def _load_callable(spec: str):
    module_name, _, attr = spec.rpartition(":")
    try:
        if module_name.endswith(".py") or "/" in module_name:
            path = Path(module_name)
            if not path.exists():
                raise InvalidInputError(f"MODEL file {module_name!r} does not exist")
            loader = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loader)
            sys.modules.setdefault(path.stem, module)
            loader.loader.exec_module(module)
        else:
            sys.path.insert(0, str(Path.cwd()))
            module = importlib.import_module(module_name)
    except ImportError as e:
        raise InvalidInputError(f"cannot import {module_name!r} for MODEL {spec!r}: {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError:
        raise InvalidInputError(f"{module_name!r} has no attribute {attr!r} (MODEL {spec!r})") from None


def _factory(spec: str, input_shapes, input_dtype, task: str | None) -> ModelSpec:
    result = _load_callable(spec)()
    target = None
    if isinstance(result, nn.Module):
        model, sample = result, None
    elif isinstance(result, tuple) and result and isinstance(result[0], nn.Module) and len(result) in (2, 3):
        model, sample = result[0], result[1]
        target = result[2] if len(result) == 3 else None
    else:
        raise InvalidInputError(
            f"factory {spec!r} returned {type(result).__name__}: return a module, (module, sample) or "
            "(module, sample, target)"
        )
    lm = task in tasks.LM_TASKS
    if input_shapes:
        dtype = input_dtype or (torch.int64 if lm else torch.float32)
        high = (tasks.vocab_size(model) or 1000) if lm else 1000
        tensors = [_random_input(s, dtype, high) for s in input_shapes]
        sample = tensors[0] if len(tensors) == 1 else tuple(tensors)
    if sample is None:
        raise InvalidInputError(
            f"factory {spec!r} returned only a module: give one sample's shape with --input-shape (e.g. 3,224,224)"
        )
    if task is None:
        return ModelSpec(model, sample, target, spec)
    rows = _rows(sample)
    if target is None:
        target = tasks.task_target(task, model, sample, rows)
    return ModelSpec(model, sample, target, f"{spec} ({task})", tasks.task_loss(task))


def _rows(sample: Any) -> int:
    first = sample[0] if isinstance(sample, (tuple, list)) else sample
    if isinstance(sample, dict):
        first = next(iter(sample.values()))
    if not isinstance(first, torch.Tensor) or first.dim() == 0:
        raise InvalidInputError("--task needs a sample whose first input is a tensor with a batch dimension")
    return first.shape[0]


def _torchvision(name: str, input_shapes, config: dict[str, Any]) -> ModelSpec:
    try:
        import torchvision
    except ImportError as e:
        raise InvalidInputError("torchvision:NAME needs torchvision installed (pip install torchvision)") from e
    try:
        with torch.device("meta"):
            model = torchvision.models.get_model(name, weights=None, **config)
    except ValueError as e:
        raise InvalidInputError(f"torchvision has no model {name!r}: {e}") from e
    shape = input_shapes[0] if input_shapes else (3, 224, 224)
    classes = int(config.get("num_classes", 1000))
    sample = torch.randn(SAMPLE_ROWS, *shape)
    target = torch.randint(0, classes, (SAMPLE_ROWS,))
    return ModelSpec(model, sample, target, f"torchvision {name} (random weights), input {shape}")


def _huggingface(name: str, input_shapes, overrides: dict[str, Any], task: str | None, dtype: str = "auto",
                 adapter=None) -> ModelSpec:
    from autofit.cli.hf_spec import build_model

    built = build_model(name, overrides, task=task, shape=input_shapes[0] if input_shapes else None,
                        rows=SAMPLE_ROWS, dtype=dtype, adapter=adapter)
    # a 4-bit weight (QLoRA) packs two values a byte into uint8: count the values, not the bytes
    params = sum(p.numel() * (2 if type(p).__name__ == "Params4bit" else 1) for p in built.model.parameters())
    size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.0f}M"
    if built.adapter:
        trainable = sum(p.numel() for p in built.model.parameters() if p.requires_grad)
        size = f"{size}, {trainable / 1e6:.1f}M trainable"
    first = next(iter(built.sample.values()))
    shape = f"sequence {first.shape[1]}" if first.dim() == 2 else f"input {tuple(first.shape[1:])}"
    adapter_words = f", {built.adapter}" if built.adapter else ""
    return ModelSpec(built.model, built.sample, None,
                     f"{name}: {type(built.model).__name__} ({size} parameters, {built.dtype}, config from "
                     f"{built.source}){adapter_words}, {built.task}, {shape}")
