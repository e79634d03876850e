"""Run the same graphs on two sides (backends, delta-net kernels or weight files) and compare them.

A *side* is a model file opened on a backend with a delta-net kernel. `compare(a, b, tokens, steps)`
runs, on each side, from the same weights file(s) and the same token inputs:

1. the prompt as one ubatch with every node's value recorded through the scheduler's eval
   callback (`graph_dump.capture_values`, the mechanism `deltarun graph --values` uses), and, when
   steps > 0, the one-token decode graph after the prompt, fed side a's first greedy token on both
   sides so the inputs are identical;
2. plain runs (no callback, so the backend fuses and schedules as it normally does): the prompt's
   logits at every position, then `steps` greedy decode steps.

Per node, in graph order, the error of side b against side a (the reference) is the normalised
mean squared error NMSE = sum((a - b)^2) / sum(a^2), as ggml's test-backend-ops measures it. A NaN
in either side fails; infinities must be at the same places with the same signs (NMSE is taken
over the finite elements); integer outputs (top-k expert indices) must be equal, but for TOP_K's,
whose order within a row ggml leaves open (`compare_top_k`).

Per-op limits
-------------
test-backend-ops checks each op alone, fed identical inputs, against 1e-7 by default and 5e-4 for
ops that reduce long dot products, whose summation order and accumulation precision legitimately
differ between backends (MUL_MAT, MUL_MAT_ID, OUT_PROD, FLASH_ATTN_EXT). Here ops are fed their
predecessors' outputs, so an op's limit is the largest of:

- `DEFAULT_LIMIT` 1e-7: elementwise ops, norms, rope, softmax, copies and views, whose results
  differ only by rounding (float32: ~1e-7 relative per element, NMSE ~1e-14), kept loose enough
  for approximate exp/tanh/sigmoid implementations on GPUs;
- its own entry in `OP_LIMITS` (5e-4): the matrix products, and the attention-like ops that contain
  them: GATED_DELTA_NET (per token an S_k x S_v state product and update, a recurrence over the
  ubatch), SSM_SCAN and the RWKV kernels, SOLVE_TRI (the primitive delta-net's triangular solve: a
  sum of products like a matmul);
- the limit of any of its inputs that is a node: whatever depends on a matrix product may carry
  its error (an elementwise op on a 3e-4 input is not wrong), so nearly the whole graph after
  the first matmul is held to 5e-4 while everything before it (embedding rows, the first norm)
  must agree to 1e-7. Weights and graph inputs are exact; the KV cache and recurrent state read
  by a decode graph were written by a previous graph and carry the matmul limit.

Integer nodes (I32/I64) are exact; a TOP_K row (qwen4exp's indexer picks its blocks with one) is a
set: ggml leaves the order of the k indices open (the CPU swaps the first two on purpose, Vulkan
returns them in another order), and where scores tie at the k-th largest either side may take
either. The logits are held to `LOGITS_LIMIT` (the matmul limit). Over
the logits the report adds top-1 agreement per position, the KL divergence KL(a || b) of the
softmax distributions, and whether the greedy continuations are equal.

`--delta-net fused,primitive` compares graphs that differ: nodes are then matched by name (and
occurrence), unnamed ones and those present on only one side are skipped. Two files of one model
(`--against`, e.g. F32 and Q8_0) are compared the same way; their weights differ, so nodes
exceed their limits by design: the logits metrics tell what the quantisation costs.

JSON schema (`schema_version` 1)
--------------------------------
Top level::

    schema_version  int     1
    passed          bool    no node and no logits limit exceeded, no NaN
    failures        [str]   one line per failed check
    sides           [side, side]   a (reference) then b
    prompt          {"text": str|null, "tokens": [int]}
    decode_steps    int
    limits          {"default": float, "ops": {op: float}, "logits": float}
    graphs          [graph]  "prefill" then, with decode steps, "decode"
    logits          logits object
    greedy          {"steps": int, "a": [int], "b": [int], "match": bool, "first_divergence": int|null}

side::

    label ("a"|"b"), model (path), backend (name given), device (description), delta_net,
    gpu_layers (int|null), placement (str), weight_types ({ggml type: n tensors}),
    n_splits ({"prefill": int, "decode": int|null}: graph splits of the scheduler)

graph::

    graph ("prefill"|"decode"), n_tokens, n_past, matched_by ("index"|"name"),
    n_nodes_a, n_nodes_b, n_compared, n_failed, n_skipped, only_a [name], only_b [name],
    first_failure (node|null), nodes [node] (every compared or skipped node of side a, graph order)

node::

    index (side a's graph index), id ("n<index>"), name, op, type, ne [4], named (bool),
    layer (int|null: as in graph_dump),
    backend_a, backend_b (where the scheduler ran it, or null), status, nmse (float, or the
    strings "inf"/"nan", or null when not computed), limit, max_abs_err (float|null),
    n_diff (integer nodes: differing elements, else null), note (str|null),
    inputs [{"name", "id", "kind" ("node"|"weight"|"input"|"memory"|"leaf"), "nmse", "status"}]

    status: ok, exceeds, nan, inf_mismatch, shape_mismatch, index_mismatch (fail);
            only_a, not_read (quantised), not_observed (skip)

logits::

    n_positions (prompt positions + decode steps while the continuations agree), nmse, limit,
    max_position_nmse, top1_agreement (fraction), top1 [bool], kl_mean, kl_max, kl [float],
    nan (bool), status ("ok"|"exceeds"|"nan")
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from deltarun.base.errors import DeltarunError
from deltarun.runner.sampling import log_softmax
from deltarun.runner.units import format_table

if TYPE_CHECKING:  # annotations only: the applications open models lazily
    from deltarun.runner.model import Model

SCHEMA_VERSION = 1
DEFAULT_LIMIT = 1e-7
MATMUL_LIMIT = 5e-4
LOGITS_LIMIT = MATMUL_LIMIT
OP_LIMITS: dict[str, float] = {
    "MUL_MAT": MATMUL_LIMIT,
    "MUL_MAT_ID": MATMUL_LIMIT,
    "OUT_PROD": MATMUL_LIMIT,
    "FLASH_ATTN_EXT": MATMUL_LIMIT,
    "GATED_DELTA_NET": MATMUL_LIMIT,
    "SSM_SCAN": MATMUL_LIMIT,
    "RWKV_WKV6": MATMUL_LIMIT,
    "RWKV_WKV7": MATMUL_LIMIT,
    "SOLVE_TRI": MATMUL_LIMIT,
}
FAIL = ("exceeds", "nan", "inf_mismatch", "shape_mismatch", "index_mismatch")
SKIP = ("only_a", "not_read", "not_observed")
INT_TYPES = ("i8", "i16", "i32", "i64")

_DERIVED = re.compile(r" \((view|reshaped|permuted|transposed|cont|copy( of .*)?)\)$")
_AUTO = re.compile(r"^(node|leaf)_\d+( |$)")


# ----------------------------------------------------------------------------------------------
# Numbers
# ----------------------------------------------------------------------------------------------
def is_named(name: str) -> bool:
    """A name the graph builder gave (`attn_norm-0`), not ggml's `node_12` or `x (reshaped)`."""
    return bool(name) and not _AUTO.match(name) and not _DERIVED.search(name)


def nmse(a: np.ndarray, b: np.ndarray) -> float:
    """sum((a-b)^2) / sum(a^2) in float64; 0 when both are all zero, inf when only a is."""
    a64 = np.asarray(a, dtype=np.float64).reshape(-1)
    b64 = np.asarray(b, dtype=np.float64).reshape(-1)
    err = float(np.sum((a64 - b64) ** 2))
    ref = float(np.sum(a64 * a64))
    if ref == 0.0:
        return 0.0 if err == 0.0 else math.inf
    return err / ref


def kl_divergence(logits_a: np.ndarray, logits_b: np.ndarray) -> np.ndarray:
    """KL(softmax(a) || softmax(b)) per row, in nats."""
    la, lb = log_softmax(logits_a), log_softmax(logits_b)
    return np.sum(np.exp(la) * (la - lb), axis=-1)


@dataclass
class NodeDiff:
    status: str
    nmse: float | None = None
    max_abs_err: float | None = None
    n_diff: int | None = None
    note: str | None = None


def compare_top_k(a: np.ndarray | None, b: np.ndarray | None, scores: np.ndarray | None,
                  score_error: float | None) -> NodeDiff:
    """A TOP_K node's indices: per row the same set, but for indices whose score (side a's source
    values, when read) lies within twice the source's largest error (`score_error`, 0 when not
    compared) of the row's k-th largest score, which either side may take in a tie."""
    if a is None or b is None:
        return NodeDiff("not_read", note="unallocated: not read")
    if a.shape != b.shape:
        return NodeDiff("shape_mismatch", note=f"shapes {a.shape} vs {b.shape}")
    k = a.shape[-1]
    rows_a, rows_b = a.reshape(-1, k), b.reshape(-1, k)
    if scores is not None and (scores.size % rows_a.shape[0] or scores.size // rows_a.shape[0] < k):
        scores = None                                  # not laid out as this node's rows: sets only
    rows_s = None if scores is None else np.asarray(scores, dtype=np.float64).reshape(rows_a.shape[0], -1)
    tolerance = 2 * (score_error or 0.0)
    n_diff = reordered = 0
    for i, (ra, rb) in enumerate(zip(rows_a.tolist(), rows_b.tolist())):
        differ = set(ra) ^ set(rb)
        if not differ:
            reordered += ra != rb
            continue
        if rows_s is not None:
            row = rows_s[i]
            kth = np.partition(row, row.size - k)[row.size - k]
            if all(0 <= j < row.size and abs(row[j] - kth) <= tolerance for j in differ):
                reordered += 1
                continue
        n_diff += 1
    if n_diff:
        return NodeDiff("index_mismatch", n_diff=n_diff, note=f"{n_diff} of {rows_a.shape[0]} rows chose other indices")
    return NodeDiff("ok", n_diff=0, note=f"{reordered} of {rows_a.shape[0]} rows in another order or tie"
                    if reordered else None)


def compare_arrays(a: np.ndarray | None, b: np.ndarray | None, type_name: str, limit: float) -> NodeDiff:
    """One node's verdict (see the module docstring for the rules)."""
    if a is None or b is None:
        return NodeDiff("not_read", note="quantised or unallocated: not read")
    if a.shape != b.shape:
        return NodeDiff("shape_mismatch", note=f"shapes {a.shape} vs {b.shape}")
    if type_name in INT_TYPES:
        n_diff = int(np.count_nonzero(a != b))
        return NodeDiff("index_mismatch" if n_diff else "ok", n_diff=n_diff,
                        note=f"{n_diff} of {a.size} elements differ" if n_diff else None)
    a64 = np.asarray(a, dtype=np.float64)
    b64 = np.asarray(b, dtype=np.float64)
    nan_a, nan_b = int(np.isnan(a64).sum()), int(np.isnan(b64).sum())
    if nan_a or nan_b:
        return NodeDiff("nan", nmse=math.nan, note=f"NaN: {nan_a} in a, {nan_b} in b")
    inf_a, inf_b = np.isinf(a64), np.isinf(b64)
    finite = ~(inf_a | inf_b)
    if (inf_a != inf_b).any() or (np.sign(a64[inf_a]) != np.sign(b64[inf_a])).any():
        n = int((inf_a != inf_b).sum())
        return NodeDiff("inf_mismatch", note=f"infinities differ ({int(inf_a.sum())} in a, {int(inf_b.sum())} in b, "
                                             f"{n} places)")
    e = nmse(a64[finite], b64[finite])
    mae = float(np.max(np.abs(a64[finite] - b64[finite]))) if finite.any() else 0.0
    return NodeDiff("exceeds" if not e <= limit else "ok", nmse=e, max_abs_err=mae)


# ----------------------------------------------------------------------------------------------
# Sides
# ----------------------------------------------------------------------------------------------
@dataclass
class Side:
    """What one side runs: a model file on a backend with a delta-net kernel."""

    model: Path
    backend: str = "cpu"
    delta_net: str = "fused"
    gpu_layers: int | None = None
    label: str = "a"


@dataclass
class GraphCapture:
    """One graph's nodes (from graph_dump) and the arrays recorded for them, by node id."""

    name: str
    n_tokens: int
    n_past: int
    nodes: list[Any]          # graph_dump.TensorRecord
    leafs: list[Any]
    arrays: dict[str, np.ndarray]
    n_splits: int


@dataclass
class SideRun:
    side: Side
    device: str
    placement: str
    weight_types: dict[str, int]
    prompt_logits: np.ndarray          # [n_prompt, vocab]
    step_logits: list[np.ndarray]      # [vocab] after each greedy token
    greedy: list[int]
    graphs: list[GraphCapture] = field(default_factory=list)
    n_vocab: int = 0


def weight_types(tensors: Any) -> dict[str, int]:
    """{ggml type: number of tensors} of some weight tensors, most common first."""
    from deltarun.base.ggml_util import ggml

    counts: Counter[str] = Counter()
    for t in tensors:
        counts[ggml.ggml_type_name(t.contents.type).decode()] += 1
    return dict(counts.most_common())


def _capture(model: Model, tokens: list[int], name: str, decode: bool) -> GraphCapture:
    from deltarun.apps import graph_dump as gd

    dump, arrays = gd.capture_values(model, tokens, decode=decode, all_outputs=not decode, keep_arrays=True,
                                     n_first=0)
    n_past = len(tokens) - 1 if decode else 0
    return GraphCapture(name=name, n_tokens=1 if decode else len(tokens), n_past=n_past, nodes=dump.nodes,
                        leafs=dump.leafs, arrays=arrays, n_splits=int(dump.summary["n_splits"]))


def run_side(side: Side, tokens: list[int], steps: int, *, decode_token: int | None = None,
             n_threads: int | None = None, kv_type: str = "f32", n_ctx: int | None = None,
             progress: Callable[[str], None] | None = None) -> SideRun:
    """Plain runs (logits, greedy continuation), then the recorded prefill and decode graphs."""
    from deltarun.runner.model import Model

    say = progress or (lambda s: None)
    ctx = n_ctx or (len(tokens) + steps + 1)
    if len(tokens) + max(steps, 1) > ctx:
        raise DeltarunError(f"--ctx {ctx} is too small for {len(tokens)} prompt tokens and {steps} decode steps")
    with Model(side.model, backend=side.backend, n_ctx=ctx, n_ubatch=max(len(tokens), 1), n_threads=n_threads,
               kv_type=kv_type, delta_net=side.delta_net, gpu_layers=side.gpu_layers,
               ssm_slots_in_place=False) as m:
        # the graph every backend builds: on the CPU the delta net could write its snapshots into
        # the cache itself and leave its own output's snapshot rows unwritten (not comparable)
        bad = [t for t in tokens if not 0 <= t < m.hp.n_vocab]
        if bad:
            raise DeltarunError(f"token {bad[0]} is outside the vocabulary of {side.model}")
        say(f"side {side.label}: {side.model.name} on {m.backend.description}: logits and {steps} greedy steps")
        m.reset()
        prompt_logits = np.array(m.eval(tokens, all_logits=True), dtype=np.float32)
        greedy: list[int] = []
        step_logits: list[np.ndarray] = []
        logits = prompt_logits[-1]
        for _ in range(steps):
            tok = int(np.argmax(logits))
            greedy.append(tok)
            logits = np.array(m.eval([tok]), dtype=np.float32)
            step_logits.append(logits)
        run = SideRun(side=side, device=m.backend.description, placement=m.placement.describe(),
                      weight_types=weight_types(m.weights.tensors.values()), prompt_logits=prompt_logits, step_logits=step_logits,
                      greedy=greedy, n_vocab=m.hp.n_vocab)
        say(f"side {side.label}: recording the prefill graph ({len(tokens)} tokens)")
        run.graphs.append(_capture(m, tokens, "prefill", decode=False))
        if steps > 0:
            tok = greedy[0] if decode_token is None else decode_token
            say(f"side {side.label}: recording the decode graph (token {tok})")
            run.graphs.append(_capture(m, list(tokens) + [tok], "decode", decode=True))
    return run


# ----------------------------------------------------------------------------------------------
# Comparing
# ----------------------------------------------------------------------------------------------
def _limits(g: GraphCapture) -> dict[str, float]:
    """Limit per node id: max(DEFAULT, own op limit, limits of the node inputs; memory if decode)."""
    memory_limit = MATMUL_LIMIT if g.n_past > 0 else 0.0
    inherited: dict[str, float] = {r.id: (memory_limit if r.is_memory else 0.0) for r in g.leafs}
    out: dict[str, float] = {}
    for r in g.nodes:
        lim = max(DEFAULT_LIMIT, OP_LIMITS.get(r.op, 0.0))
        for s in r.src_ids + ([r.view_of_id] if r.view_of_id else []):
            lim = max(lim, inherited.get(s, 0.0))
        if r.is_memory:
            lim = max(lim, memory_limit)
        inherited[r.id] = out[r.id] = lim
    return out


def _same_structure(a: GraphCapture, b: GraphCapture) -> bool:
    """Same nodes in the same order (sources are not compared: with a device, the scheduler points
    some of them at its copies of inputs that live on another backend)."""
    if len(a.nodes) != len(b.nodes):
        return False
    return all(x.op == y.op and x.name == y.name and x.ne == y.ne and x.type == y.type
               for x, y in zip(a.nodes, b.nodes))


def _keyed(nodes: list[Any]) -> dict[str, Any]:
    seen: Counter[str] = Counter()
    out = {}
    for r in nodes:
        if not is_named(r.name):
            continue
        out[f"{r.name}#{seen[r.name]}"] = r
        seen[r.name] += 1
    return out


def _leaf_kind(r: Any) -> str:
    if r.is_weight:
        return "weight"
    if r.is_memory:
        return "memory"
    if r.is_input:
        return "input"
    return "leaf"


def _num(x: float | None) -> Any:
    if x is None:
        return None
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf"
    return x


def compare_graph(a: GraphCapture, b: GraphCapture) -> dict[str, Any]:
    """Node-by-node verdicts of one graph (see the JSON schema)."""
    by_index = _same_structure(a, b)
    limits = _limits(a)
    if by_index:
        pairs = [(x, y) for x, y in zip(a.nodes, b.nodes)]
        only_a: list[str] = []
        only_b: list[str] = []
    else:
        ka, kb = _keyed(a.nodes), _keyed(b.nodes)
        pairs = [(x, kb.get(k)) for k, x in ka.items()]
        only_a = [x.name for k, x in ka.items() if k not in kb]
        only_b = [y.name for k, y in kb.items() if k not in ka]
    leafs = {r.id: r for r in a.leafs}
    names = {r.id: r for r in a.nodes}
    results: dict[str, dict[str, Any]] = {}
    rows = []
    for x, y in pairs:
        limit = limits[x.id]
        row: dict[str, Any] = {"index": x.index, "id": x.id, "name": x.name, "op": x.op, "type": x.type,
                               "ne": list(x.ne), "named": is_named(x.name), "layer": x.layer, "backend_a": x.backend,
                               "backend_b": y.backend if y is not None else None, "limit": limit}
        if y is None:
            d = NodeDiff("only_a", note="no node of this name on side b")
        elif not (x.values and x.values.observed) or not (y.values and y.values.observed):
            d = NodeDiff("not_observed", note="the scheduler did not show it to the eval callback")
        elif x.op == "TOP_K":
            src = x.src_ids[0] if x.src_ids else None
            d = compare_top_k(a.arrays.get(x.id), b.arrays.get(y.id), a.arrays.get(src),
                              (results.get(src) or {}).get("max_abs_err"))
        else:
            d = compare_arrays(a.arrays.get(x.id), b.arrays.get(y.id), x.type, limit)
        row.update({"status": d.status, "nmse": _num(d.nmse), "max_abs_err": d.max_abs_err, "n_diff": d.n_diff,
                    "note": d.note})
        results[x.id] = row
        rows.append(row)
    for row in rows:  # inputs' errors, once every node has its verdict
        x = names[row["id"]]
        inputs = []
        for s, sname in zip(x.src_ids, x.src):
            if s in results:
                inputs.append({"name": sname, "id": s, "kind": "node", "nmse": results[s]["nmse"],
                               "status": results[s]["status"]})
            elif s in leafs:
                inputs.append({"name": sname, "id": s, "kind": _leaf_kind(leafs[s]), "nmse": None, "status": None})
            else:
                inputs.append({"name": sname, "id": s, "kind": "node", "nmse": None, "status": "not_compared"})
        row["inputs"] = inputs
    failed = [r for r in rows if r["status"] in FAIL]
    return {
        "graph": a.name, "n_tokens": a.n_tokens, "n_past": a.n_past, "matched_by": "index" if by_index else "name",
        "n_nodes_a": len(a.nodes), "n_nodes_b": len(b.nodes),
        "n_compared": sum(1 for r in rows if r["status"] not in SKIP),
        "n_failed": len(failed), "n_skipped": sum(1 for r in rows if r["status"] in SKIP) + len(only_b),
        "only_a": only_a, "only_b": only_b,
        "first_failure": failed[0] if failed else None,
        "nodes": rows,
    }


def compare_logits(ra: SideRun, rb: SideRun) -> tuple[dict[str, Any], dict[str, Any]]:
    """Logits metrics over the prompt and the agreeing decode steps, and the greedy verdict."""
    steps = len(ra.greedy)
    diverge = next((i for i, (x, y) in enumerate(zip(ra.greedy, rb.greedy)) if x != y), None)
    # decode step s's logits follow tokens greedy[0..s]: comparable while those agree
    n_same = steps if diverge is None else diverge
    la = np.concatenate([ra.prompt_logits] + [x[None] for x in ra.step_logits[:n_same]])
    lb = np.concatenate([rb.prompt_logits] + [x[None] for x in rb.step_logits[:n_same]])
    nan = bool(np.isnan(la).any() or np.isnan(lb).any())
    if nan:
        per_pos = [math.nan] * len(la)
        total, kl = math.nan, np.full(len(la), math.nan)
    else:
        per_pos = [nmse(x, y) for x, y in zip(la, lb)]
        total = nmse(la, lb)
        kl = kl_divergence(la, lb)
    top1 = [bool(x) for x in np.argmax(la, axis=-1) == np.argmax(lb, axis=-1)]
    status = "nan" if nan else ("ok" if total <= LOGITS_LIMIT else "exceeds")
    logits = {"n_positions": int(len(la)), "n_prompt": int(len(ra.prompt_logits)), "nmse": _num(total),
              "limit": LOGITS_LIMIT, "max_position_nmse": _num(max(per_pos)) if per_pos else None,
              "position_nmse": [_num(x) for x in per_pos],
              "top1_agreement": sum(top1) / len(top1) if top1 else 1.0, "top1": top1,
              "kl_mean": _num(float(np.mean(kl))) if len(kl) else None,
              "kl_max": _num(float(np.max(kl))) if len(kl) else None,
              "kl": [_num(float(x)) for x in kl], "nan": nan, "status": status}
    greedy = {"steps": steps, "a": list(ra.greedy), "b": list(rb.greedy), "match": diverge is None,
              "first_divergence": diverge}
    return logits, greedy


def _side_dict(r: SideRun) -> dict[str, Any]:
    s = r.side
    splits = {g.name: g.n_splits for g in r.graphs}
    return {"label": s.label, "model": str(s.model), "backend": s.backend, "device": r.device,
            "delta_net": s.delta_net, "gpu_layers": s.gpu_layers, "placement": r.placement,
            "weight_types": r.weight_types, "n_splits": {"prefill": splits.get("prefill"),
                                                         "decode": splits.get("decode")}}


def compare(a: Side, b: Side, tokens: list[int], steps: int = 8, *, prompt_text: str | None = None,
            n_threads: int | None = None, kv_type: str = "f32", n_ctx: int | None = None,
            progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run both sides and return the report (the JSON object described in the module docstring)."""
    if not tokens:
        raise DeltarunError("the prompt has no tokens")
    a.label, b.label = "a", "b"
    ra = run_side(a, tokens, steps, n_threads=n_threads, kv_type=kv_type, n_ctx=n_ctx, progress=progress)
    decode_token = ra.greedy[0] if ra.greedy else None
    rb = run_side(b, tokens, steps, decode_token=decode_token, n_threads=n_threads, kv_type=kv_type, n_ctx=n_ctx,
                  progress=progress)
    if ra.n_vocab != rb.n_vocab:
        raise DeltarunError(f"the two models have different vocabularies ({ra.n_vocab} and {rb.n_vocab} tokens)")
    graphs = [compare_graph(ga, gb) for ga, gb in zip(ra.graphs, rb.graphs)]
    logits, greedy = compare_logits(ra, rb)
    failures = []
    for g in graphs:
        if g["n_failed"]:
            f = g["first_failure"]
            failures.append(f"{g['graph']}: {g['n_failed']} node(s) exceed their limits; first {f['name']} "
                            f"({f['op']}): {_describe(f)}")
    if logits["status"] != "ok":
        failures.append(f"logits: NMSE {_fmt(logits['nmse'])} exceeds {LOGITS_LIMIT:g}"
                        if logits["status"] == "exceeds" else "logits: NaN")
    return {
        "schema_version": SCHEMA_VERSION,
        "passed": not failures,
        "failures": failures,
        "sides": [_side_dict(ra), _side_dict(rb)],
        "prompt": {"text": prompt_text, "tokens": [int(t) for t in tokens]},
        "decode_steps": steps,
        "kv_type": kv_type,
        "limits": {"default": DEFAULT_LIMIT, "ops": dict(OP_LIMITS), "logits": LOGITS_LIMIT},
        "graphs": graphs,
        "logits": logits,
        "greedy": greedy,
    }


# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------
def to_json(report: dict[str, Any]) -> str:
    return json.dumps(report, indent=1, allow_nan=False) + "\n"


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, str):
        return x
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if x == 0:
        return "0"
    return f"{x:.3g}"


def _describe(row: dict[str, Any]) -> str:
    if row["status"] == "exceeds":
        return f"NMSE {_fmt(row['nmse'])} > limit {_fmt(row['limit'])}"
    return f"{row['status']}" + (f" ({row['note']})" if row.get("note") else "")


def _inputs_line(row: dict[str, Any]) -> str:
    parts = []
    for i in row.get("inputs", []):
        if i["kind"] == "node":
            err = _fmt(i["nmse"]) if i["status"] not in (None, "not_compared") else "not compared"
            parts.append(f"{i['name']} [{i['id']}] NMSE {err}")
        else:
            parts.append(f"{i['name']} ({i['kind']}, exact)" if i["kind"] in ("weight", "input")
                         else f"{i['name']} ({i['kind']})")
    return "; ".join(parts) or "-"


def graph_lines(g: dict[str, Any], sa: dict[str, Any], sb: dict[str, Any], show: str = "named") -> list[str]:
    """One compared graph as text lines: its summary, the node table (`show` as in `to_text`), the
    first node over its limit with its inputs' errors."""
    out: list[str] = []
    sp = f"splits a {sa['n_splits'].get(g['graph'])}, b {sb['n_splits'].get(g['graph'])}"
    out.append(f"{g['graph']} graph ({g['n_tokens']} token(s) after {g['n_past']}): nodes a {g['n_nodes_a']}, "
               f"b {g['n_nodes_b']}, matched by {g['matched_by']}; compared {g['n_compared']}, "
               f"failed {g['n_failed']}, skipped {g['n_skipped']}; {sp}")
    if g["only_a"] or g["only_b"]:
        out.append(f"  only on a: {len(g['only_a'])} named nodes; only on b: {len(g['only_b'])} "
                   f"(skipped; e.g. {', '.join((g['only_a'] + g['only_b'])[:4])})")
    rows = []
    for r in g["nodes"]:
        if show == "named" and not r["named"]:
            continue
        if show == "failures" and r["status"] not in FAIL:
            continue
        where = r["backend_b"] or "-"
        if r["backend_a"] and r["backend_a"] != r["backend_b"]:
            where = f"{r['backend_a'] or '-'}/{where}"
        rows.append([r["id"], r["name"], r["op"], where, _fmt(r["nmse"]), _fmt(r["limit"]),
                     _fmt(r["max_abs_err"]), r["status"] if r["status"] != "index_mismatch" else
                     f"index_mismatch ({r['n_diff']})"])
    if rows:
        out.extend(format_table(["id", "name", "op", "ran on", "nmse", "limit", "max|a-b|", "status"], rows))
    f = g["first_failure"]
    if f is not None:
        out.append(f"  FIRST EXCEEDING NODE: {f['id']} {f['name']} ({f['op']}, {f['type']} {f['ne']}): {_describe(f)}")
        out.append(f"    inputs: {_inputs_line(f)}")
    else:
        out.append("  every compared node is within its limit")
    return out


def to_text(report: dict[str, Any], show: str = "named") -> str:
    """The report as text; `show`: named (named nodes), all (every node), failures (failed nodes only)."""
    out: list[str] = []
    sa, sb = report["sides"]
    for s in (sa, sb):
        gl = "" if s["gpu_layers"] is None else f", --gpu-layers {s['gpu_layers']}"
        types = ", ".join(f"{k} x{v}" for k, v in s["weight_types"].items())
        out.append(f"side {s['label']}: {s['model']} on {s['backend']} = {s['device']}; delta-net {s['delta_net']}"
                   f"{gl}; {s['placement']}; weights {types}")
    toks = report["prompt"]["tokens"]
    out.append(f"prompt: {len(toks)} tokens; decode steps {report['decode_steps']}; KV cache {report['kv_type']}; "
               f"NMSE = sum((a-b)^2)/sum(a^2); limits: default {DEFAULT_LIMIT:g}, "
               + ", ".join(f"{k} {v:g}" for k, v in OP_LIMITS.items() if k in ("MUL_MAT", "MUL_MAT_ID",
                                                                               "GATED_DELTA_NET", "SOLVE_TRI"))
               + " and whatever depends on them")
    for g in report["graphs"]:
        out.append("")
        out.extend(graph_lines(g, sa, sb, show))
    lg, gr = report["logits"], report["greedy"]
    out.append("")
    n_top = sum(lg["top1"])
    out.append(f"logits ({lg['n_positions']} positions: {lg['n_prompt']} prompt + "
               f"{lg['n_positions'] - lg['n_prompt']} decode): NMSE {_fmt(lg['nmse'])} (limit {lg['limit']:g}, "
               f"worst position {_fmt(lg['max_position_nmse'])}) -> {lg['status']}")
    miss = [i for i, ok in enumerate(lg["top1"]) if not ok]
    out.append(f"  top-1 agreement {n_top}/{len(lg['top1'])}" + (f" (differs at positions {miss[:10]})" if miss else ""))
    out.append(f"  KL(a||b) mean {_fmt(lg['kl_mean'])}, max {_fmt(lg['kl_max'])} nats")
    verdict = "match" if gr["match"] else f"DIFFER from step {gr['first_divergence']}"
    out.append(f"greedy continuation ({gr['steps']} steps): {verdict}")
    out.append(f"  a: {gr['a']}")
    out.append(f"  b: {gr['b']}")
    out.append("")
    if report["passed"]:
        out.append("PASS: every node and the logits are within their limits")
    elif report["sides"][0]["model"] != report["sides"][1]["model"]:
        out.append("OVER THE LIMITS, as two weight files are (the logits metrics above are the result):")
    else:
        out.append("FAIL:")
        out.extend(f"  {f}" for f in report["failures"])
    return "\n".join(out) + "\n"
