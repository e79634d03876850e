"""Graph builders, one per `general.architecture`, found through the `deltarun.graphs` entry points.

Third-party packages add an architecture by declaring an entry point in that group whose object
is a class taking the opened `GGUFFile`; deltarun's own builders are registered the same way.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from deltarun.runner.errors import UnsupportedModelError

ENTRY_POINT_GROUP = "deltarun.graphs"


def available_architectures() -> dict[str, Any]:
    """architecture name -> entry point, for every installed graph builder."""
    found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    # running from a source tree without installed metadata (or metadata older than a family)
    for name, (module, cls) in BUILTIN.items():
        if name not in found:
            found[name] = _Lazy(module, cls)
    return found


#: deltarun's own families: architecture -> (module, class), as registered in pyproject.toml
BUILTIN = {
    "qwen3next": ("deltarun.graphs.qwen3next", "Qwen3NextGraph"),
    "qwen35": ("deltarun.graphs.qwen35", "Qwen35Graph"),
    "qwen35moe": ("deltarun.graphs.qwen35moe", "Qwen35MoeGraph"),
}


class _Lazy:
    """An entry-point look-alike for a built-in family (imported on load)."""

    def __init__(self, module: str, cls: str):
        self.module, self.cls = module, cls

    def load(self) -> Any:
        import importlib

        return getattr(importlib.import_module(self.module), self.cls)


def graph_builder_for(gguf_file: Any) -> Any:
    """The graph builder for the file's architecture, or a clear error listing the supported ones."""
    arch = gguf_file.architecture
    builders = available_architectures()
    if arch not in builders:
        raise UnsupportedModelError(
            f"{gguf_file.path}: no graph for architecture {arch!r}; deltarun runs: {', '.join(sorted(builders))}. "
            f"Use a model of a supported architecture, or install a package that registers a graph builder "
            f"for {arch!r} in the {ENTRY_POINT_GROUP!r} entry-point group")
    entry = builders[arch]
    cls = entry.load() if hasattr(entry, "load") else entry
    return cls(gguf_file)
