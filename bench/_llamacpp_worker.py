"""llama.cpp side of bench/compare_llamacpp.py; runs inside bench/.venv-llamacpp.

Loads one GGUF with llama-cpp-python and answers the commands of bench/_worker_protocol.py (JSON
lines; everything llama.cpp logs goes to stderr). Each pp/tg command is one warm-up run plus one
timed run, the same procedure as `deltarun bench -r 1` (deltarun/apps/bench.py), on the same
tokens:

- pp<P>: P tokens (numpy default_rng(1234), as deltarun's bench) evaluated from an empty state;
- tg<N>: a 16-token prompt (not timed), then N single-token evaluations, each feeding the argmax
  of the previous step's logits (read from llama_get_logits_ith).

mode "eval" times `Llama.eval` (llama-cpp-python's high-level call: the Python binding's own
per-call work included); mode "raw" times `llama_decode` on a prepared batch through the
low-level ctypes API, which is as close to llama-bench as Python gets.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import llama_cpp

from _worker_protocol import rss_bytes, serve

TG_PROMPT = 16
TOKEN_SEED = 1234


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--kv-type", default="f16")
    args = ap.parse_args()

    kv = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32, "q8_0": llama_cpp.GGML_TYPE_Q8_0}
    llm = llama_cpp.Llama(args.model, n_ctx=args.ctx, n_batch=args.batch, n_ubatch=args.batch,
                          n_threads=args.threads, n_threads_batch=args.threads, flash_attn=False,
                          type_k=kv[args.kv_type], type_v=kv[args.kv_type], verbose=False)
    ctx = llm._ctx.ctx
    mem = llama_cpp.llama_get_memory(ctx)
    n_vocab = llm.n_vocab()
    rng = np.random.default_rng(TOKEN_SEED)
    tokens = rng.integers(0, n_vocab, size=max(args.ctx, TG_PROMPT), dtype=np.int64).tolist()
    tok_buf = (llama_cpp.llama_token * args.batch)()

    def reset() -> None:
        llama_cpp.llama_memory_clear(mem, True)
        llm.reset()

    def last_logits_argmax() -> int:
        ptr = llama_cpp.llama_get_logits_ith(ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))

    def decode_raw(toks: list[int]) -> None:
        for i in range(0, len(toks), args.batch):
            chunk = toks[i:i + args.batch]
            for j, t in enumerate(chunk):
                tok_buf[j] = t
            rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tok_buf, len(chunk)))
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")

    def run_pp(n: int, mode: str) -> float:
        reset()
        toks = tokens[:n]
        t0 = time.perf_counter()
        if mode == "eval":
            llm.eval(toks)
        else:
            decode_raw(toks)
        return time.perf_counter() - t0

    def run_tg(n: int, mode: str) -> float:
        reset()
        prompt = tokens[:TG_PROMPT]
        if mode == "eval":
            llm.eval(prompt)
            tok = last_logits_argmax()
            t0 = time.perf_counter()
            for _ in range(n):
                llm.eval([tok])
                tok = last_logits_argmax()
        else:
            decode_raw(prompt)
            tok = last_logits_argmax()
            t0 = time.perf_counter()
            for _ in range(n):
                tok_buf[0] = tok
                rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tok_buf, 1))
                if rc != 0:
                    raise RuntimeError(f"llama_decode returned {rc}")
                tok = last_logits_argmax()
        return time.perf_counter() - t0

    serve({"n_vocab": n_vocab, "rss": rss_bytes(), "llama_cpp_python": llama_cpp.__version__,
           "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")},
          lambda cmd, n, mode: (run_pp if cmd == "pp" else run_tg)(n, mode))

if __name__ == "__main__":
    main()
