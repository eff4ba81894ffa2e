"""The model a config names, as the ``hf:`` reference autofit builds: a local directory with ``config.json``, an
offline-table checkpoint, or a name the table knows under another organisation (mirrors such as
``NousResearch/Meta-Llama-3-8B`` of ``meta-llama/Meta-Llama-3-8B``, torchtitan's ``./assets/hf/Llama-3.1-8B``,
torchtune's ``/tmp/Meta-Llama-3.1-8B-Instruct``): the same repository name, matched case-insensitively when
exactly one entry has it. Anything else is passed on as ``hf:NAME`` (the local cache, then the Hub)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["model_ref"]


def _by_repository_name(name: str) -> str | None:
    from autofit.cli.hf_checkpoints import CHECKPOINTS

    tail = name.rstrip("/").rsplit("/", 1)[-1].lower()
    found = {n for n in CHECKPOINTS if n.rsplit("/", 1)[-1].lower() == tail}
    return found.pop() if len(found) == 1 else None


def model_ref(name: str, config_path: Path | None) -> tuple[str, str | None]:
    """(``hf:...`` reference, a note when the name was read as another one) for the model ``name``."""
    from autofit.cli.hf_checkpoints import CHECKPOINTS, match_checkpoint

    for base in ([config_path.parent] if config_path is not None else []) + [Path.cwd()]:
        local = (base / name).expanduser()
        if (local / "config.json").is_file():
            return f"hf:{local.resolve()}", None
    if name in CHECKPOINTS:
        return f"hf:{name}", None
    matched = match_checkpoint(name)
    if matched is not None:
        return f"hf:{matched[0]}", matched[1] or None
    other = _by_repository_name(name)
    if other is not None:
        return f"hf:{other}", f"model {name!r} read as {other} (the offline table's checkpoint of that name)"
    return f"hf:{name}", None
