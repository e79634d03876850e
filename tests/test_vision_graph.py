"""`deltarun graph --mmproj` and `deltarun compare --mmproj`: the vision tower's graph for an image
file, its recorded values against the float64 reference, and the tower compared across backends
and weight files (tiny Qwen3.5 vision-language pair, as tests/test_vision_cli.py makes it)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from deltarun.apps import vision_graph as vg
from deltarun.cli.main import cli
from deltarun.model_files import qwen35, qwen35_vision as qv
from deltarun.runner import images
from deltarun.runner.vision import VisionEncoder

import reference_vision as rv

CFG = qv.vision_for(qwen35.PRESETS["tiny-qwen35"])


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("vlm-graph")
    text, mmproj = qv.write_vlm(folder, "tiny-qwen35")
    q8 = qv.write_mmproj(folder / "mmproj-tiny-qwen35-q8_0.gguf", CFG, "q8_0")
    rng = np.random.default_rng(11)
    arr = rng.integers(0, 256, (40, 100, 3), dtype=np.uint8)
    picture = folder / "picture.png"
    Image.fromarray(arr).save(picture)
    return text, mmproj, q8, picture, folder


def test_graph_of_an_image(files) -> None:
    """The tower's nodes in execution order, its weights by block, the shape the image file sets
    after preprocessing; --layer keeps one block with its v.blk.N weights."""
    text, mmproj, _, picture, _ = files
    r = run("graph", text, "--mmproj", mmproj, "--image", picture, "--format", "json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    with VisionEncoder(mmproj) as enc:
        prep = images.load_image(picture, enc.hp)
    _, gh, gw = prep.grid
    assert d["shape"] == {"image": list(prep.pixels.shape[1:]), "grid": [1, gh, gw], "n_patches": gh * gw,
                          "n_tokens": prep.n_tokens}
    names = [n["name"] for n in d["nodes"]]
    order = ["patch_bias", "inp_pos_emb", "attn_norm-0", "kqv-0", "attn_out-0", "ffn_out-0", "layer_out-0",
             "layer_out-1", "post_ln", "embeddings"]
    assert [names.index(n) for n in order] == sorted(names.index(n) for n in order)
    out = d["nodes"][-1]
    assert out["name"] == "embeddings" and out["is_output"] and out["ne"][:2] == [CFG.out_hidden_size, prep.n_tokens]
    assert d["summary"]["ops"]["FLASH_ATTN_EXT"] == CFG.depth
    patches = next(t for t in d["leafs"] if t["name"] == "inp_patches")
    assert patches["is_input"] and patches["ne"][:2] == [3 * 16 * 16, gh * gw]
    assert all(t["is_weight"] for t in d["leafs"] if t["name"].startswith(("v.", "mm.")))

    r = run("graph", text, "--mmproj", mmproj, "--image", picture, "--layer", "1", "--format", "json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert {n["layer"] for n in d["nodes"]} <= {0, 1, None} and "layer_out-1" in [n["name"] for n in d["nodes"]]
    weights = {t["name"] for t in d["leafs"] if t["is_weight"]}
    assert "v.blk.1.attn_qkv.weight" in weights and not any(w.startswith("v.blk.0.") for w in weights)
    assert all(t["layer"] == 1 for t in d["leafs"] if t["name"].startswith("v.blk.1."))

    r = run("graph", text, "--mmproj", mmproj, "--image", picture)
    assert r.exit_code == 0 and f"shape: image {prep.pixels.shape[1]} x {prep.pixels.shape[2]} pixels" in r.stdout
    assert "clip (qwen3vl_merger)" in r.stdout


def test_graph_values_are_the_towers(files, tmp_path: Path) -> None:
    """--values on the image: the recorded embeddings are what `encode` returns and the float64
    reference's within 1e-5; every block's output is recorded."""
    text, mmproj, _, picture, _ = files
    out = tmp_path / "dump"
    r = run("graph", text, "--mmproj", mmproj, "--image", picture, "--values", "--filter", "layer_out-*",
            "--filter", "embeddings", "--dump-dir", out)
    assert r.exit_code == 0, r.output
    assert f"image {picture}" in r.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert [t["name"] for t in manifest["tensors"]] == ["layer_out-0", "layer_out-1", "embeddings"]
    emb = np.load(out / "embeddings.npy")
    with VisionEncoder(mmproj, n_threads=2) as enc:
        prep = images.load_image(picture, enc.hp)
        want = enc.encode(prep)
    np.testing.assert_array_equal(emb, want)
    ref, _ = rv.vision_forward(qv.hf_weights(CFG, 0), CFG, prep.pixels)
    assert np.abs(emb - ref).max() / np.abs(ref).max() < 1e-5


def test_compare_tower_backends(files) -> None:
    """cpu against cpu-ref on one mmproj: every node compared node by node, within its limits."""
    text, mmproj, _, picture, _ = files
    r = run("compare", text, "--mmproj", mmproj, "--image", picture, "--json", "-q")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["kind"] == "vision" and rep["passed"]
    assert [s["backend"] for s in rep["sides"]] == ["cpu", "cpu-ref"]
    g, = rep["graphs"]
    assert g["matched_by"] == "index" and g["n_compared"] == g["n_nodes_a"] > 80 and g["n_failed"] == 0
    with VisionEncoder(mmproj) as enc:
        n_tokens = images.load_image(picture, enc.hp).n_tokens
    assert rep["embeddings"]["n_tokens"] == rep["image"]["n_tokens"] == n_tokens
    assert rep["embeddings"]["status"] == "ok" and rep["embeddings"]["nmse"] <= 5e-4


def test_compare_tower_weight_files(files, tmp_path: Path) -> None:
    """F32 against the Q8_0 mmproj: the embeddings' error is the quantisation's (non-zero, within
    test_vision's bound for q8_0 as a relative error), reported per node; exit 0 as with --against."""
    text, mmproj, q8, _, _ = files
    r = run("compare", text, "--mmproj", f"{mmproj},{q8}", "--seed", "3", "--json", "-q")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["sides"][1]["weight_types"].get("q8_0", 0) > 0 and "q8_0" not in rep["sides"][0]["weight_types"]
    e = rep["embeddings"]
    assert 0 < e["nmse"] < 6e-2 ** 2 and 0 < e["max_rel_err"] < 0.1
    nodes = {n["name"]: n for n in rep["graphs"][0]["nodes"]}
    assert nodes["inp_pos_emb"]["nmse"] == 0 and nodes["qkv-0"]["nmse"] > 0  # the patch kernel stays F32
    assert nodes["embeddings"]["nmse"] == pytest.approx(e["nmse"], rel=1e-6)
    page = tmp_path / "report.html"
    r = run("compare", text, "--mmproj", f"{mmproj},{q8}", "--seed", "3", "--html", page)
    assert r.exit_code == 0 and "embeddings (6 x 256)" in r.stdout and "random pixels" in r.stdout
    data = json.loads(re.search(r'<script type="application/json" id="graph-data">(.*?)</script>', page.read_text(),
                                re.S).group(1))
    assert data["mode"] == "compare" and data["compare"]["embeddings"] == e and "logits" not in data["compare"]
    assert {t["name"] for t in data["graphs"][0]["tensors"]} >= {"layer_out-1", "embeddings"}


def test_compare_tower_over_the_limits(files, monkeypatch) -> None:
    """A side whose tower computes something else (a block's output perturbed in the recording, and
    the embeddings): the first node over its limit is named, exit status 8."""
    text, mmproj, _, _, _ = files
    real = vg.run_tower

    def perturbed(side, image, **kw):
        got = real(side, image, **kw)
        if side.label == "b":
            got.embeddings = got.embeddings * 1.1
            node = next(n for n in got.graph.nodes if n.name == "layer_out-1")
            got.graph.arrays[node.id] = got.graph.arrays[node.id] + 1.0
        return got

    monkeypatch.setattr(vg, "run_tower", perturbed)
    r = run("compare", text, "--mmproj", mmproj, "--show", "failures")
    assert r.exit_code == 8, r.output
    assert "FIRST EXCEEDING NODE" in r.stdout and "layer_out-1" in r.stdout and "FAIL:" in r.stdout
    assert "embeddings: NMSE" in r.stderr and "Traceback" not in r.output


@pytest.mark.parametrize("case", ["image-alone", "text-option", "mmproj-as-model", "no-image", "graph-text-option"])
def test_bad_tower_options(files, case: str) -> None:
    text, mmproj, _, picture, folder = files
    args, expect, code = {
        "image-alone": (["graph", text, "--image", picture], "--image goes with --mmproj", 2),
        "text-option": (["compare", text, "--mmproj", mmproj, "--tokens", "4"], "drop --tokens", 2),
        "mmproj-as-model": (["compare", mmproj, "--mmproj", mmproj], "is an mmproj file", 3),
        "no-image": (["graph", text, "--mmproj", mmproj, "--image", folder / "none.png"], "no such image", 2),
        "graph-text-option": (["graph", text, "--mmproj", mmproj, "--decode"], "drop --decode", 2),
    }[case]
    r = run(*args)
    assert r.exit_code == code, r.output
    assert expect in r.output and "Traceback" not in r.output
