"""Continuing the final assistant message (assistant prefill) in `deltarun serve`: Chat Completions
(llama-server's default, `continue_final_message`), Anthropic's Messages API, never Responses.

The expected prompts are built from each template's own generation prompt (what an answer's
message opens with) and the message's text, not from the server's cut of a rendering; the
continued answers are compared with /v1/completions on that raw prompt (the same tokens, greedy).
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from test_serve import _server

from deltarun.apps.serve.protocol import parse_chat
from deltarun.base.chat_template import ChatTemplate
from deltarun.base.gguf_file import GGUFFile
from deltarun.runner.resume import common_prefix_length

TEMPLATES = {"qwen3": "tiny", "qwen35": "tiny-qwen35"}
ASKED = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour, please."}]
NO_THINKING = {"enable_thinking": False}


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def case(request, tiny_model_path):
    path = tiny_model_path(TEMPLATES[request.param], "f32")
    f = GGUFFile(path)
    with _server(path, parallel=2, chunk=32, checkpoint_every=0) as h:
        yield h, ChatTemplate(f.get("tokenizer.chat_template")), f.tokenizer()


def _opened(template: ChatTemplate, msgs: list[dict], **kw) -> str:
    """The prompt up to inside the answer's open think block: the template's generation prompt,
    which the Qwen3.5 template ends with "<think>\\n" and the Qwen3 one leaves to the model."""
    gen = template.render(msgs, add_generation_prompt=True, **kw)
    return gen if gen.endswith("<think>\n") else gen + "<think>\n"


def _body(messages: list[dict], **kw) -> dict:
    return {"messages": messages, "max_tokens": 8, "temperature": 0, **kw}


def _chat(h, body: dict) -> httpx.Response:
    return httpx.post(h.base_url + "/v1/chat/completions", json=body, timeout=60)


def _completion(h, prompt: str, max_tokens: int = 8) -> str:
    r = httpx.post(h.base_url + "/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens,
                                                        "temperature": 0}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_the_continued_prompt_is_the_generation_prompt_and_the_text(case):
    """Text continued after the (empty, closed) think block the template opens an answer with;
    reasoning continued inside it; with thinking off, the generation prompt (which then holds the
    empty think block) followed by the text. The answer starts thinking only in the second."""
    h, template, _ = case
    builder = h.state.builder
    cases = [
        (_body(ASKED + [{"role": "assistant", "content": "Sure, "}]),
         _opened(template, ASKED) + "\n</think>\n\nSure, ", False),
        (_body(ASKED + [{"role": "assistant", "content": "", "reasoning_content": "Let me"}]),
         _opened(template, ASKED) + "Let me", True),
        (_body(ASKED + [{"role": "assistant", "content": "Sure, "}], chat_template_kwargs=NO_THINKING),
         template.render(ASKED, add_generation_prompt=True, enable_thinking=False) + "Sure, ", False),
    ]
    for body, expected, thinking in cases:
        req = parse_chat(body)
        r = httpx.post(h.base_url + "/apply-template", json=body, timeout=60)       # llama-server's endpoint
        assert r.status_code == 200 and r.json() == {"prompt": expected}, r.text
        params = builder.chat(req)
        assert params.prompt == builder.tokenize(expected) and params.starts_thinking is thinking
    # not continued: a new answer after the assistant message (the old rendering)
    req = parse_chat(_body(ASKED + [{"role": "assistant", "content": "Sure, "}], continue_final_message=False))
    assert builder.prompt_text(req) == template.render(ASKED + [{"role": "assistant", "content": "Sure, "}],
                                                       add_generation_prompt=True)


def test_continued_answers_over_every_api(case):
    """Chat Completions and Messages answer what /v1/completions writes after the continued prompt
    (Messages the new text, Chat Completions the message whole, as llama-server); Responses and
    `continue_final_message: false` answer a new message after it, and so does a server started
    with --no-prefill-assistant."""
    h, template, _ = case
    msgs = ASKED + [{"role": "assistant", "content": "Sure, "}]
    expected = _completion(h, _opened(template, ASKED) + "\n</think>\n\nSure, ")
    assert "think>" not in expected and "<tool_call>" not in expected
    r = _chat(h, _body(msgs))          # the message comes back whole, as llama-server's
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "Sure, " + expected
    o = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    chunks = list(o.chat.completions.create(model="tiny", max_tokens=8, temperature=0, messages=msgs, stream=True, n=2))
    for i in range(2):
        deltas = [c.choices[0].delta for c in chunks if c.choices and c.choices[0].index == i]
        assert deltas[0].role == "assistant" and deltas[0].content == "Sure, "
        assert "".join(d.content or "" for d in deltas) == "Sure, " + expected

    a = anthropic.Anthropic(base_url=h.base_url, api_key="x", max_retries=0, timeout=60)
    m = a.messages.create(model="tiny", max_tokens=8, system=ASKED[0]["content"], messages=msgs[1:],
                          extra_body={"temperature": 0})
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == expected

    off = _completion(h, _opened(template, ASKED) + "Let me")      # continued thinking
    r = _chat(h, _body(ASKED + [{"role": "assistant", "content": "", "reasoning_content": "Let me"}]))
    got = r.json()["choices"][0]["message"]
    assert got["reasoning_content"].startswith("Let me") and off.startswith(got["reasoning_content"][6:].strip()[:8])

    new_answer = _chat(h, _body(msgs, continue_final_message=False)).json()["choices"][0]["message"]
    assert new_answer.get("content") != expected
    resp = o.responses.create(model="tiny", max_output_tokens=8, temperature=0, instructions=ASKED[0]["content"],
                              input=[{"role": "user", "content": ASKED[1]["content"]},
                                     {"role": "assistant", "content": "Sure, "}])
    assert resp.output_text == (new_answer["content"] or "")
    h.state.builder.prefill_assistant = False          # as `serve --no-prefill-assistant` builds it
    try:
        assert _chat(h, _body(msgs)).json()["choices"][0]["message"] == new_answer
        r = _chat(h, _body(msgs, continue_final_message=True))      # the request still decides
        assert r.json()["choices"][0]["message"]["content"] == "Sure, " + expected
        m = a.messages.create(model="tiny", max_tokens=8, system=ASKED[0]["content"], messages=msgs[1:],
                              extra_body={"temperature": 0})                      # Anthropic's prefill
        assert m.content[0].text == expected
    finally:
        h.state.builder.prefill_assistant = True


@pytest.mark.parametrize("body, needle", [
    (_body(ASKED, continue_final_message=True), "not the assistant's"),
    (_body(ASKED + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), "tool calls"),
    (_body(ASKED + [{"role": "assistant", "content": "{"}], response_format={"type": "json_object"}), "grammar"),
    (_body(ASKED + [{"role": "assistant", "content": "x"}], tool_choice="required",
           tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]), "grammar"),
    (_body(ASKED, continue_final_message="yes"), "continue_final_message"),
])
def test_what_cannot_be_continued_is_a_400(case, body, needle):
    h = case[0]
    r = _chat(h, body)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_apply_template_refuses_what_chat_completions_refuses(case):
    h = case[0]
    for body, needle in ((_body(ASKED, continue_final_message=True), "not the assistant's"),
                         ({"messages": []}, "messages"), ([1, 2], "JSON object")):
        r = httpx.post(h.base_url + "/apply-template", json=body, timeout=60)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_messages_refuses_to_continue_a_tool_use(case):
    h = case[0]
    r = httpx.post(h.base_url + "/v1/messages", timeout=60, json={
        "max_tokens": 5, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "messages": [{"role": "user", "content": "hi"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]}]})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert "cannot be continued" in r.json()["error"]["message"]


def test_the_next_turn_resumes_where_the_continued_message_starts(tiny_model_path):
    """The client sends the continued message back whole (its text and the answer): the next turn
    resumes from the checkpoint where that message starts, and, with prefill ahead, evaluates only
    its new user message (the prediction holds the continued message as the client sends it)."""
    path = tiny_model_path("tiny-qwen35", "f32")
    f = GGUFFile(path)
    template, tok = ChatTemplate(f.get("tokenizer.chat_template")), f.tokenizer()

    def tokens(msgs):
        return tok.encode(template.render(msgs, add_generation_prompt=True), parse_special=True)

    def turns(h):
        o = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
        first = o.chat.completions.create(model="t", max_tokens=6, temperature=0,
                                          messages=ASKED + [{"role": "assistant", "content": "Sure, "}])
        h.wait_settled()
        assert first.choices[0].message.content.startswith("Sure, ")      # sent back as it came
        msgs = ASKED + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "And another one?"}]
        second = o.chat.completions.create(model="t", max_tokens=6, temperature=0, messages=msgs)
        return msgs, second.usage

    with _server(path, parallel=1, chunk=32, checkpoint_every=0) as h:
        msgs, usage = turns(h)
        assistant_start = common_prefix_length(tokens(ASKED + [{"role": "user", "content": ""}]), tokens(msgs))
        first_prompt = h.state.builder.tokenize(_opened(template, ASKED) + "\n</think>\n\nSure, ")
        assert usage.prompt_tokens == len(tokens(msgs))
        assert usage.prompt_tokens_details.cached_tokens == common_prefix_length(first_prompt, tokens(msgs)) \
            >= assistant_start - 1
    with _server(path, parallel=1, chunk=32, checkpoint_every=0, prefill_ahead=True) as h:
        msgs, usage = turns(h)
        new_message = common_prefix_length(tokens(msgs[:-1] + [{"role": "user", "content": ""}]), tokens(msgs))
        assert usage.prompt_tokens_details.cached_tokens == new_message


def test_cli_prefill_assistant_option(tiny_model_path, monkeypatch):
    from click.testing import CliRunner

    import deltarun.apps.serve.server as server
    from deltarun.cli.main import cli

    seen = []
    monkeypatch.setattr(server, "serve_forever", lambda load, settings, *a, **kw: seen.append(settings))
    for flag, expected in (([], True), (["--no-prefill-assistant"], False)):
        result = CliRunner().invoke(cli, ["serve", str(tiny_model_path("tiny", "f32")), "--port", "0", *flag])
        assert result.exit_code == 0, result.output
        assert seen[-1].prefill_assistant is expected
