"""OpenAI's Responses API in `deltarun serve`, over real HTTP with the official `openai` client.

The tiny random-weights models (Qwen3 template: `tiny`; Qwen3.5 template: `tiny-qwen35`) write
gibberish, so the tests check shapes, greedy equalities, token counts and constraint validity.
"""

from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from test_serve import _server
from test_serve_messages import (LOOKUP, RS_SLOTS, WEATHER, _chat_loop, _eval_tokens, _held,  # noqa: F401
                                 qwen3_server, server, template_path)  # the same module-scoped servers, here

from deltarun.apps.serve import response_store
from deltarun.apps.serve.output import Delta
from deltarun.apps.serve.protocol import parse_chat
from deltarun.apps.serve.responses_api import ResponsesRequest, input_messages
from deltarun.runner.resume import common_prefix_length

NO_THINKING = {"effort": "none"}
FN_WEATHER = {"type": "function", "name": WEATHER["name"], "description": WEATHER["description"],
              "parameters": WEATHER["input_schema"]}


def _fn(tool: dict) -> dict:
    return {"type": "function", "name": tool["name"], "description": tool["description"],
            "parameters": tool["input_schema"]}


def _client(h, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=h.base_url + "/v1", api_key=key, max_retries=0, timeout=120)


def _create(c, **kw):
    kw.setdefault("model", "tiny")
    kw.setdefault("temperature", 0)
    kw.setdefault("max_output_tokens", 8)
    return c.responses.create(**kw)


def _prompt(h, body: dict) -> list[int]:
    """The prompt the server builds for a Responses body that continues no stored response."""
    return h.state.builder.chat(ResponsesRequest(body).chat).prompt


def _openai_error(resp, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    return err


# --------------------------------------------------------------------------------------------- answers
def test_response_shape_usage_and_stream(server):
    c = _client(server)
    kw = dict(instructions="Be terse.", input="Tell me a story about streams", max_output_tokens=10,
              reasoning=NO_THINKING, top_p=0.9)
    r = _create(c, **kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens" and r.error is None
    assert [o.type for o in r.output] == ["message"]
    msg = r.output[0]
    assert msg.role == "assistant" and msg.id.startswith("msg_") and msg.content[0].type == "output_text"
    assert r.output_text == msg.content[0].text and r.output_text
    assert r.instructions == "Be terse." and r.max_output_tokens == 10 and r.top_p == 0.9 and r.store is True
    u = r.usage
    chat = parse_chat({"messages": [{"role": "system", "content": "Be terse."},
                                    {"role": "user", "content": "Tell me a story about streams"}],
                       "chat_template_kwargs": {"enable_thinking": False}})
    assert u.input_tokens == len(server.state.builder.chat(chat).prompt)
    assert u.output_tokens == 10 and u.total_tokens == u.input_tokens + 10
    assert u.output_tokens_details.reasoning_tokens == 0
    events = list(_create(c, stream=True, **kw))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(d.delta for d in deltas) == r.output_text == events[-1].response.output_text
    assert {d.item_id for d in deltas} == {events[-1].response.output[0].id}
    # the same prompt again: all of it cached
    assert events[-1].response.usage.input_tokens_details.cached_tokens == u.input_tokens


def test_sampling_fields_reach_the_sampler(qwen3_server):
    c = _client(qwen3_server)

    def text(**kw):
        return _create(c, input="Sample me", max_output_tokens=12, reasoning=NO_THINKING, **kw).output_text
    greedy = text(temperature=0)
    assert text(temperature=1.5, top_p=1e-9) == greedy                 # top_p keeps the best token only
    assert text(temperature=1.5, extra_body={"top_k": 1}) == greedy
    drawn = {text(temperature=2.0, extra_body={"seed": s}) for s in range(4)}
    assert len(drawn) > 1 and text(temperature=2.0, extra_body={"seed": 1}) == text(temperature=2.0,
                                                                                     extra_body={"seed": 1})


def test_completed_when_the_answer_ends(qwen3_server):
    eos = httpx.post(qwen3_server.base_url + "/tokenize", json={"content": "<|im_end|>"}).json()["tokens"][0]
    r = _create(_client(qwen3_server), input="say nothing", reasoning=NO_THINKING,
                extra_body={"logit_bias": {str(eos): 100}})
    assert r.status == "completed" and r.incomplete_details is None
    assert [o.type for o in r.output] == ["message"] and r.output_text == "" and r.usage.output_tokens == 0


def test_input_items_render_as_chat_messages(qwen3_server):
    """Messages by role (developer, text parts), reasoning + assistant text + function calls (one
    assistant message), function_call_output (tool messages): the prompt a Chat Completions client
    gets for the same conversation."""
    items = [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "},
                                                         {"type": "input_text", "text": "in Rome?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "check"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Rome", "unit": "c"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "user", "content": "Thanks"}]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Rome?"},
            {"role": "assistant", "content": "Checking.", "reasoning_content": "check", "tool_calls": [
                {"id": "x", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Rome", "unit": "c"}'}}]},
            {"role": "tool", "tool_call_id": "x", "content": "sunny"}, {"role": "user", "content": "Thanks"}]
    tools = [{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                               "parameters": WEATHER["input_schema"]}}]
    want = qwen3_server.state.builder.chat(parse_chat({"messages": chat, "tools": tools})).prompt
    assert _prompt(qwen3_server, {"instructions": "Be brief.", "input": items, "tools": [FN_WEATHER]}) == want
    r = _create(_client(qwen3_server), instructions="Be brief.", input=items, tools=[FN_WEATHER], max_output_tokens=2)
    assert r.usage.input_tokens == len(want)
    # a new assistant message after a call starts a new assistant turn
    two = input_messages([{"role": "assistant", "content": "a"}, {"type": "function_call", "call_id": "c",
                                                                   "name": "f", "arguments": "{}"},
                          {"role": "assistant", "content": "b"}])
    assert [m["content"] for m in two] == ["a", "b"] and "tool_calls" not in two[1]


def test_reasoning_items_qwen35(tiny_model_path):
    """Qwen3.5's generation prompt opens <think>: with random weights it never closes, so the answer
    is one reasoning item and every output token is a reasoning token; effort none turns it off."""
    with _server(tiny_model_path("tiny-qwen35", "f32"), parallel=1) as h:
        c = _client(h)
        on = _create(c, input="Think first", max_output_tokens=12, reasoning={"effort": "high"},
                     extra_body={"ignore_eos": True})
        assert [o.type for o in on.output] == ["reasoning"] and on.output[0].id.startswith("rs_")
        text = on.output[0].content[0].text
        assert text and on.output[0].content[0].type == "reasoning_text"
        assert on.usage.output_tokens_details.reasoning_tokens == on.usage.output_tokens == 12
        events = list(_create(c, input="Think first", max_output_tokens=12, reasoning={"effort": "high"},
                              extra_body={"ignore_eos": True}, stream=True))
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == text
        assert [e.text for e in events if e.type == "response.reasoning_text.done"] == [text]
        off = _create(c, input="Think first", max_output_tokens=12, reasoning={"effort": "none"},
                      extra_body={"ignore_eos": True})
        assert [o.type for o in off.output] == ["message"] and off.usage.output_tokens_details.reasoning_tokens == 0
        # the reasoning goes back in a follow-up as the assistant message's reasoning_content
        follow = _create(c, input="More", previous_response_id=on.id, max_output_tokens=1,
                         reasoning={"effort": "high"})
        sent_back = [{"role": "user", "content": "Think first"}, *[o.model_dump(exclude_none=True) for o in on.output],
                     {"role": "user", "content": "More"}]
        assert follow.usage.input_tokens == len(_prompt(h, {"input": sent_back, "reasoning": {"effort": "high"}}))


def test_text_format_json_schema(qwen3_server):
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                               "role": {"enum": ["user", "staff"]}},
              "required": ["name", "role"], "additionalProperties": False}
    r = _create(_client(qwen3_server), input="A person", max_output_tokens=100, reasoning=NO_THINKING,
                text={"format": {"type": "json_schema", "name": "person", "schema": person, "strict": True}})
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), person)


# --------------------------------------------------------------------------------------------- tools
def test_function_calls_validate_against_their_schema(server):
    c = _client(server)
    lookup = _fn(LOOKUP)
    calls = []
    for choice in ("required", {"type": "function", "name": "get_weather"}):
        r = _create(c, input="Weather in Paris?", max_output_tokens=150, reasoning=NO_THINKING,
                    tools=[lookup, FN_WEATHER] if isinstance(choice, dict) else [FN_WEATHER], tool_choice=choice)
        assert r.status == "completed" and [o.type for o in r.output] == ["function_call"], r.output
        call = r.output[0]
        assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
        jsonschema.validate(json.loads(call.arguments), WEATHER["input_schema"])
        calls.append(call)
    events = list(_create(c, input="Weather in Paris?", max_output_tokens=150, reasoning=NO_THINKING,
                          tools=[FN_WEATHER], tool_choice="required", stream=True, parallel_tool_calls=False))
    added = [e for e in events if e.type == "response.output_item.added"]
    assert len(added) == 1 and added[0].item.type == "function_call" and added[0].item.arguments == ""
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(deltas) == done[0].arguments == calls[0].arguments      # the same request, streamed
    assert events[-1].type == "response.completed" and events[-1].response.parallel_tool_calls is False


def test_parallel_tool_calls_false_keeps_one_call():
    from deltarun.apps.serve.responses_api import _Answer

    calls = [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(2)]
    for parallel, kept in ((True, 2), (False, 1)):
        answer = _Answer(ResponsesRequest({"input": "x", "parallel_tool_calls": parallel}), "m")
        answer.splitter.push(Delta(tool_calls=calls))
        assert len(answer.splitter.blocks) == kept


def test_a_response_object_serializes_as_json_dumps_writes_it():
    """`_Answer.to_json` splices in the request's fields serialized once: the same text as
    json.dumps of the whole object, at every stage (the tests over HTTP read the fields back)."""
    from deltarun.apps.serve.responses_api import _Answer

    tools = [{"type": "function", "name": "f", "description": "é \"quoted\"", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}]
    answer = _Answer(ResponsesRequest({"input": "x", "instructions": "Sé brief.\n", "tools": tools,
                                       "metadata": {"k": "v"}, "temperature": 0.5}), "m")
    for r in (answer.response("in_progress", []), answer.response("failed", [], error={"code": "c", "message": "m"}),
              answer.response("completed", [{"type": "message", "content": []}], usage={"input_tokens": 3})):
        assert answer.to_json(r) == json.dumps(r)
        assert json.loads(answer.to_json(r))["tools"] == tools and json.loads(answer.to_json(r))["status"] == r["status"]


# --------------------------------------------------------------------------------------------- stored responses
def test_previous_response_id_get_and_delete(qwen3_server):
    c = _client(qwen3_server)
    first = _create(c, instructions="Be brief.", input="First question here", reasoning=NO_THINKING)
    assert c.responses.retrieve(first.id).model_dump() == first.model_dump()
    raw = httpx.get(f"{qwen3_server.base_url}/v1/responses/{first.id}").json()
    assert raw["id"] == first.id and raw["output"][0]["content"][0]["text"] == first.output_text
    second = _create(c, instructions="Be brief.", input="Second", previous_response_id=first.id, reasoning=NO_THINKING)
    assert second.previous_response_id == first.id
    # the prompt is the conversation so far: what sending all of it again builds
    full = [{"role": "user", "content": "First question here"}, *[o.model_dump(exclude_none=True) for o in first.output],
            {"role": "user", "content": "Second"}]
    prompt = _prompt(qwen3_server, {"instructions": "Be brief.", "input": full, "reasoning": NO_THINKING})
    assert second.usage.input_tokens == len(prompt)
    # resumed where the two prompts part: the earlier answer starts (without the empty think block)
    first_prompt = _prompt(qwen3_server, {"instructions": "Be brief.", "input": "First question here",
                                          "reasoning": NO_THINKING})
    assert second.usage.input_tokens_details.cached_tokens == common_prefix_length(first_prompt, prompt) > 20
    # instructions are not carried over
    other = _create(c, input="Second", previous_response_id=first.id, reasoning=NO_THINKING)
    assert other.usage.input_tokens < second.usage.input_tokens and other.instructions is None
    deleted = httpx.delete(f"{qwen3_server.base_url}/v1/responses/{first.id}").json()
    assert deleted == {"id": first.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.delete(first.id)
    with pytest.raises(openai.BadRequestError) as e:
        _create(c, input="Third", previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    # a second stays stored; one made with store=false is never kept
    assert c.responses.retrieve(second.id).id == second.id
    unstored = _create(c, input="Not kept", store=False, reasoning=NO_THINKING)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError):
        _create(c, input="x", previous_response_id=unstored.id)


def test_the_store_is_bounded(tiny_model_path, monkeypatch):
    monkeypatch.setattr(response_store, "MAX_RESPONSES", 2)
    with _server(tiny_model_path("tiny", "f32"), parallel=1) as h:
        c = _client(h)
        ids = [_create(c, input=f"question {i}", max_output_tokens=1).id for i in range(3)]
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(ids[0])                                  # evicted
        with pytest.raises(openai.BadRequestError) as e:
            _create(c, input="again", previous_response_id=ids[0])
        assert e.value.body["code"] == "previous_response_not_found"
        assert [c.responses.retrieve(i).id for i in ids[1:]] == ids[1:]
        _create(c, input="continue", previous_response_id=ids[1], max_output_tokens=1)   # ids[1] used: kept
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(ids[2])


def test_store_unit_bounds_by_bytes():
    store = response_store.ResponseStore(max_responses=10, max_bytes=300)
    msgs = [{"role": "user", "content": "x" * 50}]
    for i in range(5):
        store.put({"id": f"r{i}", "output": []}, msgs, msgs)
    assert store.nbytes <= 300 and len(store) == 300 // store.get("r4").nbytes
    assert store.get("r0") is None and store.delete("r4") and not store.delete("r4")


# --------------------------------------------------------------------------------------------- the agent loop
def _responses_loop(h, tools: list, chained: bool, turns: int = 6) -> list[tuple[int, int, int, list]]:
    """The agent loop of test_serve_messages through /v1/responses: the whole input each turn, or
    (chained) only the new items after `previous_response_id`. Per turn: (prompt tokens, new tokens
    against what the server held, evaluated tokens, output items)."""
    c = _client(h)
    items: list = [{"role": "user", "content": "Look these words up for me, one at a time."}]
    pending, prev, out = items, None, []
    for turn in range(turns):
        kw = dict(model="tiny", instructions="You use tools.", tools=[_fn(t) for t in tools], max_output_tokens=120,
                  temperature=0, reasoning=NO_THINKING, tool_choice="required" if turn < turns - 1 else "auto")
        prompt = _prompt(h, {**kw, "input": items})
        new = len(prompt) - common_prefix_length(_held(h, prompt), prompt)
        before = _eval_tokens(h)
        r = c.responses.create(input=pending, previous_response_id=prev, **kw) if chained else \
            c.responses.create(input=items, **kw)
        u = r.usage
        evaluated = u.input_tokens - u.input_tokens_details.cached_tokens
        assert u.input_tokens == len(prompt)
        assert _eval_tokens(h) - before - u.output_tokens in (evaluated - 1, evaluated)
        out.append((len(prompt), new, evaluated, r.output))
        items += [o.model_dump(exclude_none=True) for o in r.output]
        pending, prev = [], r.id
        if turn < turns - 1:
            call = r.output[-1]
            assert call.type == "function_call"
            word = json.loads(call.arguments)["word"]
            result = [f"{word} means {turn}", f"entry {turn}", "Error: not found"][turn % 3]
            pending = [{"type": "function_call_output", "call_id": call.call_id, "output": result}]
            items += pending
    return out


def test_agent_loop_evaluates_only_new_tokens_as_chat_completions_does(template_path):
    """Six turns with function results, sent whole and chained by previous_response_id: from turn 2
    on, each evaluates only the tokens the server did not hold plus at most K, reports the rest as
    cached, and costs exactly what the same conversation costs through /v1/chat/completions."""
    _, path = template_path
    runs = {}
    for name, run in (("full", lambda h: _responses_loop(h, [LOOKUP], chained=False)),
                      ("chained", lambda h: _responses_loop(h, [LOOKUP], chained=True)),
                      ("chat", lambda h: _chat_loop(h, [LOOKUP]))):
        with _server(path, parallel=2, chunk=32, checkpoint_every=0) as h:
            runs[name] = run(h)
    for turn, (full, chained, chat) in enumerate(zip(runs["full"], runs["chained"], runs["chat"])):
        n, new, evaluated, output = full
        if turn:
            assert evaluated <= new + RS_SLOTS, (turn, evaluated, new)
            assert evaluated < n // 2, (turn, evaluated, n)
        assert full[:3] == chained[:3], turn
        assert (n, evaluated) == chat[:2], turn
        message = chat[2]
        if message.tool_calls:
            assert json.loads(output[-1].arguments) == json.loads(message.tool_calls[0].function.arguments)
            assert [o.model_dump() for o in output if o.type != "function_call"] == []


# --------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("body, param", [
    ({"model": "t"}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].image_url"),                 # not a data: URL
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}]},
     "input[0].content[0]"),                           # an image, and the server has no --mmproj
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].id"),    # no stored item has it
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}, "input[0].arguments"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": [{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": None}]}]},
     "input[0].content"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "tools": [FN_WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": "hot"}, "temperature"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "store": "yes"}, "store"),
    ({"input": "hi", "previous_response_id": "resp_missing"}, "previous_response_id"),
])
def test_bad_requests_answer_openai_errors(qwen3_server, body, param):
    err = _openai_error(httpx.post(qwen3_server.base_url + "/v1/responses", json=body, timeout=30), 400)
    assert err["param"] == param and err["type"] == "invalid_request_error"


def test_error_mid_stream_is_response_failed(tiny_model_path):
    with _server(tiny_model_path("tiny", "f32"), parallel=1) as h:
        model = h.worker.model
        real = model.eval

        def failing(*a, **kw):
            raise RuntimeError("injected failure")
        model.eval = failing
        try:
            events = list(_create(_client(h), input="x", stream=True))
            assert [e.type for e in events] == ["response.created", "response.in_progress", "error",
                                                "response.failed"]
            assert "injected failure" in events[2].message
            failed = events[-1].response
            assert failed.status == "failed" and "injected failure" in failed.error.message and failed.output == []
            with pytest.raises(openai.InternalServerError):
                _create(_client(h), input="y")
        finally:
            model.eval = real
        assert _create(_client(h), input="z", max_output_tokens=1).usage.output_tokens == 1


def test_disconnect_mid_stream_frees_the_sequence(tiny_model_path):
    long = 8192
    with _server(tiny_model_path("tiny", "f32"), parallel=1, n_ctx=long) as h:
        c = _client(h)
        stream = _create(c, input="go on", max_output_tokens=long - 100, stream=True, extra_body={"ignore_eos": True})
        it = iter(stream)
        for _ in range(6):
            next(it)
        stream.close()
        deadline = time.monotonic() + 20
        while h.worker.counts[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert h.worker.counts == (0, 0)
        assert h.worker.model.n_past(0) < long - 100
        assert _create(c, input="next", max_output_tokens=2).usage.output_tokens == 2


def test_ending_reads_stop_strings_and_reasoning_tokens(qwen3_server):
    """`Ending.of` on a result as the worker reports it: which stop string ended the text, the
    reasoning tokens up to the one closing the think block, a full context told from the limit."""
    from deltarun.apps.serve.answers import Ending
    from deltarun.apps.serve.protocol import ChatRequest

    tok = qwen3_server.state.builder.tokenizer
    tokens = tok.encode("plan it</think>The answer STOP and more", parse_special=True)
    close = tokens.index(tok.encode("</think>", parse_special=True)[0])
    result = {"tokens": tokens, "text": "plan it</think>The answer "}
    req = ChatRequest(stops=["ST", "STOP", "zzz"], max_tokens=len(tokens))
    end = Ending.of(tok, req, "stop", result, had_reasoning=True)
    assert end.stop_sequence == "STOP" and end.reasoning_tokens == close + 1 and not end.context_full
    assert Ending.of(tok, req, "stop", {**result, "text": tok.decode(tokens)}, True).stop_sequence is None
    assert Ending.of(tok, req, "length", result, False).reasoning_tokens == 0
    assert not Ending.of(tok, req, "length", result, False).context_full
    assert Ending.of(tok, ChatRequest(max_tokens=len(tokens) + 1), "length", result, False).context_full


# --------------------------------------------------------------------------------------------- input items
def test_input_items_list_the_requests_own_input(qwen3_server):
    """GET /v1/responses/{id}/input_items: the request's input items (newest first by default),
    each with its own id or a new one, messages' text as content parts; pages through `limit` and
    `after` as the SDK's auto-pagination walks them; a follow-up lists only its own input."""
    c = _client(qwen3_server)
    given = [{"role": "user", "content": "hi"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "yo"}], "id": "m_1"},
             {"type": "function_call", "call_id": "c1", "name": WEATHER["name"], "arguments": '{"city": "x"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
             {"role": "user", "content": "and tomorrow?"}]
    r = _create(c, input=given, tools=[FN_WEATHER])
    listed = c.responses.input_items.list(r.id, order="asc", limit=100).model_dump()
    items = listed["data"]
    assert [i["type"] for i in items] == ["message", "message", "function_call", "function_call_output", "message"]
    assert items[1]["id"] == "m_1" and len({i["id"] for i in items}) == 5
    assert items[0]["content"][0]["type"] == "input_text" and items[0]["content"][0]["text"] == "hi"
    assert items[3]["output"] == "sunny" and items[2]["arguments"] == '{"city": "x"}'
    assert all(i["status"] == "completed" for i in items) and listed["has_more"] is False
    assert (listed["first_id"], listed["last_id"]) == (items[0]["id"], items[-1]["id"])
    newest_first = [i.id for i in c.responses.input_items.list(r.id, limit=2)]        # auto-paginated
    assert newest_first == [i["id"] for i in items][::-1]
    page = c.responses.input_items.list(r.id, limit=2, after=items[-1]["id"])
    assert [i.id for i in page.data] == [items[-2]["id"], items[-3]["id"]] and page.has_more

    follow = _create(c, input="thanks", previous_response_id=r.id)
    own = c.responses.input_items.list(follow.id).data
    assert len(own) == 1 and own[0].content[0].text == "thanks"

    base = qwen3_server.base_url + f"/v1/responses/{r.id}/input_items"
    for query, param in (("?limit=0", "limit"), ("?limit=101", "limit"), ("?order=up", "order"),
                         ("?after=nope", "after")):
        assert _openai_error(httpx.get(base + query, timeout=30), 400)["param"] == param
    assert _openai_error(httpx.get(qwen3_server.base_url + "/v1/responses/resp_nope/input_items"), 404)
    c.responses.delete(follow.id)
    assert _openai_error(httpx.get(qwen3_server.base_url + f"/v1/responses/{follow.id}/input_items"), 404)


def test_item_references_name_stored_input_and_output_items(qwen3_server):
    """An `item_reference` input item stands for the stored item it names (a stored response's
    input or output item): the same prompt and answer as the items sent whole; a reference to no
    stored item, or to one of a deleted response, is a 400."""
    c = _client(qwen3_server)
    r = _create(c, input="Weather in Paris?", tools=[FN_WEATHER], tool_choice="required", reasoning=NO_THINKING,
                max_output_tokens=60)
    call = next(o for o in r.output if o.type == "function_call")
    asked = c.responses.input_items.list(r.id).data[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    whole = _create(c, tools=[FN_WEATHER], reasoning=NO_THINKING,
                    input=[{"role": "user", "content": "Weather in Paris?"}]
                    + [o.model_dump(exclude_none=True) for o in r.output] + [result])
    named = _create(c, tools=[FN_WEATHER], reasoning=NO_THINKING,
                    input=[{"type": "item_reference", "id": asked.id}]
                    + [{"type": "item_reference", "id": o.id} for o in r.output] + [result])
    assert named.usage.input_tokens == whole.usage.input_tokens and named.output_text == whole.output_text
    assert [o.model_dump() for o in named.output][0]["type"] == [o.model_dump() for o in whole.output][0]["type"]
    url = qwen3_server.base_url + "/v1/responses"
    err = _openai_error(httpx.post(url, json={"input": [{"type": "item_reference", "id": "fc_nope"}]}, timeout=30), 400)
    assert err["code"] == "item_not_found" and err["param"] == "input[0].id"
    c.responses.delete(r.id)       # the later two hold the call too (their input), as sent or resolved
    assert httpx.post(url, json={"input": [{"type": "item_reference", "id": call.id}], "max_output_tokens": 1,
                                 "store": False}, timeout=30).status_code == 200
    for rid in (whole.id, named.id):
        c.responses.delete(rid)
    err = _openai_error(httpx.post(url, json={"input": [{"type": "item_reference", "id": call.id}]}, timeout=30), 400)
    assert err["code"] == "item_not_found"


def test_the_store_forgets_the_items_of_what_it_drops():
    """Evicted or deleted responses take their items with them; an id two responses hold stays
    with the newer one when the older goes."""
    store = response_store.ResponseStore(max_responses=2)

    def put(rid, item_ids):
        store.put({"id": rid, "output": [{"id": i, "type": "message"} for i in item_ids]}, [], [],
                  input_items=[{"id": f"in_{rid}", "type": "message"}])
    put("r1", ["a", "shared"])
    put("r2", ["b", "shared"])
    assert store.item("a") and store.item("in_r1") and store.item("shared")
    store.delete("r1")
    assert store.item("a") is None and store.item("in_r1") is None and store.item("shared") is not None
    put("r3", ["c"])
    put("r4", ["d"])                                   # r2 evicted (two at most)
    assert store.item("b") is None and store.item("shared") is None and store.item("in_r2") is None
    assert store.item("c") and store.item("d") and len(store) == 2
