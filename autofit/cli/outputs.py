"""Files the command line writes (``--plot``), checked before planning: a plan can take minutes, and a path that
cannot be written should cost none of them, nor end in a traceback after the plan was printed.

The check ends by really opening the file for writing: permission bits say nothing for root, nor for /proc, /sys,
a read-only mount or a full quota; only the write itself does. A file that was not there is removed again."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from autofit.core.errors import InvalidInputError

__all__ = ["check_output_path", "check_plot", "parse_exports", "write_exports"]


def check_output_path(path: Path, flag: str) -> None:
    """Raise :class:`InvalidInputError` (one line naming ``flag`` and what to do) unless a file can be written at
    ``path``: not a folder, its folder exists, and the file (or, for a new file, the folder) is writable."""
    folder = path.parent
    if path.is_dir():
        raise InvalidInputError(f"{flag} {path} is a folder: give a file name, e.g. {flag} {path / 'plan.png'}")
    if not folder.exists():
        raise InvalidInputError(f"{flag} {path}: folder {folder} does not exist; create it or choose another path")
    if not folder.is_dir():
        raise InvalidInputError(f"{flag} {path}: {folder} is a file, not a folder; choose another path")
    if path.exists() and not os.access(path, os.W_OK):
        raise InvalidInputError(f"{flag} {path}: the file exists and is not writable; choose another path")
    if not path.exists() and not os.access(folder, os.W_OK | os.X_OK):
        raise InvalidInputError(f"{flag} {path}: folder {folder} is not writable; choose another path")
    _try_writing(path, flag)


def _try_writing(path: Path, flag: str) -> None:
    existed = path.exists()
    try:
        with open(path, "ab"):  # appends nothing: an existing file keeps its bytes until the real write
            pass
    except OSError as e:
        raise InvalidInputError(f"{flag} {path}: cannot write there ({e.strerror or e}); choose another path") from e
    if not existed:
        path.unlink(missing_ok=True)


def check_plot(path: Path) -> None:
    """``--plot PATH``: the path can be written and matplotlib is there to draw it."""
    check_output_path(path, "--plot")
    if importlib.util.find_spec("matplotlib") is None:
        raise InvalidInputError("--plot needs matplotlib: pip install 'torch-autofit[plot]'")


def parse_exports(values: list[str] | None, names: tuple[str, ...]) -> list[tuple[str, Path | None]]:
    """``--export NAME[=PATH]`` (repeatable) as (name, path or None: print it), every path checked before planning;
    two exports to one path are refused (the second would overwrite the first)."""
    exports: list[tuple[str, Path | None]] = []
    for value in values or []:
        name, _, path = value.partition("=")
        name = name.strip().lower()
        if name not in names:
            raise InvalidInputError(f"--export {value}: the format must be one of {', '.join(names)} (optionally "
                                    "=PATH to write it as a file, e.g. --export accelerate=accelerate.yaml)")
        if "=" in value and not path.strip():
            raise InvalidInputError(f"--export {value}: give a file after '=', e.g. --export {name}={name}"
                                    f"{_SUFFIX[name]}, or no '=' to print it")
        target = Path(path.strip()) if path.strip() else None
        if target is not None:
            if any(target == other for _, other in exports):
                raise InvalidInputError(f"--export {value}: {target} is already the file of another --export")
            check_output_path(target, f"--export {name}=")
        exports.append((name, target))
    return exports


# the suffix each framework's file has (the examples in messages)
_SUFFIX = {"hf": ".json", "deepspeed": ".json", "accelerate": ".yaml", "lightning": ".yaml", "torchtitan": ".toml"}


def write_exports(console, plan, exports: list[tuple[str, Path | None]]) -> None:
    """Each export: printed as before (``--export NAME``), or written as the file its framework reads."""
    import json

    from autofit.cli.messages import say
    from autofit.emit.export import EXPORTERS, export_file, to_torchtitan_toml

    for name, path in exports:
        if path is None:
            if name == "torchtitan":  # torchtitan reads TOML (its train_configs/*.toml)
                console.print(to_torchtitan_toml(plan), highlight=False, markup=False)
            else:
                console.print_json(json.dumps(EXPORTERS[name](plan)))
            continue
        text, notes = export_file(plan, name)
        try:
            path.write_text(text, encoding="utf-8")
        except OSError as e:  # checked before planning, but the disk may fill or the folder go meanwhile
            raise InvalidInputError(f"--export {name}={path}: {e.strerror or e}") from e
        say(console, "wrote", f"{path} ({name})", "green")
        for note in notes:
            say(console, "note", f"{name}: {note}")
