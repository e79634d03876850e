"""The server's per-step shortcuts give the same results as the plain paths: step graphs kept
allocated on their own schedulers, re-allocation through GraphLayout, compaction with the fewest
swaps, greedy rows sampled together, pre-encoded SSE events and merged queued text events."""

from __future__ import annotations

import asyncio
import ctypes
import types

import numpy as np
import pytest

from deltarun.apps.serve.output import Delta
from deltarun.apps.serve.protocol import SamplingRequest
from deltarun.apps.serve.worker import Event, GenParams, Job, Worker
from deltarun.base.ggml_util import ggml
from deltarun.runner import scheduler
from deltarun.runner.model import Model
from deltarun.runner.sampling import Sampler, SamplingParams, sample_rows


# --- sampling -------------------------------------------------------------------------------------
PARAMS = [
    SamplingParams(temperature=0.0),                                              # greedy
    SamplingParams(temperature=0.0, repeat_penalty=1.5, repeat_last_n=8),          # greedy with a penalty
    SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=1),
    SamplingParams(temperature=0.0, repeat_penalty=0.7, repeat_last_n=-1),         # penalty on all history
    SamplingParams(temperature=1.3, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.2, seed=7),
    SamplingParams(temperature=0.5, top_k=5, seed=None),
]


def _case(seed: int, vocab: int = 300) -> tuple[np.ndarray, list[list[int]]]:
    rng = np.random.default_rng(seed)
    logits = (rng.normal(size=(len(PARAMS), vocab)) * 3).astype(np.float32)
    # histories that hit the best tokens, so the penalties change the argmax
    hist = [[int(t) for t in np.argsort(-row)[:3]] + [int(rng.integers(vocab)) for _ in range(5)] for row in logits]
    return logits, hist


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sample_rows_equals_sampling_each_row(seed):
    """Greedy rows (with and without repetition penalties) and seeded random rows give the tokens
    sampling each row alone gives, step after step (each sampler's generator moves the same way)."""
    logits, hist = _case(seed)
    # the penalties matter here: without them the greedy row with one would pick another token
    plain = [Sampler(SamplingParams(temperature=0.0)) for _ in PARAMS]
    assert sample_rows(plain, logits, hist)[1] != sample_rows([Sampler(p) for p in PARAMS], logits, hist)[1]
    alone = [Sampler(p) for p in PARAMS]
    together = [Sampler(p) for p in PARAMS]
    for step in range(20):
        want = [s.sample(logits[i], hist[i]) for i, s in enumerate(alone)]
        got = sample_rows(together, logits, hist)
        for i, p in enumerate(PARAMS):
            if p.greedy or p.seed is not None:       # an unseeded row draws from its own entropy
                assert got[i] == want[i], (step, i)
        logits = np.roll(logits, 7, axis=1)          # another step: other logits, the generators moved on
        hist = [h[1:] + [int(np.argmax(logits[i]))] for i, h in enumerate(hist)]


def test_sample_rows_refuses_mismatched_rows():
    with pytest.raises(ValueError):
        sample_rows([Sampler()], np.zeros((2, 4), dtype=np.float32), [[], []])


# --- step graphs and re-allocation -------------------------------------------------------------------
def _alternating_run(path, keep: bool) -> tuple[np.ndarray, int]:
    """Decode 3 sequences greedily, sometimes as two ubatches, with prompt chunks in between;
    returns every step's logits and how many allocations the schedulers did."""
    allocations = 0
    with Model(path, n_ctx=128, n_seq_max=4, n_ubatch=16, n_threads=1) as m:
        if keep:
            m.keep_step_graphs(3)
        real = scheduler.Scheduler.allocate

        def counting(self, gf, ctx):
            nonlocal allocations
            allocations += not self.holds(gf)
            real(self, gf, ctx)
        scheduler.Scheduler.allocate = counting
        try:
            toks = {s: [int(np.argmax(m.eval([3 + s, 9, 4, 1, 7], s)))] for s in range(3)}
            steps = []
            for step in range(18):
                if step % 3:
                    out = m.eval_batch(toks)
                else:                                     # two runs: seqs 0-1 and seq 2
                    out = {**m.eval_batch({0: toks[0], 1: toks[1]}), 2: m.eval(toks[2], 2)}
                if step % 4 == 0:                         # a prompt chunk on seq 3 between the steps
                    m.eval([5, 6, 7, 8, 9][: 2 + step % 3], 3)
                steps.append(np.stack([out[s] for s in range(3)]))
                toks = {s: [int(np.argmax(out[s]))] for s in range(3)}
        finally:
            scheduler.Scheduler.allocate = real
    return np.stack(steps), allocations


def test_step_graphs_stay_allocated_and_compute_the_same(tiny_model_path):
    path = tiny_model_path("tiny", "f32")
    plain, n_plain = _alternating_run(path, keep=False)
    kept, n_kept = _alternating_run(path, keep=True)
    assert np.array_equal(plain, kept)                    # the same logits, bit for bit
    assert n_kept < n_plain / 2, (n_kept, n_plain)        # only the prompt graphs re-allocate


def test_a_graph_moved_to_another_scheduler_is_allocated_anew(tiny_model_path):
    """A step graph that `sched` allocated meanwhile (a graph dump does) is not trusted where it
    was: both schedulers forget it, it is allocated again, and the logits are those of a model
    that never kept step graphs."""
    path = tiny_model_path("tiny", "f32")
    with Model(path, n_ctx=64, n_seq_max=2, n_threads=1) as m, Model(path, n_ctx=64, n_seq_max=2, n_threads=1) as ref:
        m.keep_step_graphs(2)
        for model in (m, ref):
            model.eval([4, 5, 6], 0)
            model.eval([4, 5, 6], 1)
        assert np.array_equal(m.eval([7], 0), ref.eval([7], 0))
        g = next(g for shape, g in m._graphs.items() if shape.n_seq_tokens == 1)
        assert any(s.holds(g.gf) for s in m._step_scheds) and not m.sched.holds(g.gf)
        m.sched.allocate(g.gf, g.ctx)                    # what graph_dump does with model.sched
        assert np.array_equal(m.eval([8], 0), ref.eval([8], 0))
        holders = [s for s in [m.sched] + m._step_scheds if s.holds(g.gf)]
        assert len(holders) == 1 and holders[0] is not m.sched
        assert np.array_equal(m.eval_batch({0: [9], 1: [9]})[1], ref.eval_batch({0: [9], 1: [9]})[1])


def test_graph_layout_resets_like_restore_srcs_and_forget_addresses(tiny_model_path):
    """GraphLayout.reset puts back every node's own srcs and clears every tensor's address, as
    restore_srcs + forget_addresses do; it refuses (matches) another graph."""
    with Model(tiny_model_path("tiny", "f32"), n_ctx=64, n_threads=1) as m:
        m.eval(list(range(5, 13)))
        m.eval([3])                                      # another graph is allocated now
        g = next(x for shape, x in m._graphs.items() if shape.n_seq_tokens == 8)
        other = next(x for shape, x in m._graphs.items() if shape.n_seq_tokens == 1)
        key = ctypes.addressof(g.gf.contents)
        saved = m.sched._pristine[key]
        layout = m.sched._layouts[key]
        assert layout is not None and layout.matches(g.gf, g.ctx) and not layout.matches(other.gf, other.ctx)
        node = next(ggml.ggml_graph_node(g.gf, i) for i in range(ggml.ggml_graph_n_nodes(g.gf))
                    if ggml.ggml_graph_node(g.gf, i).contents.src[0])
        original = ctypes.addressof(node.contents.src[0].contents)
        node.contents.src[0] = ggml.ggml_graph_node(g.gf, 0)        # as a cross-backend split would
        assert node.contents.data                                  # it still has its old address
        layout.reset()
        assert ctypes.addressof(node.contents.src[0].contents) == original
        assert scheduler.snapshot_srcs(g.gf) == saved
        t = ggml.ggml_get_first_tensor(g.ctx)
        while t:                                                    # every tensor forgot its address
            assert not t.contents.data and not t.contents.buffer
            t = ggml.ggml_get_next_tensor(g.ctx, t)
        want = m.logits_for(list(range(5, 13)))                     # and the graph computes as before
        with Model(tiny_model_path("tiny", "f32"), n_ctx=64, n_threads=1) as ref:
            assert np.array_equal(want, ref.logits_for(list(range(5, 13))))


def _walk(ctx) -> list[int]:
    out, t = [], ggml.ggml_get_first_tensor(ctx)
    while t:
        out.append(ctypes.addressof(t.contents))
        t = ggml.ggml_get_next_tensor(ctx, t)
    return out


def test_tensor_and_node_addresses_read_at_once_equal_ggmls_walk(tiny_model_path):
    """backend.tensor_addresses checks the context's object chain with numpy; node_addresses reads
    the graph's node array: both equal what ggml's own accessors give, and a context whose chain
    is not one stride (tensors with data in it) is walked instead."""
    from deltarun.runner.model import Model

    with Model(tiny_model_path("tiny", "f32"), n_ctx=64, n_threads=1, capture_slots=2) as m:
        m.eval(list(range(5, 30)), captures=[4, 11])
        m.eval([3])
        for g in m._graphs.values():
            assert scheduler.tensor_addresses(g.ctx).tolist() == _walk(g.ctx)
            n = ggml.ggml_graph_n_nodes(g.gf)
            assert scheduler.node_addresses(g.gf).tolist() == [ctypes.addressof(ggml.ggml_graph_node(g.gf, i).contents)
                                                        for i in range(n)]
    params = ggml.ggml_init_params(mem_size=1 << 20, mem_buffer=None, no_alloc=False)
    ctx = ggml.ggml_init(params)
    try:
        for n in (3, 100, 7, 1):                        # data inside the context: sizes differ
            ggml.ggml_new_tensor_1d(ctx, ggml.GGML_TYPE_F32, n)
        assert scheduler.tensor_addresses(ctx).tolist() == _walk(ctx) and len(_walk(ctx)) == 4
    finally:
        ggml.ggml_free(ctx)


# --- compaction -----------------------------------------------------------------------------------
class _SwapLog:
    def __init__(self):
        self.swaps: list[tuple[int, int]] = []

    def swap(self, a: int, b: int) -> None:
        self.swaps.append((a, b))


def _jobs(layout: dict[int, str]) -> list[Job]:
    jobs = []
    for seq, state in layout.items():
        j = Job(GenParams(prompt=[1, 2, 3], max_tokens=4, req=SamplingRequest()), lambda ev: None)
        j.seq, j.state = seq, state
        jobs.append(j)
    return jobs


@pytest.mark.parametrize("layout, swaps", [
    # all 8 seqs busy, a new request reads its prompt in the hole at seq 3: one swap with the last
    ({0: "decode", 1: "decode", 2: "decode", 3: "prefill", 4: "decode", 5: "decode", 6: "decode", 7: "decode"},
     [(7, 3)]),
    # generating jobs scattered over free seqs: each one outside seqs 0-2 moves into a free one
    ({0: "decode", 4: "decode", 6: "decode"}, [(4, 1), (6, 2)]),
    # two readers: the first admitted goes right after the generating ones
    ({1: "prefill", 0: "decode", 2: "decode", 3: "prefill"}, [(2, 1)]),
])
def test_compaction_moves_as_few_cells_as_it_needs(layout, swaps):
    w = Worker(lambda: None, 8)
    w.cache = log = _SwapLog()
    jobs = _jobs(layout)
    w._active = list(jobs)
    w._compact()
    assert log.swaps == swaps
    decoding = sorted(j.seq for j in jobs if j.state == "decode")
    assert decoding == list(range(len(decoding)))
    reading = [j.seq for j in jobs if j.state != "decode"]
    assert reading == list(range(len(decoding), len(decoding) + len(reading)))
    assert len({j.seq for j in jobs}) == len(jobs)


# --- riding prompt chunks -------------------------------------------------------------------------
def _riding_worker(decode_s: float) -> Worker:
    """A worker with three generating jobs, an engine of 16 rows a step and a model whose graphs take
    riding chunks: `_ride` and `_adapt_ride` need no more."""
    w = Worker(lambda: None, 4)
    w.engine = types.SimpleNamespace(max_rows=16)
    w.model = types.SimpleNamespace(family=types.SimpleNamespace(rides=True),
                                    memory=types.SimpleNamespace(n_capture=4))
    w._active = _jobs({0: "decode", 1: "decode", 2: "decode"})
    w._decode_s = decode_s
    return w


def _reader(n: int) -> Job:
    j = Job(GenParams(prompt=list(range(100, 100 + n)), max_tokens=4, req=SamplingRequest()), lambda ev: None)
    j.seq, j.state, j.pos = 3, "prefill", 0
    return j


def _read(w: Worker, job: Job, added: float | list[float]) -> list[int]:
    """Ride `job`'s prompt to its end, each chunk adding `added` seconds to its step (or chunk i
    added[i], the last for the rest); the chunk sizes."""
    w._active.append(job)
    sizes = []
    while job.pos < len(job.params.prompt):
        chunk = w._ride(job)
        sizes.append(len(chunk.tokens))
        w._adapt_ride(len(chunk.tokens), added if isinstance(added, float) else added[min(len(sizes), len(added)) - 1])
        job.pos += len(chunk.tokens)
    w._active.remove(job)
    return sizes


def test_a_prompt_starts_riding_at_what_the_last_prompts_first_chunk_adapted_to():
    """A short chat prompt ends before its own chunks adapt: its first chunk fills the row budget
    (16 rows less 3 decoding), and the next prompt starts at the size that chunk adapted to, so a
    27-token prompt rides in one step once a cheap first chunk doubled (MTP's 80 ms steps)."""
    w = _riding_worker(decode_s=0.080)
    assert _read(w, _reader(27), added=0.002) == [13, 14]       # 13 doubled to 26, the rest was cut short
    assert _read(w, _reader(27), added=0.002) == [26, 1]         # started at 26 (doubled again: 52)
    assert _read(w, _reader(27), added=0.002) == [27]
    assert _read(w, _reader(120), added=0.050) == [52, 52, 16]   # 50 ms: kept (past 1/2.2 of 0.8 steps)
    assert _read(w, _reader(27), added=0.002) == [27]


def test_a_prompt_starts_at_its_predecessors_first_chunk_not_its_last():
    """A long prompt's later chunks cost more (attention over its positions): they shrink its own
    chunks, while the next prompt starts where the first chunk left the size."""
    w = _riding_worker(decode_s=0.080)
    assert _read(w, _reader(100), added=[0.002, 0.070])[:5] == [13, 26, 13, 6, 4]
    assert _read(w, _reader(100), added=0.030)[0] == 26


def test_a_costly_first_chunk_does_not_shrink_the_next_prompts_start():
    """Where a chunk filling the row budget costs most of a step (plain decoding's 40 ms steps), the
    halved size is this prompt's, not the next one's: each prompt starts by filling the rows."""
    w = _riding_worker(decode_s=0.040)
    assert _read(w, _reader(40), added=0.035)[:3] == [13, 6, 4]     # halved down to RIDE_MIN
    assert _read(w, _reader(40), added=0.035)[:2] == [13, 6]


# --- HTTP side ------------------------------------------------------------------------------------
def test_sse_bytes_are_what_sse_starlette_would_send():
    from sse_starlette.event import ensure_bytes

    from deltarun.apps.serve.app import _sse

    for data in ('{"a": "b c", "d": [1, 2]}', "[DONE]", '{"x": "caf\\u00e9 \\u2603"}'):
        assert _sse(data) == ensure_bytes({"data": data}, "\r\n")


def test_queued_text_events_of_a_stream_are_merged():
    from deltarun.apps.serve.relay import Relay

    async def run() -> list[Event]:
        relay = Relay.__new__(Relay)
        relay.queue, relay.finished, relay._held = asyncio.Queue(), False, None
        relay.state = types.SimpleNamespace(answered=lambda params, ev: None)
        relay.job = Job(GenParams(prompt=[1], max_tokens=4, req=SamplingRequest()), lambda ev: None)
        for ev in (Event(delta=Delta("a")), Event(delta=Delta("b")), Event(logprobs=[{"t": 1}]),
                   Event(delta=Delta("c"), finish_reason="stop", result={}), Event(delta=Delta("never"))):
            relay.queue.put_nowait(ev)
        return [ev async for ev in relay.events()]

    got = asyncio.run(run())
    assert [(e.delta.content if e.delta else None, e.logprobs, e.finish_reason) for e in got] == [
        ("ab", [{"t": 1}], None), ("c", None, "stop")]


def test_text_chunks_spliced_into_their_json_are_the_json():
    import json

    from deltarun.apps.serve.app import _chunk, _ContentChunk, _sse

    def choice(text):
        return {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
    for model in ("deltarun", 'a "content": "" model'):          # a model name cannot fool the split
        fast = _ContentChunk(_chunk("chatcmpl-1", model, 1700000000, choice(""), "chat.completion.chunk"))
        for text in ("hello", ' "quoted" ', "caf\u00e9 \u2603\n\t", "</s>", "\\"):
            want = _sse(json.dumps(_chunk("chatcmpl-1", model, 1700000000, choice(text), "chat.completion.chunk")))
            assert fast.encode(text) == want
