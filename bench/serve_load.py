"""Load test of an OpenAI-compatible server: deltarun serve, or llama-server, on the same workloads.

    python bench/serve_load.py --start model.gguf --parallel 8          # starts `deltarun serve` itself
    python bench/serve_load.py --start model.gguf --parallel 8 --llama-server build/llama-server/bin/llama-server
    python bench/serve_load.py --url http://127.0.0.1:8080 --name llama-server   # any running server

Every request streams (`stream_options.include_usage`) over plain HTTP (httpx), so the client
times each event itself: TTFT is from sending the request to the first event with text, the
inter-token latency (ITL) is the gap between text events (one token each on both servers), and
aggregate tokens/s is generated tokens over the wall time of the whole run. Evaluated prompt tokens
come from llama-server-style `timings.prompt_n` (both servers send it), cached ones from
`usage.prompt_tokens_details.cached_tokens`.

Workloads (`--workloads`, default all), each bounded in requests and by `--time-limit` seconds:

- `throughput`: concurrency 1/2/4/8 (`--concurrency`), `--requests` requests per level, each a
  distinct short prompt (none repeats another of the run) and `--max-tokens` tokens (`ignore_eos`),
  after one untimed round at that concurrency (deltarun builds a graph per batch shape on first
  use); with `--settle N`, N untimed requests of other conversations before that (the prompt cache
  at its budget).
- `multiturn`: one conversation, `--turns` turns, history re-sent each turn with thinking off;
  per turn: new tokens (not in the previous request), evaluated tokens, TTFT, and (deltarun) the
  tokens the server evaluated ahead before the request came (`deltarun_prompt_tokens_ahead_total`
  of /metrics, read just before each request). `--think-time S` waits S seconds between an answer
  and the next request, as a person reading and typing does (default 0: back to back).
- `branching`: a 3-turn conversation, then regenerate the last answer, then edit the first user
  message; evaluated tokens of each.
- `interleave`: 2 x `--parallel` conversations taking turns round-robin (more than the slots);
  cached-token ratio of turns 2+.
- `prefill-stall`: `--parallel - 1` streams run; their ITL p99 alone (for `--stall-idle` seconds once
  every stream has started), then while another request prefills a prompt of about `--long-prompt`
  tokens; the ratio. The client closes the streams afterwards.

Output: markdown tables (or `--json`). Numbers depend on the machine and its load: say both.

    python bench/serve_load.py --compare dr-a.json,dr-b.json ls-a.json,ls-b.json

`--compare` reads the `--json` outputs of two servers on the same workloads (the first is the server
under test, the second the reference; several files per server are merged) and prints one table
per workload with both servers' figures, then the goals of issue 15 that the figures decide, each
marked met or not.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

from _worker_protocol import cpu_has_amx

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


@dataclass
class Result:
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    n_generated: int = 0
    n_prompt: int = 0
    n_cached: int = 0
    n_evaluated: int | None = None   # timings.prompt_n; None when the server sent none
    text: str = ""
    t_start: float = 0.0
    t_end: float = 0.0
    error: str = ""


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def evaluated(r: Result) -> int:
    """Prompt tokens the server evaluated: its timings.prompt_n, else prompt minus cached tokens."""
    return r.n_evaluated if r.n_evaluated is not None else r.n_prompt - r.n_cached


def text(i: int, n: int) -> str:
    return " ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(n))


class Client:
    def __init__(self, url: str, model: str, api_key: str | None, timeout: float, temperature: float = 0.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # A new connection per request: llama-server (cpp-httplib) closes the connection after a
        # streamed answer although it sends Keep-Alive, and a pooled connection reused in that race
        # fails with "Server disconnected". Loopback connects cost both servers the same ~0.1 ms.
        self.http = httpx.Client(base_url=url, headers=headers, timeout=timeout,
                                 limits=httpx.Limits(max_keepalive_connections=0))
        self.model = model
        self.temperature = temperature      # of the chat requests (seeded per request when > 0)

    def ahead_tokens(self) -> float | None:
        """deltarun's count of prompt tokens evaluated ahead (None from a server without it)."""
        try:
            body = self.http.get("/metrics").text
        except httpx.HTTPError:
            return None
        for line in body.splitlines():
            if line.startswith("deltarun_prompt_tokens_ahead_total "):
                return float(line.split()[1])
        return None

    def text_of_tokens(self, seed: int, n_tokens: int) -> str:
        """About n_tokens tokens of text, measured with the server's /tokenize."""
        words = text(seed, n_tokens)
        n = len(self.http.post("/tokenize", json={"content": words}).json()["tokens"])
        return text(seed, max(1, int(n_tokens * n_tokens / max(n, 1))))

    def chat(self, messages: list[dict], max_tokens: int, **extra) -> Result:
        sampled = {"temperature": self.temperature, "seed": len(str(messages))} if self.temperature > 0 else {}
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **sampled,
                "stream": True, "stream_options": {"include_usage": True}, "cache_prompt": True,
                "chat_template_kwargs": {"enable_thinking": False}, **extra}
        r = Result(t_start=time.perf_counter())
        last = None
        try:
            with self.http.stream("POST", "/v1/chat/completions", json=body) as resp:
                if resp.status_code != 200:
                    r.error = f"HTTP {resp.status_code}: {resp.read()[:200]!r}"
                    return r
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    now = time.perf_counter()
                    for ch in ev.get("choices") or []:
                        piece = (ch.get("delta") or {}).get("content") or ""
                        if piece:
                            if r.ttft == 0.0:
                                r.ttft = now - r.t_start
                            elif last is not None:
                                r.itl.append(now - last)
                            last = now
                            r.text += piece
                    if ev.get("usage"):
                        u = ev["usage"]
                        r.n_generated, r.n_prompt = u["completion_tokens"], u["prompt_tokens"]
                        r.n_cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
                    if ev.get("timings"):
                        r.n_evaluated = ev["timings"].get("prompt_n", 0)
        except httpx.HTTPError as e:
            r.error = f"{type(e).__name__}: {e}"
        r.t_end = time.perf_counter()
        return r


def throughput(c: Client, args: argparse.Namespace) -> list[dict]:
    rows = []
    for conc in args.concurrency:
        deadline = time.monotonic() + args.time_limit

        def ask(tag: str, i: int, conc: int = conc) -> Result:
            # every prompt its own (`text` repeats with a period of len(WORDS)): none resumes another's
            return c.chat([{"role": "user", "content": f"{tag} {conc}.{i}: " + text(i, 12)}], args.max_tokens,
                          ignore_eos=True)

        with cf.ThreadPoolExecutor(conc) as pool:      # --settle: other conversations fill the prompt cache first
            list(pool.map(lambda i: ask("earlier request", i), range(args.settle)))
        with cf.ThreadPoolExecutor(conc) as pool:      # warm-up: the server builds its graphs for this batch shape
            list(pool.map(lambda i: ask("warm-up", i), range(conc)))
        t0 = time.perf_counter()

        def one(i: int, deadline=deadline) -> Result | None:
            if time.monotonic() > deadline:
                return None
            return ask("request", i)

        with cf.ThreadPoolExecutor(conc) as pool:
            results = [r for r in pool.map(one, range(args.requests)) if r is not None]
        wall = time.perf_counter() - t0
        ok = [r for r in results if not r.error]
        itl = [x for r in ok for x in r.itl]
        rows.append({"concurrency": conc, "requests": len(ok), "errors": len(results) - len(ok),
                     "ttft_p50_ms": 1e3 * pct([r.ttft for r in ok], 50), "ttft_p99_ms": 1e3 * pct([r.ttft for r in ok], 99),
                     "itl_p50_ms": 1e3 * pct(itl, 50), "itl_p99_ms": 1e3 * pct(itl, 99),
                     "tokens_per_s": sum(r.n_generated for r in ok) / wall if wall else 0.0})
    return rows


def _turns(c: Client, args: argparse.Namespace, conversations: int, turns: int, tag: str) -> list[dict]:
    rows, convs, prev = [], [[] for _ in range(conversations)], [0] * conversations
    deadline = time.monotonic() + args.time_limit
    for t in range(turns):
        for k in range(conversations):
            if time.monotonic() > deadline:
                return rows
            msgs = convs[k]
            msgs.append({"role": "user", "content": f"{tag} {k} turn {t}: " + text(k * 31 + t, args.user_words)})
            if rows and args.think_time > 0:
                time.sleep(args.think_time)
            ahead = c.ahead_tokens()
            r = c.chat(msgs, args.max_tokens, **({"ignore_eos": True} if args.ignore_eos else {}))
            if r.error:
                rows.append({"conversation": k, "turn": t + 1, "error": r.error})
                return rows
            n_eval = evaluated(r)
            rows.append({"conversation": k, "turn": t + 1, "prompt_tokens": r.n_prompt,
                         "growth": r.n_prompt - prev[k], "cached": r.n_cached, "evaluated": n_eval,
                         "ttft_ms": 1e3 * r.ttft})
            if ahead is not None:
                rows[-1]["ahead_total"] = ahead
            prev[k] = r.n_prompt + r.n_generated
            msgs.append({"role": "assistant", "content": r.text})
    return rows


def multiturn(c: Client, args: argparse.Namespace) -> list[dict]:
    return _turns(c, args, 1, args.turns, "conversation")


def interleave(c: Client, args: argparse.Namespace) -> list[dict]:
    rows = _turns(c, args, 2 * args.parallel, 3, "chat")
    later = [r for r in rows if r.get("turn", 1) > 1 and "error" not in r]
    ratio = sum(r["cached"] for r in later) / max(1, sum(r["prompt_tokens"] for r in later))
    return rows + [{"summary": "turns 2+", "cached_ratio": ratio}]


def branching(c: Client, args: argparse.Namespace) -> list[dict]:
    msgs: list[dict] = []
    for t in range(3):
        msgs.append({"role": "user", "content": f"branch turn {t}: " + text(t + 50, args.user_words)})
        r = c.chat(msgs, args.max_tokens)
        msgs.append({"role": "assistant", "content": r.text})
    rows = []
    last = msgs[:-1]
    edited = [dict(m) for m in last]
    edited[2]["content"] = "edited: " + edited[2]["content"]
    for case, messages in (("regenerate last answer", last), ("edit second user message", edited)):
        r = c.chat(messages, args.max_tokens)
        rows.append({"case": case, **({"error": r.error} if r.error else {
            "prompt_tokens": r.n_prompt, "cached": r.n_cached, "evaluated": evaluated(r), "ttft_ms": 1e3 * r.ttft})})
    return rows


def prefill_stall(c: Client, args: argparse.Namespace) -> list[dict]:
    n = max(1, args.parallel - 1)
    long_msgs = [{"role": "user", "content": c.text_of_tokens(999, args.long_prompt)}]
    stamps: list[list[float]] = [[] for _ in range(n)]
    done = threading.Event()

    def stream(i: int) -> None:
        body = {"model": c.model, "messages": [{"role": "user", "content": text(i + 500, 10)}],
                "max_tokens": args.stall_tokens, "temperature": 0, "stream": True, "ignore_eos": True,
                "chat_template_kwargs": {"enable_thinking": False}}     # as chat(): llama-server streams
                                                                        # a think block as reasoning_content
        with c.http.stream("POST", "/v1/chat/completions", json=body) as resp:
            for line in resp.iter_lines():
                deltas = [ch.get("delta") or {} for ch in json.loads(line[6:]).get("choices") or []] \
                    if line.startswith("data: {") else []
                if any(d.get("content") or d.get("reasoning_content") for d in deltas):
                    stamps[i].append(time.perf_counter())   # a token's event (not the role-only first chunk)
                if done.is_set():
                    break          # closing the stream cancels the request

    with cf.ThreadPoolExecutor(n + 1) as pool:
        futs = [pool.submit(stream, i) for i in range(n)]
        deadline = time.monotonic() + args.time_limit     # idle is timed once every stream runs (the ramp-up
        while (time.monotonic() < deadline and not all(f.done() for f in futs)   # builds graphs, joins batches)
               and not all(len(s) >= 2 for s in stamps)):
            time.sleep(0.05)
        t_idle = time.perf_counter()
        time.sleep(args.stall_idle)
        t_long = time.perf_counter()
        long_result = pool.submit(c.chat, long_msgs, 1).result()
        t_long_end = time.perf_counter()
        time.sleep(0.5)
        done.set()
        for f in futs:
            f.result()
    idle, busy = [], []
    for s in stamps:
        for a, b in zip(s, s[1:]):
            (busy if t_long <= b <= t_long_end else idle if t_idle <= b < t_long else []).append(b - a)
    return [{"streams": n, "long_prompt_tokens": long_result.n_prompt,
             "idle_gaps": len(idle), "prefill_gaps": len(busy), "idle_itl_p99_ms": 1e3 * pct(idle, 99),
             "during_prefill_itl_p99_ms": 1e3 * pct(busy, 99),
             "ratio": pct(busy, 99) / pct(idle, 99) if len(idle) >= 10 and busy else float("nan"),  # else too few
             "prefill_s": t_long_end - t_long, **({"error": long_result.error} if long_result.error else {})}]


WORKLOADS = {"throughput": throughput, "multiturn": multiturn, "branching": branching, "interleave": interleave,
             "prefill-stall": prefill_stall}


def table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    fmt = lambda v: f"{v:.1f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def _cmp_rows(a: dict, b: dict, workload: str) -> tuple[list[dict], list[dict]]:
    return a["workloads"].get(workload) or [], b["workloads"].get(workload) or []


def _turn_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "turn" in r and "error" not in r]


def merged_runs(paths: list[str]) -> dict:
    """One server's `--json` runs of different workloads (e.g. -np 4 and -np 8) as one."""
    runs = [json.load(open(p)) for p in paths]
    return {**runs[0], "workloads": {k: v for r in runs for k, v in r["workloads"].items()}}


def compare(a: dict, b: dict) -> str:
    """Side-by-side markdown tables of two runs (`--json` outputs) and the issue's goals they decide."""
    na, nb = a["server"], b["server"]
    out, goals = [f"{na} vs {nb}; 1-minute load average {a['load_avg'][0]:.1f} / {b['load_avg'][0]:.1f} "
                  f"at the start of each run; think time {a.get('think_time', 0)} / {b.get('think_time', 0)} s"], []
    ra, rb = map(_turn_rows, _cmp_rows(a, b, "multiturn"))
    if ra and rb:
        ahead = [x.get("ahead_total") for x in ra]
        ahead = [None] + [b - a if a is not None and b is not None else None for a, b in zip(ahead, ahead[1:])]
        rows = [{"turn": x["turn"], "growth": x["growth"],
                 f"evaluated {na}": x["evaluated"], f"ahead {na}": "" if d is None else int(d),
                 f"evaluated {nb}": y["evaluated"],
                 f"cached {na}": x["cached"], f"cached {nb}": y["cached"],
                 f"TTFT ms {na}": x["ttft_ms"], f"TTFT ms {nb}": y["ttft_ms"]} for x, y, d in zip(ra, rb, ahead)]
        out.append("**multiturn**\n\n" + table(rows))
        later = [r for r in rows if r["turn"] >= 2]
        ea, eb = sum(r[f"evaluated {na}"] for r in later), sum(r[f"evaluated {nb}"] for r in later)
        goals.append((f"multiturn: >= 30 % fewer evaluated tokens than {nb} from turn 2",
                      f"{ea} vs {eb} tokens ({100 * (1 - ea / max(eb, 1)):.0f} % fewer)", ea <= 0.7 * eb))
        faster = sum(r[f"TTFT ms {na}"] < r[f"TTFT ms {nb}"] for r in later)
        goals.append((f"multiturn: lower TTFT than {nb} from turn 2", f"lower in {faster} of {len(later)} turns",
                      bool(later) and faster == len(later)))
    ra, rb = _cmp_rows(a, b, "branching")
    if ra and rb:
        rows = [{"case": x["case"], **{f"{k} {n}": r.get(k, r.get("error", "")) for k in ("evaluated", "cached", "ttft_ms")
                                        for n, r in ((na, x), (nb, y))}} for x, y in zip(ra, rb)]
        out.append("**branching**\n\n" + table(rows))
        for r in rows:
            ea, eb = r[f"evaluated {na}"], r[f"evaluated {nb}"]
            goals.append((f"branching, {r['case']}: evaluated <= {nb}'s", f"{ea} vs {eb}",
                          isinstance(ea, int) and isinstance(eb, int) and ea <= eb))
    ra, rb = _cmp_rows(a, b, "interleave")
    if ra and rb:
        ca, cb = ([r for r in rows if "summary" in r][0]["cached_ratio"] for rows in (ra, rb))
        ta, tb = ([r["ttft_ms"] for r in _turn_rows(rows) if r["turn"] > 1] for rows in (ra, rb))
        out.append("**interleave** (turns 2+)\n\n" + table([
            {"server": n, "cached_ratio": c, "evaluated": sum(r["evaluated"] for r in _turn_rows(rows) if r["turn"] > 1),
             "TTFT p50 ms": pct(t, 50)} for n, c, t, rows in ((na, f"{ca:.3f}", ta, ra), (nb, f"{cb:.3f}", tb, rb))]))
        goals.append((f"interleave: cached-token ratio >= {nb}'s", f"{ca:.3f} vs {cb:.3f}", ca >= cb))
    ra, rb = _cmp_rows(a, b, "throughput")
    if ra and rb:
        rows = [{"concurrency": x["concurrency"], **{f"{k} {n}": r[k] for k in ("tokens_per_s", "ttft_p50_ms", "itl_p99_ms")
                                                      for n, r in ((na, x), (nb, y))}} for x, y in zip(ra, rb)]
        out.append("**throughput**\n\n" + table(rows))
        for r in rows:
            if r["concurrency"] in (4, 8):
                ta, tb = r[f"tokens_per_s {na}"], r[f"tokens_per_s {nb}"]
                goals.append((f"throughput at concurrency {r['concurrency']}: tokens/s >= {nb}'s", f"{ta:.0f} vs {tb:.0f}",
                              ta >= tb))
    ra, rb = _cmp_rows(a, b, "prefill-stall")
    if ra and rb:
        out.append("**prefill-stall**\n\n" + table([{"server": n, **r} for n, r in ((na, ra[0]), (nb, rb[0]))]))
        ratio = ra[0]["ratio"]
        goals.append(("prefill-stall: streams' ITL p99 <= 2x idle while a long prompt prefills",
                      f"{ratio:.1f}x ({nb}: {rb[0]['ratio']:.1f}x)", ratio <= 2.0))
    out.append("**goals**\n\n" + table([{"goal": g, "figures": f, "met": "yes" if ok else "no"} for g, f, ok in goals]))
    return "\n\n".join(out)


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    """`deltarun serve`, or with --llama-server that binary, on --start MODEL with the same slots and budget.

    deltarun's --ctx is per sequence; llama-server's -c is the whole KV cache, which it splits over
    its -np slots (unified KV off, its default with an explicit -np), so it gets ctx x parallel.
    Both get --cache-ram MiB of host RAM for their prompt cache and the same --threads."""
    threads = ["--threads", str(args.threads)] if args.threads else []
    if args.llama_server:
        return [args.llama_server, "-m", args.start, "--host", "127.0.0.1", "--port", str(port),
                "-np", str(args.parallel), "-c", str(args.ctx * args.parallel), "--cache-ram", str(args.cache_ram),
                "--jinja", *threads, *trained_context_override(args.start, args.ctx),
                *(["-nr"] if cpu_has_amx() else []), *args.serve_args]     # its AMX/repack buffers crash here
    return [sys.executable, "-m", "deltarun", "serve", args.start, "--port", str(port), "--parallel", str(args.parallel),
            "--ctx", str(args.ctx), "--cache-ram", str(args.cache_ram), *threads, *args.serve_args]


def trained_context_override(model: str, ctx: int) -> list[str]:
    """llama-server caps each slot at the model's training context (`<arch>.context_length`; 256 for
    the built-in model), deltarun does not: raise the key to ctx so both serve the same context."""
    from gguf import GGUFReader

    fields = GGUFReader(model).fields
    arch = fields["general.architecture"].contents()
    key = f"{arch}.context_length"
    if key in fields and fields[key].contents() >= ctx:
        return []
    return ["--override-kv", f"{key}=int:{ctx}"]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = args.port or 8089
    with socket.socket() as probe:     # else /health below could be answered by whatever holds the port
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise SystemExit(f"port {port} is already in use: give another --port")
    log = open(args.server_log, "ab") if args.server_log else subprocess.DEVNULL
    proc = subprocess.Popen(server_command(args, port), stdout=log, stderr=log, env=dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        time.sleep(0.3)
    proc.kill()
    raise SystemExit("the server did not come up in 300 s")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 30 s (llama-server sometimes outlives SIGTERM after cancelled streams)."""
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running server (e.g. llama-server)")
    ap.add_argument("--start", metavar="MODEL.gguf", help="start `deltarun serve MODEL` (or --llama-server) on --port")
    ap.add_argument("--llama-server", metavar="BIN", help="with --start: start this llama-server binary instead, "
                    "same slots, per-slot context, --cache-ram and --threads (bench/bench_envs.py llama-server builds it)")
    ap.add_argument("--threads", type=int, help="with --start: threads of the server [default: the server's]")
    ap.add_argument("--server-log", help="with --start: append the server's output to this file")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--name", default="deltarun", help="label in the output")
    ap.add_argument("--model", default="model")
    ap.add_argument("--api-key")
    ap.add_argument("--parallel", type=int, default=4, help="slots of the server (for interleave and prefill-stall)")
    ap.add_argument("--ctx", type=int, default=8192, help="with --start: context per slot")
    ap.add_argument("--cache-ram", type=int, default=2048)
    ap.add_argument("--serve-args", nargs=argparse.REMAINDER, default=[], help="more options of the started server")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8])
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    ap.add_argument("--settle", type=int, default=0, help="throughput: this many requests of other conversations "
                    "first, untimed (a server whose prompt cache has reached its --cache-ram budget, as after a "
                    "while in service: it then reuses the memory of the states it drops)")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="of the chat requests (default 0: greedy); > 0 samples with the server's other defaults")
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--user-words", type=int, default=30, help="words of each user message (multiturn, "
                    "interleave, branching)")
    ap.add_argument("--ignore-eos", action="store_true", help="answers of --max-tokens tokens each "
                    "(multiturn, interleave): what the next turn re-sends is then that long")
    ap.add_argument("--think-time", type=float, default=0.0,
                    help="seconds between an answer and the next turn's request (multiturn, interleave)")
    ap.add_argument("--long-prompt", type=int, default=2000, help="tokens of the prefill-stall prompt")
    ap.add_argument("--stall-tokens", type=int, default=4000, help="token limit of the streams (they are closed once the long prompt is done)")
    ap.add_argument("--stall-idle", type=float, default=3.0, help="seconds of idle streaming before the long prompt")
    ap.add_argument("--time-limit", type=float, default=300, help="seconds per workload (bounds every loop)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--compare", nargs=2, metavar=("A.json[,A2.json]", "B.json[,B2.json]"),
                    help="print the --json runs of server A and of server B side by side")
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    if args.compare:
        print(compare(*(merged_runs(files.split(",")) for files in args.compare)))
        return
    proc = None
    if args.llama_server and args.name == "deltarun":
        args.name = "llama-server"
    if args.start:
        proc, url = start_server(args)
    elif args.url:
        url = args.url
    else:
        ap.error("give --url or --start")
    try:
        c = Client(url, args.model, args.api_key, args.timeout, args.temperature)
        out = {"server": args.name, "load_avg": os.getloadavg(), "think_time": args.think_time,
               "user_words": args.user_words, "max_tokens": args.max_tokens, "temperature": args.temperature,
               "ignore_eos": args.ignore_eos, "workloads": {}}
        for name in args.workloads.split(","):
            out["workloads"][name] = WORKLOADS[name](c, args)
            if not args.json:
                print(f"\n### {args.name}: {name}\n\n{table(out['workloads'][name])}", flush=True)
        out["load_avg_after"] = os.getloadavg()
        if args.json:
            print(json.dumps(out, indent=1))
        else:
            print(f"\nload average before/after: {out['load_avg']} / {out['load_avg_after']}")
    finally:
        if proc is not None:
            stop_server(proc)


if __name__ == "__main__":
    main()
