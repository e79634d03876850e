"""Chatting with a Kimi-Linear file: its chat template (Kimi-Linear-48B-A3B-Instruct's, which a
converted file with the kimi-k2 vocabulary carries) rendered as the model was trained on it and as
llama.cpp renders it, and over HTTP the vocabulary's end-of-turn tokens end an answer. (Kimi's
tool-call format is parsed in tests/test_serve_parts.py; its call grammars, the Messages and
Responses APIs and the agent loops run on this model in test_serve_agent_constraints.py and
test_serve_messages.py.)"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from serve_child import start_server, stop_serve

from deltarun.apps.serve.server import ServeHandle, ServeSettings, free_port
from deltarun.base.gguf_file import GGUFFile
from deltarun.base.chat_template import ChatTemplate
from deltarun.runner.model import Model

ROOT = Path(__file__).resolve().parents[1]
LLAMA_SERVER = os.environ.get("DELTARUN_LLAMA_SERVER") or str(ROOT / "build" / "llama-server" / "bin" / "llama-server")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = {"id": "functions.get_weather:0", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "Let me look.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "rain"},
    {"role": "assistant", "content": "It rains."},
    {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "tomorrow?"}]},
]
# What the template writes for CONVERSATION (written out by hand from the template's rules): the
# tools declared as compact JSON in a system turn of their own, each turn `<|im_ROLE|>NAME<|im_middle|>
# ...<|im_end|>` with no newlines, the call with the model's own id in one section, the tool's
# answer in a system turn headed `## Return of ID`, the text parts of a list joined.
RENDERED = (
    '<|im_system|>tool_declare<|im_middle|>[{"type":"function","function":{"name":"get_weather",'
    '"description":"Weather of a city","parameters":{"type":"object","properties":{"city":{"type":"string"}},'
    '"required":["city"]}}}]<|im_end|>'
    "<|im_system|>system<|im_middle|>Be brief.<|im_end|>"
    "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|>Let me look.<|tool_calls_section_begin|><|tool_call_begin|>"
    'functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
    "<|tool_calls_section_end|><|im_end|>"
    "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nrain<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|>It rains.<|im_end|>"
    "<|im_user|>user<|im_middle|>And tomorrow?<|im_end|>"
    "<|im_assistant|>assistant<|im_middle|>"
)
MARKERS = ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>",
           "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
           "<|tool_call_end|>", "<|tool_calls_section_end|>"]


def test_the_kimi_template_renders_a_conversation_as_written(tiny_model_path):
    """The file's template (the converter copies Kimi-Linear-48B-A3B-Instruct's with its kimi-k2
    vocabulary) renders a conversation with tools, a call and its result exactly as the template
    says, and every marker it writes is one special token of the vocabulary."""
    f = GGUFFile(tiny_model_path("tiny-kimi-linear-k2vocab", "f32"))
    template = ChatTemplate(f.get("tokenizer.chat_template"))
    assert template.render(CONVERSATION, add_generation_prompt=True, tools=TOOLS) == RENDERED
    assert template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True) == \
        "<|im_user|>user<|im_middle|>Hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    tok = f.tokenizer()
    ids = tok.encode(RENDERED, add_special=False, parse_special=True)
    for marker in MARKERS:
        (one,) = tok.encode(marker, add_special=False, parse_special=True)
        assert one >= 2304 and ids.count(one) == RENDERED.count(marker), marker     # the specials after the ranks


@pytest.mark.skipif(not Path(LLAMA_SERVER).exists(), reason="no llama-server (python bench/bench_envs.py llama-server)")
def test_llama_server_renders_and_tokenizes_the_kimi_template_alike(tiny_model_path, tmp_path):
    """llama-server (--jinja) on the same file: /apply-template gives deltarun's prompt text for each
    conversation, with and without tools, and /tokenize its token ids."""
    path = tiny_model_path("tiny-kimi-linear-k2vocab", "f32")
    f = GGUFFile(path)
    template, tok = ChatTemplate(f.get("tokenizer.chat_template")), f.tokenizer()
    port = free_port()
    proc = start_server([LLAMA_SERVER, "-m", str(path), "--jinja", "--host", "127.0.0.1", "--port", str(port),
                         "-c", "512", "-t", "1", "-np", "1", "-nr"], tmp_path / "llama-server.log", port)
    try:
        base = f"http://127.0.0.1:{port}"
        for messages in (CONVERSATION, CONVERSATION[1:2], [{"role": "user", "content": "Hi"}]):
            for tools in (None, TOOLS):
                body = {"messages": messages, **({"tools": tools} if tools else {})}
                theirs = httpx.post(base + "/apply-template", json=body, timeout=60).json()["prompt"]
                ours = template.render(messages, add_generation_prompt=True, tools=tools)
                assert theirs == ours
                ids = httpx.post(base + "/tokenize", json={"content": ours, "parse_special": True}, timeout=60)
                assert ids.json()["tokens"] == tok.encode(ours, add_special=False, parse_special=True)
    finally:
        stop_serve(proc)


def test_serve_chat_ends_at_kimis_end_of_turn(tiny_model_path):
    """A chat over HTTP with the kimi-k2 vocabulary: an answer's content comes back, and
    generation stops at Kimi's end-of-turn token `<|im_end|>` (and at `[EOT]`), which is not
    written into the content (llama.cpp's kimi-k2 end-of-generation ids)."""
    path = tiny_model_path("tiny-kimi-linear-k2vocab", "f32")
    with ServeHandle(lambda: Model(path, n_ctx=256, n_seq_max=1, n_ubatch=32, n_threads=1),
                     ServeSettings(parallel=1, prefill_ahead=False)) as h:
        def ask(**kw):
            r = httpx.post(h.base_url + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 5, "temperature": 0, **kw})
            assert r.status_code == 200, r.text
            return r.json()

        r = ask()
        assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 5
        assert isinstance(r["choices"][0]["message"]["content"], str) and r["choices"][0]["message"]["content"]
        for end in ("<|im_end|>", "[EOT]"):
            ids = httpx.post(h.base_url + "/tokenize", json={"content": end}).json()["tokens"]
            assert len(ids) == 1 and ids[0] >= 2304          # one of the 256 special ids after the ranks
            r = ask(logit_bias={str(ids[0]): 100})           # the end-of-turn token first: an empty answer
            assert r["choices"][0]["finish_reason"] == "stop", (end, r)
            assert r["usage"]["completion_tokens"] == 0 and r["choices"][0]["message"]["content"] == ""
