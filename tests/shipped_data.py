"""Paths of the reference data shipped under tests/data/ (llama.cpp's, MIT; see tests/data/README.md).

The tests use these copies, never a folder outside the repository, so a fresh clone runs them all.
"""

from __future__ import annotations

import hashlib
import lzma
import os
import tempfile
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
VOCAB_INPUTS = DATA_DIR / "ggml-vocab-qwen2.gguf.inp"
VOCAB_OUTPUTS = DATA_DIR / "ggml-vocab-qwen2.gguf.out"
QWEN3_TEMPLATE = DATA_DIR / "templates" / "Qwen-Qwen3-0.6B.jinja"
QWEN35_TEMPLATE = DATA_DIR / "templates" / "Qwen3.5-4B.jinja"

_VOCAB_XZ = DATA_DIR / "ggml-vocab-qwen2.gguf.xz"
_VOCAB_SHA256 = "44c2f46b715f585c6ab513970e8a006bfa5badd6108560054921cf598d154d8c"


def qwen2_vocab_gguf() -> Path:
    """llama.cpp's ggml-vocab-qwen2.gguf, unpacked once into the temporary folder (checked by hash)."""
    out = Path(tempfile.gettempdir()) / f"deltarun-tests-{os.getuid()}" / f"ggml-vocab-qwen2-{_VOCAB_SHA256[:12]}.gguf"
    if out.exists() and hashlib.sha256(out.read_bytes()).hexdigest() == _VOCAB_SHA256:
        return out
    data = lzma.decompress(_VOCAB_XZ.read_bytes())
    if hashlib.sha256(data).hexdigest() != _VOCAB_SHA256:
        raise RuntimeError(f"{_VOCAB_XZ} does not unpack to llama.cpp's ggml-vocab-qwen2.gguf")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.part")
    tmp.write_bytes(data)
    os.replace(tmp, out)
    return out
