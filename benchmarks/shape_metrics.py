"""The shape of the library, counted from its source (issue 42's before/after table).

Reads ``autofit/`` with ``ast`` only (nothing of autofit is imported, so a checkout of any commit can be measured):

- the parameters of ``autofit.plan`` (``planner.plan``);
- functions over 60 lines, and functions over 8 parameters;
- the largest file, in lines;
- the files that mention ``reshard_after_forward`` and ``offload_states``;
- string comparisons of the strategy and the device: ``Compare`` nodes with ``==``/``!=``/``in``/``not in`` against
  one of the string constants in ``STRINGS``;
- import cycles between autofit modules, imports under ``TYPE_CHECKING`` and inside functions counted: the strongly
  connected components of more than one module, the modules in them, and the simple cycles (networkx).

Usage: ``python benchmarks/shape_metrics.py [ROOT ...]`` (a repository root each; default: this checkout). With two
roots the table has a column per root.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import networkx as nx

STRINGS = {"fsdp2", "ddp", "fsdp", "hsdp", "cuda", "cpu", "mps", "meta"}
LONG_LINES = 60
MANY_PARAMETERS = 8


def _files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "autofit").rglob("*.py"))


def _module(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    named = a.posonlyargs + a.args + a.kwonlyargs
    count = len([x for x in named if x.arg not in ("self", "cls")])
    return count + (a.vararg is not None) + (a.kwarg is not None)


def _string_compares(tree: ast.AST) -> int:
    count = 0
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for op, left, right in zip(node.ops, operands, operands[1:]):
            if not isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                continue
            for side in (left, right):
                if isinstance(side, ast.Constant) and side.value in STRINGS:
                    count += 1
                elif isinstance(side, (ast.Tuple, ast.Set, ast.List)) and any(
                        isinstance(e, ast.Constant) and e.value in STRINGS for e in side.elts):
                    count += 1
    return count


def _imports(tree: ast.AST, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The autofit modules ``module`` imports anywhere in its file (TYPE_CHECKING blocks and functions included)."""
    found = set()
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[:len(package) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            # the longest autofit module the name starts with (``from autofit.solve import x``: autofit.solve.x when
            # x is a module, else autofit.solve)
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module and name != "autofit":
                found.add(name)
    return found


def measure(root: Path) -> dict[str, object]:
    files = _files(root)
    modules = {_module(root, p): p for p in files}
    graph = nx.DiGraph()
    long_fns, many_params, compares = [], [], 0
    mentions = {"reshard_after_forward": 0, "offload_states": 0}
    largest = ("", 0)
    plan_params = None
    for module, path in modules.items():
        text = path.read_text()
        tree = ast.parse(text)
        lines = text.count("\n") + 1
        if lines > largest[1]:
            largest = (str(path.relative_to(root)), lines)
        for word in mentions:
            mentions[word] += word in text
        compares += _string_compares(tree)
        graph.add_node(module)
        for target in _imports(tree, module, path.name == "__init__.py", set(modules)):
            graph.add_edge(module, target)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > LONG_LINES:
                    long_fns.append(f"{module}.{node.name}")
                if _parameters(node) > MANY_PARAMETERS:
                    many_params.append(f"{module}.{node.name}")
                if module == "autofit.planner" and node.name == "plan" and node.col_offset == 0:
                    plan_params = _parameters(node)
    # the package __init__ files import their children for re-export: an edge from a package to its own submodule is
    # not a dependency of the code, so cycles through it are left out
    graph.remove_edges_from([(a, b) for a, b in list(graph.edges) if b.startswith(a + ".")])
    sccs = [c for c in nx.strongly_connected_components(graph) if len(c) > 1]
    cycles = sum(1 for _ in nx.simple_cycles(graph))
    return {
        "parameters of autofit.plan": plan_params,
        f"functions over {LONG_LINES} lines": len(long_fns),
        f"functions over {MANY_PARAMETERS} parameters": len(many_params),
        "largest file (lines)": f"{largest[0]} ({largest[1]})",
        "files mentioning reshard_after_forward": mentions["reshard_after_forward"],
        "files mentioning offload_states": mentions["offload_states"],
        "string compares of strategy/device": compares,
        "import cycles: strongly connected components": len(sccs),
        "import cycles: modules in them": sum(len(c) for c in sccs),
        "import cycles: simple cycles": cycles,
        "_sccs": sorted(sorted(c) for c in sccs),
    }


def main(argv: list[str]) -> None:
    roots = [Path(a) for a in argv] or [Path(__file__).resolve().parents[1]]
    results = [measure(r) for r in roots]
    keys = [k for k in results[0] if not k.startswith("_")]
    width = max(map(len, keys))
    print(f"| {'measure':<{width}} | " + " | ".join(str(r) for r in roots) + " |")
    print(f"|{'-' * (width + 2)}|" + "|".join("-" * (len(str(r)) + 2) for r in roots) + "|")
    for k in keys:
        print(f"| {k:<{width}} | " + " | ".join(str(res[k]) for res in results) + " |")
    for root, res in zip(roots, results):
        for component in res["_sccs"]:
            print(f"{root}: cycle among {', '.join(component)}")


if __name__ == "__main__":
    main(sys.argv[1:])
