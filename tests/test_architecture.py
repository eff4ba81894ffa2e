"""The layout is the pipeline (docs/architecture.md): imports run one way, and private torch symbols are read in one
module only. Both are checked on the source text (ast), so a backwards import fails here even when nothing runs it."""

from __future__ import annotations

import ast
import pathlib

import networkx as nx
import pytest

PACKAGE = pathlib.Path(__file__).parents[1] / "autofit"

# The stages in pipeline order (docs/architecture.md). A module may import its own layer and the layers above it in
# this list, never one below: values flow down the pipeline, callables are passed in, not imported back.
LAYERS: list[set[str]] = [
    # foundations (autofit/core/): the torch boundary, typed errors, byte units, memory categories, progress, worker
    # processes, this CPU's kernels, and the memory figures estimate and measure hand back
    {"core"},
    # the parallel layout (autofit/parallel/): its dimensions, registered, and the layout value they make
    {"parallel"},
    # what one training step is (autofit/training/), shared by simulate, measure and the trainer; and the step
    # features (autofit/features/), each built on the step's parts and run by the step itself (training/step.py):
    # test_features_stand_between_the_steps_parts_and_the_step places them within the layer
    {"training", "features"},
    {"capture"},  # 1. model copies and the traced graph, and fake kernels corrected to the CPU's
    {"simulate"},  # 2. one step on fake tensors -> Timeline
    {"analyse"},  # 3. per-layer table and the peak as a function of the knobs
    {"device", "cuda"},  # 4. the Target: CPU or a catalog GPU and its memory / speed model
    {"solve"},  # 5. memory and time models, search
    {"measure"},  # ground truth on the real device
    {"emit"},  # 6. the Plan, the training wrapper it emits, and the plan in other frameworks' terms
    # the public entry points that compose the stages (compare: one plan per card), the options they take, and the
    # request's checks
    {"api", "planner", "planning", "request", "validate", "options", "compare"},
    {"integrations"},  # a Plan applied inside other trainers (Hugging Face, Lightning)
    {"cli"},
    {"__init__", "__main__"},
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}

# A torch module or attribute whose name has a component starting with "_" is private, except aten operator names
# (``torch.ops.aten._to_copy`` is an operator, not Python API) and ``torch._check``, which torch documents for users.
PUBLIC_BY_DOCS = {"torch._check"}
# the torch boundary: _torch.py, with _torch_profiler.py for the profiler's memory record, _torch_interrupts.py for
# torch's lazy imports and Ctrl-C, and _torch_compile.py for torch.compile's internals (dynamo, inductor)
BOUNDARIES = {PACKAGE / "core" / "_torch.py", PACKAGE / "core" / "_torch_profiler.py",
              PACKAGE / "core" / "_torch_interrupts.py", PACKAGE / "core" / "_torch_compile.py"}


def _unit(path: pathlib.Path) -> str:
    """The layer unit of a module: its sub-package, or the module itself for top-level files."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _modules() -> list[pathlib.Path]:
    return sorted(p for p in PACKAGE.rglob("*.py"))


def _imports(tree: ast.AST, *, annotations: bool = False) -> list[tuple[int, str]]:
    """(line, dotted module) of every import, at the top or inside a function; those under ``if TYPE_CHECKING:``
    (annotations only) too with ``annotations``."""
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test) and not annotations:
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
            found.extend((node.lineno, f"{node.module}.{a.name}") for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_every_module_has_a_layer() -> None:
    units = {_unit(p) for p in _modules()}
    assert units <= set(RANK), f"modules without a layer in LAYERS: {sorted(units - set(RANK))}"


# Annotations (under ``if TYPE_CHECKING:``) that name a later stage's type: counted like any import, except these, the
# one kind left: the solve stage reads the request's values (PlanRequest, autofit/request.py, built after it in this
# order). None may be added; a runtime import of the request from these modules fails all the same.
ANNOTATIONS_AGAINST_THE_PIPELINE = {
    ("solve/estimator.py", "autofit.request"), ("solve/finish.py", "autofit.request"),
    ("solve/host.py", "autofit.request"), ("solve/ladder.py", "autofit.request"), ("solve/quick.py", "autofit.request"),
    ("solve/space.py", "autofit.request")}


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_follow_the_pipeline(path: pathlib.Path) -> None:
    unit = _unit(path)
    backwards = []
    tree = ast.parse(path.read_text())
    runs = set(_imports(tree))
    for line, module in _imports(tree, annotations=True):
        parts = module.split(".")
        if parts[0] != "autofit" or len(parts) < 2 or parts[1] not in RANK:
            continue
        allowed = (str(path.relative_to(PACKAGE)), ".".join(parts[:2])) in ANNOTATIONS_AGAINST_THE_PIPELINE
        if allowed and (line, module) not in runs:
            continue
        if RANK[parts[1]] > RANK[unit]:
            backwards.append(f"line {line}: {module} ({parts[1]} comes after {unit} in the pipeline)")
    assert not backwards, "imports that run against the pipeline:\n" + "\n".join(backwards)


def test_features_stand_between_the_steps_parts_and_the_step() -> None:
    """Within the training layer, only the step (training/step.py) names the step features
    (Note [step features], autofit/features/base.py): the features stand on the step's parts (the chunked loss's
    arithmetic, the optimizer's twin), the step runs them, and no part of the step reaches back into them."""
    step_users = {PACKAGE / "training" / "step.py"}
    graph = nx.DiGraph()
    for path in _modules():
        if _unit(path) != "training":
            continue
        for _, module in _imports(ast.parse(path.read_text()), annotations=True):
            graph.add_edge(path, module)
    named = sorted(str(p.relative_to(PACKAGE)) for p in graph.nodes
                   if isinstance(p, pathlib.Path) and p not in step_users
                   and any(m.startswith("autofit.features") for m in graph.successors(p)))
    assert not named, f"training modules that import a step feature, other than the step: {named}"
    for path in (PACKAGE / "features").glob("*.py"):
        for _, module in _imports(ast.parse(path.read_text()), annotations=True):
            assert module.split(".")[:3] != ["autofit", "training", "step"], f"{path.name} imports the step"


# Private names of other libraries that autofit reads on purpose, each where its absence changes nothing but the
# estimate's detail: transformers' MoE experts modules (simulate/routing.py, a getattr with a default).
OTHER_LIBRARIES = {"_apply_gate", "_experts_implementation"}


def _own_names() -> set[str]:
    """Every name autofit itself defines or binds (functions, classes, variables, attributes it assigns, arguments,
    keywords, import aliases, setattr'd names): a private name outside this set belongs to another library."""
    own: set[str] = set()
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.alias):
                own.add(node.asname or node.name.split(".")[-1])
            elif isinstance(node, ast.keyword) and node.arg:
                own.add(node.arg)
            elif _string_attribute(node) is not None and ast.unparse(node.func) == "setattr":
                own.add(_string_attribute(node))
    return own


def _string_attribute(node: ast.AST) -> str | None:
    """The name read by ``getattr(x, "name", ...)`` (or hasattr / setattr / delattr) with a constant name."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
        return node.args[1].value
    return None


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_torch(tree: ast.AST, own: frozenset[str] = frozenset()) -> list[str]:
    """Private torch symbols: imports of private torch modules, ``torch.`` / ``nn.`` chains through a private name,
    and a private attribute autofit does not define itself, read on any object (``op._schema``,
    ``optimizer_module._foreach_supported_types``) or through a string (``getattr(t, "_local_tensor")``)."""
    found = []
    for line, module in _imports(tree):
        parts = module.split(".")
        if parts[0] == "torch" and any(p.startswith("_") for p in parts[1:]):
            found.append(f"line {line}: import {module}")
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain = ast.unparse(node)
            root = chain.split(".")[0]
            if chain.startswith(("torch.ops.", "aten.")) or chain in PUBLIC_BY_DOCS or node.lineno in lines:
                continue
            if root in ("torch", "nn") or (node.attr not in own and node.attr not in OTHER_LIBRARIES):
                lines.add(node.lineno)
                found.append(f"line {node.lineno}: {chain}")
        name = _string_attribute(node)
        if (name is not None and _private(name) and name not in own and name not in OTHER_LIBRARIES
                and node.lineno not in lines):
            lines.add(node.lineno)
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


OWN = frozenset(_own_names())


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_private_torch_only_through_the_boundary(path: pathlib.Path) -> None:
    if path in BOUNDARIES:
        return
    found = _private_torch(ast.parse(path.read_text()), OWN)
    assert not found, "private torch symbols outside the torch boundary (BOUNDARIES):\n" + "\n".join(found)


def test_the_checks_catch_what_they_should() -> None:
    """The checks, on source written to break them (else an empty result proves nothing)."""
    bad = ast.parse("import torch\nfrom torch._C import _EventType\nx = torch._C._current_autograd_node()\n"
                    "from autofit.planner import plan\ny = nn.modules.batchnorm._BatchNorm\nz = torch.ops.aten._to_copy\n"
                    "a = op._schema.arguments\nb = getattr(t, '_local_tensor', None)\nc = self._own_field\n"
                    "d = getattr(self, '_own_field', None)\ne = hasattr(config, '_experts_implementation')\n")
    found = _private_torch(bad, frozenset({"_own_field"}))
    assert sorted(f.split(":")[0] for f in found) == ["line 2", "line 2", "line 3", "line 5", "line 7", "line 8"]
    assert (4, "autofit.planner") in _imports(bad)
    assert RANK["planner"] > RANK["simulate"]
    # autofit's own private names are its own: a field it assigns is not torch's
    assert "_stored" in OWN and "_schema" not in OWN and "_local_tensor" not in OWN


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _import_graph(sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    """Module -> the autofit modules it imports: at the top, inside a function, and under ``if TYPE_CHECKING:``.
    An annotation-only import is a dependency all the same: the module cannot be read, type-checked or moved without
    the one it names (Note [the plan is data], autofit/emit/plan.py). A package is the module of its ``__init__.py``,
    with the imports it makes; the parents Python runs first are not edges (every package would otherwise close a
    loop with the modules it re-exports). ``sources``: module -> source text (default: autofit's own files)."""
    if sources is None:
        sources = {_module_name(p): p.read_text() for p in _modules()}
    graph: dict[str, set[str]] = {}
    for name, text in sources.items():
        edges = set()
        for _, module in _imports(ast.parse(text), annotations=True):
            while module and module not in sources:  # ``from autofit.x import Name``: the module is autofit.x
                module = module.rpartition(".")[0]
            if module and module != name:
                edges.add(module)
        graph[name] = edges
    return graph


def _digraph(graph: dict[str, set[str]]) -> nx.DiGraph:
    g = nx.DiGraph()
    g.add_nodes_from(graph)
    g.add_edges_from((v, w) for v, ws in graph.items() for w in ws)
    return g


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, each sorted (the modules of one or more cycles)."""
    return sorted(sorted(c) for c in nx.strongly_connected_components(_digraph(graph)) if len(c) > 1)


def test_no_import_cycle_among_autofit_modules() -> None:
    cycles = [list(c) for c in nx.simple_cycles(_digraph(_import_graph()))]
    assert not cycles, (
        "modules that import each other, directly or around a loop (TYPE_CHECKING and function-local imports "
        "count):\n" + "\n".join(" -> ".join(c) for c in sorted(cycles)))


def test_the_cycle_check_catches_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    # an import under TYPE_CHECKING, or inside a function, closes a loop all the same
    sources = {"autofit.x": "from autofit.y import Y\n",
               "autofit.y": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from autofit.x import X\n",
               "autofit.p": "def f():\n    from autofit.q import g\n",
               "autofit.q": "from autofit.p import f\n",
               "autofit.r": "import autofit.x\n"}
    assert _cycles(_import_graph(sources)) == [["autofit.p", "autofit.q"], ["autofit.x", "autofit.y"]]


def _declared(tree: ast.AST) -> list[str] | None:
    """A module's ``__all__``, or None where it declares none."""
    for node in getattr(tree, "body", []):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return [ast.literal_eval(e) for e in node.value.elts]
    return None


def _missing_from_all(sources: dict[str, str], importers: list[str]) -> list[str]:
    """``module: name (imported by ...)`` for each public name imported (``from autofit.x import name``) from a module
    whose ``__all__`` does not list it; a submodule imported from its package is not a name."""
    declared = {m: _declared(ast.parse(text)) for m, text in sources.items()}
    found = set()
    for importer in importers:
        text = sources.get(importer) or pathlib.Path(importer).read_text()
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ImportFrom) or node.level or declared.get(node.module or "") is None:
                continue
            for alias in node.names:
                name = alias.name
                if not name.startswith("_") and f"{node.module}.{name}" not in sources \
                        and name not in declared[node.module]:
                    found.add(f"{node.module}: {name} (imported by {importer})")
    return sorted(found)


def test_all_lists_what_other_modules_import() -> None:
    """A module's ``__all__`` is its public surface: a name that another module or a test imports from it is listed
    there (a name nobody outside imports may stay off it)."""
    sources = {_module_name(p): p.read_text() for p in _modules()}
    tests = sorted(str(p) for p in pathlib.Path(__file__).parent.rglob("*.py"))
    assert not (missing := _missing_from_all(sources, list(sources) + tests)), (
        "names imported from a module whose __all__ leaves them out:\n" + "\n".join(missing))
    # the check, on modules written to break it
    assert _missing_from_all({"autofit.x": "__all__ = ['a']\na = b = 1\n", "autofit.y": "from autofit.x import a, b\n",
                              "autofit.z": "from autofit.x import _c\n"}, ["autofit.y", "autofit.z"]) == [
        "autofit.x: b (imported by autofit.y)"]


def _device_name_compared(tree: ast.AST) -> list[int]:
    """Lines that compare a ``.kind`` with a device's name ("cpu", "cuda")."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and isinstance(node.left, ast.Attribute) and node.left.attr == "kind" and any(
                isinstance(c, ast.Constant) and c.value in ("cpu", "cuda") for c in node.comparators):
            found.append(node.lineno)
    return found


def test_the_target_is_asked_not_named() -> None:
    """The stages ask the target (``DeviceTarget``'s class attributes and methods: autofit/device.py) what the device
    does; none compares its name, so a new kind of device is one subclass, not a search for string comparisons."""
    found = [f"{p.relative_to(PACKAGE)}:{line}" for p in _modules() if p.name != "device.py"
             for line in _device_name_compared(ast.parse(p.read_text()))]
    assert not found, "a device's name compared outside autofit/device.py:\n" + "\n".join(found)
    assert _device_name_compared(ast.parse("if target.kind != 'cuda':\n    pass\nok = batch.kind == 'dict'\n")) == [1]


_STRATEGY_NAMES = frozenset({"ddp", "fsdp2", "fsdp", "hsdp"})


def _strategy_name_compared(tree: ast.AST) -> list[int]:
    """Lines that compare anything with a strategy's name, alone or in a tuple, list or set (``== "fsdp2"``,
    ``in ("ddp", "fsdp2")``)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            elements = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
            if any(isinstance(e, ast.Constant) and e.value in _STRATEGY_NAMES for e in elements):
                found.append(node.lineno)
                break
    return found


def test_the_strategy_is_asked_not_named() -> None:
    """A layout's strategy is read once into a ``Strategy`` (autofit/parallel/layout.py: ``as_strategy``) and asked
    what it does (``shards_parameters``, ``replicates_parameters``), never compared with a name: the rules of a
    layout live in ``check_layout``, and a new strategy is one more member, not a search for string comparisons."""
    found = [f"{p.relative_to(PACKAGE)}:{line}" for p in _modules()
             for line in _strategy_name_compared(ast.parse(p.read_text()))]
    assert not found, "a strategy's name compared:\n" + "\n".join(found)
    assert _strategy_name_compared(ast.parse(
        "if strategy != 'fsdp2':\n    pass\nok = s in ('ddp', 'x')\nfine = kind == 'dict'\n")) == [1, 3]
