"""What an agent's request constrains in `deltarun serve`, over real HTTP: the thinking budget
(Anthropic's `thinking.budget_tokens`, llama-server's `reasoning_budget_tokens`) and the lazy
tool-call grammar of `tool_choice: auto`.

The tiny random-weights models write gibberish, so the reference for each greedy answer is the
same prompt's tokens through /v1/completions, which has neither budget nor grammar: the answer
must be those tokens up to the point where the budget or grammar takes over, and then what the
constraint says (the template's end-of-thinking marker; a call that parses and validates against
its schema). Tokens are compared by their text in `logprobs` (by their bytes between two chat
answers).
"""

from __future__ import annotations

import json
import os

import anthropic
import httpx
import jsonschema
import numpy as np
import pytest
from test_serve import _server

from test_thinking_budget import _decode, _Oracle

from deltarun.apps.serve.grammar import CallSyntax, GrammarFactory
from deltarun.apps.serve.worker import end_of_generation_ids
from deltarun.base.chat_template import ChatTemplate
from deltarun.base.gguf_file import GGUFFile
from deltarun.runner.model import Model
from deltarun.runner.reasoning import THINK_CLOSE, ThinkingTags
from deltarun.runner.sampling import LogitsProcessors
from deltarun.runner.speculative import Draft

TEMPLATES = {"qwen3": "tiny", "qwen35": "tiny-qwen35", "kimi": "tiny-kimi-linear-k2vocab"}
#: the token a template's call block opens with (the lazy grammar's trigger), and the texts that
#: open and close each call in it (Kimi-Linear's template: a section of calls)
CALL_MARKS = {"qwen3": ("<tool_call>", "<tool_call>", "</tool_call>"),
              "qwen35": ("<tool_call>", "<tool_call>", "</tool_call>"),
              "kimi": ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_end|>")}
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                   "unit": {"enum": ["c", "f"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": WEATHER_SCHEMA}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def served(request, tiny_model_path):
    """(template name, server, tokenizer, template) for one tiny model (Kimi-Linear's with its own
    template and vocabulary)."""
    path = tiny_model_path(TEMPLATES[request.param], "f32")
    f = GGUFFile(path)
    tmpl = ChatTemplate(f.get("tokenizer.chat_template")) if f.get("tokenizer.chat_template") else ChatTemplate.builtin()
    with _server(path, parallel=1, chunk=32, checkpoint_every=0) as h:
        yield request.param, h, f.tokenizer(), tmpl


def _prompt(tok, tmpl, messages, **kw) -> list[int]:
    return tok.encode(tmpl.render(messages, add_generation_prompt=True, **kw), parse_special=True)


def _chat(h, body) -> dict:
    r = httpx.post(h.base_url + "/v1/chat/completions", json={"temperature": 0, "logprobs": True, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _free(h, prompt: list[int], n: int, **extra) -> list[str]:
    """The text of each of the n greedy tokens after `prompt` with no budget and no grammar."""
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "logprobs": 1, "ignore_eos": True, **extra}
    r = httpx.post(h.base_url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def _bytes(choice: dict) -> list[bytes]:
    return [bytes(e["bytes"]) for e in choice["logprobs"]["content"]]


def _texts(choice: dict) -> list[str]:
    """Each token's text as /v1/completions gives it (undecodable bytes replaced)."""
    return [e["token"] for e in choice["logprobs"]["content"]]


def _whole(pieces: list[bytes], n: int) -> int:
    """n, or more until the text does not end inside a UTF-8 character."""
    k = n
    while k < len(pieces) and not _complete(b"".join(pieces[:k])):
        k += 1
    return k


def _complete(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError as e:
        return e.start < len(data) - 3          # an error before the last bytes: not a cut character


# ------------------------------------------------------------------------------------ thinking budget
@pytest.mark.parametrize("n", [1, 6])
def test_a_budget_of_n_thinks_n_tokens_then_the_marker(served, n):
    """Thinking on, a budget of n: the reference's first n tokens (more only to finish a character),
    then the template's marker token by token; reasoning and content split there."""
    name, h, tok, tmpl = served
    if name != "qwen35":
        pytest.skip(f"the {name} template's generation prompt does not open the think block and the tiny "
                    "model never writes <think>: nothing to count")
    encode = lambda s: tok.encode(s, add_special=False, parse_special=True)  # noqa: E731
    marker = [tok.token_bytes(t) for t in ThinkingTags.of(encode, tmpl.reasoning_separator()).forced]
    prompt = _prompt(tok, tmpl, ASK, enable_thinking=True)
    body = {"messages": ASK, "max_tokens": n + 12, "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": True}}
    # no budget (and -1, llama-server's "no limit"): the reference's tokens, all of them thinking
    for extra in ({}, {"reasoning_budget_tokens": -1}):
        plain = _chat(h, {**body, **extra})
        assert _texts(plain) == _free(h, prompt, body["max_tokens"]) and not plain["message"]["content"]
    free = _bytes(plain)
    k = _whole(free, n)
    assert THINK_CLOSE.encode() not in b"".join(free[:k])
    got = _chat(h, {**body, "max_tokens": k + len(marker) + 5, "reasoning_budget_tokens": n})
    pieces = _bytes(got)
    assert pieces[:k] == free[:k] and pieces[k:k + len(marker)] == marker
    msg = got["message"]
    before_close = tmpl.reasoning_separator().split(THINK_CLOSE)[0]      # the marker's "\n" is reasoning text
    assert msg["reasoning_content"] == (b"".join(free[:k]).decode("utf-8", errors="replace") + before_close).lstrip("\n")
    assert msg["content"] == b"".join(pieces[k + len(marker):]).decode("utf-8", errors="replace").lstrip("\n")


def test_anthropic_budget_tokens_is_the_budget(served):
    """`thinking: {type: enabled, budget_tokens}` through the anthropic SDK: the same thinking and
    text as the chat request with that budget."""
    name, h, tok, tmpl = served
    c = anthropic.Anthropic(base_url=h.base_url, api_key="x", max_retries=0, timeout=120)
    r = c.messages.create(model="tiny", max_tokens=20, messages=ASK, thinking={"type": "enabled", "budget_tokens": 4},
                          extra_body={"temperature": 0, "ignore_eos": True})
    chat = _chat(h, {"messages": ASK, "max_tokens": 20, "ignore_eos": True, "reasoning_budget_tokens": 4,
                     "chat_template_kwargs": {"enable_thinking": True}})["message"]
    blocks = {b.type: b for b in r.content}
    if name == "qwen35":
        assert [b.type for b in r.content] == ["thinking", "text"]
        assert blocks["thinking"].thinking == chat["reasoning_content"]
    assert blocks["text"].text == chat["content"]


def test_bad_budgets_are_400(served):
    _, h, _, _ = served
    for v in (-2, "4", 1.5):
        r = httpx.post(h.base_url + "/v1/chat/completions", timeout=60,
                       json={"messages": ASK, "max_tokens": 2, "reasoning_budget_tokens": v})
        assert r.status_code == 400 and "reasoning_budget_tokens" in r.json()["error"]["message"], r.text


# ------------------------------------------------------------------------------------- lazy grammar
def _trigger_bias(h, tok, prompt: list[int], name: str) -> tuple[int, float, list[str]]:
    """A logit bias on the call block's opening token (<tool_call>, Kimi's section) that makes the
    unconstrained model write some text first and then the trigger: (trigger id, bias, the
    unconstrained tokens)."""
    opening = CALL_MARKS[name][0]
    trigger = tok.encode(opening, add_special=False, parse_special=True)
    assert len(trigger) == 1
    for bias in (6, 7, 8, 9, 10, 11, 12):
        free = _free(h, prompt, 40, logit_bias={str(trigger[0]): bias})
        if opening in free[1:]:
            return trigger[0], bias, free
    pytest.fail(f"no bias makes the tiny model write {opening} after some text")


def _valid_call(call: dict) -> None:
    assert call["function"]["name"] == "get_weather"
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER_SCHEMA)


def test_auto_tool_calls_follow_the_schema_after_the_trigger(served):
    """tool_choice auto: the text before the trigger is the model's own (token for token the
    unconstrained answer), and from the trigger on each call parses and validates against its
    schema, where the unconstrained model's text after the trigger is no such call."""
    name, h, tok, tmpl = served
    prompt = _prompt(tok, tmpl, ASK, tools=[WEATHER], enable_thinking=False)
    trigger, bias, free = _trigger_bias(h, tok, prompt, name)
    at = free.index(CALL_MARKS[name][0])
    got = _chat(h, {"messages": ASK, "tools": [WEATHER], "tool_choice": "auto", "max_tokens": 120,
                    "logit_bias": {str(trigger): bias}, "chat_template_kwargs": {"enable_thinking": False}})
    pieces = _texts(got)
    assert pieces[:at + 1] == free[:at + 1] and pieces[at + 1:] != free[at + 1:]
    calls = got["message"]["tool_calls"]
    closed = pieces.count(CALL_MARKS[name][2])     # the last call may be cut by max_tokens
    assert closed >= 1 and len(calls) >= closed
    for call in calls[:closed]:
        _valid_call(call)
    before = b"".join(_bytes(got)[:at]).decode("utf-8", errors="replace")
    assert got["message"]["content"].startswith(before.lstrip("\n"))
    # the same request without tools: no grammar, the unconstrained tokens
    plain = _chat(h, {"messages": ASK, "max_tokens": 40, "ignore_eos": True, "logit_bias": {str(trigger): bias},
                      "chat_template_kwargs": {"enable_thinking": False}})
    assert plain["message"].get("tool_calls") is None


def test_a_trigger_while_thinking_is_not_a_call(served):
    """A <tool_call> inside the think block is reasoning: nothing is constrained, the answer is the
    unconstrained model's token for token."""
    name, h, tok, tmpl = served
    if name != "qwen35":
        pytest.skip(f"the {name} template's generation prompt does not open the think block")
    prompt = _prompt(tok, tmpl, ASK, tools=[WEATHER], enable_thinking=True)
    trigger, bias, free = _trigger_bias(h, tok, prompt, name)
    got = _chat(h, {"messages": ASK, "tools": [WEATHER], "max_tokens": 40, "ignore_eos": True,
                    "logit_bias": {str(trigger): bias}, "chat_template_kwargs": {"enable_thinking": True}})
    assert _texts(got) == free and not got["message"].get("tool_calls")


def test_anthropic_auto_tool_use_validates(served):
    """The Messages API's tool_choice auto takes the same lazy grammar: tool_use inputs validate."""
    name, h, tok, tmpl = served
    prompt = _prompt(tok, tmpl, ASK, tools=[WEATHER], enable_thinking=False)
    trigger, bias, _ = _trigger_bias(h, tok, prompt, name)
    c = anthropic.Anthropic(base_url=h.base_url, api_key="x", max_retries=0, timeout=120)
    tool = {"name": "get_weather", "description": "Weather in a city", "input_schema": WEATHER_SCHEMA}
    r = c.messages.create(model="tiny", max_tokens=120, messages=ASK, tools=[tool], tool_choice={"type": "auto"},
                          thinking={"type": "disabled"},
                          extra_body={"temperature": 0, "logit_bias": {str(trigger): bias}})
    uses = [b for b in r.content if b.type == "tool_use"]
    assert uses
    for u in uses:
        jsonschema.validate(u.input, WEATHER_SCHEMA)


def test_drafts_with_a_lazy_grammar_keep_the_answer(tiny_model_path):
    """The decode engine with drafts that are the constrained answer itself: they are cut before
    the trigger and not taken inside a call, so the answer is the undrafted one, and the drafts
    before each trigger were verified."""
    path = tiny_model_path("tiny", "f32")
    with Model(path, n_ctx=512, kv_type="f32", n_seq_max=1, rs_slots=4) as m:
        tok = m.tokenizer
        grammars = GrammarFactory(tok, m.hp.n_vocab, end_of_generation_ids(m))
        grammar, trigger = grammars.lazy_tool_call([WEATHER], CallSyntax.JSON)
        prompt = _prompt(tok, ChatTemplate.builtin(), ASK, tools=[WEATHER], enable_thinking=False)

        def processors() -> LogitsProcessors:
            return LogitsProcessors(logit_bias={trigger: 9.0}, banned=end_of_generation_ids(m),
                                    grammar=grammars.matcher(grammar, trigger))
        want = _decode(m, prompt, 90, processors(), None)
        assert want.count(trigger) >= 2 and want.index(trigger) > 0
        text = b"".join(tok.token_bytes(t) for t in want).decode("utf-8", errors="replace")
        for block in text.split("<tool_call>")[1:-1]:
            call = json.loads(block.split("</tool_call>")[0])
            jsonschema.validate(call["arguments"], WEATHER_SCHEMA)
        oracle = _AcrossTriggers(prompt, want, trigger)
        assert _decode(m, prompt, 90, processors(), oracle, stats := {}) == want
        assert stats["n_drafted"] > 0


class _AcrossTriggers(_Oracle):
    """Drafts the answer itself, from two tokens before each trigger: every draft reaches across
    one, which the engine must cut before it."""

    def __init__(self, prompt: list[int], answer: list[int], trigger: int):
        super().__init__(prompt, answer)
        self.starts = {i - 2 for i, t in enumerate(answer) if t == trigger}

    def propose(self, history, n, sampler):
        if len(history) - len(self.prompt) not in self.starts:
            return Draft([], [])
        return super().propose(history, n, sampler)


def test_responses_take_the_budget_as_an_extra(served):
    """The Responses API has no token budget: llama-server's `reasoning_budget_tokens` extra is
    passed on, and the reasoning item and message are the chat request's."""
    name, h, _, _ = served
    if name != "qwen35":
        pytest.skip(f"the {name} template's generation prompt does not open the think block")
    body = {"model": "tiny", "input": ASK[0]["content"], "max_output_tokens": 16, "temperature": 0,
            "ignore_eos": True, "reasoning": {"effort": "high"}, "reasoning_budget_tokens": 3, "store": False}
    r = httpx.post(h.base_url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    items = {it["type"]: it for it in r.json()["output"]}
    chat = _chat(h, {"messages": ASK, "max_tokens": 16, "ignore_eos": True, "reasoning_budget_tokens": 3,
                     "chat_template_kwargs": {"enable_thinking": True}})["message"]
    assert items["reasoning"]["content"][0]["text"] == chat["reasoning_content"]
    assert items["message"]["content"][0]["text"] == chat["content"]


def test_matchers_of_one_grammar_are_independent(tiny_model_path):
    """A request's matcher is a copy of the grammar compiled once: moving one on leaves the next
    request's at the grammar's start."""
    tok = GGUFFile(tiny_model_path("tiny", "f32")).tokenizer()
    grammars = GrammarFactory(tok, tok.n_vocab, [tok.eos_id])
    grammar, trigger = grammars.lazy_tool_call([WEATHER], CallSyntax.JSON)
    x = np.zeros(tok.n_vocab, dtype=np.float32)
    first = grammars.matcher(grammar)
    assert np.flatnonzero(np.isfinite(first.mask(x))).tolist() == [trigger]
    first.accept(trigger)
    second = grammars.matcher(grammar)
    assert np.flatnonzero(np.isfinite(second.mask(x))).tolist() == [trigger]
    assert not np.isfinite(first.mask(x))[trigger]


def test_mtp_drafts_with_a_budget_keep_the_answer(tiny_model_path):
    """`--draft mtp` (Qwen3.5's MTP block) on a request with a thinking budget: drafts are verified
    up to the budget's end, and the greedy answer is the undrafted server's, marker included."""
    from test_serve_draft import _server as draft_server

    path = tiny_model_path("tiny-qwen35", "f32")
    body = {"messages": ASK, "max_tokens": 24, "temperature": 0, "ignore_eos": True,    # no logprobs: they stop drafts
            "reasoning_budget_tokens": 7, "chat_template_kwargs": {"enable_thinking": True}}
    answers = []
    for draft in (None, "mtp"):
        with draft_server(path, draft=draft, parallel=1) as h:
            r = httpx.post(h.base_url + "/v1/chat/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            answers.append(r.json())
    plain, drafted = (a["choices"][0]["message"] for a in answers)
    assert drafted == plain and plain["content"] and plain["reasoning_content"]
    assert answers[1]["timings"]["draft_n"] > 0


# ------------------------------------------------------------- constrained answers while thinking
ANSWER_SCHEMA = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"], "additionalProperties": False}
ANSWER_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": ANSWER_SCHEMA}}


def _close_bias(h, tok, prompt: list[int]) -> tuple[int, float, list[str]]:
    """A logit bias on </think> that makes the unconstrained model think a few tokens and then
    close the block itself: (its id, the bias, the unconstrained tokens)."""
    close = tok.encode(THINK_CLOSE, add_special=False, parse_special=True)
    assert len(close) == 1
    for bias in (4, 5, 6, 7, 8, 9, 10, 11, 12):
        free = _free(h, prompt, 30, logit_bias={str(close[0]): bias})
        if THINK_CLOSE in free[3:]:
            return close[0], bias, free
    pytest.fail("no bias makes the tiny model close its think block after some tokens")


def test_a_response_format_constrains_the_answer_after_the_think_block(served):
    """Thinking on, a json_schema (llama-server's parser: an optional think block, then the JSON):
    the think block is the unconstrained model's token for token up to its closing tag, and the
    answer after it is the JSON, in `content` (it was all written inside the block, as reasoning)."""
    name, h, tok, tmpl = served
    if name != "qwen35":
        pytest.skip(f"the {name} template's generation prompt does not open the think block")
    prompt = _prompt(tok, tmpl, ASK, enable_thinking=True)
    close, bias, free = _close_bias(h, tok, prompt)
    at = free.index(THINK_CLOSE)
    got = _chat(h, {"messages": ASK, "max_tokens": 60, "logit_bias": {str(close): bias}, "ignore_eos": True,
                    "response_format": ANSWER_FORMAT, "chat_template_kwargs": {"enable_thinking": True}})
    assert _texts(got)[:at + 1] == free[:at + 1]
    msg = got["message"]
    assert msg["reasoning_content"] == b"".join(_bytes(got)[:at]).decode("utf-8", errors="replace").strip("\n")
    jsonschema.validate(json.loads(msg["content"]), ANSWER_SCHEMA)
    assert got["finish_reason"] == "stop"


@pytest.mark.parametrize("api", ["chat", "messages", "responses", "tool_call"])
def test_a_budget_ends_the_thinking_before_a_constrained_answer(served, api):
    """A budget of 3 with a json_schema (Chat Completions' response_format, the Messages API's
    output_config.format, the Responses API's text.format) or a forced tool call: the thinking,
    the template's marker, then the JSON or the call, which validates; the thinking is the
    unconstrained answer's with that budget. A template whose prompt does not open the block (Qwen3's) is
    constrained from the first token, as before: no thinking."""
    name, h, tok, tmpl = served
    body = {"messages": ASK, "max_tokens": 60, "ignore_eos": True, "reasoning_budget_tokens": 3,
            "chat_template_kwargs": {"enable_thinking": True}}
    if api == "tool_call":
        msg = _chat(h, {**body, "tools": [WEATHER], "tool_choice": "required"})["message"]
        _valid_call(msg["tool_calls"][0])
        answer, thinking = None, msg.get("reasoning_content")
    elif api == "chat":
        msg = _chat(h, {**body, "response_format": ANSWER_FORMAT})["message"]
        answer, thinking = msg["content"], msg.get("reasoning_content")
    elif api == "messages":
        c = anthropic.Anthropic(base_url=h.base_url, api_key="x", max_retries=0, timeout=120)
        r = c.messages.create(model="tiny", max_tokens=60, messages=ASK, thinking={"type": "enabled", "budget_tokens": 3},
                              extra_body={"temperature": 0, "ignore_eos": True, "output_config": {"format": {
                                  "type": "json_schema", "schema": ANSWER_SCHEMA}}})
        blocks = {b.type: b for b in r.content}
        answer = blocks["text"].text
        thinking = blocks["thinking"].thinking if "thinking" in blocks else None
    else:
        r = httpx.post(h.base_url + "/v1/responses", timeout=120, json={
            "model": "tiny", "input": ASK[0]["content"], "max_output_tokens": 60, "temperature": 0,
            "reasoning": {"effort": "high"}, "reasoning_budget_tokens": 3, "store": False, "ignore_eos": True,
            "text": {"format": {"type": "json_schema", "name": "x", "schema": ANSWER_SCHEMA}}})
        assert r.status_code == 200, r.text
        items = {it["type"]: it for it in r.json()["output"]}
        answer = items["message"]["content"][0]["text"]
        thinking = items["reasoning"]["content"][0]["text"] if "reasoning" in items else None
    if answer is not None:
        jsonschema.validate(json.loads(answer), ANSWER_SCHEMA)
    if name == "qwen35":
        same = {"tools": [WEATHER], "tool_choice": "auto"} if api == "tool_call" else {}     # the same prompt
        free = _chat(h, {**body, **same, "max_tokens": 12})["message"]     # the same budget, no constraint
        assert thinking and thinking == free["reasoning_content"]
    else:
        assert not thinking


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_a_call_renders_back_as_it_was_generated(served, choice):
    """The call's text (JSON with the template's separators, or Qwen3.5's XML; Kimi's with its id)
    is what the template writes when the call comes back in the history, so the next turn's prompt
    shares it."""
    name, h, tok, tmpl = served
    opening, call_open, call_close = CALL_MARKS[name]
    trigger = tok.encode(opening, add_special=False, parse_special=True)[0]
    body = {"messages": ASK, "tools": [WEATHER], "tool_choice": choice, "max_tokens": 120,
            "chat_template_kwargs": {"enable_thinking": False}}
    if choice == "auto":
        body["logit_bias"] = {str(trigger): 9}
    got = _chat(h, body)
    text = b"".join(_bytes(got)).decode("utf-8", errors="replace")
    generated = text[text.index(call_open):text.index(call_close) + len(call_close)]
    first = got["message"]["tool_calls"][0]
    call = first["function"]
    history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": first["id"], "type": "function",
         "function": {"name": call["name"], "arguments": json.loads(call["arguments"])}}]}]
    rendered = tmpl.render(history, add_generation_prompt=False, tools=[WEATHER], enable_thinking=False)
    assert generated in rendered


def test_a_forced_call_without_a_tool_call_token_writes_the_tag_as_text():
    """A vocabulary without a `<tool_call>` special token (llama.cpp's Qwen2 vocabulary): a forced
    call's grammar writes the tags as text (it was a 400, "unknown special token"), and the call
    as the template writes it is allowed token by token to its end."""
    from deltarun.model_files.vocab import qwen2_vocab_path

    path = qwen2_vocab_path()
    if not os.path.exists(path):
        pytest.skip(f"no Qwen2 vocabulary at {path}")
    tok = GGUFFile(path).tokenizer()
    assert len(tok.encode("<tool_call>", add_special=False, parse_special=True)) > 1
    grammars = GrammarFactory(tok, tok.n_vocab, [tok.eos_id])
    m = grammars.matcher(grammars.tool_call([WEATHER], CallSyntax.JSON))
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    x = np.zeros(tok.n_vocab, dtype=np.float32)
    for t in tok.encode(text, add_special=False, parse_special=True):
        assert np.isfinite(m.mask(x)[t]), tok.token_bytes(t)
        m.accept(t)
    assert m.done and not m.matcher.is_error()


def _walk(grammars: GrammarFactory, tok, grammar: str, text: str) -> str:
    """`text`'s tokens through a matcher of `grammar`: "refused" at the first token its mask forbids,
    else "done" (complete) or "open"."""
    m, x = grammars.matcher(grammar), np.zeros(tok.n_vocab, dtype=np.float32)
    for t in tok.encode(text, add_special=False, parse_special=True):
        if not np.isfinite(m.mask(x)[t]):
            return "refused"
        m.accept(t)
    return "done" if m.done else "open"


def test_kimi_call_grammars(tiny_model_path):
    """Kimi's call grammar token by token on the kimi-k2 vocabulary: a section with one call of an
    offered tool, `functions.NAME:INDEX` and arguments that follow its schema; a forced call's
    section holds one call, the lazy grammar's (the model chose to call) as many as it writes;
    an unknown name, an index with a leading zero or arguments off the schema are refused."""
    tok = GGUFFile(tiny_model_path("tiny-kimi-linear-k2vocab", "f32")).tokenizer()
    grammars = GrammarFactory(tok, tok.n_vocab, [tok.eos_id])
    lazy, trigger = grammars.lazy_tool_call([WEATHER], CallSyntax.KIMI)
    assert tok.token_bytes(trigger).decode() == "<|tool_calls_section_begin|>"

    def call(i: int, args: str = '{"city": "Paris", "unit": "c"}', name: str = "get_weather") -> str:
        return f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{args}<|tool_call_end|>"

    def walk(grammar: str, text: str) -> str:
        return _walk(grammars, tok, grammar, text)

    forced = grammars.tool_call([WEATHER], CallSyntax.KIMI)
    one = "<|tool_calls_section_begin|>" + call(0) + "<|tool_calls_section_end|>"
    two = "<|tool_calls_section_begin|>" + call(0) + call(1) + "<|tool_calls_section_end|>"
    assert walk(forced, one) == "done" and walk(lazy, one) == "done"
    assert walk(forced, two) == "refused" and walk(lazy, two) == "done"
    assert walk(forced, "<|tool_calls_section_begin|>" + call(12)) == "open"
    for bad in (call(0, name="get_time"), call("01"), call(0, '{"city": "Paris", "unit": "k"}'),
                call(0, '{"city": "Paris"}'), call(0, '{"city":"Paris","unit":"c"}')):
        assert walk(forced, "<|tool_calls_section_begin|>" + bad) == "refused", bad


def test_xml_call_grammar_takes_what_the_template_writes(tiny_model_path):
    """Qwen3.5's XML calls token by token: a string value closed as the template writes it
    (`value\\n</parameter>`, multi-line values too) is accepted (it was refused at `</`: the value's
    lexeme took the newline, and the closing wanted another), a `maxLength` holds, a non-string
    parameter is JSON of its schema (an integer's digits; "ten" refused), an enum is one of its
    values."""
    tok = GGUFFile(tiny_model_path("tiny-qwen35", "f32")).tokenizer()
    grammars = GrammarFactory(tok, tok.n_vocab, [tok.eos_id])
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 8}, "note": {"type": "string"},
                       "days": {"type": "integer", "minimum": 1, "maximum": 9}, "unit": {"enum": ["c", "f"]},
                       "flags": {"type": "array", "items": {"type": "boolean"}}}}}}]
    grammar = grammars.tool_call(tools, CallSyntax.XML)

    def walk(*params: tuple[str, str]) -> str:
        text = "<tool_call>\n<function=f>\n" + "".join(f"<parameter={n}>\n{v}\n</parameter>\n" for n, v in params) \
            + "</function>\n</tool_call>"
        return _walk(grammars, tok, grammar, text)

    assert walk(("city", "Paris")) == "done"
    assert walk(("city", "Paris"), ("note", "line one\nline two"), ("days", "3"), ("unit", "f"),
                ("flags", "[true, false]")) == "done"
    for bad in ([("city", "Paris is big")], [("city", "Rome"), ("days", "ten")], [("city", "Rome"), ("days", "12")],
                [("city", "Rome"), ("unit", "k")], [("note", "no city")]):
        assert walk(*bad) == "refused", bad
