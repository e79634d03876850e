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

tgp (P sequences decoding together, several sequences per llama_decode), tgd (decoding after D
tokens of context; the context is evaluated once and the sequence state restored with
llama_state_seq_set_data before each run) and profile (per-node times through cb_eval) use
contexts of their own on the same loaded model, created on first use: see those functions.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path
from typing import Any

import numpy as np

import llama_cpp

from _worker_protocol import cpu_has_amx, rss_bytes, serve

TG_PROMPT = 16
TOKEN_SEED = 1234


def _ggml_base() -> Any:
    """llama-cpp-python's own libggml-base (tensor names and op names for the eval callback)."""
    lib = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"))
    for fn in ("ggml_op_desc", "ggml_get_name"):
        getattr(lib, fn).restype = ctypes.c_char_p
        getattr(lib, fn).argtypes = [ctypes.c_void_p]
    return lib


ggml_base = _ggml_base()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--kv-type", default="f16")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="time runs by wall time or by this process's CPU time (one thread only)")
    args = ap.parse_args()
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    node_ns = time.thread_time_ns if args.clock == "cpu" else time.perf_counter_ns   # the profile's clock

    kv = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32, "q8_0": llama_cpp.GGML_TYPE_Q8_0}
    extra_bufts = not cpu_has_amx()
    if not extra_bufts:        # Llama() takes them from llama_model_default_params, which has no argument for it
        defaults = llama_cpp.llama_cpp.llama_model_default_params

        def without_extra_bufts() -> Any:
            p = defaults()
            p.use_extra_bufts = False
            return p
        llama_cpp.llama_cpp.llama_model_default_params = without_extra_bufts
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
        t0 = clock()
        if mode == "eval":
            llm.eval(toks)
        else:
            decode_raw(toks)
        return clock() - t0

    def run_tg(n: int, mode: str) -> float:
        reset()
        prompt = tokens[:TG_PROMPT]
        if mode == "eval":
            llm.eval(prompt)
            tok = last_logits_argmax()
            t0 = clock()
            for _ in range(n):
                llm.eval([tok])
                tok = last_logits_argmax()
        else:
            decode_raw(prompt)
            tok = last_logits_argmax()
            t0 = clock()
            for _ in range(n):
                tok_buf[0] = tok
                rc = llama_cpp.llama_decode(ctx, llama_cpp.llama_batch_get_one(tok_buf, 1))
                if rc != 0:
                    raise RuntimeError(f"llama_decode returned {rc}")
                tok = last_logits_argmax()
        return clock() - t0

    # ---- contexts of their own for batched decoding, long contexts and the eval-callback profile
    def new_context(n_ctx: int, n_seq_max: int = 1, cb_eval: Any = None) -> Any:
        params = llama_cpp.llama_context_params.from_buffer_copy(llm.context_params)
        params.n_ctx, params.n_seq_max = n_ctx, n_seq_max
        params.n_batch = params.n_ubatch = args.batch     # Llama() may have lowered them to its n_ctx
        if cb_eval is not None:
            params.cb_eval = cb_eval
        c = llama_cpp.llama_init_from_model(llm.model, params)
        if not c:
            raise RuntimeError(f"llama_init_from_model failed (n_ctx {n_ctx}, n_seq_max {n_seq_max})")
        return c

    contexts: dict[tuple, Any] = {}
    batches: dict[int, Any] = {}

    def batch_of(n: int) -> Any:
        if n not in batches:
            batches[n] = llama_cpp.llama_batch_init(n, 0, 1)
        return batches[n]

    def decode_seqs(c: Any, items: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, pos, seq, wants logits) items."""
        b = batch_of(len(items))
        for i, (tok, pos, seq, out) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, out
            b.seq_id[i][0] = seq
        b.n_tokens = len(items)
        rc = llama_cpp.llama_decode(c, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax_ith(c: Any, i: int) -> int:
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(c, i), shape=(n_vocab,))))

    def parallel_run(c: Any, p: int, n: int) -> float:
        """P sequences: a 16-token prompt each in one batch (as deltarun's parallel_prompts), then N
        steps of one llama_decode with one token per sequence."""
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(c), True)
        items = [(tokens[(s * TG_PROMPT + i) % len(tokens)], i, s, i == TG_PROMPT - 1)
                 for s in range(p) for i in range(TG_PROMPT)]
        decode_seqs(c, items)
        nxt = [argmax_ith(c, (s + 1) * TG_PROMPT - 1) for s in range(p)]
        t0 = clock()
        for step in range(n):
            decode_seqs(c, [(nxt[s], TG_PROMPT + step, s, True) for s in range(p)])
            nxt = [argmax_ith(c, s) for s in range(p)]
        return clock() - t0

    def tgp(req: dict) -> dict:
        n, p = req["n"], req["p"]
        key = ("p", p, n)
        if key not in contexts:   # per-sequence cache (kv_unified off): n_ctx is split between sequences
            contexts[key] = new_context(p * (TG_PROMPT + n), p)
        parallel_run(contexts[key], p, n)                                        # warm-up
        return {"s": parallel_run(contexts[key], p, n)}

    depth_states: dict[int, tuple] = {}

    def tgd(req: dict) -> dict:
        n, d = req["n"], req["d"]
        key = ("d", d, n)
        if key not in contexts:
            contexts[key] = new_context(d + n)
        c = contexts[key]
        if d not in depth_states:   # the context once; its sequence state is restored before each run
            ctx_tokens = np.random.default_rng(TOKEN_SEED).integers(0, n_vocab, size=d).tolist()
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(c), True)
            for i in range(0, d, args.batch):
                chunk = ctx_tokens[i:i + args.batch]
                decode_seqs(c, [(t, i + j, 0, i + j == d - 1) for j, t in enumerate(chunk)])
            first = argmax_ith(c, -1)
            size = llama_cpp.llama_state_seq_get_size(c, 0)
            buf = (ctypes.c_uint8 * size)()
            if llama_cpp.llama_state_seq_get_data(c, buf, size, 0) != size:
                raise RuntimeError("llama_state_seq_get_data failed")
            depth_states[d] = (buf, size, first)
        buf, size, first = depth_states[d]

        def run() -> float:
            llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(c), True)
            if llama_cpp.llama_state_seq_set_data(c, buf, size, 0) != size:
                raise RuntimeError("llama_state_seq_set_data failed")
            tok = first
            t0 = clock()
            for step in range(n):
                decode_seqs(c, [(tok, d + step, 0, True)])
                tok = argmax_ith(c, 0)
            return clock() - t0

        run()                                                                    # warm-up
        return {"s": run()}

    node_clock: dict[str, Any] = {"nodes": [], "last": 0, "first": True, "no_ops": set()}

    def observe(t: Any, ask: bool, user_data: Any) -> bool:
        now = node_ns()
        if ask:
            if node_clock["first"]:
                node_clock["first"], node_clock["last"] = False, now
            op = (ggml_base.ggml_op_desc(t) or b"?").decode()
            node_clock["nodes"].append([(ggml_base.ggml_get_name(t) or b"").decode(errors="replace"), op, 0.0])
            return op not in node_clock["no_ops"]
        node_clock["nodes"][-1][2] = (now - node_clock["last"]) * 1e-9
        node_clock["last"] = now
        return True

    observe_c = llama_cpp.ggml_backend_sched_eval_callback(observe)   # alive as long as the worker

    def profile(req: dict) -> dict:
        """Per-node times through llama.cpp's eval callback (cb_eval), the way deltarun's
        op_profile takes them: every node the scheduler asks about is recorded in order; computed
        nodes are asked for (so the scheduler computes them one by one) and a node's time runs
        from the previous callback to its own ask=False call; the first starts at the first ask."""
        n, reps = req["n"], req.get("reps", 3)
        node_clock["no_ops"] = set(req["no_ops"])
        if "profile" not in contexts:
            contexts["profile"] = new_context(args.ctx, 1, observe_c)
        pc = contexts["profile"]

        def profiled(kind: str) -> dict:
            runs, plain = [], []
            for c in (ctx, pc):
                llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(c), True)
                if kind == "tg":
                    decode_seqs(c, [(t, i, 0, i == TG_PROMPT - 1) for i, t in enumerate(tokens[:TG_PROMPT])])
            pos = TG_PROMPT
            for r in range(reps + 1):                                      # the first run is a warm-up
                items = ([(tokens[0], pos, 0, True)] if kind == "tg"
                         else [(t, i, 0, i == n - 1) for i, t in enumerate(tokens[:n])])
                for c in (ctx, pc):
                    if kind == "pp":
                        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(c), True)
                    node_clock["nodes"], node_clock["first"] = [], True
                    t0 = clock()
                    decode_seqs(c, items)
                    if r and c is ctx:
                        plain.append(clock() - t0)
                    if r and c is pc:
                        runs.append(node_clock["nodes"])
                pos += 1
            nodes = [[name, op, [run[i][2] for run in runs]] for i, (name, op, _) in enumerate(runs[0])]
            if any(len(run) != len(runs[0]) for run in runs):
                raise RuntimeError("llama.cpp computed graphs of different sizes across profiled runs")
            return {"nodes": nodes, "plain_s": plain}

        return {"pp": profiled("pp"), "tg": profiled("tg")}

    serve({"n_vocab": n_vocab, "rss": rss_bytes(), "llama_cpp_python": llama_cpp.__version__, "extra_bufts": extra_bufts,
           "system_info": llama_cpp.llama_print_system_info().decode(errors="replace")},
          lambda cmd, n, mode: (run_pp if cmd == "pp" else run_tg)(n, mode),
          commands={"tgp": tgp, "tgd": tgd, "profile": profile})

if __name__ == "__main__":
    main()
