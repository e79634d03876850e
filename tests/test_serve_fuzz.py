"""Fuzzing `deltarun serve`'s request bodies: bad input is a 4xx in the API's own error shape.

Hypothesis starts from valid bodies of every endpoint that takes one (/v1/chat/completions,
/v1/completions, /v1/messages, /v1/messages/count_tokens, /v1/responses, /tokenize, /detokenize:
tools, tool choices, tool calls and results, thinking, JSON schemas, stop sequences, logit_bias,
logprobs, streams, a stored response continued) and mutates one or two places of the body at a
time: a value replaced by one of another JSON type, an empty or boundary one (0, -1, 2**63, 1e308,
NaN, Infinity), an unknown enum value, a block or schema of the wrong kind; a field removed; a
known field added with such a value; a numeric setting set to an edge number; one part of the body
copied over another (a message where a tool goes); a list item duplicated (two tools of one name).

The cases go to one `deltarun serve` child process per model, started once for the module:
`tiny` (Qwen3's template, JSON tool calls) and `tiny-qwen35` (Qwen3.5's: XML tool calls, a think
block). Each answer must be below 500; a 4xx must carry a JSON error in the API's shape (OpenAI's,
or Anthropic's under /v1/messages); a 200 must be strict JSON (no NaN), tool calls' arguments
included; a stream must end as its API ends one, with no server error inside; no request may take
longer than REQUEST_TIMEOUT_S; and the server's log (a file) gets no traceback and no internal
error from any case. After each run the server still answers /health.

The default run is 300 derandomized cases (200 on `tiny`, 100 on `tiny-qwen35`); `-m slow` runs
600 on each. Beside them: every numeric setting at every edge number (what random mutations reach
only by luck), odd ids for GET and DELETE /v1/responses/{id}, and a regression case for each bug
found (REGRESSIONS and the tests after it).
"""

from __future__ import annotations

import copy
import json
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from deltarun.apps.serve.grammar import GrammarFactory
from deltarun.apps.serve.server import free_port
from deltarun.base.gguf_file import GGUFFile

from serve_child import start_serve, stop_serve

N_CTX = 1024               # bounds an answer whose max_tokens a mutation removed (about 2 s on the tiny model)
REQUEST_TIMEOUT_S = 60.0   # longer is a hang
DEFAULT_CASES = {"tiny": 200, "tiny-qwen35": 100}
SLOW_CASES = 600
PREV = "$PREV"             # stands for the id of a response the server has stored

CHAT, COMPLETIONS, TOKENIZE, DETOKENIZE = "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"
MESSAGES, COUNT, RESPONSES = "/v1/messages", "/v1/messages/count_tokens", "/v1/responses"

# --------------------------------------------------------------------------------------------- bodies
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                   "unit": {"enum": ["c", "f"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
LOOKUP_SCHEMA = {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8}}, "required": ["word"]}
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                "parameters": WEATHER_SCHEMA}},
              {"type": "function", "function": {"name": "lookup", "parameters": LOOKUP_SCHEMA}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER_SCHEMA},
                   {"name": "lookup", "input_schema": LOOKUP_SCHEMA}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city",
                    "parameters": WEATHER_SCHEMA}, {"type": "function", "name": "lookup", "parameters": LOOKUP_SCHEMA}]
ANSWER_SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}, "n": {"type": "integer"}},
                 "required": ["a"]}

#: valid bodies of every endpoint: what the mutations start from
BASES: list[tuple[str, dict[str, Any]]] = [
    (CHAT, {"model": "m", "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"}],
            "max_tokens": 3, "temperature": 0.7, "seed": 1, "stop": ["\n\n", "END"], "logit_bias": {"5": 1.5},
            "logprobs": True, "top_logprobs": 2, "n": 1}),
    (CHAT, {"messages": [{"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": "",
                          "tool_calls": [{"id": "c1", "type": "function",
                                          "function": {"name": "get_weather",
                                                       "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "12 C"},
                         {"role": "user", "content": "And Rome?"}],
            "tools": CHAT_TOOLS, "tool_choice": "auto", "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}),
    (CHAT, {"messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": CHAT_TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 4,
            "temperature": 0}),
    (CHAT, {"messages": [{"role": "developer", "content": [{"type": "text", "text": "Answer in JSON."}]},
                         {"role": "user", "content": [{"type": "text", "text": "a or b?"}]}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}},
            "max_tokens": 4, "chat_template_kwargs": {"enable_thinking": False}, "reasoning_budget_tokens": 2}),
    (CHAT, {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "hello", "reasoning_content": "greet back"},
                         {"role": "user", "content": "more"}],
            "max_completion_tokens": 2, "top_k": 5, "top_p": 0.9, "min_p": 0.05, "repeat_penalty": 1.1,
            "repeat_last_n": 16, "presence_penalty": 0.5, "frequency_penalty": 0.5, "ignore_eos": True,
            "stream": True, "chat_template_kwargs": {"enable_thinking": True}}),
    (COMPLETIONS, {"model": "m", "prompt": "Once upon", "max_tokens": 3, "logprobs": 2, "echo": True, "stop": "\n",
                   "seed": 3}),
    (COMPLETIONS, {"prompt": [1, 2, 3], "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True},
                   "logit_bias": {"7": -100}, "temperature": 0}),
    (MESSAGES, {"model": "m", "max_tokens": 3, "system": "Be terse.",
                "messages": [{"role": "user", "content": "hi"}], "stop_sequences": ["END"], "temperature": 0.5,
                "top_k": 5, "metadata": {"user_id": "u"}}),
    (MESSAGES, {"model": "m", "max_tokens": 4, "stream": True,
                "system": [{"type": "text", "text": "You help.", "cache_control": {"type": "ephemeral"}}],
                "messages": [{"role": "user", "content": "Weather in Paris?"},
                             {"role": "assistant", "content": [
                                 {"type": "thinking", "thinking": "Use the tool.", "signature": ""},
                                 {"type": "text", "text": "Checking."},
                                 {"type": "tool_use", "id": "tu1", "name": "get_weather",
                                  "input": {"city": "Paris", "unit": "c"}}]},
                             {"role": "user", "content": [
                                 {"type": "tool_result", "tool_use_id": "tu1",
                                  "content": [{"type": "text", "text": "12 C"}], "is_error": False},
                                 {"type": "text", "text": "Thanks. And Rome?"}]}],
                "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
                "thinking": {"type": "enabled", "budget_tokens": 2}}),
    (MESSAGES, {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"}}),
    (MESSAGES, {"model": "m", "max_tokens": 4, "stream": True, "thinking": {"type": "disabled"},
                "messages": [{"role": "user", "content": [{"type": "text", "text": "a or b?"}]}],
                "output_config": {"format": {"type": "json_schema", "schema": ANSWER_SCHEMA}}}),
    (COUNT, {"model": "m", "system": "Be terse.", "messages": [{"role": "user", "content": "Weather in Paris?"}],
             "tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any"}, "thinking": {"type": "adaptive"}}),
    (COUNT, {"model": "m", "messages": [{"role": "user", "content": "a or b?"}],
             "output_config": {"format": {"type": "json_schema", "schema": ANSWER_SCHEMA}}}),
    (RESPONSES, {"model": "m", "input": "hi", "instructions": "Be terse.", "max_output_tokens": 3,
                 "temperature": 0.5, "top_p": 0.9, "store": True, "metadata": {"k": "v"},
                 "reasoning": {"effort": "none"}}),
    (RESPONSES, {"model": "m", "max_output_tokens": 4, "stream": True, "parallel_tool_calls": False,
                 "tools": RESPONSES_TOOLS, "tool_choice": "auto",
                 "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Paris?"}]},
                           {"type": "reasoning", "summary": [],
                            "content": [{"type": "reasoning_text", "text": "Use the tool."}]},
                           {"type": "function_call", "call_id": "fc1", "name": "get_weather",
                            "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"},
                           {"type": "function_call_output", "call_id": "fc1", "output": "12 C"},
                           {"type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": "12 C in Paris."}]},
                           {"role": "user", "content": "And Rome?"}]}),
    (RESPONSES, {"model": "m", "input": [{"role": "developer", "content": "Answer in JSON."},
                                         {"role": "user", "content": "a or b?"}],
                 "max_output_tokens": 4, "reasoning": {"effort": "high"},
                 "text": {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA,
                                     "strict": True}}}),
    (RESPONSES, {"model": "m", "previous_response_id": PREV, "input": "more", "max_output_tokens": 2,
                 "tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "lookup"}, "store": False}),
    (TOKENIZE, {"content": "hello <|im_end|> world", "add_special": True, "parse_special": True, "with_pieces": True}),
    (DETOKENIZE, {"tokens": [1, 2, 3, 100]}),
]

#: field names a mutation may add to an object (what the APIs read somewhere, at any depth)
FIELDS = sorted({
    "model", "messages", "max_tokens", "max_completion_tokens", "n_predict", "n", "temperature", "top_k", "top_p",
    "min_p", "seed", "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "logit_bias",
    "stop", "ignore_eos", "logprobs", "top_logprobs", "stream", "stream_options", "include_usage", "tools",
    "tool_choice", "response_format", "chat_template_kwargs", "reasoning_budget_tokens", "prompt", "echo",
    "system", "stop_sequences", "thinking", "budget_tokens", "output_config", "output_format", "metadata",
    "input", "instructions", "max_output_tokens", "text", "format", "reasoning", "effort", "previous_response_id",
    "store", "background", "parallel_tool_calls", "user", "content", "role", "type", "name", "description",
    "parameters", "input_schema", "function", "arguments", "tool_calls", "tool_call_id", "tool_use_id", "id",
    "is_error", "source", "media_type", "data", "image_url", "url", "call_id", "output", "reasoning_content",
    "json_schema", "schema", "strict", "properties", "required", "$ref", "items", "enum", "maxLength",
    "disable_parallel_tool_use", "enable_thinking", "images", "self", "add_special", "parse_special",
    "with_pieces", "tokens", "refusal", "file_id", "signature", "summary",
})
#: values that break expectations: other JSON types, empties, boundaries, unknown enum values,
#: blocks and schemas of the wrong kind
ODD_SCALARS = [None, True, False, 0, -1, 1, 2, 2**31, 2**63, -2**63, 2**64, 10**39, 0.5, -0.0, 1e308, -1e308, 5e-324,
               float("nan"), float("inf"), float("-inf"), "", " ", "x", "nonsense", "auto", "any", "required", "none",
               "tool", "function", "text", "json_object", "json_schema", "enabled", "disabled", "user", "assistant",
               "system", "tool_use", "tool_result", "image", "input_image", "high", "resp_nonexistent", "\x00",
               "<tool_call>", "</think>", "<|im_end|>", "{", "[1]", "é" * 5, "data:image/png;base64,AAAA"]
ODD_COMPOUNDS: list[Any] = [
    [], {}, [None], [""], [0], [1, 2], [[]], [{}], {"": None}, {"type": None},
    {"type": "nonsense"}, {"$ref": "#/nothing"}, {"$ref": "#"}, {"type": ["string", 5]},
    {"type": "object", "properties": []}, {"type": "object", "properties": "abc"},
    {"type": "object", "properties": {"a": 5}}, {"type": "object", "required": 5},
    {"type": "object", "properties": {"a": {}}, "required": [[1], {"x": 1}]},
    {"type": "object", "properties": {"a\"b>\n": {"maxLength": 2**63}}},
    {"type": "object", "properties": {"a": {"enum": []}, "b": {"maxLength": True}, "c": {"enum": ["<", 1]}}},
    {"type": "string", "pattern": "(("}, {"type": "integer", "minimum": 5, "maximum": 1},
    {"anyOf": []}, {"allOf": [{"type": "string"}, {"type": "integer"}]}, {"not": {}},
    [{"type": "text", "text": "x"}], [{"type": "text"}], [{"type": "nonsense"}], [{"type": "text", "text": 5}],
    [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}],
    [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}],
    [{"type": "input_image", "image_url": "https://example.com/x.png"}],
    [{"type": "tool_result", "tool_use_id": "nope", "content": [{"type": "image"}]}],
    [{"type": "tool_use", "id": 5, "name": "", "input": []}], [{"type": "thinking"}],
    [{"role": "user"}], [{"role": "assistant", "content": "x"}], [{"role": "tool", "content": "x"}],
    [{"role": "system", "content": "x"}, {"role": "system", "content": "y"}],
    [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1, 2]"}],
    [{"type": "function_call_output", "call_id": 5}], [{"type": "reasoning", "content": "x"}],
    {"name": "nope"}, {"type": "function", "name": "nope"}, {"type": "function", "function": {"name": "nope"}},
    {"type": "function", "function": "get_weather"}, {"type": "tool", "name": "nope"}, {"type": "tool", "name": 5},
    [{"type": "function", "function": {"name": "get_weather"}} for _ in range(2)],
    [{"name": "get_weather"}, {"name": "get_weather", "input_schema": {"type": "nonsense"}}],
    [{"type": "function", "name": "x", "parameters": {"$ref": "#/definitions/missing"}}],
    {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": {"type": "nonsense"}}},
    {"type": "json_schema", "schema": {"$ref": "#/nothing"}}, {"format": {"type": "json_schema", "schema": []}},
    {"images": True}, {"self": 1}, {"enable_thinking": "yes", "add_generation_prompt": False},
    {"raise_exception": 1, "namespace": None}, {"include_usage": "yes"}, {"effort": ["high"]},
    {"type": "enabled", "budget_tokens": 0}, {"type": "enabled", "budget_tokens": 2**63}, {"type": "adaptive"},
    {"-1": 1}, {"99999999": 1}, {"5": 101}, {"5": "x"}, {"０": 1},
]
#: the numeric fields of the sampling and length settings, and numbers at the edges of their ranges
NUMERIC_FIELDS = ["max_tokens", "max_completion_tokens", "n_predict", "n", "temperature", "top_k", "top_p", "min_p",
                  "seed", "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty", "logprobs",
                  "top_logprobs", "reasoning_budget_tokens", "max_output_tokens"]
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "n_predict", "max_output_tokens")
EDGE_NUMBERS = [0, -0.0, 5e-324, 1e-320, 1e-300, 1e-30, 1e-7, 1e-6, 1e-3, 0.5, 0.999999, 1, 1.0, 1.000001, 2,
                2.0000001, 3.0, 20, 21, 100, 100.5, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 1e308, -1, -1.5, -2,
                -2.0000001, -2**63, -1e308]
_LEAF = st.none() | st.booleans() | st.integers(-2**64, 2**64) | st.floats() | st.text(max_size=6)
_SMALL_JSON = st.recursive(_LEAF, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=4), inner, max_size=3),
                           max_leaves=6)
ODD_VALUES = st.one_of(st.sampled_from(ODD_SCALARS), st.sampled_from(ODD_COMPOUNDS).map(copy.deepcopy), _SMALL_JSON)


# --------------------------------------------------------------------------------------------- mutations
def _spots(value: Any, at: tuple = ()) -> Iterator[tuple]:
    """The path (keys and indices from the root) of every value in `value`, the root's () first."""
    yield at
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _spots(v, at + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _spots(v, at + (i,))


def _get(body: Any, at: tuple) -> Any:
    for k in at:
        body = body[k]
    return body


def _set(body: Any, at: tuple, value: Any) -> Any:
    """`body` with the value at `at` replaced (the root replaced: `value` itself)."""
    if not at:
        return value
    _get(body, at[:-1])[at[-1]] = value
    return body


@st.composite
def mutated(draw: Any, body: Any) -> Any:
    """`body` with one mutation (see the module docstring)."""
    spots = list(_spots(body))
    kind = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add", "add", "copy", "duplicate",
                                 "number", "number", "number"]))
    if kind == "number" and isinstance(body, dict):
        body[draw(st.sampled_from(NUMERIC_FIELDS))] = draw(st.sampled_from(EDGE_NUMBERS) | st.floats(allow_nan=False))
        return body
    if kind == "replace":
        return _set(body, draw(st.sampled_from(spots)), draw(ODD_VALUES))
    if kind == "delete" and len(spots) > 1:
        at = draw(st.sampled_from(spots[1:]))
        del _get(body, at[:-1])[at[-1]]
        return body
    if kind == "add":
        objects = [at for at in spots if isinstance(_get(body, at), dict)]
        if objects:
            at = draw(st.sampled_from(objects))
            _get(body, at)[draw(st.sampled_from(FIELDS))] = draw(ODD_VALUES)
            return body
    if kind == "copy" and len(spots) > 1:
        source = copy.deepcopy(_get(body, draw(st.sampled_from(spots))))
        return _set(body, draw(st.sampled_from(spots)), source)
    if kind == "duplicate":
        lists = [at for at in spots if isinstance(_get(body, at), list) and _get(body, at)]
        if lists:
            items = _get(body, draw(st.sampled_from(lists)))
            items.insert(draw(st.integers(0, len(items))), copy.deepcopy(draw(st.sampled_from(items))))
            return body
    return _set(body, draw(st.sampled_from(spots)), draw(ODD_VALUES))


@st.composite
def cases(draw: Any) -> tuple[str, Any]:
    """(path, body): a base body with one or two mutations."""
    path, base = draw(st.sampled_from(BASES))
    body = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 2))):
        body = draw(mutated(body))
    return path, body


# --------------------------------------------------------------------------------------------- the server
class Served:
    """A `deltarun serve` child process: its base URL, log, and a stored response's id."""

    def __init__(self, base: str, log: Path, proc: subprocess.Popen, model: Path):
        self.base, self.log, self.proc, self.model = base, log, proc, model
        self.prev_id = ""
        self._read = 0

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def new_log(self) -> str:
        """What the server logged since the last call."""
        with open(self.log, "rb") as f:
            f.seek(self._read)
            data = f.read()
        self._read += len(data)
        return data.decode(errors="replace")


def _start(path: Path, log: Path) -> Served:
    port = free_port()
    proc = start_serve([str(path), "--host", "127.0.0.1", "--parallel", "1", "--ctx", str(N_CTX), "--threads", "1",
                        "--log-level", "info"], log, port)
    s = Served(f"http://127.0.0.1:{port}", log, proc, path)
    r = httpx.post(s.base + RESPONSES, json={"input": "hi", "max_output_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
    s.prev_id = r.json()["id"]
    return s


@pytest.fixture(scope="module")
def servers(tiny_model_path, tmp_path_factory) -> Iterator[dict[str, Served]]:
    """One server per model (by preset), started on first use and stopped with the module."""
    class Lazy(dict):
        def __missing__(self, preset: str) -> Served:
            log = tmp_path_factory.mktemp("fuzz") / f"serve-{preset}.log"
            self[preset] = _start(tiny_model_path(preset, "f32"), log)
            return self[preset]

    started = Lazy()
    try:
        yield started
    finally:
        for s in started.values():
            stop_serve(s.proc)


# --------------------------------------------------------------------------------------------- checks
def _encode(body: Any, prev_id: str) -> bytes:
    """The body as JSON text (NaN and Infinity as Python writes them), PREV replaced by a stored id."""
    def fill(v: Any) -> Any:
        if v == PREV and isinstance(v, str):
            return prev_id
        if isinstance(v, dict):
            return {k: fill(x) for k, x in v.items()}
        if isinstance(v, list):
            return [fill(x) for x in v]
        return v
    return json.dumps(fill(body)).encode()


def _strict(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(text: str) -> Any:
    """JSON as a strict client reads it (NaN and Infinity are Python's, not JSON)."""
    return json.loads(text, parse_constant=_strict)


def _check_arguments(value: Any) -> None:
    """The tool calls' arguments in an answer (`arguments`, a Messages stream's `partial_json`: one
    delta holds a whole call) are JSON a strict client reads."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            for k, x in v.items():
                if k in ("arguments", "partial_json") and isinstance(x, str):
                    if x:                            # "": an item announced, not yet filled
                        loads(x)
                else:
                    stack.append(x)
        elif isinstance(v, list):
            stack.extend(v)


def _check_error(path: str, err: Any, status: int) -> None:
    """A 4xx's JSON (or a stream's error event) in the shape of the API `path` belongs to."""
    if path.startswith(MESSAGES):
        assert isinstance(err, dict) and err.get("type") == "error", err
        e = err["error"]
        assert isinstance(e, dict) and isinstance(e.get("type"), str) and isinstance(e.get("message"), str), err
        assert e["message"] and e["type"] not in ("api_error", "overloaded_error"), err
    else:
        assert isinstance(err, dict) and isinstance(err.get("error"), dict), err
        e = err["error"]
        assert set(e) >= {"message", "type", "param", "code"} and isinstance(e["message"], str) and e["message"], err
        assert e["type"] not in ("server_error", "unavailable_error"), err
    assert 400 <= status < 500


def _check_stream(path: str, lines: list[str]) -> None:
    """The events of a stream: JSON data, no server error, the API's end."""
    events: list[tuple[str | None, str]] = []
    name = None
    for line in lines:
        if line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            events.append((name, line[5:].strip()))
            name = None
    assert events, lines
    if path in (CHAT, COMPLETIONS):
        assert events[-1][1] == "[DONE]", lines[-5:]
        for _, data in events[:-1]:
            chunk = loads(data)
            _check_arguments(chunk)
            if "error" in chunk:
                _check_error(path, chunk, 400)
    elif path == MESSAGES:
        assert events[-1][0] in ("message_stop", "error"), lines[-5:]
        for kind, data in events:
            d = loads(data)
            _check_arguments(d)
            if kind == "error":
                _check_error(path, d, 400)
    else:
        assert events[-1][0] in ("response.completed", "response.incomplete", "response.failed"), lines[-5:]
        for kind, data in events:
            d = loads(data)
            _check_arguments(d)
            if kind in ("error", "response.failed"):
                err = d.get("response", {}).get("error") if kind == "response.failed" else d
                assert err["code"] not in ("server_error", "unavailable_error"), d


def send(s: Served, client: httpx.Client, path: str, body: Any, raw: bytes | None = None) -> tuple[int, Any]:
    """Post one case and check the answer (see the module docstring); (status, JSON or stream lines)."""
    content = raw if raw is not None else _encode(body, s.prev_id)
    what = f"POST {path} {content[:1500]!r}"
    t0 = time.monotonic()
    try:
        with client.stream("POST", path, content=content, headers={"content-type": "application/json"}) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                assert time.monotonic() - t0 < REQUEST_TIMEOUT_S, f"{what}: no end after {REQUEST_TIMEOUT_S} s"
            text = "\n".join(lines)
    except httpx.TimeoutException:
        pytest.fail(f"{what}: no answer within {REQUEST_TIMEOUT_S} s")
    except httpx.TransportError as e:
        pytest.fail(f"{what}: the connection failed ({e!r}); server alive: {s.proc.poll() is None}")
    log = s.new_log()
    assert "Traceback" not in log and "internal error" not in log, f"{what}: the server logged\n{log[-4000:]}"
    assert r.status_code < 500, f"{what}: {r.status_code} {text[:1000]}"
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        assert r.status_code == 200, what
        try:
            _check_stream(path, lines)
        except (AssertionError, ValueError, KeyError, TypeError) as e:
            raise AssertionError(f"{what}: a bad stream ({e!r}): {text[-1500:]}") from None
        return r.status_code, lines
    try:
        answer = loads(text)
    except ValueError:
        raise AssertionError(f"{what}: {r.status_code} is not JSON: {text[:500]!r}") from None
    if r.status_code >= 400:
        try:
            _check_error(path, answer, r.status_code)
        except AssertionError as e:
            raise AssertionError(f"{what}: {r.status_code} not in the API's error shape: {e}") from None
    else:
        assert r.status_code == 200 and isinstance(answer, dict) and not answer.get("error"), f"{what}: {text[:500]}"
        try:
            _check_arguments(answer)
        except ValueError as e:
            raise AssertionError(f"{what}: a tool call's arguments are not JSON ({e}): {text[:1000]}") from None
    return r.status_code, answer


def _assert_healthy(s: Served) -> None:
    assert s.proc.poll() is None, f"the server died: {s.log_text()[-3000:]}"
    assert httpx.get(s.base + "/health", timeout=10).status_code == 200
    log = s.log_text()
    assert "Traceback" not in log, log[-4000:]


def run_fuzz(s: Served, n_cases: int) -> Counter:
    outcomes: Counter = Counter()
    with httpx.Client(base_url=s.base, timeout=REQUEST_TIMEOUT_S) as client:
        @settings(max_examples=n_cases, derandomize=True, database=None, deadline=None,
                  phases=(Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck))
        @given(case=cases())
        def one_case(case: tuple[str, Any]) -> None:
            path, body = case
            status, _ = send(s, client, path, body)
            outcomes[(path, status)] += 1

        t0 = time.perf_counter()
        try:
            one_case()
        finally:
            total = sum(outcomes.values())
            summary = ", ".join(f"{p} {st_} x{n}" for (p, st_), n in sorted(outcomes.items()))
            print(f"\nfuzz: {total} cases in {time.perf_counter() - t0:.1f} s ({summary})")
    return outcomes


# --------------------------------------------------------------------------------------------- tests
def test_bases_are_valid(servers):
    """Every unmutated body is answered 200 (so the mutations start from requests that work)."""
    s = servers["tiny"]
    with httpx.Client(base_url=s.base, timeout=REQUEST_TIMEOUT_S) as client:
        for path, body in BASES:
            status, _ = send(s, client, path, body)
            assert status == 200, (path, body)


@pytest.mark.parametrize("preset", sorted(DEFAULT_CASES))
def test_fuzz_request_bodies(servers, preset):
    s = servers[preset]
    outcomes = run_fuzz(s, DEFAULT_CASES[preset])
    assert sum(outcomes.values()) >= DEFAULT_CASES[preset] * 0.9    # hypothesis may skip a few duplicates
    statuses = {st_ for _, st_ in outcomes}
    assert 200 in statuses and 400 in statuses                         # valid and refused bodies both
    _assert_healthy(s)


@pytest.mark.slow
@pytest.mark.parametrize("preset", sorted(DEFAULT_CASES))
def test_fuzz_request_bodies_long(servers, preset):
    s = servers[preset]
    outcomes = run_fuzz(s, SLOW_CASES)
    assert sum(outcomes.values()) >= SLOW_CASES * 0.9
    _assert_healthy(s)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_numeric_fields_at_their_edges(servers, path):
    """Every numeric setting at every edge number, one at a time, on a prompt that repeats itself
    (the repetition penalty has tokens to act on) with sampling on: what random mutations reach
    only by luck."""
    s = servers["tiny"]
    base = {"messages": [{"role": "user", "content": "hello hello hello hello"}]} if path == CHAT else \
        {"prompt": "hello hello hello hello"}
    seen: Counter = Counter()
    with httpx.Client(base_url=s.base, timeout=REQUEST_TIMEOUT_S) as client:
        eos = client.post(TOKENIZE, json={"content": client.get("/props").json()["eos_token"]}).json()["tokens"]
        assert len(eos) == 1
        for key in NUMERIC_FIELDS:
            for value in EDGE_NUMBERS:
                body = {**base, "max_tokens": 3, key: value}
                if key in LENGTH_FIELDS:          # a length of 2**63 checked, not generated: the answer ends at once
                    body["logit_bias"] = {str(eos[0]): 100}
                if key in ("logprobs", "top_logprobs") and path == CHAT:
                    body["logprobs"] = True if key == "top_logprobs" else value
                seen[send(s, client, path, body)[0]] += 1
    assert seen[200] and seen[400]
    _assert_healthy(s)


HI = [{"role": "user", "content": "hi"}]
HELLOS = [{"role": "user", "content": "hello hello hello hello"}]

#: the bugs found: (preset, path, body or raw JSON text, words of the error message): each now a
#: 400 in the API's shape, each a 500 before its fix (with a traceback in the log but for
#: /v1/messages, which answered its own 500)
REGRESSIONS: dict[str, tuple[str, str, Any, str]] = {
    # chat_template_kwargs naming an argument of ChatTemplate.render itself: a TypeError
    "template kwarg 'images'": ("tiny", CHAT, {"messages": HI, "max_tokens": 2,
                                               "chat_template_kwargs": {"images": True}}, "may not set images"),
    "template kwarg 'self'": ("tiny", CHAT, {"messages": HI, "max_tokens": 2, "chat_template_kwargs": {"self": 1}},
                              "may not set self"),
    "template kwarg 'images', count_tokens": ("tiny", COUNT, {"messages": HI, "chat_template_kwargs": {"images": 1}},
                                              "may not set images"),
    # NaN, Infinity and numbers beyond a double were read (Python's json does): /v1/responses
    # echoes the request's fields, and encoding its answer failed (ValueError: out of range float
    # values); GET /v1/responses/{id} failed the same way
    "NaN": ("tiny", RESPONSES, '{"input": "hi", "max_output_tokens": 2, "user": NaN}', "NaN is not a JSON value"),
    "Infinity": ("tiny", RESPONSES, '{"input": "hi", "max_output_tokens": 2, "metadata": {"a": -Infinity}}',
                 "-Infinity is not a JSON value"),
    "1e999": ("tiny", RESPONSES, '{"input": "hi", "max_output_tokens": 2, "tools": [{"type": "function", '
                                 '"name": "f", "description": 1e999}]}', "beyond the range of a double"),
    # (this one was answered 200; refused now as everywhere)
    "NaN in a message": ("tiny", MESSAGES, '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, '
                                           '"metadata": {"a": NaN}}', "NaN is not a JSON value"),
    # a repeat_penalty so small that it divided a seen token's logit to inf: NaN probabilities,
    # nothing left to sample (IndexError in the worker)
    "repeat_penalty 5e-324": ("tiny", CHAT, {"messages": HELLOS, "max_tokens": 2, "repeat_penalty": 5e-324},
                              "'repeat_penalty' is 5e-324"),
    "repeat_penalty 1e-300, messages": ("tiny", MESSAGES, {"messages": HELLOS, "max_tokens": 2,
                                                           "repeat_penalty": 1e-300}, "'repeat_penalty' is 1e-300"),
    # XML tool calls (Qwen3.5's template): a schema whose properties are not an object, or whose
    # required is not a list of names, failed building the call grammar (AttributeError, TypeError)
    "XML properties a string": ("tiny-qwen35", CHAT, {
        "messages": HI, "max_tokens": 2, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                "properties": "abc"}}}]},
        "need 'properties' as an object"),
    "XML required a number": ("tiny-qwen35", CHAT, {
        "messages": HI, "max_tokens": 2, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 5}}}]},
        "'required' as a list of names"),
    "XML required unhashable": ("tiny-qwen35", MESSAGES, {
        "messages": HI, "max_tokens": 2, "tool_choice": {"type": "any"},
        "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {}}, "required": [[1]]}}]},
        "'required' as a list of names"),
    "XML properties a list, responses": ("tiny-qwen35", RESPONSES, {
        "input": "hi", "max_output_tokens": 2, "tool_choice": "required",
        "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "properties": [1]}}]},
        "need 'properties' as an object"),
    # a parameter's type a list holding a non-string (TypeError: unhashable type: 'list'; found by
    # a random-mutation sweep of every endpoint's body), or a number (taken as no type: free text)
    "XML parameter type [[]], messages": ("tiny-qwen35", MESSAGES, {
        "messages": HI, "max_tokens": 2, "tool_choice": {"type": "any"},
        "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": [[]]}}}}]},
        "'type' must be a string or a list of strings"),
    "XML parameter type 5": ("tiny-qwen35", CHAT, {
        "messages": HI, "max_tokens": 2, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": 5}}}}}]},
        "'type' must be a string or a list of strings"),
}


@pytest.mark.parametrize("name", list(REGRESSIONS))
def test_regressions(servers, name):
    preset, path, body, words = REGRESSIONS[name]
    s = servers[preset]
    raw = body.encode() if isinstance(body, str) else None
    with httpx.Client(base_url=s.base, timeout=REQUEST_TIMEOUT_S) as client:
        status, err = send(s, client, path, body, raw)
    assert status == 400 and words in err["error"]["message"], err


@pytest.mark.parametrize("preset", sorted(DEFAULT_CASES))
def test_xml_tool_choice_auto_with_a_bad_schema_is_answered(servers, preset):
    """With tool_choice auto a schema the call grammar cannot take leaves the calls unconstrained
    (as for JSON calls): the request is answered, not refused, on both templates."""
    s = servers[preset]
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tool_choice": "auto",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                    "properties": "abc",
                                                                                    "required": 5}}}]}
    unhashable = copy.deepcopy(body)
    unhashable["tools"][0]["function"]["parameters"] = {"type": "object", "properties": {"a": {"type": [[]]}}}
    with httpx.Client(base_url=s.base, timeout=REQUEST_TIMEOUT_S) as client:
        assert send(s, client, CHAT, body)[0] == 200
        assert send(s, client, CHAT, unhashable)[0] == 200


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
@pytest.mark.parametrize("stream", [False, True])
def test_a_nan_parameter_of_an_xml_tool_call_is_a_string(servers, path, stream):
    """A Qwen3.5 (XML) call's parameter written `NaN` (here forced by its enum) is the string "NaN":
    it was read as a float NaN, the arguments `{"x": NaN}` were no JSON, and /v1/messages answered
    500 (ValueError: out of range float values)."""
    s = servers["tiny-qwen35"]
    schema = {"type": "object", "properties": {"x": {"enum": ["NaN"]}, "y": {"enum": ["-Infinity"]}},
              "required": ["x", "y"]}
    ask = [{"role": "user", "content": "hi"}]
    body = {CHAT: {"messages": ask, "tool_choice": "required", "chat_template_kwargs": {"enable_thinking": False},
                   "tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}]},
            MESSAGES: {"messages": ask, "tool_choice": {"type": "any"}, "thinking": {"type": "disabled"},
                       "tools": [{"name": "f", "input_schema": schema}]},
            RESPONSES: {"input": "hi", "tool_choice": "required", "reasoning": {"effort": "none"},
                        "tools": [{"type": "function", "name": "f", "parameters": schema}]}}[path]
    body = {**body, "max_tokens" if path != RESPONSES else "max_output_tokens": 64, "stream": stream}
    with httpx.Client(base_url=s.base, timeout=REQUEST_TIMEOUT_S) as client:
        status, answer = send(s, client, path, body)
    assert status == 200
    text = json.dumps(answer)
    assert "NaN" in text and ("tool_use" in text or "tool_calls" in text or "function_call" in text), text[-1000:]
    if not stream:
        calls = {CHAT: lambda a: [json.loads(c["function"]["arguments"])
                                  for c in a["choices"][0]["message"]["tool_calls"]],
                 MESSAGES: lambda a: [b["input"] for b in a["content"] if b["type"] == "tool_use"],
                 RESPONSES: lambda a: [json.loads(o["arguments"]) for o in a["output"] if o["type"] == "function_call"]}
        assert calls[path](answer) == [{"x": "NaN", "y": "-Infinity"}]


def test_xml_tool_call_names_with_quotes(servers):
    """A Qwen3.5 (XML) call grammar writes its tags as JSON strings: a function or parameter name
    with a quote was spliced into a Lark string as it was (a 400 "lexer error", or a grammar
    other than the call's)."""
    s = servers["tiny-qwen35"]
    schema = {"type": "object", "properties": {'a"b': {"enum": ["v"]}}, "required": ['a"b']}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64, "tool_choice": "required",
            "chat_template_kwargs": {"enable_thinking": False},
            "tools": [{"type": "function", "function": {"name": 'x"y', "parameters": schema}}]}
    with httpx.Client(base_url=s.base, timeout=REQUEST_TIMEOUT_S) as client:
        status, answer = send(s, client, CHAT, body)
    assert status == 200, answer
    calls = answer["choices"][0]["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [('x"y', {'a"b': "v"})]


def test_a_huge_repeat_penalty_cannot_push_a_grammar_s_tokens_to_minus_inf(servers):
    """repeat_penalty multiplies a seen token's negative logit: at 1e308, the tokens a JSON schema
    allows (seen in the prompt, biased negative) all went to -inf, and sampling from nothing failed
    (IndexError in the worker: 500); greedy took token 0, against the grammar. Now a 400."""
    s = servers["tiny"]
    tok = GGUFFile(s.model).tokenizer()
    grammars = GrammarFactory(tok, tok.n_vocab, [tok.eos_id])
    first = grammars.matcher(grammars.json_schema({"type": "string"}, "x"))
    allowed = [int(t) for t in np.flatnonzero(np.isfinite(first.mask(np.zeros(tok.n_vocab, dtype=np.float32))))]
    assert 0 < len(allowed) < 50
    body = {"messages": [{"role": "user", "content": tok.decode(allowed)}], "max_tokens": 3, "repeat_last_n": -1,
            "logit_bias": {str(t): -50 for t in allowed},
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "string"}}}}
    with httpx.Client(base_url=s.base, timeout=REQUEST_TIMEOUT_S) as client:
        for temperature in (0.8, 0.0):
            status, err = send(s, client, CHAT, {**body, "temperature": temperature, "repeat_penalty": 1e308})
            assert status == 400 and err["error"]["param"] == "repeat_penalty"
            status, answer = send(s, client, CHAT, {**body, "temperature": temperature, "repeat_penalty": 1e6})
            assert status == 200
            assert answer["choices"][0]["message"]["content"].startswith('"')     # the grammar held


@pytest.mark.parametrize("path", [CHAT, MESSAGES, RESPONSES])
def test_a_grammar_that_fails_while_generating_fails_the_request(servers, path):
    """A pattern llguidance cannot build a lexer for fails only once the output reaches it (after
    `{"s":"`), and then at the first mask of every later copy of that compiled grammar: the matcher
    allowed nothing but the end, and the answer was `{` with finish_reason "stop". Now the
    request fails with llguidance's reason, as a 400 or, once streaming, an error event; twice, the
    second from the kept compiled grammar."""
    s = servers["tiny"]
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^a{1000000}$"}}, "required": ["s"]}
    if path == CHAT:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    elif path == MESSAGES:
        body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], "tool_choice":
                {"type": "tool", "name": "f"}, "tools": [{"name": "f", "input_schema": schema}]}
    else:
        body = {"input": "hi", "max_output_tokens": 8,
                "text": {"format": {"type": "json_schema", "name": "x", "schema": schema}}}
    with httpx.Client(base_url=s.base, timeout=REQUEST_TIMEOUT_S) as client:
        for stream in (False, True, False):
            status, answer = send(s, client, path, {**body, "stream": stream})
            text = json.dumps(answer) if not stream else "\n".join(answer)
            assert "too many expressions" in text and (stream or status == 400), text[-1500:]


ODD_IDS = ["x", "resp_" + "0" * 32, "resp_" + "a" * 5000, "%00", "%ED%A0%80", "..", "%2E%2E", "a%2Fb", "null",
           "%22%27%3C%3E", "%E2%80%AE", "resp_%F0%9F%98%80", " ", "%0A", "-1", "1e999", "NaN"]


@pytest.mark.parametrize("rid", ODD_IDS)
def test_odd_response_ids_are_not_found(servers, rid):
    s = servers["tiny"]
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{s.base}/v1/responses/{rid}", timeout=30)
        assert r.status_code in (404, 405), (method, rid, r.status_code, r.text[:300])
        _check_error(RESPONSES, r.json(), r.status_code)
    assert "Traceback" not in s.new_log()


def test_stored_response_get_delete(servers):
    """A stored response: found, deleted once, then not found; continuing it then is a 400."""
    s = servers["tiny"]
    with httpx.Client(base_url=s.base, timeout=REQUEST_TIMEOUT_S) as client:
        _, answer = send(s, client, RESPONSES, {"input": "hi", "max_output_tokens": 2})
        rid = answer["id"]
        assert client.get(f"/v1/responses/{rid}").json()["id"] == rid
        assert client.delete(f"/v1/responses/{rid}").json() == {"id": rid, "object": "response", "deleted": True}
        for method in ("GET", "DELETE"):
            r = client.request(method, f"/v1/responses/{rid}")
            assert r.status_code == 404
            _check_error(RESPONSES, r.json(), 404)
        status, err = send(s, client, RESPONSES, {"input": "more", "previous_response_id": rid})
        assert status == 400 and err["error"]["code"] == "previous_response_not_found"
    _assert_healthy(s)
