#!/usr/bin/env python3
"""The machine's memory-read bandwidth, and what it allows a decoded token (issue 16's method).

    python bench/membw.py                                  # bandwidth: 2 processes, 1 GiB each
    python bench/membw.py --model /tmp/drbench/bench-vocab151k-q8_0.gguf --tps 40.2

Bandwidth: P processes (default: one per CPU of the affinity mask) each allocate their own
float32 array (--mib each, far larger than any cache), touch it once, wait at a barrier, and then
sum it --reps times with numpy (one pass reads the whole array; the sum itself is a few
instructions per 64-byte line, so the loop is bound by reading memory). Aggregate GB/s = all
bytes read / the wall time from the barrier until the last process finishes; the best of --rounds
rounds is reported, and every round. numpy's summation is single-threaded, so each process is one
reader. The same bytes over each process's own CPU time give a second figure that other
processes' time slices do not lower (memory traffic of other work still does); --cpu-time takes
the limit from that one.

Bytes a decoded token reads (with --model): every weight tensor once, except the token embedding
(one row) and the routed experts (`*_exps`: n_expert_used of n_expert, the rest are not touched),
plus the recurrent state of each linear-attention layer read and written once (conv + delta-net
state, F32) and the KV rows of the attention layers at the bench's 16-token context (negligible).
The limit is bandwidth / bytes per token; --tps gives a measured decoding speed to express as a
fraction of it.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time


def _reader(n_floats: int, reps: int, barrier, out) -> None:   # type: ignore[no-untyped-def]
    import numpy as np

    a = np.ones(n_floats, dtype=np.float32)
    a.sum()                                     # touch every page before timing
    barrier.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(reps):
        a.sum()
    out.put((t0, time.perf_counter(), a.nbytes * reps, time.process_time() - c0))


def bandwidth(n_proc: int, mib: int, reps: int) -> tuple[float, float]:
    """Aggregate read bandwidth in bytes/s of n_proc concurrent numpy readers: by wall time, and
    by each process's CPU time (what the readers would get with the cores to themselves: on a
    shared machine other processes take time slices, which lowers the first, not the second)."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(n_proc), ctx.Queue()
    procs = [ctx.Process(target=_reader, args=(mib * 2**20 // 4, reps, barrier, out)) for _ in range(n_proc)]
    for p in procs:
        p.start()
    res = [out.get() for _ in procs]
    for p in procs:
        p.join()
    start = min(r[0] for r in res)
    end = max(r[1] for r in res)
    return sum(r[2] for r in res) / (end - start), sum(r[2] / r[3] for r in res)


def bytes_per_token(path: str) -> dict[str, int]:
    """Weights and recurrent state a one-token decode of `path` reads (see the module docstring)."""
    from deltarun.base.gguf_file import GGUFFile
    from deltarun.graphs.qwen3next import Qwen3NextFamily

    f = GGUFFile(path)
    hp = Qwen3NextFamily.read_hparams(f)
    weights = 0
    for name, t in f.tensors.items():
        if name.startswith("blk.") and int(name.split(".")[1]) >= hp.n_layer:
            continue                             # MTP block: not used by plain decoding
        if name == "token_embd.weight":
            weights += t.nbytes // hp.n_vocab
        elif "_exps" in name:
            weights += t.nbytes * hp.n_expert_used // hp.n_expert
        else:
            weights += t.nbytes
    conv_dim = 2 * hp.key_dim + hp.value_dim
    state_per_layer = 4 * (conv_dim * (hp.ssm_d_conv - 1) + hp.ssm_d_state * hp.ssm_d_state * hp.ssm_n_v_heads)
    state = 2 * state_per_layer * len(hp.linear_layers)
    return {"weights": weights, "state": state, "total": weights + state}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--mib", type=int, default=1024, help="array size per process")
    ap.add_argument("--reps", type=int, default=10, help="passes over the array per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cpu-time", action="store_true",
                    help="take the limit from the CPU-time bandwidth (on a shared, busy machine)")
    ap.add_argument("--model", action="append", default=[], help="GGUF: bytes per decoded token and the limit")
    ap.add_argument("--tps", type=float, action="append", default=[],
                    help="measured decoding t/s of each --model, to report as a fraction of the limit")
    args = ap.parse_args()
    load0 = os.getloadavg()[0]
    runs = [bandwidth(args.procs, args.mib, args.reps) for _ in range(args.rounds)]
    best, best_cpu = max(r[0] for r in runs), max(r[1] for r in runs)
    print(f"read bandwidth, {args.procs} processes x {args.mib} MiB, numpy sum: best {best / 1e9:.1f} GB/s by wall "
          f"time (rounds: {', '.join(f'{r[0] / 1e9:.1f}' for r in runs)}), {best_cpu / 1e9:.1f} GB/s by CPU time "
          f"(rounds: {', '.join(f'{r[1] / 1e9:.1f}' for r in runs)}); 1-min load {load0:.1f} -> "
          f"{os.getloadavg()[0]:.1f}")
    if args.cpu_time:
        best = best_cpu
    for i, path in enumerate(args.model):
        b = bytes_per_token(path)
        limit = best / b["total"]
        line = (f"{os.path.basename(path)}: {b['weights'] / 1e6:.1f} MB weights + {b['state'] / 1e6:.1f} MB "
                f"recurrent state per token -> at most {limit:.1f} t/s")
        if i < len(args.tps):
            line += f"; measured {args.tps[i]:.1f} t/s = {args.tps[i] / limit:.2f} of the limit"
        print(line)


if __name__ == "__main__":
    main()
