"""Self-contained HTML pages that draw a ggml graph: `deltarun graph --format html` and `compare --html`.

Why a page: a hybrid model's graph has hundreds of nodes per ubatch (thousands for a 48-layer
model); a text table or a static SVG is hard to follow. The page draws the exact graph of a dump
(`graph_dump.GraphDump.to_dict()`, schema in that module) or of a comparison report
(`compare.compare()`, schema in that module) with pan and zoom, layers collapsible into groups,
search by name, a details panel per node and colour modes.

The layout is computed here, in Python, so the browser only draws: the graph is cut into *bands*
(graph inputs, one band per layer in execution order, the output head), and inside a band every
tensor gets a rank (the longest path from the band's first node; a leaf sits one rank above its
first consumer) and an x position (the barycentre of its inputs, pushed right to avoid overlaps).
Collapsing a band in the page only changes band offsets, so no layout runs in the browser. The page
itself (deltarun/apps/pages/graph.{html,css,js}) is a plain canvas renderer that draws only what is
in view, with no library and no network access; the data are embedded as JSON.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from importlib import resources
from typing import Any

from deltarun.apps.graph_dump import layer_of_name

NODE_W = 180      # node box width in layout units (CSS pixels at zoom 1)
GAP_X = 24        # horizontal gap between boxes of one rank

INPUTS_BAND = "inputs"
OUTPUT_BAND = "output"


def read_asset(name: str) -> str:
    """A file of deltarun/apps/pages (package data): graph.html/css/js, chat.html."""
    return resources.files("deltarun.apps").joinpath("pages", name).read_text(encoding="utf-8")


def _script_json(data: Any) -> str:
    """JSON that is safe inside a <script> element (no `</script>`, no `<!--`)."""
    return (json.dumps(data, separators=(",", ":"), allow_nan=False)
            .replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


def _text(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def render_page(data: dict[str, Any], title: str) -> str:
    """The single HTML file: graph.html with its stylesheet, script and `data` inlined."""
    html = read_asset("graph.html")
    return (html.replace("%%TITLE%%", _text(title))
            .replace("/*%%STYLE%%*/", read_asset("graph.css"))
            .replace("%%DATA%%", _script_json(data))
            .replace("/*%%SCRIPT%%*/", read_asset("graph.js")))


# ----------------------------------------------------------------------------------------------
# Layout
# ----------------------------------------------------------------------------------------------
def _band_keys(tensors: list[dict[str, Any]]) -> dict[str, Any]:
    """Band of every tensor: its layer for nodes of a layer; graph-level nodes after the last
    layer's nodes go to `output`, the others to `inputs`; a leaf goes to the band of its consumers when they
    share one, else to `inputs`."""
    nodes = [t for t in tensors if t["kind"] == "node"]
    last_layered = max((i for i, t in enumerate(nodes) if t["layer"] is not None), default=-1)
    band: dict[str, Any] = {}
    for i, t in enumerate(nodes):
        band[t["id"]] = t["layer"] if t["layer"] is not None else (INPUTS_BAND if i < last_layered else OUTPUT_BAND)
    consumers: dict[str, list[str]] = defaultdict(list)
    for t in nodes:
        for s in t["src_ids"]:
            consumers[s].append(t["id"])
        if t.get("view_of_id"):
            consumers[t["view_of_id"]].append(t["id"])
    for t in tensors:
        if t["kind"] == "node":
            continue
        bands = {band[c] for c in consumers.get(t["id"], []) if c in band}
        band[t["id"]] = bands.pop() if len(bands) == 1 else INPUTS_BAND
    return band


def layout(tensors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Set `band`, `rank` and `x` on every tensor; return the bands in drawing order.

    Tensors are dicts with at least id, kind ("node"/"leaf"), layer and src_ids, nodes in
    execution order."""
    by_id = {t["id"]: t for t in tensors}
    band_of = _band_keys(tensors)
    layers = sorted({k for k in band_of.values() if isinstance(k, int)})
    order: list[Any] = [INPUTS_BAND, *layers, OUTPUT_BAND]  # ggml may start a layer before the previous ends
    members: dict[Any, list[dict[str, Any]]] = {k: [] for k in order}
    for t in tensors:
        members[band_of[t["id"]]].append(t)

    consumers: dict[str, list[str]] = defaultdict(list)
    for t in tensors:
        for s in t["src_ids"]:
            consumers[s].append(t["id"])

    bands = []
    for key in order:
        ts = members[key]
        if not ts:
            continue
        ids = {t["id"] for t in ts}
        rank: dict[str, int] = {}
        for t in ts:  # nodes in execution order: sources come first
            if t["kind"] == "node":
                rank[t["id"]] = max([rank[s] + 1 for s in t["src_ids"] if s in rank] + [1])
        for t in ts:
            if t["kind"] != "node":
                cons = [rank[c] for c in consumers.get(t["id"], []) if c in rank and c in ids]
                rank[t["id"]] = max(0, min(cons) - 1) if cons else 0
        if all(rank[t["id"]] > 0 for t in ts):  # no leaf in the first row: close the gap
            for t in ts:
                rank[t["id"]] -= 1
        rows: dict[int, list[dict[str, Any]]] = defaultdict(list)
        for t in ts:
            rows[rank[t["id"]]].append(t)
        x: dict[str, float] = {}
        n_ranks = max(rows) + 1
        for r in range(n_ranks):
            row = rows.get(r, [])
            want = []
            for pos, t in enumerate(row):
                near = [x[s] for s in t["src_ids"] if s in x]
                if not near:  # a leaf: under nothing yet; aim at its consumers' sources
                    near = [x[s] for c in consumers.get(t["id"], []) if c in by_id for s in by_id[c]["src_ids"]
                            if s in x]
                want.append(sum(near) / len(near) if near else pos * (NODE_W + GAP_X))
            placed = sorted(zip(want, range(len(row))), key=lambda p: p)
            xs: list[float] = []
            for w, _ in placed:
                xs.append(w if not xs else max(w, xs[-1] + NODE_W + GAP_X))
            shift = sum(w - p for (w, _), p in zip(placed, xs)) / len(xs) if xs else 0.0
            for (_, i), p in zip(placed, xs):
                x[row[i]["id"]] = p + shift
        lo = min(x.values())
        for t in ts:
            t["band"] = len(bands)
            t["rank"] = rank[t["id"]]
            t["x"] = round(x[t["id"]] - lo, 1)
        width = max(x.values()) - lo + NODE_W
        layer = key if isinstance(key, int) else None
        ops = Counter(t["op"] for t in ts if t["kind"] == "node")
        bands.append({"key": str(key), "layer": layer, "n_ranks": n_ranks, "width": round(width, 1),
                      "n_nodes": sum(1 for t in ts if t["kind"] == "node"), "n_leafs": sum(1 for t in ts if t["kind"] != "node"),
                      "label": _band_label(key, ops), "ops": dict(ops.most_common(6))})
    return bands


def _band_label(key: Any, ops: Counter) -> str:
    if key == INPUTS_BAND:
        return "graph inputs"
    if key == OUTPUT_BAND:
        return "output head"
    kind = ("linear attention (delta-net)" if "GATED_DELTA_NET" in ops or "SSM_CONV" in ops
            else "full attention" if "FLASH_ATTN_EXT" in ops or "SOFT_MAX" in ops else "")
    return f"layer {key}" + (f": {kind}" if kind else "")


def _splits(nodes: list[dict[str, Any]]) -> None:
    """`split`: the index of the run of consecutive nodes (execution order) on one backend. ggml's
    scheduler cuts the graph where the backend changes (and may cut more often, e.g. when a split
    has too many inputs): the scheduler's own count is the summary's n_splits."""
    split, prev = -1, object()
    for t in nodes:
        if t.get("backend") != prev:
            split += 1
            prev = t.get("backend")
        t["split"] = split


# ----------------------------------------------------------------------------------------------
# Graph dumps
# ----------------------------------------------------------------------------------------------
_TENSOR_KEYS = ("id", "kind", "index", "name", "op", "type", "ne", "nb", "nbytes", "contiguous", "view_of",
                "view_of_id", "view_offs", "src", "src_ids", "backend", "buffer", "is_input", "is_output",
                "is_weight", "is_memory", "layer", "values")


def dump_view(dump: dict[str, Any]) -> dict[str, Any]:
    """The page's view of one graph dump (GraphDump.to_dict())."""
    tensors = [{k: t[k] for k in _TENSOR_KEYS if k in t} for t in dump["nodes"] + dump["leafs"]]
    _splits([t for t in tensors if t["kind"] == "node"])
    bands = layout(tensors)
    return {"name": "graph", "tensors": tensors, "bands": bands, "summary": dump["summary"],
            "shape": dump["shape"], "values": dump.get("values"), "filter": dump.get("filter")}


def render_graph_html(dump: dict[str, Any]) -> str:
    """`deltarun graph --format html`: the page of one graph dump."""
    view = dump_view(dump)
    data = {"mode": "graph", "model": dump["model"], "architecture": dump["architecture"],
            "has_values": dump.get("values") is not None, "graphs": [view]}
    sh = dump["shape"]
    what = (f"vision tower, {sh['grid'][1]} x {sh['grid'][2]} patches" if "grid" in sh
            else f"{sh['n_seq_tokens']} x {sh['n_seqs']} tokens")
    title = f"{dump['model'].rsplit('/', 1)[-1]}: graph of {what}"
    return render_page(data, title)


# ----------------------------------------------------------------------------------------------
# Comparison reports
# ----------------------------------------------------------------------------------------------
_LEAF_FLAGS = {"weight": "is_weight", "memory": "is_memory", "input": "is_input"}
#: verdicts of tensors that are not compared: weights and graph inputs are identical on both sides
_LEAF_STATUS = {"weight": "exact", "input": "exact", "memory": "memory", "leaf": "leaf"}


def compare_view(graph: dict[str, Any], side_a: dict[str, Any], side_b: dict[str, Any]) -> dict[str, Any]:
    """The page's view of one compared graph (report["graphs"][i]): side a's nodes with their
    verdicts, and the tensors their inputs name (weights, inputs, memory; nodes that were not
    compared) as leafs."""
    tensors: list[dict[str, Any]] = []
    known: set[str] = set()
    for row in graph["nodes"]:
        t = {k: row[k] for k in ("id", "index", "name", "op", "type", "ne", "status", "nmse", "limit", "max_abs_err",
                                 "n_diff", "note", "named", "backend_a", "backend_b", "inputs")}
        t.update(kind="node", backend=row["backend_b"] or row["backend_a"], layer=row.get("layer", layer_of_name(row["name"])),
                 src_ids=[i["id"] for i in row["inputs"]], src=[i["name"] for i in row["inputs"]])
        tensors.append(t)
        known.add(row["id"])
    extra: dict[str, dict[str, Any]] = {}
    for row in graph["nodes"]:
        for i in row["inputs"]:
            if i["id"] in known or i["id"] in extra:
                continue
            leaf = {"id": i["id"], "kind": "leaf" if i["kind"] != "node" else "uncompared", "name": i["name"],
                    "op": "NONE" if i["kind"] != "node" else "?", "type": "", "ne": None, "src_ids": [], "src": [],
                    "layer": layer_of_name(i["name"]), "status": _LEAF_STATUS.get(i["kind"], i["status"] or "not_compared"),
                    "input_kind": i["kind"], "nmse": None, "backend": None}
            if i["kind"] in _LEAF_FLAGS:
                leaf[_LEAF_FLAGS[i["kind"]]] = True
            extra[i["id"]] = leaf
    tensors.extend(extra.values())
    _splits([t for t in tensors if t["kind"] == "node"])
    bands = layout(tensors)
    first = graph["first_failure"]
    return {"name": graph["graph"], "tensors": tensors, "bands": bands,
            "first_failure": first["id"] if first else None,
            "summary": {k: graph[k] for k in ("n_tokens", "n_past", "matched_by", "n_nodes_a", "n_nodes_b", "n_compared",
                                              "n_failed", "n_skipped")},
            "splits": {"a": side_a["n_splits"].get(graph["graph"]), "b": side_b["n_splits"].get(graph["graph"])}}


def render_compare_html(report: dict[str, Any]) -> str:
    """`deltarun compare --html`: every compared graph coloured by NMSE against its limit, the first
    node over its limit marked, and the logits metrics."""
    sa, sb = report["sides"]
    data = {"mode": "compare", "model": sa["model"], "architecture": "", "has_values": False,
            "graphs": [compare_view(g, sa, sb) for g in report["graphs"]],
            "compare": {k: report[k] for k in ("passed", "failures", "sides", "prompt", "decode_steps", "limits",
                                              "logits", "greedy", "image", "embeddings") if k in report}}
    title = f"compare: {sa['backend']} {sa['model'].rsplit('/', 1)[-1]} vs {sb['backend']} {sb['model'].rsplit('/', 1)[-1]}"
    return render_page(data, title)
