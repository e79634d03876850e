"""Event-loop stall of `deltarun serve` while hostile requests run beside a stream (issue 34).

    python bench/serve_hostile.py                       # the built-in model, --parallel 2
    python bench/serve_hostile.py --model m.gguf --seconds 30 --json out.json

Starts `deltarun serve` in a child process, then for each phase (`--seconds` each):

- `idle`: one stream only (the reference);
- `issue`: the stream, and 4 client processes each sending one of issue 34's probes again and again:
  `/tokenize` of "hello world " x 650,000 with pieces, `/detokenize` of 1.5M ids, a chat of 100,000
  tiny messages, a JSON body nested 100,000 deep;
- `at-limit`: the same but each probe as large as the server still accepts (the most work a request
  can make it do): /tokenize of as much text as it takes with pieces, /detokenize of 262,000 ids,
  a chat of 2048 messages, a body of 299,000 numbers.

Meanwhile this process sends `GET /health` every `--interval` seconds on one kept-alive connection
and times the answers: the event loop's stall is what they take beyond a quiet server's. The
stream's largest gap between chunks is reported too. Hostile clients are separate processes so
their own CPU work does not delay this one's probes (the server is another process again).

Numbers depend on the machine and its load (both are printed): a 2-core machine shared with other
work stalls more than the server alone would.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import subprocess
import sys
import threading
import time

import httpx

PROBES = ("tokenize", "detokenize", "messages", "nested")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown"


def _body(kind: str, at_limit: bool, n_ctx: int) -> bytes:
    """One hostile request body (see the module docstring)."""
    if kind == "tokenize":
        text = "hello world " * (n_ctx * 16 // 12 if at_limit else 650_000)
        return json.dumps({"content": text, "with_pieces": True}).encode()
    if kind == "detokenize":
        return json.dumps({"tokens": [5] * (262_000 if at_limit else 1_500_000)}).encode()
    if kind == "messages":
        n = 2048 if at_limit else 100_000
        return json.dumps({"messages": [{"role": "user", "content": "a"}] * n, "max_tokens": 1}).encode()
    if at_limit:
        return json.dumps({"messages": [{"role": "user", "content": "a"}], "max_tokens": 1,
                           "logit_bias": {}, "filler": [0] * 299_000}).encode()
    return b"[" * 100_000 + b"]" * 100_000


def _hostile(base: str, kind: str, at_limit: bool, n_ctx: int, until: float, out: "mp.Queue") -> None:
    path = {"tokenize": "/tokenize", "detokenize": "/detokenize"}.get(kind, "/v1/chat/completions")
    body = _body(kind, at_limit, n_ctx)
    statuses: dict[str, int] = {}
    with httpx.Client(base_url=base, timeout=120) as c:
        while time.monotonic() < until:
            try:
                r = c.post(path, content=body, headers={"content-type": "application/json"})
                key = str(r.status_code)
            except httpx.HTTPError as e:
                key = type(e).__name__
            statuses[key] = statuses.get(key, 0) + 1
    out.put((kind, statuses))


def _stream(base: str, stop: threading.Event, gaps: list[float]) -> None:
    """One long stream, restarted when it ends; records the gaps between its chunks."""
    with httpx.Client(base_url=base, timeout=120) as c:
        while not stop.is_set():
            body = {"messages": [{"role": "user", "content": "Tell me a long story"}], "max_tokens": 4000,
                    "ignore_eos": True, "stream": True}
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                last = None
                for line in r.iter_lines():
                    now = time.perf_counter()
                    if line.startswith("data:"):
                        if last is not None:
                            gaps.append(now - last)
                        last = now
                    if stop.is_set():
                        break


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run_phase(base: str, name: str, seconds: float, interval: float, n_ctx: int) -> dict:
    stop = threading.Event()
    gaps: list[float] = []
    streamer = threading.Thread(target=_stream, args=(base, stop, gaps), daemon=True)
    streamer.start()
    time.sleep(1.0)                                  # the stream is running
    until = time.monotonic() + seconds
    procs, results = [], mp.Queue()
    if name != "idle":
        for kind in PROBES:
            p = mp.Process(target=_hostile, args=(base, kind, name == "at-limit", n_ctx, until, results))
            p.start()
            procs.append(p)
    lat: list[float] = []
    with httpx.Client(base_url=base, timeout=60) as c:
        while time.monotonic() < until:
            t = time.perf_counter()
            c.get("/health")
            lat.append(time.perf_counter() - t)
            time.sleep(max(0.0, interval - (time.perf_counter() - t)))
    statuses = {}
    for p in procs:
        p.join(180)
    while not results.empty():
        kind, st = results.get()
        statuses[kind] = st
    stop.set()
    streamer.join(30)
    n_gaps = len(gaps)
    return {"phase": name, "health_n": len(lat), "health_p50_ms": 1e3 * _pct(lat, 0.5),
            "health_p99_ms": 1e3 * _pct(lat, 0.99), "health_max_ms": 1e3 * max(lat),
            "stream_chunks": n_gaps, "stream_gap_p99_ms": 1e3 * _pct(gaps, 0.99),
            "stream_gap_max_ms": 1e3 * max(gaps) if gaps else float("nan"), "hostile": statuses}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF to serve [default: the built-in model]")
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each phase")
    ap.add_argument("--interval", type=float, default=0.01, help="seconds between two /health probes")
    ap.add_argument("--phases", default="idle,issue,at-limit")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args()

    port = _free_port()
    cmd = [sys.executable, "-m", "deltarun", "serve", *([args.model] if args.model else []), "--port", str(port),
           "--parallel", str(args.parallel), "--ctx", str(args.ctx), "--threads", str(args.threads)]
    server = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                sys.exit("the server did not come up")
            time.sleep(0.2)
        info = {"cpu": _cpu_model(), "cores": os.cpu_count(), "loadavg_start": os.getloadavg(),
                "python": platform.python_version(), "model": args.model or "built-in", "parallel": args.parallel,
                "ctx": args.ctx}
        phases = [run_phase(base, name, args.seconds, args.interval, args.ctx) for name in args.phases.split(",")]
        info["loadavg_end"] = os.getloadavg()
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    print(f"machine: {info['cpu']}, {info['cores']} cores, load average {info['loadavg_start'][0]:.2f} -> "
          f"{info['loadavg_end'][0]:.2f}; model {info['model']}, --parallel {args.parallel}, --ctx {args.ctx}")
    print("| phase | /health probes | p50 ms | p99 ms | max ms | stream chunks | gap p99 ms | gap max ms | hostile answers |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in phases:
        hostile = "; ".join(f"{k}: " + ", ".join(f"{s} x{n}" for s, n in st.items()) for k, st in r["hostile"].items())
        print(f"| {r['phase']} | {r['health_n']} | {r['health_p50_ms']:.1f} | {r['health_p99_ms']:.1f} | "
              f"{r['health_max_ms']:.1f} | {r['stream_chunks']} | {r['stream_gap_p99_ms']:.1f} | "
              f"{r['stream_gap_max_ms']:.1f} | {hostile or '-'} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "phases": phases}, f, indent=1)


if __name__ == "__main__":
    main()
