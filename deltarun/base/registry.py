"""Graph families, one per `general.architecture`, found through the `deltarun.graphs` entry points.

Third-party packages add an architecture by declaring an entry point in that group whose object
is a class taking the opened `GGUFFile` and following `deltarun.base.interface.GraphFamily`;
deltarun's own families (deltarun/graphs/) are registered the same way. Families are imported
only when a file of their architecture is opened, so nothing here imports them.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

from deltarun.base.errors import UnsupportedModelError
from deltarun.base.interface import GraphFamily
from deltarun.base.vision import VisionTower

ENTRY_POINT_GROUP = "deltarun.graphs"
#: vision towers (mmproj files), one per `clip.projector_type`
PROJECTOR_GROUP = "deltarun.projectors"

#: deltarun's own families: architecture -> (module, class), as registered in pyproject.toml
BUILTIN = {
    "qwen3next": ("deltarun.graphs.qwen3next", "Qwen3NextFamily"),
    "qwen35": ("deltarun.graphs.qwen35", "Qwen35Family"),
    "qwen35moe": ("deltarun.graphs.qwen35moe", "Qwen35MoeFamily"),
    "kimi-linear": ("deltarun.graphs.kimi_linear", "KimiLinearFamily"),
    "qwen4exp": ("deltarun.graphs.qwen4exp", "Qwen4ExpFamily"),
}


#: deltarun's own vision towers: projector type -> (module, class)
BUILTIN_PROJECTORS = {
    "qwen3vl_merger": ("deltarun.graphs.vision", "Qwen3VLVision"),
}


class _Lazy:
    """An entry-point look-alike for a built-in family (imported on load)."""

    def __init__(self, module: str, cls: str):
        self.module, self.cls = module, cls

    def load(self) -> Any:
        return getattr(importlib.import_module(self.module), self.cls)


def available_architectures() -> dict[str, Any]:
    """architecture name -> entry point, for every installed graph family."""
    found = {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    # running from a source tree without installed metadata (or metadata older than a family)
    for name, (module, cls) in BUILTIN.items():
        if name not in found:
            found[name] = _Lazy(module, cls)
    return found


def graph_family_for(gguf_file: Any) -> GraphFamily:
    """The registered family of the file's architecture, constructed from the file (which reads and
    validates its hyper-parameters and tensors), or a clear error listing the supported ones."""
    arch = gguf_file.architecture
    families = available_architectures()
    if arch not in families:
        raise UnsupportedModelError(
            f"{gguf_file.path}: no graph for architecture {arch!r}; deltarun runs: {', '.join(sorted(families))}. "
            f"Use a model of a supported architecture, or install a package that registers a graph family "
            f"for {arch!r} in the {ENTRY_POINT_GROUP!r} entry-point group")
    entry = families[arch]
    cls = entry.load() if hasattr(entry, "load") else entry
    return cls(gguf_file)


def available_projectors() -> dict[str, Any]:
    """projector type -> entry point, for every installed vision tower."""
    found = {ep.name: ep for ep in entry_points(group=PROJECTOR_GROUP)}
    for name, (module, cls) in BUILTIN_PROJECTORS.items():
        found.setdefault(name, _Lazy(module, cls))
    return found


def projector_for(gguf_file: Any) -> VisionTower:
    """The vision tower of an mmproj file (`general.architecture = clip`), constructed from the file
    (which reads and validates its keys and tensors), or one clear error."""
    if gguf_file.architecture != "clip":
        raise UnsupportedModelError(
            f"{gguf_file.path}: not an mmproj file (general.architecture is {gguf_file.architecture!r}, not 'clip'); "
            f"pass the vision projector file published beside the model (mmproj-*.gguf)")
    kind = gguf_file.get("clip.vision.projector_type") or gguf_file.get("clip.projector_type")
    towers = available_projectors()
    if kind not in towers:
        raise UnsupportedModelError(
            f"{gguf_file.path}: no vision graph for projector type {kind!r}; deltarun runs: {', '.join(sorted(towers))}")
    entry = towers[kind]
    cls = entry.load() if hasattr(entry, "load") else entry
    return cls(gguf_file)
