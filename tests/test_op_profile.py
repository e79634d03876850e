"""`deltarun bench --profile` and deltarun.apps.op_profile: structure, grouping, sums (no timings).

Speed itself is measured in bench/, never asserted here: these tests check that every computed
node is timed once and put in exactly one group, that op and group sums make up the total, and
that profiling leaves the model as it was (callback removed, same logits).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from deltarun.apps.op_profile import GROUPS, NO_OPS, classify_nodes, make_profile, profile_ubatch
from deltarun.cli.main import cli
from deltarun.runner.model import Model


@pytest.fixture(scope="module")
def model_path(tiny_model_path):
    return tiny_model_path("tiny", "f32")


def test_groups_from_names():
    names = ["model.embed_tokens", "inp_embd",                      # embedding (llama.cpp, deltarun)
             "node_3", "attn_norm-0", "linear_attn_qkv_mixed-0 (reshaped) (transposed)", "node_9",
             "cache_s_l0 (view)", "attn_residual-0",                  # delta net layer 0
             "node_12", "attn_post_norm-0", "ffn_moe_logits-0", "node_15", "ffn_moe_topk-0", "l_out-0",
             "attn_norm-1", "Qcur-1", "kq-1", "attn_output-1",        # attention layer 1 (has a ROPE)
             "ffn_shexp-1", "node_30", "result_norm", "result_output", "node_40"]
    ops = ["GET_ROWS", "GET_ROWS",
           "RMS_NORM", "MUL", "TRANSPOSE", "GATED_DELTA_NET", "VIEW", "ADD",
           "RMS_NORM", "MUL", "MUL_MAT", "ARGSORT", "VIEW", "ADD",
           "MUL", "ROPE", "MUL_MAT", "MUL_MAT",
           "MUL_MAT", "GET_ROWS", "MUL", "MUL_MAT", "CPY"]
    groups = classify_nodes(names, ops)
    assert groups == ["other", "other",
                      "delta_net", "delta_net", "delta_net", "delta_net", "delta_net", "delta_net",
                      "moe_ffn", "moe_ffn", "moe_ffn", "moe_ffn", "moe_ffn", "moe_ffn",
                      "attention", "attention", "attention", "attention",
                      "moe_ffn", "lm_head", "lm_head", "lm_head", "lm_head"]
    with pytest.raises(ValueError):
        classify_nodes(["a"], [])


def test_make_profile_sums_and_skips_views():
    recs = [("inp_embd", "GET_ROWS", [1.0, 3.0]), ("x-0 (view)", "VIEW", [0.0, 0.0]),
            ("attn_norm-0", "MUL", [2.0, 2.0]), ("ffn_out-0", "ADD", [0.5, 1.5]),
            ("result_output", "MUL_MAT", [4.0, 6.0])]
    p = make_profile(recs, n_nodes=5, test="t", kind="pp", n_tokens=2, n_seqs=1, n_past=0, threads=1,
                     repetitions=2)
    d = p.as_dict(with_nodes=True)
    assert d["n_computed"] == 4 and d["n_nodes"] == 5 and d["total_s"] == pytest.approx(2 + 2 + 1 + 5)
    assert {r["op"]: r["seconds"] for r in d["ops"]} == {"GET_ROWS": 2.0, "MUL": 2.0, "ADD": 1.0, "MUL_MAT": 5.0}
    assert [g["group"] for g in d["groups"]] == list(GROUPS)
    assert {g["group"]: g["seconds"] for g in d["groups"]} == {"attention": 0.0, "delta_net": 2.0, "moe_ffn": 1.0,
                                                               "lm_head": 5.0, "other": 2.0}
    assert d["overhead"] is None and sum(g["share"] for g in d["groups"]) == pytest.approx(1.0)


@pytest.mark.parametrize("decode", [False, True])
def test_profile_of_a_real_ubatch(model_path, decode):
    with Model(model_path, n_ctx=64, n_threads=1) as m:
        toks = np.random.default_rng(0).integers(0, m.hp.n_vocab, 20).tolist()
        kwargs = {"n_past_tokens": toks[:8]} if decode else {}
        p = profile_ubatch(m, toks[19:] if decode else toks[:12], repetitions=2, threads=1, **kwargs)
        assert m.sched._c_callback is None                      # the eval callback is gone again
        d = p.as_dict(with_nodes=True)
        assert d["kind"] == ("tg" if decode else "pp") and d["n_tokens"] == (1 if decode else 12)
        assert d["n_past"] == (8 if decode else 0) and d["repetitions"] == 2
        nodes = d["nodes"]
        assert len(nodes) == d["n_computed"] < d["n_nodes"]
        assert all(n["op"] not in NO_OPS and n["group"] in GROUPS and n["seconds"] >= 0 for n in nodes)
        assert sum(n["seconds"] for n in nodes) == pytest.approx(d["total_s"], rel=1e-12)
        assert sum(r["seconds"] for r in d["ops"]) == pytest.approx(d["total_s"], rel=1e-12)
        assert sum(g["seconds"] for g in d["groups"]) == pytest.approx(d["total_s"], rel=1e-12)
        assert d["plain_s"] > 0 and d["total_s"] > 0 and d["overhead_per_node_us"] is not None
        counts = {g["group"]: g["count"] for g in d["groups"]}
        assert all(counts[g] > 0 for g in ("attention", "delta_net", "moe_ffn", "lm_head"))
        by_op = {}
        for n in nodes:
            by_op.setdefault(n["op"], set()).add(n["group"])
        assert by_op["GATED_DELTA_NET"] == {"delta_net"} and by_op["ROPE"] == {"attention"}
        assert by_op["MUL_MAT_ID"] == {"moe_ffn"} and by_op["SSM_CONV"] == {"delta_net"}
        assert [n["group"] for n in nodes if n["name"] == "result_output"] == ["lm_head"]
        # the model computes exactly as before profiling
        m.reset()
        after = m.eval(toks[:12])
    with Model(model_path, n_ctx=64, n_threads=1) as fresh:
        np.testing.assert_array_equal(after, fresh.eval(toks[:12]))


def test_bench_profile_depth_and_parallel_json(model_path):
    r = CliRunner().invoke(cli, ["bench", str(model_path), "-p", "16", "-n", "4", "-r", "2", "-t", "1", "-ub", "16",
                                 "--depth", "40", "--parallel", "1,3", "--profile", "-o", "json"])
    assert r.exit_code == 0, (r.output, r.exception)
    doc = json.loads(r.stdout)
    rows = {x["test"]: x for x in doc["results"]}
    assert list(rows) == ["pp16", "tg4", "tg4@d40", "tg4x1", "tg4x3"]
    assert rows["tg4@d40"]["n_depth"] == 40 and rows["tg4x3"]["n_parallel"] == 3
    assert rows["tg4"]["n_depth"] == 0 and rows["tg4"]["n_parallel"] == 1
    x3 = rows["tg4x3"]
    assert x3["samples_tps"][0] == pytest.approx(3 * 4 / x3["samples_s"][0])     # aggregate tokens/s
    assert doc["settings"]["depth"] == [40] and doc["settings"]["parallel"] == [1, 3]
    profs = doc["profiles"]
    assert [(p["test"], p["kind"]) for p in profs] == [("pp16", "pp"), ("tg1@16", "tg")]
    for p in profs:
        assert [g["group"] for g in p["groups"]] == list(GROUPS)
        assert sum(g["seconds"] for g in p["groups"]) == pytest.approx(p["total_s"], rel=1e-12)
        assert sum(o["seconds"] for o in p["ops"]) == pytest.approx(p["total_s"], rel=1e-12)


def test_bench_profile_markdown_and_errors(model_path):
    r = CliRunner().invoke(cli, ["bench", str(model_path), "-p", "0", "-n", "0", "-r", "1", "-t", "1", "-ub", "8",
                                 "--profile"])
    assert r.exit_code == 0, (r.output, r.exception)
    out = r.stdout
    assert "| op | deltarun pp8 ms | deltarun pp8 % | deltarun tg1@16 ms | deltarun tg1@16 % |" in out
    assert "| group |" in out and "| delta_net |" in out and "| lm_head |" in out and "overhead" in out
    r = CliRunner().invoke(cli, ["bench", str(model_path), "-p", "8", "-n", "0", "--depth", "32", "-r", "1"])
    assert r.exit_code != 0 and "-n N > 0" in r.output
    r = CliRunner().invoke(cli, ["bench", str(model_path), "-n", "4", "--parallel", "0", "-r", "1"])
    assert r.exit_code != 0 and "below 1" in r.output
