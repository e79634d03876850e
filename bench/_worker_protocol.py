"""The JSON-lines loop both bench workers answer (bench/compare_llamacpp.py drives them).

Plain Python only: it runs in deltarun's environment and in bench/.venv-llamacpp alike.

    {"cmd": "pp", "n": 512, "mode": "eval"}   -> {"s": seconds, ...}
    {"cmd": "tg", "n": 128, "mode": "eval"}   -> {"s": seconds, ...}
    {"cmd": "rss"}                             -> {"rss": bytes, "peak": bytes}
    {"cmd": "tgp", "n": 128, "p": 4}           -> {"s": seconds}: P sequences decoding N steps together
    {"cmd": "tgd", "n": 128, "d": 4096}        -> {"s": seconds}: N decode steps after D tokens of context
    {"cmd": "profile", "n": 512, "reps": 3, "no_ops": [...]}
        -> {"pp": {...}, "tg": {...}}: per-node times of a pp ubatch of N tokens and of a one-token
           decode after 16, each {"nodes": [[name, op, [seconds per run]], ...], "plain_s": [...]}
    {"cmd": "mtp", "n": 128, "depth": 3, "prompt": "..."}
        -> {"s": seconds, "n": tokens, "drafted": .., "accepted": .., "tokens": [...]} (deltarun only):
           greedy generation with MTP drafts of the given depth (0: none)
    {"cmd": "quit"}

Each pp/tg/tgp/tgd command is one warm-up run plus one timed run, as `deltarun bench -r 1`.
"""

from __future__ import annotations

import json
import resource
import sys
from typing import Any, Callable


def cpu_has_amx() -> bool:
    """Whether this CPU has Intel AMX. llama.cpp's default CPU "extra buffer types" (repack/AMX)
    crash there (SIGSEGV or SIGILL, llama-cpp-python 0.3.36), so its side is measured with them
    off (`use_extra_bufts = false`, llama-server `-nr`) and the reports say so."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " amx_tile" in line for line in f)
    except OSError:
        return False


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def serve(ready: dict[str, Any], run: Callable[[str, int, str], float],
          extra: Callable[[], dict[str, Any]] = dict,
          commands: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] | None = None) -> None:
    """Announce `ready`, then answer commands; `run(cmd, n, mode)` times one pp or tg run,
    `extra()` adds fields to each timing reply, and `commands[cmd](request)` answers the others."""
    out = sys.stdout
    print(json.dumps(dict(ready, ready=True)), file=out, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        cmd = req.get("cmd")
        if cmd == "quit":
            break
        if cmd in ("pp", "tg"):
            mode = req.get("mode", "eval")
            run(cmd, req["n"], mode)                                   # warm-up
            print(json.dumps(dict(s=run(cmd, req["n"], mode), **extra())), file=out, flush=True)
        elif commands and cmd in commands:
            print(json.dumps(commands[cmd](req)), file=out, flush=True)
        elif cmd == "rss":
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            print(json.dumps({"rss": rss_bytes(), "peak": peak}), file=out, flush=True)
        else:
            print(json.dumps({"error": f"unknown command {cmd!r}"}), file=out, flush=True)
