"""Several choices per request (OpenAI's `n`) in `serve`, over real HTTP with the openai client.

Each choice is a job of its own; the later ones wait for choice 0 to read the prompt and start
from a copy of its sequence (`Worker._fork`), so the prompt is evaluated once. Greedy choices
equal the single answer (F32 model and KV cache: exact), with or without MTP drafts, with seqs for
all or for one choice at a time; a seed makes choice i the answer of seed + i; streams carry each
choice's index and one usage chunk at the end; a client that leaves frees every choice's seq.
"""

from __future__ import annotations

import dataclasses
import queue
import time

import httpx
import openai
import pytest

from deltarun.apps.serve.protocol import parse_chat
from deltarun.apps.serve.server import ServeHandle, ServeSettings
from deltarun.apps.serve.worker import Job
from deltarun.runner.model import Model

N_CTX = 512
MSG = [{"role": "user", "content": "one two three four five six seven"}]


def _server(path, parallel: int, draft: str | None = None) -> ServeHandle:
    def open_model():
        return Model(path, n_ctx=N_CTX, n_seq_max=parallel, n_ubatch=64, rs_slots=4, n_threads=1, kv_type="f32",
                     mtp=draft == "mtp")
    return ServeHandle(open_model, ServeSettings(parallel=parallel, draft=draft, draft_max=3, prefill_ahead=False))


def _client(h: ServeHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def _chat(c: openai.OpenAI, messages: list[dict] = MSG, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return c.chat.completions.create(model="tiny", messages=messages, extra_body={"ignore_eos": True}, **kw)


@pytest.fixture(scope="module")
def path(tiny_model_path):
    return tiny_model_path("tiny-mtp")


@pytest.fixture(scope="module")
def single(path):
    """The greedy answer of one choice on a fresh single-sequence server."""
    with _server(path, 1) as h:
        return _chat(_client(h)).choices[0].message.content


@pytest.mark.parametrize("parallel, draft", [(4, None), (4, "mtp"), (1, None)])
def test_greedy_choices_equal_the_single_answer_and_read_the_prompt_once(path, single, parallel, draft):
    with _server(path, parallel, draft) as h:
        r = _chat(_client(h), n=3)
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert [c.message.content for c in r.choices] == [single] * 3
        assert r.usage.completion_tokens == 3 * 12
        # choice 0 done at its first token (max_tokens 1) still hands the others the prompt (a new
        # one: a cached prompt has nothing to wait for)
        one = _chat(_client(h), [{"role": "user", "content": "eight nine ten"}], n=3, max_tokens=1, timeout=30)
        assert [c.message.content for c in one.choices] == [one.choices[0].message.content] * 3
        if parallel > 1:
            assert one.model_extra["timings"]["prompt_n"] == one.usage.prompt_tokens
            # a prompt asked once before: choice 0 resumes from the cache, the others fork from it
            before = [{"role": "user", "content": "asked once before"}]
            first = _chat(_client(h), before).choices[0].message.content
            again = _chat(_client(h), before, n=3)
            assert [c.message.content for c in again.choices] == [first] * 3
            assert again.model_extra["timings"]["prompt_n"] == 0
        prompt_n = r.model_extra["timings"]["prompt_n"]       # prompt tokens evaluated, all choices
        if parallel > 1:
            assert prompt_n == r.usage.prompt_tokens          # once: the other choices forked
        else:
            assert prompt_n >= r.usage.prompt_tokens          # one seq: choice by choice, from the cache


def test_a_seed_makes_choice_i_the_answer_of_seed_plus_i(path):
    with _server(path, 4) as h:
        c = _client(h)
        r = _chat(c, n=3, temperature=1.0, seed=40)
        again = _chat(c, n=3, temperature=1.0, seed=40)
        alone = [_chat(c, temperature=1.0, seed=40 + i).choices[0].message.content for i in range(3)]
        got = [ch.message.content for ch in r.choices]
        assert got == [ch.message.content for ch in again.choices] == alone
        assert len(set(got)) > 1


def test_streamed_choices_carry_their_index_and_one_usage_at_the_end(path, single):
    with _server(path, 4) as h:
        c = _client(h)
        chunks = list(_chat(c, n=2, stream=True, stream_options={"include_usage": True}))
        text, finished = {0: "", 1: ""}, {}
        for ch in chunks[:-1]:
            assert ch.usage is None and len(ch.choices) == 1
            text[ch.choices[0].index] += ch.choices[0].delta.content or ""
            if ch.choices[0].finish_reason is not None:
                finished[ch.choices[0].index] = ch.choices[0].finish_reason
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
        assert text == {0: single, 1: single} and finished == {0: "length", 1: "length"}

        # legacy completions: each choice echoes the prompt with its logprobs (computed once)
        r = c.completions.create(model="tiny", prompt="one two three", max_tokens=0, n=2, echo=True, logprobs=2)
        lps = [ch.logprobs for ch in r.choices]
        assert lps[0].tokens == lps[1].tokens and lps[0].token_logprobs == lps[1].token_logprobs
        assert lps[0].token_logprobs[0] is None and len(lps[0].tokens) == r.usage.prompt_tokens


def _predicted(h: ServeHandle) -> float:
    lines = httpx.get(h.base_url + "/metrics").text.splitlines()
    return float(next(ln for ln in lines if ln.startswith("deltarun_tokens_predicted_total ")).split()[1])


def test_a_client_leaving_stops_every_choice(path):
    with _server(path, 4) as h:
        with httpx.stream("POST", h.base_url + "/v1/chat/completions", timeout=60,
                          json={"messages": MSG, "max_tokens": 400, "n": 3, "stream": True, "ignore_eos": True}) as s:
            for i, _ in enumerate(s.iter_lines()):
                if i == 6:
                    break
        deadline = time.monotonic() + 30
        while "deltarun_requests_processing 0.0" not in httpx.get(h.base_url + "/metrics").text.splitlines():
            assert time.monotonic() < deadline, "a choice kept its seq"
            time.sleep(0.05)
        assert _predicted(h) < 400     # stopped, not run to their 3 x 400 tokens


def test_choices_beyond_the_limit_are_a_400(path):
    with _server(path, 2) as h:
        with pytest.raises(openai.BadRequestError):
            _chat(_client(h), n=17)


def test_a_later_choice_forks_from_a_choice_0_that_went_on(path, single):
    """The choices' jobs reach the worker one by one: a later one admitted after choice 0 has
    decoded a few tokens still starts from its seq (the prompt's KV rows and the prompt-end
    checkpoint's state), evaluating nothing."""
    with _server(path, 4) as h:
        params = h.state.builder.chat(parse_chat({"messages": MSG, "temperature": 0, "ignore_eos": True}))
        events: list[queue.Queue] = [queue.Queue(), queue.Queue()]
        first = Job(dataclasses.replace(params, max_tokens=300, group="g", choice=0), events[0].put)
        h.state.worker.submit(first)
        for _ in range(4):                # choice 0 goes past its prompt
            assert events[0].get(timeout=30).error is None
        later = Job(dataclasses.replace(params, max_tokens=12, group="g", choice=1), events[1].put)
        h.state.worker.submit(later)
        while (ev := events[1].get(timeout=30)).finish_reason is None:
            assert ev.error is None
        first.cancel()
        assert ev.result["content"] == single and ev.result["n_evaluated"] == 0


def test_choices_past_the_queue_are_a_503_and_none_of_them_runs(path):
    def open_model():
        return Model(path, n_ctx=N_CTX, n_seq_max=1, n_ubatch=64, n_threads=1, kv_type="f32")
    with ServeHandle(open_model, ServeSettings(parallel=1, max_queue=1, prefill_ahead=False)) as h:
        with pytest.raises(openai.APIStatusError) as e:
            _chat(_client(h), n=3, max_tokens=200)
        assert e.value.status_code == 503
        deadline = time.monotonic() + 30
        while "deltarun_requests_processing 0.0" not in httpx.get(h.base_url + "/metrics").text.splitlines():
            assert time.monotonic() < deadline, "a choice of the refused request runs"
            time.sleep(0.05)
        assert _predicted(h) < 200


def test_a_failing_choice_fails_the_request_at_once_and_stops_the_others(path, monkeypatch):
    """A non-streamed request whose choice 1 fails after its first step (an error injected where a
    request's own error, its grammar's, surfaces): the answer is that error at once, not after
    the other choices' 400 tokens, and their jobs stop."""
    from deltarun.apps.serve.protocol import ApiError
    from deltarun.apps.serve.worker import Worker

    settle = Worker._settle

    def failing(self, job, o):
        if job.params.choice == 1:
            raise ApiError("injected failure", code="grammar_error")
        settle(self, job, o)

    monkeypatch.setattr(Worker, "_settle", failing)
    with _server(path, 4) as h:
        r = httpx.post(h.base_url + "/v1/chat/completions", timeout=60,
                       json={"messages": MSG, "max_tokens": 400, "n": 3, "ignore_eos": True})
        assert r.status_code == 400 and "injected failure" in r.json()["error"]["message"], r.text
        deadline = time.monotonic() + 30
        while "deltarun_requests_processing 0.0" not in httpx.get(h.base_url + "/metrics").text.splitlines():
            assert time.monotonic() < deadline, "a choice kept its seq"
            time.sleep(0.05)
        predicted = _predicted(h)      # the other two stopped, not run to their 400 tokens each (800)
        assert predicted < 700, predicted
