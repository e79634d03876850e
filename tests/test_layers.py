"""The layering docs/architecture.md describes, checked on the source: who may import whom.

    deltarun.cli        command line                    may import apps, runner, base, model_files
    deltarun.apps       applications                    may import runner, base
    deltarun.runner     runtime core                    may import base
    deltarun.graphs     graph families (plug-ins)       may import base
    deltarun.base       errors, ggml, the GGUF file,    imports nothing of deltarun above it
                        the family interface + registry
    models/             model-file writers              may import base
    (deltarun.model_files)

The runtime core and the families sit side by side on base and never import each other: the
runner finds a file's family at run time through `deltarun.base.registry.graph_family_for` (the
`deltarun.graphs` entry-point group) and talks to it through `deltarun.base.interface`. Every
layer may import itself and the package root `deltarun` (its version); `python -m deltarun`
(deltarun/__main__.py) is the command line's entry on top. The training script in models/train/
is a tool on top of everything (it scores held-out text with perplexity's own windows).

Besides the layer rule: no import cycle between the layers (packages), and none between files.
Imports inside functions count everywhere: a late import is still a dependency.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

#: layers from the bottom up; a layer imports only layers before it in this order
ORDER = ("deltarun", "deltarun.base", "deltarun.model_files", "deltarun.graphs", "deltarun.runner",
         "deltarun.apps", "deltarun.cli", "deltarun.__main__")
#: layer -> the other layers it may import
MAY_IMPORT = {
    "deltarun": set(),
    "deltarun.base": set(),
    "deltarun.model_files": {"deltarun.base"},
    "deltarun.graphs": {"deltarun.base"},
    "deltarun.runner": {"deltarun.base"},
    "deltarun.apps": {"deltarun", "deltarun.base", "deltarun.runner"},
    "deltarun.cli": {"deltarun", "deltarun.base", "deltarun.runner", "deltarun.apps", "deltarun.model_files"},
    "deltarun.__main__": {"deltarun.cli"},
}

#: folders that are tools on top of everything, not part of their layer
TOOLS = ("models/train",)


def imports_of(path: Path) -> list[str]:
    """Every absolute import of a file, module-level and inside functions; `from m import a` gives
    both `m` and `m.a` (either may be a module)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


def module_name(path: Path) -> str:
    """deltarun/runner/model.py -> deltarun.runner.model; models/ is installed as deltarun.model_files."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "models":
        parts[:1] = ["deltarun", "model_files"]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> str:
    """The layer a module belongs to: deltarun.runner.model -> deltarun.runner."""
    parts = module.split(".")
    return ".".join(parts[:2])


def sources() -> dict[str, Path]:
    """module name -> file, for every file of deltarun/ and models/ outside TOOLS."""
    files = [p for folder in ("deltarun", "models") for p in sorted((ROOT / folder).rglob("*.py"))
             if not any(p.is_relative_to(ROOT / t) for t in TOOLS)]
    return {module_name(p): p for p in files}


def module_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of `modules` it imports (itself excluded)."""
    return {m: {n for n in imports_of(p) if n in modules and n != m} for m, p in modules.items()}


def layer_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """layer -> the other layers its modules import."""
    out: dict[str, set[str]] = {}
    for m, targets in graph.items():
        out.setdefault(layer_of(m), set()).update(layer_of(n) for n in targets if layer_of(n) != layer_of(m))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


@pytest.fixture(scope="module")
def modules() -> dict[str, Path]:
    return sources()


@pytest.fixture(scope="module")
def graph(modules) -> dict[str, set[str]]:
    return module_graph(modules)


def test_every_source_file_is_in_a_layer(graph):
    assert {layer_of(m) for m in graph} <= set(MAY_IMPORT), {layer_of(m) for m in graph} - set(MAY_IMPORT)


def test_the_layer_table_follows_the_order():
    assert set(ORDER) == set(MAY_IMPORT)
    for layer, allowed in MAY_IMPORT.items():
        assert all(ORDER.index(a) < ORDER.index(layer) for a in allowed), layer


def test_each_layer_imports_only_the_layers_under_it(modules, graph):
    bad = []
    for module, targets in sorted(graph.items()):
        layer = layer_of(module)
        for target in sorted(targets):
            if layer_of(target) not in MAY_IMPORT[layer] | {layer}:
                bad.append(f"{modules[module].relative_to(ROOT)} imports {target}")
    assert not bad, "\n".join(bad)


def test_runner_and_graph_families_meet_only_in_base(graph):
    """Spelled out, because it is the rule a new family or a runner change would most likely break."""
    layers = layer_graph(graph)
    assert "deltarun.graphs" not in layers.get("deltarun.runner", set())
    assert "deltarun.runner" not in layers.get("deltarun.graphs", set())


def test_no_import_cycle_between_layers(graph):
    assert not cycles(layer_graph(graph))


def test_no_import_cycle_between_files(graph):
    found = cycles(graph)
    assert not found, "\n".join(" <-> ".join(c) for c in found)


def test_the_architecture_document_draws_these_layers():
    """docs/architecture.md's diagram (its first code block) draws the layers' folders top down:
    cli/ over apps/ over runner/ and graphs/ over base/."""
    diagram = (ROOT / "docs" / "architecture.md").read_text().split("```")[1]
    rows = [m.group(1) for m in re.finditer(r"deltarun/(\w+)/", diagram)]
    order = [rows.index(name) for name in ("cli", "apps", "runner", "base")]
    assert order == sorted(order), rows
    assert rows.index("apps") < rows.index("graphs") < rows.index("base"), rows


# --- negative controls ------------------------------------------------------------------------
def test_the_checker_sees_imports_inside_functions(tmp_path):
    """A late import in a function body is found."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from deltarun.cli.main import cli\n    return cli\n")
    assert "deltarun.cli.main" in imports_of(f)


def test_the_checker_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    # two files of different layers importing each other make a cycle of layers too
    g = {"deltarun.runner.backend": {"deltarun.base.errors"}, "deltarun.base.errors": {"deltarun.runner.backend"}}
    assert cycles(layer_graph(g)) == [["deltarun.base", "deltarun.runner"]]
