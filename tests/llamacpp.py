"""llama.cpp itself, run from the tests: logits, greedy continuations and tokenization of a GGUF file.

The tests that compare deltarun with llama.cpp need a Python with llama-cpp-python 0.3.36 (the
sdist whose vendored ggml deltarun's wheel is built from; its llama.cpp has qwen3next, qwen35,
qwen35moe and kimi-linear): `$DELTARUN_LLAMACPP_PYTHON`, else the bench environment
`bench/.venv-llamacpp` (`python bench/bench_envs.py llamacpp` builds it, 20-40 minutes on two
cores). Without one they skip (CI has none, so they stay out of its time budget).

Each call runs a short script in that Python. llama.cpp loads the weights with its extra CPU
buffer types off (`use_extra_bufts = false`, llama-server's `-nr`): on CPUs with AMX the default
(repacked and AMX buffers) crashes (SIGSEGV/SIGILL on the Xeon these tests were measured on), and
with them off llama.cpp runs ggml's plain CPU kernels, as deltarun does with `repack=False`.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import numpy as np
import pytest

# Loads llama_cpp with the default model parameters' extra buffer types switched off (see above):
# Llama() reads them from llama_cpp.llama_cpp.llama_model_default_params, which has no argument
# for it.
PRELUDE = """
import json, sys
import numpy as np
import llama_cpp.llama_cpp as _lc
from llama_cpp import Llama
_defaults = _lc.llama_model_default_params
def _no_extra_bufts():
    p = _defaults()
    p.use_extra_bufts = False
    return p
_lc.llama_model_default_params = _no_extra_bufts
"""

# argv: model, out.npz, prompt ids (comma-separated), greedy tokens to generate. F32 KV cache, no
# flash attention, one thread, the whole prompt in one ubatch: the prompt's logits, then greedy
# tokens one at a time with the logits each was chosen from.
LOGITS_SCRIPT = PRELUDE + """
path, out, toks, n_gen = sys.argv[1], sys.argv[2], [int(t) for t in sys.argv[3].split(",")], int(sys.argv[4])
llm = Llama(model_path=path, n_ctx=256, n_batch=256, n_ubatch=256, n_threads=1, logits_all=True,
            verbose=False, flash_attn=False, type_k=0, type_v=0)
llm.eval(toks)
logits = np.asarray(llm.scores[:len(toks)], dtype=np.float64)
gen, rows = [], []
for _ in range(n_gen):
    rows.append(np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float64))
    gen.append(int(np.argmax(rows[-1])))
    llm.eval([gen[-1]])
np.savez(out, logits=logits, greedy=np.asarray(gen, dtype=np.int64), greedy_logits=np.asarray(rows) if rows else logits[:0])
"""

# argv: vocabulary GGUF, texts.json, out.json: each text's ids (no bos, special texts as text).
TOKENIZE_SCRIPT = PRELUDE + """
llm = Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
texts = json.load(open(sys.argv[2], encoding="utf-8"))
json.dump([llm.tokenize(t.encode("utf-8"), add_bos=False, special=False) for t in texts], open(sys.argv[3], "w"))
"""


def llamacpp_python() -> Path | None:
    """The Python with llama-cpp-python the tests use, or None."""
    candidates = [os.environ.get("DELTARUN_LLAMACPP_PYTHON"),
                  str(Path(__file__).resolve().parents[1] / "bench" / ".venv-llamacpp" / "bin" / "python")]
    for c in candidates:
        if c and Path(c).is_file():
            check = subprocess.run([c, "-c", "import llama_cpp"], capture_output=True)
            if check.returncode == 0:
                return Path(c)
    return None


PYTHON = llamacpp_python()
needs_llamacpp = pytest.mark.skipif(PYTHON is None, reason="no Python with llama-cpp-python "
                                    "(python bench/bench_envs.py llamacpp, or set DELTARUN_LLAMACPP_PYTHON)")


def run(script: str, *args: object) -> None:
    """Run one of the scripts above in llama.cpp's Python; a failure shows its stderr."""
    p = subprocess.run([str(PYTHON), "-c", script, *map(str, args)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    assert p.returncode == 0, f"llama.cpp exited with {p.returncode}: {p.stderr[-2000:]}"


def logits_and_greedy(path: Path, toks: list[int], n_gen: int, tmp: Path) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's logits for `toks` (one row per token, float64), and for its next `n_gen` greedy
    tokens the logits each was chosen from (the argmax of row i is greedy token i)."""
    out = tmp / f"{path.stem}-llamacpp.npz"
    run(LOGITS_SCRIPT, path, out, ",".join(map(str, toks)), n_gen)
    with np.load(out) as z:
        return z["logits"], z["greedy_logits"]


def tokenize(vocab: Path, texts: list[str], tmp: Path) -> list[list[int]]:
    """llama.cpp's ids for each text (no bos; special-token texts are plain text)."""
    src, out = tmp / "texts.json", tmp / "llamacpp-ids.json"
    src.write_text(json.dumps(texts, ensure_ascii=False), encoding="utf-8")
    run(TOKENIZE_SCRIPT, vocab, src, out)
    return json.loads(out.read_text())


def random_texts(n: int, seed: int) -> list[str]:
    """Short strings mixing letters (and lower/upper case changes), combining marks, digits,
    whitespace runs, punctuation, contractions in both cases, and scripts: Han (common, extension
    B, compatibility ideographs), kana, the iteration mark 々 (a letter of the Han script outside
    the CJK blocks), Cyrillic, Thai, Devanagari, emoji with ZWJ."""
    rnd = random.Random(seed)
    pools = ["abcxyzABC", "aBcDeF", "éüñßøÆ", "\u0301\u0308\u0327\u0300", "0123456789", " ", "  ", "\t", "\n",
             "\r\n", ".,!?'\"-()[]{}<>/\\|@#$%^&*_=+~`;:", "我想在工作天", "\U00020000\U0002a700\uf900\u3400",
             "ひらがなカタカナ", "々〇", "кириллица", "🚀😀🦙", "\u200d", "'s", "'LL", "'Re", "'vE", "'d", "'M",
             "ा ि ु", "ก่ข้"]
    return ["".join(rnd.choice(rnd.choice(pools)) * rnd.randint(1, 3) for _ in range(rnd.randint(1, 12)))
            for _ in range(n)]
