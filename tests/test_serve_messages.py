"""Anthropic's Messages API in `deltarun serve`, over real HTTP with the official `anthropic` client.

The tiny random-weights models (Qwen3 template: `tiny`; Qwen3.5 template: `tiny-qwen35`) write
gibberish, so the tests check shapes, greedy equalities, token counts and constraint validity.
The anthropic SDK 2.x has no sampling arguments: temperature and friends go in `extra_body`, as
a current client sends them.
"""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import jsonschema
import openai
import pytest
from test_serve import _server

from deltarun.apps.serve.answers import BlockSplitter
from deltarun.apps.serve.messages_api import _max_calls, chat_body, parse_messages
from deltarun.apps.serve.output import Delta
from deltarun.apps.serve.protocol import parse_chat
from deltarun.runner.resume import common_prefix_length

RS_SLOTS = 4
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "Weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                              "unit": {"enum": ["c", "f"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
LOOKUP = {"name": "lookup", "description": "Look a word up",
          "input_schema": {"type": "object", "properties": {"word": {"type": "string", "maxLength": 8}},
                           "required": ["word"], "additionalProperties": False}}
TEMPLATES = {"qwen3": "tiny", "qwen35": "tiny-qwen35", "kimi": "tiny-kimi-linear-k2vocab"}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def template_path(request, tiny_model_path):
    return request.param, tiny_model_path(TEMPLATES[request.param], "f32")


@pytest.fixture(scope="module")
def server(template_path):
    with _server(template_path[1], parallel=2, chunk=32, checkpoint_every=0) as h:
        yield h


@pytest.fixture(scope="module")
def qwen3_server(tiny_model_path):
    with _server(tiny_model_path("tiny", "f32"), parallel=2, chunk=32, checkpoint_every=0) as h:
        yield h


def _client(h, key: str = "x") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=h.base_url, api_key=key, max_retries=0, timeout=120)


def _ask(c, messages, max_tokens=8, extra=None, **kw):
    return c.messages.create(model="tiny", max_tokens=max_tokens, messages=messages,
                             extra_body={**GREEDY, **(extra or {})}, **kw)


def _post(h, body, path="/v1/messages", **kw):
    return httpx.post(h.base_url + path, json=body, timeout=60, **kw)


def _anthropic_error(resp, status: int, kind: str = "invalid_request_error") -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and body["error"]["message"], body
    return body["error"]["message"]


def _sse(resp) -> list[tuple[str, dict]]:
    """(event name, data) of a raw stream."""
    out, name = [], None
    for line in resp.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            out.append((name, json.loads(line[6:])))
    return out


# --------------------------------------------------------------------------------------------- answers
def test_message_shape_usage_and_stream(server):
    c = _client(server)
    msgs = [{"role": "user", "content": "Tell me a story about streams"}]
    r = _ask(c, msgs, max_tokens=10, thinking={"type": "disabled"})
    assert r.id.startswith("msg_") and r.type == "message" and r.role == "assistant" and r.model == "tiny"
    assert [b.type for b in r.content] == ["text"] and r.content[0].text
    assert r.stop_reason == "max_tokens" and r.stop_sequence is None
    u = r.usage
    assert u.output_tokens == 10 and u.cache_creation_input_tokens == 0
    total = c.messages.count_tokens(model="tiny", messages=msgs, thinking={"type": "disabled"}).input_tokens
    assert u.input_tokens + u.cache_read_input_tokens == total
    # the same request streamed: everything cached, the same text, the documented event order
    with c.messages.stream(model="tiny", max_tokens=10, messages=msgs, thinking={"type": "disabled"},
                           extra_body=GREEDY) as s:
        kinds = [ev.type for ev in s if ev.type not in ("text",)]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and kinds[-3] == "content_block_stop"
    assert set(kinds[2:-3]) == {"content_block_delta"}
    assert final.content[0].text == r.content[0].text and final.stop_reason == "max_tokens"
    assert final.usage.input_tokens == 0 and final.usage.cache_read_input_tokens == total
    assert final.usage.output_tokens == 10


def test_raw_stream_events_and_ping(server):
    body = {"model": "tiny", "max_tokens": 4, "stream": True, "temperature": 0, "thinking": {"type": "disabled"},
            "messages": [{"role": "user", "content": "hi"}]}
    with httpx.stream("POST", server.base_url + "/v1/messages", json=body, timeout=60) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = _sse(resp)
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    assert all(n == d["type"] for n, d in events)
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    delta = events[-2][1]
    assert delta["type"] == "message_delta" and delta["delta"]["stop_reason"] == "max_tokens"
    assert delta["usage"]["output_tokens"] == 4
    texts = [d["delta"] for n, d in events if n == "content_block_delta"]
    assert texts and all(t["type"] == "text_delta" for t in texts)


def test_thinking_blocks_qwen35(tiny_model_path):
    """Qwen3.5's generation prompt opens <think>: with random weights it never closes, so the whole
    answer is one thinking block; disabled, it is text."""
    with _server(tiny_model_path("tiny-qwen35", "f32"), parallel=1) as h:
        c = _client(h)
        msgs = [{"role": "user", "content": "Think first"}]
        on = _ask(c, msgs, max_tokens=12, thinking={"type": "enabled", "budget_tokens": 1024},
                  extra={"ignore_eos": True})
        assert [b.type for b in on.content] == ["thinking"] and on.content[0].thinking
        assert isinstance(on.content[0].signature, str)
        with c.messages.stream(model="tiny", max_tokens=12, messages=msgs, extra_body={**GREEDY, "ignore_eos": True},
                               thinking={"type": "enabled", "budget_tokens": 1024}) as s:
            deltas = [ev.delta for ev in s if ev.type == "content_block_delta"]
            final = s.get_final_message()
        assert deltas and all(d.type == "thinking_delta" for d in deltas)
        assert "".join(d.thinking for d in deltas) == on.content[0].thinking == final.content[0].thinking
        off = _ask(c, msgs, max_tokens=12, thinking={"type": "disabled"}, extra={"ignore_eos": True})
        assert [b.type for b in off.content] == ["text"]
        # the template's default (thinking) when `thinking` is absent; adaptive is on too
        assert [b.type for b in _ask(c, msgs, max_tokens=4, extra={"ignore_eos": True}).content] == ["thinking"]
        adaptive = _ask(c, msgs, max_tokens=4, thinking={"type": "adaptive"}, extra={"ignore_eos": True})
        assert [b.type for b in adaptive.content] == ["thinking"]


def test_system_prompt_as_text_and_blocks(qwen3_server):
    c = _client(qwen3_server)
    msgs = [{"role": "user", "content": "hi"}]
    plain = c.messages.count_tokens(model="t", messages=msgs).input_tokens
    as_text = c.messages.count_tokens(model="t", system="You are terse.", messages=msgs).input_tokens
    as_blocks = c.messages.count_tokens(model="t", messages=msgs, system=[
        {"type": "text", "text": "You are ", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "terse."}]).input_tokens
    assert as_text == as_blocks > plain


def test_billing_header_does_not_break_the_prompt_cache(qwen3_server):
    """Claude Code's system prompt starts with a header whose cch= value changes per request."""
    c = _client(qwen3_server)

    def system(cch: str) -> str:
        return f"x-anthropic-billing-header: cc_version=2.1.1; cc_entrypoint=cli; cch={cch};You are a helper."
    msgs = [{"role": "user", "content": "What is in the cache?"}]
    _ask(c, msgs, max_tokens=2, system=system("a5145"))
    again = _ask(c, msgs, max_tokens=2, system=system("77b0c"))
    assert again.usage.input_tokens == 0 and again.usage.cache_read_input_tokens > 0


def test_stop_sequences_and_end_turn(server):
    c = _client(server)
    msgs = [{"role": "user", "content": "Say something long"}]
    full = _ask(c, msgs, max_tokens=24, thinking={"type": "disabled"}).content[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    r = _ask(c, msgs, max_tokens=24, thinking={"type": "disabled"}, stop_sequences=["never there", stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == full[:full.index(stop)]
    with c.messages.stream(model="tiny", max_tokens=24, messages=msgs, stop_sequences=[stop],
                           thinking={"type": "disabled"}, extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop
    # <|im_end|> forced first: an empty answer that ended by itself
    eos = httpx.post(server.base_url + "/tokenize", json={"content": "<|im_end|>"}).json()["tokens"]
    empty = _ask(c, msgs, thinking={"type": "disabled"}, extra={"logit_bias": {str(eos[0]): 100}})
    assert empty.stop_reason == "end_turn" and empty.stop_sequence is None and empty.content == []
    assert empty.usage.output_tokens == 0


def test_context_window_exceeded(tiny_model_path):
    with _server(tiny_model_path("tiny", "f32"), parallel=1, n_ctx=64) as h:
        r = _ask(_client(h), [{"role": "user", "content": "hi"}], max_tokens=1000, thinking={"type": "disabled"},
                 extra={"ignore_eos": True})
        assert r.stop_reason == "model_context_window_exceeded"
        assert r.usage.input_tokens + r.usage.cache_read_input_tokens + r.usage.output_tokens == 64


def test_sampling_from_extra_fields(qwen3_server):
    c = _client(qwen3_server)
    msgs = [{"role": "user", "content": "Sample me"}]

    def text(**extra):
        return _ask(c, msgs, max_tokens=12, extra=extra, thinking={"type": "disabled"}).content[0].text
    greedy = text(temperature=0)
    assert text(temperature=1.0, top_k=1) == greedy                   # top_k reaches the sampler
    assert text(temperature=1.5, seed=5, top_p=0.9) == text(temperature=1.5, seed=5, top_p=0.9)
    drawn = {text(temperature=2.0, seed=s) for s in range(4)}
    assert len(drawn) > 1                                              # temperature reaches it too
    # top_p also as the (older) SDK argument: the same draw as in the extra body
    r = c.messages.create(model="tiny", max_tokens=12, messages=msgs, thinking={"type": "disabled"},
                          extra_body={"temperature": 1.5, "seed": 5, "top_p": 0.9})
    assert r.content[0].text == text(temperature=1.5, seed=5, top_p=0.9)


def test_unknown_and_current_sdk_fields_are_accepted(qwen3_server):
    body = {"model": "claude-sonnet-4-5", "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi",
                                                       "cache_control": {"type": "ephemeral"}}]}],
            "metadata": {"user_id": "u-1"}, "service_tier": "auto", "cache_control": {"type": "ephemeral"},
            "output_config": {"effort": "high"}, "container": None, "anthropic_version": "2023-06-01",
            "something_new": {"x": [1, 2]}}
    resp = _post(qwen3_server, body, headers={"anthropic-version": "2023-06-01", "anthropic-beta": "x"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "claude-sonnet-4-5" and resp.json()["usage"]["output_tokens"] <= 3
    # Claude Code adds ?beta=true to the path
    assert _post(qwen3_server, body, path="/v1/messages?beta=true").status_code == 200


# --------------------------------------------------------------------------------------------- tools
def test_forced_tool_use_validates_against_its_schema(server):
    c = _client(server)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    inputs = []
    for choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"}):
        r = _ask(c, msgs, max_tokens=150, tools=[LOOKUP, WEATHER] if choice["type"] == "tool" else [WEATHER],
                 tool_choice=choice, thinking={"type": "disabled"})
        assert r.stop_reason == "tool_use", r
        uses = [b for b in r.content if b.type == "tool_use"]
        assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id
        jsonschema.validate(uses[0].input, WEATHER["input_schema"])
        inputs.append(uses[0].input)
    with c.messages.stream(model="tiny", max_tokens=150, messages=msgs, tools=[WEATHER], tool_choice={"type": "any"},
                           thinking={"type": "disabled"}, extra_body=GREEDY) as s:
        events = list(s)
        final = s.get_final_message()
    start = [e for e in events if e.type == "content_block_start" and e.content_block.type == "tool_use"]
    parts = [e.delta.partial_json for e in events if e.type == "content_block_delta"
             and e.delta.type == "input_json_delta"]
    assert len(start) == 1 and start[0].content_block.name == "get_weather" and start[0].content_block.input == {}
    assert json.loads("".join(parts)) == final.content[-1].input == inputs[0]      # the same request, streamed
    assert final.stop_reason == "tool_use"


def test_tool_choice_none_and_disable_parallel_tool_use(qwen3_server):
    c = _client(qwen3_server)
    msgs = [{"role": "user", "content": "hi"}]
    with_tools = c.messages.count_tokens(model="t", messages=msgs, tools=[WEATHER]).input_tokens
    none = c.messages.count_tokens(model="t", messages=msgs, tools=[WEATHER], tool_choice={"type": "none"})
    assert none.input_tokens == c.messages.count_tokens(model="t", messages=msgs).input_tokens < with_tools
    r = _ask(c, msgs, max_tokens=150, tools=[WEATHER], thinking={"type": "disabled"},
             tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert [b.type for b in r.content] == ["tool_use"]


@pytest.mark.parametrize("then_text", [False, True])
def test_tool_results_render_as_chat_tool_messages(qwen3_server, then_text):
    """tool_use / tool_result blocks (text, blocks, is_error) become the tool calls and tool messages
    a Chat Completions client would send: the same prompt, token for token. Ending with the tool
    results, the assistant message is part of the agent loop, and the template renders its thinking."""
    messages = [
        {"role": "user", "content": "Weather in two cities?"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "two calls", "signature": "sig"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "unit": "c"}},
            {"type": "tool_use", "id": "toolu_2", "name": "get_weather", "input": {"city": "Rome", "unit": "c"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "service "}, {"type": "text", "text": "down"}]},
            {"type": "text", "text": "And tomorrow?"}][:3 if then_text else 2]}]
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in two cities?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "two calls", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": '{"city": "Paris", "unit": "c"}'}},
            {"id": "b", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": '{"city": "Rome", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "a", "content": "sunny"},
        {"role": "tool", "tool_call_id": "b", "content": "Error: service down"},
        {"role": "user", "content": "And tomorrow?"}][:6 if then_text else 5]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": WEATHER["input_schema"]}}]
    body = {"model": "t", "max_tokens": 2, "system": "Be brief.", "messages": messages, "tools": [WEATHER]}
    builder = qwen3_server.state.builder
    want = builder.chat(parse_chat({"messages": chat, "tools": tools, "max_tokens": 2})).prompt
    assert builder.chat(parse_messages(body)).prompt == want
    assert ("two calls" in builder.tokenizer.decode(want)) is not then_text
    assert _client(qwen3_server).messages.count_tokens(
        model="t", system="Be brief.", messages=messages, tools=[WEATHER]).input_tokens == len(want)
    # and over HTTP the two endpoints see the same prompt
    c = openai.OpenAI(base_url=qwen3_server.base_url + "/v1", api_key="x", max_retries=0)
    r = c.chat.completions.create(model="t", messages=chat, tools=tools, max_tokens=2, temperature=0)
    m = _ask(_client(qwen3_server), messages, max_tokens=2, system="Be brief.", tools=[WEATHER])
    assert r.usage.prompt_tokens == m.usage.input_tokens + m.usage.cache_read_input_tokens == len(want)


def test_block_splitter_orders_and_closes_blocks():
    """Deltas -> blocks: reasoning, then text, then each tool call, in order; a block is closed before
    the next opens; calls beyond `max_calls` are left out."""
    def call(i):
        return {"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": f'{{"i": {i}}}'}}
    s = BlockSplitter()
    steps = s.push(Delta(reasoning="think ")) + s.push(Delta(reasoning="more", content="Hi")) \
        + s.push(Delta(content=" there", tool_calls=[call(0), call(1)])) + s.push(Delta(content="bye")) + s.close()
    assert [(x.what, x.block.index, x.piece) for x in steps] == [
        ("open", 0, ""), ("delta", 0, "think "), ("delta", 0, "more"), ("close", 0, ""),
        ("open", 1, ""), ("delta", 1, "Hi"), ("delta", 1, " there"), ("close", 1, ""),
        ("open", 2, ""), ("delta", 2, '{"i": 0}'), ("close", 2, ""), ("open", 3, ""), ("delta", 3, '{"i": 1}'),
        ("close", 3, ""), ("open", 4, ""), ("delta", 4, "bye"), ("close", 4, "")]
    assert [(b.kind, b.text) for b in s.blocks] == [("thinking", "think more"), ("text", "Hi there"),
                                                    ("tool_call", '{"i": 0}'), ("tool_call", '{"i": 1}'), ("text", "bye")]
    one = BlockSplitter(max_calls=_max_calls({"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}))
    one.push(Delta(tool_calls=[call(0), call(1)]))
    assert [b.call["id"] for b in one.blocks] == ["c0"]
    assert _max_calls({"tool_choice": {"type": "auto"}}) is None


def test_output_config_json_schema(qwen3_server):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "role": {"enum": ["user", "staff"]}},
              "required": ["name", "role"], "additionalProperties": False}
    r = _ask(_client(qwen3_server), [{"role": "user", "content": "A person"}], max_tokens=100,
             thinking={"type": "disabled"}, output_config={"format": {"type": "json_schema", "schema": person}})
    assert r.stop_reason == "end_turn", r
    jsonschema.validate(json.loads(r.content[0].text), person)


# --------------------------------------------------------------------------------------------- the agent loop
def _held(h, prompt: list[int]) -> list[int]:
    """What the seqs hold that shares the longest prefix with `prompt`."""
    m = h.worker.model
    return max((m.tokens(i) for i in range(m.memory.n_seq_max)), key=lambda t: common_prefix_length(t, prompt))


def _eval_tokens(h) -> int:
    return h.worker.model.stats.n_eval_tokens


def _messages_loop(h, tools: list, turns: int = 6) -> list[tuple[int, int, int, object]]:
    """An agent loop: a forced tool call each turn but the last, its result sent back (as text,
    as blocks, as an error), the whole history re-sent each time. Per turn: (prompt tokens, new
    tokens against what the server held, evaluated tokens, the answer's content)."""
    c = _client(h)
    msgs: list[dict] = [{"role": "user", "content": "Look these words up for me, one at a time."}]
    out = []
    for turn in range(turns):
        body = {"model": "tiny", "max_tokens": 120, "system": "You use tools.", "messages": msgs, "tools": tools,
                "thinking": {"type": "disabled"}, "temperature": 0,
                "tool_choice": {"type": "any"} if turn < turns - 1 else {"type": "auto"}}
        prompt = h.state.builder.chat(parse_messages(body)).prompt
        new = len(prompt) - common_prefix_length(_held(h, prompt), prompt)
        before = _eval_tokens(h)
        r = c.messages.create(**{k: v for k, v in body.items() if k != "temperature"}, extra_body=GREEDY)
        evaluated = r.usage.input_tokens
        assert evaluated + r.usage.cache_read_input_tokens == len(prompt)
        spent = _eval_tokens(h) - before - r.usage.output_tokens         # the model's own count of the prompt
        assert spent in (evaluated - 1, evaluated)
        out.append((len(prompt), new, evaluated, r.content))
        msgs.append({"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]})
        if turn < turns - 1:
            assert r.stop_reason == "tool_use"
            call = r.content[-1]
            result = [f"{call.input['word']} means {turn}", [{"type": "text", "text": f"entry {turn}"}],
                      "not found"][turn % 3]
            msgs.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                                      "content": result, "is_error": turn % 3 == 2}]})
    return out


def _chat_loop(h, tools: list, turns: int = 6) -> list[tuple[int, int, object]]:
    """The same loop through /v1/chat/completions: (prompt tokens, evaluated, the answer's message)."""
    c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    chat_tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                    "parameters": t["input_schema"]}} for t in tools]
    msgs: list[dict] = [{"role": "system", "content": "You use tools."},
                        {"role": "user", "content": "Look these words up for me, one at a time."}]
    out = []
    for turn in range(turns):
        r = c.chat.completions.create(model="t", messages=msgs, tools=chat_tools, max_tokens=120, temperature=0,
                                      tool_choice="required" if turn < turns - 1 else "auto",
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        m = r.choices[0].message
        out.append((r.usage.prompt_tokens, r.usage.prompt_tokens - r.usage.prompt_tokens_details.cached_tokens, m))
        msgs.append(m.model_dump(exclude_none=True))
        if turn < turns - 1:
            call = m.tool_calls[0]
            word = json.loads(call.function.arguments)["word"]
            result = [f"{word} means {turn}", f"entry {turn}", "Error: not found"][turn % 3]
            msgs.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return out


def test_agent_loop_evaluates_only_new_tokens_as_chat_completions_does(template_path):
    """Six turns with tool results: from turn 2 on, each evaluates only the tokens the server did not
    hold plus at most K (the rollback slots), reports the rest as cached, and costs exactly what
    the same conversation costs through /v1/chat/completions."""
    _, path = template_path
    with _server(path, parallel=2, chunk=32, checkpoint_every=0) as h:
        loop = _messages_loop(h, [LOOKUP])
    with _server(path, parallel=2, chunk=32, checkpoint_every=0) as h:
        chat = _chat_loop(h, [LOOKUP])
    for turn, ((n, new, evaluated, content), (chat_n, chat_evaluated, message)) in enumerate(zip(loop, chat)):
        if turn:
            assert evaluated <= new + RS_SLOTS, (turn, evaluated, new)
            assert evaluated < n // 2, (turn, evaluated, n)           # most of the history came from the cache
        assert (n, evaluated) == (chat_n, chat_evaluated), turn
        if message.tool_calls:                                        # greedy: the same answers
            assert content[-1].input == json.loads(message.tool_calls[0].function.arguments)


# --------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("body, needle", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": "hi"}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "tool", "content": "hi"}]}, "role"),
    ({"max_tokens": 5, "messages": [{"role": "user"}]}, "content"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, "text"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}, "no vision tower (start it with --mmproj FILE)"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "only base64 sources are accepted"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]}, "video"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "tool_use", "name": "f", "input": {}}]}, {"role": "user", "content": "b"}]}, "tool_use"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]}], "tools": [WEATHER]},
     "cannot be continued"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
      "tool_choice": {"type": "tool", "name": "nope"}}, "nope"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tool_choice": {"type": "any"}}, "tools"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "web_search_20250305",
                                                                                 "name": "web_search"}]},
     "server tools"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "sometimes"}},
     "thinking"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "enabled"}},
     "budget_tokens"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "stop_sequences": "x"}, "stop_sequences"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}, "nonsense"),
])
def test_bad_requests_answer_anthropic_errors(qwen3_server, body, needle):
    message = _anthropic_error(_post(qwen3_server, body), 400)
    assert needle in message


def test_error_shapes_over_the_sdk_and_raw_http(qwen3_server, tiny_model_path):
    c = _client(qwen3_server)
    with pytest.raises(anthropic.BadRequestError) as e:
        c.messages.create(model="t", max_tokens=5, messages=[{"role": "user", "content": "hi"}], tools=[WEATHER],
                          tool_choice={"type": "tool", "name": "missing"})
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    resp = httpx.post(qwen3_server.base_url + "/v1/messages", content=b"{not json", timeout=30,
                      headers={"content-type": "application/json"})
    _anthropic_error(resp, 400)
    _anthropic_error(_post(qwen3_server, [1, 2]), 400)
    _anthropic_error(httpx.get(qwen3_server.base_url + "/v1/messages"), 405)
    long = {"max_tokens": 5, "messages": [{"role": "user", "content": "word " * 3000}]}
    assert _anthropic_error(_post(qwen3_server, long), 400).startswith("prompt is too long: ")
    # count_tokens answers for a prompt over the context, and needs no max_tokens
    counted = _post(qwen3_server, long, path="/v1/messages/count_tokens").json()["input_tokens"]
    assert counted > 1024
    _anthropic_error(_post(qwen3_server, {"messages": "x"}, path="/v1/messages/count_tokens"), 400)


def test_api_key_by_x_api_key_and_bearer(tiny_model_path):
    with _server(tiny_model_path("tiny", "f32"), parallel=1, api_key="sekret") as h:
        msgs = [{"role": "user", "content": "hi"}]
        with pytest.raises(anthropic.AuthenticationError) as e:
            _ask(_client(h, "wrong"), msgs, max_tokens=1)
        assert e.value.body == {"type": "error", "error": {"type": "authentication_error", "message": e.value.body[
            "error"]["message"]}}
        _anthropic_error(_post(h, {"max_tokens": 1, "messages": msgs}), 401, "authentication_error")
        assert _ask(_client(h, "sekret"), msgs, max_tokens=1).usage.output_tokens == 1          # x-api-key
        bearer = anthropic.Anthropic(base_url=h.base_url, auth_token="sekret", max_retries=0, timeout=60)
        assert _ask(bearer, msgs, max_tokens=1).usage.output_tokens == 1                         # Authorization


def test_error_mid_stream_is_an_error_event(tiny_model_path):
    """A failure after the stream began (here: the model's evaluation) ends it with an `error`
    event in Anthropic's shape, which the SDK raises."""
    with _server(tiny_model_path("tiny", "f32"), parallel=1) as h:
        model = h.worker.model
        real = model.eval

        def failing(*a, **kw):
            raise RuntimeError("injected failure")
        model.eval = failing
        try:
            with pytest.raises(anthropic.APIStatusError) as e:
                with _client(h).messages.stream(model="t", max_tokens=4, messages=[{"role": "user", "content": "x"}]) \
                        as s:
                    list(s)
            assert e.value.body["type"] == "error" and "injected failure" in e.value.body["error"]["message"]
            resp = _post(h, {"max_tokens": 4, "messages": [{"role": "user", "content": "y"}]})
            assert "injected failure" in _anthropic_error(resp, 500, "api_error")
        finally:
            model.eval = real
        assert _ask(_client(h), [{"role": "user", "content": "z"}], max_tokens=1).usage.output_tokens == 1


def test_disconnect_mid_stream_frees_the_sequence(tiny_model_path):
    long = 8192
    with _server(tiny_model_path("tiny", "f32"), parallel=1, n_ctx=long) as h:
        c = _client(h)
        with c.messages.stream(model="t", max_tokens=long - 100, messages=[{"role": "user", "content": "go on"}],
                               extra_body={"ignore_eos": True}) as s:
            it = iter(s)
            for _ in range(4):
                next(it)
        deadline = time.monotonic() + 20
        while h.worker.counts[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert h.worker.counts == (0, 0)
        assert h.worker.model.n_past(0) < long - 100
        assert _ask(c, [{"role": "user", "content": "next"}], max_tokens=2).usage.output_tokens == 2


def test_chat_body_is_what_llama_server_converts_to():
    """The translation on its own: what each field becomes."""
    body = chat_body({"model": "m", "max_tokens": 7, "system": [{"type": "text", "text": "S"}],
                      "messages": [{"role": "user", "content": "u"}], "stop_sequences": ["END"],
                      "top_k": 3, "thinking": {"type": "enabled", "budget_tokens": 2048},
                      "tools": [WEATHER], "tool_choice": {"type": "any"}})
    assert body["messages"] == [{"role": "system", "content": [{"type": "text", "text": "S"}]},
                                {"role": "user", "content": "u"}]
    assert body["max_tokens"] == 7 and body["stop"] == ["END"] and body["top_k"] == 3 and body["model"] == "m"
    assert body["chat_template_kwargs"] == {"enable_thinking": True} and body["tool_choice"] == "required"
    assert body["tools"][0]["function"]["parameters"] == WEATHER["input_schema"]


def test_props_and_chat_page_name_the_endpoints(qwen3_server):
    props = httpx.get(qwen3_server.base_url + "/props").json()
    assert "/v1/messages" in props["endpoints"]["anthropic"] and "/v1/responses" in props["endpoints"]["openai"]
    page = httpx.get(qwen3_server.base_url + "/").text
    assert "/v1/messages" in page and "/v1/responses" in page
