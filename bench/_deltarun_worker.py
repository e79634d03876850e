"""deltarun side of bench/compare_llamacpp.py: `deltarun bench`'s measurement, kept loaded.

Same protocol as bench/_llamacpp_worker.py (bench/_worker_protocol.py: JSON lines; each pp/tg
command = one warm-up run + one timed run). The model is opened exactly as `deltarun bench` opens it (deltarun.apps.bench:
context = bench_context, ubatch = --batch, threads, f16 KV, fused delta-net) and timed by the
same functions (`_time_pp`, `_time_tg`) on the same tokens, so a round costs no process start or
model load and the two engines can be interleaved closely.
"""

from __future__ import annotations

import argparse

import numpy as np

from deltarun.apps import bench as B
from deltarun.runner.ggml_util import ggml
from deltarun.runner.model import Model

from _worker_protocol import serve


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--kv-type", default="f16")
    args = ap.parse_args()

    cfg = B.BenchConfig(model=args.model, n_prompt=[args.pp], n_gen=[args.tg], threads=[args.threads],
                        batch=[args.batch], kv_type=args.kv_type)
    m = Model(args.model, backend="cpu", n_ctx=B.bench_context(cfg), n_batch=args.batch, n_threads=args.threads,
              kv_type=args.kv_type, delta_net=cfg.delta_net)
    rng = np.random.default_rng(B.TOKEN_SEED)
    tokens = rng.integers(0, m.hp.n_vocab, size=max(args.pp, B.TG_PROMPT), dtype=np.int64).tolist()

    def run(cmd: str, n: int, mode: str) -> float:
        return B._time_pp(m, tokens[:n]) if cmd == "pp" else B._time_tg(m, tokens[:B.TG_PROMPT], n)

    serve({"llamafile": int(ggml.ggml_cpu_has_llamafile()), "ggml": ggml.__file__}, run,
          extra=lambda: {"builds": m.stats.n_graph_builds})
    m.close()


if __name__ == "__main__":
    main()
