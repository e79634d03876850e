"""`deltarun compare` on the CPU: CPU against CPU-reference kernels, fused against primitive
delta-net, and F32 against Q4_K weights (which must exceed the limits), plus the NMSE rules."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from deltarun.cli.main import cli
from deltarun.apps import compare as cmp

FAST = ["--threads", "1", "--quiet"]


def run(*args):
    return CliRunner().invoke(cli, ["compare", *[str(a) for a in args], *FAST])


def report_of(*args, code=0):
    r = run(*args, "--json")
    assert r.exit_code == code, (r.output, r.exception)
    return json.loads(r.stdout)


# --- whole runs --------------------------------------------------------------------------------
@pytest.mark.parametrize("wtype", ["f32", "q8_0"])
def test_report_of_two_backends_that_agree(tiny_model_path, wtype):
    """The report's structure on two backends. cpu-ref computes deltarun's graphs bit for bit as
    cpu does (they have none of the ops its switch changes: see test_backends), so every error is
    exactly 0; this checks the comparison's plumbing, not the kernels (test_vulkan.py does that)."""
    rep = report_of(tiny_model_path("tiny", wtype), "--backends", "cpu,cpu-ref", "--tokens", "12", "-n", "4")
    assert rep["passed"] and rep["failures"] == []
    assert all(n["nmse"] in (0.0, None) for g in rep["graphs"] for n in g["nodes"])
    assert rep["logits"]["nmse"] == 0.0
    assert [s["backend"] for s in rep["sides"]] == ["cpu", "cpu-ref"]
    assert [g["graph"] for g in rep["graphs"]] == ["prefill", "decode"]
    for g in rep["graphs"]:
        assert g["matched_by"] == "index" and g["n_failed"] == 0 and g["first_failure"] is None
        assert g["n_compared"] == g["n_nodes_a"] > 100
        assert all(n["status"] in ("ok", "not_read") for n in g["nodes"])
    assert rep["logits"]["status"] == "ok" and rep["logits"]["n_positions"] == 12 + 4
    assert rep["logits"]["top1_agreement"] == 1.0
    assert rep["greedy"]["match"] and rep["greedy"]["a"] == rep["greedy"]["b"] and len(rep["greedy"]["a"]) == 4


def test_fused_against_primitive_delta_net_matches_by_name(tiny_model_path):
    # 70 tokens: the primitive side's chunked form crosses a chunk boundary
    rep = report_of(tiny_model_path("tiny", "f32"), "--backends", "cpu", "--delta-net", "fused,primitive",
                    "--tokens", "70", "-n", "2")
    assert rep["passed"], rep["failures"]
    assert [s["delta_net"] for s in rep["sides"]] == ["fused", "primitive"]
    pre = rep["graphs"][0]
    assert pre["matched_by"] == "name"
    assert any(n.startswith("dnet_") for n in pre["only_b"]) and pre["only_a"] == []
    assert {n["name"] for n in pre["nodes"]} >= {"attn_output-0", "l_out-3", "result_output"}
    assert all(n["named"] for n in pre["nodes"])
    assert rep["logits"]["nmse"] < 1e-10
    assert rep["greedy"]["match"]


def test_f32_against_q4_k_exceeds_the_limits_as_expected(tiny_model_path):
    """Two weight files exceed the node limits by design: the report is the result, status 0."""
    a, b = tiny_model_path("tiny", "f32"), tiny_model_path("tiny", "q4_k")
    rep = report_of(a, "--against", b, "--tokens", "8", "-n", "2", code=0)
    assert not rep["passed"] and rep["failures"]
    assert rep["sides"][1]["model"] == str(b) and "q4_K" in rep["sides"][1]["weight_types"]
    first = rep["graphs"][0]["first_failure"]
    assert first["status"] == "exceeds" and first["nmse"] > first["limit"]
    # it is the first failing node in graph order, and its inputs' errors are reported
    fails = [n for n in rep["graphs"][0]["nodes"] if n["status"] in cmp.FAIL]
    assert fails[0]["id"] == first["id"]
    assert first["inputs"] and all({"name", "id", "kind", "nmse", "status"} <= set(i) for i in first["inputs"])
    assert any(i["kind"] == "weight" for i in first["inputs"])
    assert rep["logits"]["status"] == "exceeds" and rep["logits"]["nmse"] > cmp.LOGITS_LIMIT
    assert rep["logits"]["kl_mean"] > 0
    # the text report names the node and the exit status is the same
    r = run(a, "--against", b, "--tokens", "8", "-n", "2", "--show", "failures")
    assert r.exit_code == 0
    assert "FIRST EXCEEDING NODE" in r.stdout and first["name"] in r.stdout and "FAIL:" not in r.stdout
    assert "OVER THE LIMITS, as two weight files are" in r.stdout
    assert "error" not in r.stderr


def test_limits_exceeded_has_its_own_exit_status(tiny_model_path, monkeypatch):
    """8 when the comparison ran and found a difference over a limit; 5, 2, ... when it could not run."""
    monkeypatch.setattr(cmp, "LOGITS_LIMIT", 0.0)     # fused and primitive logits differ by float rounding
    r = run(tiny_model_path("tiny", "f32"), "--delta-net", "fused,primitive", "--tokens", "6", "-n", "1", "-q")
    assert r.exit_code == 8, r.output
    assert "FAIL:" in r.stdout and r.stderr.startswith("compare: limits exceeded: logits: NMSE")
    assert "error" not in r.stderr


def test_backends_are_checked_before_any_work(tiny_model_path, monkeypatch):
    calls = []
    monkeypatch.setattr(cmp, "compare", lambda *a, **k: calls.append(a))
    r = run(tiny_model_path("tiny", "f32"), "--backends", "cpu,vulkan:7", "-q")
    assert r.exit_code == 5 and r.stderr.startswith("error: ") and "vulkan" in r.stderr.lower()
    assert calls == [] and r.stdout == ""


def test_text_report_lists_named_nodes_in_graph_order(tiny_model_path):
    r = run(tiny_model_path("tiny", "f32"), "--tokens", "6", "-n", "1")
    assert r.exit_code == 0, r.output
    out = r.stdout
    for word in ("side a:", "side b:", "prefill graph", "decode graph", "inp_embd", "result_output",
                 "top-1 agreement", "KL(a||b)", "greedy continuation (1 steps): match", "PASS"):
        assert word in out, word
    assert out.index("inp_embd") < out.index("attn_norm-0") < out.index("l_out-3") < out.index("result_output")
    assert "node_" not in out.split("decode graph")[0]     # unnamed nodes only with --show all


def test_json_schema(tiny_model_path):
    rep = report_of(tiny_model_path("tiny-tied", "f32"), "-p", "Hello world", "--tokens", "5", "-n", "2")
    assert rep["schema_version"] == 1
    assert set(rep) == {"schema_version", "passed", "failures", "sides", "prompt", "decode_steps", "kv_type",
                        "limits", "graphs", "logits", "greedy"}
    assert len(rep["prompt"]["tokens"]) == 5 and rep["prompt"]["text"] == "Hello world"
    assert rep["limits"]["default"] == 1e-7 and rep["limits"]["ops"]["MUL_MAT"] == 5e-4
    for s in rep["sides"]:
        assert set(s) == {"label", "model", "backend", "device", "delta_net", "gpu_layers", "placement",
                          "weight_types", "n_splits"}
        assert set(s["n_splits"]) == {"prefill", "decode"}
    for g in rep["graphs"]:
        assert set(g) == {"graph", "n_tokens", "n_past", "matched_by", "n_nodes_a", "n_nodes_b", "n_compared",
                          "n_failed", "n_skipped", "only_a", "only_b", "first_failure", "nodes"}
        for n in g["nodes"]:
            assert set(n) == {"index", "id", "name", "op", "type", "ne", "named", "layer", "backend_a", "backend_b",
                              "status", "nmse", "limit", "max_abs_err", "n_diff", "note", "inputs"}
            assert n["layer"] is None or 0 <= n["layer"] < 4
            assert n["status"] in cmp.FAIL + cmp.SKIP + ("ok",)
            assert n["nmse"] is None or isinstance(n["nmse"], (int, float)) or n["nmse"] in ("inf", "nan")
            assert n["limit"] >= cmp.DEFAULT_LIMIT
    assert rep["graphs"][1]["n_tokens"] == 1 and rep["graphs"][1]["n_past"] == 5
    lg = rep["logits"]
    assert set(lg) >= {"n_positions", "nmse", "limit", "max_position_nmse", "top1_agreement", "top1", "kl_mean",
                       "kl_max", "kl", "status"}
    assert len(lg["top1"]) == len(lg["kl"]) == lg["n_positions"] == 7
    assert set(rep["greedy"]) == {"steps", "a", "b", "match", "first_divergence"}


def test_prefill_only_and_bad_arguments(tiny_model_path):
    path = tiny_model_path("tiny", "f32")
    rep = report_of(path, "--tokens", "4", "-n", "0")
    assert [g["graph"] for g in rep["graphs"]] == ["prefill"] and rep["greedy"]["a"] == []
    assert run(path, "--backends", "cpu,cpu,cpu").exit_code == 2
    assert run(path, "--delta-net", "fused,magic").exit_code == 2
    r = run(path, "--backends", "cpu,quantum")
    assert r.exit_code == 5 and "unknown backend 'quantum'" in r.stderr


# --- the rules ---------------------------------------------------------------------------------
def test_nmse_definition():
    a = np.array([1.0, 2.0, 3.0], np.float32)
    assert cmp.nmse(a, a) == 0.0
    assert cmp.nmse(a, a * 1.01) == pytest.approx(1e-4, rel=1e-4)
    assert cmp.nmse(np.zeros(3), np.zeros(3)) == 0.0
    assert cmp.nmse(np.zeros(3), np.ones(3)) == math.inf


def test_nan_fails_and_infinities_must_match():
    a = np.array([1.0, -np.inf, 3.0], np.float32)
    assert cmp.compare_arrays(a, a.copy(), "f32", 1e-7).status == "ok"
    nan = np.array([1.0, -np.inf, np.nan], np.float32)
    assert cmp.compare_arrays(a, nan, "f32", 1e-7).status == "nan"
    assert cmp.compare_arrays(nan, nan, "f32", 1e-7).status == "nan"   # NaN anywhere fails
    assert cmp.compare_arrays(a, np.array([1.0, np.inf, 3.0], np.float32), "f32", 1e-7).status == "inf_mismatch"
    assert cmp.compare_arrays(a, np.array([1.0, -3.0, 3.0], np.float32), "f32", 1e-7).status == "inf_mismatch"
    d = cmp.compare_arrays(a, np.array([1.0, -np.inf, 3.1], np.float32), "f32", 1e-7)
    assert d.status == "exceeds" and d.nmse == pytest.approx(0.01 / 10, rel=1e-3)
    assert cmp.compare_arrays(a, a[:2], "f32", 1).status == "shape_mismatch"
    i = np.array([[3, 1], [0, 2]], np.int32)
    assert cmp.compare_arrays(i, i.copy(), "i32", 1).status == "ok"
    d = cmp.compare_arrays(i, i[:, ::-1].copy(), "i32", 1)
    assert d.status == "index_mismatch" and d.n_diff == 4
    assert cmp.compare_arrays(None, a, "q8_0", 1).status == "not_read"


def test_top_k_rows_are_sets_up_to_ties():
    """ggml leaves the order of TOP_K's indices open (its CPU kernel swaps the first two), and a
    tie at the k-th largest score may go either way; any other difference is a failure."""
    scores = np.array([[0.1, 0.9, 0.5, 0.3], [0.2, 0.2, 0.7, 0.1], [-1e30, -1e30, -1e30, 0.4]], np.float32)
    a = np.array([[1, 2], [2, 0], [3, 1]], np.int32)
    assert cmp.compare_top_k(a, a.copy(), scores, 0.0).status == "ok"
    d = cmp.compare_top_k(a, a[:, ::-1].copy(), scores, 0.0)                  # another order
    assert d.status == "ok" and d.note == "3 of 3 rows in another order or tie"
    assert cmp.compare_top_k(a, a[:, ::-1].copy(), None, None).status == "ok"
    tie = np.array([[2, 1], [1, 2], [0, 3]], np.int32)                      # rows 2 and 3: equal scores
    assert cmp.compare_top_k(a, tie, scores, 0.0).status == "ok"
    assert cmp.compare_top_k(a, tie, None, None).status == "index_mismatch"  # without scores: sets only
    other = np.array([[1, 3], [2, 0], [3, 1]], np.int32)                    # 0.3 is not the 2nd largest
    d = cmp.compare_top_k(a, other, scores, 0.0)
    assert d.status == "index_mismatch" and d.n_diff == 1
    near = scores.copy()
    near[0, 3] = 0.49                                                        # within 2 x 0.006 of 0.5
    assert cmp.compare_top_k(a, other, near, 0.006).status == "ok"
    assert cmp.compare_top_k(a, other, near, 0.004).status == "index_mismatch"
    assert cmp.compare_top_k(a, np.array([[1, 7], [2, 0], [3, 1]], np.int32), scores, 1e9).status == "index_mismatch"
    assert cmp.compare_top_k(a, a[:2], scores, 0.0).status == "shape_mismatch"


def _rec(id, op, src=(), is_memory=False, is_weight=False, is_input=False, name=None):
    return SimpleNamespace(id=id, op=op, src_ids=list(src), view_of_id=None, is_memory=is_memory,
                           is_weight=is_weight, is_input=is_input, name=name or id)


def test_limits_are_inherited_from_matrix_products():
    leafs = [_rec("l0", "NONE", is_weight=True), _rec("l1", "NONE", is_input=True), _rec("l2", "NONE", is_memory=True)]
    nodes = [_rec("n0", "GET_ROWS", ["l0", "l1"]), _rec("n1", "RMS_NORM", ["n0"]), _rec("n2", "MUL_MAT", ["l0", "n1"]),
             _rec("n3", "SILU", ["n2"]), _rec("n4", "ADD", ["n1", "l2"]), _rec("n5", "ADD", ["n3", "n4"])]
    prefill = cmp.GraphCapture("prefill", 4, 0, nodes, leafs, {}, 1)
    lim = cmp._limits(prefill)
    assert lim == {"n0": 1e-7, "n1": 1e-7, "n2": 5e-4, "n3": 5e-4, "n4": 1e-7, "n5": 5e-4}
    decode = cmp.GraphCapture("decode", 1, 4, nodes, leafs, {}, 1)
    assert cmp._limits(decode)["n4"] == 5e-4      # the state was written by an earlier graph


def test_kl_divergence():
    x = np.array([[1.0, 2.0, 3.0]])
    assert cmp.kl_divergence(x, x)[0] == pytest.approx(0.0, abs=1e-15)
    p = np.exp(x) / np.exp(x).sum()
    y = np.array([[1.0, 2.0, 2.5]])
    q = np.exp(y) / np.exp(y).sum()
    assert cmp.kl_divergence(x, y)[0] == pytest.approx(float(np.sum(p * np.log(p / q))))
