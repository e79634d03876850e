#!/usr/bin/env python3
"""Load time and resident memory: the real 151k vocabulary, and a multi-GB GGUF.

    python bench/load_time.py                  # vocab file + /tmp/drbench/big-f16.gguf (written once)
    python bench/load_time.py --stock          # also time plain gguf.GGUFReader on the vocab (slow)
    python bench/load_time.py --llama          # also load the big file with llama.cpp (bench venv)

Every measurement runs in a fresh Python process (imports excluded from the timed part, page
cache warm: the file was read before). The big file is the Qwen3-Next architecture written by
deltarun.model_files.generate with hidden 2048, 8 layers, 16 experts, F16, and the real Qwen2
vocabulary of llama.cpp's ggml-vocab-qwen2.gguf (151,936 tokens, 151,387 merges: where
deltarun.model_files.vocab.qwen2_vocab_path finds it), so its metadata is as heavy as a real
Qwen3-Next file's; it goes to /tmp, never into the repo.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
from deltarun.model_files.vocab import qwen2_vocab_path  # noqa: E402

VOCAB = Path(qwen2_vocab_path())
BIG = Path("/tmp/drbench/big-f16.gguf")

PRELUDE = r"""
import json, resource, sys, time
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
"""

VOCAB_FAST = PRELUDE + r"""
from deltarun.base.gguf_file import GGUFFile
from deltarun.base.tokenizer import Tokenizer
path = sys.argv[1]
r0 = rss(); t0 = time.perf_counter(); c0 = time.process_time()
f = GGUFFile(path)
t1 = time.perf_counter()
tok = Tokenizer.from_gguf(f.reader)
t2 = time.perf_counter()
print(json.dumps({"GGUFFile_s": t1 - t0, "tokenizer_s": t2 - t1, "total_s": t2 - t0,
                  "cpu_s": time.process_time() - c0, "n_vocab": tok.n_vocab, "rss_delta": rss() - r0}))
"""

VOCAB_STOCK = PRELUDE + r"""
import gguf
from deltarun.base.tokenizer import Tokenizer
path = sys.argv[1]
t0 = time.perf_counter()
r = gguf.GGUFReader(path)
t1 = time.perf_counter()
tok = Tokenizer.from_gguf(r)
t2 = time.perf_counter()
print(json.dumps({"GGUFReader_s": t1 - t0, "tokenizer_s": t2 - t1, "total_s": t2 - t0}))
"""

MODEL_LOAD = PRELUDE + r"""
import numpy as np
from deltarun.runner.model import Model
path, ctx = sys.argv[1], int(sys.argv[2])
r0 = rss(); t0 = time.perf_counter(); c0 = time.process_time()
m = Model(path, n_ctx=ctx, n_threads=2)
t1 = time.perf_counter()
after_load = rss()
state = m.memory.nbytes
logits = m.eval(list(range(16)))
for _ in range(8):
    logits = m.eval([int(np.argmax(logits))])
after_gen = rss()
print(json.dumps({"load_s": t1 - t0, "load_cpu_s": time.process_time() - c0, "rss_before": r0,
                  "rss_after_load": after_load, "rss_after_24_tokens": after_gen, "state_bytes": state,
                  "compute_buffer": m.sched.compute_buffer_size(), "n_vocab": m.hp.n_vocab,
                  "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

LLAMA_LOAD = PRELUDE + r"""
import llama_cpp
path, ctx = sys.argv[1], int(sys.argv[2])
r0 = rss(); t0 = time.perf_counter()
llm = llama_cpp.Llama(path, n_ctx=ctx, n_threads=2, n_threads_batch=2, verbose=False)
t1 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "rss_before": r0, "rss_after_load": rss()}))
"""


def run(python: str, code: str, *argv: str) -> dict:
    r = subprocess.run([python, "-c", code, *argv], capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def write_big(path: Path) -> None:
    """The Qwen3-Next generator's file, with the real vocabulary and a bigger config."""
    from deltarun.model_files import generate as gen

    cfg = gen.ModelConfig(n_embd=2048, n_layer=8, n_head=16, n_head_kv=2, head_dim=128, n_rot=64,
                          ssm_d_state=128, ssm_n_k_heads=16, ssm_n_v_heads=32, n_expert=16, n_expert_used=4,
                          n_ff_exp=512, n_ff_shexp=512, vocab="qwen2")
    gen.write_model(path, cfg, "f16", name="deltarun synthetic qwen3next big f16 (real vocab)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--big", default=str(BIG))
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--stock", action="store_true", help="also time plain gguf.GGUFReader on the vocab")
    ap.add_argument("--llama", action="store_true", help="also load the big file with llama.cpp")
    args = ap.parse_args()
    py = sys.executable
    mib = 2 ** 20

    if VOCAB.exists():
        rows = [run(py, VOCAB_FAST, str(VOCAB)) for _ in range(args.repeat)]
        best = min(rows, key=lambda d: d["total_s"])
        every = ", ".join(f"{d['total_s']:.3f}" for d in rows)
        print(f"vocab {VOCAB.name} ({VOCAB.stat().st_size / mib:.1f} MiB, {best['n_vocab']} tokens): "
              f"GGUFFile {best['GGUFFile_s']:.3f} s + Tokenizer.from_gguf {best['tokenizer_s']:.3f} s = "
              f"{best['total_s']:.3f} s (best of {args.repeat}; all: {every}); cpu {best['cpu_s']:.3f} s")
        if args.stock:
            d = run(py, VOCAB_STOCK, str(VOCAB))
            print(f"  plain gguf.GGUFReader: {d['GGUFReader_s']:.2f} s + Tokenizer.from_gguf "
                  f"{d['tokenizer_s']:.2f} s = {d['total_s']:.2f} s")

    big = Path(args.big)
    if not big.exists():
        print(f"writing {big} (takes a minute or two)", file=sys.stderr, flush=True)
        write_big(big)
    size = big.stat().st_size
    rows = [run(py, MODEL_LOAD, str(big), str(args.ctx)) for _ in range(args.repeat)]
    best = min(rows, key=lambda d: d["load_s"])
    every = ", ".join(f"{d['load_s']:.3f}" for d in rows)
    print(f"model {big.name} ({size / 2**30:.2f} GiB, n_vocab {best['n_vocab']}), ctx {args.ctx}: "
          f"Model() {best['load_s']:.3f} s (best of {args.repeat}; all: {every}); cpu {best['load_cpu_s']:.3f} s")
    print(f"  RSS before {best['rss_before'] / mib:.0f} MiB, after load {best['rss_after_load'] / mib:.0f} MiB "
          f"(+{(best['rss_after_load'] - best['rss_before']) / mib:.0f}), after 24 tokens "
          f"{best['rss_after_24_tokens'] / mib:.0f} MiB; file {size / mib:.0f} MiB, compute buffer "
          f"{best['compute_buffer'] / mib:.0f} MiB, KV + recurrent state {best['state_bytes'] / mib:.0f} MiB, "
          f"peak {best['peak'] / mib:.0f} MiB")
    if args.llama:
        sys.path.insert(0, str(HERE))
        from bench_envs import LLAMACPP

        d = run(str(LLAMACPP.ensure()), LLAMA_LOAD, str(big), str(args.ctx))
        print(f"  llama.cpp (llama-cpp-python, mmap): load {d['load_s']:.3f} s, RSS after load "
              f"{d['rss_after_load'] / mib:.0f} MiB (+{(d['rss_after_load'] - d['rss_before']) / mib:.0f})")


if __name__ == "__main__":
    main()
