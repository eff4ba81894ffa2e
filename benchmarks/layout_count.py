"""How spread the parallel layout is over autofit/: an AST count anyone can rerun, before and after a redesign
(issue 54, "Layout dimensions as registered objects").

    python benchmarks/layout_count.py                 # the table for this checkout
    python benchmarks/layout_count.py --rev f8a51ab   # the same count over a commit (read with git show)
    python benchmarks/layout_count.py --list          # and the files and lines behind each count

What is counted, and where the heuristics are (each row says "outside the layout's home": the modules that are the
layout, :data:`HOME`, plus the user-facing options and the CLI, :data:`ASIDE`):

- *reads*: files with an attribute read ``x.F`` where F is a field or property of the layout value
  (:data:`LAYOUT_FIELDS`: ``Parallel``'s fields and properties, ``Strategy``'s), but ``nodes`` on a torch.fx graph or
  a module call (``graph.nodes``, ``call.nodes``), which only shares the name;
- *branches*: ``if`` / ``elif`` / ``while`` / conditional expressions / comprehension filters / ``match`` whose test
  reads a layout field or compares with a strategy's name ("ddp", "fsdp2");
- *world_size //*: a floor division whose left side is named ``world_size`` (rows or ranks per data-parallel
  group written inline);
- *mesh and wrapping calls*: calls of ``init_device_mesh``, ``fully_shard``, ``DistributedDataParallel``,
  ``parallelize_module``;
- *micro-batch loops*: ``for`` statements whose body runs a micro-batch (calls ``run_micro_batch`` or ``backward``)
  or switches the gradient sync between micro-batches: a heuristic, listed with ``--list`` so that a reader can
  check it;
- *dicts keyed by strategy names*: dict literals with a "ddp" or "fsdp2" key;
- *functions over 10 parameters* outside the CLI;
- the parameters of ``autofit.plan``, ``autofit.estimate`` and ``autofit.measure`` (as the API module defines them);
- *import cycles between folders*: a cycle in the graph "a module of folder A imports one of folder B" over
  autofit's sub-packages (module-level and function-level imports both: either ties the two folders together);
- the largest module and ``planner.py``'s length, in lines.
"""

from __future__ import annotations

import argparse
import ast
import subprocess
from collections import defaultdict
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parents[1]

# The layout's own modules today; a redesign moves them under autofit/parallel/, which counts as home too.
HOME = ("autofit/parallel/", "autofit/training/layout.py", "autofit/training/tensor_parallel.py",
        "autofit/training/sequence_parallel.py")
ASIDE = ("autofit/options.py", "autofit/cli/")
LAYOUT_FIELDS = frozenset({
    # Parallel's fields
    "strategy", "world_size", "shard_units", "offload_states", "reduce_every_micro_batch", "reshard_after_forward",
    "replicate", "gpus_per_node", "tensor_parallel", "tensor_plan", "more_dimensions",
    # its properties, and Strategy's
    "shards_parameters", "replicates_parameters", "fully_sharded", "shard_group", "data_parallel", "ranks_per_node",
    "least_memory", "sequence_parallel",
    # derived counts added since (issue 54): reading them is reading the layout too
    "data_ranks", "nodes", "shard_ranks",
    # a dimension's share of memory and the layout's rungs (Note [a dimension's share of memory])
    "model_ways", "state_ways", "kept_gathered", "defers_gradients", "states_on_host",
    "reducing_every_micro_batch", "label_with_ranks", "data_rank", "row_copies",
    # the step's properties derived from its layout (StepConfig: where the states live, where the optimizer runs)
    "host_states", "optimizer_device",
    # the rows a rank holds of a batch: a number of the layout (issue 54)
    "rank_rows",
})
STRATEGY_NAMES = frozenset({"ddp", "fsdp2"})
WRAPPING_CALLS = frozenset({"init_device_mesh", "fully_shard", "DistributedDataParallel", "parallelize_module"})
API_FUNCTIONS = {"plan": "autofit/planner.py", "estimate": "autofit/api.py", "measure": "autofit/api.py"}


def _sources(rev: str | None) -> dict[str, str]:
    """Every module of autofit/ at ``rev`` (None: the working tree), by path relative to the root."""
    if rev is None:
        return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "autofit").rglob("*.py"))}
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", rev, "autofit/"],
                           capture_output=True, text=True, check=True).stdout.split()
    return {n: subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{n}"], capture_output=True, text=True,
                              check=True).stdout for n in names if n.endswith(".py")}


# ``nodes`` is also torch.fx's ``Graph.nodes`` and the analysis' ``ModuleCall.nodes``: a read on a graph or a module
# call is not a layout's (the receivers the analysis names so: ``graph``, ``x.graph``, ``call``)
_NOT_LAYOUT_NODES = frozenset({"graph", "call"})


def _is_layout_field(node: ast.Attribute) -> bool:
    if node.attr not in LAYOUT_FIELDS:
        return False
    if node.attr == "nodes":
        receiver = node.value
        name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
        return name not in _NOT_LAYOUT_NODES
    return True


def _reads_layout(node: ast.AST) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and _is_layout_field(sub):
            return True
        if isinstance(sub, ast.Constant) and sub.value in STRATEGY_NAMES:
            return True
    return False


def _tests(tree: ast.AST):
    """The conditions of a module's branches, each with its line."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)):
            yield node.lineno, node.test
        elif isinstance(node, ast.comprehension):
            for cond in node.ifs:
                yield cond.lineno, cond
        elif isinstance(node, ast.Match):
            yield node.lineno, node.subject


def _call_name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


MICRO_BATCH_CALLS = frozenset({"run_micro_batch", "backward", "set_requires_gradient_sync", "gradient_sync",
                               "no_sync"})


def _is_micro_loop(node: ast.For) -> bool:
    """A loop that runs micro-batches: its body (not a function defined in it) runs one (``run_micro_batch``, a
    ``backward``) or switches the gradient sync between them."""
    stack = list(node.body)
    while stack:
        sub = stack.pop()
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(sub, ast.Call) and _call_name(sub) in MICRO_BATCH_CALLS:
            return True
        stack.extend(ast.iter_child_nodes(sub))
    return False


def _folder(path: str) -> str:
    parts = path.split("/")
    return parts[1] if len(parts) > 2 else "(top)"


def _imported_folders(tree: ast.AST, path: str) -> set[str]:
    out = set()
    package = path[:-3].replace("/", ".").rsplit(".", 1)[0]
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                names = [".".join(base + ([node.module] if node.module else []))]
            elif node.module:
                names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "autofit" and len(parts) > 1:
                top = parts[1]
                is_package = (ROOT / "autofit" / top).is_dir()
                out.add(top if is_package else "(top)")
    return out


def count(rev: str | None = None) -> tuple[dict[str, object], dict[str, list[str]]]:
    sources = _sources(rev)
    rows: dict[str, object] = {}
    where: dict[str, list[str]] = defaultdict(list)
    reads, branch_files, branches, floor_div, wrapping, loops, strategy_dicts, long_functions = (
        set(), set(), 0, 0, 0, set(), 0, 0)
    graph = nx.DiGraph()
    api_params: dict[str, int] = {}
    lengths = {path: text.count("\n") + 1 for path, text in sources.items()}
    for path, text in sources.items():
        tree = ast.parse(text)
        home = path.startswith(HOME)
        aside = path.startswith(ASIDE)
        folder = _folder(path)
        for target in _imported_folders(tree, path):
            if target != folder and folder != "(top)" and target != "(top)":
                graph.add_edge(folder, target)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) - (1 if a.args and a.args[0].arg in (
                    "self", "cls") else 0)
                if n > 10 and not path.startswith("autofit/cli/"):
                    long_functions += 1
                    where["functions over 10 parameters"].append(f"{path}:{node.lineno} {node.name} ({n})")
                if node.col_offset == 0 and API_FUNCTIONS.get(node.name) == path:
                    api_params[node.name] = n
            if home or aside:
                continue
            if isinstance(node, ast.Attribute) and _is_layout_field(node) and isinstance(node.ctx, ast.Load):
                reads.add(path)
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
                left = node.left
                name = left.attr if isinstance(left, ast.Attribute) else left.id if isinstance(left, ast.Name) else ""
                if name == "world_size":
                    floor_div += 1
                    where["world_size //"].append(f"{path}:{node.lineno}")
            elif isinstance(node, ast.Call) and _call_name(node) in WRAPPING_CALLS:
                wrapping += 1
                where["mesh and wrapping calls"].append(f"{path}:{node.lineno} {_call_name(node)}")
            elif isinstance(node, ast.For) and _is_micro_loop(node):
                loops.add(path)
                where["micro-batch loops"].append(f"{path}:{node.lineno}")
            elif isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value in STRATEGY_NAMES
                                                    for k in node.keys):
                strategy_dicts += 1
                where["dicts keyed by strategy names"].append(f"{path}:{node.lineno}")
        if not (home or aside):
            for line, test in _tests(tree):
                if _reads_layout(test):
                    branches += 1
                    branch_files.add(path)
                    where["branches on layout fields"].append(f"{path}:{line}")
    where["files reading a layout field"] = sorted(reads)
    cycles = sorted(sorted(c) for c in nx.simple_cycles(graph))
    where["import cycles between folders"] = [" <-> ".join(c) for c in cycles]
    largest = max(lengths, key=lengths.get)
    rows["files outside the home reading a layout field"] = len(reads)
    rows["branches on layout fields outside it (files)"] = f"{branches} ({len(branch_files)})"
    rows["inline world_size // outside it"] = floor_div
    rows["mesh and wrapping calls outside it"] = wrapping
    rows["files looping over micro-batches"] = len(loops)
    rows["dicts keyed by strategy names"] = strategy_dicts
    rows["functions over 10 parameters outside the CLI"] = long_functions
    rows["parameters of plan / estimate / measure"] = " / ".join(str(api_params.get(k, "?")) for k in API_FUNCTIONS)
    rows["import cycles between folders"] = len(cycles)
    rows["largest module (lines)"] = f"{largest} ({lengths[largest]})"
    rows["planner.py (lines)"] = lengths.get("autofit/planner.py", 0)
    rows["modules over 450 lines"] = sum(n > 450 for n in lengths.values())
    return rows, where


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", action="append", help="a commit to count (repeat for a before / after table); "
                        "default: the working tree")
    parser.add_argument("--list", action="store_true", help="print the files and lines behind each count")
    args = parser.parse_args()
    revs = args.rev or [None]
    tables = [count(rev) for rev in revs]
    names = [rev or "working tree" for rev in revs]
    width = max(len(k) for k in tables[0][0])
    columns = [max([len(n)] + [len(str(v)) for v in t[0].values()]) for t, n in zip(tables, names)]
    print(f"| {'':{width}} | " + " | ".join(f"{n:>{c}}" for n, c in zip(names, columns)) + " |")
    print(f"|{'-' * (width + 2)}|" + "|".join("-" * (c + 2) for c in columns) + "|")
    for key in tables[0][0]:
        print(f"| {key:{width}} | " + " | ".join(f"{str(t[0][key]):>{c}}" for t, c in zip(tables, columns)) + " |")
    if args.list:
        for name, (_, where) in zip(names, tables):
            print(f"\n## {name}")
            for key, items in where.items():
                print(f"\n{key} ({len(items)}):")
                for item in items:
                    print(f"  {item}")


if __name__ == "__main__":
    main()
