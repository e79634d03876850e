"""llama.cpp's mtmd side of bench/mtmd_encode.py; runs inside bench/.venv-llamacpp.

llama-cpp-python 0.3.36 ships the mtmd bindings (llama_cpp/mtmd_cpp.py) but not libmtmd, so
bench/mtmd_encode.py points LLAMA_CPP_LIB_PATH and MTMD_CPP_LIB at a shared-library build of the
sdist's own llama.cpp tree (build/llama-mtmd/bin: libllama, libmtmd and their libggml, one copy).
The worker loads the text model (llama.cpp's mtmd refuses a projector whose output width is not
the text model's; extra buffer types off on AMX CPUs, bench/_worker_protocol.cpu_has_amx), the
mmproj on the CPU with N threads, and tokenizes "<__media__>" with the image once: llama.cpp's own
preprocessing, outside the timing. Then it answers JSON lines (bench/_worker_protocol.serve):

    {"cmd": "encode"}             -> {"ms": milliseconds of one mtmd_encode_chunk of the image}
    {"cmd": "embd", "path": P}    -> {"n_tokens": n, "dim": d}; the last encode's embeddings saved
                                     to P (.npy, [n_tokens, dim])
    {"cmd": "quit"}

The ready line reports the image chunk's token count and grid (nx, ny) so the driver can check
that both engines encode the same number of image tokens.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from typing import Any

import numpy as np
import llama_cpp
from llama_cpp import mtmd_cpp as mtmd

from _worker_protocol import cpu_has_amx, serve


def loaded_libraries() -> list[str]:
    """The llama.cpp, mtmd and ggml shared libraries this process mapped (one copy of each expected)."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "/lib" in line and (".so" in line)}
    return sorted(os.path.realpath(p) for p in paths if any(k in os.path.basename(p) for k in ("ggml", "llama", "mtmd")))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--mmproj", required=True)
    ap.add_argument("--rgb", required=True, help="the image's pixels, uint8 [height, width, 3], as .npy "
                    "(this environment has no Pillow; the driver decodes the PNG)")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    mp.n_gpu_layers = 0
    amx = cpu_has_amx()
    if amx:
        mp.use_extra_bufts = False
    model = llama_cpp.llama_model_load_from_file(a.model.encode(), mp)
    if not model:
        sys.exit(f"llama.cpp could not load {a.model}")

    cp = mtmd.mtmd_context_params_default()
    cp.use_gpu = False
    cp.n_threads = a.threads
    cp.print_timings = False
    cp.warmup = True
    ctx = mtmd.mtmd_init_from_file(a.mmproj.encode(), model, cp)
    if not ctx:
        sys.exit(f"mtmd could not load {a.mmproj}")

    rgb = np.ascontiguousarray(np.load(a.rgb), dtype=np.uint8)
    ny, nx, _ = rgb.shape
    data = (ctypes.c_uint8 * rgb.size).from_buffer(rgb)
    bitmap = mtmd.mtmd_bitmap_init(nx, ny, data)
    chunks = mtmd.mtmd_input_chunks_init()
    text = mtmd.mtmd_input_text()
    prompt = mtmd.mtmd_default_marker()
    text.text, text.text_len, text.add_special, text.parse_special = prompt, len(prompt), False, True
    bitmaps = (mtmd.mtmd_bitmap_p_ctypes * 1)(bitmap)
    rc = mtmd.mtmd_tokenize(ctx, chunks, ctypes.byref(text), bitmaps, 1)
    if rc != 0:
        sys.exit(f"mtmd_tokenize failed ({rc})")
    chunk = None
    for i in range(mtmd.mtmd_input_chunks_size(chunks)):
        c = mtmd.mtmd_input_chunks_get(chunks, i)
        if mtmd.mtmd_input_chunk_get_type(c) == mtmd.MTMD_INPUT_CHUNK_TYPE_IMAGE:
            chunk = c
    if chunk is None:
        sys.exit("mtmd_tokenize gave no image chunk")
    n_tokens = int(mtmd.mtmd_input_chunk_get_n_tokens(chunk))
    dim = int(llama_cpp.llama_model_n_embd_inp(model)) if hasattr(llama_cpp, "llama_model_n_embd_inp") \
        else int(llama_cpp.llama_model_n_embd(model))

    def encode(req: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        rc = mtmd.mtmd_encode_chunk(ctx, chunk)
        ms = (time.perf_counter() - t0) * 1e3
        if rc != 0:
            return {"error": f"mtmd_encode_chunk failed ({rc})"}
        return {"ms": ms}

    def embd(req: dict[str, Any]) -> dict[str, Any]:
        ptr = mtmd.mtmd_get_output_embd(ctx)
        out = np.ctypeslib.as_array(ptr, shape=(n_tokens * dim,)).reshape(n_tokens, dim).copy()
        np.save(req["path"], out)
        return {"n_tokens": n_tokens, "dim": dim}

    serve({"engine": "llama.cpp mtmd", "n_tokens": n_tokens, "dim": dim, "image": [ny, nx], "threads": a.threads,
           "extra_bufts": not amx, "libs": loaded_libraries()},
          lambda cmd, n, mode: 0.0, commands={"encode": encode, "embd": embd})


if __name__ == "__main__":
    main()
