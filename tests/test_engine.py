"""The decode engine (`runner.engine`): many sequences in one ubatch, each keeping what the
float64 reference keeps, with drafts verified, filler and rejected drafts rolled back, and a
failing sequence ending alone."""

from __future__ import annotations

import numpy as np
import pytest

from deltarun.runner.engine import Engine, Running
from deltarun.runner.model import Model
from deltarun.runner.sampling import GREEDY, LogitsProcessors, Sampler
from deltarun.runner.speculative import DraftLength, MtpDraft, NgramDraft

from reference import ReferenceModel
from test_sampling import _Grammar

N_NEW = 12


def _reference_greedy(path, prompt: list[int], n: int) -> list[int]:
    ref = ReferenceModel.from_gguf(path)
    logits = ref.forward(prompt)[-1]
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = ref.forward([out[-1]])[-1]
    return out


def still_wanted(running: list[Running], prompts: list[list[int]], n: int) -> list[Running]:
    """The sequences with fewer than n new tokens, each given the budget of what it still wants."""
    live = [s for s in running if len(s.history) - len(prompts[s.seq]) < n]
    for s in live:
        s.budget = n - (len(s.history) - len(prompts[s.seq]))
    return live


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    motif = [int(t) for t in rng.integers(3, 2000, 5)]
    return [motif * 3,                                        # repeats: n-gram drafts get accepted
            [int(t) for t in rng.integers(3, 2000, 9)],       # no drafts at all (padded with filler)
            [int(t) for t in rng.integers(3, 2000, 4)] * 3]


def test_sequences_in_one_ubatch_keep_what_the_reference_keeps(tiny_model_path):
    """Three sequences decoded together by greedy steps, two with n-gram drafts and one without:
    each sequence's tokens are the float64 reference's greedy continuation of its prompt, and after
    every step the model holds exactly each history but its last token (drafts rejected and filler
    rolled back)."""
    path = tiny_model_path("tiny-echo", "f32")
    prompts = _prompts()
    want = [_reference_greedy(path, p, N_NEW) for p in prompts]
    with Model(path, n_ctx=128, kv_type="f32", n_seq_max=3, rs_slots=4) as m:
        engine = Engine(m, max_rows=64)          # no row budget: up to 3 drafts each
        running = []
        for seq, p in enumerate(prompts):
            drafts = seq != 1
            s = Running(seq, Sampler(GREEDY), list(p), draft=NgramDraft() if drafts else None,
                        length=DraftLength(3) if drafts else None)
            engine.first(s, m.eval(p, seq))
            running.append(s)
        widths = []
        for _ in range(N_NEW):
            live = still_wanted(running, prompts, N_NEW)
            if not live:
                break
            outcomes = engine.step(live)
            assert all(o.error is None and not o.full for o in outcomes)
            for o in outcomes:               # greedy: each kept token is the argmax of the row it came from
                assert [int(np.argmax(row)) for row in o.logits] == o.tokens
            widths += [(len(run), width) for run, width in engine.last_runs]
            for s in live:
                assert m.tokens(s.seq) == s.history[:-1]
        got = [s.history[len(p):len(p) + N_NEW] for s, p in zip(running, prompts)]
    assert got == want
    assert any(n > 1 and width > 1 for n, width in widths)          # drafts and filler shared a ubatch
    assert running[0].n_accepted > 0 and running[1].n_drafted == 0
    assert running[0].n_drafted > running[0].n_accepted or running[2].n_drafted > running[2].n_accepted


class _FailingGrammar:
    """A grammar whose mask fails on its second call."""

    def __init__(self) -> None:
        self.calls = 0

    def mask(self, logits: np.ndarray) -> np.ndarray:
        self.calls += 1
        if self.calls == 2:
            raise RuntimeError("grammar failed")
        return logits

    def accept(self, token: int) -> None:
        pass


def test_a_failing_sequence_ends_alone_and_its_filler_is_rolled_back(tiny_model_path):
    path = tiny_model_path("tiny-echo", "f32")
    prompts = _prompts()
    with Model(path, n_ctx=128, kv_type="f32", n_seq_max=3, rs_slots=4) as m:
        engine = Engine(m)
        running = [Running(0, Sampler(GREEDY), list(prompts[0]), draft=NgramDraft(), length=DraftLength(3)),
                   Running(1, Sampler(GREEDY), list(prompts[1]), LogitsProcessors(grammar=_FailingGrammar())),
                   Running(2, Sampler(GREEDY), list(prompts[2]))]
        for s in running:
            engine.first(s, m.eval(prompts[s.seq], s.seq))
        ok, failed, plain = engine.step(running)
        assert engine.last_runs[0][1] > 1                       # seq 0's drafts widened the rows
        assert isinstance(failed.error, RuntimeError) and not failed.tokens
        assert ok.error is None and plain.error is None and ok.tokens and plain.tokens
        assert m.tokens(1) == running[1].history               # the pending token evaluated, filler gone
        assert m.tokens(0) == running[0].history[:-1] and m.tokens(2) == running[2].history[:-1]


def test_plain_steps_keep_their_start_only_for_sequences_that_may_be_undone(tiny_model_path):
    """A one-token step without drafts saves the state it started from (the token stays undoable
    within the rollback slots) when a sequence of its run is `undoable`; `generate`'s are not, and
    their steps leave nothing to undo, at no cost to the tokens."""
    path = tiny_model_path("tiny-echo", "f32")
    prompts = _prompts()
    kept = {}
    for undoable in (True, False):
        with Model(path, n_ctx=128, kv_type="f32", n_seq_max=2, rs_slots=3) as m:
            engine = Engine(m)
            running = [Running(i, Sampler(GREEDY), list(prompts[i]), undoable=undoable) for i in range(2)]
            for s in running:
                engine.first(s, m.eval(prompts[s.seq], s.seq))
            for _ in range(3):
                engine.step(running)
            assert [m.memory.rollback_limit(i) for i in range(2)] == ([1, 1] if undoable else [0, 0])
            kept[undoable] = [s.history for s in running]
            if undoable:
                m.rollback(1, 0)
                assert m.tokens(0) == running[0].history[:-2]
    assert kept[True] == kept[False]
    # one undoable sequence in the run keeps the start of every sequence's step
    with Model(path, n_ctx=128, kv_type="f32", n_seq_max=2, rs_slots=3) as m:
        engine = Engine(m)
        running = [Running(0, Sampler(GREEDY), list(prompts[0]), undoable=False),
                   Running(1, Sampler(GREEDY), list(prompts[1]))]
        for s in running:
            engine.first(s, m.eval(prompts[s.seq], s.seq))
        engine.step(running)
        assert m.memory.rollback_limit(1) == 1


def test_a_full_context_is_reported_not_evaluated(tiny_model_path):
    with Model(tiny_model_path("tiny", "f32"), n_ctx=16, n_seq_max=2) as m:
        engine = Engine(m)
        a = Running(0, Sampler(GREEDY), list(range(3, 19)))
        b = Running(1, Sampler(GREEDY), list(range(3, 8)))
        engine.first(a, m.eval(a.history, 0))
        engine.first(b, m.eval(b.history, 1))
        full, fine = engine.step([a, b])
        assert full.full and not full.tokens and fine.tokens and m.n_past(0) == 16


@pytest.mark.parametrize("presence,frequency", [(0.0, 0.0), (250.0, 0.0), (0.0, 120.0)])
def test_kept_tokens_count_for_the_penalties(tiny_model_path, presence, frequency):
    """The engine moves a sequence's logits processors past every kept token, so OpenAI's
    presence/frequency penalties see the tokens generated so far: the step's choice equals the
    argmax of the logits minus count * frequency + (count > 0) * presence, computed here. (The
    echo model repeats its last token by a margin of about 190 logits: hence the large penalties.)"""
    prompt = _prompts()[0]                       # a motif the echo model goes on repeating
    with Model(tiny_model_path("tiny-echo", "f32"), n_ctx=64) as m:
        engine = Engine(m)
        procs = LogitsProcessors(presence_penalty=presence, frequency_penalty=frequency)
        s = Running(0, Sampler(GREEDY), list(prompt), procs)
        engine.first(s, m.eval(prompt))
        counts: dict[int, int] = {s.history[-1]: 1}
        changed = 0
        for _ in range(8):
            outcome, = engine.step([s])
            raw = outcome.logits[0].astype(np.float64)
            row = raw.copy()
            for t, c in counts.items():
                row[t] -= c * frequency + presence
            assert outcome.tokens == [int(np.argmax(row))]
            changed += int(np.argmax(row)) != int(np.argmax(raw))
            counts[outcome.tokens[0]] = counts.get(outcome.tokens[0], 0) + 1
        assert dict(procs.counts) == counts
        assert (changed > 0) == bool(presence or frequency)


@pytest.mark.parametrize("n_seqs,most_drafts", [(1, 3), (2, 3), (4, 1), (8, 0)])
def test_drafts_fit_the_row_budget(tiny_model_path, n_seqs, most_drafts):
    """On the CPU a step's ubatch holds at most Engine.CPU_ROWS = 8 rows when sequences share it
    (the matrix kernels read the weights once for up to 8 columns): 2 sequences draft up to
    draft-max 3, 4 sequences 1 each, 8 none; one sequence alone is not limited."""
    path = tiny_model_path("tiny-echo", "f32")
    motif = _prompts()[0]
    with Model(path, n_ctx=128, n_seq_max=n_seqs, rs_slots=4) as m:
        engine = Engine(m)
        assert engine.max_rows == Engine.CPU_ROWS
        running = [Running(i, Sampler(GREEDY), list(motif), draft=NgramDraft(), length=DraftLength(3))
                   for i in range(n_seqs)]
        for s in running:
            engine.first(s, m.eval(motif, s.seq))
        widths = []
        for _ in range(4):
            outcomes = engine.step(running)
            widths += [w for _, w in engine.last_runs]
            assert all(len(o.tokens) <= 1 + most_drafts for o in outcomes)
        assert max(widths) == 1 + most_drafts



@pytest.mark.parametrize("n_seqs,ride,most_drafts", [(1, 4, 3), (1, 6, 1), (2, 4, 1), (2, 6, 0), (1, 8, 0)])
def test_a_riding_prompt_chunk_takes_its_rows_first(tiny_model_path, n_seqs, ride, most_drafts):
    """`Engine.step(..., ride=...)`: the prompt chunk's rows come out of the row budget before the
    drafts (8 rows: a 4-token chunk leaves one sequence 3 drafts, two 1 each), it is evaluated in
    the step (its sequence grows by it), and the decoding sequences keep what they keep without it."""
    from deltarun.runner.model import PromptChunk

    path = tiny_model_path("tiny-echo", "f32")
    motif = _prompts()[0]
    kept = []
    for with_ride in (False, True):
        with Model(path, n_ctx=128, n_seq_max=n_seqs + 1, rs_slots=4) as m:
            engine = Engine(m)
            running = [Running(i, Sampler(GREEDY), list(motif), draft=NgramDraft(), length=DraftLength(3))
                       for i in range(n_seqs)]
            for s in running:
                engine.first(s, m.eval(motif, s.seq))
            prompt = list(range(100, 140))
            m.eval(prompt[:5], n_seqs)
            widths = []
            for step in range(3):
                chunk = PromptChunk(n_seqs, prompt[5 + ride * step:5 + ride * (step + 1)]) if with_ride else None
                outcomes = engine.step(running, ride=chunk)
                assert all(o.error is None for o in outcomes)
                widths += [w for _, w in engine.last_runs]
            if with_ride:
                assert max(widths) == 1 + most_drafts
                assert m.tokens(n_seqs) == prompt[:5 + 3 * ride]
                engine.step(running, ride=PromptChunk(n_seqs, []))          # not evaluable: left out alone
                engine.step(running, ride=PromptChunk(n_seqs, [10**9]))
                assert m.tokens(n_seqs) == prompt[:5 + 3 * ride]
            else:
                for _ in range(2):
                    engine.step(running)
            kept.append([s.history for s in running])
    for a, b in zip(*kept):                     # fewer drafts, the same greedy tokens
        n = min(len(a), len(b))
        assert a[:n] == b[:n] and n >= len(_prompts()[0]) + 1 + 5


def test_a_chunk_rides_in_the_graph_of_one_greedy_mtp_sequence(tiny_model_path):
    """One sequence drafting with the MTP block greedily verifies with the block in its graph
    (`mtp_argmax`), unless a prompt chunk rides along: then the chunk goes into that one graph and
    the source fills its MTP rows afterwards (it used to be evaluated apart: every weight read a
    second time). The sequence keeps the float64 reference's greedy tokens either way, and the chunk
    is evaluated."""
    from deltarun.runner.model import PromptChunk

    path = tiny_model_path("tiny-mtp")
    p = _prompts()[0][:9]
    want = _reference_greedy(path, p, N_NEW)
    chunk_prompt = list(range(100, 140))
    for with_ride in (False, True):
        with Model(path, n_ctx=128, kv_type="f32", n_seq_max=2, rs_slots=4, mtp=True) as m:
            engine = Engine(m, max_rows=8)
            s = Running(0, Sampler(GREEDY), list(p), draft=MtpDraft(m, seq=0), length=DraftLength(3))
            logits = m.eval(p, 0, all_hidden=True)
            engine.first(s, logits, (list(p[1:]), m.last_hidden[0], 0))
            m.eval(chunk_prompt[:4], 1)
            done, graphs = 4, []
            while len(s.history) - len(p) < N_NEW:
                ride = PromptChunk(1, chunk_prompt[done:done + 4]) if with_ride and done < 36 else None
                before = m.stats.n_eval_calls
                s.budget = N_NEW - (len(s.history) - len(p))
                (outcome,) = engine.step([s], ride=ride)
                assert outcome.error is None
                graphs.append(m.stats.n_eval_calls - before)
                done += len(ride.tokens) if ride is not None else 0
            assert s.history[len(p):len(p) + N_NEW] == want
            if with_ride:
                assert m.tokens(1) == chunk_prompt[:done] and done > 8
                assert graphs[:(done - 4) // 4] == [1] * ((done - 4) // 4)     # the chunk in the step's graph
            assert s.n_drafted > 0


def test_models_step_sixteen_rows_where_ggml_multiplies_sixteen_columns_at_once(tiny_model_path, monkeypatch):
    """Engine.max_rows on the CPU: WIDE_ROWS (16) for a model whose layer matrices are of a type
    ggml multiplies by 16 columns at once (AMX tiles: Q8_0, F16, BF16, Q4_K; Q8_0's column lanes on
    AVX-512 VNNI), then 4 sequences draft 3 each; else CPU_ROWS (8): F32 weights, or without them."""
    import deltarun.runner.engine as engine_module
    from deltarun.base.ggml_compat import ggml, wide_columns

    motif = _prompts()[0]
    with Model(tiny_model_path("tiny", "f32"), n_ctx=32) as m:
        assert wide_columns(ggml.GGML_TYPE_F32) == 0 and Engine(m).max_rows == Engine.CPU_ROWS
    for wtype, gtype in (("bf16", ggml.GGML_TYPE_BF16), ("f16", ggml.GGML_TYPE_F16), ("q4_k", ggml.GGML_TYPE_Q4_K)):
        with Model(tiny_model_path("tiny", wtype), n_ctx=32) as m:
            want = Engine.WIDE_ROWS if wide_columns(gtype) >= 16 else Engine.CPU_ROWS
            assert Engine(m).max_rows == want
            monkeypatch.setattr(engine_module, "wide_columns", lambda t, g=gtype: 16 if t == g else 0)
            assert Engine(m).max_rows == Engine.WIDE_ROWS
            monkeypatch.setattr(engine_module, "wide_columns", lambda t, g=gtype: 0 if t == g else 16)
            assert Engine(m).max_rows == Engine.CPU_ROWS
            monkeypatch.setattr(engine_module, "wide_columns", wide_columns)
    with Model(tiny_model_path("tiny-echo", "q8_0"), n_ctx=128, n_seq_max=4, rs_slots=4) as m:
        want = Engine.WIDE_ROWS if wide_columns(ggml.GGML_TYPE_Q8_0) >= 16 else Engine.CPU_ROWS
        assert Engine(m).max_rows == want
        monkeypatch.setattr(engine_module, "wide_columns", lambda t: 16 if t == ggml.GGML_TYPE_Q8_0 else 0)
        engine = Engine(m)
        assert engine.max_rows == Engine.WIDE_ROWS
        running = [Running(i, Sampler(GREEDY), list(motif), draft=NgramDraft(), length=DraftLength(3))
                   for i in range(4)]
        for s in running:
            engine.first(s, m.eval(motif, s.seq))
        widths = []
        for _ in range(4):
            engine.step(running)
            widths += [w for _, w in engine.last_runs]
        assert max(widths) == 4
        monkeypatch.setattr(engine_module, "wide_columns", lambda t: 0)
        assert Engine(m).max_rows == Engine.CPU_ROWS


def _reference_mtp_chain(path, history: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """The greedy MTP chain the float64 reference drafts after `history` (its last token not yet
    evaluated), and the logits each draft after the first was drawn from: the block over rows
    (hidden_i, token_i+1) of every evaluated position, then each draft fed back with the block's
    output hidden state at the next position."""
    from reference import rmsnorm

    ref = ReferenceModel.from_gguf(path)
    ref.forward(history[:-1])
    hidden = rmsnorm(ref.hidden(), ref.hp.eps) * ref.w["output_norm.weight"]
    logits, out = ref.mtp_forward(history[1:], hidden)
    chain, rows = [int(np.argmax(logits[-1]))], []
    while len(chain) < n:
        logits, out = ref.mtp_forward(chain[-1:], out[-1:])
        rows.append(logits[-1])
        chain.append(int(np.argmax(logits[-1])))
    return chain, rows


def test_mtp_chains_of_several_sequences_advance_together(tiny_model_path, monkeypatch):
    """Three sequences drafting 3 tokens each with the MTP block: each chain level of the three is
    one MTP ubatch of three one-token rows (two a step, not six), each sequence's drafts are the
    float64 reference's MTP chain after its history, and each keeps the reference's greedy
    continuation over the following steps (drafts mostly rejected: random weights)."""
    import deltarun.runner.engine as engine_module

    path = tiny_model_path("tiny-mtp")
    prompts = [p[:9] for p in _prompts()]
    want = [_reference_greedy(path, p, N_NEW) for p in prompts]
    chain_calls: list[int] = []
    chain_logits: list[list[np.ndarray]] = []      # per chain call, per sequence of its run
    proposed: list[tuple[list[int], list[int]]] = []
    mtp_eval_rows, propose_mtp = Model.mtp_eval_rows, engine_module.propose_mtp

    chaining = []

    def counted(self, rows, seq_head):
        results = mtp_eval_rows(self, rows, seq_head)
        if chaining:
            chain_calls.append(len(rows))
            chain_logits.append([logits for logits, _ in results])
        return results

    def recorded(model, wants):
        chaining.append(True)
        try:
            drafts = propose_mtp(model, wants)
        finally:
            chaining.clear()
        proposed.extend((list(history), d.tokens) for (_, history, _, _), d in zip(wants, drafts))
        return drafts
    monkeypatch.setattr(Model, "mtp_eval_rows", counted)
    monkeypatch.setattr(engine_module, "propose_mtp", recorded)
    with Model(path, n_ctx=128, kv_type="f32", n_seq_max=3, rs_slots=4, mtp=True) as m:
        engine = Engine(m, max_rows=64)
        running = []
        for seq, p in enumerate(prompts):
            s = Running(seq, Sampler(GREEDY), list(p), draft=MtpDraft(m, seq=seq), length=DraftLength(3))
            logits = m.eval(p, seq, all_hidden=True)
            engine.first(s, logits, (list(p[1:]), m.last_hidden[0], 0))
            running.append(s)
        assert all(o.error is None for o in engine.step(running))
        assert chain_calls == [3, 3]
        first_step = [list(level) for level in chain_logits]
        for _ in range(N_NEW):
            live = still_wanted(running, prompts, N_NEW)
            if not live:
                break
            assert all(o.error is None for o in engine.step(live))
        got = [s.history[len(p):len(p) + N_NEW] for s, p in zip(running, prompts)]
    assert len(proposed) >= 3 and all(len(d) == 3 for _, d in proposed[:3])
    for i, (history, drafts) in enumerate(proposed):
        chain, rows = _reference_mtp_chain(path, history, len(drafts))
        assert drafts == chain
        if i < 3:          # the first step: levels 1 and 2 of sequence i against the reference's
            for level, want_row in enumerate(rows):
                got_row = first_step[level][i]
                assert np.abs(got_row - want_row).max() / np.abs(want_row).max() < 1e-5
    assert got == want


@pytest.mark.parametrize("ignore_eos", [False, True])
@pytest.mark.parametrize("length", [4, 5, 6])
def test_a_draft_that_completes_the_grammar_ends_the_step_there(tiny_model_path, length, ignore_eos):
    """Drafts that are the greedy answer, under a grammar complete after `length` tokens: at a
    step's last draft (4: the first token, then 3 drafts), at the token drawn after them (5) or at
    a step's first draft, drafts after it (6). A draft that completes it ends the step there with
    no token after it (only the end of generation could follow: with ignore_eos, banned) and the
    sequence holds every kept token; either way the draft source is handed each kept token at the
    position of the row it follows (history[start + i + 1] == next_tokens[i])."""
    from test_thinking_budget import _Oracle     # (it imports this module)

    class Recorder(_Oracle):
        """Drafts the answer itself (every draft is kept) and records what each step commits."""

        def __init__(self, prompt: list[int], answer: list[int]):
            super().__init__(prompt, answer)
            self.commits: list[tuple[int, list[int]]] = []

        def commit(self, next_tokens, hiddens, start) -> None:
            self.commits.append((start, list(next_tokens)))

    path = tiny_model_path("tiny-echo", "f32")
    prompt = _prompts()[0]
    answer = _reference_greedy(path, prompt, N_NEW)
    end = 0                                             # a token the answer does not hold
    assert end not in answer
    with Model(path, n_ctx=128, kv_type="f32", rs_slots=4) as m:
        engine = Engine(m, max_rows=64)
        source = Recorder(prompt, answer)
        others = [t for t in range(m.hp.n_vocab) if t != end]
        processors = LogitsProcessors(banned=[end] if ignore_eos else (), grammar=_Grammar(others, length, end))
        s = Running(0, Sampler(GREEDY), list(prompt), processors, draft=source, length=DraftLength(3))
        engine.first(s, m.eval(prompt, 0))
        for _ in range(N_NEW):
            o, = engine.step([s])
            assert o.error is None
            if processors.ended:
                break
        assert s.history == prompt + answer[:length] and len(o.logits) == len(o.tokens)
        at_draft = len(o.tokens) == o.n_accepted       # no token drawn after the kept drafts
        assert at_draft == (length != 5)                 # 5: the first token and a step of 3 drafts and the next
        assert m.tokens(0) == (s.history if at_draft else s.history[:-1])
    for start, tokens in source.commits:
        assert tokens == s.history[start + 1:start + 1 + len(tokens)]
    assert source.commits[-1][0] + len(source.commits[-1][1]) == len(s.history) - 1
