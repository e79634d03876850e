"""Prompt tokens evaluated per agent turn: `deltarun serve` against llama-server, both on /v1/messages.

    python bench/agent_turns_llama_server.py --llama-server build/llama-server/bin/llama-server
    python bench/agent_turns_llama_server.py --llama-server BIN --model some.gguf --turns 6 --json out.json

An agent loop of `--turns` turns through the Anthropic Messages API (a system prompt, four tools
with JSON schemas, a task, then per turn a tool call and its result, the whole history re-sent
each time) against each server, started here on the same GGUF file with one slot. Two kinds of
history:

- `scripted`: every server gets byte-identical requests. The assistant turns sent back are a fixed
  script (the calls an agent made), not what the model wrote, so after each answer a server must
  go back to where the answer began and read the call and its result from there: the test of its
  checkpoints on a hybrid model, whose recurrent state cannot be rolled back token by token.
- `own`: each server's own answer is sent back (a forced call, `tool_choice: any`, on turns but
  the last), as a real agent does; the prompts then differ between the servers (on random weights
  llama-server's forced calls did not close within 120 tokens: see bench/RESULTS.md).

Then one more turn (unless `--no-follow-up`): the last answer sent back as it came and the user's
next message, after which Qwen3.5's template renders the earlier assistant turns differently.

Per turn: the prompt's tokens, and the tokens the server evaluated, from the answer's
`usage.input_tokens` (both servers report the tokens not read from their cache there, with
`cache_read_input_tokens` for the rest) and, as a check, from each server's own counter in
/metrics (deltarun: `deltarun_prompt_tokens_evaluated_total`, plus `..._ahead_total` for the
prompt starts it evaluates while idle, counted against the turn they were evaluated before;
llama-server `--metrics`: `llamacpp:prompt_tokens_total`). These are counts, not timings: valid on
a loaded machine. Thinking is off (`thinking: disabled` and `chat_template_kwargs`: llama-server's
/v1/messages reads only the latter).

Without `--model` the file is the tiny Qwen3.5 preset (3 delta-net + 1 attention layer, MTP
block) with the real Qwen2 vocabulary (`models/vocab.py`) and the Qwen3.5 chat template, written
to `--workdir`: both servers tokenize and render the same text the same way. llama-server runs
with `-nr` on AMX CPUs (its extra buffer types crash there) and `--jinja`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _worker_protocol import cpu_has_amx  # noqa: E402

SYSTEM = ("You are a coding agent working in a Python repository. Read files before you change them, "
          "keep changes small, run the tests after each change and report what you did. ") * 6
TASK = "The test tests/test_parse.py::test_dates fails since yesterday's commit. Find out why and fix it."
FOLLOW_UP = "Thanks. Now add a test for dates before 1970 and tell me whether it passes."


def _tool(name: str, description: str, props: dict, required: list[str]) -> dict:
    return {"name": name, "description": description,
            "input_schema": {"type": "object", "properties": props, "required": required,
                             "additionalProperties": False}}


TOOLS = [
    _tool("read_file", "Read a file of the repository, with line numbers.",
          {"path": {"type": "string", "maxLength": 40, "description": "Path from the repository root."},
           "start": {"type": "integer", "description": "First line to show."}}, ["path"]),
    _tool("grep", "Search the repository for a regular expression.",
          {"pattern": {"type": "string", "maxLength": 40}, "glob": {"type": "string", "maxLength": 20}}, ["pattern"]),
    _tool("edit_file", "Replace one exact piece of text in a file.",
          {"path": {"type": "string", "maxLength": 40}, "old": {"type": "string", "maxLength": 80},
           "new": {"type": "string", "maxLength": 80}}, ["path", "old", "new"]),
    _tool("run_tests", "Run pytest on some tests and return its output.",
          {"selector": {"type": "string", "maxLength": 60}}, ["selector"]),
]

#: The scripted calls (tool, input) and their results: an agent's first turns on TASK.
SCRIPT = [
    ("run_tests", {"selector": "tests/test_parse.py::test_dates"}),
    ("read_file", {"path": "src/parse.py"}),
    ("grep", {"pattern": "def parse_date", "glob": "*.py"}),
    ("read_file", {"path": "src/dates.py", "start": 1}),
    ("edit_file", {"path": "src/dates.py", "old": "fmt = '%d/%m/%Y'", "new": "fmt = '%Y-%m-%d'"}),
    ("run_tests", {"selector": "tests/test_parse.py"}),
    ("run_tests", {"selector": "tests"}),
]


def tool_result(turn: int, name: str) -> str:
    """A result of the size agents send back (a file listing, test output): 20-40 lines."""
    if name == "read_file":
        return "".join(f"{i:4d}  def helper_{turn}_{i}(value):\n      return value.strip().lower() + '{i}'\n"
                       for i in range(1, 16))
    if name == "grep":
        return "".join(f"src/module_{i}.py:{10 * i}: def parse_date(text, fmt=None):  # turn {turn}\n"
                       for i in range(12))
    if name == "edit_file":
        return "Replaced 1 occurrence in src/dates.py."
    return ("============================= test session starts ==============================\n"
            + "".join(f"tests/test_parse.py::test_case_{i} PASSED\n" for i in range(10))
            + f"tests/test_parse.py::test_dates FAILED\n    assert parse_date('2024-01-0{turn}') == date(2024, 1, {turn})\n"
            + "E   ValueError: time data '2024-01-01' does not match format '%d/%m/%Y'\n"
            + "========================= 1 failed, 10 passed in 0.12s =========================\n")


def request(msgs: list[dict], turn: int, turns: int, mode: str) -> dict:
    forced = mode == "own" and turn < turns - 1
    return {"model": "m", "max_tokens": 120 if mode == "own" else 8, "system": SYSTEM, "messages": msgs,
            "tools": TOOLS, "tool_choice": {"type": "any"} if forced else {"type": "auto"},
            "temperature": 0, "thinking": {"type": "disabled"},
            "chat_template_kwargs": {"enable_thinking": False}}


# --------------------------------------------------------------------------------------------- servers
class Server:
    """One server process on a free port, with its evaluated-token counter from /metrics."""

    def __init__(self, name: str, command: list[str], port: int, log: Path):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self._log = open(log, "ab")
        command = [*command, "--host", "127.0.0.1", "--port", str(port)]
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=self._log, env=dict(os.environ))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"{name} exited with {self.proc.returncode}: see {log}")
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"{name} did not come up in 300 s: see {log}")

    def counters(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=30).text
        out = {}
        for line in text.splitlines():
            m = re.match(r"^([a-zA-Z_:]+)\s+([0-9.e+-]+)$", line)
            if m:
                out[m.group(1)] = float(m.group(2))
        return out

    def evaluated(self) -> tuple[float, float]:
        """(tokens evaluated for requests, tokens evaluated ahead while idle) so far."""
        c = self.counters()
        if "llamacpp:prompt_tokens_total" in c:
            return c["llamacpp:prompt_tokens_total"], 0.0
        return c.get("deltarun_prompt_tokens_evaluated_total", 0.0), c.get("deltarun_prompt_tokens_ahead_total", 0.0)

    def settle(self) -> None:
        """Wait until the idle work (deltarun's prefill ahead) is over: the counters stop moving."""
        last = self.evaluated()
        for _ in range(120):
            time.sleep(0.5)
            now = self.evaluated()
            if now == last:
                return
            last = now

    def stop(self) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from serve_load import stop_server

        stop_server(self.proc)
        self._log.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_loop(server: Server, turns: int, mode: str, follow_up: bool) -> list[dict]:
    msgs: list[dict] = [{"role": "user", "content": TASK}]
    rows: list[dict] = []
    n = turns + (1 if follow_up else 0)
    for turn in range(n):
        server.settle()
        before = server.evaluated()
        r = httpx.post(server.url + "/v1/messages", json=request(msgs, turn, turns, mode), timeout=1800)
        if r.status_code != 200:
            raise SystemExit(f"{server.name}, turn {turn + 1}: HTTP {r.status_code}: {r.text[:400]}")
        ans = r.json()
        u = ans["usage"]
        after = server.evaluated()
        rows.append({"turn": turn + 1, "follow_up": turn == turns,
                     "prompt": u["input_tokens"] + u.get("cache_read_input_tokens", 0),
                     "evaluated": u["input_tokens"], "cached": u.get("cache_read_input_tokens", 0),
                     "counter": after[0] - before[0], "ahead_before": before[1] - (rows[-1]["_ahead"] if rows else 0),
                     "output": u["output_tokens"], "stop_reason": ans.get("stop_reason"), "_ahead": after[1]})
        if turn == n - 1:
            break
        if turn == turns - 1:              # the agent's last answer, sent back as it came, and the user's next message
            text = "".join(b["text"] for b in ans["content"] if b["type"] == "text")
            msgs.append({"role": "assistant", "content": [{"type": "text", "text": text or "..."}]})
            msgs.append({"role": "user", "content": FOLLOW_UP})
            continue
        if mode == "scripted":
            name, args = SCRIPT[turn % len(SCRIPT)]
            call = {"type": "tool_use", "id": f"toolu_{turn:02d}", "name": name, "input": args}
            msgs.append({"role": "assistant", "content": [call]})
        else:
            blocks = [b for b in ans["content"] if b["type"] in ("text", "tool_use") and (b["type"] != "text" or b["text"])]
            msgs.append({"role": "assistant", "content": blocks or [{"type": "text", "text": "..."}]})
            call = next((b for b in blocks if b["type"] == "tool_use"), None)
            name = call["name"] if call else ""
        if call is not None:
            msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"],
                                                      "content": tool_result(turn, name)}]})
        else:
            msgs.append({"role": "user", "content": "Go on."})
    for r in rows:
        r.pop("_ahead")
    return rows


# ------------------------------------------------------------------------------------------------ main
def tiny_model(workdir: Path) -> Path:
    """tiny-qwen35 with the real Qwen2 vocabulary (see the module)."""
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    from deltarun.model_files import qwen35

    path = workdir / "tiny-qwen35-vocab151k-f32.gguf"
    if not path.exists():
        workdir.mkdir(parents=True, exist_ok=True)
        qwen35.write_model(path, qwen35.config_with("tiny-qwen35", vocab="qwen2"), "f32", 0)
    return path


def commands(args: argparse.Namespace, model: Path) -> dict[str, tuple[list[str], Path]]:
    threads = ["--threads", str(args.threads)]
    out = {}
    for ahead in (False, True):
        name = "deltarun" + ("" if ahead else " (no prefill ahead)")
        out[name] = [sys.executable, "-m", "deltarun", "serve", str(model), "--parallel", "1", "--ctx", str(args.ctx),
                     *threads, *([] if ahead else ["--no-prefill-ahead"])]
    if args.llama_server:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from serve_load import trained_context_override

        out["llama-server"] = [args.llama_server, "-m", str(model), "-np", "1", "-c", str(args.ctx), "--jinja",
                               "--metrics", *threads, *trained_context_override(str(model), args.ctx),
                               *(["-nr"] if cpu_has_amx() else []), *args.llama_args]
    # (the Server adds --host and --port: after --llama-args, which takes the rest of the command line)
    return {k: (v, args.workdir / f"{k.split()[0]}{'-noahead' if 'no prefill' in k else ''}.log")
            for k, v in out.items()}


def table(results: dict[str, dict[str, list[dict]]]) -> str:
    lines = []
    for mode, by_server in results.items():
        names = list(by_server)
        first = next(iter(by_server.values()))
        lines.append(f"\n**{mode}** (per turn: prompt tokens / evaluated by usage / by the server's counter"
                     " / for deltarun, evaluated ahead while idle before it)\n")
        lines.append("| turn | " + " | ".join(names) + " |")
        lines.append("| ---: | " + " | ".join("---" for _ in names) + " |")
        for i, row in enumerate(first):
            cells = []
            for n in names:
                r = by_server[n][i]
                cell = f"{r['prompt']} / {r['evaluated']} / {r['counter']:.0f}"
                if n.startswith("deltarun"):
                    cell += f" / {r['ahead_before']:.0f}"
                cells.append(cell)
            lines.append(f"| {i + 1}{' (user)' if row['follow_up'] else ''} | " + " | ".join(cells) + " |")
        tool_turns = [i for i, r in enumerate(first) if i > 0 and not r["follow_up"]]
        follow = [i for i, r in enumerate(first) if r["follow_up"]]
        for label, idx in ((f"tool turns 2-{len(tool_turns) + 1}", tool_turns), ("the user's next message", follow)):
            if not idx:
                continue
            req = {n: sum(rows[i]["evaluated"] for i in idx) for n, rows in by_server.items()}
            idle = {n: sum(rows[i]["ahead_before"] for i in idx) for n, rows in by_server.items()}
            lines.append(f"\n{label}: evaluated at request time (+ ahead while idle): "
                         + ", ".join(f"{n} {req[n]} (+{idle[n]:.0f})" for n in names))
            if req.get("llama-server"):
                lines.append("".join(f"; {n} {req[n] / req['llama-server']:.2f}x "
                                     f"({(req[n] + idle[n]) / req['llama-server']:.2f}x with the idle work)"
                                     for n in names if n != "llama-server").lstrip("; "))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-server", metavar="PATH", help="llama-server binary for the other side")
    ap.add_argument("--model", type=Path, default=None, help="GGUF file (default: the tiny Qwen3.5 with a real vocabulary)")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--modes", default="scripted,own")
    ap.add_argument("--no-follow-up", action="store_true", help="leave out the user's message after the last answer")
    ap.add_argument("--ctx", type=int, default=16384)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/agent-turns"))
    ap.add_argument("--llama-args", nargs=argparse.REMAINDER, default=[], help="more llama-server arguments (last)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    model = args.model or tiny_model(args.workdir)
    results: dict[str, dict[str, list[dict]]] = {}
    errors: list[str] = []
    for mode in args.modes.split(","):
        for name, (command, log) in commands(args, model).items():      # a fresh server per loop
            server = Server(name, command, free_port(), log)
            try:
                results.setdefault(mode, {})[name] = agent_loop(server, args.turns, mode, not args.no_follow_up)
            except SystemExit as e:                     # a refused request: said, and the others go on
                errors.append(f"{mode}, {str(e)}")
            finally:
                server.stop()
    print(f"model: {model}")
    print(table(results))
    for e in errors:
        print(f"- error: {e}")
    if args.json:
        args.json.write_text(json.dumps({"model": str(model), "results": results, "errors": errors}, indent=1))


if __name__ == "__main__":
    main()
