"""Dumps of the ggml graph the runner computes, and of the values flowing through it.

`dump_graph(model, shape)` builds the graph of one ubatch shape through the model's own
`Model.graph` (so it is exactly the graph `eval` computes), allocates it in the model's scheduler
so every tensor has its backend, and walks it: every node (in ggml's execution order) and every
tensor the nodes read that is not itself a node (weights, graph inputs, KV cache and recurrent
state), which this module calls *leafs*. `capture_values(...)` runs a prompt through the same graph
with a scheduler eval callback and records statistics (and optionally the data) of the selected
nodes. A `GraphDump` renders as an aligned text table, JSON, or Graphviz dot (and svg through
graphviz's `dot` program when it is installed).

JSON schema (`schema_version` 1)
--------------------------------
Top level object::

    schema_version  int     1; bumped on any incompatible change, fields are only ever added
    model           str     path of the GGUF file
    architecture    str     general.architecture
    shape           object  the ubatch shape: n_seq_tokens, n_seqs, n_tokens, n_outputs, n_kv,
                            seq_head, delta_net, n_past (tokens already in the KV), rs_slots (K),
                            decode (bool); for a vision tower's graph (`deltarun graph --mmproj`,
                            apps/vision_graph.py): image [height, width] (pixels as preprocessed),
                            grid [t, h, w] (patches), n_patches, n_tokens (image tokens)
    filter          object  {"layer": int|null, "values": [pattern, ...]|null}
    summary         object  see below (always about the whole graph, whatever the filter)
    nodes           list    graph nodes kept by the filter, in execution order (tensor objects)
    leafs           list    tensors read by the kept nodes that are not graph nodes (tensor objects)
    values          object|null  present after a --values run: {"prompt": str|null,
                            "tokens": [int, ...], "n_selected": int, "n_observed": int}; a vision
                            tower's adds "image": str (the file, or the random image's description)

Tensor object::

    id           str          "n<index>" for a graph node, "l<k>" for a leaf; unique in one dump
    kind         str          "node" or "leaf"
    index        int          node: position in ggml_graph_node order; leaf: order of discovery
    name         str          ggml name (llama.cpp style `attn_norm-0`; ggml names unnamed nodes
                              `node_<i>`, derived views `<src> (view)`, `(reshaped)`, ...)
    op           str          ggml_op_desc (`MUL_MAT`, `SET_ROWS`, ...); "NONE" for leafs
    type         str          ggml_type_name (`f32`, `q8_0`, ...)
    ne           [int x4]     elements per dimension, ne0 fastest
    nb           [int x4]     strides in bytes
    n_dims       int          ggml_n_dims
    nbytes       int          ggml_nbytes (the byte span for strided views)
    contiguous   bool         ggml_is_contiguous
    view_of      str|null     name of the tensor this one views (ggml's view_src: the root owner)
    view_of_id   str|null     id of that tensor
    view_offs    int          byte offset into view_of
    src          [str]        names of the direct inputs (src[0..]) in order
    src_ids      [str]        their ids
    backend      str|null     backend the scheduler assigned (ggml_backend_sched_get_tensor_backend);
                              null when the scheduler assigned none (e.g. host-filled inputs)
    buffer       str|null     name of the backend buffer holding the data (ggml_backend_buffer_name)
    is_input     bool         flags & GGML_TENSOR_FLAG_INPUT
    is_output    bool         flags & GGML_TENSOR_FLAG_OUTPUT
    is_weight    bool         in a WEIGHTS-usage buffer or one of the model's weight tensors
    is_memory    bool         one of the model's KV-cache / recurrent-state tensors
    layer        int|null     block the tensor belongs to: the `-L` suffix of its name (ggml's view
                              suffixes ignored), `blk.L.` for weights, `cache_*_lL` for memory; an
                              unnamed node (`node_<i>`) takes the layer all its consumers share
    values       object       only for nodes whose values were recorded (see below)

Values object::

    observed     bool         false when the scheduler never showed the node to the callback
    count        int          number of elements
    n_nan, n_inf int          NaN and +-Inf counts
    min, max, mean, rms       float|null, over the finite elements (null when none is finite)
    first        [number|str] the first elements in ggml order (ne0 fastest); non-finite ones as
                              the strings "nan", "inf", "-inf" so the JSON stays strict
    note         str|null     why something is missing or how it was read (e.g. strided view)
    file         str|null     .npy file name inside --dump-dir, when one was written

Summary object::

    n_nodes, n_leafs        int   whole graph
    n_nodes_shown           int   after the filter
    ops                     {op: count} over all graph nodes
    n_splits                int   ggml_backend_sched_get_n_splits after allocation
    placement               str   where the layers are (Placement / LayerSplit.describe)
    compute_buffer_bytes    {backend: bytes}   ggml_backend_sched_get_buffer_size per backend
    weight_bytes            {backend: bytes}   bytes of the weights this graph reads, per backend
    model_weight_bytes      int   every weight the model loaded
    memory_bytes            int   KV cache + recurrent state buffer

--dump-dir writes one `<name>.npy` per recorded node (numpy shape = reversed ne, as everywhere in
deltarun) and `manifest.json` ({"schema_version", "model", "shape", "tokens", "tensors": [{name, id,
op, type, ne, shape, file, stats}]}); each file is written to a temporary name and renamed, so a
reader never sees half a file and two runs into two folders can be diffed file by file.
"""

from __future__ import annotations

import ctypes
import io
import fnmatch
import json
import math
import re
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

from deltarun.base.errors import DeltarunError
from deltarun.base.ggml_util import NP_TYPES, ggml, name_of
from deltarun.base.interface import UbatchShape
from deltarun.runner.files import write_atomically
from deltarun.runner.model import padded_n_kv
from deltarun.runner.units import format_bytes, format_table

if TYPE_CHECKING:  # annotations only: the applications open models lazily
    from deltarun.runner.model import Model

SCHEMA_VERSION = 1
N_FIRST = 8

_AUTO_NAME = re.compile(r"^(node|leaf)_\d+$")
_DERIVED = re.compile(r"( \((view|reshaped|permuted|transposed|cont|copy( of .*)?)\))+$")
_LAYER_SUFFIX = re.compile(r"-(\d+)$")
_BLK = re.compile(r"^(?:v\.)?blk\.(\d+)\.")   # text weights, and a vision tower's (v.blk.N.)
_CACHE = re.compile(r"^cache_[a-z]+_l(\d+)$")


class GraphvizMissingError(DeltarunError):
    """`--format svg` needs graphviz's `dot` program."""

    exit_code = 1


# ----------------------------------------------------------------------------------------------
# Records
# ----------------------------------------------------------------------------------------------
@dataclass
class ValueStats:
    observed: bool = False
    count: int = 0
    n_nan: int = 0
    n_inf: int = 0
    min: float | None = None
    max: float | None = None
    mean: float | None = None
    rms: float | None = None
    first: list[Any] = field(default_factory=list)
    note: str | None = None
    file: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"observed": self.observed, "count": self.count, "n_nan": self.n_nan, "n_inf": self.n_inf,
                "min": self.min, "max": self.max, "mean": self.mean, "rms": self.rms,
                "first": list(self.first), "note": self.note, "file": self.file}


@dataclass
class TensorRecord:
    id: str
    kind: str
    index: int
    name: str
    op: str
    type: str
    ne: list[int]
    nb: list[int]
    n_dims: int
    nbytes: int
    contiguous: bool
    view_of: str | None
    view_of_id: str | None
    view_offs: int
    src: list[str]
    src_ids: list[str]
    backend: str | None
    buffer: str | None
    is_input: bool
    is_output: bool
    is_weight: bool
    is_memory: bool
    layer: int | None
    values: ValueStats | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in (
            "id", "kind", "index", "name", "op", "type", "ne", "nb", "n_dims", "nbytes", "contiguous",
            "view_of", "view_of_id", "view_offs", "src", "src_ids", "backend", "buffer", "is_input",
            "is_output", "is_weight", "is_memory", "layer")}
        if self.values is not None:
            d["values"] = self.values.to_dict()
        return d

    @property
    def flags(self) -> str:
        """Short role letters for the text table: I input, O output, W weight, M memory, V view."""
        s = ("I" if self.is_input else "") + ("O" if self.is_output else "") + ("W" if self.is_weight else "")
        s += ("M" if self.is_memory else "") + ("V" if self.view_of else "")
        return s or "-"


@dataclass
class GraphDump:
    model: str
    architecture: str
    shape: dict[str, Any]
    summary: dict[str, Any]
    nodes: list[TensorRecord]
    leafs: list[TensorRecord]
    layer: int | None = None
    value_patterns: list[str] | None = None
    values: dict[str, Any] | None = None
    #: id -> ggml tensor pointer; valid only while the model (and its graph cache) is open
    tensors: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    # --- lookups ------------------------------------------------------------------------------
    def all(self) -> list[TensorRecord]:
        return self.nodes + self.leafs

    def find(self, name: str) -> list[TensorRecord]:
        return [r for r in self.all() if r.name == name]

    # --- renderers ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "model": self.model,
            "architecture": self.architecture,
            "shape": dict(self.shape),
            "filter": {"layer": self.layer, "values": list(self.value_patterns) if self.value_patterns else None},
            "summary": self.summary,
            "nodes": [r.to_dict() for r in self.nodes],
            "leafs": [r.to_dict() for r in self.leafs],
            "values": self.values,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n"

    def to_txt(self) -> str:
        out: list[str] = []
        sh = self.shape
        out.append(f"model: {self.model} ({self.architecture})")
        out.append("shape: " + (_shape_label(sh) if "grid" in sh else ", ".join(f"{k}={sh[k]}" for k in (
            "n_seq_tokens", "n_seqs", "n_outputs", "n_kv", "n_past", "rs_slots", "delta_net", "decode"))))
        if self.layer is not None:
            out.append(f"filter: layer {self.layer} (its nodes and their direct sources)")
        out.append("flags: I input, O output, W weight, M memory (KV / recurrent state), V view")
        out.append("")
        cols = ["id", "name", "op", "type", "ne", "nb", "flags", "backend", "view_of", "src"]
        out.append(f"nodes ({len(self.nodes)} of {self.summary['n_nodes']}):")
        out.extend(format_table(cols, [self._row(r) for r in self.nodes]))
        out.append("")
        out.append(f"leafs ({len(self.leafs)}): weights, inputs and memory read by these nodes")
        out.extend(format_table(cols[:8], [self._row(r)[:8] for r in self.leafs]))
        out.append("")
        out.extend(self._summary_lines())
        recorded = [r for r in self.nodes if r.values is not None]
        if self.values is not None:
            out.append("")
            what = (f"image {self.values['image']}" if self.values.get("image")
                    else f"prompt tokens {self.values['tokens']}")
            out.append(f"values ({len(recorded)} nodes; {what}); min/max/mean/rms over finite elements")
            vcols = ["id", "name", "min", "max", "mean", "rms", "nan", "inf", "first", "note"]
            rows = []
            for r in recorded:
                v = r.values
                assert v is not None
                rows.append([r.id, r.name, _num(v.min), _num(v.max), _num(v.mean), _num(v.rms), str(v.n_nan),
                             str(v.n_inf), "[" + ", ".join(_num(x) for x in v.first) + "]", v.note or "-"])
            out.extend(format_table(vcols, rows))
        return "\n".join(out) + "\n"

    @staticmethod
    def _row(r: TensorRecord) -> list[str]:
        return [r.id, r.name, r.op, r.type, _dims(r.ne), _dims(r.nb), r.flags, r.backend or r.buffer or "-",
                r.view_of or "-", ", ".join(r.src) or "-"]

    def _summary_lines(self) -> list[str]:
        s = self.summary
        lines = ["summary:"]
        lines.append(f"  nodes {s['n_nodes']}, leafs {s['n_leafs']}, graph splits {s['n_splits']}")
        if s.get("placement"):
            lines.append(f"  placement: {s['placement']}")
        lines.append("  nodes by op: " + ", ".join(f"{op} {n}" for op, n in s["ops"].items()))
        for key, label in (("compute_buffer_bytes", "compute buffer"), ("weight_bytes", "weights read")):
            parts = ", ".join(f"{be} {format_bytes(n)}" for be, n in s[key].items()) or "-"
            lines.append(f"  {label}: {parts}")
        lines.append(f"  model weights {format_bytes(s['model_weight_bytes'])}, memory (KV + state) "
                     f"{format_bytes(s['memory_bytes'])}")
        return lines

    def to_dot(self) -> str:
        """Graphviz source: weights, inputs, memory and outputs drawn apart, views dashed."""
        lines = ["digraph ggml_graph {", "  rankdir=TB;", '  node [fontname="monospace", fontsize=10];',
                 '  edge [color="#555555"];',
                 f'  label="{_dot_escape(self.model)}  {_dot_escape(_shape_label(self.shape))}"; labelloc=t;']
        for r in self.all():
            lines.append(f"  {r.id} [{_dot_style(r)}];")
        known = {r.id for r in self.all()}
        for r in self.nodes:
            for i, s in enumerate(r.src_ids):
                if s in known:
                    lines.append(f'  {s} -> {r.id} [label="{i}", fontsize=8];')
            if r.view_of_id and r.view_of_id in known and r.view_of_id not in r.src_ids:
                lines.append(f'  {r.view_of_id} -> {r.id} [style=dashed, label="view", fontsize=8];')
        lines.append("}")
        return "\n".join(lines) + "\n"


def graphviz_dot() -> str:
    """Path of graphviz's `dot` program, or a clear error saying how to get it."""
    exe = shutil.which("dot")
    if exe is None:
        raise GraphvizMissingError(
            "--format svg needs graphviz's `dot` program, which is not installed: install it with "
            "`apt install graphviz` (or your system's package manager), or use --format dot and render it elsewhere")
    return exe


def render_svg(dot_source: str) -> bytes:
    """Run graphviz's `dot -Tsvg` on `dot_source`."""
    exe = graphviz_dot()
    proc = subprocess.run([exe, "-Tsvg"], input=dot_source.encode(), capture_output=True, check=False)
    if proc.returncode != 0:
        raise DeltarunError(f"graphviz dot failed ({proc.returncode}): {proc.stderr.decode(errors='replace').strip()}")
    return proc.stdout


# ----------------------------------------------------------------------------------------------
# Building a dump
# ----------------------------------------------------------------------------------------------
def ubatch_shape(model: Model, n_seq_tokens: int, n_seqs: int = 1, n_past: int = 0, all_outputs: bool = False,
                 seq_head: int = 0) -> UbatchShape:
    """The shape `Model.eval` / `Model.eval_batch` use for such a ubatch (same n_kv padding, same outputs rule)."""
    if n_seq_tokens <= 0 or n_seqs <= 0 or n_past < 0:
        raise DeltarunError("tokens and seqs must be positive and past non-negative")
    if seq_head + n_seqs > model.memory.n_seq_max:
        raise DeltarunError(f"{n_seqs} sequences need n_seq_max >= {seq_head + n_seqs} "
                            f"(the model was opened for {model.memory.n_seq_max})")
    if n_past + n_seq_tokens > model.n_ctx:
        raise DeltarunError(f"{n_past} past + {n_seq_tokens} tokens exceed the context size {model.n_ctx}")
    n_kv = padded_n_kv(n_past + n_seq_tokens, model.n_ctx)
    n_out = n_seq_tokens if all_outputs else 1
    return UbatchShape(n_seq_tokens=n_seq_tokens, n_seqs=n_seqs, n_outputs=n_out * n_seqs, n_kv=n_kv,
                       seq_head=seq_head, delta_net=model.delta_net)


def _addr(t: Any) -> int:
    return ctypes.addressof(t.contents)


def _str(b: bytes | None) -> str | None:
    return None if b is None else b.decode(errors="replace")


class _Walker:
    """Collects every node and referenced tensor of a graph, with ids. `weights` and `memory` are
    the tensors to flag as weights and as KV cache / recurrent state."""

    def __init__(self, sched: Any, gf: Any, weights: Iterable[Any], memory: Iterable[Any] = ()):
        self.gf = gf
        self.sched = sched
        self.nodes: list[Any] = []
        self.leafs: list[Any] = []
        self.ids: dict[int, str] = {}
        n = int(ggml.ggml_graph_n_nodes(gf))
        for i in range(n):
            t = ggml.ggml_graph_node(gf, i)
            self.nodes.append(t)
            self.ids[_addr(t)] = f"n{i}"
        for t in self.nodes:
            for s in self.inputs_of(t):
                if _addr(s) not in self.ids:
                    self.ids[_addr(s)] = f"l{len(self.leafs)}"
                    self.leafs.append(s)
        self.weight_addrs = {_addr(t) for t in weights}
        self.memory_addrs = {_addr(t) for t in memory}

    @staticmethod
    def srcs(t: Any) -> list[Any]:
        c = t.contents
        return [c.src[j] for j in range(len(c.src)) if c.src[j]]

    def inputs_of(self, t: Any) -> list[Any]:
        out = self.srcs(t)
        vs = t.contents.view_src
        if vs:
            out.append(vs)
        return out

    def backend_name(self, t: Any) -> str | None:
        be = ggml.ggml_backend_sched_get_tensor_backend(self.sched, t)
        return _str(ggml.ggml_backend_name(be)) if be else None

    def record(self, t: Any, kind: str, index: int) -> TensorRecord:
        c = t.contents
        buf = c.buffer
        usage_weights = bool(buf) and ggml.ggml_backend_buffer_get_usage(buf) == ggml.GGML_BACKEND_BUFFER_USAGE_WEIGHTS
        vs = c.view_src
        srcs = self.srcs(t)
        return TensorRecord(
            id=self.ids[_addr(t)], kind=kind, index=index, name=name_of(t),
            op=_str(ggml.ggml_op_desc(t)) or "?", type=_str(ggml.ggml_type_name(c.type)) or "?",
            ne=[int(c.ne[i]) for i in range(4)], nb=[int(c.nb[i]) for i in range(4)],
            n_dims=int(ggml.ggml_n_dims(t)), nbytes=int(ggml.ggml_nbytes(t)),
            contiguous=bool(ggml.ggml_is_contiguous(t)),
            view_of=name_of(vs) if vs else None, view_of_id=self.ids.get(_addr(vs)) if vs else None,
            view_offs=int(c.view_offs),
            src=[name_of(s) for s in srcs], src_ids=[self.ids[_addr(s)] for s in srcs],
            backend=self.backend_name(t), buffer=_str(ggml.ggml_backend_buffer_name(buf)) if buf else None,
            is_input=bool(c.flags & ggml.GGML_TENSOR_FLAG_INPUT),
            is_output=bool(c.flags & ggml.GGML_TENSOR_FLAG_OUTPUT),
            is_weight=usage_weights or _addr(t) in self.weight_addrs,
            is_memory=_addr(t) in self.memory_addrs,
            layer=None,
        )


def _unnamed(name: str) -> bool:
    """ggml's automatic names (`node_12`, and `" (reshaped)"` for views of then-unnamed tensors)."""
    base = _DERIVED.sub("", name).strip()
    return not base or _AUTO_NAME.match(base) is not None


def layer_of_name(name: str) -> int | None:
    if _unnamed(name):
        return None
    base = _DERIVED.sub("", name)
    for rx in (_LAYER_SUFFIX, _BLK, _CACHE):
        m = rx.search(base)
        if m:
            return int(m.group(1))
    return None


def _assign_layers(nodes: list[TensorRecord], leafs: list[TensorRecord]) -> None:
    """Layer from the name; unnamed nodes take the layer shared by all their consumers."""
    for r in nodes + leafs:
        r.layer = layer_of_name(r.name)
    consumers: dict[str, list[TensorRecord]] = {}
    for r in nodes:
        for s in dict.fromkeys(r.src_ids):
            consumers.setdefault(s, []).append(r)
    for r in reversed(nodes):  # consumers come later in execution order
        if r.layer is None and _unnamed(r.name):
            layers = {c.layer for c in consumers.get(r.id, [])}
            if len(layers) == 1:
                r.layer = layers.pop()


def _summary(model: Model, walker: _Walker, nodes: list[TensorRecord], leafs: list[TensorRecord]) -> dict[str, Any]:
    ops = Counter(r.op for r in nodes)
    compute: dict[str, int] = {}
    for b in model.sched.backends:
        name = _str(ggml.ggml_backend_name(b.handle)) or b.name
        compute[name] = compute.get(name, 0) + int(ggml.ggml_backend_sched_get_buffer_size(walker.sched, b.handle))
    weights: dict[str, int] = {}
    for r in leafs + nodes:
        if r.is_weight:
            key = r.backend or r.buffer or "?"
            weights[key] = weights.get(key, 0) + r.nbytes
    return {
        "n_nodes": len(nodes),
        "n_leafs": len(leafs),
        "n_nodes_shown": len(nodes),
        "ops": dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))),
        "n_splits": int(model.sched.n_splits()),
        "placement": model.placement.describe(),
        "compute_buffer_bytes": compute,
        "weight_bytes": weights,
        "model_weight_bytes": int(model.weights.nbytes),
        "memory_bytes": int(model.memory.nbytes),
    }


def _shape_dict(model: Model, shape: UbatchShape, n_past: int) -> dict[str, Any]:
    return {"n_seq_tokens": shape.n_seq_tokens, "n_seqs": shape.n_seqs, "n_tokens": shape.n_tokens,
            "n_outputs": shape.n_outputs, "n_kv": shape.n_kv, "seq_head": shape.seq_head,
            "delta_net": shape.delta_net, "n_past": n_past, "rs_slots": model.memory.rs_slots,
            "decode": shape.n_seq_tokens == 1 and n_past > 0}


def dump_graph(model: Model, shape: UbatchShape, *, layer: int | None = None, n_past: int = 0,
               allocate: bool = True) -> GraphDump:
    """Describe the graph `model` computes for `shape` (built and cached by `Model.graph`)."""
    g = model.graph(shape)
    if allocate:
        model.sched.allocate(g.gf, g.ctx)
    mem = model.memory
    w = _Walker(model.sched.handle, g.gf, model.weights.tensors.values(),
                [t for d in (mem.k, mem.v, mem.conv, mem.ssm) for t in d.values()])
    nodes = [w.record(t, "node", i) for i, t in enumerate(w.nodes)]
    leafs = [w.record(t, "leaf", i) for i, t in enumerate(w.leafs)]
    _assign_layers(nodes, leafs)
    summary = _summary(model, w, nodes, leafs)
    dump = GraphDump(model=str(model.path), architecture=getattr(model.family, "arch", "?"),
                     shape=_shape_dict(model, shape, n_past), summary=summary, nodes=nodes, leafs=leafs)
    dump.tensors = {r.id: t for r, t in zip(nodes + leafs, w.nodes + w.leafs)}
    if layer is not None:
        filter_layer(dump, layer)
    return dump


def filter_layer(dump: GraphDump, layer: int) -> None:
    """Keep the nodes of one layer plus their direct sources (and the tensors those view)."""
    keep_nodes = {r.id for r in dump.nodes if r.layer == layer}
    if not keep_nodes:
        layers = sorted({r.layer for r in dump.nodes if r.layer is not None})
        raise DeltarunError(f"no node belongs to layer {layer}; this graph has layers {layers[0]}..{layers[-1]}"
                            if layers else f"no node belongs to layer {layer}")
    needed = set(keep_nodes)
    for r in dump.nodes:
        if r.id in keep_nodes:
            needed.update(r.src_ids)
            if r.view_of_id:
                needed.add(r.view_of_id)
    dump.nodes = [r for r in dump.nodes if r.id in needed]
    dump.leafs = [r for r in dump.leafs if r.id in needed]
    dump.layer = layer
    dump.summary["n_nodes_shown"] = len(dump.nodes)


# ----------------------------------------------------------------------------------------------
# Values
# ----------------------------------------------------------------------------------------------
def compile_patterns(patterns: Iterable[str] | None) -> Callable[[str], bool] | None:
    """A name predicate: `re:REGEX` is searched as a regular expression, anything else is an fnmatch
    glob matched against the whole name (`attn_norm-*`, `result_*`)."""
    pats = [p for p in (patterns or []) if p]
    if not pats:
        return None
    tests: list[Callable[[str], bool]] = []
    for p in pats:
        if p.startswith("re:"):
            try:
                rx = re.compile(p[3:])
            except re.error as e:
                raise DeltarunError(f"bad --filter regular expression {p[3:]!r}: {e}") from None
            tests.append(lambda n, rx=rx: rx.search(n) is not None)
        else:
            tests.append(lambda n, p=p: fnmatch.fnmatchcase(n, p))
    return lambda name: any(t(name) for t in tests)


def tensor_array(t: Any) -> tuple[np.ndarray | None, str | None]:
    """The tensor's data as numpy (shape = reversed ne), read from its backend buffer.

    Contiguous tensors are copied directly; strided views are read over their byte span and
    gathered through their strides (noted). Quantised types are not read (noted)."""
    c = t.contents
    if c.type not in NP_TYPES:
        return None, f"type {_str(ggml.ggml_type_name(c.type))} is not read (quantised)"
    if not c.data or not c.buffer:
        return None, "no data (not allocated)"
    dtype = np.dtype(NP_TYPES[c.type])
    n_dims = int(ggml.ggml_n_dims(t))
    ne = [int(c.ne[i]) for i in range(4)]
    nbs = [int(c.nb[i]) for i in range(4)]
    shape = tuple(reversed(ne[:n_dims]))
    if ggml.ggml_is_contiguous(t):
        out = np.empty(shape, dtype=dtype)
        ggml.ggml_backend_tensor_get(t, out.ctypes.data, 0, out.nbytes)
        return out, None
    span = int(ggml.ggml_nbytes(t))  # byte span of a strided view: type_size + sum((ne_i - 1) * nb_i)
    raw = np.empty(span, dtype=np.uint8)
    ggml.ggml_backend_tensor_get(t, raw.ctypes.data, 0, span)
    full = tuple(reversed(ne))
    elems = np.lib.stride_tricks.as_strided(raw, shape=full + (dtype.itemsize,),
                                            strides=tuple(reversed(nbs)) + (1,), writeable=False)
    out = np.ascontiguousarray(elems).view(dtype).reshape(full).reshape(shape)
    return out, "not contiguous: gathered through its strides"


def value_stats(arr: np.ndarray, n_first: int = N_FIRST) -> ValueStats:
    x = np.asarray(arr).reshape(-1)
    v = ValueStats(observed=True, count=int(x.size))
    xf = x.astype(np.float64)
    nan = np.isnan(xf)
    inf = np.isinf(xf)
    v.n_nan, v.n_inf = int(nan.sum()), int(inf.sum())
    fin = xf[~(nan | inf)]
    if fin.size:
        v.min, v.max = float(fin.min()), float(fin.max())
        v.mean = float(fin.mean())
        v.rms = float(math.sqrt(float(np.mean(fin * fin))))
    v.first = [_json_number(e) for e in x[:n_first].tolist()]
    return v


def _json_number(e: Any) -> Any:
    if isinstance(e, float) and not math.isfinite(e):
        return "nan" if math.isnan(e) else ("inf" if e > 0 else "-inf")
    return e


def select_nodes(dump: GraphDump, layer: int | None, patterns: Iterable[str] | None) -> list[TensorRecord]:
    """The nodes whose values `--values` records: those of `layer` (when given) matching `patterns`."""
    match = compile_patterns(patterns)
    selected = [r for r in dump.nodes if (layer is None or r.layer == layer) and (match is None or match(r.name))]
    if not selected:
        where = f" in layer {layer}" if layer is not None else ""
        raise DeltarunError(f"no node{where} matches --filter {' '.join(patterns or [])!s}; node names look like "
                            "attn_norm-0, conv_state_store-1, result_output (see the plain dump)")
    return selected


def record_values(sched: Any, dump: GraphDump, selected: list[TensorRecord], run: Callable[[], Any], *,
                  keep_arrays: bool = False, n_first: int = N_FIRST) -> dict[str, np.ndarray]:
    """Call `run` (which computes the dumped graph on `sched`, a `Scheduler`) with an eval callback
    that sets `values` on the selected records; returns their arrays by id when `keep_arrays`."""
    wanted = {_addr(dump.tensors[r.id]): r for r in selected}
    arrays: dict[str, np.ndarray] = {}
    errors: list[Exception] = []
    for r in selected:
        r.values = ValueStats(observed=False, note="not shown to the eval callback by the scheduler")

    def observe(t: Any, ask: bool, user_data: Any) -> bool:
        try:
            r = wanted.get(ctypes.addressof(t.contents))
            if ask:
                return r is not None
            if r is not None:
                arr, note = tensor_array(t)
                if arr is None:
                    r.values = ValueStats(observed=True, count=int(ggml.ggml_nelements(t)), note=note)
                else:
                    r.values = value_stats(arr, n_first)
                    r.values.note = note
                    if keep_arrays:
                        arrays[r.id] = arr
        except Exception as e:  # never let an exception cross into C
            errors.append(e)
            return False
        return True

    sched.set_eval_callback(observe)  # the scheduler owns the ggml callback (scheduler.Scheduler)
    try:
        run()
    finally:
        sched.clear_eval_callback()
    if errors:
        raise DeltarunError(f"reading values failed: {errors[0]}")
    return arrays


def capture_values(model: Model, tokens: list[int], *, n_seqs: int = 1, decode: bool = False,
                   all_outputs: bool = False, layer: int | None = None, patterns: Iterable[str] | None = None,
                   keep_arrays: bool = False, n_first: int = N_FIRST, prompt: str | None = None
                   ) -> tuple[GraphDump, dict[str, np.ndarray]]:
    """Run `tokens` (as every one of `n_seqs` sequences, from an empty state) and record the values
    of the selected nodes of the last ubatch's graph.

    The model is reset first and holds the prompt's state afterwards; the eval callback is removed
    again before returning. Prefill (default): the whole prompt is one ubatch. `decode`: the prompt but its last token is
    evaluated first, then the last token alone: the recorded graph is the one-token decode graph.
    Returns the dump (with `values` on the selected nodes) and, with `keep_arrays`, the arrays by id.
    """
    tokens = [int(t) for t in tokens]
    if not tokens:
        raise DeltarunError("the prompt has no tokens")
    if decode and len(tokens) < 2:
        raise DeltarunError("--decode with --values needs a prompt of at least two tokens")
    model.reset()
    prefix, last = (tokens[:-1], tokens[-1:]) if decode else ([], tokens)
    n_past = len(prefix)
    shape = ubatch_shape(model, len(last), n_seqs, n_past, all_outputs)
    if prefix:
        if n_seqs == 1:
            model.eval(prefix)
        else:
            model.eval_batch({s: list(prefix) for s in range(n_seqs)})
    dump = dump_graph(model, shape, layer=layer, n_past=n_past)
    selected = select_nodes(dump, layer, patterns)
    builds = model.stats.n_graph_builds
    arrays = record_values(model.sched, dump, selected, lambda: model.eval_batch(
        {seq: list(last) for seq in range(n_seqs)}, all_logits=all_outputs), keep_arrays=keep_arrays, n_first=n_first)
    if model.stats.n_graph_builds != builds:  # the runner chose another shape than the dump's
        raise DeltarunError("internal: the runner evaluated a different graph than the one dumped")
    dump.values = {"prompt": prompt, "tokens": tokens, "n_selected": len(selected),
                   "n_observed": sum(1 for r in selected if r.values and r.values.observed)}
    dump.value_patterns = list(patterns) if patterns else None
    return dump, arrays


# ----------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------
def _safe_name(name: str) -> str:
    s = re.sub(r"[^A-Za-z0-9_.+-]+", "_", name).strip("._")
    return s or "tensor"


def write_dump_dir(dump: GraphDump, arrays: dict[str, np.ndarray], directory: str | Path) -> Path:
    """One .npy per recorded array plus manifest.json, each written atomically."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    used: set[str] = set()
    entries = []
    for r in dump.nodes:
        if r.id not in arrays:
            continue
        base = _safe_name(r.name)
        fname = f"{base}.npy"
        if fname in used:
            fname = f"{base}__{r.id}.npy"
        used.add(fname)
        buf = io.BytesIO()
        np.save(buf, arrays[r.id], allow_pickle=False)
        write_atomically(d / fname, buf.getvalue())
        if r.values is not None:
            r.values.file = fname
        entries.append({"name": r.name, "id": r.id, "op": r.op, "type": r.type, "ne": r.ne,
                        "shape": list(arrays[r.id].shape), "file": fname,
                        "stats": r.values.to_dict() if r.values else None})
    manifest = {"schema_version": SCHEMA_VERSION, "model": dump.model, "shape": dump.shape,
                "tokens": (dump.values or {}).get("tokens"), "tensors": entries}
    write_atomically(d / "manifest.json", json.dumps(manifest, indent=1, allow_nan=False) + "\n")
    return d / "manifest.json"


# ----------------------------------------------------------------------------------------------
# Formatting helpers
# ----------------------------------------------------------------------------------------------
def _dims(v: list[int]) -> str:
    return "[" + ", ".join(str(x) for x in v) + "]"


def _num(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, int):
        return str(x)
    return f"{x:.6g}"


def _shape_label(sh: dict[str, Any]) -> str:
    if "grid" in sh:       # a vision tower's graph (apps/vision_graph.py)
        return (f"image {sh['image'][0]} x {sh['image'][1]} pixels, {sh['grid'][1]} x {sh['grid'][2]} patches, "
                f"{sh['n_tokens']} image tokens")
    return (f"tokens {sh['n_seq_tokens']} x seqs {sh['n_seqs']}, outputs {sh['n_outputs']}, n_kv {sh['n_kv']}, "
            f"past {sh['n_past']}, K {sh['rs_slots']}, {sh['delta_net']}")


def _dot_escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def _dot_style(r: TensorRecord) -> str:
    label = _dot_escape(r.name) + "\\n" + _dot_escape(f"{r.op} {r.type} {_dims(r.ne)}")
    if r.is_weight:
        style = 'shape=box, style=filled, fillcolor="#fff2cc", color="#b59f3b"'
    elif r.is_input:
        style = 'shape=invhouse, style=filled, fillcolor="#d5f5d5", color="#3b8f3b"'
    elif r.is_memory:
        style = 'shape=cylinder, style=filled, fillcolor="#dae8fc", color="#3b5f8f"'
    elif r.is_output:
        style = 'shape=box, style="filled,bold", fillcolor="#f8cecc", color="#b85450", penwidth=2'
    elif r.view_of or r.op in ("RESHAPE", "PERMUTE", "TRANSPOSE"):
        style = 'shape=box, style="dashed,rounded", color="#888888"'
    else:
        style = 'shape=box, style="rounded"'
    return f'label="{label}", {style}'
