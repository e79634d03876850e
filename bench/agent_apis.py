"""What the agent APIs cost over Chat Completions: per-request overhead, and evaluated tokens of an agent loop.

    python bench/agent_apis.py                       # the built-in model
    python bench/agent_apis.py model.gguf --requests 300 --json out.json

Two measurements on one `deltarun serve` (127.0.0.1, one slot; for `overhead` a process of its own,
as users run it: in this process it would share the GIL with the client, whose parsing of the
Responses stream's 38 KB showed up as server time, 1 ms of it):

- `overhead`: one agent-sized request (a system prompt, `--tools` tools with JSON schemas, a
  conversation of `--messages` messages with tool calls and results) sent as its Chat Completions,
  Anthropic Messages and OpenAI Responses equivalents, `--requests` times each, interleaved. After
  the first, the prompt is all cached (nothing evaluated) and one token is generated, so the time
  is the HTTP, parsing, translation, template, tokenizing, cache lookup and answer formatting of
  each API. Reported: median and p90 client wall time, streaming and not, and the median minus
  Chat Completions'. Then the translation on its own (`parse_messages` / `ResponsesRequest` against
  `parse_chat` of the same conversation), timed in this process without HTTP.
- `agent-loop`: the 6-turn loop of the tests (a forced tool call per turn, its result sent back),
  once per API on a fresh server: prompt and evaluated tokens per turn, which must be equal.

Numbers depend on the machine and its load: say both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from importlib import resources
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_turns_llama_server import Server, free_port  # noqa: E402  (one server process per port)


def _schema(i: int) -> dict:
    return {"type": "object", "properties": {
        "path": {"type": "string", "description": f"The file the tool number {i} works on, relative to the root."},
        "limit": {"type": "integer", "description": "How many lines at most."},
        "mode": {"enum": ["read", "write", "append"], "description": "What to do with it."}},
        "required": ["path"], "additionalProperties": False}


def agent_request(n_tools: int, n_messages: int) -> tuple[dict, dict, dict]:
    """(chat, messages, responses) bodies of the same agent conversation."""
    system = "You are a coding agent. Use the tools to read and change files. " * 40
    tools = [{"name": f"tool_{i}", "description": f"Tool number {i}: does one thing to a file. " * 3,
              "schema": _schema(i)} for i in range(n_tools)]
    chat_msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Fix the failing test please."}]
    anth_msgs = [{"role": "user", "content": "Fix the failing test please."}]
    items: list = [{"role": "user", "content": "Fix the failing test please."}]
    for k in range(max(0, (n_messages - 2) // 2)):
        args = {"path": f"src/module_{k}.py", "mode": "read"}
        cid = f"call_{k}"
        result = f"line {k}: def f(x):\n    return x + {k}\n" * 8
        chat_msgs += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": cid, "type": "function", "function": {"name": f"tool_{k % n_tools}", "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": cid, "content": result}]
        anth_msgs += [{"role": "assistant", "content": [{"type": "tool_use", "id": cid, "name": f"tool_{k % n_tools}",
                                                         "input": args}]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": cid, "content": result}]}]
        items += [{"type": "function_call", "call_id": cid, "name": f"tool_{k % n_tools}", "arguments": json.dumps(args)},
                  {"type": "function_call_output", "call_id": cid, "output": result}]
    common = {"model": "m", "temperature": 0}
    chat = {**common, "messages": chat_msgs, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False},
            "tools": [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                        "parameters": t["schema"]}} for t in tools]}
    messages = {**common, "system": system, "messages": anth_msgs, "max_tokens": 1, "thinking": {"type": "disabled"},
                "tools": [{"name": t["name"], "description": t["description"], "input_schema": t["schema"]}
                          for t in tools]}
    responses = {**common, "instructions": system, "input": items, "max_output_tokens": 1,
                 "reasoning": {"effort": "none"},
                 "tools": [{"type": "function", "name": t["name"], "description": t["description"],
                            "parameters": t["schema"]} for t in tools]}
    return chat, messages, responses


PATHS = {"chat": "/v1/chat/completions", "messages": "/v1/messages", "responses": "/v1/responses"}


def _time(client: httpx.Client, path: str, body: dict, stream: bool) -> float:
    t0 = time.perf_counter()
    if stream:
        with client.stream("POST", path, json={**body, "stream": True}) as r:
            for _ in r.iter_bytes():
                pass
            assert r.status_code == 200
    else:
        r = client.post(path, json=body)
        assert r.status_code == 200, r.text
    return time.perf_counter() - t0


def _prompt_tokens(name: str, usage: dict) -> int:
    """The prompt's tokens as each API reports them (Anthropic's cached ones apart)."""
    if name == "chat":
        return usage["prompt_tokens"]
    if name == "messages":
        return usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"]
    return usage["input_tokens"]


def overhead(model: Path, n_requests: int, n_tools: int, n_messages: int) -> dict:
    from deltarun.apps.serve.messages_api import parse_messages
    from deltarun.apps.serve.protocol import parse_chat
    from deltarun.apps.serve.responses_api import ResponsesRequest

    bodies = dict(zip(("chat", "messages", "responses"), agent_request(n_tools, n_messages)))
    out: dict = {"n_requests": n_requests, "n_tools": n_tools, "n_messages": n_messages}
    server = Server("deltarun serve", [sys.executable, "-m", "deltarun", "serve", str(model), "--parallel", "1",
                                       "--ctx", "32768", "--no-prefill-ahead"], free_port(),
                    Path(tempfile.gettempdir()) / "agent_apis-serve.log")
    try:
        with httpx.Client(base_url=server.url, timeout=120) as client:
            prompts = {name: _prompt_tokens(name, client.post(PATHS[name], json=bodies[name]).json()["usage"])
                       for name in PATHS}
            assert len(set(prompts.values())) == 1, prompts          # one conversation, three shapes
            out["prompt_tokens"] = prompts["chat"]
            for stream in (False, True):
                times: dict[str, list[float]] = {k: [] for k in PATHS}
                for name in PATHS:                                    # first: evaluates the prompt; then cached
                    _time(client, PATHS[name], bodies[name], stream)
                for _ in range(n_requests):
                    for name in PATHS:
                        times[name].append(_time(client, PATHS[name], bodies[name], stream))
                key = "stream" if stream else "json"
                out[key] = {name: {"median_ms": 1e3 * statistics.median(t),
                                   "p90_ms": 1e3 * sorted(t)[int(0.9 * len(t))]} for name, t in times.items()}
                for name in ("messages", "responses"):
                    out[key][name]["over_chat_ms"] = out[key][name]["median_ms"] - out[key]["chat"]["median_ms"]
    finally:
        server.stop()
    out["translation_us"] = {}
    for name, fn in (("chat", lambda: parse_chat(bodies["chat"])), ("messages", lambda: parse_messages(bodies["messages"])),
                     ("responses", lambda: ResponsesRequest(bodies["responses"]).chat)):
        reps = 200
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        out["translation_us"][name] = 1e6 * (time.perf_counter() - t0) / reps
    return out


def agent_loop(model: Path) -> dict:
    from test_serve import _server
    from test_serve_messages import LOOKUP, _chat_loop, _messages_loop
    from test_serve_responses import _responses_loop

    out = {}
    for name, run in (("chat", lambda h: [(n, ev) for n, ev, _ in _chat_loop(h, [LOOKUP])]),
                      ("messages", lambda h: [(n, ev) for n, _, ev, _ in _messages_loop(h, [LOOKUP])]),
                      ("responses", lambda h: [(n, ev) for n, _, ev, _ in _responses_loop(h, [LOOKUP], chained=True)])):
        with _server(model, parallel=2, chunk=32, checkpoint_every=0) as h:
            out[name] = run(h)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", type=Path,
                    default=Path(str(resources.files("deltarun.model_files") / "shakespeare-qwen3next-q8_0.gguf")))
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--tools", type=int, default=16)
    ap.add_argument("--messages", type=int, default=24)
    ap.add_argument("--loop-model", type=Path, default=None,
                    help="model of the agent loop (one whose forced tool calls parse: the tests' tiny ones)")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    res = {"overhead": overhead(a.model, a.requests, a.tools, a.messages)}
    if a.loop_model is not None:
        res["agent_loop"] = agent_loop(a.loop_model)
    o = res["overhead"]
    print(f"## Per-request overhead ({o['prompt_tokens']} prompt tokens, {o['n_tools']} tools, "
          f"{o['n_messages']} messages, {o['n_requests']} requests each, all cached, 1 token)\n")
    print("| API | JSON median ms | p90 | over chat | stream median ms | p90 | over chat | translation us |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in PATHS:
        j, s = o["json"][name], o["stream"][name]
        print(f"| {name} | {j['median_ms']:.2f} | {j['p90_ms']:.2f} | {j.get('over_chat_ms', 0):+.2f} | "
              f"{s['median_ms']:.2f} | {s['p90_ms']:.2f} | {s.get('over_chat_ms', 0):+.2f} | "
              f"{o['translation_us'][name]:.0f} |")
    if "agent_loop" in res:
        print("\n## Agent loop: (prompt, evaluated) tokens per turn\n")
        for name, turns in res["agent_loop"].items():
            print(f"- {name}: {turns}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
