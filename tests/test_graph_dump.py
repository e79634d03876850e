"""`deltarun graph`: graph dumps of the runner's own graphs, and values checked against the reference.

Tolerances of the value checks (tiny model, F32 weights, F32 KV cache so that only float32
arithmetic separates ggml from the float64 reference):
- `inp_embd` is get_rows of F32 embedding rows: the same numbers, so the statistics agree exactly
  (checked to 1e-12 relative, i.e. only float64 summation noise).
- Every other node: |stat_ggml - stat_ref| <= 1e-5 * rms_ref for min/max/mean/rms, and elementwise
  max |ggml - ref| <= 1e-5 * max |ref| for the dumped arrays. Measured on x86-64: <= 3.4e-7 (attn_norm-0
  2e-7, result_output 2e-7 after 4 layers), the same size as test_forward's logits error (7.4e-7);
  1e-5 leaves room for another summation order / SIMD width, while an F16 KV cache (2e-5) or any
  wrong value would fail it.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from deltarun.cli.main import cli
from deltarun.model_files import generate as gen
from deltarun.apps import graph_dump as gd

from reference import ReferenceModel, rmsnorm

CFG = gen.PRESETS["tiny"]
DC1 = CFG.ssm_d_conv - 1
CHANNELS = 2 * CFG.key_dim + CFG.value_dim
LINEAR = [il for il, rec in enumerate(CFG.recurrent) if rec]
PROMPT = "Hello world, this is a graph dump"
REL_TOL = 1e-5


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gen.write_model(tmp_path_factory.mktemp("graph") / "tiny-f32.gguf", "tiny", "f32")


def run(*args: object, ok: bool = True):
    result = CliRunner().invoke(cli, ["graph", *map(str, args)])
    if ok:
        assert result.exit_code == 0, (result.output, result.exception)
    return result


def run_json(*args: object) -> dict:
    return json.loads(run(*args, "--format", "json").stdout, parse_constant=_no_constant)


def _no_constant(name: str) -> None:
    raise AssertionError(f"non-standard JSON constant {name}")


def by_id(d: dict) -> dict[str, dict]:
    return {t["id"]: t for t in d["nodes"] + d["leafs"]}


# --- the rollback-slot conv-state write ---------------------------------------------------------
@pytest.mark.parametrize("tokens,k,seqs", [(t, k, 1) for t in (1, 2, 5) for k in (1, 3)] + [(2, 3, 2), (5, 3, 3)])
def test_conv_state_store_is_one_set_rows_per_linear_layer(model_path: Path, tokens: int, k: int, seqs: int) -> None:
    d = run_json(model_path, "--tokens", tokens, "--rs-slots", k, "--seqs", seqs)
    t = by_id(d)
    kw = min(tokens + 1, k)
    assert d["schema_version"] == gd.SCHEMA_VERSION
    assert d["shape"]["n_seq_tokens"] == tokens and d["shape"]["rs_slots"] == k and d["shape"]["n_seqs"] == seqs

    slot_rev = [x for x in d["leafs"] if x["name"] == "rs_s_slot_rev"]
    assert len(slot_rev) == 1
    assert slot_rev[0]["is_input"] and slot_rev[0]["type"] == "i32" and slot_rev[0]["ne"][0] == kw

    set_rows = [n for n in d["nodes"] if n["op"] == "SET_ROWS"]
    for il in LINEAR:
        cache = f"cache_r_l{il}"
        stores = [n for n in set_rows if n["view_of"] == cache]
        assert len(stores) == 1, f"layer {il}: {len(stores)} set_rows into {cache}"
        store = stores[0]
        assert store["name"] == f"conv_state_store-{il}" and store["layer"] == il
        src, idx, dst = (t[i] for i in store["src_ids"])
        # source: Kw windows of d_conv-1 columns overlapping by d_conv-2 (row stride one element)
        assert src["name"] == f"conv_state_windows-{il}" and src["view_of"] == f"conv_input-{il}"
        assert src["ne"] == [DC1, kw, CHANNELS, seqs] and src["nb"][0] == 4 and src["nb"][1] == 4
        assert not src["contiguous"]
        assert idx["name"] == "rs_s_slot_rev"
        # destination: the 4D view [d_conv-1, K, channels, n_seqs] of this ubatch's conv-cache cells
        assert dst["view_of"] == cache and t[dst["view_of_id"]]["is_memory"]
        assert dst["ne"] == [DC1, k, CHANNELS, seqs] and dst["nb"][:3] == [4, 4 * DC1, 4 * DC1 * k]
        assert store["ne"] == dst["ne"] and store["backend"] == "CPU"
    # the other set_rows are the K and V stores of the full-attention layers
    n_attn = len(CFG.recurrent) - len(LINEAR)
    assert len(set_rows) == len(LINEAR) + 2 * n_attn


def test_decode_graph(model_path: Path) -> None:
    d = run_json(model_path, "--decode", "--past", 300, "--rs-slots", 3)
    sh = d["shape"]
    assert (sh["n_seq_tokens"], sh["n_outputs"], sh["n_past"], sh["n_kv"], sh["decode"]) == (1, 1, 300, 512, True)
    kq_mask = next(x for x in d["leafs"] if x["name"] == "kq_mask")
    assert kq_mask["ne"][:2] == [512, 1]
    assert not [x for x in d["leafs"] if x["name"] == "inp_out_ids"]  # one token, one output row
    assert next(x for x in d["leafs"] if x["name"] == "rs_s_slot_rev")["ne"][0] == 2


def test_seqs_need_cells_and_flags_are_marked(model_path: Path) -> None:
    d = run_json(model_path, "--tokens", 3)
    leafs = {x["name"]: x for x in d["leafs"]}
    assert leafs["token_embd.weight"]["is_weight"] and not leafs["token_embd.weight"]["is_input"]
    assert leafs["inp_tokens"]["is_input"] and not leafs["inp_tokens"]["is_weight"]
    assert leafs["cache_r_l0"]["is_memory"] and leafs["cache_k_l3"]["is_memory"]
    out = [n for n in d["nodes"] if n["is_output"]]
    assert sorted(n["name"] for n in out) == ["result_norm", "result_output"]   # hidden state kept for MTP
    s = d["summary"]
    assert s["n_nodes"] == len(d["nodes"]) and sum(s["ops"].values()) == s["n_nodes"]
    assert s["n_splits"] >= 1 and s["compute_buffer_bytes"]["CPU"] > 0
    assert s["weight_bytes"]["CPU"] == s["model_weight_bytes"]  # every weight of the tiny model is read
    assert all(n["backend"] == "CPU" for n in d["nodes"])


# --- json and txt agree -------------------------------------------------------------------------
def parse_txt_tables(text: str) -> dict[str, list[dict[str, str]]]:
    """The `nodes` and `leafs` tables of the txt format, by column (cells cut at the header's offsets)."""
    lines = text.splitlines()
    tables: dict[str, list[dict[str, str]]] = {}
    i = 0
    while i < len(lines):
        m = re.match(r"^(nodes|leafs) \(", lines[i])
        if not m:
            i += 1
            continue
        header = lines[i + 1]
        cols = [(mm.group(), mm.start()) for mm in re.finditer(r"\S+", header)]
        rows = []
        i += 2
        while i < len(lines) and lines[i].strip():
            row = lines[i]
            cells = {}
            for j, (name, start) in enumerate(cols):
                end = cols[j + 1][1] if j + 1 < len(cols) else len(row)
                cells[name] = row[start:end].rstrip()
            rows.append(cells)
            i += 1
        tables[m.group(1)] = rows
    return tables


def fmt_dims(v: list[int]) -> str:
    return "[" + ", ".join(map(str, v)) + "]"


@pytest.mark.parametrize("extra", [[], ["--layer", "1"], ["--delta-net", "primitive", "--tokens", "3"]])
def test_json_round_trips_and_matches_txt(model_path: Path, extra: list[str]) -> None:
    args = [model_path, "--tokens", 4, "--rs-slots", 2, *extra]
    txt = run(*args).stdout
    d = run_json(*args)
    assert json.loads(json.dumps(d)) == d
    tables = parse_txt_tables(txt)
    for kind in ("nodes", "leafs"):
        rows = tables[kind]
        assert [r["id"] for r in rows] == [x["id"] for x in d[kind]]
        for row, x in zip(rows, d[kind]):
            assert row["name"] == x["name"] and row["op"] == x["op"] and row["type"] == x["type"]
            assert row["ne"] == fmt_dims(x["ne"]) and row["nb"] == fmt_dims(x["nb"])
            assert row["backend"] == (x["backend"] or x["buffer"])
            flags = row["flags"]
            assert ("I" in flags, "O" in flags, "W" in flags, "M" in flags) == (
                x["is_input"], x["is_output"], x["is_weight"], x["is_memory"])
            if kind == "nodes":
                assert row["view_of"] == (x["view_of"] or "-")
                assert row["src"] == (", ".join(x["src"]) or "-")
    s = d["summary"]
    assert f"nodes {s['n_nodes']}, leafs {s['n_leafs']}, graph splits {s['n_splits']}" in txt
    assert f"nodes ({len(d['nodes'])} of {s['n_nodes']})" in txt


# --- --layer ------------------------------------------------------------------------------------
def test_layer_filter_keeps_one_layer_and_its_direct_sources(model_path: Path) -> None:
    full = run_json(model_path, "--tokens", 3)
    one = run_json(model_path, "--tokens", 3, "--layer", 1)
    assert one["filter"]["layer"] == 1 and full["summary"]["n_nodes"] == one["summary"]["n_nodes"]
    in_layer = [n for n in full["nodes"] if n["layer"] == 1]
    # every node named `...-1` is in layer 1, and nothing named for another layer is
    assert {n["name"] for n in full["nodes"] if re.search(r"-1$", n["name"])} <= {n["name"] for n in in_layer}
    assert not [n for n in in_layer if re.search(r"-(\d+)$", n["name"]) and not n["name"].endswith("-1")]
    expected = {n["id"] for n in in_layer}
    for n in in_layer:
        expected.update(n["src_ids"])
        if n["view_of_id"]:
            expected.add(n["view_of_id"])
    kept = {x["id"] for x in one["nodes"] + one["leafs"]}
    assert kept == expected
    assert one["summary"]["n_nodes_shown"] == len(one["nodes"]) < len(full["nodes"])
    names = {x["name"] for x in one["nodes"] + one["leafs"]}
    assert {"attn_norm-1", "conv_state_store-1", "l_out-1", "rs_s_slot_rev", "cache_r_l1"} <= names
    assert "l_out-0" in names                       # a direct source from the layer before
    assert not {x for x in names if x.startswith("blk.0.") or x.startswith("blk.2.")}
    assert "conv_state_store-0" not in names and "attn_norm-2" not in names

    bad = run(model_path, "--layer", 40, ok=False)
    assert bad.exit_code != 0 and "layer 40" in bad.output and "Traceback" not in bad.output


# --- dot / svg ----------------------------------------------------------------------------------
def test_dot_styles_weights_and_inputs_apart(model_path: Path) -> None:
    dot = run(model_path, "--tokens", 2, "--layer", 0, "--format", "dot").stdout
    assert dot.startswith("digraph") and dot.rstrip().endswith("}")
    lines = dot.splitlines()
    weight = next(line for line in lines if '"blk.0.attn_qkv.weight\\n' in line)
    inp = next(line for line in lines if '"rs_s_slot_rev\\n' in line)
    mem = next(line for line in lines if '"cache_r_l0\\n' in line)
    assert "#fff2cc" in weight and "invhouse" in inp and "cylinder" in mem
    assert len({weight.split("[", 1)[1], inp.split("[", 1)[1]}) == 2
    assert re.search(r"^  l\d+ -> n\d+ ", dot, re.M)


def test_svg_without_graphviz_is_a_clean_error(model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shutil.which", lambda *a, **k: None)
    result = run(model_path, "--format", "svg", ok=False)
    assert result.exit_code != 0
    assert "apt install graphviz" in result.output and "--format dot" in result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output


def test_svg_runs_dot(model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "bin" / "dot"  # a stand-in for graphviz: checks it got dot source, prints svg
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\ngrep -q '^digraph' && echo '<svg>ok</svg>'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    out = tmp_path / "g.svg"
    run(model_path, "--tokens", 2, "--format", "svg", "-o", out)
    assert out.read_text().strip() == "<svg>ok</svg>"


# --- values -------------------------------------------------------------------------------------
VALUE_NODES = ["inp_embd", "attn_norm-0", "conv_state_store-0", "result_norm", "result_output"]


def reference_values(model_path: Path, tokens: list[int]) -> dict[str, np.ndarray]:
    ref = ReferenceModel.from_gguf(model_path)
    logits = ref.forward(tokens)
    w, eps = ref.w, ref.hp.eps
    emb = w["token_embd.weight"][tokens]
    return {
        "inp_embd": emb,
        "attn_norm-0": rmsnorm(emb, eps) * w["blk.0.attn_norm.weight"],
        "conv_state_store-0": ref.conv_state(0),   # K = 1: the slot the set_rows writes is the state
        "result_norm": (rmsnorm(ref.hidden(), eps) * w["output_norm.weight"])[-1:],  # last row only
        "result_output": logits[-1:],
    }


def assert_stats_close(name: str, got: dict, ref: np.ndarray) -> None:
    want = gd.value_stats(ref)
    assert got["observed"] and got["count"] == ref.size and got["n_nan"] == 0 and got["n_inf"] == 0
    tol = 1e-12 if name == "inp_embd" else REL_TOL
    for key in ("min", "max", "mean", "rms"):
        assert abs(got[key] - getattr(want, key)) <= tol * want.rms, (name, key, got[key], getattr(want, key))


@pytest.mark.parametrize("delta_net", ["fused", "primitive"])
def test_values_match_the_numpy_reference(model_path: Path, tmp_path: Path, delta_net: str) -> None:
    dump_dir = tmp_path / "dump"
    args = [model_path, "--values", "-p", PROMPT, "--kv-type", "f32", "--delta-net", delta_net,
            "--dump-dir", dump_dir, *[a for n in VALUE_NODES for a in ("--filter", n)]]
    d = run_json(*args)
    tokens = d["values"]["tokens"]
    assert d["values"]["prompt"] == PROMPT and len(tokens) > 3
    recorded = {n["name"]: n for n in d["nodes"] if "values" in n}
    assert sorted(recorded) == sorted(VALUE_NODES)
    assert d["values"]["n_selected"] == d["values"]["n_observed"] == len(VALUE_NODES)
    refs = reference_values(model_path, tokens)
    for name in VALUE_NODES:
        v = recorded[name]["values"]
        assert_stats_close(name, v, refs[name])
        # first values are in ggml order (ne0 fastest) = numpy order of reversed ne
        if name != "conv_state_store-0":
            np.testing.assert_allclose(v["first"], refs[name].reshape(-1)[: len(v["first"])],
                                       rtol=0, atol=REL_TOL * np.abs(refs[name]).max())

    manifest = json.loads((dump_dir / "manifest.json").read_text())
    assert manifest["schema_version"] == gd.SCHEMA_VERSION and manifest["tokens"] == tokens
    entries = {e["name"]: e for e in manifest["tensors"]}
    assert sorted(entries) == sorted(VALUE_NODES)
    assert not [p for p in dump_dir.iterdir() if p.name.startswith(".")]  # no temp files left
    for name, e in entries.items():
        arr = np.load(dump_dir / e["file"])
        assert list(arr.shape) == e["shape"] and e["type"] == "f32" and e["op"] == recorded[name]["op"]
        assert recorded[name]["values"]["file"] == e["file"]
        ref = refs[name]
        if name == "conv_state_store-0":   # ne [d_conv-1, K=1, channels, 1] -> numpy (1, ch, 1, dc1)
            arr = arr.reshape(CHANNELS, DC1).T
        assert arr.size == ref.size
        arr = arr.reshape(ref.shape)     # numpy shape is reversed ne over ggml_n_dims (trailing 1s dropped)
        assert np.abs(arr - ref).max() <= REL_TOL * np.abs(ref).max()


def test_values_txt_and_decode(model_path: Path) -> None:
    txt = run(model_path, "--values", "-p", PROMPT, "--filter", "re:^result_", "--kv-type", "f32").stdout
    assert re.search(r"^values \(2 nodes; prompt tokens \[", txt, re.M)
    rows = parse_values_rows(txt)
    assert [r[1] for r in rows] == ["result_norm", "result_output"]

    d = run_json(model_path, "--values", "-p", PROMPT, "--decode", "--filter", "result_output",
                 "--kv-type", "f32", "--rs-slots", 2)
    tokens = d["values"]["tokens"]
    assert d["shape"]["n_seq_tokens"] == 1 and d["shape"]["n_past"] == len(tokens) - 1
    got = next(n for n in d["nodes"] if n["name"] == "result_output")["values"]
    ref = ReferenceModel.from_gguf(model_path).forward(tokens)[-1:]
    assert_stats_close("result_output", got, ref)


def parse_values_rows(txt: str) -> list[list[str]]:
    lines = txt.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("values ("))
    return [re.split(r"\s{2,}", line.strip()) for line in lines[start + 2:] if line.strip()]


def test_values_of_every_node_and_two_runs_agree(model_path: Path, tmp_path: Path) -> None:
    from deltarun.runner.model import Model

    with Model(model_path, kv_type="f32", rs_slots=3) as m:
        tokens = m.tokenizer.encode(PROMPT)
        first, arrays = gd.capture_values(m, tokens, keep_arrays=True)
        # every node was shown to the callback and read (strided views gathered through their strides)
        assert all(n.values is not None and n.values.observed for n in first.nodes)
        notes = {n.name: n.values.note for n in first.nodes if n.values and n.values.note}
        assert notes.get("conv_state_windows-0", "").startswith("not contiguous")
        # the overlapping windows as read equal the last Kw columns of conv_input, window by window
        conv_in = arrays[first.find("conv_input-0")[0].id]                 # (ch, d_conv-1+T)
        win = arrays[first.find("conv_state_windows-0")[0].id]           # (ch, Kw, d_conv-1)
        T, kw = len(tokens), 3
        for j in range(kw):
            np.testing.assert_array_equal(win[:, j, :], conv_in[:, T - (kw - 1) + j: T - (kw - 1) + j + DC1])
        # the callback is cleared afterwards: a second capture on the same model gives the same numbers
        second, arrays2 = gd.capture_values(m, tokens, patterns=["l_out-*"], keep_arrays=True)
        for n in second.nodes:
            if n.values is not None:
                np.testing.assert_array_equal(arrays2[n.id], arrays[n.id])
        captured = arrays[first.find("result_output")[0].id].reshape(-1)
        # the same graph (one ubatch, last row out) evaluated normally gives the same bits ...
        m.reset()
        logits = m.eval(tokens)
        np.testing.assert_array_equal(logits, captured[-len(logits):])
        # ... and a graph of another shape (every row out) agrees to rounding: its matrix products
        # may take another kernel (llamafile's sgemm for many rows, vec_dot for one)
        np.testing.assert_allclose(m.logits_for(tokens)[-1], logits, rtol=1e-5, atol=1e-5 * np.abs(logits).max())

    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        run(model_path, "--values", "-p", PROMPT, "--filter", "*-2", "--dump-dir", d)
    ma, mb = (json.loads((d / "manifest.json").read_text()) for d in (a, b))
    assert ma == mb and len(ma["tensors"]) > 10
    assert len({e["file"] for e in ma["tensors"]}) == len(ma["tensors"])   # repeated names get distinct files
    for e in ma["tensors"]:
        assert (a / e["file"]).read_bytes() == (b / e["file"]).read_bytes()


def test_filter_patterns() -> None:
    match = gd.compile_patterns(["attn_norm-*", "re:^result_(norm|output)$"])
    assert match("attn_norm-0") and match("attn_norm-12") and match("result_norm") and match("result_output")
    assert not match("attn_norm_gated-0") and not match("result_output_x") and not match("l_out-0")
    assert gd.compile_patterns([]) is None
    with pytest.raises(gd.DeltarunError):
        gd.compile_patterns(["re:("])


def test_usage_errors(model_path: Path) -> None:
    for args in (["--values"], ["--filter", "x"], ["--decode", "--tokens", "3"], ["-p", "hi", "--tokens", "3"]):
        result = run(model_path, *args, ok=False)
        assert result.exit_code == 2 and "Traceback" not in result.output, args
    result = run(model_path, "--seqs", 2, "--tokens", 1, ok=True)  # opens the model with n_seq_max = 2
    assert "n_seqs=2" in result.stdout
    result = run(model_path, "-p", "hi", "--filter", "no_such_node", ok=False)
    assert result.exit_code == 1 and "no node matches --filter no_such_node" in result.output
