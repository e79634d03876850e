#!/usr/bin/env python3
"""pp/tg with the layers local, on one and on two loopback RPC servers, and the bytes they exchange.

    python bench/rpc_bench.py [--model PATH] [--type q8_0] [-p 512] [-n 128] [-r 3] [--threads 2]
                              [--json OUT]

Starts two `deltarun rpc-server` processes on 127.0.0.1 and measures, with deltarun's bench loop
(`apps.bench.iter_bench`: a warm-up, then -r runs), pp<P> and tg<N> for

  local     every layer on the local CPU (no RPC);
  rpc x1    every layer and the output on server A (`--backend rpc:A`, the token embeddings local);
  rpc x2    the layers split 1:1 over A and B, the output on B (`--rpc A,B --tensor-split 1,1,0`);
  rpc+local the layers split 1:1 over A and the local CPU, the output local (`--rpc A -ts 1,1`).

Then the traffic: each configuration again through counting TCP proxies in front of the servers
(byte counts and messages in each direction, parsed from ggml-rpc's framing: requests
| cmd u8 | size u64 | payload |, answers | size u64 | data |), over a 16-token prompt, one decode
step (its graph replaces the prompt's, so each server receives the whole graph again: reported as
graph_switch_bytes) and then 64 decoded tokens (each server re-runs the graph it has,
GRAPH_RECOMPUTE); reported per decoded token and per prompt token. Every answer is a round trip
the client waits for. From that, what a 1 Gbit/s link would allow: the bandwidth ceiling
(1e9 / 8 / bytes per token) and tg estimated as 1 / (loopback time per token + bytes x 8 / 1e9 +
round trips x RTT) for a LAN round-trip time of 0.2 ms.

The servers and the client share this machine's cores, so the RPC rows measure the protocol's cost
on loopback, not the speed of two machines.
"""

from __future__ import annotations

import argparse
import json
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

RTT_S = 0.2e-3
LINK_BPS = 1e9


class Counter:
    """Bytes and messages seen in one direction of a proxied stream (ggml-rpc framing)."""

    def __init__(self, requests: bool):
        self.requests = requests        # client->server: | cmd | size | payload |; else | size | data |
        self.bytes = 0
        self.messages = 0
        self._buf = b""
        self._skip = 0
        self.by_cmd: dict[int, list[int]] = {}     # requests: command -> [count, bytes]
        self.lock = threading.Lock()

    def feed(self, data: bytes) -> None:
        with self.lock:
            self.bytes += len(data)
            head = 9 if self.requests else 8
            while data:
                if self._skip:
                    n = min(self._skip, len(data))
                    self._skip -= n
                    data = data[n:]
                    continue
                need = head - len(self._buf)
                self._buf += data[:need]
                data = data[need:]
                if len(self._buf) == head:
                    size = struct.unpack("<Q", self._buf[-8:])[0]
                    self.messages += 1
                    if self.requests:
                        c = self.by_cmd.setdefault(self._buf[0], [0, 0])
                        c[0] += 1
                        c[1] += head + size
                    self._buf = b""
                    self._skip = size

    def snapshot(self) -> tuple[int, int]:
        with self.lock:
            return self.bytes, self.messages


class Proxy:
    """A loopback TCP proxy to `target` that counts what passes."""

    def __init__(self, target: tuple[str, int]):
        self.target = target
        self.up, self.down = Counter(True), Counter(False)
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._pump, args=(client, server, self.up), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, self.down), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, counter: Counter) -> None:
        try:
            while True:
                data = src.recv(1 << 20)
                if not data:
                    break
                counter.feed(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def totals(self) -> tuple[int, int, int, int]:
        (ub, um), (db, dm) = self.up.snapshot(), self.down.snapshot()
        return ub, um, db, dm


def start_server(threads: int) -> tuple[subprocess.Popen, str]:
    from deltarun.runner import rpc

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "deltarun", "rpc-server", "--port", str(port), "--threads",
                             str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            preexec_fn=lambda: __import__("ctypes").CDLL(None).prctl(1, 15))  # die with us
    ep = f"127.0.0.1:{port}"
    for _ in range(150):
        try:
            rpc.probe(ep, timeout=2)
            return proc, ep
        except rpc.RpcError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"rpc-server on {ep} did not start")


def traffic(model: Path, threads: int, opts: dict, proxies: list[Proxy], n_prompt: int = 16,
            n_decode: int = 64) -> dict:
    """Bytes and messages per prompt token and per decoded token through the proxies."""
    from deltarun.runner.model import Model

    def total() -> np.ndarray:
        return np.array([p.totals() for p in proxies], dtype=np.int64).sum(axis=0) if proxies else np.zeros(4)

    with Model(model, n_ctx=512, n_ubatch=512, n_threads=threads, **opts) as m:
        rng = np.random.default_rng(0)
        toks = rng.integers(0, m.hp.n_vocab, n_prompt).tolist()
        m.eval(toks[:4])          # graphs of both shapes exist before counting
        m.eval(toks[4:5])
        m.reset()
        t0 = total()
        logits = m.eval(toks)
        t1 = total()
        logits = m.eval([int(np.argmax(logits))])      # the decode graph replaces the prompt's
        t2 = total()
        for _ in range(n_decode):
            logits = m.eval([int(np.argmax(logits))])
        t3 = total()
    pp, first, tg = (t1 - t0) / n_prompt, t2 - t1, (t3 - t2) / n_decode
    return {"prompt_up_bytes": float(pp[0]), "prompt_down_bytes": float(pp[2]),
            "graph_switch_bytes": float(first[0] + first[2] - (tg[0] + tg[2])),
            "tg_up_bytes": float(tg[0]), "tg_down_bytes": float(tg[2]), "tg_bytes": float(tg[0] + tg[2]),
            "tg_requests": float(tg[1]), "tg_answers": float(tg[3])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--type", default="q8_0")
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from deltarun.apps.bench import BenchConfig, iter_bench

    model = args.model
    if model is None:
        from deltarun.model_files.generate import write_model

        model = Path(tempfile.gettempdir()) / f"deltarun-bench-{args.type}.gguf"
        if not model.exists():
            write_model(model, "bench", args.type)
    servers = [start_server(args.threads) for _ in range(2)]
    (pa, a), (pb, b) = servers
    configs = {"local": {}, "rpc x1": {"backend": f"rpc:{a}"}, "rpc x2": {"rpc": f"{a},{b}", "tensor_split": "1,1,0"},
               "rpc+local": {"rpc": a, "tensor_split": "1,1"}}
    rows = []
    try:
        for label, opts in configs.items():
            cfg = BenchConfig(model=model, n_prompt=[args.p], n_gen=[args.n], threads=[args.threads], batch=[512],
                              backends=[opts.get("backend", "cpu")], repetitions=args.r, rpc=opts.get("rpc"),
                              tensor_split=opts.get("tensor_split"))
            res = {r.kind: r for r in iter_bench(cfg)}
            proxies = []
            popts = dict(opts)
            if "backend" in popts:
                proxies = [Proxy(("127.0.0.1", int(a.split(":")[1])))]
                popts["backend"] = f"rpc:{proxies[0].endpoint}"
            elif "rpc" in popts:
                eps = popts["rpc"].split(",")
                proxies = [Proxy(("127.0.0.1", int(e.split(":")[1]))) for e in eps]
                popts["rpc"] = ",".join(p.endpoint for p in proxies)
            tr = traffic(model, args.threads, popts, proxies)
            row = {"config": label, "placement": backend_label_from(model, args.threads, opts),
                   "pp_tps": res["pp"].avg_tps, "pp_sd": res["pp"].stddev_tps, "tg_sd": res["tg"].stddev_tps,
                   "tg_tps": res["tg"].avg_tps, **tr}
            if tr["tg_bytes"]:
                link = row["tg_bytes"] * 8 / LINK_BPS
                row["link_ceiling_tps"] = 1 / link
                row["est_1gbit_tg_tps"] = 1 / (1 / row["tg_tps"] + link + row["tg_answers"] * RTT_S)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        for p, _ in servers:
            p.terminate()
            p.wait(10)
    print_table(rows, args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def backend_label_from(model: Path, threads: int, opts: dict) -> str:
    from deltarun.apps.bench import backend_label
    from deltarun.runner.model import Model

    with Model(model, n_ctx=64, n_ubatch=64, n_threads=threads, **opts) as m:
        return backend_label(m)


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\n| config | placement | pp{args.p} t/s | tg{args.n} t/s | bytes/decoded token (up + down) | "
          f"answers/token | bytes/prompt token | graph resend bytes | 1 Gbit/s ceiling t/s | "
          f"est. tg at 1 Gbit/s, 0.2 ms RTT |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        if r["tg_bytes"]:
            extra = (f"{r['tg_up_bytes']:,.0f} + {r['tg_down_bytes']:,.0f} | {r['tg_answers']:.1f} | "
                     f"{r['prompt_up_bytes'] + r['prompt_down_bytes']:,.0f} | {r['graph_switch_bytes']:,.0f} | "
                     f"{r['link_ceiling_tps']:,.0f} | "
                     f"{r['est_1gbit_tg_tps']:.1f}")
        else:
            extra = "- | - | - | - | - | -"
        print(f"| {r['config']} | {r['placement']} | {r['pp_tps']:.1f} ± {r['pp_sd']:.1f} | "
              f"{r['tg_tps']:.1f} ± {r['tg_sd']:.1f} | {extra} |")


if __name__ == "__main__":
    main()
