"""The layering docs/architecture.md describes, checked on the source: who may import whom.

runtime core (deltarun.runner) <- graph families (deltarun.graphs) <- applications (deltarun.apps)
<- command line (deltarun.cli). The core reaches the families only through
`deltarun.graphs.interface` (and the registry in `deltarun.graphs` it calls); families never import
the model, applications or the CLI; applications never import the CLI; the model-file writers
(models/) sit beside the core, under the applications (the training script in models/train/ is a
tool on top: it scores held-out text with perplexity's own windows). Imports inside functions
count too: a late import is still a dependency.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> module prefixes it must not import
FORBIDDEN = {
    "deltarun/runner": ("deltarun.apps", "deltarun.cli", "deltarun.model_files"),
    "deltarun/graphs": ("deltarun.apps", "deltarun.cli", "deltarun.runner.model", "deltarun.model_files"),
    "deltarun/apps": ("deltarun.cli",),
    "models": ("deltarun.apps", "deltarun.cli"),
}
# graphs/ modules the core may import (everything else there is a family's business)
CORE_MAY_IMPORT_FROM_GRAPHS = ("deltarun.graphs.interface",)


def imports_of(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return names


#: folders inside a layer that are tools on top of everything, not part of the layer
TOOLS = ("models/train",)


def sources(folder: str) -> list[Path]:
    return sorted(p for p in (ROOT / folder).rglob("*.py")
                  if not any(p.is_relative_to(ROOT / t) for t in TOOLS))


@pytest.mark.parametrize("folder", list(FORBIDDEN))
def test_no_layer_imports_a_layer_above_it(folder):
    bad = []
    for path in sources(folder):
        for name in imports_of(path):
            if any(name == f or name.startswith(f + ".") for f in FORBIDDEN[folder]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_core_sees_graph_families_only_through_the_interface():
    bad = []
    for path in sources("deltarun/runner"):
        for name in imports_of(path):
            if name.startswith("deltarun.graphs") and not name.startswith(CORE_MAY_IMPORT_FROM_GRAPHS):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_imports_inside_functions(tmp_path):
    """Negative control: a late import in a function body is found."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from deltarun.cli.main import cli\n    return cli\n")
    assert "deltarun.cli.main" in imports_of(f)
