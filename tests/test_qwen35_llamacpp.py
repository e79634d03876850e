"""llama.cpp itself on the synthetic Qwen3.5 files: its logits equal the float64 reference computed
from the Hugging Face-order weights, and a file without the converter's value-head reorder misses.

This is the check that the generator writes what llama.cpp's loader and graphs expect (keys,
names, shapes, the tiled value-head order, the stored 1 + w norms, -exp(A_log)), independent of
deltarun's own graphs. It needs a Python with llama-cpp-python 0.3.36 (the first release with
qwen35): `$DELTARUN_LLAMACPP_PYTHON`, else the bench environment `bench/.venv-llamacpp`
(`python bench/bench_envs.py llamacpp` builds it, 20-40 minutes); without one it is skipped.

Measured (2 vCPU x86-64, F32 KV cache, 40 tokens): 4.9e-7 (tiny-qwen35) and 2.6e-7
(tiny-qwen35moe) max relative logit error; the file written in grouped order misses by 0.48 (the
same miss deltarun's graph shows on it, test_qwen35_forward.py).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest

from deltarun.model_files import qwen35 as q35
from reference_qwen35 import Qwen35Reference
from test_qwen35_files import N_VOCAB

LLAMA_SCRIPT = """
import sys, numpy as np
from llama_cpp import Llama
path, out, toks = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")]
llm = Llama(model_path=path, n_ctx=256, n_batch=256, n_ubatch=256, n_threads=1, logits_all=True,
            verbose=False, flash_attn=False, type_k=0, type_v=0)   # F32 KV cache
llm.eval(toks)
np.save(out, np.asarray(llm.scores[:len(toks)], dtype=np.float64))
"""


def llamacpp_python() -> Path | None:
    candidates = [os.environ.get("DELTARUN_LLAMACPP_PYTHON"),
                  str(Path(__file__).resolve().parents[1] / "bench" / ".venv-llamacpp" / "bin" / "python")]
    for c in candidates:
        if c and Path(c).is_file():
            check = subprocess.run([c, "-c", "import llama_cpp"], capture_output=True)
            if check.returncode == 0:
                return Path(c)
    return None


PYTHON = llamacpp_python()
pytestmark = pytest.mark.skipif(PYTHON is None, reason="no Python with llama-cpp-python (set DELTARUN_LLAMACPP_PYTHON)")


def llama_logits(path: Path, toks: list[int], tmp: Path) -> np.ndarray:
    out = tmp / (path.stem + ".npy")
    p = subprocess.run([str(PYTHON), "-c", LLAMA_SCRIPT, str(path), str(out), ",".join(map(str, toks))],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert p.returncode == 0, p.stderr[-2000:]
    return np.load(out)


def toks40() -> list[int]:
    return [int(t) for t in np.random.default_rng(1).integers(0, 2300, 40)]


@pytest.mark.parametrize("preset", ["tiny-qwen35", "tiny-qwen35moe"])
def test_llamacpp_matches_the_hf_order_reference(tiny_model_path, tmp_path, preset):
    cfg = q35.PRESETS[preset]
    expected = Qwen35Reference(cfg, q35.hf_weights(cfg, N_VOCAB, 0)).forward(toks40())
    got = llama_logits(tiny_model_path(preset, "f32"), toks40(), tmp_path)
    assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-5
    assert (got.argmax(1) == expected.argmax(1)).all()


def test_llamacpp_misses_on_a_file_left_in_grouped_order(tmp_path, monkeypatch):
    cfg = q35.PRESETS["tiny-qwen35"]
    monkeypatch.setattr(q35, "_reorder_linear_attention", lambda cfg, name, x: x)
    path = q35.write_model(tmp_path / "grouped.gguf", cfg, "f32")
    expected = Qwen35Reference(cfg, q35.hf_weights(cfg, N_VOCAB, 0)).forward(toks40())
    got = llama_logits(path, toks40(), tmp_path)
    assert np.abs(got - expected).max() / np.abs(expected).max() > 0.1
