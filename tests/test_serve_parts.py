"""The server's pieces without HTTP: output parsing (reasoning, tool calls), request checks,
per-sequence state copies and the prompt cache's budget."""

from __future__ import annotations

import json

import numpy as np
import pytest

from deltarun.apps.serve.output import (KIMI_TOOLS, QWEN_TOOLS, OutputStream, ToolCallStream, parse_tool_call,
                                        parse_tool_calls, tool_format_of)
from deltarun.apps.serve.prompt_cache import PromptCache
from deltarun.apps.serve.protocol import ApiError, parse_chat, parse_completion
from deltarun.cli.serve import is_loopback
from deltarun.runner.model import Model


class _CharTokenizer:
    """One token per character: lets a test feed exact text pieces through OutputStream."""

    def __init__(self, text: str):
        self.text = text

    def token_bytes(self, i: int) -> bytes:
        return self.text[i].encode()


def _stream(text: str, **kw) -> tuple[str, str, list[dict], OutputStream]:
    out = OutputStream(_CharTokenizer(text), **kw)
    content, reasoning, calls = "", "", []
    for i in range(len(text)):
        d = out.push(i)
        content, reasoning, calls = content + d.content, reasoning + d.reasoning, calls + d.tool_calls
        if out.stopped:
            break
    d = out.flush()
    return content + d.content, reasoning + d.reasoning, calls + d.tool_calls, out


def test_reasoning_split_from_content():
    content, reasoning, _, _ = _stream("<think>\nLet me think.\n</think>\n\nThe answer.", reasoning=True)
    assert reasoning == "Let me think.\n" and content == "The answer."
    # the prompt opened the think block (Qwen3.5, Qwen3 thinking templates)
    content, reasoning, _, _ = _stream("hmm</think>\n\nYes.", reasoning=True, starts_thinking=True)
    assert reasoning == "hmm" and content == "Yes."
    content, reasoning, _, _ = _stream("no thinking here", reasoning=True)
    assert reasoning == "" and content == "no thinking here"


def test_tool_calls_json_and_xml_forms():
    text = 'Sure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n' \
           '<function=g>\n<parameter=city>\nParis\n</parameter>\n<parameter=n>\n3\n</parameter>\n</function>\n</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content.strip() == "Sure."
    assert [c["function"]["name"] for c in calls] == ["f", "g"] and [c["index"] for c in calls] == [0, 1]
    assert json.loads(calls[0]["function"]["arguments"]) == {"x": 1}
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Paris", "n": 3}
    # streamed one character at a time, with reasoning before it
    content, reasoning, calls2, out = _stream("<think>plan</think>" + text, reasoning=True, tools=True)
    assert reasoning == "plan" and [c["function"] for c in calls2] == [c["function"] for c in calls]
    assert out.n_tool_calls == 2
    # not a tool call after all: kept as content
    assert parse_tool_call("not json") is None
    s = ToolCallStream()
    d = s.push("<tool_call>oops</tool_call> rest")
    assert d.content == "<tool_call>oops</tool_call> rest" and not d.tool_calls


KIMI_ANSWER = ('Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
               '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>'
               'functions.add:1<|tool_call_argument_begin|>{"a":1,"b":[2,3]}<|tool_call_end|>'
               '<|tool_calls_section_end|>')


def test_kimi_tool_calls():
    """Kimi's format as llama.cpp's kimi-k2 parser reads it: one section, ids functions.NAME:N kept,
    arguments as written; the section markers optional; anything else in a section is content."""
    content, calls = parse_tool_calls(KIMI_ANSWER, KIMI_TOOLS)
    assert content == "Let me check."
    assert [(c["index"], c["id"], c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        (0, "functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
        (1, "functions.add:1", "add", '{"a":1,"b":[2,3]}')]
    # streamed one character at a time: the same calls, no marker text in the content
    content2, _, calls2, out = _stream(KIMI_ANSWER, tools=True, tool_format=KIMI_TOOLS)
    assert content2 == "Let me check." and calls2 == calls and out.n_tool_calls == 2
    # no section markers, the last call unterminated (the answer ended there)
    content, calls = parse_tool_calls('<|tool_call_begin|>functions.f:3<|tool_call_argument_begin|>{"x": 1}',
                                      KIMI_TOOLS)
    assert content == "" and [(c["id"], c["function"]["name"]) for c in calls] == [("functions.f:3", "f")]
    # a call's end marker left out before the next call (llama.cpp's grammar makes it optional)
    content, calls = parse_tool_calls('<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"x": 1}'
                                      '<|tool_call_begin|>functions.g:1<|tool_call_argument_begin|>{}'
                                      '<|tool_call_end|>', KIMI_TOOLS)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("f", '{"x": 1}'), ("g", "{}")]
    # the answer cut inside its section (max_tokens): the complete calls are calls, the cut one's
    # text is content, streamed or whole (before, the whole section was content)
    complete = KIMI_ANSWER[:KIMI_ANSWER.rindex("<|tool_call_begin|>")]
    for cut in ('<|tool_call_begin|>functions.add:1<|tool_call_argument_begin|>{"a":', "<|tool_cal"):
        for content, calls in (parse_tool_calls(complete + cut, KIMI_TOOLS),
                               _stream(complete + cut, tools=True, tool_format=KIMI_TOOLS)[::2]):
            assert content == "Let me check." + cut
            assert [(c["id"], c["function"]["arguments"]) for c in calls] == [("functions.get_weather:0", '{"city": "Paris"}')]
    # an id without the functions. prefix, or arguments that are not a JSON object: content
    for bad in ('<|tool_calls_section_begin|><|tool_call_begin|>f:0<|tool_call_argument_begin|>{}'
                '<|tool_call_end|><|tool_calls_section_end|>',
                '<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>[1]'
                '<|tool_call_end|><|tool_calls_section_end|> tail'):
        content, calls = parse_tool_calls(bad, KIMI_TOOLS)
        assert content == bad and calls == []
    # Qwen's tags mean nothing to a Kimi model, and Kimi's markers nothing to a Qwen one
    qwen = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert parse_tool_calls(qwen, KIMI_TOOLS) == (qwen, [])
    assert parse_tool_calls(KIMI_ANSWER, QWEN_TOOLS) == (KIMI_ANSWER, [])


def test_tool_format_follows_the_template():
    """The format is the template's (llama.cpp's rule: both Kimi markers in its source)."""
    kimi = "{{ '<|tool_calls_section_begin|>' }}{{ '<|tool_call_begin|>' }}"
    assert tool_format_of(kimi) is KIMI_TOOLS
    assert tool_format_of("{{ '<|tool_calls_section_begin|>' }}") is QWEN_TOOLS
    assert tool_format_of("<tool_call>{{ x }}</tool_call>") is QWEN_TOOLS


def test_stop_strings_hold_back_partial_matches():
    content, _, _, out = _stream("Hello STOP world", stops=["STOP"])
    assert content == "Hello " and out.stopped
    content, _, _, out = _stream("Hello ST", stops=["STOP"])
    assert content == "Hello ST" and not out.stopped


def test_request_checks():
    ok = parse_chat({"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text",
                                                                                                     "text": "b"}]}],
                     "max_completion_tokens": 5, "stop": "x", "stream": True, "stream_options": {"include_usage": True}})
    assert ok.messages[0] == {"role": "system", "content": "ab"} and ok.max_tokens == 5 and ok.stops == ["x"]
    assert ok.include_usage
    bad = [({"messages": "hi"}, "messages"), ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
           ({"messages": [{"role": "user", "content": "x"}], "top_p": 0}, "top_p"),
           ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
           ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, "top_logprobs"),
           ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
           ({"messages": [{"role": "user", "content": "x"}], "logit_bias": {"a": 1}}, "logit_bias"),
           ({"messages": [{"role": "user", "content": "x"}], "seed": 1.5}, "seed")]
    for body, param in bad:
        with pytest.raises(ApiError) as e:
            parse_chat(body)
        assert e.value.param == param and e.value.status == 400
    with pytest.raises(ApiError):
        parse_chat([1, 2])
    assert parse_completion({"prompt": [1, 2, 3], "logprobs": 2}).top_logprobs == 2


def test_top_k_by_partition_draws_from_the_same_distribution():
    """k < vocab / 8: top-k by partition; the draws follow `distribution`."""
    from deltarun.runner.sampling import Sampler, SamplingParams

    rng = np.random.default_rng(0)
    logits = rng.normal(size=5000).astype(np.float32) * 3
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, repeat_penalty=1.3, seed=5)
    history = [int(i) for i in np.argsort(-logits)[:5]]        # penalise some of the best
    want = Sampler(params).distribution(logits, history)
    sampler = Sampler(params)
    assert sampler.partitions(logits.size)
    draws = np.bincount([sampler.sample(logits, history) for _ in range(4000)], minlength=5000) / 4000
    assert set(np.flatnonzero(draws)) <= set(np.flatnonzero(want))
    assert np.abs(draws - want).max() < 0.03


@pytest.mark.parametrize("vocab", [400, 60])
def test_top_k_alone_limits_the_draw_to_the_k_best(vocab):
    """Top-p 1 and min-p 0 keep everything: only k = 10 limits the draw among 400 close logits
    (the 11th best about as likely as the 10th). Exactly the 10 best after the repetition
    penalty are drawn, each as often as its softmax among them, computed here; by partition (400
    logits) and by a full sort (60)."""
    from deltarun.runner.sampling import Sampler, SamplingParams

    rng = np.random.default_rng(1)
    logits = (rng.normal(size=vocab) * 0.3).astype(np.float32)
    history = [int(i) for i in np.argsort(-logits)[[0, 3]]]      # penalised: the best stays, the 4th drops out
    params = SamplingParams(temperature=1.0, top_k=10, top_p=1.0, min_p=0.0, repeat_penalty=1.5, seed=3)
    x = logits.astype(np.float64)
    for t in history:                                             # llama.cpp: divide positive, multiply negative
        x[t] = x[t] / 1.5 if x[t] > 0 else x[t] * 1.5
    best = np.argsort(-x)[:10]
    want = np.zeros(vocab)
    want[best] = np.exp(x[best]) / np.exp(x[best]).sum()
    sampler = Sampler(params)
    assert sampler.partitions(vocab) == (vocab == 400)
    n = 20000
    draws = np.bincount([sampler.sample(logits, history) for _ in range(n)], minlength=vocab) / n
    assert set(np.flatnonzero(draws)) == set(best.tolist())
    assert np.abs(draws - want).max() < 5 * np.sqrt(want.max() * (1 - want.max()) / n)   # 5 standard deviations


def test_loopback_detection():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.10")


@pytest.fixture(scope="module")
def model(tiny_model_path):
    with Model(tiny_model_path("tiny", "f32"), n_ctx=256, n_seq_max=3, n_ubatch=32, n_threads=1) as m:
        yield m


def test_memory_seq_copies_move_a_sequence_between_cells(model):
    """KV rows + recurrent state copied from seq 0 into seq 2 continue exactly like seq 0."""
    model.reset()
    prompt = list(range(40, 80))
    model.eval(prompt, seq=0)
    kv = model.memory.read_kv(0, len(prompt))
    rec = model.memory.read_recurrent(0)
    model.memory.write_kv(2, kv)
    model.memory.write_recurrent(2, rec)
    model.memory.set_tokens(2, prompt)
    a = model.eval([7, 8, 9], seq=0, all_logits=True)
    b = model.eval([7, 8, 9], seq=2, all_logits=True)
    np.testing.assert_array_equal(a, b)
    # a shorter prefix from the same KV copy: positions 0..19 plus the state saved at 20
    model.reset()
    model.eval(prompt[:20], seq=1)
    rec20 = model.memory.read_recurrent(1)
    model.eval(prompt[20:], seq=1)
    model.memory.write_kv(2, kv, 20)
    model.memory.write_recurrent(2, rec20)
    model.memory.set_tokens(2, prompt[:20])
    fresh = Model.logits_for(model, prompt[:20] + [5, 6])[-1]
    model.memory.write_kv(2, kv, 20)
    model.memory.write_recurrent(2, rec20)
    model.memory.set_tokens(2, prompt[:20])
    np.testing.assert_allclose(model.eval([5, 6], seq=2), fresh, rtol=1e-5, atol=1e-5)
    model.memory.clear_seq(2)
    assert model.n_past(2) == 0


def test_prompt_cache_lookup_and_budget(model):
    model.reset()
    cache = PromptCache(model, 3, budget_bytes=1 << 30)
    prompt = list(range(100, 140))
    model.eval(prompt[:16], seq=0)
    cache.checkpoint(0)
    model.eval(prompt[16:], seq=0)
    cache.checkpoint(0, logits=np.zeros(model.hp.n_vocab, dtype=np.float32))
    cache.finished(0, answer_start=16)
    assert cache.lookup(prompt, [0, 1, 2]).how == "live" and cache.lookup(prompt, [0]).pos == len(prompt)
    r = cache.lookup(prompt[:16] + [1, 2, 3], [0, 1, 2])
    assert (r.how, r.pos, r.seq) in {("checkpoint", 16, 0), ("rollback", 16, 0)}
    assert cache.lookup([9, 9, 9], [1, 2]).how == "fresh"
    # moving the conversation out to host RAM and back
    other = list(range(300, 330))
    fresh = cache.lookup(other, [0])
    cache.apply(fresh, 0)
    assert cache.host and model.n_past(0) == 0
    back = cache.lookup(prompt, [1])
    assert back.how == "host" and back.pos == len(prompt)
    cache.apply(back, 1)
    assert model.tokens(1) == prompt and not cache.host
    # a budget smaller than one entry keeps nothing in host RAM, and only two checkpoints per seq
    small = PromptCache(model, 3, budget_bytes=1)
    small.apply(small.lookup([1, 2, 3], [1]), 1)
    assert not small.host
    for n in range(4):
        model.eval([5 + n], seq=2)
        small.checkpoint(2)
    assert sorted(small.seqs[2].checkpoints) == [model.n_past(2) - 1, model.n_past(2)]


def _count_kv_reads(model, monkeypatch) -> list[int]:
    reads: list[int] = []
    real = model.memory.read_kv
    monkeypatch.setattr(model.memory, "read_kv", lambda *a, **k: reads.append(1) or real(*a, **k))
    return reads


def _hold(model, cache: PromptCache, seq: int, tokens: list[int]) -> None:
    """A conversation answered in `seq`: evaluated there, checkpointed at its end, finished."""
    model.eval(tokens, seq=seq)
    cache.checkpoint(seq)
    cache.finished(seq, answer_start=model.n_past(seq))


def test_copy_ahead_takes_the_eviction_copy_off_a_requests_path(model, monkeypatch):
    """With every seq taken, the least recently used conversation is copied to host RAM while
    idle; the request that pushes it out then copies nothing, and the conversation comes back from
    that copy and goes on exactly as if it had never left."""
    model.reset()
    cache = PromptCache(model, 2, budget_bytes=1 << 30)
    convs = [list(range(100, 140)), list(range(200, 230))]
    _hold(model, cache, 0, convs[0])
    assert not cache.copy_ahead([0, 1])           # an empty seq: nobody gets pushed out
    _hold(model, cache, 1, convs[1])
    assert cache.copy_ahead([0, 1]) and [e.tokens for e in cache.host] == [convs[0]]
    assert not cache.copy_ahead([0, 1])           # copied already
    reads = _count_kv_reads(model, monkeypatch)
    cache.apply(cache.lookup(list(range(300, 320)), [0, 1]), cache.pick_seq([0, 1]))
    assert reads == [] and model.tokens(0) == [] and cache.n_evictions == 1
    assert [e.tokens for e in cache.host] == [convs[0]]
    back = cache.lookup(convs[0] + [5, 6], [1])
    assert (back.how, back.pos) == ("host", len(convs[0]))
    cache.apply(back, 1)                          # pushes out seq 1's conversation: copied now
    assert len(reads) == 1 and model.tokens(1) == convs[0]
    got = model.eval([5, 6], seq=1)
    want = model.eval(convs[0] + [5, 6], seq=0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_stale_copy_ahead_is_dropped(model, monkeypatch):
    """A copy made ahead is a copy of the seq as it was: once the conversation goes on in its seq,
    the copy is dropped (not kept beside it in host RAM) and a new one made when it is next in line."""
    model.reset()
    cache = PromptCache(model, 2, budget_bytes=1 << 30)
    for seq, toks in enumerate([list(range(100, 140)), list(range(200, 230))]):
        _hold(model, cache, seq, toks)
    assert cache.copy_ahead([0, 1]) and cache.seqs[0].copy is cache.host[0]
    _hold(model, cache, 0, [7, 8, 9])             # the conversation in seq 0 goes on
    assert cache.copy_ahead([0, 1])               # seq 1 is next in line now; seq 0's copy dropped
    assert [e.tokens for e in cache.host] == [model.tokens(1)] and cache.seqs[0].copy is None
    reads = _count_kv_reads(model, monkeypatch)
    cache.apply(cache.lookup([1, 2, 3], [0]), 0)  # pushes out seq 0: copied now, at its new length
    assert len(reads) == 1 and sorted(len(e.tokens) for e in cache.host) == [30, 43]


def test_a_host_resume_whose_eviction_fills_host_ram_takes_its_entry_first(model):
    """Resuming conversation A from host RAM into a seq that holds B pushes B out to host RAM; with
    room for one conversation there, the budget then drops the least recently used entry, which is
    A's own. A is taken out first, so the resume completes (it failed with a 500 in the server's
    stress run) and goes on exactly as a fresh evaluation."""
    model.reset()
    a, b = list(range(100, 140)), list(range(200, 240))
    cache = PromptCache(model, 1, budget_bytes=1 << 30)
    _hold(model, cache, 0, a)
    cache.apply(cache.lookup(b, [0]), 0)           # B pushes A out to host RAM
    _hold(model, cache, 0, b)
    cache.budget = cache.nbytes() + 1024           # room for one conversation's copy
    back = cache.lookup(a + [5, 6], [0])
    assert (back.how, back.pos) == ("host", len(a))
    cache.apply(back, 0)
    assert model.tokens(0) == a and [e.tokens for e in cache.host] == [b]
    got = model.eval([5, 6], seq=0)
    want = Model.logits_for(model, a + [5, 6])[-1]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_copy_ahead_never_pushes_out_what_host_ram_holds(model):
    model.reset()
    cache = PromptCache(model, 2, budget_bytes=1 << 30)
    for seq, t in enumerate([list(range(100, 140)), list(range(200, 240))]):
        _hold(model, cache, seq, t)
    other = cache._copy(1)             # host RAM holds another conversation's entry
    cache.budget = cache.nbytes()      # and is full
    assert not cache.copy_ahead([0, 1]) and cache.host == [other]


def test_worker_compaction_puts_generating_jobs_side_by_side(model):
    """Jobs generating in seqs 0 and 2 with one reading its prompt in seq 1: after compaction the
    generating ones are in seqs 0-1, each with its own tokens, the reader in seq 2."""
    from deltarun.apps.serve.worker import GenParams, Job, Worker
    from deltarun.apps.serve.protocol import SamplingRequest

    model.reset()
    w = Worker(lambda: model, 3)
    w.model, w.cache = model, PromptCache(model, 3, 1 << 30)
    jobs = []
    for seq, state in ((0, "decode"), (1, "prefill"), (2, "decode")):
        model.eval(list(range(10 + seq, 30 + 2 * seq)), seq=seq)
        j = Job(GenParams(prompt=[], max_tokens=1, req=SamplingRequest()), lambda ev: None)
        j.seq, j.state = seq, state
        jobs.append(j)
    held = {j.id: model.tokens(j.seq) for j in jobs}
    w._active = list(jobs)
    w._compact()
    assert [j.seq for j in jobs] == [0, 2, 1]
    assert all(model.tokens(j.seq) == held[j.id] for j in jobs)


def test_the_first_token_goes_out_before_the_prompt_end_is_checkpointed(tiny_model_path, monkeypatch):
    """The prompt's last chunk is evaluated, then its first token is sampled and streamed, then the
    prompt's end is checkpointed (a copy of the recurrent state to host memory, which a request's
    time to first token need not wait for); the checkpoint still holds the state after the prompt,
    the one a fresh evaluation of the prompt leaves."""
    import threading

    from deltarun.apps.serve.protocol import SamplingRequest
    from deltarun.apps.serve.worker import GenParams, Job, Worker

    events: list = []
    taken: list[tuple[int, int]] = []        # (position, events emitted before it) per checkpoint
    checkpoint = PromptCache.checkpoint

    def spy(self, seq, logits=None, state=None):
        taken.append((state.n_past if state is not None else self.model.n_past(seq), len(events)))
        return checkpoint(self, seq, logits, state)

    monkeypatch.setattr(PromptCache, "checkpoint", spy)
    path = tiny_model_path("tiny", "f32")
    w = Worker(lambda: Model(path, n_ctx=256, n_seq_max=2, n_threads=1), 2)
    w.start()
    try:
        assert w.ready.wait(60) and w.load_error is None
        prompt = list(range(10, 40))
        done = threading.Event()

        def emit(ev) -> None:
            events.append(ev)
            if ev.finish_reason is not None or ev.error is not None:
                done.set()

        job = Job(GenParams(prompt=prompt, max_tokens=3, req=SamplingRequest(ignore_eos=True, logprobs=True)), emit)
        w.submit(job)
        assert done.wait(60) and events[-1].error is None
        fresh = w.call(lambda m: (m.memory.clear_seq(1), m.eval(prompt, 1), m.memory.read_recurrent(1))[2]).result(60)
    finally:
        w.shutdown(wait=30)
    assert [pos for pos, _ in taken] == [len(prompt)]
    assert taken[0][1] == 1 and events[0].logprobs          # after the first token's event, before the second
    saved = w.cache.seqs[job.seq].checkpoints[len(prompt)].state
    assert saved.n_past == fresh.n_past == len(prompt)
    assert all(np.array_equal(saved.conv[il], fresh.conv[il]) and np.array_equal(saved.ssm[il], fresh.ssm[il])
               for il in fresh.ssm)


def test_the_first_token_is_handed_over_before_the_step_decodes_on(tiny_model_path):
    """The step that ends a prompt goes on to decode the new stream (and the others): the first
    token's event is handed to the server (`Worker.after_step`, which wakes the event loop) at once,
    not with the next token's at the end of that step."""
    import threading

    from deltarun.apps.serve.protocol import SamplingRequest
    from deltarun.apps.serve.worker import GenParams, Job, Worker

    events: list = []
    wakes: list[int] = []                   # events emitted so far, at each hand-over
    done = threading.Event()

    def emit(ev) -> None:
        events.append(ev)
        if ev.finish_reason is not None or ev.error is not None:
            done.set()

    path = tiny_model_path("tiny", "f32")
    w = Worker(lambda: Model(path, n_ctx=256, n_seq_max=2, n_threads=1), 2)
    w.after_step = lambda: wakes.append(len(events))
    w.start()
    try:
        assert w.ready.wait(60) and w.load_error is None
        w.submit(Job(GenParams(prompt=list(range(10, 40)), max_tokens=4, req=SamplingRequest(ignore_eos=True,
                                                                                           logprobs=True)), emit))
        assert done.wait(60) and events[-1].error is None
    finally:
        w.shutdown(wait=30)
    assert len(events) >= 2 and 1 in wakes


def test_message_boundaries_from_token_offsets_equal_retokenizing(model):
    """PromptBuilder finds a boundary's token count from the prompt tokens' byte offsets instead of
    tokenizing the text before it again: the same counts, on contents that start with spaces,
    newlines, brackets or think blocks, thinking on and off (and the slow way where a token's
    bytes are not the text's)."""
    import os

    from deltarun.apps.chat import followed_by_a_message
    from deltarun.apps.serve.prompts import PromptBuilder
    from deltarun.apps.serve.protocol import ChatRequest
    from deltarun.base.chat_template import ChatTemplate

    pb = PromptBuilder(model, ChatTemplate.builtin(), None)
    rng = np.random.default_rng(0)
    starts = ["", "\n", " ", "(", "\n\n", "<think>x</think>", "  ", "é"]
    words = "the cat sat on a mat, then 42 dogs ran off".split()
    for trial in range(40):
        msgs = []
        for _ in range(int(rng.integers(1, 4))):
            for role in ("user", "assistant"):
                body = " ".join(rng.choice(words, int(rng.integers(0, 8))))
                msgs.append({"role": role, "content": str(rng.choice(starts)) + body})
        msgs.pop()
        req = ChatRequest(messages=msgs, template_kwargs={"enable_thinking": bool(trial % 2)})
        text = pb._render(msgs, req, None, True)
        prompt = pb.tokenize(text)
        ends = pb._token_ends(text, prompt)
        assert ends is not None and int(ends[-1]) == len(text.encode())
        for i in range(1, len(msgs)):
            other = pb._render(followed_by_a_message(msgs[:i]), req, None, False)
            k = len(os.path.commonprefix([text, other]))
            assert 0 < pb._boundary(text, other, prompt, ends) == pb._boundary(text, other, prompt, None) <= len(prompt)
            assert k == len(text) or pb._boundary(text, other, prompt, ends) < len(prompt)
    assert pb._token_ends("something else", prompt) is None     # bytes that are not the text's


def test_a_next_turn_renders_only_its_new_boundaries(model, monkeypatch):
    """Stand-in renderings are remembered by the messages before them: a conversation's next turn
    renders the prompt, the answer-start probe and its two new messages' boundaries, and finds
    the same checkpoints as a builder that remembers nothing."""
    from deltarun.apps.serve.prompts import PromptBuilder
    from deltarun.apps.serve.protocol import ChatRequest
    from deltarun.base.chat_template import ChatTemplate

    pb = PromptBuilder(model, ChatTemplate.builtin(), None)
    calls = []
    real = pb._render
    monkeypatch.setattr(pb, "_render", lambda *a: calls.append(a) or real(*a))
    msgs = [{"role": "system", "content": "Be brief."}]
    for turn in range(4):
        msgs.append({"role": "user", "content": f"question {turn} about cats"})
        req = ChatRequest(messages=list(msgs), template_kwargs={"enable_thinking": False})
        calls.clear()
        params = pb.chat(req)
        fresh = PromptBuilder(model, ChatTemplate.builtin(), None).chat(req)
        assert params.checkpoints == fresh.checkpoints and params.answer_start == fresh.answer_start
        assert len(calls) == (len(msgs) + 1 if turn == 0 else 4)
        msgs.append({"role": "assistant", "content": f"answer {turn}"})
    other = ChatRequest(messages=list(msgs[:-1]), template_kwargs={"enable_thinking": True})
    calls.clear()
    pb.chat(other)                                    # other template options: rendered again
    assert len(calls) == len(msgs) + 1 - 1


@pytest.mark.parametrize("template", ["qwen3", "qwen35"])
def test_next_turn_is_where_the_next_prompt_starts_its_new_message(model, monkeypatch, template):
    """`PromptBuilder.next_turn` (what the server prefills ahead) is the next turn's prompt up to
    where its new message's text begins: those tokens start the next prompt, and two next prompts
    with different new messages agree on exactly that many tokens. Contents starting with spaces,
    newlines, brackets or think blocks; thinking on and off; the Qwen3 and Qwen3.5 templates. The
    rendering it made is the one the next turn finds its last boundary with (not rendered again)."""
    from shipped_data import QWEN35_TEMPLATE

    from deltarun.apps.chat import common_prefix_length
    from deltarun.apps.serve.prompts import PromptBuilder
    from deltarun.apps.serve.protocol import ChatRequest
    from deltarun.base.chat_template import ChatTemplate

    tmpl = ChatTemplate.builtin() if template == "qwen3" else ChatTemplate(QWEN35_TEMPLATE.read_text())
    pb = PromptBuilder(model, tmpl, None)
    rng = np.random.default_rng(1)
    starts = ["", "\n", " ", "(", "\n\n", "<think>x</think>", "  ", "é"]
    words = "the cat sat on a mat, then 42 dogs ran off".split()
    for trial in range(24):
        msgs = [{"role": "system", "content": "Be brief."}]
        for _ in range(int(rng.integers(1, 3))):
            msgs.append({"role": "user", "content": " ".join(rng.choice(words, int(rng.integers(1, 6))))})
            msgs.append({"role": "assistant", "content": " ".join(rng.choice(words, int(rng.integers(1, 6))))})
        msgs.pop()
        kwargs = {"enable_thinking": bool(trial % 2)}
        req = ChatRequest(messages=list(msgs), template_kwargs=kwargs)
        answer = str(rng.choice(starts)) + " ".join(rng.choice(words, int(rng.integers(0, 8))))
        ahead = pb.next_turn(req, answer)
        assert ahead is not None and ahead.ahead and ahead.answer_start == len(ahead.prompt)
        after = msgs + [{"role": "assistant", "content": answer}]
        calls = []
        real = pb._render
        monkeypatch.setattr(pb, "_render", lambda *a: calls.append(a) or real(*a))
        nxt = pb.chat(ChatRequest(messages=after + [{"role": "user", "content": "alpha beta"}], template_kwargs=kwargs))
        monkeypatch.undo()
        other = pb.chat(ChatRequest(messages=after + [{"role": "user", "content": "gamma"}], template_kwargs=kwargs))
        assert nxt.prompt[:len(ahead.prompt)] == ahead.prompt
        assert common_prefix_length(nxt.prompt, other.prompt) == len(ahead.prompt)
        assert len(ahead.prompt) in nxt.checkpoints           # the next turn checkpoints where it resumes
        stand_ins = [a[0] for a in calls if not a[3] and a[0][-1]["content"] == "\u0001"]
        assert stand_ins and after + [stand_ins[0][-1]] not in stand_ins


def test_prompt_cache_keeps_the_replaced_tail_aside(model):
    """Work ahead goes back to a checkpoint at the answer start and keeps what the seq held after
    it aside (`keep_tail`): the old prompt's end resumes from there with its logits (a
    regeneration) and continues exactly as a fresh evaluation would. A request going back keeps
    no aside (the copy would add to its time to first token). The aside counts against the budget
    and goes before any checkpoint does."""
    model.reset()
    cache = PromptCache(model, 3, budget_bytes=1 << 30)
    prompt = list(range(100, 140))
    answer = [7, 8, 9, 10, 11]
    ahead = prompt[:16] + list(range(200, 210))                      # the next turn's start

    model.eval(prompt[:16], seq=0)
    cache.checkpoint(0)
    logits_40 = model.eval(prompt[16:], seq=0)
    cache.checkpoint(0, logits=logits_40)
    model.eval(answer, seq=0)
    cache.finished(0, answer_start=16)
    r = cache.lookup(ahead, [0, 1, 2])
    assert (r.how, r.pos, r.seq) == ("checkpoint", 16, 0)
    cache.apply(r, 0, keep_tail=True)
    aside = cache.seqs[0].aside
    assert aside is not None and aside.start == 16 and sorted(aside.checkpoints) == [40]
    assert aside.tokens == prompt + answer and aside.kv.start == 16 and aside.kv.n == 45 - 16
    model.eval(ahead[16:], seq=0)
    cache.checkpoint(0)
    cache.finished(0, answer_start=len(ahead))
    assert cache.nbytes() == sum(c.nbytes for c in cache.seqs[0].checkpoints.values()) + aside.nbytes
    # the old prompt again (a regeneration): from the aside, nothing to evaluate
    r = cache.lookup(prompt, [0, 1, 2])
    assert (r.how, r.pos, r.seq) == ("aside", 40, 0)
    np.testing.assert_array_equal(r.logits, logits_40)
    cache.apply(r, 0)
    assert model.tokens(0) == prompt and cache.seqs[0].aside is None
    assert sorted(cache.seqs[0].checkpoints) == [16, 40]
    np.testing.assert_allclose(model.eval(answer, seq=0), Model.logits_for(model, prompt + answer)[-1],
                               rtol=1e-5, atol=1e-5)
    # a request going back to the answer start keeps nothing aside
    r = cache.lookup(ahead + [1, 2], [0])
    assert (r.how, r.pos) == ("checkpoint", 16)
    cache.apply(r, 0)
    assert model.tokens(0) == prompt[:16] and cache.seqs[0].aside is None
    # work ahead again, then a budget too tight for everything: the aside goes first
    model.eval(prompt[16:], seq=0)
    cache.checkpoint(0)
    model.eval(answer, seq=0)
    cache.finished(0, answer_start=16)
    cache.apply(cache.lookup(ahead, [0]), 0, keep_tail=True)
    assert cache.seqs[0].aside is not None
    cache.budget = cache.nbytes() - 1
    cache._enforce_budget()
    assert cache.seqs[0].aside is None and sorted(cache.seqs[0].checkpoints) == [16]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_a_seq_cut_below_its_aside_drops_it(model):
    """The aside's tail continues the seq's first `start` positions. Once the seq goes back
    below that start (here one position, to a checkpoint at 15) and other tokens fill those
    positions, the aside is no continuation any more: resending the old prompt (and its answer)
    must not resume from it, but give the logits of a fresh evaluation."""
    model.reset()
    cache = PromptCache(model, 3, budget_bytes=1 << 30)
    prompt = list(range(100, 140))
    answer = [7, 8, 9, 10, 11]
    ahead = prompt[:16] + list(range(200, 210))

    model.eval(prompt[:15], seq=0)
    cache.checkpoint(0)
    model.eval(prompt[15:16], seq=0)
    cache.checkpoint(0)
    cache.checkpoint(0, logits=model.eval(prompt[16:], seq=0))
    model.eval(answer, seq=0)
    cache.finished(0, answer_start=16)
    cache.apply(cache.lookup(ahead, [0]), 0, keep_tail=True)          # work ahead: the tail goes aside
    assert cache.seqs[0].aside is not None and cache.seqs[0].aside.start == 16
    model.eval(ahead[16:], seq=0)
    cache.finished(0, answer_start=len(ahead))
    branch = prompt[:15] + [300, 301, 302]                            # position 15 gets another token
    r = cache.lookup(branch, [0])
    assert (r.how, r.pos, r.seq) == ("checkpoint", 15, 0)
    cache.apply(r, 0)
    model.eval(branch[15:], seq=0)
    cache.finished(0, answer_start=len(branch))
    # the old prompt again, then its answer
    r = cache.lookup(prompt, [0])
    cache.apply(r, 0)
    got = model.eval(prompt[r.pos:], seq=0) if r.pos < len(prompt) else r.logits
    got_answer = model.eval(answer, seq=0, all_logits=True)
    fresh = Model.logits_for(model, prompt + answer)
    assert rel_err(got, fresh[len(prompt) - 1]) < 1e-4 and rel_err(got_answer, fresh[len(prompt):]) < 1e-4


def test_a_lookup_after_a_rollback_plans_none_beyond_the_slots_left(tiny_model_path):
    """A seq ends with a 4-token verification step of which 2 drafts were rolled back: of the
    K-1 = 3 tokens its slots reached, 1 is left. A prompt that leaves the seq one token back rolls
    back; one that leaves it two back resumes from the checkpoint (a rollback there is one Memory
    refuses). Both go on as a fresh evaluation does."""
    with Model(tiny_model_path("tiny", "f32"), n_ctx=128, n_seq_max=2, n_ubatch=32, rs_slots=4, n_threads=1,
               kv_type="f32") as m:
        cache = PromptCache(m, 2, budget_bytes=1 << 30)
        prompt = list(range(100, 120))
        m.eval(prompt, seq=0)
        cache.checkpoint(0)
        m.eval([7, 8, 9, 10], seq=0, all_logits=True)
        m.rollback(2, 0)
        cache.finished(0, answer_start=len(prompt))
        assert m.tokens(0) == prompt + [7, 8]

        def check(new: list[int], want: tuple[str, int]) -> None:
            r = cache.lookup(prompt + new, [0])
            assert (r.how, r.pos, r.seq) == (*want, 0)
            cache.apply(r, 0)
            got = m.eval((prompt + new)[r.pos:], seq=0)
            m.memory.clear_seq(1)
            fresh = m.eval(prompt + new, seq=1)
            assert rel_err(got, fresh) < 1e-5
            cache.finished(0, answer_start=len(prompt))

        assert cache.lookup(prompt + [3, 4], [0]).how == "checkpoint"      # two tokens back: too far
        check([7, 5], ("rollback", 21))                                      # one back: the token left
        check([3, 4], ("checkpoint", 20))        # two back from [5], a 1-token ubatch, which reaches one


def test_kv_rows_read_and_written_from_a_start_position(model):
    model.reset()
    prompt = list(range(40, 80))
    model.eval(prompt, seq=0)
    whole = model.memory.read_kv(0, 40)
    tail = model.memory.read_kv(0, 40, start=25)
    assert (tail.n, tail.start) == (15, 25)
    for il, (k, v) in tail.rows.items():
        k_all, v_all = whole.rows[il]
        assert k.tobytes() == k_all[25 * len(k_all) // 40:].tobytes()
        assert v.tobytes() == np.ascontiguousarray(v_all[:, 25 * v_all.shape[1] // 40:]).tobytes()
    # seq 1: the first 25 positions from the whole copy, the rest from the tail
    model.memory.write_kv(1, whole, 25)
    model.memory.write_kv(1, tail)
    model.memory.write_recurrent(1, model.memory.read_recurrent(0))
    model.memory.set_tokens(1, prompt)
    np.testing.assert_array_equal(model.eval([3, 4], seq=1), model.eval([3, 4], seq=0))
    model.memory.clear_seq(1)
