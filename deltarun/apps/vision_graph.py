"""The vision tower's graph (an mmproj file) for `deltarun graph --mmproj` and `deltarun compare --mmproj`.

A tower's graph depends on the image's size only, so it is built for one image
(`VisionEncoder.graph`: the graph `encode` computes, allocated on its own scheduler) and described
with `graph_dump`'s records: the same tensor objects, layers (`-N` suffixes, `v.blk.N.` weights),
filters, value statistics and renderers as a text model's dump, with an image shape in place of
the ubatch shape (`graph_dump`'s JSON schema). With `values`, the graph is computed with the
scheduler's eval callback, as `deltarun graph --values` does for a prompt.

`compare_towers` runs two sides (an mmproj on a backend each; both files may differ, e.g. F32
against Q8_0) on the same image and compares them as `apps.compare` compares text graphs: per
node NMSE against `apps.compare`'s per-op limits (node by node when the graphs have one structure,
by name otherwise), then the embeddings of a plain run (no callback, so each backend fuses and
schedules as it normally does), held to the matrix-product limit. Report schema: `apps.compare`'s,
with `kind` "vision", `image` {file, size [h, w], grid [t, h, w], n_tokens, digest} in place of the
prompt, the one graph "vision", and `embeddings` {nmse, limit, max_rel_err (max |a-b| / max |a|),
n_tokens, dim, nan, status} in place of logits and greedy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from deltarun.apps import compare as cmp
from deltarun.apps import graph_dump as gd
from deltarun.base.errors import DeltarunError, UnsupportedModelError
from deltarun.base.ggml_util import ggml
from deltarun.base.gguf_file import GGUFFile
from deltarun.base.vision import PreparedImage
from deltarun.runner.vision import VisionEncoder

#: image tokens (rows, columns) of the seeded random image used when no --image is given
RANDOM_IMAGE_TOKENS = (2, 3)


def check_fits(encoder: VisionEncoder, model: Path) -> None:
    """Refuse a tower that does not fit the text model (hidden size, deepstack), read from its header."""
    f = GGUFFile(model)
    arch = f.get("general.architecture")
    if arch == "clip":
        raise UnsupportedModelError(f"{model} is an mmproj file; give the text model as MODEL and the mmproj "
                                    "with --mmproj")
    n_embd = f.get(f"{arch}.embedding_length")
    if not isinstance(n_embd, int):
        raise UnsupportedModelError(f"{model}: no {arch}.embedding_length key; is it a text model GGUF?")
    encoder.check_text_model(n_embd, str(arch))


def image_for(encoder: VisionEncoder, path: Path | None, seed: int = 0) -> tuple[PreparedImage, str]:
    """The image a command looks at, and how to name it: the file preprocessed for this tower, or
    (without one) seeded uniform pixels in [-1, 1] of RANDOM_IMAGE_TOKENS image tokens, as the text
    commands default to random tokens."""
    from deltarun.runner.images import load_image

    hp = encoder.hp
    if path is not None:
        return load_image(path, hp), str(path)
    rows, cols = RANDOM_IMAGE_TOKENS
    pixels = np.random.default_rng(seed).uniform(-1, 1, (3, rows * hp.align, cols * hp.align)).astype(np.float32)
    return PreparedImage(pixels, hp.patch_size, hp.n_merge), f"random {rows * hp.align} x {cols * hp.align} (seed {seed})"


def shape_of(image: PreparedImage) -> dict[str, Any]:
    _, h, w = image.pixels.shape
    _, gh, gw = image.grid
    return {"image": [int(h), int(w)], "grid": [1, gh, gw], "n_patches": gh * gw, "n_tokens": image.n_tokens}


def _summary(encoder: VisionEncoder, sched: Any, nodes: list[gd.TensorRecord],
             leafs: list[gd.TensorRecord]) -> dict[str, Any]:
    from collections import Counter

    compute: dict[str, int] = {}
    for b in sched.backends:
        name = (ggml.ggml_backend_name(b.handle) or b"?").decode(errors="replace")
        compute[name] = compute.get(name, 0) + int(ggml.ggml_backend_sched_get_buffer_size(sched.handle, b.handle))
    weights: dict[str, int] = {}
    for r in leafs + nodes:
        if r.is_weight:
            key = r.backend or r.buffer or "?"
            weights[key] = weights.get(key, 0) + r.nbytes
    ops = Counter(r.op for r in nodes)
    return {"n_nodes": len(nodes), "n_leafs": len(leafs), "n_nodes_shown": len(nodes),
            "ops": dict(sorted(ops.items(), key=lambda kv: (-kv[1], kv[0]))), "n_splits": int(sched.n_splits()),
            "placement": f"vision tower ({encoder.hp.n_layer} blocks) on {encoder.backend.description}",
            "compute_buffer_bytes": compute, "weight_bytes": weights,
            "model_weight_bytes": int(encoder.weights.nbytes), "memory_bytes": 0}


def dump_tower(encoder: VisionEncoder, image: PreparedImage, image_label: str, *, layer: int | None = None,
               values: bool = False, patterns: Iterable[str] | None = None, keep_arrays: bool = False,
               n_first: int = gd.N_FIRST) -> tuple[gd.GraphDump, dict[str, np.ndarray]]:
    """The tower's graph for `image` as a `GraphDump` (filtered to `layer` when given); with
    `values`, computed once with the selected nodes' values recorded (arrays by id with `keep_arrays`)."""
    arrays: dict[str, np.ndarray] = {}
    with encoder.graph(image) as run:
        w = gd._Walker(run.sched.handle, run.gf, encoder.weights.tensors.values())
        nodes = [w.record(t, "node", i) for i, t in enumerate(w.nodes)]
        leafs = [w.record(t, "leaf", i) for i, t in enumerate(w.leafs)]
        gd._assign_layers(nodes, leafs)
        dump = gd.GraphDump(model=str(encoder.path), architecture=f"clip ({encoder.hp.projector})",
                            shape=shape_of(image), summary=_summary(encoder, run.sched, nodes, leafs),
                            nodes=nodes, leafs=leafs)
        dump.tensors = {r.id: t for r, t in zip(nodes + leafs, w.nodes + w.leafs)}
        if layer is not None:
            gd.filter_layer(dump, layer)
        if values:
            selected = gd.select_nodes(dump, layer, patterns)
            arrays = gd.record_values(run.sched, dump, selected, run.compute, keep_arrays=keep_arrays, n_first=n_first)
            dump.values = {"prompt": None, "tokens": [], "image": image_label, "n_selected": len(selected),
                           "n_observed": sum(1 for r in selected if r.values and r.values.observed)}
            dump.value_patterns = list(patterns) if patterns else None
        dump.tensors = {}     # the pointers die with the graph
    return dump, arrays


# ----------------------------------------------------------------------------------------------
# compare
# ----------------------------------------------------------------------------------------------
@dataclass
class TowerSide:
    """One side of a tower comparison: an mmproj file on a backend."""

    mmproj: Path
    backend: str = "cpu"
    label: str = "a"


@dataclass
class TowerRun:
    side: TowerSide
    device: str
    weight_types: dict[str, int]
    embeddings: np.ndarray
    graph: cmp.GraphCapture


def run_tower(side: TowerSide, image: PreparedImage, *, n_threads: int | None = None,
              progress: Callable[[str], None] | None = None) -> TowerRun:
    """A plain encode (the embeddings), then the graph again with every node recorded."""
    say = progress or (lambda s: None)
    with VisionEncoder(side.mmproj, backend=side.backend, n_threads=n_threads) as enc:
        say(f"side {side.label}: {side.mmproj.name} on {enc.backend.description}: the embeddings of "
            f"{image.n_tokens} image tokens")
        emb = enc.encode(image)
        say(f"side {side.label}: recording the tower's graph")
        dump, arrays = dump_tower(enc, image, "", values=True, keep_arrays=True, n_first=0)
        graph = cmp.GraphCapture(name="vision", n_tokens=image.n_tokens, n_past=0, nodes=dump.nodes,
                                 leafs=dump.leafs, arrays=arrays, n_splits=int(dump.summary["n_splits"]))
        return TowerRun(side, enc.backend.description, cmp.weight_types(enc.weights.tensors.values()), emb, graph)


def compare_embeddings(a: np.ndarray, b: np.ndarray) -> dict[str, Any]:
    """Side b's embeddings against side a's (the reference), held to the matrix-product limit."""
    nan = bool(np.isnan(a).any() or np.isnan(b).any())
    e = cmp.nmse(a, b) if not nan else float("nan")
    scale = float(np.abs(a).max()) if a.size else 0.0
    rel = float(np.abs(a.astype(np.float64) - b).max()) / scale if scale and not nan else (0.0 if not nan else None)
    status = "nan" if nan else ("ok" if e <= cmp.MATMUL_LIMIT else "exceeds")
    return {"nmse": cmp._num(e), "limit": cmp.MATMUL_LIMIT, "max_rel_err": rel, "n_tokens": int(a.shape[0]),
            "dim": int(a.shape[1]), "nan": nan, "status": status}


def compare_towers(a: TowerSide, b: TowerSide, image: PreparedImage, image_file: str | None, *,
                   n_threads: int | None = None, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run both sides on `image` and return the report (schema in the module docstring)."""
    a.label, b.label = "a", "b"
    ra = run_tower(a, image, n_threads=n_threads, progress=progress)
    rb = run_tower(b, image, n_threads=n_threads, progress=progress)
    if ra.embeddings.shape != rb.embeddings.shape:
        raise DeltarunError(f"the two towers give embeddings of different shapes ({list(ra.embeddings.shape)} "
                            f"and {list(rb.embeddings.shape)}): they are not one model's")
    graph = cmp.compare_graph(ra.graph, rb.graph)
    emb = compare_embeddings(ra.embeddings, rb.embeddings)
    failures = []
    if graph["n_failed"]:
        f = graph["first_failure"]
        failures.append(f"vision: {graph['n_failed']} node(s) exceed their limits; first {f['name']} ({f['op']}): "
                        f"{cmp._describe(f)}")
    if emb["status"] != "ok":
        failures.append(f"embeddings: NMSE {cmp._fmt(emb['nmse'])} exceeds {cmp.MATMUL_LIMIT:g}"
                        if emb["status"] == "exceeds" else "embeddings: NaN")
    sides = [{"label": r.side.label, "model": str(r.side.mmproj), "backend": r.side.backend, "device": r.device,
              "delta_net": None, "gpu_layers": None, "placement": f"vision tower on {r.device}",
              "weight_types": r.weight_types, "n_splits": {"vision": r.graph.n_splits}} for r in (ra, rb)]
    return {"schema_version": cmp.SCHEMA_VERSION, "kind": "vision", "passed": not failures, "failures": failures,
            "sides": sides,
            "image": {"file": image_file, **{k: v for k, v in shape_of(image).items() if k != "n_patches"},
                      "digest": image.digest},
            "limits": {"default": cmp.DEFAULT_LIMIT, "ops": dict(cmp.OP_LIMITS), "embeddings": cmp.MATMUL_LIMIT},
            "graphs": [graph], "embeddings": emb}


def to_text(report: dict[str, Any], show: str = "named") -> str:
    """The tower report as text (the layout of `apps.compare.to_text`)."""
    out: list[str] = []
    sa, sb = report["sides"]
    for s in (sa, sb):
        types = ", ".join(f"{k} x{v}" for k, v in s["weight_types"].items())
        out.append(f"side {s['label']}: {s['model']} on {s['backend']} = {s['device']}; weights {types}")
    im = report["image"]
    out.append(f"image: {im['file'] or 'random pixels'}, {im['image'][0]} x {im['image'][1]} pixels, "
               f"{im['grid'][1]} x {im['grid'][2]} patches, {im['n_tokens']} image tokens; "
               f"NMSE = sum((a-b)^2)/sum(a^2); limits: default {cmp.DEFAULT_LIMIT:g}, MUL_MAT and FLASH_ATTN_EXT "
               f"{cmp.MATMUL_LIMIT:g} and whatever depends on them")
    for g in report["graphs"]:
        out.append("")
        out.extend(cmp.graph_lines(g, sa, sb, show))
    e = report["embeddings"]
    out.append("")
    out.append(f"embeddings ({e['n_tokens']} x {e['dim']}): NMSE {cmp._fmt(e['nmse'])} (limit {e['limit']:g}), "
               f"max |a-b| / max |a| {cmp._fmt(e['max_rel_err'])} -> {e['status']}")
    out.append("")
    if report["passed"]:
        out.append("PASS: every node and the embeddings are within their limits")
    elif sa["model"] != sb["model"]:
        out.append("OVER THE LIMITS, as two weight files are (the embeddings metrics above are the result):")
    else:
        out.append("FAIL:")
        out.extend(f"  {f}" for f in report["failures"])
    return "\n".join(out) + "\n"
