"""llama.cpp itself on the synthetic Qwen3.5 files: its logits equal the float64 reference computed
from the Hugging Face-order weights, and a file without the converter's value-head reorder misses.

This is the check that the generator writes what llama.cpp's loader and graphs expect (keys,
names, shapes, the tiled value-head order, the stored 1 + w norms, -exp(A_log)), independent of
deltarun's own graphs. It needs a Python with llama-cpp-python 0.3.36 (the first release with
qwen35): `$DELTARUN_LLAMACPP_PYTHON`, else the bench environment `bench/.venv-llamacpp`
(`python bench/bench_envs.py llamacpp` builds it, 20-40 minutes); without one it is skipped.

The qwen35 pre-tokenizer is compared on 1000 random texts as well (llama.cpp tokenizes the shared
Qwen2 vocabulary relabelled `qwen35`).

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


TOKENIZE_SCRIPT = """
import json, sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
texts = json.load(open(sys.argv[2], encoding="utf-8"))
json.dump([llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in texts], open(sys.argv[3], "w"))
"""


def random_texts(n: int, seed: int) -> list[str]:
    """Short strings mixing letters, combining marks, digits, whitespace runs, punctuation,
    contractions and scripts (CJK, Cyrillic, Thai, Devanagari, emoji with ZWJ)."""
    import random

    rnd = random.Random(seed)
    pools = ["abcxyzABC", "éüñßøÆ", "\u0301\u0308\u0327\u0300", "0123456789", " ", "  ", "\t", "\n", "\r\n",
             ".,!?'\"-()[]{}<>/\\|@#$%^&*_=+~`;:", "我想在工作天", "кириллица", "🚀😀🦙", "\u200d", "'s", "'LL",
             "ा ि ु", "ก่ข้"]
    return ["".join(rnd.choice(rnd.choice(pools)) * rnd.randint(1, 3) for _ in range(rnd.randint(1, 12)))
            for _ in range(n)]


def test_qwen35_pre_tokenizer_agrees_with_llamacpp_on_random_text(tmp_path):
    """llama.cpp splits qwen35 text with a hand-written splitter, deltarun with the regex: they agree
    (measured: 3000 of 3000 random texts when this test was written)."""
    import json

    from deltarun.base.tokenizer import Tokenizer
    from test_loader_errors import GV, rewrite
    from shipped_data import qwen2_vocab_gguf   # llama.cpp's Qwen2 vocabulary, shipped in tests/data

    QWEN2_VOCAB = qwen2_vocab_gguf()
    vocab = tmp_path / "vocab-qwen35.gguf"
    rewrite(QWEN2_VOCAB, vocab, set_kv={"tokenizer.ggml.pre": ("qwen35", GV.STRING)})
    texts = random_texts(1000, seed=0)
    (tmp_path / "texts.json").write_text(json.dumps(texts, ensure_ascii=False), encoding="utf-8")
    p = subprocess.run([str(PYTHON), "-c", TOKENIZE_SCRIPT, str(vocab), str(tmp_path / "texts.json"),
                        str(tmp_path / "out.json")], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert p.returncode == 0, p.stderr[-2000:]
    want = json.loads((tmp_path / "out.json").read_text())
    import gguf

    tok = Tokenizer.from_gguf(gguf.GGUFReader(str(vocab)))
    assert tok.pre == "qwen35"
    bad = [(t, w) for t, w in zip(texts, want) if tok.encode(t, parse_special=False) != w]
    assert not bad, bad[:3]
