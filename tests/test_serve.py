"""`deltarun serve` over real HTTP on 127.0.0.1, with the official openai client.

The servers run in this process (uvicorn in a thread, the model worker in another), so tests can
also read the model's own counters (`Model.stats.n_eval_tokens`) next to what the API reports.
The model is the tiny random-weights one: texts are gibberish, so the tests check shapes, exact
greedy equalities, token counts and constraint validity rather than meaning.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import jsonschema
import numpy as np
import openai
import pytest
from admission_gate import AdmissionGate

from deltarun.apps.chat import common_prefix_length
from deltarun.apps.serve.server import ServeHandle, ServeSettings, free_port
from deltarun.apps.serve.worker import CAPTURE_SLOTS
from deltarun.base.chat_template import ChatTemplate
from deltarun.base.gguf_file import GGUFFile
from deltarun.runner.model import Model

N_CTX = 1024
RS_SLOTS = 4


def _server(path, parallel: int = 4, capture_slots: int = CAPTURE_SLOTS, **settings) -> ServeHandle:
    """A server on `path` opened as `deltarun serve` opens its model (capture slots included).
    Prefill ahead is off unless asked for: most tests count what each request evaluates, which
    work done ahead between requests would make depend on timing (it has tests of its own)."""
    settings.setdefault("prefill_ahead", False)
    ctx = settings.pop("n_ctx", N_CTX)
    rs = max(RS_SLOTS, settings.get("draft_max", 0) + 1)
    return ServeHandle(lambda: Model(path, n_ctx=ctx, n_seq_max=parallel, n_ubatch=64, rs_slots=rs,
                                       n_threads=1, capture_slots=capture_slots),
                       ServeSettings(parallel=parallel, **settings))


@pytest.fixture(scope="module")
def model_path(tiny_model_path):
    return tiny_model_path("tiny", "f32")


@pytest.fixture(scope="module")
def server(model_path):
    with _server(model_path, parallel=8, chunk=32, checkpoint_every=64) as h:
        yield h


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_tokens(model_path):
    """(messages, **kwargs) -> prompt tokens, rendered as the server renders them."""
    f = GGUFFile(model_path)
    tok = f.tokenizer()
    tmpl = ChatTemplate(f.get("tokenizer.chat_template"))

    def render(messages, enable_thinking=None, gen=True, **kw):
        return tok.encode(tmpl.render(messages, add_generation_prompt=gen, enable_thinking=enable_thinking, **kw),
                          parse_special=True)
    return render


EXTRA = ("ignore_eos", "top_k", "min_p", "repeat_penalty", "chat_template_kwargs")


def _ask(client, messages, **kw):
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0)
    extra = {k: kw.pop(k) for k in EXTRA if k in kw}
    if extra:
        kw["extra_body"] = {**kw.get("extra_body", {}), **extra}
    return client.chat.completions.create(model="tiny", messages=messages, **kw)


def _post(server, path, body, timeout=60, **kw):
    return httpx.post(server.base_url + path, json=body, timeout=timeout, **kw)


def _error(resp, status):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    return err


# --------------------------------------------------------------------------------------------- basics
def test_chat_completion_shape_and_usage(client):
    r = _ask(client, [{"role": "user", "content": "Hello there"}], max_tokens=6)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("length", "stop")
    u = r.usage
    assert u.completion_tokens <= 6 and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.prompt_tokens_details.cached_tokens <= u.prompt_tokens
    t = r.model_extra["timings"]
    assert t["cache_n"] + t["prompt_n"] == u.prompt_tokens and t["predicted_n"] == u.completion_tokens


def test_stream_matches_non_stream_and_ends_with_usage(client):
    msgs = [{"role": "user", "content": "Tell me a story about streams"}]
    whole = _ask(client, msgs, max_tokens=10)
    chunks = list(_ask(client, msgs, max_tokens=10, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == whole.choices[0].finish_reason
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    # the same prompt again is served from the prompt-end checkpoint: nothing evaluated
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == chunks[-1].usage.prompt_tokens


def test_immediate_end_of_generation(client, server):
    """logit_bias forces <|im_end|> first: an empty answer, still with the role chunk first."""
    eos = _post(server, "/tokenize", {"content": "<|im_end|>"}).json()["tokens"]
    assert len(eos) == 1
    bias = {str(eos[0]): 100}
    r = _ask(client, [{"role": "user", "content": "say nothing"}], logit_bias=bias)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == ""
    assert r.usage.completion_tokens == 0
    chunks = list(_ask(client, [{"role": "user", "content": "say nothing"}], logit_bias=bias, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[-1].choices[0].finish_reason == "stop"


def test_raw_sse_framing(server):
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", timeout=60,
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines)
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last["choices"][0]["finish_reason"] in ("length", "stop") and "timings" in last


def test_models_health_props_tokenize(server, client):
    models = client.models.list()
    assert models.data[0].object == "model"
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}
    props = httpx.get(server.base_url + "/props").json()
    assert props["total_slots"] == 8 and props["default_generation_settings"]["n_ctx"] == N_CTX
    assert props["modalities"]["vision"] is False and "im_start" in props["chat_template"]
    toks = _post(server, "/tokenize", {"content": "Hello world", "with_pieces": True}).json()["tokens"]
    assert "".join(t["piece"] for t in toks) == "Hello world"
    ids = _post(server, "/tokenize", {"content": "Hello world"}).json()["tokens"]
    assert ids == [t["id"] for t in toks]
    assert _post(server, "/detokenize", {"tokens": ids}).json() == {"content": "Hello world"}


def test_metrics(server, client):
    _ask(client, [{"role": "user", "content": "count me"}], max_tokens=3)
    text = httpx.get(server.base_url + "/metrics").text
    for name in ("deltarun_prompt_tokens_total", "deltarun_tokens_predicted_total", "deltarun_prompt_tokens_cached_total",
                 "deltarun_requests_processing", "deltarun_requests_deferred", "deltarun_predicted_tokens_seconds"):
        assert name in text
    generated = [ln for ln in text.splitlines() if ln.startswith("deltarun_tokens_predicted_total")]
    assert float(generated[0].split()[1]) >= 3


def test_completions(client, server):
    r = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2)
    assert r.object == "text_completion" and r.usage.completion_tokens <= 5
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.completion_tokens and all(len(t) <= 2 for t in lp.top_logprobs)
    echo = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0, echo=True)
    assert echo.choices[0].text == "Once upon a time" + r.choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0, stream=True) if c.choices)
    assert streamed == r.choices[0].text


def _log_softmax(rows: np.ndarray) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.float64)
    rows = rows - rows.max(axis=-1, keepdims=True)
    return rows - np.log(np.exp(rows).sum(axis=-1, keepdims=True))


def test_completions_echo_with_logprobs_scores_the_prompt(client, model_path):
    """/v1/completions with echo and logprobs returns the prompt's tokens with their logprobs, the
    first None (OpenAI's legacy shape, what lm-evaluation-harness scores continuations with;
    max_tokens 0 gives the prompt alone). Each equals a fresh evaluation's log-softmax of the row
    before it; the prompt is evaluated whole even when the cache holds it."""
    ref = Model(model_path, n_ctx=N_CTX, n_threads=1)
    ids = ref.tokenizer.encode("Once upon a time there was a little model that read its own prompt")
    n, k = len(ids), 3
    rows = _log_softmax(ref.eval(ids, all_logits=True))
    client.completions.create(model="tiny", prompt=ids, max_tokens=2, temperature=0)   # now cached

    r = client.completions.create(model="tiny", prompt=ids, max_tokens=0, echo=True, logprobs=k, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 0
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert lp.tokens == [ref.tokenizer.token_bytes(t).decode("utf-8", errors="replace") for t in ids]
    assert r.choices[0].text == ref.tokenizer.decode(ids) == "".join(lp.tokens)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    np.testing.assert_allclose(lp.token_logprobs[1:], rows[np.arange(n - 1), ids[1:]], atol=1e-4)
    for i in range(1, n):
        best = np.argsort(-rows[i - 1])[:k]
        want = {ref.tokenizer.token_bytes(int(t)).decode("utf-8", errors="replace"): rows[i - 1, t] for t in best}
        assert lp.top_logprobs[i].keys() == want.keys()
        np.testing.assert_allclose([lp.top_logprobs[i][t] for t in want], list(want.values()), atol=1e-4)
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(n)]
    # lm-evaluation-harness calls a continuation greedy where each token's logprob equals the largest
    # of its alternatives: exactly, where the token is the row's argmax (the last one here)
    g = client.completions.create(model="tiny", prompt=ids + [int(np.argmax(rows[-1]))], max_tokens=0, echo=True,
                                  logprobs=1, temperature=0).choices[0].logprobs
    for i in range(1, n + 1):
        top1 = max(g.top_logprobs[i], key=g.top_logprobs[i].get)
        assert (g.token_logprobs[i] == max(g.top_logprobs[i].values())) == (top1 == g.tokens[i])
    assert g.token_logprobs[n] == max(g.top_logprobs[n].values())

    # with a generated token: the prompt's entries, then the token's (a plain request's logprob)
    one = client.completions.create(model="tiny", prompt=ids, max_tokens=1, echo=True, logprobs=k, temperature=0)
    plain = client.completions.create(model="tiny", prompt=ids, max_tokens=1, logprobs=k, temperature=0)
    lp1 = one.choices[0].logprobs
    assert lp1.tokens[:n] == lp.tokens and lp1.tokens[n:] == plain.choices[0].logprobs.tokens
    np.testing.assert_allclose(lp1.token_logprobs[1:], lp.token_logprobs[1:] + plain.choices[0].logprobs.token_logprobs,
                               atol=1e-5)
    assert lp1.text_offset[n] == len(r.choices[0].text) and one.choices[0].text == r.choices[0].text + plain.choices[0].text

    # streamed: the echo arrives with the prompt's logprobs, then the tokens, offsets running on
    chunks = [c.choices[0] for c in client.completions.create(model="tiny", prompt=ids, max_tokens=3, echo=True,
                                                              logprobs=k, temperature=0, stream=True) if c.choices]
    whole = client.completions.create(model="tiny", prompt=ids, max_tokens=3, echo=True, logprobs=k, temperature=0)
    got = [c.logprobs for c in chunks if c.logprobs is not None]
    assert "".join(c.text for c in chunks) == whole.choices[0].text
    assert sum((g.tokens for g in got), []) == whole.choices[0].logprobs.tokens
    assert sum((g.text_offset for g in got), []) == whole.choices[0].logprobs.text_offset
    np.testing.assert_allclose([x for g in got for x in g.token_logprobs[1 if g is got[0] else 0:]],
                               whole.choices[0].logprobs.token_logprobs[1:], atol=1e-6)


def test_max_tokens_zero_only_where_the_prompt_alone_is_an_answer(client):
    with pytest.raises(openai.BadRequestError):
        _ask(client, [{"role": "user", "content": "hi"}], max_tokens=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", max_tokens=-1)
    for _ in range(2):                 # evaluated, then cached whole
        r = client.completions.create(model="tiny", prompt="The prompt alone, twice", max_tokens=0)
        assert r.choices[0].text == "" and r.usage.completion_tokens == 0 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens


# --------------------------------------------------------------------------------------------- sampling
def test_stop_string(client):
    msgs = [{"role": "user", "content": "Say something long"}]
    full = _ask(client, msgs, max_tokens=24).choices[0].message.content
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), full
    r = _ask(client, msgs, max_tokens=24, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[:full.index(stop)]


def test_logprobs(client):
    r = _ask(client, [{"role": "user", "content": "probabilities"}], max_tokens=4, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].token == e.token      # greedy: the chosen token is the most likely
        assert abs(e.top_logprobs[0].logprob - e.logprob) < 1e-6


def test_seed_and_penalties(client):
    msgs = [{"role": "user", "content": "random please"}]
    a = _ask(client, msgs, max_tokens=12, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    b = _ask(client, msgs, max_tokens=12, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=42)
    assert a.choices[0].message.content == b.choices[0].message.content
    plain = _ask(client, msgs, max_tokens=16, ignore_eos=True)
    pen = _ask(client, msgs, max_tokens=16, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0)
    assert pen.usage.completion_tokens == 16 == plain.usage.completion_tokens
    ids = lambda r: [e.token for e in r.choices[0].logprobs.content]  # noqa: E731
    plain_lp = _ask(client, msgs, max_tokens=16, ignore_eos=True, logprobs=True)
    pen_lp = _ask(client, msgs, max_tokens=16, ignore_eos=True, logprobs=True, frequency_penalty=2.0,
                  presence_penalty=2.0)
    assert len(set(ids(pen_lp))) >= len(set(ids(plain_lp)))


def test_presence_and_frequency_penalties_by_openais_formula(client, model_path):
    """OpenAI: logit[j] -= count[j] * frequency_penalty + (count[j] > 0) * presence_penalty, count[j]
    how often j was sampled so far (the prompt's tokens do not count). logit_bias puts "a", "b",
    "c" far ahead of the rest so the penalties decide among them; the greedy answer is worked out
    here in numpy from the model's raw logits, and differs from what no penalty, the two penalties
    swapped or a count that includes the prompt would give."""
    with Model(model_path, n_ctx=N_CTX, n_ubatch=64, n_threads=1) as m:
        a, b, c = (m.tokenizer.token_id(ch) for ch in "abc")
        prompt = m.tokenizer.encode("Once upon a time a cat") + [a]
        bias = {a: 100.0, b: 99.0, c: 98.0}

        def greedy(penalty, counts) -> list[int]:
            m.reset()
            logits, out, counts = m.eval(prompt), [], dict(counts)
            for _ in range(12):
                x = logits.astype(np.float64)
                for t, v in bias.items():
                    x[t] += v
                for t, n in counts.items():
                    x[t] -= penalty(n)
                top2 = np.sort(x)[-2:]
                assert top2[1] - top2[0] > 0.05           # no near-tie: the server's logits may differ slightly
                out.append(int(np.argmax(x)))
                counts[out[-1]] = counts.get(out[-1], 0) + 1
                logits = m.eval(out[-1:])
            return out

        want = greedy(lambda n: n * 0.5 + (n > 0) * 1.5, {})
        for other in (greedy(lambda n: 0.0, {}), greedy(lambda n: n * 1.5 + (n > 0) * 0.5, {}),
                      greedy(lambda n: n * 0.5 + (n > 0) * 1.5, {a: 1})):
            assert other != want
        text = m.tokenizer.decode(want)
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, presence_penalty=1.5,
                                  frequency_penalty=0.5, logit_bias={str(t): v for t, v in bias.items()})
    assert r.usage.completion_tokens == 12 and r.choices[0].text == text


# --------------------------------------------------------------------------------------------- errors
def test_errors_bad_requests(server):
    url = "/v1/chat/completions"
    bad = httpx.post(server.base_url + url, content=b"{not json", headers={"content-type": "application/json"})
    assert _error(bad, 400)["code"] == "invalid_json"
    assert _error(_post(server, url, {"messages": []}), 400)["param"] == "messages"
    assert _error(_post(server, url, {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
                  400)["param"] == "temperature"
    assert _error(_post(server, url, {"messages": [{"role": "user", "content": "x"}], "n": 17}), 400)["param"] == "n"
    assert _error(_post(server, url, {"messages": [{"role": "wizard", "content": "x"}]}), 400)["param"] == \
        "messages[0].role"
    img = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this"},
                                                       {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}
    err = _error(_post(server, url, img), 400)     # an image, and this server has no vision tower (--mmproj)
    assert err["param"] == "messages[0].content[1]" and "no vision tower" in err["message"]
    err = _error(_post(server, url, {"messages": [{"role": "user", "content": "x"}],
                                     "response_format": {"type": "xml"}}), 400)
    assert err["param"] == "response_format.type"
    assert _error(_post(server, "/v1/completions", {"prompt": [999999]}), 400)["param"] == "prompt"
    assert _error(httpx.get(server.base_url + "/v1/nothing"), 404)["type"] == "not_found_error"


def test_error_prompt_over_context(server, client):
    long = "word " * (N_CTX + 100)
    with pytest.raises(openai.BadRequestError) as e:
        _ask(client, [{"role": "user", "content": long}])
    err = e.value.body
    assert err["code"] == "context_length_exceeded" and err["n_ctx"] == N_CTX and err["n_prompt_tokens"] > N_CTX
    assert str(N_CTX) in err["message"] and str(err["n_prompt_tokens"]) in err["message"]


def test_error_body_too_large(model_path):
    with _server(model_path, parallel=1, max_body_mib=1) as h:
        big = {"messages": [{"role": "user", "content": "x" * (2 << 20)}]}
        assert _error(_post(h, "/v1/chat/completions", big), 413)["code"] == "body_too_large"


def test_error_api_key(model_path):
    with _server(model_path, parallel=1, api_key="sekret") as h:
        assert httpx.get(h.base_url + "/health").status_code == 200      # health stays public
        assert _error(httpx.get(h.base_url + "/v1/models"), 401)["type"] == "authentication_error"
        wrong = openai.OpenAI(base_url=h.base_url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            _ask(wrong, [{"role": "user", "content": "hi"}])
        right = openai.OpenAI(base_url=h.base_url + "/v1", api_key="sekret", max_retries=0)
        assert _ask(right, [{"role": "user", "content": "hi"}], max_tokens=2).usage.completion_tokens <= 2


def test_error_queue_full(model_path):
    with _server(model_path, parallel=1, max_queue=1, n_ctx=8192) as h:
        c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        long = dict(max_tokens=8000, ignore_eos=True, stream=True)      # still running when the others come
        first = _ask(c, [{"role": "user", "content": "one"}], **long)
        next(iter(first))                                      # running: the slot is taken
        second = _ask(c, [{"role": "user", "content": "two"}], **long)   # waits in the queue
        deadline = time.monotonic() + 30
        while h.worker.counts != (1, 1) and time.monotonic() < deadline:
            time.sleep(0.02)
        resp = _post(h, "/v1/chat/completions", {"messages": [{"role": "user", "content": "three"}]})
        err = _error(resp, 503)
        assert err["code"] == "queue_full" and resp.headers["retry-after"] == "1"
        with pytest.raises(openai.InternalServerError):
            _ask(c, [{"role": "user", "content": "four"}])
        first.close()
        second.close()


# --------------------------------------------------------------------------------------------- parallel
def test_the_worker_is_not_idle_while_the_step_that_ended_an_answer_goes_on(model_path, monkeypatch):
    """A job leaves the running ones before its step is done: the step still writes for it (an
    answer's deferred MTP rows, the prompt cache's record of it, the copy to host RAM ahead), and
    the client may have its answer by then (an earlier wake of the event loop delivers the answer
    as soon as it is emitted). `Worker.idle`, which `wait_settled` and the tests that read the
    model's memory after it rely on, must stay false until that step has ended."""
    from deltarun.apps.serve.prompt_cache import PromptCache
    seen: list[bool] = []
    finished = PromptCache.finished

    def finished_seen(self, seq: int, answer_start: int) -> None:
        seen.append(h.worker.idle)
        finished(self, seq, answer_start)

    monkeypatch.setattr(PromptCache, "finished", finished_seen)
    with _server(model_path, parallel=1) as h:
        openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=60).completions.create(
            model="tiny", prompt="one two", max_tokens=2, temperature=0)
        h.wait_settled()
    assert seen == [False]


def test_greedy_same_alone_and_among_others(model_path):
    prompts = [f"Request number {i} says {'hello ' * i}" for i in range(8)]
    with _server(model_path, parallel=8, chunk=16) as h:
        c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=300)
        kw = dict(max_tokens=12, ignore_eos=True)
        alone = [_ask(c, [{"role": "user", "content": p}], **kw).choices[0].message.content for p in prompts]
        h.wait_settled()             # (every seq taken: the worker copies one to host RAM while idle)
        h.worker.model.reset()
        for info in h.worker.cache.seqs:
            info.checkpoints.clear()
        h.worker.cache.host.clear()
        calls_before = h.worker.model.stats.n_eval_calls
        with AdmissionGate(h.worker, 8) as gate, cf.ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(lambda p: _ask(c, [{"role": "user", "content": p}], **kw).choices[0].message.content,
                                   p) for p in prompts]
            gate.release()
            together = [f.result() for f in futures]
        n_calls = h.worker.model.stats.n_eval_calls - calls_before
    assert together == alone
    # 8 x 12 tokens: decoding shares ubatches (one per step when the seqs are consecutive)
    assert n_calls < 8 * 12


def test_eight_concurrent_streams(client, server):
    def run(i):
        stream = _ask(client, [{"role": "user", "content": f"stream {i}"}], max_tokens=16, ignore_eos=True,
                      stream=True, stream_options={"include_usage": True})
        chunks = list(stream)
        return chunks[-1].usage.completion_tokens, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, range(8)))
    assert [n for n, _ in results] == [16] * 8
    for i, (_, text) in enumerate(results):
        alone = _ask(client, [{"role": "user", "content": f"stream {i}"}], max_tokens=16, ignore_eos=True)
        assert alone.choices[0].message.content == text


def test_running_sequences_stay_in_one_ubatch(model_path):
    """A stream that ends in the middle leaves a hole; the last one moves into it and the rest
    keep decoding in one ubatch, with the same greedy tokens as alone."""
    with _server(model_path, parallel=3) as h:
        c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        kw = dict(max_tokens=300, ignore_eos=True, stream=True)
        streams = []
        for i in range(3):
            streams.append(_ask(c, [{"role": "user", "content": f"stream {i} here"}], **kw))
            next(iter(streams[-1]))
        h.worker.trace = trace = []
        streams[1].close()                                  # the middle one goes away
        texts = {i: "".join(ch.choices[0].delta.content or "" for ch in streams[i] if ch.choices) for i in (0, 2)}
        h.worker.trace = None
        alone = {i: _ask(c, [{"role": "user", "content": f"stream {i} here"}], max_tokens=300,
                         ignore_eos=True) for i in (0, 2)}
    moves = [t for t in trace if t[0] == "move"]
    assert moves, trace
    after = trace[trace.index(moves[0]) + 1:]
    decodes = [t[1] for t in after if t[0] == "batch"]
    sizes = [len(ids) for ids in decodes]
    assert sizes[0] == 2 and sizes == sorted(sizes, reverse=True)   # together in one ubatch until one ends
    for i in (0, 2):
        assert texts[i] and texts[i] in alone[i].choices[0].message.content


def test_ngram_drafts_keep_greedy_output(tiny_model_path):
    """--draft ngram on a model that repeats its input: drafts get accepted, the text is unchanged."""
    echo = tiny_model_path("tiny-echo", "f32")
    msgs = [{"role": "user", "content": "one two three four five six seven eight one two three four five"}]
    with _server(echo, parallel=2) as plain:
        c = openai.OpenAI(base_url=plain.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        want = _ask(c, msgs, max_tokens=40)
    with _server(echo, parallel=2, draft="ngram", draft_max=3) as h:
        c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        h.worker.trace = trace = []
        got = _ask(c, msgs, max_tokens=40)
        h.worker.trace = None
        sampled = _ask(c, msgs, max_tokens=30, temperature=0.8, seed=9)     # sampled drafts: min(1, p/q)
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage.completion_tokens == want.usage.completion_tokens
    verify = [t for t in trace if t[0] == "verify"]
    assert verify and sum(t[3] for t in verify) > 0          # some drafts were accepted
    assert len(verify) < got.usage.completion_tokens          # fewer target steps than tokens
    assert 0 < sampled.usage.completion_tokens <= 30


def test_disconnect_frees_the_slot(model_path):
    LONG = 8192      # more tokens than a disconnect takes to notice, on any machine
    with _server(model_path, parallel=1, n_ctx=LONG) as h:
        c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
        stream = _ask(c, [{"role": "user", "content": "go on forever"}], max_tokens=LONG - 100, ignore_eos=True, stream=True)
        it = iter(stream)
        next(it), next(it)
        stream.close()
        deadline = time.monotonic() + 20
        while h.worker.counts[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert h.worker.counts == (0, 0)
        generated = h.worker.model.n_past(0)
        assert generated < LONG - 100          # cancelled before its tokens were all generated
        assert _ask(c, [{"role": "user", "content": "next"}], max_tokens=2).usage.completion_tokens <= 2
        # a non-streaming client that gives up is noticed too (the handler polls the connection)
        with pytest.raises(httpx.ReadTimeout):
            _post(h, "/v1/chat/completions", {"messages": [{"role": "user", "content": "wait for me"}],
                                              "max_tokens": LONG - 100, "ignore_eos": True}, timeout=1.5)
        deadline = time.monotonic() + 20
        while h.worker.counts[0] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert h.worker.counts == (0, 0) and h.worker.model.n_past(0) < LONG - 100


def test_sigterm_ends_streams_cleanly(model_path, tmp_path):
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "deltarun", "serve", str(model_path), "--port", str(port),
                             "--parallel", "2", "--ctx", "8192", "--threads", "1"], stderr=subprocess.PIPE, env=env)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail("server did not come up")
        lines = []
        with httpx.stream("POST", base + "/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8000, "ignore_eos": True,
                "stream": True}) as r:
            for ln in r.iter_lines():
                if ln:
                    lines.append(ln)
                if len(lines) == 3:
                    proc.send_signal(signal.SIGTERM)
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "stop"
        assert proc.wait(30) in (0, -signal.SIGTERM)   # uvicorn re-raises the signal once it has shut down
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_long_prompt_prefills_in_chunks_between_decode_steps(model_path):
    """While a long prompt is evaluated, a running stream gets a token after every chunk; each
    chunk, the last one with the prompt's logits too, rides along the stream's decode step (one
    graph, `Worker._ride`), and the answer is the one the prompt gets alone."""
    with _server(model_path, parallel=2, chunk=32, checkpoint_every=0) as h:
        c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        alone = _ask(c, [{"role": "user", "content": "long " * 400}], max_tokens=4, temperature=0)
    with _server(model_path, parallel=2, chunk=32, checkpoint_every=0) as h:
        c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        stream = iter(_ask(c, [{"role": "user", "content": "keep going"}], max_tokens=900, ignore_eos=True,
                           stream=True))
        next(stream), next(stream)
        h.worker.trace = trace = []
        before = _metric_value(h, "deltarun_prompt_tokens_ridden_total")
        long = _ask(c, [{"role": "user", "content": "long " * 400}], max_tokens=4, temperature=0)
        ridden = _metric_value(h, "deltarun_prompt_tokens_ridden_total") - before
        h.worker.trace = None
        stream.close()
    assert long.choices[0].message.content == alone.choices[0].message.content
    steps = [t for t in trace if t[0] == "prefill"]
    assert sum(n for _, _, n in steps) == long.usage.prompt_tokens and all(n <= 32 for _, _, n in steps)
    assert ridden == long.usage.prompt_tokens
    first = trace.index(steps[0])
    last = trace.index(steps[-1])
    between = trace[first:last + 1]
    # prefill, decode, prefill, decode, ...: the other stream never waits for more than one chunk
    assert all(a[0] != b[0] for a, b in zip(between, between[1:]))


def test_a_riding_prompt_captures_its_checkpoints_without_ending_chunks_there(model_path):
    """A conversation's prompt riding along another stream's steps is checkpointed at its message
    boundaries by the steps' graphs (`PromptChunk.captures`), not by chunks that end at each: fewer
    chunks than boundaries, the same checkpoints (positions and states) and answer as the prompt
    evaluated alone, and its next turn resumes from them."""
    convo = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "one two three"},
             {"role": "assistant", "content": "four five"}, {"role": "user", "content": "six seven"}]
    results = {}
    for mode in ("alone", "riding"):
        with _server(model_path, parallel=2, chunk=256, checkpoint_every=0) as h:
            c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
            stream = None
            if mode == "riding":
                stream = iter(_ask(c, [{"role": "user", "content": "keep going"}], max_tokens=900, ignore_eos=True,
                                   stream=True))
                next(stream), next(stream)
            h.worker.trace = trace = []
            answer = _ask(c, convo, max_tokens=4, temperature=0)
            h.worker.trace = None
            seq = 1 if mode == "riding" else next(s for s, info in enumerate(h.worker.cache.seqs) if info.checkpoints)
            checkpoints = dict(h.worker.cache.seqs[seq].checkpoints)
            again = _ask(c, convo + [{"role": "assistant", "content": answer.choices[0].message.content},
                                     {"role": "user", "content": "eight"}], max_tokens=2, temperature=0)
            if stream is not None:
                stream.close()
        steps = [n for kind, _, n in trace if kind == "prefill"]
        results[mode] = (answer.choices[0].message.content, checkpoints, steps, again.usage)
    text, checkpoints, steps, usage = results["riding"]
    assert text == results["alone"][0]
    ends = set(np.cumsum(steps).tolist())                     # where each riding chunk ended
    inside = [p for p in checkpoints if p < sum(steps)]
    assert len(inside) >= 3 and not ends >= set(inside)       # chunks ended at each checkpoint before
    assert sorted(checkpoints) == sorted(results["alone"][1])
    for pos, cp in checkpoints.items():
        other = results["alone"][1][pos].state
        for il in cp.state.ssm:
            a, b = (np.frombuffer(np.ascontiguousarray(x).tobytes(), dtype=np.float32)
                    for x in (cp.state.ssm[il], other.ssm[il]))
            assert np.abs(a - b).max() <= 1e-6 * np.abs(b).max()
    assert usage.prompt_tokens_details.cached_tokens >= max(inside)


def _metric_value(h: ServeHandle, name: str) -> float:
    text = httpx.get(h.base_url + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


def test_cli_bad_model_is_one_line_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    proc = subprocess.run([sys.executable, "-m", "deltarun", "serve", str(bad), "--port", "0"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ")


def test_cli_port_in_use_is_one_line_error(model_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "deltarun", "serve", str(model_path), "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and proc.stderr.strip() == f"error: cannot listen on 127.0.0.1:{port}: Address already in use"


@pytest.mark.parametrize("flag, expected", [([], True), (["--no-prefill-ahead"], False)])
def test_cli_prefill_ahead_option(model_path, monkeypatch, flag, expected):
    from click.testing import CliRunner

    import deltarun.apps.serve.server as server
    from deltarun.cli.main import cli

    seen = []
    monkeypatch.setattr(server, "serve_forever", lambda load, settings, *a, **kw: seen.append(settings))
    result = CliRunner().invoke(cli, ["serve", str(model_path), "--port", "0", *flag])
    assert result.exit_code == 0, result.output
    assert seen[0].prefill_ahead is expected


def test_warm_up_before_the_first_request(model_path):
    """Started servers have evaluated two tokens in a seq they then cleared, compiled the chat
    template and loaded anyio's asyncio backend: one-time costs the first request would pay."""
    with _server(model_path, parallel=2) as h:
        m = h.worker.model
        assert (m.stats.n_eval_calls, m.stats.n_eval_tokens) == (1, 2)
        assert m.n_past(0) == m.n_past(1) == 0 and not h.worker.cache.seqs[0].checkpoints
        assert h.state._builder is not None and "anyio._backends._asyncio" in sys.modules


def test_health_is_503_while_loading(model_path):
    import threading

    gate = threading.Event()

    def slow_open():
        gate.wait(60)
        return Model(model_path, n_ctx=256, n_threads=1)

    h = ServeHandle(slow_open, ServeSettings(parallel=1))
    h.worker.start()
    h._thread.start()
    try:
        deadline = time.monotonic() + 30
        while not h.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        r = httpx.get(h.base_url + "/health")
        assert r.status_code == 503 and r.json()["error"]["message"] == "Loading model"
        assert _error(_post(h, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}), 503)
        gate.set()
        assert h.worker.ready.wait(60)
        assert httpx.get(h.base_url + "/health").json() == {"status": "ok"}
    finally:
        gate.set()
        h.stop()


# --------------------------------------------------------------------------------------------- prompt cache
@pytest.mark.parametrize("capture_slots", [CAPTURE_SLOTS, 0])
def test_multi_turn_evaluates_only_new_tokens(model_path, chat_tokens, capture_slots):
    """Qwen3 template, thinking off: each turn re-renders the previous answer without the empty
    think block, so the new prompt differs from what the seq holds right after `assistant\\n`.
    The server resumes from the checkpoint taken there and evaluates only the new tokens. With
    capture slots (as `serve` opens its model) the checkpoints inside a prompt chunk (the new
    message's start, the answer's start) are taken by the chunk's own graph evaluation; without,
    the chunk ends at each of them."""
    with _server(model_path, parallel=2, chunk=32, checkpoint_every=0, capture_slots=capture_slots) as h:
        c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        model = h.worker.model
        msgs = [{"role": "system", "content": "You are a terse assistant."}]
        held: list[int] = []
        kwargs = {"enable_thinking": False}
        for turn in range(4):
            msgs.append({"role": "user", "content": f"Question {turn}: what about {'this ' * (turn + 3)}?"})
            prompt = chat_tokens(msgs, **kwargs)
            new = len(prompt) - common_prefix_length(held, prompt)
            before, calls = model.stats.n_eval_tokens, model.stats.n_eval_calls
            r = _ask(c, msgs, max_tokens=12, extra_body={"chat_template_kwargs": kwargs})
            evaluated = r.model_extra["timings"]["prompt_n"]
            decoded = model.stats.n_eval_tokens - before - evaluated      # one token per decode step
            prompt_calls = model.stats.n_eval_calls - calls - decoded
            if capture_slots:
                assert prompt_calls == -(-evaluated // 32)                # chunks of 32, none cut short
            elif turn:
                assert prompt_calls > -(-evaluated // 32)                 # cut at the checkpoints
            assert r.usage.prompt_tokens == len(prompt)
            assert r.usage.prompt_tokens_details.cached_tokens == len(prompt) - evaluated
            # the model evaluated the new prompt tokens and the answer's tokens but the last
            assert model.stats.n_eval_tokens - before == evaluated + r.usage.completion_tokens - 1 \
                or r.choices[0].finish_reason == "stop"
            if turn:
                assert evaluated <= new + RS_SLOTS
                assert evaluated == new
            # what the seqs hold now: the prompt and the answer (the next turn renders the answer differently)
            held = max((model.tokens(i) for i in range(2)), key=lambda t: common_prefix_length(t, prompt))
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})


@pytest.mark.parametrize("capture_slots", [CAPTURE_SLOTS, 0])
def test_branching_regenerate_and_edit(model_path, chat_tokens, capture_slots):
    with _server(model_path, parallel=1, chunk=32, checkpoint_every=0, capture_slots=capture_slots) as h:
        c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        msgs = [{"role": "system", "content": "Be helpful."}, {"role": "user", "content": "First question here"},
                {"role": "assistant", "content": "First answer"}, {"role": "user", "content": "Second question"}]
        first = _ask(c, msgs, max_tokens=6)
        again = _ask(c, msgs, max_tokens=6)                   # regenerate: everything cached, same greedy answer
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
        assert again.choices[0].message.content == first.choices[0].message.content
        edited = [dict(m) for m in msgs]
        edited[1]["content"] = "First question, edited"
        r = _ask(c, edited, max_tokens=6)
        # resumed from the checkpoint where the edited message's content starts
        assert r.usage.prompt_tokens_details.cached_tokens == _content_start(chat_tokens, msgs[:1], chat_tokens(edited))
        assert r.usage.prompt_tokens == len(chat_tokens(edited))
        # the old branch went to host RAM: asking it again resumes from there
        back = _ask(c, msgs, max_tokens=6)
        assert back.usage.prompt_tokens_details.cached_tokens == back.usage.prompt_tokens
        assert back.choices[0].message.content == first.choices[0].message.content
        # editing the second user message keeps the earlier answer: the checkpoint at that message's
        # start is found with the answer rendered as an earlier one (no think block), as in the prompt
        edited2 = [dict(m) for m in msgs]
        edited2[3]["content"] = "Second question, edited"
        r2 = _ask(c, edited2, max_tokens=6)
        assert r2.usage.prompt_tokens_details.cached_tokens == _content_start(chat_tokens, msgs[:3], chat_tokens(edited2))


def _content_start(chat_tokens, before: list[dict], prompt: list[int]) -> int:
    """Prompt tokens before the content of the user message that follows `before`."""
    return common_prefix_length(chat_tokens(before + [{"role": "user", "content": ""}], gen=False), prompt)


def test_a_request_stops_work_ahead_after_its_chunk(model_path, chat_tokens, monkeypatch):
    """The next turn arrives while the worker prefills it ahead (made certain here: the request is
    sent, and queued, during the first chunk of work ahead): the work ahead stops after that chunk
    and the request resumes from the seq's live state there, so it reuses the chunk."""
    kw = {"chat_template_kwargs": {"enable_thinking": False}}
    msgs = [{"role": "user", "content": "Tell me about the weather in spring, briefly."}]
    with _server(model_path, parallel=1, chunk=4, checkpoint_every=0, prefill_ahead=True) as h, \
            cf.ThreadPoolExecutor(1) as ex:
        c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        w = h.worker
        real, sent, answered = w._prefill_chunk, [], threading.Event()

        def chunk(job):
            real(job)
            if job.params.ahead and not sent:     # the client has the first answer (the worker sent it)
                assert answered.wait(30)
                sent.append(ex.submit(_ask, c, msgs + [{"role": "user", "content": "And in autumn?"}],
                                      max_tokens=6, **kw))
                deadline = time.monotonic() + 30
                while not w._waiting and time.monotonic() < deadline:
                    time.sleep(0.001)
        monkeypatch.setattr(w, "_prefill_chunk", chunk)
        first = _ask(c, msgs, max_tokens=12, **kw)
        msgs.append({"role": "assistant", "content": first.choices[0].message.content})
        answered.set()
        deadline = time.monotonic() + 30
        while not sent and time.monotonic() < deadline:
            time.sleep(0.005)
        r = sent[0].result()
        h.wait_settled()
        monkeypatch.undo()
        assert _ahead_total(h) >= 4
    nxt = msgs + [{"role": "user", "content": "And in autumn?"}]
    prompt = chat_tokens(nxt, enable_thinking=False)
    diverge = common_prefix_length(chat_tokens(msgs[:1], enable_thinking=False), prompt)
    assert r.usage.prompt_tokens_details.cached_tokens == diverge + 4
    with _server(model_path, parallel=1, chunk=4, checkpoint_every=0) as h:
        c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        _ask(c, msgs[:1], max_tokens=12, **kw)
        assert _ask(c, nxt, max_tokens=6, **kw).choices[0].message.content == r.choices[0].message.content


def _ahead_total(h: ServeHandle) -> float:
    return h.worker.metrics.ahead_tokens._value.get()


def _conversation(h: ServeHandle, turns: int, settle: bool, tag: str = "") -> list:
    """A multi-turn chat, thinking off, each answer sent back; with `settle` the server finishes its
    work ahead between turns. Returns (prompt_tokens, cached, evaluated, answer, tokens evaluated
    ahead so far) per turn."""
    c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
    msgs = [{"role": "system", "content": "You are a terse assistant."}]
    out = []
    for turn in range(turns):
        msgs.append({"role": "user", "content": f"{tag}Question {turn}: what about {'this ' * (turn + 3)}?"})
        r = _ask(c, msgs, max_tokens=10 + 3 * turn, chat_template_kwargs={"enable_thinking": False})
        msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        if settle:
            h.wait_settled()
        out.append((r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens,
                    r.model_extra["timings"]["prompt_n"], r.choices[0].message.content, _ahead_total(h)))
    return out


def test_prefill_ahead_leaves_each_turn_only_its_new_message(model_path, chat_tokens):
    """With prefill ahead, the server evaluates each answer as the next turn will render it while
    idle, so a turn evaluates only its new message (from where its text starts). Same answers as
    without; the prompt tokens evaluated ahead plus those evaluated per request are exactly what a
    server without prefill ahead evaluates per request. A regeneration of the last answer still
    evaluates nothing (the replaced tail was kept aside), the turn after it again only its new
    message, and an edit of the first message resumes where that message's text starts."""
    with _server(model_path, parallel=2, chunk=32, checkpoint_every=0) as h:
        plain = _conversation(h, 4, settle=False)
    with _server(model_path, parallel=2, chunk=32, checkpoint_every=0, prefill_ahead=True) as h:
        ahead = _conversation(h, 4, settle=True)
        assert [t[3] for t in ahead] == [t[3] for t in plain]
        assert [t[0] for t in ahead] == [t[0] for t in plain]
        # (the work ahead after the last turn is for a turn that does not come)
        assert sum(t[2] for t in ahead) + ahead[-2][4] == sum(t[2] for t in plain)
        assert ahead[-1][4] > ahead[-2][4] > ahead[0][4] > 0
        msgs = [{"role": "system", "content": "You are a terse assistant."}]
        for turn, (n_prompt, cached, evaluated, answer, _) in enumerate(ahead):
            msgs.append({"role": "user", "content": f"Question {turn}: what about {'this ' * (turn + 3)}?"})
            prompt = chat_tokens(msgs, enable_thinking=False)
            assert n_prompt == len(prompt) and cached + evaluated == n_prompt
            if turn:
                assert cached == _content_start(chat_tokens, msgs[:-1], prompt) > plain[turn][1]
            msgs.append({"role": "assistant", "content": answer})

        c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        kw = {"chat_template_kwargs": {"enable_thinking": False}}
        again = _ask(c, msgs[:-1], max_tokens=19, **kw)                 # regenerate the last answer
        assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens
        assert again.choices[0].message.content == msgs[-1]["content"]
        h.wait_settled()
        msgs.append({"role": "user", "content": "And after that?"})
        r = _ask(c, msgs, max_tokens=6, **kw)
        prompt = chat_tokens(msgs, enable_thinking=False)
        assert r.usage.prompt_tokens_details.cached_tokens == _content_start(chat_tokens, msgs[:-1], prompt)
        edited = [dict(m) for m in msgs]
        edited[1]["content"] = "Question 0, edited"
        r = _ask(c, edited, max_tokens=6, **kw)
        assert r.usage.prompt_tokens_details.cached_tokens == _content_start(chat_tokens, msgs[:1],
                                                                             chat_tokens(edited, enable_thinking=False))


def test_prefill_ahead_back_to_back_and_concurrent_conversations_keep_their_answers(model_path):
    """No pause between turns, three conversations at once on two slots (requests come while work
    ahead runs, or before it could start): the answers are those of a server without prefill
    ahead, and every request's cached and evaluated tokens add up to its prompt."""
    def run(prefill_ahead: bool) -> list:
        with _server(model_path, parallel=2, chunk=8, checkpoint_every=0, prefill_ahead=prefill_ahead) as h:
            with cf.ThreadPoolExecutor(3) as ex:
                runs = list(ex.map(lambda k: _conversation(h, 3, settle=False, tag=f"[{k}] "), range(3)))
            answers = [[(t[0], t[3]) for t in conv] for conv in runs]
            return answers, [[t[1] + t[2] == t[0] for t in conv] for conv in runs]

    plain, _ = run(False)
    ahead, consistent = run(True)
    assert ahead == plain and all(all(c) for c in consistent)


def test_more_conversations_than_slots_resume_from_host_ram(model_path):
    with _server(model_path, parallel=1, chunk=32, cache_ram_mib=64) as h:
        c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        convs = [[{"role": "user", "content": f"Conversation {i} starts with {'words ' * (5 + i)}"}] for i in range(3)]
        answers = []
        for m in convs:
            answers.append(_ask(c, m, max_tokens=6))
        for m, a in zip(convs, answers):     # each comes back after the others took the only slot
            r = _ask(c, m, max_tokens=6)
            assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens
            assert r.choices[0].message.content == a.choices[0].message.content
        assert h.worker.cache.n_evictions >= 2
    with _server(model_path, parallel=1, chunk=32, cache_ram_mib=0) as h:   # no host RAM: recomputed
        c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        for m in convs:
            _ask(c, m, max_tokens=6)
        r = _ask(c, convs[0], max_tokens=6)
        assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_idle_server_copies_the_next_conversation_to_push_out_ahead(model_path):
    """Both slots taken and nothing to do: the least recently used conversation is copied to host
    RAM then, and the request that later takes its slot uses that copy (no copy on its way)."""
    with _server(model_path, parallel=2, chunk=32, cache_ram_mib=64) as h:
        c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        convs = [[{"role": "user", "content": f"Conversation {i} starts with {'words ' * (5 + i)}"}] for i in range(3)]
        answers = [_ask(c, convs[0], max_tokens=6)]
        h.wait_settled()
        cache = h.worker.cache
        assert not cache.host                   # a slot is still free: nothing copied
        answers.append(_ask(c, convs[1], max_tokens=6))
        h.wait_settled()
        lru = min(range(2), key=lambda seq: cache.seqs[seq].last_used)
        ahead = cache.seqs[lru].copy
        assert ahead is not None and [e is ahead for e in cache.host] == [True]
        _ask(c, convs[2], max_tokens=6)         # takes the least recently used slot
        h.wait_settled()
        assert any(e is ahead for e in cache.host) and cache.n_evictions == 1
        r = _ask(c, convs[0], max_tokens=6)     # and conversation 0 comes back from that copy
        assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens
        assert r.choices[0].message.content == answers[0].choices[0].message.content


# --------------------------------------------------------------------------------------------- structure
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "admin": {"type": "boolean"},
    "role": {"enum": ["user", "staff", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3}},
    "required": ["name", "admin", "role", "tags"], "additionalProperties": False}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_output_validates(client, temperature):
    r = _ask(client, [{"role": "user", "content": "Give me a person"}], max_tokens=200, temperature=temperature,
             seed=3, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_object_output_parses(client):
    r = _ask(client, [{"role": "user", "content": "JSON please"}], max_tokens=120, temperature=0.7, seed=1,
             response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:            # random weights may write a long object: what there is must be a valid JSON prefix
        assert r.choices[0].message.content.startswith("{")


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 10},
                                                "unit": {"enum": ["c", "f"]}},
                                                "required": ["city", "unit"], "additionalProperties": False}}}


def test_forced_tool_call(client):
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = _ask(client, msgs, max_tokens=100, tools=[WEATHER], tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls"
    call = r.choices[0].message.tool_calls[0]
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(_ask(client, msgs, max_tokens=100, tools=[WEATHER],
                       tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and all(d.index == 0 for d in deltas) and deltas[0].function.name == "get_weather"
    assert json.loads("".join(d.function.arguments for d in deltas)) == json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the call goes back into the conversation, with the tool's answer
    follow = msgs + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    assert _ask(client, follow, max_tokens=4, tools=[WEATHER]).usage.prompt_tokens > r.usage.prompt_tokens


def test_tools_render_into_the_prompt(client):
    plain = _ask(client, [{"role": "user", "content": "hi"}], max_tokens=1)
    with_tools = _ask(client, [{"role": "user", "content": "hi"}], max_tokens=1, tools=[WEATHER])
    none = _ask(client, [{"role": "user", "content": "hi"}], max_tokens=1, tools=[WEATHER], tool_choice="none")
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens == none.usage.prompt_tokens


@pytest.fixture(scope="module")
def qwen35_template_model(tmp_path_factory):
    """The tiny model with a Qwen3.5-style chat template: the generation prompt opens <think>
    unless thinking is off, and tool calls are written in the XML form."""
    from deltarun.model_files import generate as gen

    closing = "        {{- '<think>\\n\\n</think>\\n\\n' }}\n    {%- endif %}"
    source = gen.chat_template()
    assert closing in source
    source = source.replace(closing, closing.replace("{%- endif %}", "{%- else %}\n        {{- '<think>\\n' }}\n"
                                                                      "    {%- endif %}"))
    source += ("{#- tool calls: <tool_call>\\n<function=NAME>\\n<parameter=NAME>\\nVALUE\\n</parameter>\\n"
               "</function>\\n</tool_call> -#}")
    path = tmp_path_factory.mktemp("qwen35-template") / "tiny-qwen35-template.gguf"
    original = gen.chat_template
    gen.chat_template = lambda: source
    try:
        gen.write_model(path, "tiny", "f32")
    finally:
        gen.chat_template = original
    return path


def test_reasoning_content_and_xml_tool_calls(qwen35_template_model):
    with _server(qwen35_template_model, parallel=1) as h:
        c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=120)
        msgs = [{"role": "user", "content": "Think first"}]
        # the prompt opened <think>: with random weights </think> never comes, so all is reasoning
        r = _ask(c, msgs, max_tokens=12, ignore_eos=True)
        assert r.choices[0].message.model_extra["reasoning_content"] and not r.choices[0].message.content
        chunks = list(_ask(c, msgs, max_tokens=12, ignore_eos=True, stream=True))
        streamed = "".join((ch.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                           for ch in chunks if ch.choices)
        assert streamed == r.choices[0].message.model_extra["reasoning_content"]
        off = _ask(c, msgs, max_tokens=12, ignore_eos=True, chat_template_kwargs={"enable_thinking": False})
        assert off.choices[0].message.content and "reasoning_content" not in (off.choices[0].message.model_extra or {})
        forced = _ask(c, [{"role": "user", "content": "Weather?"}], max_tokens=400, tools=[WEATHER],
                      tool_choice="required", chat_template_kwargs={"enable_thinking": False})
        assert forced.choices[0].finish_reason == "tool_calls", forced.choices[0].message
        call = forced.choices[0].message.tool_calls[0]
        args = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and set(args) == {"city", "unit"} and args["unit"] in ("c", "f")
