"""deltarun side of bench/compare_llamacpp.py: `deltarun bench`'s measurement, kept loaded.

Same protocol as bench/_llamacpp_worker.py (bench/_worker_protocol.py: JSON lines; each pp/tg
command = one warm-up run + one timed run). The model is opened exactly as `deltarun bench` opens it (deltarun.apps.bench:
context = bench_context, ubatch = --ubatch, threads, f16 KV, fused delta-net) and timed by the
same functions (`_time_pp`, `_time_tg`; `_time_tg_parallel` and `_time_tg_depth` for the tgp and
tgd commands, on models opened for them on first use) on the same tokens, so a round costs no
process start or model load and the two engines can be interleaved closely. `profile` answers
with deltarun.apps.op_profile's profiles of a pp and a tg ubatch. `mtp` times greedy generation
of a text prompt as `deltarun generate --draft mtp --draft-max D` runs it (depth 0: without
drafts, on a model opened as `generate` opens one), on a model opened for each depth.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from deltarun.apps import bench as B
from deltarun.apps.op_profile import profile_ubatch
from deltarun.base.ggml_util import ggml
from deltarun.runner.generation import GenerationStats, generate_tokens
from deltarun.runner.model import Model
from deltarun.runner.sampling import GREEDY, Sampler
from deltarun.runner.speculative import MtpDraft

from _worker_protocol import serve


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, required=True)
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--kv-type", default="f16")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="time runs by wall time or by this process's CPU time (one thread only)")
    args = ap.parse_args()
    if args.clock == "cpu":
        import time

        B.CLOCK = time.process_time

    cfg = B.BenchConfig(model=args.model, n_prompt=[args.pp], n_gen=[args.tg], threads=[args.threads],
                        ubatch=[args.ubatch], kv_type=args.kv_type)
    m = Model(args.model, backend="cpu", n_ctx=B.bench_context(cfg), n_ubatch=args.ubatch, n_threads=args.threads,
              kv_type=args.kv_type, delta_net=cfg.delta_net)
    rng = np.random.default_rng(B.TOKEN_SEED)
    tokens = rng.integers(0, m.hp.n_vocab, size=max(args.pp, B.TG_PROMPT), dtype=np.int64).tolist()

    def run(cmd: str, n: int, mode: str) -> float:
        return B._time_pp(m, tokens[:n]) if cmd == "pp" else B._time_tg(m, tokens[:B.TG_PROMPT], n)

    others: dict[tuple, Any] = {}     # models opened for parallel / depth tests, kept for later rounds

    def open_other(key: tuple, n_ctx: int, n_seq_max: int = 1) -> Model:
        if key not in others:
            others[key] = Model(args.model, backend="cpu", n_ctx=n_ctx, n_ubatch=args.ubatch, n_threads=args.threads,
                                kv_type=args.kv_type, delta_net=cfg.delta_net, n_seq_max=n_seq_max)
        return others[key]

    def tgp(req: dict) -> dict:
        n, p = req["n"], req["p"]
        mp = open_other(("p", p, n), B.TG_PROMPT + n, p)
        prompts = B.parallel_prompts(tokens, p)
        B._time_tg_parallel(mp, prompts, n)                                   # warm-up
        return {"s": B._time_tg_parallel(mp, prompts, n)}

    depth_starts: dict[int, tuple] = {}

    def tgd(req: dict) -> dict:
        n, d = req["n"], req["d"]
        md = open_other(("d", d, n), d + n)
        if d not in depth_starts:
            ctx_tokens = np.random.default_rng(B.TOKEN_SEED).integers(0, md.hp.n_vocab, size=d).tolist()
            md.reset()
            first = md.eval(ctx_tokens)
            depth_starts[d] = (md.checkpoint(), first)
        start, first = depth_starts[d]
        B._time_tg_depth(md, start, first, n)                                  # warm-up
        return {"s": B._time_tg_depth(md, start, first, n)}

    def profile(req: dict) -> dict:
        n, reps = req["n"], req.get("reps", 3)
        cpu = args.clock == "cpu"
        pp = profile_ubatch(m, tokens[:n], repetitions=reps, threads=args.threads, test=f"pp{n}", cpu_clock=cpu)
        tg = profile_ubatch(m, tokens[:1], n_past_tokens=tokens[:B.TG_PROMPT], repetitions=reps,
                            threads=args.threads, test=f"tg1@{B.TG_PROMPT}", cpu_clock=cpu)
        m.reset()
        return {"pp": pp.as_dict(with_nodes=True), "tg": tg.as_dict(with_nodes=True)}

    def mtp(req: dict) -> dict:
        n, depth = req["n"], req["depth"]
        key = ("mtp", depth, n, req["prompt"])
        if key not in others:
            # what `generate --draft mtp --draft-max D` opens (cli.options.open_with_draft)
            others[key] = Model(args.model, backend="cpu", n_ctx=4096, n_ubatch=max(args.ubatch, depth + 1),
                                n_threads=args.threads, kv_type=args.kv_type, delta_net=cfg.delta_net,
                                mtp=depth > 0, rs_slots=depth + 1)
        mm = others[key]
        prompt = mm.tokenizer.encode(req["prompt"])

        def once() -> GenerationStats:
            mm.reset()
            stats = GenerationStats()
            source = MtpDraft(mm, defer=True) if depth else None
            for _ in generate_tokens(mm, prompt, n, Sampler(GREEDY), stats=stats, draft=source, draft_max=depth):
                pass
            if source is not None:
                source.close()
            return stats

        once()                                                                # warm-up
        st = once()
        return {"s": st.generate_seconds, "n": st.n_generated, "drafted": st.n_drafted,
                "accepted": st.n_accepted, "tokens": st.tokens}

    serve({"llamafile": int(ggml.ggml_cpu_has_llamafile()), "ggml": ggml.__file__}, run,
          extra=lambda: {"builds": m.stats.n_graph_builds},
          commands={"tgp": tgp, "tgd": tgd, "profile": profile, "mtp": mtp})
    for other in others.values():
        other.close()
    m.close()


if __name__ == "__main__":
    main()
