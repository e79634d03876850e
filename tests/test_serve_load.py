"""bench/serve_load.py, the load test that compares `deltarun serve` with llama-server.

No timings are asserted (speed is measured in bench/RESULTS.md, never here). These tests check that
the script starts llama-server with the same slots, per-slot context and cache budget as deltarun,
and that its workloads read the token accounting of both servers: every prompt token is either
cached or evaluated. The llama-server run needs the binary that `python bench/bench_envs.py
llama-server` builds ($DELTARUN_LLAMA_SERVER, else build/llama-server/bin/llama-server); without it
that test is skipped.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from deltarun.apps.serve.server import ServeHandle, ServeSettings, free_port
from deltarun.runner.model import Model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import serve_load  # noqa: E402

SHIPPED = str(ROOT / "models" / "shakespeare-qwen3next-q8_0.gguf")   # trained context 256
LLAMA_SERVER = os.environ.get("DELTARUN_LLAMA_SERVER") or str(ROOT / "build" / "llama-server" / "bin" / "llama-server")


def args_of(*argv: str):
    return serve_load.parser().parse_args(list(argv))


def test_llama_server_gets_deltarun_settings():
    a = args_of("--start", SHIPPED, "--llama-server", "/x/llama-server", "--parallel", "4", "--ctx", "1024",
                "--cache-ram", "512", "--threads", "1")
    cmd = serve_load.server_command(a, 8123)
    assert cmd[0] == "/x/llama-server"
    opts = dict(zip(cmd[1::2], cmd[2::2]))          # every option before --jinja takes one value
    assert opts["-m"] == SHIPPED and opts["--port"] == "8123" and opts["--host"] == "127.0.0.1"
    assert opts["-np"] == "4" and opts["-c"] == str(4 * 1024)    # llama-server splits -c over the slots
    assert opts["--cache-ram"] == "512"
    assert cmd[cmd.index("--threads") + 1] == "1"
    # the shipped model was trained on 256 tokens; llama-server would cap each slot there
    assert cmd[cmd.index("--override-kv") + 1] == "qwen3next.context_length=int:1024"
    assert "--override-kv" not in serve_load.server_command(args_of("--start", SHIPPED, "--llama-server", "b",
                                                                      "--ctx", "256"), 1)

    d = serve_load.server_command(args_of("--start", SHIPPED, "--parallel", "4", "--ctx", "1024", "--cache-ram",
                                          "512", "--threads", "1"), 8123)
    assert d[1:4] == ["-m", "deltarun", "serve"]
    assert d[d.index("--ctx") + 1] == "1024" and d[d.index("--parallel") + 1] == "4"
    assert d[d.index("--cache-ram") + 1] == "512" and d[d.index("--threads") + 1] == "1"


def check_accounting(rows: list[dict]) -> None:
    assert rows and not [r for r in rows if "error" in r], rows
    for r in rows:
        if "prompt_tokens" in r:
            assert r["cached"] + r["evaluated"] == r["prompt_tokens"], r


def run_workloads(url: str) -> dict[str, list[dict]]:
    a = args_of("--url", url, "--turns", "2", "--max-tokens", "4", "--parallel", "1", "--time-limit", "120")
    c = serve_load.Client(url, "model", None, 120)
    out = {name: serve_load.WORKLOADS[name](c, a) for name in ("multiturn", "branching")}
    for rows in out.values():
        check_accounting(rows)
    turn2 = out["multiturn"][1]
    assert turn2["cached"] > 0 and turn2["evaluated"] < turn2["prompt_tokens"]   # the prompt cache was used
    return out


def test_workloads_read_deltarun_accounting():
    with ServeHandle(lambda: Model(SHIPPED, n_ctx=1024, n_seq_max=1, n_ubatch=64, n_threads=1),
                     ServeSettings(parallel=1)) as h:
        run_workloads(h.base_url)


@pytest.mark.skipif(not Path(LLAMA_SERVER).exists(), reason="no llama-server (python bench/bench_envs.py llama-server)")
def test_workloads_read_llama_server_accounting():
    a = args_of("--start", SHIPPED, "--llama-server", LLAMA_SERVER, "--parallel", "1", "--ctx", "1024",
                "--threads", "1", "--port", str(free_port("127.0.0.1")))
    proc, url = serve_load.start_server(a)
    try:
        run_workloads(url)
    finally:
        proc.terminate()
        proc.wait(30)


def test_compare_puts_runs_side_by_side_and_decides_the_goals(tmp_path):
    def run(name: str, evaluated: list[int], regen: int, ratio: float, tps8: float, stall: float,
            ahead: list[float] | None = None) -> dict:
        turns = [{"conversation": 0, "turn": t + 1, "prompt_tokens": 100 * (t + 1), "growth": 100, "cached": 0,
                  "evaluated": e, "ttft_ms": 50.0} for t, e in enumerate(evaluated)]
        for row, total in zip(turns, ahead or []):      # deltarun's ahead counter, read before each request
            row["ahead_total"] = total
        return {"server": name, "load_avg": [1.0, 1.0, 1.0], "workloads": {
            "multiturn": turns,
            "branching": [{"case": "regenerate last answer", "prompt_tokens": 300, "cached": 300 - regen,
                           "evaluated": regen, "ttft_ms": 5.0}],
            "interleave": turns + [{"summary": "turns 2+", "cached_ratio": ratio}],
            "throughput": [{"concurrency": 8, "tokens_per_s": tps8, "ttft_p50_ms": 1.0, "itl_p99_ms": 1.0}],
            "prefill-stall": [{"streams": 7, "ratio": stall}]}}

    a = tmp_path / "a.json"
    a.write_text(json.dumps(run("deltarun", [100, 60, 60], 0, 0.5, 90.0, 1.5, ahead=[0.0, 40.0, 85.0])))
    b = run("llama-server", [100, 100, 100], 4, 0.6, 100.0, 40.0)
    merged = serve_load.merged_runs([str(a)])
    out = serve_load.compare(merged, b)
    goals = {line.split(" | ")[0].strip("| "): line.rsplit(" | ", 1)[1].strip(" |")
             for line in out.split("**goals**")[1].splitlines() if line.startswith("| ") and "goal" not in line}
    assert goals["multiturn: >= 30 % fewer evaluated tokens than llama-server from turn 2"] == "yes"   # 120 vs 200
    assert goals["branching, regenerate last answer: evaluated <= llama-server's"] == "yes"
    assert goals["interleave: cached-token ratio >= llama-server's"] == "no"
    assert goals["throughput at concurrency 8: tokens/s >= llama-server's"] == "no"
    assert goals["prefill-stall: streams' ITL p99 <= 2x idle while a long prompt prefills"] == "yes"
    assert "| 2 | 100 | 60 | 40 | 100 |" in out     # turn 2: growth, evaluated by deltarun, ahead, by llama-server
    assert "| 3 | 100 | 60 | 45 | 100 |" in out


def test_throughput_prompts_never_repeat():
    """The throughput workload's prompts (settling, warm-up and measured, every concurrency level)
    are all different: one that repeated an earlier one would be answered from the prompt cache
    without being evaluated, and count as speed (`text` alone repeats every len(WORDS) seeds)."""
    sent: list[str] = []

    class Recorder:
        def chat(self, messages: list[dict], max_tokens: int, **extra) -> serve_load.Result:
            sent.append(messages[-1]["content"])
            return serve_load.Result(ttft=0.01, itl=[0.01] * (max_tokens - 1), n_generated=max_tokens)

    a = args_of("--url", "http://127.0.0.1:1", "--concurrency", "1,4", "--requests", "40", "--settle", "30")
    rows = serve_load.throughput(Recorder(), a)
    assert [r["requests"] for r in rows] == [40, 40]
    assert len(sent) == 2 * (30 + 40) + 1 + 4 == len(set(sent))
