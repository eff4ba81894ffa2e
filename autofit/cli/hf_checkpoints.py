"""The configs of common Hugging Face checkpoints, so that ``hf:NAME`` plans offline: numbers only, no weights.

The data lives in :mod:`autofit.cli.checkpoints`, one module per family; this module gathers it into one index.
Each entry is the keyword arguments of ``transformers.AutoConfig.for_model(model_type, **kwargs)``, copied from the
checkpoint's ``config.json`` on the Hugging Face Hub (the fields that decide shapes; everything else keeps the config
class's default, which for these checkpoints is the published value). ``architectures`` is kept because it names the
head the checkpoint was trained with, and ``hf:`` builds that head unless ``--task`` says otherwise.

Names are the Hub's repository ids. Aliases share an entry: instruct / chat variants, Pythia's ``-deduped`` models,
and the short legacy ids (``gpt2``, ``bert-base-uncased``, ``t5-small``) of the organisation ids
(``openai-community/gpt2``, ``google-bert/bert-base-uncased``, ``google-t5/t5-small``).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from autofit.cli.checkpoints import classic, deepseek, encoders, gemma, llama, mistral, phi, qwen, vision
from autofit.cli.checkpoints.entry import Checkpoint

__all__ = ["Checkpoint", "TABLE", "CHECKPOINTS", "checkpoint_config", "find_checkpoint", "match_checkpoint"]

# Listing order: decoders by family, then encoders, then vision models.
TABLE: tuple[Checkpoint, ...] = (*llama.CHECKPOINTS, *qwen.CHECKPOINTS, *gemma.CHECKPOINTS, *phi.CHECKPOINTS,
                                 *mistral.CHECKPOINTS, *deepseek.CHECKPOINTS, *classic.CHECKPOINTS,
                                 *encoders.CHECKPOINTS, *vision.CHECKPOINTS)


def _index(table: tuple[Checkpoint, ...]) -> dict[str, Checkpoint]:
    index: dict[str, Checkpoint] = {}
    for entry in table:
        for name in (entry.name, *entry.aliases):
            if name in index:  # two entries claiming one name: the second would silently shadow the first
                raise ValueError(f"offline table: {name!r} is claimed by {index[name].name!r} and {entry.name!r}")
            index[name] = entry
    return index


_BY_NAME = _index(TABLE)

CHECKPOINTS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {name: entry.config for name, entry in _BY_NAME.items()})


_LOWER: dict[str, list[str]] = {}
for _name in _BY_NAME:
    _LOWER.setdefault(_name.lower(), []).append(_name)
# words that name a variant of one model (post-trained, pre-trained, converted), dropped when names are compared
_VARIANT_WORDS = frozenset({"it", "pt", "instruct", "base", "chat", "hf", "deduped"})


def _words(name: str) -> tuple[str, ...]:
    return tuple(w for w in re.split(r"[-_/. ]+", name.lower()) if w and w not in _VARIANT_WORDS)


_BY_WORDS: dict[tuple[str, ...], set[str]] = {}
for _name, _entry in _BY_NAME.items():
    if "/" in _name:
        _BY_WORDS.setdefault(_words(_name), set()).add(_entry.name)


def match_checkpoint(name: str) -> tuple[str, str] | None:
    """(table name, note) for ``name``: itself (note ""), the one table name equal to it but for case, or the one
    entry whose Hub id has the same words once separators and variant words ("it", "pt", "Instruct", "Base",
    "chat", "hf") are set aside ("google/gemma-3-4b" -> google/gemma-3-4b-pt; "microsoft/phi-4-mini" ->
    microsoft/Phi-4-mini-instruct, never microsoft/phi-4), with a note saying which name was used. None when no
    entry, or more than one, matches that way. Short ids and model types must be exact but for case."""
    if name in _BY_NAME:
        return name, ""
    same = _LOWER.get(name.lower(), [])
    if len({_BY_NAME[n].name for n in same}) == 1:
        return same[0], f"{name!r} matched case-insensitively"
    if "/" not in name:
        return None
    found = _BY_WORDS.get(_words(name), set())
    if len(found) != 1:
        return None
    entry = next(iter(found))
    return entry, f"{name!r} is not in the table; its one close match is used"


def find_checkpoint(name: str) -> Checkpoint | None:
    """The table's entry for ``name`` (a Hub id, an alias or a legacy short id), or None."""
    return _BY_NAME.get(name)


def checkpoint_config(name: str) -> dict[str, Any] | None:
    """A copy of the table's config for ``name`` (a Hub id, an alias or a legacy short id), with the ``torch_dtype``
    that name's ``config.json`` gives, or None."""
    entry = CHECKPOINTS.get(name)
    if entry is None:
        return None
    return {**copy.deepcopy(dict(entry)), "torch_dtype": _BY_NAME[name].dtype_of(name)}
