#!/usr/bin/env python3
"""deltarun against llama.cpp on the same GGUF, backend (CPU) and thread count.

    python bench/compare_llamacpp.py                      # bench preset, Q8_0 and F16, 2 threads
    python bench/compare_llamacpp.py --rounds 7 --quiet 0.3 --quiet-wait 300 --json /tmp/cmp.json
    python bench/compare_llamacpp.py --memory             # peak RSS at ctx 4096 instead

What it does
------------
1. On first use it builds llama-cpp-python from source into bench/.venv-llamacpp (CPU backend,
   -march=native, OpenMP: see bench/bench_envs.py; ~20-40 min on two cores). Version 0.3.36 is
   pinned: its vendored llama.cpp (ggml 0.25.3) has the `qwen3next` architecture.
2. It writes the synthetic "bench" preset (hidden 1024, 8 layers, 16 experts top-4) as Q8_0 and
   F16 to /tmp/drbench/ unless --model is given.
3. Per model it starts one llama.cpp worker (bench/_llamacpp_worker.py) and one deltarun worker
   per ggml-python build (bench/_deltarun_worker.py: the model opened and timed exactly as
   `deltarun bench` does, with its own functions), all with the model loaded once, and then runs
   rounds: per test (pp512, then tg128) llama.cpp (A) and deltarun (B) one after the other,
   A B A B ... Each request is one warm-up run plus one timed run on the same random tokens
   (seed 1234); tg starts after an untimed 16-token prompt and feeds the argmax of each step's
   logits back. Per round the ratio deltarun t/s / llama.cpp t/s is taken; min / median / max
   over the rounds are printed, and best/best (each side's fastest run), the figure least moved
   by other work on the machine. With --quiet-wait, each test waits until fewer than --quiet
   CPUs are busy (two threads on two cores collapse when anything else runs).
4. At the end it runs the real `deltarun bench -r 1 -o json` once per build as a cross-check.

llama.cpp is timed two ways (--modes): `eval` = llama-cpp-python's Llama.eval (what a Python
user of llama.cpp gets), `raw` = llama_decode on a prepared batch via the low-level ctypes API
(closest to llama-bench). deltarun is timed on the installed ggml-python (--ggml-builds
installed: scripts/install.sh builds it with -DGGML_LLAMAFILE=ON, as llama.cpp builds ggml) and,
with --ggml-builds installed,stock, also on the plain sdist build (ggml's default
GGML_LLAMAFILE=OFF) in bench/.venv-ggml-stock (bench/bench_envs.py, built on first use).

Optional tests (after pp/tg in each round; --tests pp,tg picks the plain ones): --parallel 1,2,4,8
adds tg<N>x<P>, P sequences decoding together (deltarun: one Model.eval_batch per step; llama.cpp:
one llama_decode with one token per sequence, per-sequence KV cache), aggregate tokens/s; --depth
4096,16384 adds tg<N>@d<D>, decoding after D tokens of context (evaluated once per worker; each run
restores the state: deltarun Model.checkpoint/restore, llama.cpp llama_state_seq_set_data). Both
sides run these through their lowest-level decode call, so llama.cpp has only its `raw` mode there.
--profile, after the rounds, prints both engines' per-op and per-group profiles of a pp and a tg
ubatch side by side (deltarun.apps.op_profile: the eval-callback method and its overhead).
--preset bench-vocab151k uses the bench shape with the real 151,936-token vocabulary.

--mtp 1,3 instead compares speculative decoding with the model's MTP block (a file with one, e.g.
`make-tiny --preset bench-qwen35-echo-vocab151k`, where every draft is right, or
`bench-qwen35-vocab151k`, where almost none is): llama.cpp as its users run it, `llama-server
--spec-type draft-mtp --spec-draft-n-max D` (built from the sdist's tools/server by
bench/bench_envs.py, --llama-server; one server per depth, and one without drafts), one greedy
/completion of --tg tokens from --mtp-prompt per run (ignore_eos, no prompt cache), timed by its own
`timings.predicted_per_second`; deltarun as `deltarun generate --draft mtp --draft-max D` runs it
(the worker's `mtp` command: generate_tokens with an MtpDraft, generation time only). Depth 0 is
each side's plain decoding; rounds alternate the sides per depth. Printed per depth: both t/s, the
ratio, and each side's speed-up over its own plain decoding, with the drafts accepted.

--memory instead measures peak resident memory for pp512 + tg128 at ctx 4096 in fresh processes
(deltarun's Model API vs the llama.cpp worker) and prints the ratio.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bench_envs import GGML_STOCK, LLAMACPP  # noqa: E402
from _worker_protocol import cpu_has_amx  # noqa: E402

DEFAULT_DIR = Path("/tmp/drbench")


def load1() -> float:
    return os.getloadavg()[0]


def busy_cpus(interval: float = 1.0) -> float:
    """CPUs busy over `interval` seconds (from /proc/stat), whoever keeps them busy."""
    def snap() -> tuple[int, int]:
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        idle = vals[3] + vals[4]
        return sum(vals), idle

    t0, i0 = snap()
    time.sleep(interval)
    t1, i1 = snap()
    total = t1 - t0
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / total) if total else 0.0


def wait_quiet(limit: float, max_wait: float) -> float:
    """Wait (up to max_wait s) until fewer than `limit` CPUs are busy; returns the last reading."""
    deadline = time.monotonic() + max_wait
    busy = busy_cpus()
    while busy > limit and time.monotonic() < deadline:
        busy = busy_cpus(2.0)
    return busy


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def ensure_models(paths: list[str], preset: str = "bench") -> list[Path]:
    if paths:
        return [Path(p) for p in paths]
    DEFAULT_DIR.mkdir(parents=True, exist_ok=True)
    out = []
    for wtype in ("q8_0", "f16"):
        p = DEFAULT_DIR / f"{preset}-{wtype}.gguf"
        if not p.exists():
            from deltarun.model_files.generate import write_model

            print(f"writing {p} ({preset} preset, {wtype})", file=sys.stderr, flush=True)
            write_model(p, preset, wtype)
        out.append(p)
    return out


class Worker:
    """One benchmark process with the model loaded; JSON lines in and out (see the worker files)."""

    def __init__(self, argv: list[str], stderr: Any = subprocess.DEVNULL):
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=stderr, text=True, cwd=ROOT)
        self.info = self._read()
        if not self.info.get("ready"):
            raise RuntimeError(f"benchmark worker failed to start: {self.info}")

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark worker exited (code {self.proc.poll()})")
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            raise RuntimeError(f"benchmark worker wrote something else than JSON: {line[:300]!r}") from None

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        try:
            self.proc.stdin.write('{"cmd": "quit"}\n')
            self.proc.stdin.flush()
        except OSError:
            pass
        self.proc.wait(timeout=60)


def LlamaWorker(python: Path, model: Path, threads: int, batch: int, ctx: int, kv_type: str = "f16",
                clock: str = "wall") -> Worker:
    return Worker([str(python), str(HERE / "_llamacpp_worker.py"), str(model), "--threads", str(threads),
                   "--batch", str(batch), "--ctx", str(ctx), "--kv-type", kv_type, "--clock", clock])


def DeltarunWorker(python: str, model: Path, threads: int, batch: int, pp: int, tg: int,
                   clock: str = "wall") -> Worker:
    return Worker([python, str(HERE / "_deltarun_worker.py"), str(model), "--threads", str(threads),
                   "--ubatch", str(batch), "--pp", str(pp), "--tg", str(tg), "--clock", clock])


def deltarun_bench(python: str, model: Path, threads: int, batch: int, pp: int, tg: int) -> dict[str, float]:
    """One `deltarun bench -r 1 -o json` run with the given interpreter; tokens/s by test name."""
    cmd = [python, "-m", "deltarun", "bench", str(model), "-p", str(pp), "-n", str(tg),
           "-t", str(threads), "-ub", str(batch), "-r", "1", "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"deltarun bench failed ({r.returncode}): {r.stderr[-2000:]}")
    doc = json.loads(r.stdout)
    return {res["test"]: res["avg_tps"] for res in doc["results"]}


def summarize(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def deltarun_pythons(args: argparse.Namespace) -> dict[str, str]:
    """Interpreter per ggml-python build: `installed` (this Python's), `stock` (bench venv)."""
    out = {}
    for build in [b for b in args.ggml_builds.split(",") if b]:
        if build == "installed":
            out[build] = sys.executable
        elif build == "stock":
            out[build] = str(GGML_STOCK.ensure())
        else:
            raise SystemExit(f"unknown ggml build {build!r} (installed, stock)")
    return out


def speed_tests(args: argparse.Namespace) -> list[dict]:
    """The tests of a round: name, worker request, tokens per timed run, llama.cpp modes that apply.

    pp/tg are timed in both llama.cpp modes; tg<N>x<P> (P sequences per llama_decode) and
    tg<N>@d<D> (after D tokens of context) go through llama_decode directly (mode raw)."""
    modes = [m for m in args.modes.split(",") if m]
    out = []
    for kind in [k for k in args.tests.split(",") if k]:
        if kind not in ("pp", "tg"):
            raise SystemExit(f"unknown test kind {kind!r} (pp, tg)")
        n = args.pp if kind == "pp" else args.tg
        out.append({"name": f"{kind}{n}", "req": {"cmd": kind, "n": n}, "tokens": n, "modes": modes})
    for p in args.parallel:
        out.append({"name": f"tg{args.tg}x{p}", "req": {"cmd": "tgp", "n": args.tg, "p": p},
                    "tokens": p * args.tg, "modes": ["raw"]})
    for d in args.depth:
        out.append({"name": f"tg{args.tg}@d{d}", "req": {"cmd": "tgd", "n": args.tg, "d": d},
                    "tokens": args.tg, "modes": ["raw"]})
    return out


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def run_speed(args: argparse.Namespace, python: Path) -> dict:
    models = ensure_models(args.model, args.preset)
    modes = [m for m in args.modes.split(",") if m]
    builds = deltarun_pythons(args)
    tests = speed_tests(args)
    report: dict = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "cpu": cpu_model(),
                    "cores": os.cpu_count(), "threads": args.threads, "batch": args.batch, "clock": args.clock,
                    "rounds": args.rounds, "modes": modes, "builds": list(builds), "models": {}}
    ctx = max(args.pp, 16 + args.tg)
    for model in models:
        print(f"\n== {model} ({model.stat().st_size / 2**20:.0f} MiB), {args.threads} threads, "
              f"batch {args.batch}", flush=True)
        llama = LlamaWorker(python, model, args.threads, args.batch, ctx, clock=args.clock)
        report["llama_cpp_python"] = llama.info.get("llama_cpp_python")
        report["llama_extra_bufts"] = llama.info.get("extra_bufts")     # off on AMX CPUs (cpu_has_amx)
        report["llama_system_info"] = llama.info.get("system_info")
        drs = {b: DeltarunWorker(py, model, args.threads, args.batch, args.pp, args.tg, clock=args.clock)
               for b, py in builds.items()}
        report["deltarun_llamafile"] = {b: w.info.get("llamafile") for b, w in drs.items()}
        rows: list[dict] = []
        profiles: list[dict] = []
        try:
            for rnd in range(args.rounds):
                row: dict = {"round": rnd, "load_before": load1()}
                for t in tests:
                    busy = wait_quiet(args.quiet, args.quiet_wait) if args.quiet_wait > 0 else busy_cpus(0.5)
                    row[f"busy_{t['name']}"] = busy
                    for mode in t["modes"]:                             # A: llama.cpp
                        row[f"llama_{mode}_{t['name']}"] = t["tokens"] / llama.ask(**t["req"], mode=mode)["s"]
                    for build, w in drs.items():                        # B: deltarun
                        row[f"deltarun_{build}_{t['name']}"] = t["tokens"] / w.ask(**t["req"])["s"]
                row["load_after"] = load1()
                rows.append(row)
                print(f"  round {rnd}: load {row['load_before']:.2f}->{row['load_after']:.2f}  "
                      + "  ".join(f"{k}={v:.1f}" for k, v in row.items()
                                  if k.startswith(("llama_", "deltarun_", "busy_"))), flush=True)
            if args.profile:
                profiles = run_profiles(args, llama, drs)
        finally:
            llama.close()
            for w in drs.values():
                w.close()
        cli = {}
        if args.cli_check:   # the real command once per build, as a cross-check of the worker numbers
            for build, py in builds.items():
                if args.quiet_wait > 0:
                    wait_quiet(args.quiet, args.quiet_wait)
                cli[build] = deltarun_bench(py, model, args.threads, args.batch, args.pp, args.tg)
                print(f"  deltarun bench -r 1 ({build}): " + ", ".join(f"{k} {v:.1f} t/s" for k, v in cli[build].items()),
                      flush=True)
        summary: dict = {}
        for t in (tests if rows else []):
            test = t["name"]
            summary[test] = {}
            for mode in t["modes"]:
                summary[test][f"llama_{mode}_tps"] = summarize([r[f"llama_{mode}_{test}"] for r in rows])
            for build in builds:
                d = [r[f"deltarun_{build}_{test}"] for r in rows]
                summary[test][f"deltarun_{build}_tps"] = summarize(d)
                for mode in t["modes"]:
                    ll = [r[f"llama_{mode}_{test}"] for r in rows]
                    ratios = [a / b for a, b in zip(d, ll)]
                    summary[test][f"ratio_{build}_vs_{mode}"] = summarize(ratios)
                    summary[test][f"best_ratio_{build}_vs_{mode}"] = max(d) / max(ll)
        report["models"][str(model)] = {"rounds": rows, "summary": summary, "cli_check": cli, "profiles": profiles,
                                        "load": summarize([r["load_before"] for r in rows] or [load1()]),
                                        "busy": summarize([r[f"busy_{t['name']}"] for r in rows for t in tests]
                                                          or [0.0])}
    print_speed(report)
    return report


class LlamaServer:
    """llama-server on one model (extra buffer types off on AMX CPUs), for --mtp: `depth` > 0 adds
    `--spec-type draft-mtp --spec-draft-n-max depth`."""

    def __init__(self, binary: str, model: Path, threads: int, depth: int):
        import socket

        with socket.socket() as probe:                  # a free port, picked by the kernel
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        spec = ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(depth)] if depth else []
        self.proc = subprocess.Popen([binary, "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
                                      "-t", str(threads), "-tb", str(threads), "-c", "4096", "-np", "1",
                                      *(["-nr"] if cpu_has_amx() else []), *spec],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}")
            time.sleep(0.3)
        self.close()
        raise RuntimeError("llama-server did not come up in 300 s")

    def complete(self, prompt: str, n: int) -> dict:
        """One greedy completion of n tokens; its timings (predicted_per_second, draft_n, ...)."""
        body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "ignore_eos": True,
                           "cache_prompt": False, "stream": False}).encode()
        req = urllib.request.Request(self.url + "/completion", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())["timings"]

    def close(self) -> None:
        from serve_load import stop_server

        stop_server(self.proc)


def run_mtp(args: argparse.Namespace) -> dict:
    """--mtp: both engines' MTP speculative decoding at each depth and their plain decoding (depth 0)."""
    models = ensure_models(args.model, args.preset)
    depths = [0] + [d for d in args.mtp if d > 0]
    report: dict = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "cpu": cpu_model(),
                    "cores": os.cpu_count(), "threads": args.threads, "tg": args.tg, "rounds": args.rounds,
                    "prompt": args.mtp_prompt, "llama_server": args.llama_server,
                    "llama_extra_bufts": not cpu_has_amx(), "models": {}}
    for model in models:
        print(f"\n== {model}: MTP depths {depths[1:]}, {args.threads} threads, {args.tg} tokens", flush=True)
        servers = {d: LlamaServer(args.llama_server, model, args.threads, d) for d in depths}
        dr = DeltarunWorker(sys.executable, model, args.threads, args.batch, args.pp, args.tg)
        rows: list[dict] = []
        try:
            for rnd in range(args.rounds):
                row: dict = {"round": rnd, "load_before": load1()}
                for d in depths:
                    if args.quiet_wait > 0:
                        wait_quiet(args.quiet, args.quiet_wait)
                    servers[d].complete(args.mtp_prompt, args.tg)                       # warm-up
                    t = servers[d].complete(args.mtp_prompt, args.tg)                   # A: llama.cpp
                    row[f"llama_d{d}"] = t["predicted_per_second"]
                    row[f"llama_d{d}_drafted"] = t.get("draft_n", 0)
                    row[f"llama_d{d}_accepted"] = t.get("draft_n_accepted", 0)
                    r = dr.ask(cmd="mtp", n=args.tg, depth=d, prompt=args.mtp_prompt)    # B: deltarun
                    row[f"deltarun_d{d}"] = r["n"] / r["s"]
                    row[f"deltarun_d{d}_drafted"], row[f"deltarun_d{d}_accepted"] = r["drafted"], r["accepted"]
                row["load_after"] = load1()
                rows.append(row)
                print(f"  round {rnd}: load {row['load_before']:.2f}->{row['load_after']:.2f}  "
                      + "  ".join(f"{k}={v:.1f}" for k, v in row.items() if k.endswith(tuple(f"_d{d}" for d in depths))),
                      flush=True)
        finally:
            dr.close()
            for srv in servers.values():
                srv.close()
        summary = {}
        for d in depths:
            ll, de = [r[f"llama_d{d}"] for r in rows], [r[f"deltarun_d{d}"] for r in rows]
            summary[f"d{d}"] = {
                "llama_tps": summarize(ll), "deltarun_tps": summarize(de),
                "ratio": summarize([a / b for a, b in zip(de, ll)]),
                "llama_vs_plain": summarize([r[f"llama_d{d}"] / r["llama_d0"] for r in rows]),
                "deltarun_vs_plain": summarize([r[f"deltarun_d{d}"] / r["deltarun_d0"] for r in rows]),
                "llama_accepted": f"{sum(r[f'llama_d{d}_accepted'] for r in rows)}/"
                                  f"{sum(r[f'llama_d{d}_drafted'] for r in rows)}",
                "deltarun_accepted": f"{sum(r[f'deltarun_d{d}_accepted'] for r in rows)}/"
                                     f"{sum(r[f'deltarun_d{d}_drafted'] for r in rows)}"}
        report["models"][str(model)] = {"rounds": rows, "summary": summary}
        print("\n| depth | llama.cpp t/s | deltarun t/s | deltarun / llama.cpp | llama.cpp x plain | "
              "deltarun x plain | drafts accepted (llama.cpp, deltarun) |\n|---|---|---|---|---|---|---|")
        for d in depths:
            x = summary[f"d{d}"]
            print(f"| {d or 'plain'} | {x['llama_tps']['median']:.1f} | {x['deltarun_tps']['median']:.1f} | "
                  f"{x['ratio']['median']:.2f} ({x['ratio']['min']:.2f}-{x['ratio']['max']:.2f}) | "
                  f"{x['llama_vs_plain']['median']:.2f} | {x['deltarun_vs_plain']['median']:.2f} | "
                  f"{x['llama_accepted']}, {x['deltarun_accepted']} |", flush=True)
        print("(medians over the rounds; llama.cpp " + ("without extra buffer types: they crash on this "
              "AMX CPU)" if cpu_has_amx() else "with its default buffer types)"), flush=True)
    return report


def run_profiles(args: argparse.Namespace, llama: Worker, drs: dict[str, Worker]) -> list[dict]:
    """Per-op profiles of a pp and a tg ubatch on both engines, through each one's eval callback
    (deltarun.apps.op_profile explains the method and its overhead); printed side by side."""
    from deltarun.apps.op_profile import NO_OPS, format_profiles, make_profile

    if args.quiet_wait > 0:
        wait_quiet(args.quiet, args.quiet_wait)
    raw = llama.ask(cmd="profile", n=args.pp, reps=args.profile_reps, no_ops=sorted(NO_OPS))
    out: dict[str, list[dict]] = {"pp": [], "tg": []}
    for build, w in drs.items():
        got = w.ask(cmd="profile", n=args.pp, reps=args.profile_reps)
        for kind in ("pp", "tg"):
            d = got[kind]
            d["engine"] = f"deltarun ({build})" if len(drs) > 1 else "deltarun"
            out[kind].append(d)
    for kind in ("pp", "tg"):
        r = raw[kind]
        recs = [(name, op, secs) for name, op, secs in r["nodes"]]
        prof = make_profile(recs, len(recs), test=f"pp{args.pp}" if kind == "pp" else "tg1@16", kind=kind,
                            n_tokens=args.pp if kind == "pp" else 1, n_seqs=1, n_past=0 if kind == "pp" else 16,
                            threads=args.threads, repetitions=args.profile_reps,
                            plain_s=statistics.fmean(r["plain_s"]), engine="llama.cpp")
        out[kind].append(prof.as_dict(with_nodes=True))
    docs = out["pp"] + out["tg"]
    print("\nper-op profile (seconds per ggml op and node group, eval callback, node by node):")
    print(format_profiles(docs))
    return docs


def print_speed(report: dict) -> None:
    modes, builds = report["modes"], report["builds"]
    print(f"\n{report['date']}  {report['cpu']}, {report['cores']} CPUs, {report['threads']} threads, "
          f"batch {report['batch']}, {report['clock']} clock, {report['rounds']} rounds A/B, llama-cpp-python "
          f"{report.get('llama_cpp_python')}"
          + (" (extra buffer types off: AMX CPU)" if report.get("llama_extra_bufts") is False else ""))
    head = ("| model | test | ggml-python build | deltarun t/s (med) | "
            + " | ".join(f"llama.cpp {m} t/s (med) | ratio vs {m}: min / med / max" for m in modes)
            + " | load 1-min | busy CPUs before |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for model, doc in report["models"].items():
        for test, s in doc["summary"].items():
            for build in builds:
                cells = [Path(model).name, test, build, f"{s[f'deltarun_{build}_tps']['median']:.2f}"]
                for m in modes:
                    if f"ratio_{build}_vs_{m}" not in s:
                        cells += ["", ""]
                        continue
                    r = s[f"ratio_{build}_vs_{m}"]
                    cells += [f"{s[f'llama_{m}_tps']['median']:.2f}",
                              f"{r['min']:.3f} / **{r['median']:.3f}** / {r['max']:.3f} "
                              f"(best/best {s[f'best_ratio_{build}_vs_{m}']:.3f})"]
                ld, bz = doc["load"], doc["busy"]
                cells += [f"{ld['min']:.1f}-{ld['max']:.1f}", f"{bz['min']:.1f}-{bz['max']:.1f}"]
                print("| " + " | ".join(cells) + " |")


# ------------------------------------------------------------------------------------ memory
DELTARUN_MEM = r"""
import json, resource, sys
import numpy as np
from deltarun.runner.model import Model
path, threads, ctx, pp, tg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
base = rss()
m = Model(path, n_ctx=ctx, n_threads=threads)
after_load = rss()
toks = np.random.default_rng(1234).integers(0, m.hp.n_vocab, size=pp).tolist()
logits = m.eval(toks)
for _ in range(tg):
    logits = m.eval([int(np.argmax(logits))])
print(json.dumps({"base": base, "after_load": after_load, "rss": rss(),
                  "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def run_memory(args: argparse.Namespace, python: Path) -> dict:
    models = ensure_models(args.model, args.preset)
    report: dict = {"date": _dt.datetime.now().isoformat(timespec="seconds"), "ctx": args.ctx, "models": {}}
    print("| model | ctx | deltarun peak RSS | llama.cpp peak RSS | ratio | deltarun RSS after load |")
    print("|---|---|---|---|---|---|")
    for model in models:
        r = subprocess.run([sys.executable, "-c", DELTARUN_MEM, str(model), str(args.threads), str(args.ctx),
                            str(args.pp), str(args.tg)], capture_output=True, text=True, cwd=ROOT)
        if r.returncode != 0:
            raise RuntimeError(r.stderr[-2000:])
        dr = json.loads(r.stdout.strip().splitlines()[-1])
        w = LlamaWorker(python, model, args.threads, args.batch, args.ctx)
        try:
            w.ask(cmd="pp", n=args.pp, mode="eval")
            w.ask(cmd="tg", n=args.tg, mode="eval")
            ll = w.ask(cmd="rss")
            ll["after_load"] = w.info["rss"]
        finally:
            w.close()
        ratio = dr["peak"] / ll["peak"]
        report["models"][str(model)] = {"deltarun": dr, "llama": ll, "ratio": ratio,
                                        "file_size": model.stat().st_size}
        mib = 2 ** 20
        print(f"| {model.name} | {args.ctx} | {dr['peak'] / mib:.0f} MiB | {ll['peak'] / mib:.0f} MiB | "
              f"{ratio:.3f} | {dr['after_load'] / mib:.0f} MiB (file {model.stat().st_size / mib:.0f} MiB) |",
              flush=True)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", action="append", default=[], help="GGUF to compare (repeatable); "
                    "default: the bench preset as Q8_0 and F16 in /tmp/drbench")
    ap.add_argument("--preset", default="bench",
                    help="generator preset of the default models (bench, bench-vocab151k: real vocabulary)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--modes", default="eval,raw", help="llama.cpp timing modes: eval, raw")
    ap.add_argument("--ggml-builds", default="installed",
                    help="deltarun on which ggml-python builds: installed (this Python's), stock "
                         "(GGML_LLAMAFILE=OFF, bench/.venv-ggml-stock, built on first use)")
    ap.add_argument("--quiet", type=float, default=0.3,
                    help="before each round wait until fewer than this many CPUs are busy ...")
    ap.add_argument("--quiet-wait", type=float, default=120.0, help="... for at most this many seconds")
    ap.add_argument("--no-cli-check", dest="cli_check", action="store_false",
                    help="skip the final `deltarun bench` run per build")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="time runs by wall time, or by each worker's CPU time (with --threads 1 only: on a "
                         "busy shared machine other processes' time slices do not count then)")
    ap.add_argument("--tests", default="pp,tg", help="plain tests per round: pp, tg (either may be left out)")
    ap.add_argument("--parallel", type=int_list, default=[], metavar="P[,P...]",
                    help="also tg<tg>x<P>: P sequences decoding together (aggregate t/s)")
    ap.add_argument("--depth", type=int_list, default=[], metavar="D[,D...]",
                    help="also tg<tg>@d<D>: decoding after D tokens of context")
    ap.add_argument("--profile", action="store_true",
                    help="after the rounds, per-op profiles of a pp and a tg ubatch on both engines")
    ap.add_argument("--profile-reps", type=int, default=3, help="profiled runs per ubatch")
    ap.add_argument("--memory", action="store_true", help="measure peak RSS (ctx --ctx) instead of speed")
    ap.add_argument("--ctx", type=int, default=4096, help="context size for --memory")
    ap.add_argument("--mtp", type=int_list, default=[], metavar="D[,D...]",
                    help="instead: MTP speculative decoding at these draft depths, against llama-server's draft-mtp")
    ap.add_argument("--mtp-prompt", default="Hello world, this is a test", help="the prompt of the --mtp runs")
    ap.add_argument("--llama-server", default=str(ROOT / "build" / "llama-server" / "bin" / "llama-server"),
                    help="llama-server binary for --mtp (bench/bench_envs.py llama-server builds it)")
    ap.add_argument("--json", help="also write the full results here")
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu needs --threads 1 (CPU time would count the threads' barrier spinning)")

    if args.mtp:
        if not Path(args.llama_server).is_file():
            raise SystemExit(f"no llama-server at {args.llama_server}: build it (bench/bench_envs.py) or give --llama-server")
        report = run_mtp(args)
    else:
        python = LLAMACPP.ensure()
        report = run_memory(args, python) if args.memory else run_speed(args, python)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
