"""`deltarun serve --draft ngram|mtp|DRAFT.gguf` over real HTTP with the openai client.

Speculative decoding must not change greedy output, alone or with several requests verified in one
ubatch; drafts get accepted (the echo preset repeats its input, so n-gram and MTP drafts are right;
a draft model with the target's trunk is always right); the prompt cache stays exact (the MTP
block's KV rows after a cached resume equal those of a fresh evaluation); a bad --draft is a
one-line error before any model loads. Tiny F32 models with an F32 KV cache, so equality is exact.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json

import httpx
import numpy as np
import openai
import pytest
from admission_gate import AdmissionGate

from deltarun.apps.chat import common_prefix_length
from deltarun.apps.serve.server import ServeHandle, ServeSettings
from deltarun.runner.model import Model

N_CTX = 512
DRAFT_MAX = 3
#: tokens per answer: long enough that the four requests of `_together` decode side by side while
#: the later prompts ride along the earlier requests' steps a few tokens at a time (`Worker._ride`)
N_TOKENS = 48
PROMPTS = [f"say {' '.join(['one two three four'] * (i + 1))} {i} one two" for i in range(4)]


def _server(target, draft=None, draft_path=None, parallel=4, **settings) -> ServeHandle:
    settings.setdefault("prefill_ahead", False)    # as in test_serve: requests' own evaluations are counted
    def target_model():
        return Model(target, n_ctx=N_CTX, n_seq_max=parallel, n_ubatch=64, rs_slots=DRAFT_MAX + 1, n_threads=1,
                     kv_type="f32", mtp=draft == "mtp")

    def draft_model():
        return Model(draft_path, n_ctx=N_CTX, n_seq_max=parallel, n_ubatch=64, n_threads=1, kv_type="f32")

    return ServeHandle(target_model, ServeSettings(parallel=parallel, draft=draft, draft_max=DRAFT_MAX,
                                                   open_draft=draft_model if draft_path else None, **settings))


def _client(h: ServeHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=h.base_url + "/v1", api_key="x", max_retries=0, timeout=120)


def _ask(c: openai.OpenAI, text: str, **kw):
    kw.setdefault("max_tokens", N_TOKENS)
    kw.setdefault("temperature", 0)
    return c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}],
                                     extra_body={"ignore_eos": True}, **kw)


def _together(h: ServeHandle, c: openai.OpenAI, prompts: list[str], **kw) -> list:
    """The prompts as concurrent requests, admitted together (so they decode together)."""
    with AdmissionGate(h.worker, len(prompts)) as gate, cf.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(_ask, c, p, **kw) for p in prompts]
        gate.release()
        return [f.result() for f in futures]


def _metric(h: ServeHandle, name: str) -> float:
    text = httpx.get(h.base_url + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " "))


@pytest.fixture(scope="module")
def plain_answers(tiny_model_path):
    """Greedy answers without drafts, each request alone, for the two targets."""
    out = {}
    for preset in ("tiny-echo", "tiny-mtp"):
        with _server(tiny_model_path(preset)) as h:
            c = _client(h)
            out[preset] = [_ask(c, p).choices[0].message.content for p in PROMPTS]
    return out


@pytest.mark.parametrize("draft", ["ngram", "mtp", "model"])
def test_greedy_output_unchanged_alone_and_four_together(tiny_model_path, plain_answers, draft):
    # ngram and mtp on the echo preset (drafts right); a draft GGUF with the target's trunk (always right)
    preset = "tiny-mtp" if draft == "model" else "tiny-echo"
    kw = {"draft": draft} if draft != "model" else {"draft": "draft.gguf", "draft_path": tiny_model_path("tiny")}
    with _server(tiny_model_path(preset), **kw) as h:
        c = _client(h)
        alone = _ask(c, PROMPTS[0])
        assert alone.choices[0].message.content == plain_answers[preset][0]
        t = alone.model_extra["timings"]
        assert t["draft_n"] > 0 and 0 < t["draft_n_accepted"] <= t["draft_n"]
        h.worker.trace = trace = []
        together = _together(h, c, PROMPTS)
        h.worker.trace = None
        assert [r.choices[0].message.content for r in together] == plain_answers[preset]
        assert all(r.usage.completion_tokens == N_TOKENS for r in together)
        assert _metric(h, "deltarun_prompt_tokens_ridden_total") > 0   # later prompts rode along (MTP: with their rows)
        # several sequences verified in one ubatch, each with its own drafts
        assert any(len(ids) > 1 and width > 1 for kind, ids, width in (e for e in trace if e[0] == "batch"))
        verified = [e for e in trace if e[0] == "verify"]
        assert len({e[1] for e in verified if e[3] > 0}) > 1
        steps = [e[1] for e in trace if e[0] == "batch"]
        jobs = {j for ids in steps for j in ids}
        assert len(jobs) == len(PROMPTS)        # fewer verification steps than tokens, for each request
        assert all(sum(j in ids for ids in steps) < N_TOKENS for j in jobs), [sum(j in ids for ids in steps) for j in jobs]
        drafted = _metric(h, "deltarun_draft_tokens_total")
        accepted = _metric(h, "deltarun_draft_tokens_accepted_total")
        assert drafted > 0 and 0 < accepted <= drafted
        spec = httpx.get(h.base_url + "/props", timeout=30).json()["speculative"]
        assert spec["n_drafted"] == drafted and spec["n_accepted"] == accepted and spec["draft_max"] == DRAFT_MAX
        # sampled decoding with drafts (min(1, p/q) acceptance) runs alongside
        sampled = _together(h, c, PROMPTS[:2], temperature=0.9, seed=3)
        assert all(r.usage.completion_tokens == N_TOKENS for r in sampled)


def test_a_logprobs_request_drafts_and_reports_the_plain_servers_logprobs(tiny_model_path, plain_answers):
    """A logprobs request drafts beside another in one verification ubatch: each kept token's entry
    comes from its own row of the verification, so tokens, logprobs and top alternatives are the
    plain server's (up to float32 rounding: the rows are computed in a wider ubatch). The drafts come
    from a draft GGUF with the target's trunk (always right), on a model whose rows differ token by
    token (the echo model's rows after one token are all alike)."""
    with _server(tiny_model_path("tiny-mtp")) as h:
        want = _ask(_client(h), PROMPTS[0], logprobs=True, top_logprobs=3).choices[0].logprobs.content
    with _server(tiny_model_path("tiny-mtp"), draft="draft.gguf", draft_path=tiny_model_path("tiny")) as h:
        c = _client(h)
        h.worker.trace = trace = []
        with AdmissionGate(h.worker, 2) as gate, cf.ThreadPoolExecutor(2) as pool:
            fa = pool.submit(_ask, c, PROMPTS[0], logprobs=True, top_logprobs=3)
            fb = pool.submit(_ask, c, PROMPTS[1])
            gate.release()
            a, b = fa.result(), fb.result()
        h.worker.trace = None
    assert a.choices[0].message.content == plain_answers["tiny-mtp"][0]
    assert b.choices[0].message.content == plain_answers["tiny-mtp"][1]
    got = a.choices[0].logprobs.content
    assert [e.token for e in got] == [e.token for e in want] and len(got) == N_TOKENS
    np.testing.assert_allclose([e.logprob for e in got], [e.logprob for e in want], atol=1e-4)
    assert [[t.token for t in e.top_logprobs] for e in got] == [[t.token for t in e.top_logprobs] for e in want]
    assert a.model_extra["timings"]["draft_n_accepted"] > 0 and b.model_extra["timings"]["draft_n"] > 0
    assert any(len(ids) == 2 and width > 1 for kind, ids, width in (e for e in trace if e[0] == "batch"))


@pytest.mark.parametrize("draft", ["ngram", "mtp"])
def test_drafts_are_verified_under_a_json_schema_and_penalties(tiny_model_path, draft):
    """A request with a JSON schema, a presence penalty and a logit bias drafts too: its processors
    verify each draft on a fork that walks the drafts before it (`sampling.accept_draft`), so the
    greedy answer is the plain server's and drafts are kept (the echo model repeats its last token
    until the string's maxLength closes it: the grammar's mask and the penalty move with every
    drafted token)."""
    kw = dict(max_tokens=40, presence_penalty=0.3, logit_bias={"7": 1.5},
              response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
                  "type": "object", "properties": {"a": {"type": "string", "maxLength": 60}}, "required": ["a"],
                  "additionalProperties": False}}})
    with _server(tiny_model_path("tiny-echo")) as h:
        want = [_ask(_client(h), p, **kw).choices[0].message.content for p in PROMPTS[:2]]
    with _server(tiny_model_path("tiny-echo"), draft=draft) as h:
        got = [_ask(_client(h), p, **kw) for p in PROMPTS[:2]]
    assert [r.choices[0].message.content for r in got] == want
    assert all(len(json.loads(r.choices[0].message.content)["a"]) <= 60 for r in got)    # the schema held
    assert sum(r.model_extra["timings"]["draft_n_accepted"] for r in got) > 4


def _mtp_rows(h: ServeHandle, tokens: list[int]) -> tuple[int, list[np.ndarray]]:
    """The MTP block's KV rows of the seq holding `tokens` (positions 0..len-2: the last pairs with
    a token the seq has not evaluated), once the worker has settled: an answer's last MTP rows are
    completed as its job is released, after the client has the answer."""
    h.wait_settled()
    m = h.worker.model
    seq = max(range(m.memory.n_seq_max), key=lambda s: common_prefix_length(m.tokens(s), tokens))
    n = common_prefix_length(m.tokens(seq), tokens)
    kv = m.memory.read_kv(seq, n)
    return n, [np.frombuffer(kv.rows[il][0], dtype=np.float32).reshape(n, -1)[:n - 1] for il in m.memory.mtp_layers]


@pytest.mark.parametrize("prefill_ahead", [False, True])
def test_prompt_cache_with_drafts_evaluates_only_new_tokens_and_keeps_the_mtp_rows(tiny_model_path, prefill_ahead):
    """Multi-turn (the Qwen3 template re-renders the previous answer, so each turn resumes from the
    checkpoint at the answer's start, or with prefill ahead from the re-rendered answer evaluated
    between turns): only tokens the seqs do not hold are evaluated with drafts on (rolled-back
    drafts are not held, so they never count as cached), and the MTP block's KV rows after the
    resume (and after the work ahead) equal those a fresh server computes for the same conversation
    (the row before the resume point comes from the hidden row the cache kept)."""
    from deltarun.base.chat_template import ChatTemplate
    from deltarun.base.gguf_file import GGUFFile

    path = tiny_model_path("tiny-mtp")      # random weights: answers that are not just white space
    f = GGUFFile(path)
    tok, template = f.tokenizer(), ChatTemplate(f.get("tokenizer.chat_template"))
    msgs = [{"role": "system", "content": "Repeat after me."}]
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    with _server(path, draft="mtp", parallel=2, chunk=32, checkpoint_every=0, prefill_ahead=prefill_ahead) as h:
        c, model = _client(h), h.worker.model
        held: list[int] = []
        for turn in range(3):
            msgs.append({"role": "user", "content": f"turn {turn}: " + "one two three " * (turn + 2)})
            prompt = tok.encode(template.render(msgs, add_generation_prompt=True, enable_thinking=False),
                                parse_special=True)
            r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                          extra_body=kwargs)
            t = r.model_extra["timings"]
            assert r.usage.prompt_tokens == len(prompt)
            assert r.usage.prompt_tokens_details.cached_tokens == len(prompt) - t["prompt_n"]
            if turn:
                assert t["prompt_n"] == len(prompt) - common_prefix_length(held, prompt)
                assert r.usage.prompt_tokens_details.cached_tokens > 20
            assert t.get("draft_n", 0) > 0
            msgs.append({"role": "assistant", "content": r.choices[0].message.content})
            h.wait_settled()
            held = max((model.tokens(i) for i in range(2)), key=lambda ts: common_prefix_length(ts, prompt))
        n_cached, rows = _mtp_rows(h, held)
        assert (_metric(h, "deltarun_prompt_tokens_ahead_total") > 0) == prefill_ahead
    # a fresh server evaluates the last request (or with prefill ahead a next turn, which starts with
    # what was evaluated ahead) from nothing
    probe = msgs + [{"role": "user", "content": "next"}] if prefill_ahead else msgs[:-1]
    with _server(path, draft="mtp", parallel=2, chunk=32, checkpoint_every=0) as fresh:
        r2 = _client(fresh).chat.completions.create(model="tiny", messages=probe, max_tokens=10, temperature=0,
                                                    extra_body=kwargs)
        assert r2.usage.prompt_tokens_details.cached_tokens == 0
        if not prefill_ahead:
            assert r2.choices[0].message.content == msgs[-1]["content"]
        n_fresh, fresh_rows = _mtp_rows(fresh, held)
    assert n_cached == n_fresh == len(held)
    for a, b in zip(rows, fresh_rows):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_a_prompt_riding_along_another_streams_steps_keeps_the_mtp_rows_of_a_fresh_evaluation(tiny_model_path):
    """With --draft mtp a prompt read while another stream decodes rides along that stream's steps
    with its hidden rows (`Worker._ride`); the MTP block's KV rows of its positions, and its
    answer, are those of the same request on a fresh server, alone."""
    from deltarun.base.chat_template import ChatTemplate
    from deltarun.base.gguf_file import GGUFFile

    path = tiny_model_path("tiny-mtp")
    f = GGUFFile(path)
    msgs = [{"role": "user", "content": "riding " + "one two three " * 30}]
    prompt = f.tokenizer().encode(ChatTemplate(f.get("tokenizer.chat_template")).render(
        msgs, add_generation_prompt=True), parse_special=True)
    with _server(path, draft="mtp", parallel=2, chunk=32, checkpoint_every=0) as h:
        c = _client(h)
        stream = iter(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "keep going"}],
                                                max_tokens=400, stream=True, extra_body={"ignore_eos": True}))
        next(stream), next(stream)
        before = _metric(h, "deltarun_prompt_tokens_ridden_total")
        r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
        ridden = _metric(h, "deltarun_prompt_tokens_ridden_total") - before
        stream.close()
        h.wait_settled()
        n, rows = _mtp_rows(h, prompt)
    assert r.usage.prompt_tokens == len(prompt) and ridden == len(prompt)
    with _server(path, draft="mtp", parallel=2, chunk=32, checkpoint_every=0) as fresh:
        r2 = _client(fresh).chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
        assert _metric(fresh, "deltarun_prompt_tokens_ridden_total") == 0
        n_fresh, fresh_rows = _mtp_rows(fresh, prompt)
    assert r.choices[0].message.content == r2.choices[0].message.content
    assert n == n_fresh == len(prompt)
    for a, b in zip(rows, fresh_rows):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_paused_mtp_sources_leave_the_mtp_rows_of_every_answer_position(tiny_model_path):
    """Random weights: every MTP draft is wrong, so drafting pauses and the rows of the paused steps
    wait (`Running.drafts_next_step`: no MTP row in the trunk's graph, none evaluated after it)
    until drafting resumes or the request ends (`Worker._release`). After two requests decoded side
    by side, each seq's MTP KV rows over prompt and answer are a fresh evaluation's, and the
    answers are the plain server's."""
    from test_mtp_rows import fresh_mtp_kv_rows, mtp_kv_rows

    path = tiny_model_path("tiny-mtp")
    with _server(path, parallel=2) as h:
        want = [_ask(_client(h), p).choices[0].message.content for p in PROMPTS[:2]]
    with _server(path, draft="mtp", parallel=2) as h:
        c = _client(h)
        got = _together(h, c, PROMPTS[:2])
        h.wait_settled()
        m = h.worker.model
        held = [m.tokens(seq) for seq in range(2)]
        rows = [mtp_kv_rows(m, seq, len(held[seq]) - 1) for seq in range(2)]
        drafted = _metric(h, "deltarun_draft_tokens_total")
    assert [r.choices[0].message.content for r in got] == want
    assert 0 < drafted < N_TOKENS         # a pause: drafts on fewer than half the steps of either request
    for seq in range(2):
        assert len(held[seq]) > N_TOKENS
        for a, b in zip(rows[seq], fresh_mtp_kv_rows(path, held[seq])):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_cli_bad_draft_is_one_line_error_before_loading(tiny_model_path, tmp_path):
    from click.testing import CliRunner

    from deltarun.cli.main import cli
    from deltarun.cli.options import resolve_model

    tiny = str(tiny_model_path("tiny"))
    other_vocab = str(resolve_model(None, quiet=True))      # the built-in model: 4,096 tokens, not 2,330
    cases = [(["--draft", "mtp"], "an MTP block"),      # "tiny" has none
             (["--draft", str(tmp_path / "missing.gguf")], "no such draft model file"),
             (["--draft", other_vocab], "vocabulary")]
    for args, words in cases:
        res = CliRunner().invoke(cli, ["serve", tiny, "--port", "0", *args])
        assert res.exit_code != 0, res.output
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and words in lines[0], res.stderr


def test_draft_model_state_follows_conversations_across_slots_and_host_ram(tiny_model_path, monkeypatch):
    """Three conversations take turns on two slots (one goes through host RAM each round) with a
    draft GGUF that has the target's trunk: after every proposal the draft model's sequence holds
    exactly the conversation's tokens (reused when it held a prefix, evaluated again otherwise),
    every answer is the plain server's and every draft is accepted."""
    from deltarun.runner.speculative import ModelDraft

    target, draft = tiny_model_path("tiny-mtp"), tiny_model_path("tiny")
    wrong, propose = [], ModelDraft.propose

    def checked(self, history, n, sampler):
        out = propose(self, history, n, sampler)
        if self.model.tokens(self.seq) != history:
            wrong.append((self.seq, len(history)))
        return out
    monkeypatch.setattr(ModelDraft, "propose", checked)
    convs = [[{"role": "user", "content": f"conversation {i}: " + "word " * (3 + i)}] for i in range(3)]

    def run(h: ServeHandle) -> list[tuple[str, int, int, int]]:
        c, out = _client(h), []
        talks = [list(m) for m in convs]
        for turn in range(3):
            for msgs in talks:
                if turn:
                    msgs.append({"role": "user", "content": f"and then {turn}"})
                r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
                t = r.model_extra["timings"]
                out.append((r.choices[0].message.content, t.get("draft_n", 0), t.get("draft_n_accepted", 0),
                            r.usage.prompt_tokens_details.cached_tokens))
                msgs.append({"role": "assistant", "content": r.choices[0].message.content})
        return out

    with _server(target, parallel=2) as h:
        plain = run(h)
    with _server(target, "draft.gguf", draft_path=draft, parallel=2) as h:
        spec = run(h)
        assert h.worker.cache.n_evictions > 0          # some conversation went to host RAM and came back
    assert all(cached > 0 for *_, cached in spec[3:])    # later turns resumed from the cache
    assert not wrong
    assert [a for a, *_ in spec] == [a for a, *_ in plain]
    assert all(n > 0 and ok == n for _, n, ok, _ in spec), spec


def test_mtp_rows_after_a_resume_from_host_ram(tiny_model_path):
    """One slot, two conversations: the first returns from host RAM, resuming at the start of its
    re-rendered answer (thinking off), where the next token differs from the one the slot had; the
    MTP block's KV rows then equal those of a fresh server (the KV copy in host RAM holds them, the
    entry keeps the hidden row before the resume point)."""
    kw = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    path = tiny_model_path("tiny-mtp")
    a = [{"role": "user", "content": "first conversation " + "alpha " * 6}]
    b = [{"role": "user", "content": "second conversation " + "beta " * 6}]
    with _server(path, draft="mtp", parallel=1, chunk=32) as h:
        c = _client(h)
        for msgs in (a, b):
            r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0, **kw)
            msgs += [{"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "more"}]
        r = c.chat.completions.create(model="tiny", messages=a, max_tokens=6, temperature=0, **kw)
        assert h.worker.cache.n_evictions >= 2 and r.usage.prompt_tokens_details.cached_tokens > 10
        h.wait_settled()      # the answer's MTP rows are completed as its job is released, after the answer
        held = h.worker.model.tokens(0)
        n, rows = _mtp_rows(h, held)
    with _server(path, draft="mtp", parallel=1, chunk=32) as fresh:
        r2 = _client(fresh).chat.completions.create(model="tiny", messages=a, max_tokens=6, temperature=0, **kw)
        assert r2.choices[0].message.content == r.choices[0].message.content
        n2, fresh_rows = _mtp_rows(fresh, held)
    assert n == n2 == len(held)
    for x, y in zip(rows, fresh_rows):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-4)


def test_supervised_server_drafts_and_counts(tiny_model_path, plain_answers):
    """The model in the supervised child process (serve --rpc runs it there) speculates the same
    way; /props's draft counts come back through the replayed metric calls."""
    open_model = functools.partial(Model, tiny_model_path("tiny-echo"), n_ctx=N_CTX, n_seq_max=2, n_ubatch=64,
                                   rs_slots=DRAFT_MAX + 1, n_threads=1, kv_type="f32", mtp=True)
    with ServeHandle(open_model, ServeSettings(parallel=2, draft="mtp", draft_max=DRAFT_MAX, supervise=True)) as h:
        r = _ask(_client(h), PROMPTS[0])
        assert r.choices[0].message.content == plain_answers["tiny-echo"][0]
        spec = httpx.get(h.base_url + "/props", timeout=30).json()["speculative"]
        assert spec["draft"] == "mtp" and spec["draft_max"] == DRAFT_MAX
        assert spec["n_drafted"] == _metric(h, "deltarun_draft_tokens_total") > 0
        assert 0 < spec["n_accepted"] == _metric(h, "deltarun_draft_tokens_accepted_total") <= spec["n_drafted"]


@pytest.mark.parametrize("preset, body", [
    ("tiny-kimi-linear-k2vocab", {"tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                                               "unit": {"enum": ["c", "f"]}},
                                              "required": ["city", "unit"], "additionalProperties": False}}}]}),
    ("tiny", {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "object", "properties": {"a": {"enum": ["x", "yy"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "n"], "additionalProperties": False}}}}),
])
@pytest.mark.parametrize("ignore_eos, beyond", [(False, 0), (True, 0), (True, 3)])
def test_a_grammar_completed_inside_a_verified_step_keeps_the_steps_tokens(tiny_model_path, monkeypatch, preset, body,
                                                                          ignore_eos, beyond):
    """Drafts that are the answer itself (every step keeps 4 tokens): a forced Kimi call or a JSON
    schema that completes in the middle of a step's kept tokens ends the answer where it completes,
    with all of them. (The grammar walks the whole step before the tokens are streamed; asking
    whether it was complete at the step's first token cut the answer there: a Kimi call lost its
    closing brace and came back as text.)

    With `ignore_eos` nothing may follow a complete grammar (its one allowed token, the end, is
    banned): the step ends at the draft that completes it, with no token after it, whether that
    draft is the step's last or `beyond` more drafts follow it (they were verified against a row
    that allows nothing, and the request failed with "the grammar cannot go on")."""
    import queue

    from test_thinking_budget import _Oracle

    from deltarun.apps.serve import worker as worker_module
    from deltarun.apps.serve.protocol import parse_chat
    from deltarun.apps.serve.worker import Job

    path = tiny_model_path(preset, "f32")
    request = {"messages": [{"role": "user", "content": "one two three four"}], "temperature": 0, "max_tokens": 60,
               "ignore_eos": ignore_eos, **body}

    def run(h: ServeHandle) -> dict:
        params = h.state.builder.chat(parse_chat(request))
        events: queue.Queue = queue.Queue()
        h.state.worker.submit(Job(params, events.put))
        while (ev := events.get(timeout=60)).finish_reason is None:
            assert ev.error is None, ev.error
        return dict(ev.result, finish=ev.finish_reason, prompt=list(params.prompt))

    with _server(path, parallel=1) as h:
        want = run(h)
    assert want["finish"] in ("stop", "tool_calls") and len(want["tokens"]) > 8
    # drafts that are the answer itself (test_thinking_budget's oracle) in place of the n-gram source
    monkeypatch.setattr(worker_module, "NgramDraft", lambda: _Oracle(want["prompt"], want["tokens"] + want["tokens"][:beyond]))
    with _server(path, "ngram", parallel=1) as h:
        got = run(h)
    assert got["n_drafted"] > 0 and got["n_accepted"] == got["n_drafted"]
    assert (got["tokens"], got["content"], got["finish"]) == (want["tokens"], want["content"], want["finish"])
