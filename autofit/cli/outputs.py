"""Files the command line writes (``--plot``), checked before planning: a plan can take minutes, and a path that
cannot be written should cost none of them, nor end in a traceback after the plan was printed.

The check ends by really opening the file for writing: permission bits say nothing for root, nor for /proc, /sys,
a read-only mount or a full quota; only the write itself does. A file that was not there is removed again."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from autofit.core.errors import InvalidInputError

__all__ = ["check_output_path", "check_plot"]


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
