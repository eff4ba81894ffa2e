"""Which framework a config file comes from, read from its content, and the file read into a
:class:`~autofit.cli.configs.value.TrainConfig` by that framework's reader.

The format follows the suffix (``.yaml``/``.yml``, ``.json``, ``.toml``); the framework follows the keys, first
match wins: torchtitan (TOML sections ``[model]`` with ``flavor`` and ``[training]``), torchtune (``model`` with a
``_component_``), axolotl (``base_model``), LLaMA-Factory (``model_name_or_path`` with one of its own keys:
``finetuning_type``, ``cutoff_len``, ``stage``, ``template``, ...), then TRL / Hugging Face ``TrainingArguments``
(``per_device_train_batch_size``, or ``model_name_or_path`` with a TRL key)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from autofit.core.errors import InvalidInputError
from autofit.cli.configs import axolotl, hf_args, llamafactory, torchtitan, torchtune
from autofit.cli.configs.value import TrainConfig

__all__ = ["load", "detect", "reader", "read_config", "READERS", "FORMATS"]

READERS: tuple[tuple[str, ModuleType], ...] = (
    ("torchtitan", torchtitan), ("torchtune", torchtune), ("axolotl", axolotl), ("llama-factory", llamafactory),
    ("trl", hf_args))
FORMATS = {".yaml": "yaml", ".yml": "yaml", ".json": "json", ".toml": "toml"}


def load(path: Path) -> tuple[Mapping[str, Any], str]:
    """The file's mapping and its format ("yaml", "json", "toml")."""
    path = Path(path)
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise InvalidInputError(f"{path}: a config ends in .yaml, .yml, .json or .toml")
    try:
        text = path.read_text()
    except OSError as e:
        raise InvalidInputError(f"{path}: cannot read it ({e.strerror or e})") from e
    try:
        data = _parse(text, fmt)
    except InvalidInputError:
        raise
    except Exception as e:  # noqa: BLE001 - each parser has its own error type; all are bad input here
        raise InvalidInputError(f"{path}: not valid {fmt.upper()}: {e}") from e
    if not isinstance(data, Mapping):
        raise InvalidInputError(f"{path}: the file holds no mapping of keys (got {type(data).__name__})")
    return data, fmt


def _parse(text: str, fmt: str) -> Any:
    """Plain mappings: JSON by the standard library, TOML by tomllib (Python 3.11+) or tomlkit, YAML 1.2 by
    ruamel.yaml's safe loader (the configs extra; writing back uses the same libraries round trip)."""
    if fmt == "json":
        return json.loads(text)
    if fmt == "toml":
        try:
            import tomllib
        except ImportError:  # Python 3.10
            return _extra("tomlkit").parse(text).unwrap()
        return tomllib.loads(text)
    yaml = _extra("ruamel.yaml").YAML(typ="safe", pure=True)
    return yaml.load(text)


def _extra(module: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise InvalidInputError(f"reading a training config needs {module}: pip install "
                                "'torch-autofit[configs]'") from e


def detect(data: Mapping[str, Any], fmt: str = "yaml") -> str:
    """The framework's name, from the keys."""
    for name, reader in READERS:
        if (name == "torchtitan") == (fmt == "toml") and reader.looks_like(data):
            return name
    raise InvalidInputError(
        "cannot tell which framework this config is for: autofit reads axolotl (base_model), LLaMA-Factory "
        "(model_name_or_path with finetuning_type or cutoff_len), torchtune (model: _component_), TRL / Hugging "
        "Face TrainingArguments (per_device_train_batch_size) and torchtitan TOML ([model] flavor, [training])")


def reader(framework: str) -> ModuleType:
    for name, module in READERS:
        if name == framework or (framework == "hf" and name == "trl"):
            return module
    raise InvalidInputError(f"unknown framework {framework!r}")


def read_config(path: str | Path, *, data_ranks: int | None = None) -> TrainConfig:
    """The config at ``path`` read by its framework's reader; ``data_ranks`` (the ranks training different rows)
    replaces the config's when given, as the launcher's world size does."""
    import dataclasses

    path = Path(path)
    data, fmt = load(path)
    module = reader(detect(data, fmt))
    config = module.read(data, path)
    if data_ranks is not None and data_ranks != config.data_ranks:
        # per-device batches multiply by the ranks; a framework that states a global batch re-splits it
        rerank = getattr(module, "with_ranks", None)
        config = rerank(config, data_ranks) if rerank else dataclasses.replace(
            config, data_ranks=data_ranks, data_ranks_stated=True)
    return config
