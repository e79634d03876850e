#!/usr/bin/env python3
"""What the supervised model process of `serve --rpc` costs per token: in-process vs child process.

    python bench/serve_supervised.py [--model PATH] [-n 256] [-r 5] [--streams 1] [--threads 1] [--json OUT]

Starts `deltarun.apps.serve` twice on 127.0.0.1 with the same model (the built-in one by default):
the worker in-process (`serve` without --rpc) and in a supervised child process (`serve --rpc`,
here `ServeSettings(supervise=True)` without RPC servers, so only the process boundary differs).
Each run streams `--streams` greedy completions of -n tokens (ignore_eos) at once; the figure is
the client's wall time from the first to the last content chunk per generated token and stream
step, median and minimum over -r runs that alternate between the two servers (on a busy machine
the minimum is the steadier figure). The difference is the pipe:
per worker step one pickled message with the step's events and metric calls, relayed by the
parent to the event loop.

The pipe alone is measured too (steadier than the end-to-end figure on a busy machine): a spawned
process sends 20,000 step messages shaped as the worker's (`--streams` events with a one-token
`Delta` each, and the metric calls of a decode step) and the parent receives and unpickles them:
microseconds per message, i.e. per decode step.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import functools
import json
import statistics
import time

import httpx

from deltarun.apps.serve.server import ServeHandle, ServeSettings
from deltarun.runner.model import Model


def stream_once(base: str, n: int) -> tuple[float, int]:
    body = {"prompt": "The", "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True}
    t_first = t_last = 0.0
    chunks = 0
    with httpx.stream("POST", base + "/v1/completions", json=body, timeout=600) as r:
        for ln in r.iter_lines():
            if ln.startswith("data: {"):
                now = time.perf_counter()
                t_first = t_first or now
                t_last = now
                chunks += 1
    return t_last - t_first, chunks


def run(base: str, n: int, streams: int) -> float:
    """Milliseconds per worker step (one token for each stream), first to last chunk."""
    with cf.ThreadPoolExecutor(streams) as ex:
        res = list(ex.map(lambda _: stream_once(base, n), range(streams)))
    spans = [s for s, _ in res]
    return 1000 * max(spans) / (n - 1)


def _step_message(streams: int) -> tuple:
    from deltarun.apps.serve.output import Delta
    from deltarun.apps.serve.worker import Event

    events = [(i + 1, Event(delta=Delta(content=" word"))) for i in range(streams)]
    calls = [(("decode_step",), (streams, 0.001), {}), (("running", "set"), (streams,), {})]
    return ("step", events, calls, (streams, 0))


def _send_steps(conn, streams: int, count: int) -> None:
    msg = _step_message(streams)
    for _ in range(count):
        conn.send(msg)
    conn.send(None)


def pipe_us_per_message(streams: int, count: int = 20000) -> float:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_send_steps, args=(child, streams, count))
    proc.start()
    child.close()
    first = parent.recv()           # the child is up: time the rest
    t0 = time.perf_counter()
    n = 1
    while parent.recv() is not None:
        n += 1
    dt = time.perf_counter() - t0
    proc.join()
    assert first is not None and n == count
    return 1e6 * dt / (n - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file [default: the built-in model]")
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("-r", "--repetitions", type=int, default=5)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from deltarun.cli.options import resolve_model

    path = resolve_model(a.model, quiet=True)
    opener = functools.partial(Model, path, n_ctx=max(1024, a.n + 64), n_seq_max=a.streams, n_threads=a.threads)
    times: dict[str, list[float]] = {"in-process": [], "supervised": []}
    handles = {"in-process": ServeHandle(opener, ServeSettings(parallel=a.streams)),
               "supervised": ServeHandle(opener, ServeSettings(parallel=a.streams, supervise=True))}
    for h in handles.values():
        h.start()
    try:
        for h in handles.values():
            run(h.base_url, 16, a.streams)      # warm-up: graphs built, caches touched
        for _ in range(a.repetitions):
            for name, h in handles.items():
                times[name].append(run(h.base_url, a.n, a.streams))
    finally:
        for h in handles.values():
            h.stop()
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    out = {"model": str(path), "n": a.n, "streams": a.streams, "threads": a.threads, "ms_per_step": times,
           "median_ms_per_step": med, "min_ms_per_step": best,
           "overhead_ms_per_step": {"median": med["supervised"] - med["in-process"],
                                    "min": best["supervised"] - best["in-process"]}}
    out["pipe_us_per_step_message"] = pipe_us_per_message(a.streams)
    for k in times:
        print(f"{k:>11}: {med[k]:.3f} ms per step median, {best[k]:.3f} min ({a.streams} stream(s), {a.n} tokens, "
              f"{a.repetitions} runs)")
    o = out["overhead_ms_per_step"]
    print(f"   overhead: {o['median']:+.3f} ms per step median, {o['min']:+.3f} min")
    print(f"       pipe: {out['pipe_us_per_step_message']:.1f} us per step message (pickle, send, receive, unpickle)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
