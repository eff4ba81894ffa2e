"""Where a step feature lives: the modules of autofit/ outside the feature's own that name it in code, an AST count
anyone can rerun before and after a redesign (issue 58: "the files changed outside the feature's module, goal at
most 4"; Note [carried features], autofit/features/base.py).

    python benchmarks/feature_count.py                         # float8, this checkout
    python benchmarks/feature_count.py --rev becb926 --rev HEAD  # before / after, read with git show
    python benchmarks/feature_count.py --feature float8 --list   # and the lines behind each file

A module names the feature where its code (not a comment, not a docstring) has an identifier (a name, an attribute,
a keyword, a parameter, an imported name) or a string constant containing the feature's name. The rows are sorted
into the feature's registration (``features/__init__.py``), its option (``options.py``), the CLI (``cli/``), the
config readers (``cli/configs/``: a framework's own keys for it read into the plan) and the rest, where the rest is
split by hand into the engine's own knowledge of the kernels the feature runs (the float8
dtypes and ``torch._scaled_mm``: the time model's dtype classes, the CPU kernel probe, the compile meta kernel, the
card catalog's FP8 rate), which any float8 code needs whatever the feature, and the feature's plumbing, which the
redesign is meant to remove.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from layout_count import _sources  # noqa: E402 - the same reader of a checkout or a commit

# the modules that know the float8 kernels (dtypes, _scaled_mm), not the feature: the time model, the CPU's kernel
# probe and its error, the compile meta kernel, the card catalog's FP8 rate, the dtype ranking of a device
ENGINE = frozenset({"autofit/analyse/table.py", "autofit/core/_torch.py", "autofit/core/_torch_compile.py",
                    "autofit/core/cpu.py", "autofit/cuda/spec.py", "autofit/cuda/cards.py", "autofit/device.py"})
REGISTRY = "autofit/features/__init__.py"
OPTION = "autofit/options.py"


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are docstrings (a module's, a class's, a function's)."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
                    isinstance(first.value.value, str):
                ids.add(id(first.value))
    return ids


def naming_lines(source: str, word: str) -> list[int]:
    """The lines of ``source`` whose code names ``word`` (case-insensitive), by the rules of the module's docstring."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    pattern = re.compile(re.escape(word), re.IGNORECASE)
    lines = set()
    for node in ast.walk(tree):
        text = None
        if isinstance(node, ast.Name):
            text = node.id
        elif isinstance(node, ast.Attribute):
            text = node.attr
        elif isinstance(node, ast.keyword):
            text = node.arg
        elif isinstance(node, ast.arg):
            text = node.arg
        elif isinstance(node, ast.alias):
            text = f"{node.name} {node.asname or ''}"
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            text = getattr(node, "module", None)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = node.value
        if text and pattern.search(text):
            lines.add(node.lineno)
    return sorted(lines)


def count(word: str, rev: str | None) -> dict[str, list[int]]:
    """The modules outside ``autofit/features/<word>.py`` naming ``word`` in code, with their lines."""
    home = f"autofit/features/{word}.py"
    found = {}
    for path, source in _sources(rev).items():
        if path != home:
            lines = naming_lines(source, word)
            if lines:
                found[path] = lines
    return found


def _kind(path: str) -> str:
    if path == REGISTRY:
        return "registration"
    if path == OPTION:
        return "the option"
    if path.startswith("autofit/cli/configs/"):
        return "config readers"
    if path.startswith("autofit/cli/"):
        return "the CLI"
    return "engine (the kernels)" if path in ENGINE else "plumbing"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--feature", default="float8", help="the feature's module name under autofit/features/")
    parser.add_argument("--rev", action="append", help="a commit to count (repeat for a before / after table); "
                        "default: the working tree")
    parser.add_argument("--list", action="store_true", help="print the lines behind each file")
    args = parser.parse_args()
    for rev in args.rev or [None]:
        found = count(args.feature, rev)
        print(f"\n{args.feature!r} named in code outside autofit/features/{args.feature}.py at "
              f"{rev or 'the working tree'}: {len(found)} modules")
        by_kind: dict[str, list[str]] = {}
        for path in sorted(found):
            by_kind.setdefault(_kind(path), []).append(path)
        for kind in ("registration", "the option", "the CLI", "config readers", "plumbing", "engine (the kernels)"):
            paths = by_kind.get(kind, [])
            print(f"  {kind:<22} {len(paths):>3}  {', '.join(p.removeprefix('autofit/') for p in paths)}")
            if args.list:
                for p in paths:
                    print(f"      {p}: lines {', '.join(map(str, found[p]))}")


if __name__ == "__main__":
    main()
