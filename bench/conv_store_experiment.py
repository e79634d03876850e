#!/usr/bin/env python3
"""Experiment (not applied to the graph): the conv-state store as one ggml_cpy when K == 1.

    python bench/conv_store_experiment.py [--model PATH] [--threads 1] [--reps 5]

deltarun stores the last d_conv-1 columns of each linear layer's conv input with ONE set_rows
into the rollback slots (`graphs.blocks.delta_net.write_conv_slots`, indexed by rs_s_slot_rev). Without rollback
slots (K = --rs-slots = 1, the default) that set_rows copies 3-float rows, conv_dim of them per
layer and token, and shows up as ~2.5 % of a decode step in `perf` (llama.cpp uses a plain copy).
This script patches the builder in-process so that for K == 1 the store is a ggml_cpy of the
same view, checks that 40 decode steps give bit-identical logits, and times tg128 both ways in
separate processes.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import numpy as np

DEFAULT_MODEL = "/tmp/drbench/bench-q8_0.gguf"


def patch() -> None:
    from deltarun.base.ggml_util import ggml, nb
    from deltarun.graphs.blocks import delta_net as D

    orig = D.write_conv_slots

    def write_conv_slots(g, rs, conv_all, conv_input, il):
        if g.mem.rs_slots != 1 or rs.kw != 1:
            return orig(g, rs, conv_all, conv_input, il)
        hp, ub, c = g.hp, g.ub, g.ctx
        dc1, ch, T, N = hp.ssm_d_conv - 1, hp.conv_dim, ub.n_seq_tokens, ub.n_seqs
        src = g.view(conv_input, (dc1, ch, N), (nb(conv_input)[1], nb(conv_input)[2]), T * 4)
        dst = g.view(conv_all, (dc1, ch, N), (dc1 * 4, nb(conv_all)[1]), ub.seq_head * nb(conv_all)[1])
        g.expand(g.cb(ggml.ggml_cpy(c, src, dst), "conv_state_store", il))

    D.write_conv_slots = write_conv_slots


def child(variant: str, model: str, threads: int, reps: int) -> None:
    if variant == "cpy":
        patch()
    from deltarun.runner.model import Model

    m = Model(model, n_ctx=512, n_threads=threads)
    toks = np.random.default_rng(1234).integers(0, m.hp.n_vocab, size=512).tolist()
    m.reset()
    logits = m.eval(toks[:16])
    steps = []
    for _ in range(40):
        logits = m.eval([int(np.argmax(logits))])
        steps.append(logits)
    np.save(f"/tmp/conv_store_{variant}.npy", np.stack(steps))

    def tg() -> float:
        m.reset()
        lg = m.eval(toks[:16])
        t = time.perf_counter()
        for _ in range(128):
            lg = m.eval([int(np.argmax(lg))])
        return time.perf_counter() - t

    tg()
    print(" ".join(f"{tg():.4f}" for _ in range(reps)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", choices=["setrows", "cpy"])
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.model, args.threads, args.reps)
    times: dict[str, list[float]] = {"setrows": [], "cpy": []}
    for _ in range(args.rounds):
        for v in times:
            out = subprocess.run([sys.executable, __file__, "--child", v, "--model", args.model, "--threads",
                                  str(args.threads), "--reps", str(args.reps)], capture_output=True, text=True,
                                 check=True).stdout
            times[v] += [float(x) for x in out.split()]
    a, b = np.load("/tmp/conv_store_setrows.npy"), np.load("/tmp/conv_store_cpy.npy")
    print(f"logits over 40 decode steps: max |set_rows - cpy| = {np.abs(a - b).max()}")
    for v, ts in times.items():
        print(f"{v:8s} tg128 median {statistics.median(ts):.3f} s  ({128 / statistics.median(ts):.1f} t/s)  "
              f"all: {', '.join(f'{t:.3f}' for t in ts)}")
    print(f"cpy / set_rows time: {statistics.median(times['cpy']) / statistics.median(times['setrows']):.3f}")


if __name__ == "__main__":
    main()
