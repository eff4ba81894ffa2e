"""The shape of the library, counted on its source text (issue 42's before/after table).

    python benchmarks/shape_metrics.py [REPO_ROOT]

Reads ``REPO_ROOT/autofit`` with ``ast`` only (nothing of autofit is imported, so it measures any checkout, an old
commit's included) and prints one table:

- the parameters of ``autofit.plan`` (``def plan`` in autofit/planner.py, every kind of parameter);
- the functions and methods in autofit/ over 60 lines (``def`` line to last line) and over 8 parameters (a method's
  ``self`` / ``cls`` not counted);
- the largest file and its lines;
- the files that mention ``reshard_after_forward`` and ``offload_states``;
- string comparisons of strategy and device: ``ast.Compare`` nodes with ``==`` / ``!=`` against one of the string
  constants "ddp", "fsdp2", "cuda", "cpu";
- import cycles among autofit's modules, counting every import: at the top, inside a function, and under
  ``if TYPE_CHECKING:``. A package is the module of its ``__init__.py``; an edge goes to the module an import names
  (``from autofit.emit.plan import Plan`` -> autofit.emit.plan, ``from autofit.emit import Trainer`` -> autofit.emit),
  not to the parent packages Python runs first (every package's ``__init__`` would otherwise close a loop with the
  submodules it re-exports). Cycles are networkx's ``simple_cycles``; the components are its strongly connected
  components of more than one module.
"""

from __future__ import annotations

import argparse
import ast
import pathlib

import networkx as nx

STRINGS = {"ddp", "fsdp2", "cuda", "cpu"}
MENTIONS = ("reshard_after_forward", "offload_states")


def _files(package: pathlib.Path) -> list[pathlib.Path]:
    return sorted(package.rglob("*.py"))


def _parameters(node: ast.FunctionDef | ast.AsyncFunctionDef, *, method: bool) -> int:
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args]
    count = len(names) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    decorators = {ast.unparse(d) for d in node.decorator_list}
    if method and names and names[0] in ("self", "cls") and "staticmethod" not in decorators:
        count -= 1
    return count


def _functions(tree: ast.AST) -> list[tuple[ast.FunctionDef | ast.AsyncFunctionDef, bool]]:
    """Every function and method, nested ones included, with whether it is defined directly in a class."""
    found = []

    def visit(node: ast.AST, in_class: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((child, in_class))
                visit(child, False)
            elif isinstance(child, ast.ClassDef):
                visit(child, True)
            else:
                visit(child, in_class)

    visit(tree, False)
    return found


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """The dotted names an import statement may load (relative imports resolved against ``module``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [target] + [f"{target}.{a.name}" for a in node.names]


def import_graph(root: pathlib.Path) -> nx.DiGraph:
    package = root / "autofit"
    paths = {_module_name(p, root): p for p in _files(package)}
    packages = {_module_name(p, root) for p in _files(package) if p.name == "__init__.py"}
    graph = nx.DiGraph()
    graph.add_nodes_from(paths)
    for name, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(node, name, name in packages):
                while target and target not in paths:  # ``from autofit.x import Name``: the module is autofit.x
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph.add_edge(name, target)
    return graph


def metrics(root: pathlib.Path) -> list[tuple[str, str]]:
    package = root / "autofit"
    files = _files(package)
    trees = {p: ast.parse(p.read_text()) for p in files}
    texts = {p: p.read_text() for p in files}

    plan_params = "-"
    planner = package / "planner.py"
    for node in ast.iter_child_nodes(trees[planner]) if planner in trees else ():
        if isinstance(node, ast.FunctionDef) and node.name == "plan":
            plan_params = str(_parameters(node, method=False))

    long_functions = many_parameters = 0
    for tree in trees.values():
        for node, method in _functions(tree):
            long_functions += node.end_lineno - node.lineno + 1 > 60
            many_parameters += _parameters(node, method=method) > 8

    lines = {p: len(texts[p].splitlines()) for p in files}
    largest = max(files, key=lambda p: lines[p])

    comparisons = 0
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops):
                operands = [node.left, *node.comparators]
                comparisons += any(isinstance(o, ast.Constant) and o.value in STRINGS for o in operands)

    graph = import_graph(root)
    cycles = sum(1 for _ in nx.simple_cycles(graph))
    components = sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)

    rows = [
        ("parameters of autofit.plan", plan_params),
        ("functions over 60 lines", str(long_functions)),
        ("functions over 8 parameters", str(many_parameters)),
        ("largest file", f"{largest.relative_to(root)} ({lines[largest]} lines)"),
    ]
    rows += [(f"files mentioning {word}", str(sum(word in t for t in texts.values()))) for word in MENTIONS]
    rows += [
        ("==/!= against " + "/".join(f'"{s}"' for s in sorted(STRINGS)), str(comparisons)),
        ("import cycles (simple cycles, TYPE_CHECKING and local imports counted)", str(cycles)),
        ("import-cycle components (strongly connected, more than one module)", str(len(components))),
    ]
    rows += [(f"  component {i + 1}", " <-> ".join(c)) for i, c in enumerate(components)]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=str(pathlib.Path(__file__).resolve().parents[1]),
                        help="repository root (default: this script's repository)")
    root = pathlib.Path(parser.parse_args().root).resolve()
    rows = metrics(root)
    width = max(len(k) for k, _ in rows)
    print(f"autofit shape: {root}")
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


if __name__ == "__main__":
    main()
