"""llama-server's own endpoints in `deltarun serve`: `/infill` (the fill-in-the-middle prompt, its
budget, the FIM end-of-generation tokens) and `/completion`, answered in llama-server's format.

The expected prompts are spelled out token by token from llama-server's layout (tools/server,
`format_prompt_infill`); the answers are compared with /v1/completions on those tokens (greedy).
"""

from __future__ import annotations

import json

import httpx
import pytest
from test_serve import _server

from deltarun.apps.serve.infill import FIM_BATCH, FimTokens, infill_prompt
from deltarun.apps.serve.protocol import parse_completion, parse_llama_server_completion
from deltarun.base.gguf_file import GGUFFile

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"
EXTRA = [("util.py", "X = 1\n"), ("other.py", "def sub(a, b):\n    return a - b\n")]


@pytest.fixture(scope="module")
def path(tiny_model_path):
    return tiny_model_path("tiny-qwen35", "f32")


@pytest.fixture(scope="module")
def tok(path):
    return GGUFFile(path).tokenizer()


@pytest.fixture(scope="module")
def server(path):
    with _server(path, parallel=2, chunk=32, checkpoint_every=0, n_ctx=4096) as h:     # extras fit past a batch
        yield h


def _ids(tok, *names):
    return [tok.token_id(n) for n in names]


def _plain(tok, text):
    return tok.encode(text, add_special=False, parse_special=False)


def test_the_repository_level_prompt(tok):
    """[REPO]myproject\\n, each snippet after [SEP]name\\n, [SEP]filename\\n, then [PRE]prefix prompt
    [SUF]suffix [MID]; special-token text in a file stays text, in the prompt it is a token."""
    fim = FimTokens.of(tok)
    rep, sep, pre, suf, mid = _ids(tok, "<|repo_name|>", "<|file_sep|>", "<|fim_prefix|>", "<|fim_suffix|>",
                                   "<|fim_middle|>")
    assert (fim.rep, fim.sep, fim.pre, fim.suf, fim.mid) == (rep, sep, pre, suf, mid)
    got = infill_prompt(tok, fim, PREFIX + "<|im_end|>", SUFFIX, EXTRA, "return<|im_end|>", n_ctx=4096,
                        n_predict=16)
    expected = ([rep] + _plain(tok, "myproject\n")
                + [sep] + _plain(tok, "util.py\n") + _plain(tok, "X = 1\n")
                + [sep] + _plain(tok, "other.py\n") + _plain(tok, "def sub(a, b):\n    return a - b\n")
                + [sep] + _plain(tok, "filename\n")
                + [pre] + _plain(tok, PREFIX + "<|im_end|>") + _plain(tok, "return") + _ids(tok, "<|im_end|>")
                + [suf] + _plain(tok, SUFFIX) + [mid])
    assert got == expected
    assert tok.token_id("<|im_end|>") not in _plain(tok, PREFIX + "<|im_end|>")


def test_the_budget_keeps_the_prefix_end_the_suffix_start_and_the_extras_end(tok):
    """llama-server's split of a batch (3/4 prefix, 1/4 less the prompt and 2 suffix) and what
    the context leaves the extra chunks (less a batch and twice n_predict), cut from their ends."""
    fim = FimTokens.of(tok)
    prefix, suffix = "a = 1\n" * 900, "b = 2\n" * 900
    extra_text = "c = 3\n" * 2000
    p, s, e = _plain(tok, prefix), _plain(tok, suffix), _plain(tok, extra_text)
    assert len(p) > 3 * FIM_BATCH // 4 and len(s) > FIM_BATCH // 4
    prompt = _plain(tok, "x")
    got = infill_prompt(tok, fim, prefix, suffix, [("f.py", extra_text)], "x", n_ctx=4096, n_predict=100)
    extra = [fim.rep] + _plain(tok, "myproject\n") + [fim.sep] + _plain(tok, "f.py\n") + e + [fim.sep] + \
        _plain(tok, "filename\n")
    n_extra = 4096 - FIM_BATCH - 2 * 100
    core = [fim.pre] + p[-(3 * FIM_BATCH // 4):] + prompt + [fim.suf] + s[:FIM_BATCH // 4 - 2 - len(prompt)] + \
        [fim.mid]
    assert got == extra[-n_extra:] + core
    # a context smaller than a batch: the batch is the context, no extras
    small = infill_prompt(tok, fim, prefix, suffix, [("f.py", extra_text)], "", n_ctx=256, n_predict=8)
    assert small == [fim.pre] + p[-192:] + [fim.suf] + s[:64 - 2] + [fim.mid]
    # extras never take the answer's room
    tight = infill_prompt(tok, fim, prefix, suffix, [("f.py", extra_text)], "", n_ctx=FIM_BATCH + 50, n_predict=0)
    assert len(tight) == FIM_BATCH + 50 - 1 and tight[-FIM_BATCH - 1:] == \
        [fim.pre] + p[-(3 * FIM_BATCH // 4):] + [fim.suf] + s[:FIM_BATCH // 4 - 2] + [fim.mid]


def test_infill_answers_what_completions_writes_after_the_prompt(server, tok):
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "prompt": "ret", "n_predict": 10, "temperature": 0,
            "input_extra": [{"filename": n, "text": t} for n, t in EXTRA], "samplers": ["top_k"], "cache_prompt": True}
    prompt = infill_prompt(tok, FimTokens.of(tok), PREFIX, SUFFIX, EXTRA, "ret", n_ctx=server.worker.model.n_ctx,
                           n_predict=10)
    r = httpx.post(server.base_url + "/infill", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    c = httpx.post(server.base_url + "/v1/completions", json={"prompt": prompt, "max_tokens": 10, "temperature": 0},
                   timeout=60).json()
    assert got["content"] == c["choices"][0]["text"] and got["stop"] is True
    assert got["prompt"] == tok.decode(prompt)
    assert got["prompt"].startswith("<|repo_name|>myproject\n<|file_sep|>util.py")
    n = c["usage"]["completion_tokens"]
    assert got["tokens_evaluated"] == len(prompt) and got["tokens_predicted"] == got["timings"]["predicted_n"] == n
    assert got["stop_type"] == {"stop": "eos", "length": "limit"}[c["choices"][0]["finish_reason"]]
    with httpx.stream("POST", server.base_url + "/infill", json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(line[len("data: "):]) for line in s.iter_lines() if line.startswith("data: ")]
    assert all(e["stop"] is False for e in events[:-1]) and events[-1]["stop"] is True
    assert "".join(e["content"] for e in events) == got["content"]
    assert events[-1]["tokens_cached"] == len(prompt)           # the same prompt again: all cached
    r = httpx.post(server.base_url + "/infill", json={**body, "stop": [got["content"][1:3]]}, timeout=60).json()
    assert (r["content"], r["stop_type"], r["stopping_word"]) == (got["content"][:1], "word", got["content"][1:3])


def test_a_fim_separator_ends_the_answer(server, tok):
    """Qwen's <|file_sep|>, <|fim_pad|> and <|repo_name|> end generation (llama.cpp's vocabulary
    makes them end-of-generation tokens): an answer made to write one first is empty, "eos"."""
    for name in ("<|file_sep|>", "<|fim_pad|>", "<|repo_name|>"):
        assert tok.is_eog(tok.token_id(name))
        r = httpx.post(server.base_url + "/infill", timeout=60, json={
            "input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 6, "temperature": 0,
            "logit_bias": {str(tok.token_id(name)): 100}})
        got = r.json()
        assert (got["content"], got["tokens_predicted"], got["stop_type"]) == ("", 0, "eos"), got


@pytest.mark.parametrize("body, needle", [
    ({"input_suffix": ""}, "input_prefix"),
    ({"input_prefix": 3, "input_suffix": ""}, "input_prefix"),
    ({"input_prefix": ""}, "input_suffix"),
    ({"input_prefix": "", "input_suffix": "", "prompt": [1, 2]}, "prompt"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": {"text": "x"}}, "input_extra"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a"}]}, "input_extra[0]"),
    ({"input_prefix": "", "input_suffix": "", "input_extra": [{"text": "x", "filename": 1}]}, "input_extra[0]"),
    ({"input_prefix": "", "input_suffix": "", "n": 2}, "'n'"),
    ({"input_prefix": "", "input_suffix": "", "n_predict": "many"}, "n_predict"),
    ([], "JSON object"),
])
def test_bad_infill_requests_are_400s(server, body, needle):
    r = httpx.post(server.base_url + "/infill", json=body, timeout=60)
    assert r.status_code == 400 and needle in r.json()["error"]["message"], r.text


def test_a_vocabulary_without_fim_tokens_is_a_501(tiny_model_path):
    with _server(tiny_model_path("tiny-kimi-linear-k2vocab", "f32"), parallel=1) as h:
        r = httpx.post(h.base_url + "/infill", json={"input_prefix": "a", "input_suffix": "b"}, timeout=60)
    assert r.status_code == 501 and "fill-in-the-middle" in r.json()["error"]["message"], r.text


def test_completion_in_llama_servers_format(server, tok):
    """/completion answers what /v1/completions writes, in llama-server's record; without
    n_predict it runs to the end of generation or the context (llama-server's -1), where
    /v1/completions stops after OpenAI's 16."""
    body = {"prompt": "Once upon a time", "n_predict": 9, "temperature": 0}
    got = httpx.post(server.base_url + "/completion", json=body, timeout=60).json()
    c = httpx.post(server.base_url + "/v1/completions", json={**body, "max_tokens": 9}, timeout=60).json()
    assert got["content"] == c["choices"][0]["text"] and got["prompt"] == "Once upon a time"
    assert (got["tokens_predicted"], got["tokens_evaluated"]) == (c["usage"]["completion_tokens"],
                                                                  c["usage"]["prompt_tokens"])
    with httpx.stream("POST", server.base_url + "/completion", json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(line[len("data: "):]) for line in s.iter_lines() if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == got["content"] and events[-1]["stop"] is True
    builder = server.state.builder
    n = len(builder.tokenize("Once upon a time"))
    assert builder.completion(parse_llama_server_completion({"prompt": "Once upon a time"})).max_tokens == \
        server.worker.model.n_ctx - n
    assert builder.completion(parse_completion({"prompt": "Once upon a time"})).max_tokens == 16
    r = httpx.post(server.base_url + "/completion", json={"prompt": "a", "n": 2}, timeout=60)
    assert r.status_code == 400 and "'n'" in r.json()["error"]["message"]
