"""`deltarun bench`: the grid, the JSON schema and the other report formats (tiny f32 model)."""

from __future__ import annotations

import csv
import io
import json
import os

import pytest
from click.testing import CliRunner

import deltarun
from deltarun.apps.bench import SCHEMA, SCHEMA_VERSION, TG_PROMPT
from deltarun.cli.main import cli
from deltarun.runner import devices


def invoke(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def ok(*args):
    r = invoke(*args)
    assert r.exit_code == 0, (r.output, r.exception)
    return r


@pytest.fixture(scope="module")
def model(tiny_model_path):
    return tiny_model_path("tiny", "f32")


def test_json_schema_and_a_2x2_grid(model):
    r = ok("bench", model, "-p", "8,16", "-n", "0", "-ub", "8", "-ub", "16", "-r", "2", "-t", "1", "-o", "json")
    data = json.loads(r.stdout)
    assert data["schema"] == SCHEMA and data["schema_version"] == SCHEMA_VERSION
    assert data["deltarun_version"] == deltarun.__version__
    machine = data["machine"]
    assert {"platform", "machine", "processor", "python", "cpu_count", "cpu_affinity"} <= set(machine)
    assert machine["ggml_cpu_features"] == devices.cpu_features()
    assert ("LLAMAFILE" in machine["ggml_cpu_features"]) == bool(devices.ggml.ggml_cpu_has_llamafile())
    assert machine["cpu_count"] == os.cpu_count()
    m = data["model"]
    assert m["path"] == str(model) and m["size_bytes"] > 0 and m["n_params"] > 0
    assert m["size_bytes"] == 4 * m["n_params"]        # an all-F32 file: 4 bytes per parameter
    assert data["settings"]["repetitions"] == 2 and data["settings"]["tg_prompt"] == TG_PROMPT
    rows = data["results"]
    assert len(rows) == 4
    assert {(x["ubatch"], x["n_prompt"]) for x in rows} == {(8, 8), (8, 16), (16, 8), (16, 16)}
    for x in rows:
        assert x["kind"] == "pp" and x["test"] == f"pp{x['n_prompt']}" and x["n_gen"] == 0
        assert x["backend"] == "cpu" and x["threads"] == 1 and x["repetitions"] == 2
        assert len(x["samples_s"]) == len(x["samples_tps"]) == 2
        assert all(s > 0 for s in x["samples_s"])
        assert x["avg_tps"] == pytest.approx(sum(x["samples_tps"]) / 2)
        assert x["samples_tps"][0] == pytest.approx(x["n_prompt"] / x["samples_s"][0])
        assert x["stddev_tps"] >= 0 and x["avg_s"] > 0


def test_markdown_and_csv(model):
    md = ok("bench", model, "-p", "8", "-n", "4", "-r", "1", "-t", "1", "-ub", "8")
    lines = md.stdout.strip().splitlines()
    assert lines[0].startswith("| model | size | params | backend | ngl | threads | n_ubatch | test | t/s |")
    assert "| cpu | all | 1 | 8 | pp8 |" in lines[2]
    assert len(lines) == 4 and "| pp8 |" in lines[2] and "| tg4 |" in lines[3] and " ± " in lines[3]
    assert "MiB" in lines[2]
    c = ok("bench", model, "-p", "0", "-n", "3", "-r", "1", "-t", "1", "--backend", "cpu,cpu-ref", "-o", "csv")
    rows = list(csv.DictReader(io.StringIO(c.stdout)))
    assert [(r["backend"], r["test"], r["kind"]) for r in rows] == [("cpu", "tg3", "tg"), ("cpu-ref", "tg3", "tg")]
    assert float(rows[0]["avg_tps"]) > 0


def test_gpu_layers_are_a_grid_dimension(model):
    # on the CPU backend every layer is on the CPU whatever -ngl says; the rows still record it
    c = ok("bench", model, "-p", "8", "-n", "0", "-r", "1", "-t", "1", "-ub", "8", "-ngl", "0,2", "-o", "json")
    rows = json.loads(c.stdout)["results"]
    assert [(r["gpu_layers"], r["test"]) for r in rows] == [(0, "pp8"), (2, "pp8")]
    c = ok("bench", model, "-p", "8", "-n", "0", "-r", "1", "-t", "1", "-ub", "8", "-o", "json")
    assert [r["gpu_layers"] for r in json.loads(c.stdout)["results"]] == [None]


@pytest.mark.parametrize("args, message", [
    (["-p", "x"], "not an integer"),
    (["-t", "0"], "below 1"),
    (["-p", "0", "-n", "0"], "nothing to measure"),
    (["--backend", "gpu9"], "unknown backend"),
])
def test_bad_arguments(model, args, message):
    r = invoke("bench", model, "-r", "1", *args)
    assert r.exit_code != 0 and message in r.output


def test_bench_says_when_ggml_lacks_the_llamafile_kernels(model, monkeypatch):
    args = ("bench", model, "-p", "8", "-n", "0", "-r", "1", "-t", "1", "-ub", "8")
    monkeypatch.setattr(devices.ggml, "ggml_cpu_has_llamafile", lambda: 0)
    r = ok(*args)
    assert "scripts/install.sh" in r.stderr and "LLAMAFILE" not in r.stderr
    monkeypatch.setattr(devices.ggml, "ggml_cpu_has_llamafile", lambda: 1)
    r = ok(*args)
    assert "scripts/install.sh" not in r.stderr and "LLAMAFILE" in r.stderr


def test_ubatch_cost_is_each_pp_over_pp1(model):
    """-p 4,1,2: pp1 is measured first whatever the order, and every larger ubatch reports its
    seconds over pp1's (JSON, CSV and the markdown "x pp1" column)."""
    r = ok("bench", model, "-p", "4,1,2", "-n", "2", "-r", "2", "-t", "1", "-ub", "8", "-o", "json")
    rows = json.loads(r.stdout)["results"]
    assert [x["test"] for x in rows] == ["pp1", "pp4", "pp2", "tg2"]
    pp1 = rows[0]["avg_s"]
    assert rows[0]["ubatch_cost"] is None and rows[3]["ubatch_cost"] is None
    for x in rows[1:3]:
        assert x["ubatch_cost"] == pytest.approx(x["avg_s"] / pp1)
    md = ok("bench", model, "-p", "1,2", "-n", "0", "-r", "1", "-t", "1", "-ub", "8").stdout.strip().splitlines()
    assert md[0].endswith("| t/s | x pp1 |")
    assert md[2].endswith("| 1.00 |")
    cost = float(md[3].rsplit("|", 2)[1])
    assert cost > 0 and md[3].split("|")[8].strip() == "pp2"
    plain = ok("bench", model, "-p", "2", "-n", "0", "-r", "1", "-t", "1", "-ub", "8").stdout.splitlines()
    assert plain[0].endswith("| t/s |")   # no pp1 in the grid: no cost column
