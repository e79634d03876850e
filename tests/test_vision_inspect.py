"""`deltarun inspect` on an mmproj file (issue 31): the tower it holds, the text model it fits, and
what images cost in tokens; an mmproj deltarun cannot run says why."""

from __future__ import annotations

import json

import gguf
import numpy as np
from click.testing import CliRunner

from deltarun.cli.main import cli
from deltarun.model_files import qwen35, qwen35_vision as qv


def _inspect(*args: object):
    r = CliRunner().invoke(cli, ["inspect", *map(str, args)])
    assert r.exit_code == 0, r.output
    return r.stdout


def test_inspect_an_mmproj(tmp_path) -> None:
    cfg = qwen35.PRESETS["tiny-qwen35"]
    vcfg = qv.vision_for(cfg)
    path = qv.write_mmproj(tmp_path / "mmproj.gguf", vcfg, "f32", 0)
    d = json.loads(_inspect(path, "--json"))
    v = d["vision"]
    assert d["runnable"] is True and d["architecture"] == "clip" and d["problems"] == []
    assert v["projector"] == "qwen3vl_merger" and v["proj_dim"] == cfg.hidden_size
    assert (v["n_layer"], v["patch_size"], v["n_merge"]) == (vcfg.depth, vcfg.patch_size, vcfg.spatial_merge_size)
    assert v["deepstack_layers"] == [] and "kv_cache" not in d["memory"]
    # the processor's smart_resize worked by hand for patch 16 x merge 2 (sides multiples of 32):
    # 640 x 480 stays (20 x 15 tokens); 1920 x 1080 -> 1920 x 1088 (60 x 34)
    assert v["image_tokens"] == {"640x480": 300, "1024x1024": 1024, "1920x1080": 2040}
    text = _inspect(path)
    assert "runnable      yes" in text and "vision tower  qwen3vl_merger: 2 ViT blocks" in text
    assert f"projects to        {cfg.hidden_size}" in text and "1920x1080 -> 2040" in text


def test_inspect_an_mmproj_deltarun_cannot_run(tmp_path) -> None:
    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "clip")
    w.add_string("clip.projector_type", "idefics3")
    w.add_tensor("v.patch_embd.weight", np.zeros((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    text = _inspect(path)
    assert "runnable      no" in text and "no vision graph for projector type 'idefics3'" in text
    assert json.loads(_inspect(path, "--json"))["vision"] is None
