"""qwen3next's graphs, pinned node for node.

The graph layer is shared by several families (see deltarun/graphs/); a change there must not
move one node of the qwen3next graphs by accident. `tests/data/graph_pin_qwen3next.json.gz`
records, for the synthetic presets tiny, tiny-legacy, tiny-tied and tiny-mtp (F32) and the
ubatch shapes below, every node in execution order: op, name, type, ne, nb, view offset, op
parameters and its sources (node index, or the name of a leaf: weight, memory, graph input).
The fixture was written from the graph code before the family redesign; regenerate it only for
an intended change of the qwen3next graph, with

    python tests/test_graph_pin.py --write
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

FIXTURE = Path(__file__).parent / "data" / "graph_pin_qwen3next.json.gz"

#: (case name, preset, Model options, ubatch: n_seq_tokens, n_seqs, n_past, all_outputs, mtp)
CASES = [
    ("tiny/prefill-fused-K1", "tiny", dict(rs_slots=1), (7, 1, 0, False, False)),
    ("tiny/prefill-fused-K3-all", "tiny", dict(rs_slots=3), (7, 1, 0, True, False)),
    ("tiny/prefill-primitive-70-K3", "tiny", dict(rs_slots=3, delta_net="primitive"), (70, 1, 0, False, False)),
    ("tiny/decode-fused-K3", "tiny", dict(rs_slots=3), (1, 1, 9, False, False)),
    ("tiny/decode-primitive-K1", "tiny", dict(rs_slots=1, delta_net="primitive"), (1, 1, 9, False, False)),
    ("tiny/two-seqs-K3", "tiny", dict(rs_slots=3, n_seq_max=2), (4, 2, 0, False, False)),
    ("tiny/two-seqs-decode-K1", "tiny", dict(rs_slots=1, n_seq_max=2), (1, 2, 5, False, False)),
    ("tiny-legacy/prefill-fused-K3", "tiny-legacy", dict(rs_slots=3), (5, 1, 0, False, False)),
    ("tiny-legacy/decode-primitive-K3", "tiny-legacy", dict(rs_slots=3, delta_net="primitive"),
     (1, 1, 4, False, False)),
    ("tiny-tied/prefill-fused-K1", "tiny-tied", dict(rs_slots=1), (6, 1, 0, False, False)),
    ("tiny-tied/decode-fused-K3", "tiny-tied", dict(rs_slots=3), (1, 1, 6, False, False)),
    ("tiny-mtp/prefill-fused-K3", "tiny-mtp", dict(rs_slots=3, mtp=True), (5, 1, 0, True, False)),
    ("tiny-mtp/mtp-1", "tiny-mtp", dict(rs_slots=3, mtp=True), (1, 1, 5, False, True)),
    ("tiny-mtp/mtp-3", "tiny-mtp", dict(rs_slots=3, mtp=True), (3, 1, 5, False, True)),
]


def _dump_nodes(model, n_seq_tokens: int, n_seqs: int, n_past: int, all_outputs: bool, mtp: bool) -> list[str]:
    """One line per node: op|name|type|ne|nb|offs|params|sources (n<i> for a node, a leaf by name)."""
    import dataclasses

    from deltarun.apps import graph_dump as gd

    shape = gd.ubatch_shape(model, n_seq_tokens, n_seqs, n_past, all_outputs)
    if mtp:
        shape = dataclasses.replace(shape, mtp=True, n_outputs=n_seq_tokens * n_seqs)
    dump = gd.dump_graph(model, shape)
    leaf_names = {r.id: r.name for r in dump.leafs}
    lines = []
    for r in dump.nodes:
        t = dump.tensors[r.id]
        params = list(t.contents.op_params)
        while params and params[-1] == 0:
            params.pop()
        srcs = ",".join(s if s.startswith("n") else "L:" + leaf_names[s] for s in r.src_ids)
        view = r.view_of_id if r.view_of_id and r.view_of_id.startswith("n") else (
            "L:" + leaf_names[r.view_of_id] if r.view_of_id else "")
        lines.append(f"{r.op}|{r.name}|{r.type}|{r.ne}|{r.nb}|{view}@{r.view_offs}|{params}|{srcs}")
    return lines


def dump_all(tmp: Path) -> dict[str, list[str]]:
    from deltarun.model_files import generate as gen
    from deltarun.runner.model import Model

    files: dict[str, Path] = {}
    out: dict[str, list[str]] = {}
    for name, preset, opts, ub in CASES:
        if preset not in files:
            files[preset] = gen.write_model(tmp / f"{preset}-f32.gguf", preset, "f32")
        # the graph every backend builds (pinned); the CPU's variant whose delta net writes the
        # snapshots into the cache itself: tests/test_delta_net_slots_in_place.py
        with Model(files[preset], n_ctx=512, n_ubatch=128, kv_type="f32", ssm_slots_in_place=False, **opts) as model:
            out[name] = _dump_nodes(model, *ub)
    return out


def test_qwen3next_graphs_unchanged(tmp_path: Path) -> None:
    want = json.loads(gzip.decompress(FIXTURE.read_bytes()))
    got = dump_all(tmp_path)
    assert sorted(got) == sorted(want)
    for case, lines in want.items():
        now = got[case]
        for i, (a, b) in enumerate(zip(lines, now)):
            assert a == b, f"{case}: node {i} differs:\n  pinned {a}\n  now    {b}"
        assert len(now) == len(lines), f"{case}: {len(now)} nodes, pinned {len(lines)}"


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/test_graph_pin.py --write")
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        data = dump_all(Path(d))
    FIXTURE.parent.mkdir(exist_ok=True)
    FIXTURE.write_bytes(gzip.compress(json.dumps(data, indent=0).encode(), mtime=0))
    print(f"wrote {FIXTURE}: {sum(map(len, data.values()))} nodes in {len(data)} graphs")
