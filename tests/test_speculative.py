"""Rollback of the recurrent state, and speculative decoding that keeps greedy output unchanged."""

from __future__ import annotations

from dataclasses import replace as dataclass_replace

import numpy as np
import pytest

from deltarun.base.errors import RollbackError
from deltarun.runner.generation import GenerationStats, generate_tokens
from deltarun.runner.model import Model
from deltarun.runner.sampling import GREEDY, Distribution, Sampler, SamplingParams, accept_draft
from deltarun.runner.speculative import Draft, ModelDraft, MtpDraft, NgramDraft

from reference import ReferenceModel


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 2300, n)]


@pytest.mark.parametrize("delta_net", ["fused", "primitive"])
@pytest.mark.parametrize("m_tokens,r", [(2, 1), (4, 3), (3, 3), (1, 1), (5, 2), (70, 3)])
def test_rollback_restores_the_state_r_tokens_back(tiny_model_path, delta_net, m_tokens, r):
    """After a ubatch of m tokens and a rollback of r, the next token sees exactly the state of a
    run that never evaluated those r tokens (compared with the numpy reference)."""
    path = tiny_model_path("tiny")
    head, ubatch, nxt = prompt(6, 1), prompt(m_tokens, 2), prompt(3, 3)
    ref = ReferenceModel.from_gguf(path)
    ref.forward(head + ubatch[: m_tokens - r])
    expected = ref.forward(nxt)
    with Model(path, n_ctx=256, kv_type="f32", rs_slots=5, delta_net=delta_net) as m:
        m.eval(head)
        m.eval(ubatch)
        m.rollback(r)
        assert m.n_past() == len(head) + m_tokens - r
        assert m.tokens() == head + ubatch[: m_tokens - r]
        got = m.eval(nxt, all_logits=True)
    assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-5


def test_rollback_in_two_steps_equals_one(tiny_model_path):
    path = tiny_model_path("tiny")
    toks = prompt(8, 4)
    with Model(path, n_ctx=64, kv_type="f32", rs_slots=6) as m:
        m.eval(toks)
        m.rollback(2)
        m.rollback(3)
        a = m.eval([7])
        m.reset()
        m.eval(toks[:3])
        b = m.eval([7])
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_rollback_beyond_the_slots_is_an_error(tiny_model_path):
    with Model(tiny_model_path("tiny"), n_ctx=64, rs_slots=3) as m:
        m.eval(prompt(6))
        with pytest.raises(RollbackError, match="rollback slots"):
            m.rollback(3)            # K - 1 = 2 slots back at most
        before = m.tokens()
        m.eval([5])
        with pytest.raises(RollbackError):
            m.rollback(2)            # a one-token ubatch reaches back one token
        m.rollback(1)                # ... to the state it started from
        assert m.tokens() == before
        with pytest.raises(RollbackError):
            m.rollback(1)            # and no further
        m.rollback(0)
    with Model(tiny_model_path("tiny"), n_ctx=64) as m:
        m.eval(prompt(4))
        with pytest.raises(RollbackError):
            m.rollback(1)            # K = 1: nothing can be rolled back


def _plain(path, toks, n, **kw) -> list[int]:
    with Model(path, n_ctx=256, kv_type="f32", **kw) as m:
        return list(generate_tokens(m, toks, n, Sampler(GREEDY)))


def _speculative(path, toks, n, make_draft, draft_max, **kw) -> tuple[list[int], GenerationStats]:
    """Speculative greedy decoding; also checks that every rejected draft was rolled back, so the
    target holds exactly the prompt and the emitted tokens (all but the last, not yet evaluated)."""
    with Model(path, n_ctx=256, kv_type="f32", rs_slots=draft_max + 1, **kw) as m:
        draft = make_draft(m)
        stats = GenerationStats()
        rolled_back = []
        real_rollback = m.rollback
        m.rollback = lambda n_tokens, seq=0: (rolled_back.append(n_tokens), real_rollback(n_tokens, seq))[1]
        out = list(generate_tokens(m, toks, n, Sampler(GREEDY), stats=stats, draft=draft, draft_max=draft_max))
        draft.close()
        assert sum(rolled_back) == stats.n_drafted - stats.n_accepted
        assert m.tokens() == toks + out[:-1]
        return out, stats


def _ngram_by_windows(h: list[int], n: int, n_max: int = 4, n_min: int = 1) -> list[int]:
    """Prompt lookup written plainly: for each length from n_max down, every earlier window equal
    to the history's last tokens, latest first; the first with n tokens after it (up to an image's
    negative ids), else the longest."""
    for size in range(min(n_max, len(h) - 1), n_min - 1, -1):
        best: list[int] = []
        for start in range(len(h) - 1 - size, -1, -1):
            if h[start:start + size] != h[len(h) - size:]:
                continue
            follow = []
            for t in h[start + size:start + size + n]:
                if t < 0:
                    break
                follow.append(t)
            if len(follow) > len(best):
                best = follow
            if len(best) == n:
                break
        if best:
            return best
    return []


def test_ngram_drafts_are_those_of_a_plain_window_search():
    """NgramDraft finds occurrences from the positions of the last token and keeps the history as
    an array that grows with it: on random histories of few distinct tokens (many matches of every
    length), with image rows (negative ids), grown step by step through one source, shortened,
    replaced by another list or its last token changed, its drafts are those of the plain search
    over every window."""
    rng = np.random.default_rng(5)
    for case in range(60):
        n_max, n_min = int(rng.integers(1, 6)), 1 + int(rng.integers(0, 2))
        src = NgramDraft(n_max=n_max, n_min=min(n_min, n_max))
        h = [int(t) for t in rng.integers(0, 1 + int(rng.integers(2, 9)), size=int(rng.integers(1, 30)))]
        for step in range(40):
            n = int(rng.integers(1, 9))
            want = _ngram_by_windows(h, n, n_max, min(n_min, n_max))
            assert src.propose(h, n, None).tokens == want, (case, step, h, n)
            r = rng.random()
            if r < 0.1:
                h.append(-3)                               # an image row
            elif r < 0.15:
                del h[max(1, len(h) - 3):]                 # shorter (a new generation on the list)
            elif r < 0.2:
                h = list(h)                                # another list
                h[-1] = int(rng.integers(0, 9))
            elif r < 0.25:
                h[-1] = int(rng.integers(0, 9))            # the last token changed in place
            else:
                h.extend(int(t) for t in rng.integers(0, 9, size=int(rng.integers(1, 4))))
    src, h = NgramDraft(), []
    while len(h) < 1500:                                   # one history growing past the array's first sizes
        h.extend(int(t) for t in rng.integers(0, 40, size=int(rng.integers(1, 30))))
        assert src.propose(h, 5, None).tokens == _ngram_by_windows(h, 5)


@pytest.mark.parametrize("draft_max", [1, 3, 7])
def test_ngram_and_mtp_drafts_all_accepted_keep_greedy_output(tiny_model_path, draft_max):
    """The echo preset repeats its input, so n-gram and MTP drafts are (nearly) all right."""
    path = tiny_model_path("tiny-echo")
    toks = prompt(12, 5)
    base = _plain(path, toks, 40)
    out, st = _speculative(path, toks, 40, lambda m: NgramDraft(), draft_max)
    assert out == base
    assert st.acceptance > 0.8 and st.tokens_per_step > 1.5
    out, st = _speculative(path, toks, 40, lambda m: MtpDraft(m), draft_max, mtp=True)
    assert out == base
    assert st.acceptance == 1.0
    assert st.n_steps < 40 // (draft_max + 1) + 2


@pytest.mark.parametrize("draft_max", [2, 5])
def test_draft_model_all_and_none_accepted(tiny_model_path, draft_max):
    target = tiny_model_path("tiny-mtp")      # same trunk as "tiny": that draft is always right
    toks = prompt(10, 6)
    base = _plain(target, toks, 30)

    def same(m):
        return ModelDraft(Model(tiny_model_path("tiny"), n_ctx=256, kv_type="f32", n_seq_max=2), m.hp.n_vocab)

    def other(m):
        return ModelDraft(Model(tiny_model_path("tiny", "q8_0", seed=7), n_ctx=256, n_seq_max=2), m.hp.n_vocab)

    out, st = _speculative(target, toks, 30, same, draft_max)
    assert out == base and st.acceptance == 1.0
    out, st = _speculative(target, toks, 30, other, draft_max)
    # rejected and rolled back (then drafting pauses: DraftLength)
    assert out == base and st.n_accepted <= 1 and st.n_drafted >= draft_max + 1


def test_drafts_on_random_models_never_change_greedy_output(tiny_model_path):
    """No draft source is right here (random weights): every step rolls back, output unchanged."""
    path = tiny_model_path("tiny-mtp")
    toks = prompt(10, 8)
    base = _plain(path, toks, 25)
    for make, kw in ((lambda m: NgramDraft(), {}), (lambda m: MtpDraft(m), {"mtp": True})):
        out, st = _speculative(path, toks, 25, make, 4, **kw)
        assert out == base
        # drafts were made and (nearly all) rejected: _speculative checked each was rolled back
        assert st.n_drafted - st.n_accepted >= 4


def test_speculative_sampling_keeps_the_target_distribution():
    """Accept with min(1, p/q), resample from max(p - q, 0): the first emitted token follows p."""
    rng = np.random.default_rng(0)
    vocab = 6
    logits = rng.standard_normal((2, vocab)).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1))
    p = sampler.distribution(logits[0])
    q = np.array([0.5, 0.1, 0.1, 0.1, 0.1, 0.1])
    counts = np.zeros(vocab)
    n = 20000
    for _ in range(n):
        d = int(sampler.rng.choice(vocab, p=q))
        n_ok, nxt = accept_draft(sampler, logits, Draft([d], [Distribution.of_dense(q)]), [])
        counts[d if n_ok == 1 else nxt] += 1
    # 4 standard deviations of a binomial proportion at n = 20000 is below 0.015
    np.testing.assert_allclose(counts / n, p, atol=0.015)
    # a point-mass draft (n-gram) is accepted with probability p[d]
    acc = sum(accept_draft(sampler, logits, Draft([2], [None]), [])[0] for _ in range(n)) / n
    assert abs(acc - p[2]) < 0.015


def test_generate_cli_with_draft_matches_plain(tiny_model_path):
    from click.testing import CliRunner

    from deltarun.cli.main import cli

    path = str(tiny_model_path("tiny-echo"))
    args = ["generate", path, "-p", "one two three one two", "-n", "24", "--temp", "0", "--threads", "1",
            "--kv-type", "f32"]
    plain = CliRunner().invoke(cli, args)
    spec = CliRunner().invoke(cli, args + ["--draft", "ngram", "--draft-max", "4", "--vs-plain"])
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout
    assert "drafts accepted" in spec.stderr and "same tokens" in spec.stderr


def test_mtp_block_matches_reference(tiny_model_path):
    """The MTP graph against the numpy reference: rows (trunk hidden after output_norm, next token)."""
    from reference import rmsnorm

    path = tiny_model_path("tiny-mtp")
    toks = prompt(20, 9)
    ref = ReferenceModel.from_gguf(path)
    ref.forward(toks)
    hidden = rmsnorm(ref.hidden(), ref.hp.eps) * ref.w["output_norm.weight"]
    nxt = toks[1:] + [17]
    exp_logits, exp_out = ref.mtp_forward(nxt[:12], hidden[:12])
    exp_logits2, _ = ref.mtp_forward(nxt[12:], hidden[12:])
    with Model(path, n_ctx=64, kv_type="f32", mtp=True) as m:
        m.eval(toks, all_logits=True)
        h = m.last_hidden[0]
        np.testing.assert_allclose(h, hidden, rtol=1e-4, atol=1e-4)
        got, out = m.mtp_eval(nxt[:12], h[:12], 0)
        got2, _ = m.mtp_eval(nxt[12:], h[12:], 12)       # continues over its own KV cache
    scale = np.abs(exp_logits).max()
    assert np.abs(got - exp_logits).max() / scale < 1e-5
    assert np.abs(got2 - exp_logits2).max() / scale < 1e-5
    np.testing.assert_allclose(out, exp_out, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("lengths", [(3, 3, 3), (1, 3, 2)])
def test_mtp_rows_of_several_sequences_in_one_ubatch_match_reference(tiny_model_path, lengths):
    """`Model.mtp_eval_rows`: three sequences' MTP rows in one ubatch, of equal or unequal lengths
    (the shorter padded past their last position): each sequence's last-row logits and output
    equal the float64 reference's for that sequence alone, and its padding does not disturb the
    next rows (a second call continues over each sequence's own MTP KV cache)."""
    from reference import rmsnorm

    path = tiny_model_path("tiny-mtp")
    prompts = [prompt(12, 30 + i) for i in range(3)]
    with Model(path, n_ctx=64, kv_type="f32", mtp=True, n_seq_max=3, rs_slots=4) as m:
        hidden = []
        for i, toks in enumerate(prompts):
            m.eval(toks, i, all_logits=True)
            hidden.append(m.last_hidden[0])
        first = [(toks[1:6], h[:5], 0) for toks, h in zip(prompts, hidden)]       # 5 rows each
        m.mtp_eval_rows(first, 0)
        rows = [(toks[6:6 + n], h[5:5 + n], 5) for toks, h, n in zip(prompts, hidden, lengths)]
        got = m.mtp_eval_rows(rows, 0)
        after = [(toks[6 + n:8 + n], h[5 + n:7 + n], 5 + n) for toks, h, n in zip(prompts, hidden, lengths)]
        got_after = m.mtp_eval_rows(after, 0)      # 2 rows each, over what the padding wrote
    for i, toks in enumerate(prompts):
        ref = ReferenceModel.from_gguf(path)
        ref.forward(toks)
        h = rmsnorm(ref.hidden(), ref.hp.eps) * ref.w["output_norm.weight"]
        ref.mtp_forward(toks[1:6], h[:5])
        n = lengths[i]
        exp, exp_out = ref.mtp_forward(toks[6:6 + n], h[5:5 + n])
        assert np.abs(got[i][0] - exp[-1]).max() / np.abs(exp).max() < 1e-5
        np.testing.assert_allclose(got[i][1], exp_out[-1:], rtol=1e-4, atol=1e-4)
        exp2, _ = ref.mtp_forward(toks[6 + n:8 + n], h[5 + n:7 + n])
        assert np.abs(got_after[i][0] - exp2[-1]).max() / np.abs(exp2).max() < 1e-5


@pytest.mark.parametrize("n_ubatch", [32, 8])
def test_all_hidden_gives_every_rows_hidden_state_and_the_last_logits(tiny_model_path, n_ubatch):
    """`Model.eval(..., all_hidden=True)` (a prompt whose rows the MTP block reads): every token's
    hidden state after the final norm and the last token's logits, equal to the float64
    reference's, in one ubatch and across three."""
    from reference import rmsnorm

    path = tiny_model_path("tiny-mtp")
    toks = prompt(20, 12)
    ref = ReferenceModel.from_gguf(path)
    want = ref.forward(toks)[-1]
    hidden = rmsnorm(ref.hidden(), ref.hp.eps) * ref.w["output_norm.weight"]
    with Model(path, n_ctx=64, kv_type="f32", mtp=True, rs_slots=4, n_ubatch=n_ubatch) as m:
        got = m.eval(toks, all_hidden=True)
        rows = m.last_hidden[0]
    assert got.shape == want.shape and rows.shape == hidden.shape
    assert np.abs(got - want).max() / np.abs(want).max() < 1e-5
    np.testing.assert_allclose(rows, hidden, rtol=1e-4, atol=1e-4)


def test_checkpoint_restore_returns_to_the_prompt_state(tiny_model_path):
    path = tiny_model_path("tiny")
    a, b, c = prompt(9, 20), prompt(7, 21), prompt(3, 22)
    with Model(path, n_ctx=64, kv_type="f32") as m:
        m.eval(a)
        cp = m.checkpoint()
        m.eval(b)
        for t in b[:3]:
            m.eval([t])
        m.restore(cp)
        assert m.n_past() == len(a) and m.tokens() == a
        got = m.eval(c, all_logits=True)
        m.reset()
        expected = m.eval(a + c, all_logits=True)[len(a):]
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
        assert not m.can_restore(cp)             # the reset cut the sequence below the checkpoint
        with pytest.raises(RollbackError, match="stale"):
            m.restore(cp)


def test_a_checkpoint_before_a_rollback_is_stale_once_those_positions_are_evaluated_again(tiny_model_path):
    """A checkpoint at length 9, then a rollback of 2 and two other tokens evaluated at positions
    7-8: the KV rows there are the new tokens', so the checkpoint cannot be restored any more. One
    taken at 7, where the rollback stopped, still can, and goes on as a run that never saw the
    rolled-back tokens (the numpy reference)."""
    path = tiny_model_path("tiny")
    a, b, c, d = prompt(7, 30), prompt(2, 31), prompt(2, 32), prompt(3, 33)
    ref = ReferenceModel.from_gguf(path)
    ref.forward(a)
    expected = ref.forward(d)
    with Model(path, n_ctx=64, kv_type="f32", rs_slots=4) as m:
        m.eval(a)
        at_7 = m.checkpoint()
        m.eval(b)
        at_9 = m.checkpoint()
        m.rollback(2)
        m.eval(c)                                # positions 7-8 again, other tokens
        assert m.tokens() == a + c
        assert not m.can_restore(at_9)
        with pytest.raises(RollbackError, match="stale"):
            m.restore(at_9)
        assert m.tokens() == a + c               # a refused restore changes nothing
        assert m.can_restore(at_7)
        m.restore(at_7)
        assert m.n_past() == 7 and m.tokens() == a
        got = m.eval(d, all_logits=True)
    assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-5


@pytest.mark.parametrize("preset", ["tiny-echo", "tiny-mtp"])
@pytest.mark.parametrize("draft", ["ngram", "mtp"])
def test_chat_with_draft_gives_the_plain_answers(tiny_model_path, draft, preset):
    from click.testing import CliRunner

    from deltarun.cli.main import cli

    path = str(tiny_model_path(preset))
    args = ["chat", path, "-n", "12", "--temp", "0", "--threads", "1", "--kv-type", "f32", "--no-think"]
    messages = "Hello there\nsay it again\n"
    plain = CliRunner().invoke(cli, args, input=messages)
    spec = CliRunner().invoke(cli, args + ["--draft", draft, "--draft-max", "3"], input=messages)
    assert plain.exit_code == 0 and spec.exit_code == 0, spec.output
    assert spec.stdout == plain.stdout and len(plain.stdout) > 10


# --- the MTP block inside the verification graph (Model.eval(..., mtp_argmax=True)) ---------------
def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def check_mtp_in_graph(path, delta_net: str, ref, final_norm) -> None:
    """A trunk ubatch with the MTP block on every row's (argmax, hidden), after a prompt whose MTP
    rows were evaluated separately: the argmax tokens are the trunk logits' own, and the MTP logits
    and outputs equal the float64 reference's on those rows (continuing over its MTP KV cache) and a
    separate `mtp_eval` of the same rows, within the F32 bound of the forward tests (1e-5)."""
    toks = prompt(19, 9)
    n_prompt = 15
    ref_logits = ref.forward(toks)
    hidden = final_norm(ref.hidden())
    with Model(path, n_ctx=64, kv_type="f32", mtp=True, rs_slots=4, delta_net=delta_net) as m:
        m.eval(toks[:n_prompt], all_logits=True)
        m.mtp_eval(toks[1:n_prompt + 1], m.last_hidden[0], 0)      # prompt rows (hidden_i, token_{i+1})
        logits = m.eval(toks[n_prompt:], all_logits=True, mtp_argmax=True)
        rows = m.last_mtp
        assert (rows.seq, rows.start) == (0, n_prompt)
        again, again_out = m.mtp_eval(rows.tokens, m.last_hidden[0], n_prompt)   # the same rows, separately
    assert rows.tokens == np.argmax(logits, axis=1).tolist() == np.argmax(ref_logits[n_prompt:], axis=1).tolist()
    ref.mtp_forward(toks[1:n_prompt + 1], hidden[:n_prompt])
    exp, exp_out = ref.mtp_forward(rows.tokens, hidden[n_prompt:])
    assert rel_err(rows.logits, exp) < 1e-5
    np.testing.assert_allclose(rows.out, exp_out, rtol=1e-4, atol=1e-4)
    assert rel_err(rows.logits, again) < 1e-5
    np.testing.assert_allclose(rows.out, again_out, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("delta_net", ["fused", "primitive"])
def test_mtp_in_graph_matches_reference(tiny_model_path, delta_net):
    from reference import rmsnorm

    path = tiny_model_path("tiny-mtp")
    ref = ReferenceModel.from_gguf(path)
    check_mtp_in_graph(path, delta_net, ref, lambda h: rmsnorm(h, ref.hp.eps) * ref.w["output_norm.weight"])


class RecordingMtpDraft(MtpDraft):
    """Records each round's first-draft logits and proposal, and the separate MTP evaluations."""

    def __init__(self, target: Model, in_graph: bool):
        super().__init__(target, in_graph=in_graph)
        self.rounds: list[tuple[np.ndarray, list[int]]] = []
        self.mtp_rows_evaluated = 0
        real, real_rows = target.mtp_eval, target.mtp_eval_rows

        def counted(tokens, hidden, start, seq=0, n_outputs=None):
            self.mtp_rows_evaluated += len(tokens)
            return real(tokens, hidden, start, seq, n_outputs)

        def counted_rows(rows, seq_head):       # chained drafts (speculative.propose_mtp)
            self.mtp_rows_evaluated += sum(len(tokens) for tokens, _, _ in rows)
            return real_rows(rows, seq_head)
        target.mtp_eval, target.mtp_eval_rows = counted, counted_rows

    def propose(self, history, n, sampler):
        first = None if self.first is None else self.first[0].copy()
        d = super().propose(history, n, sampler)
        self.rounds.append((first, d.tokens))
        return d


@pytest.mark.parametrize("preset,delta_net,draft_max", [("tiny-mtp", "fused", 1), ("tiny-mtp", "primitive", 3),
                                                        ("tiny-qwen35", "fused", 3), ("tiny-qwen35moe", "primitive", 1),
                                                        ("tiny-qwen35moe", "fused", 2)])
def test_mtp_drafts_in_graph_equal_separate_ones(tiny_model_path, monkeypatch, preset, delta_net, draft_max):
    """Random weights: nearly every draft is rejected and rolled back, so the MTP KV rows of
    rejected positions (written by the verification graph) must be masked and overwritten like the
    trunk's. Every round's first-draft logits and drafts equal those of separate MTP evaluations,
    greedy output is plain decoding's, and in the graph no kept row is evaluated twice: separate MTP
    rows are only the prompt's and the chained drafts'. (Drafting never pauses here: every step
    drafts, as the comparison needs.)"""
    from deltarun.runner.speculative import DraftLength

    monkeypatch.setattr(DraftLength, "MIN_ACCEPTANCE", 0.0)
    path = tiny_model_path(preset)
    toks = prompt(10, 8)
    base = _plain(path, toks, 16, delta_net=delta_net)
    runs = {}
    for in_graph in (True, False):
        made = []

        def make(m, in_graph=in_graph):
            made.append(RecordingMtpDraft(m, in_graph))
            return made[-1]
        out, st = _speculative(path, toks, 16, make, draft_max, mtp=True, delta_net=delta_net)
        assert out == base
        runs[in_graph] = (made[0], st)
    fused, separate = runs[True][0], runs[False][0]
    assert len(fused.rounds) == len(separate.rounds) >= runs[True][1].n_steps - 1   # no draft in a last 1-token step
    for (f_logits, f_tokens), (s_logits, s_tokens) in zip(fused.rounds, separate.rounds):
        assert f_tokens == s_tokens
        if f_logits is not None:
            assert rel_err(f_logits, s_logits) < 1e-5
    chained = sum(max(len(t) - 1, 0) for _, t in fused.rounds)
    assert fused.mtp_rows_evaluated == len(toks) + chained
    assert separate.mtp_rows_evaluated > fused.mtp_rows_evaluated


def test_mtp_commit_reuses_graph_rows_up_to_the_first_other_token(tiny_model_path):
    """When a kept token is not its row's argmax (sampled decoding), the rows from there on are
    evaluated again: the next first draft equals a run that evaluated every row separately."""
    path = tiny_model_path("tiny-mtp")
    toks = prompt(12, 3)
    firsts = []
    for in_graph in (True, False):
        with Model(path, n_ctx=64, kv_type="f32", mtp=True, rs_slots=4) as m:
            draft = MtpDraft(m, in_graph=in_graph)
            m.eval(toks[:9], all_logits=True)
            draft.commit(toks[1:10], m.last_hidden[0], 0)
            m.eval(toks[9:12], all_logits=True, mtp_argmax=in_graph)
            if in_graph:
                kept = list(m.last_mtp.tokens)
                kept[1] = (kept[1] + 1) % m.hp.n_vocab          # row 1 kept another token
            else:
                kept = firsts[0][1]
            draft.commit(kept, m.last_hidden[0], 9)
            firsts.append((draft.first[0].copy(), kept))
    assert rel_err(firsts[0][0], firsts[1][0]) < 1e-5


def test_sampled_mtp_drafts_use_separate_evaluations(tiny_model_path):
    """With temperature > 0 the next token is not the argmax: verification graphs stay plain."""
    path = tiny_model_path("tiny-mtp")
    params = SamplingParams(temperature=0.8, seed=3)
    with Model(path, n_ctx=128, kv_type="f32", mtp=True, rs_slots=3) as m:
        draft = MtpDraft(m)
        assert not draft.wants_mtp_argmax(Sampler(params)) and draft.wants_mtp_argmax(Sampler(GREEDY))
        assert not draft.wants_mtp_argmax(Sampler(SamplingParams(temperature=0.0, repeat_penalty=1.1)))
        out = list(generate_tokens(m, prompt(8, 2), 12, Sampler(params), draft=draft, draft_max=2))
        assert len(out) == 12 and m.last_mtp is None


def test_mtp_argmax_needs_the_mtp_block_and_every_row(tiny_model_path):
    from deltarun.base.errors import DeltarunError

    with Model(tiny_model_path("tiny-mtp"), n_ctx=64, rs_slots=3) as m:
        with pytest.raises(DeltarunError, match="MTP block"):
            m.eval([1, 2], all_logits=True, mtp_argmax=True)
    with Model(tiny_model_path("tiny-mtp"), n_ctx=64, rs_slots=3, mtp=True) as m:
        with pytest.raises(DeltarunError, match="every row"):
            m.eval([1, 2], mtp_argmax=True)
        assert m.n_past() == 0


def test_small_mtp_graphs_leave_the_trunk_graph_allocated(tiny_model_path):
    """A step's MTP rows (up to rs_slots) run on their own scheduler: the trunk's verification graph
    is not re-allocated after each of them (what made separate MTP drafts cost several steps)."""
    with Model(tiny_model_path("tiny-mtp"), n_ctx=64, kv_type="f32", rs_slots=3, mtp=True) as m:
        m.eval(prompt(6), all_logits=True)
        m.eval([4, 5], all_logits=True)
        trunk = m.sched._allocated
        m.mtp_eval([7, 8], m.last_hidden[0], 6)
        assert m.sched._allocated is trunk and m._mtp_sched._allocated is not None
        m.mtp_eval(prompt(4), m.last_hidden[0].repeat(2, 0), 0)     # more rows than slots: the trunk's scheduler
        assert m.sched._allocated is not trunk


def test_qwen35_echo_preset_accepts_every_mtp_draft(tiny_model_path):
    """models/qwen35.py's echo models (residual_scale near 0, tied embeddings; the bench-qwen35-echo
    presets at real shapes): greedy repeats the last token and every MTP draft is right; the same
    weights at full residual scale give drafts that are almost never right."""
    echo = tiny_model_path("tiny-qwen35", tie_word_embeddings=True, residual_scale=1e-3)
    toks = prompt(8, 9)
    base = _plain(echo, toks, 24)
    assert base == [toks[-1]] * 24
    out, st = _speculative(echo, toks, 24, lambda m: MtpDraft(m), 3, mtp=True)
    assert out == base and st.acceptance == 1.0 and st.tokens_per_step > 3.5
    plain = tiny_model_path("tiny-qwen35", tie_word_embeddings=True)
    base = _plain(plain, toks, 24)
    out, st = _speculative(plain, toks, 24, lambda m: MtpDraft(m), 3, mtp=True)
    assert out == base and st.acceptance < 0.5


def _lengths(length, accepted_of) -> list[int]:
    """Drive a DraftLength: each step asks for a length and reports accepted_of(k) of k accepted."""
    out = []
    for _ in range(200):
        k = length.next()
        out.append(k)
        length.update(k, accepted_of(k))
    return out


def test_draft_length_grows_shrinks_and_pauses_when_drafts_are_wrong():
    from deltarun.runner.speculative import DraftLength

    assert _lengths(DraftLength(5), lambda k: k)[:3] == [5, 5, 5]       # all right: the full length
    length = DraftLength(5)
    length.update(5, 2)
    assert length.next() == 3                                           # one past the accepted ones
    length.update(3, 3)
    assert length.next() == 4                                           # all accepted: one more
    wrong = _lengths(DraftLength(3), lambda k: 0)
    # two failing steps, then pauses of 4, 8, 16, 32, 64, 64 steps, each followed by a 1-token probe
    assert wrong[:2] == [3, 1] and wrong[2:6] == [0] * 4 and wrong[6] == 1 and wrong[7:15] == [0] * 8
    assert sum(wrong) <= 12 and sum(1 for k in wrong if k) <= 8
    # a probe that is accepted resumes drafting
    length = DraftLength(3)
    for _ in range(7):
        length.update(length.next(), 0)
    assert length.probing is False and length.paused == 8               # the probe failed: twice the pause
    length = DraftLength(3)
    for _ in range(6):
        length.update(length.next(), 0)
    assert length.next() == 1
    length.update(1, 1)
    assert length.next() == 2 and length.paused == 0


def test_mtp_deferred_rows_give_the_drafts_of_rows_committed_at_once(tiny_model_path):
    """MtpDraft(defer=True) keeps rows aside and evaluates them in one ubatch (LM head on the last
    row only) when a draft is asked for: the drafts and the MTP block's first logits are those of
    rows committed one step at a time."""
    path = tiny_model_path("tiny-mtp")
    toks = prompt(10, 12)
    firsts = {}
    for defer in (False, True):
        with Model(path, n_ctx=256, kv_type="f32", rs_slots=4, mtp=True) as m:
            d = MtpDraft(m, in_graph=False, defer=defer)
            logits = m.eval(toks, all_logits=True)
            rows = m.last_hidden[0]
            d.commit(toks[1:], rows[:-1], 0)
            history = list(toks)
            for _ in range(6):                  # plain steps: one kept token each
                nxt = int(np.argmax(logits[-1]))
                d.commit([nxt], m.last_hidden[0][-1:], len(history) - 1)
                history.append(nxt)
                logits = m.eval([nxt], all_logits=True)
            assert (len(d.deferred) == 1 and len(d.deferred[0][0]) == 15) == defer
            draft = d.propose(history + [int(np.argmax(logits[-1]))], 3, Sampler(GREEDY))
            firsts[defer] = (draft.tokens, d.first[0] if d.first is not None else None)
            assert not d.deferred
    assert firsts[True][0] == firsts[False][0] and len(firsts[True][0]) == 3


def test_mtp_on_wrong_drafts_pauses_and_keeps_greedy_output(tiny_model_path):
    """Random weights: MTP drafts are wrong, so drafting pauses (a probe now and then) and the
    MTP block runs only for probes, whether the source defers its rows (generate, chat) or fills
    them at once (the server's: its paused steps keep them waiting, `Running.drafts_next_step`,
    with no MTP row in the trunk's graph). The output stays plain greedy decoding's, both propose
    the same drafts (the rows that waited are evaluated before the newest), and the rows waiting
    at the end are those after the last committed ones."""
    path = tiny_model_path("tiny-mtp")
    toks = prompt(10, 13)
    base = _plain(path, toks, 60)
    proposed = {}
    for defer in (True, False):
        calls, made = [], []

        def counting(m):
            d = MtpDraft(m, defer=defer)
            made.append(d)
            for name in ("mtp_eval", "mtp_eval_rows"):
                real = getattr(m, name)
                setattr(m, name, lambda *a, real=real, name=name, **kw: (calls.append(name), real(*a, **kw))[1])
            real_eval, real_propose = m.eval, d.propose
            m.eval = lambda *a, **kw: (calls.append("in graph") if kw.get("mtp_argmax") else None,
                                       real_eval(*a, **kw))[1]
            d.propose = lambda *a: (lambda r: (proposed.setdefault(defer, []).append(r.tokens), r)[1])(real_propose(*a))
            return d

        out, st = _speculative(path, toks, 60, counting, 3, mtp=True)
        assert out == base
        assert st.n_drafted <= 14 and st.n_steps >= 50
        assert len(calls) <= 2 * 7, calls   # a flush (and a chained draft) per drafting step, none while paused
        waiting = made[0].deferred
        assert len(waiting) == 1 and waiting[0][2] + len(waiting[0][0]) == len(toks) + len(out) - 1
    assert proposed[True] == proposed[False] and len(proposed[True]) >= 5


#: chi-square critical values at p = 0.001 for 1..15 degrees of freedom (the usual table)
CHI2_CRITICAL_0001 = [10.828, 13.816, 16.266, 18.467, 20.515, 22.458, 24.322, 26.124, 27.877, 29.588,
                      31.264, 32.909, 34.528, 36.123, 37.697]


class TableDraft:
    """Drafts the token after t1 from a fixed distribution q[t1] (drawn with the sampler's generator)."""

    needs_hidden = False

    def __init__(self, table: dict[int, np.ndarray]):
        self.table = table

    def start(self, prompt):
        pass

    def propose(self, history, n, sampler):
        q = self.table[history[-1]]
        return Draft([int(sampler.rng.choice(q.size, p=q))], [Distribution.of_dense(q)])

    def commit(self, next_tokens, hiddens, start):
        pass

    def close(self):
        pass


@pytest.mark.parametrize("source", ["table", "mtp", "mtp-draft-vocab"])
def test_sampling_with_drafts_keeps_the_targets_distribution(tiny_model_path, source):
    """temperature 1, top-k 4: the first token is drawn from the target, the second goes through a
    drafted token and speculative sampling's min(1, p/q) rule with the residual max(p - q, 0).
    Over 1,200 seeded generations the (first, second) pairs must follow the target's exact joint
    distribution p(t1) p(t2 | t1), computed from its logits (a chi-square test at p = 0.001, cells
    under 5 expected draws pooled). "table" drafts from a q that overlaps p in part (p's tokens
    weighted in reverse, plus a token p never draws), so keeping drafts too often, or resampling a
    rejection from p or q instead of the residual, fails; "mtp" drafts with the MTP block,
    "mtp-draft-vocab" with its LM head over the first half of the vocabulary (runner.draft_vocab):
    a q that is zero on the tokens past it, some of which the target draws."""
    from deltarun.runner.sampling import Sampler, SamplingParams

    path = tiny_model_path("tiny-mtp")
    toks = prompt(6, 14)
    params = SamplingParams(temperature=1.0, top_k=4, top_p=1.0, min_p=0.0)
    draft_vocab = None
    if source == "mtp-draft-vocab":
        with Model(path, n_ctx=16) as probe_model:
            draft_vocab = probe_model.hp.n_vocab // 2
    with Model(path, n_ctx=64, kv_type="f32", rs_slots=2, mtp=True, draft_vocab=draft_vocab) as m:
        probe = Sampler(params)
        p1 = probe.distribution(m.eval(toks), toks)
        joint, table = {}, {}
        for t1 in np.flatnonzero(p1):
            m.reset()
            m.eval(toks)
            p2 = probe.distribution(m.eval([int(t1)]), toks + [int(t1)])
            support = np.flatnonzero(p2)
            for t2 in support:
                joint[(int(t1), int(t2))] = p1[t1] * p2[t2]
            q = np.zeros_like(p2)
            q[support[np.argsort(p2[support])]] = np.sort(p2[support])[::-1] * 0.8
            q[(support.max() + 1) % q.size] = 0.2
            table[int(t1)] = q / q.sum()
        counts: dict[tuple[int, int], int] = {}
        n, drafted = 1200, 0
        for seed in range(n):
            m.reset()
            st = GenerationStats()
            draft = TableDraft(table) if source == "table" else MtpDraft(m)
            out = list(generate_tokens(m, toks, 3, Sampler(dataclass_replace(params, seed=seed)), stats=st,
                                       stop_at_eog=False, draft=draft, draft_max=1))
            drafted += st.n_drafted
            counts[(out[0], out[1])] = counts.get((out[0], out[1]), 0) + 1
    assert drafted == n and set(counts) <= set(joint)
    if draft_vocab:       # the target draws second tokens on both sides of the draft vocabulary
        assert {t2 >= draft_vocab for _, t2 in joint} == {True, False}
    expected = {c: n * p for c, p in joint.items()}
    small = [c for c, e in expected.items() if e < 5]
    cells = [([c], e) for c, e in expected.items() if e >= 5] + ([(small, sum(expected[c] for c in small))] if small else [])
    chi2 = sum((sum(counts.get(c, 0) for c in group) - e) ** 2 / e for group, e in cells)
    assert len(cells) >= 6
    assert chi2 < CHI2_CRITICAL_0001[len(cells) - 2], (chi2, len(cells) - 1)


def test_a_draft_vocabulary_gives_the_mtp_logits_of_its_first_ids(tiny_model_path):
    """`draft_vocab` N: the MTP block's LM head is a view of its first N rows, so a separate MTP
    evaluation and the rows computed in a verification graph (mtp_argmax) give the whole head's
    logits for ids < N and -inf past them (never drafted); the trunk's logits do not change."""
    path = tiny_model_path("tiny-mtp")
    toks = prompt(10, 4)
    got = {}
    for dv in (0, 200):
        with Model(path, n_ctx=64, kv_type="f32", mtp=True, rs_slots=4, draft_vocab=dv) as m:
            assert m.draft_vocab == dv
            trunk = m.eval(toks, all_logits=True)
            sep, _ = m.mtp_eval(toks[1:] + [3], m.last_hidden[0], 0)
            verify = m.eval([5, 6, 7], all_logits=True, mtp_argmax=True)
            got[dv] = trunk, sep, verify, m.last_mtp.logits
    assert 200 < m.hp.n_vocab
    for full, sub in zip(got[0], got[200]):
        assert full.shape == sub.shape
    np.testing.assert_array_equal(got[0][0], got[200][0])
    np.testing.assert_array_equal(got[0][2], got[200][2])
    for full, sub in ((got[0][1], got[200][1]), (got[0][3], got[200][3])):
        np.testing.assert_allclose(sub[..., :200], full[..., :200], rtol=1e-6, atol=1e-6)
        assert np.all(np.isneginf(sub[..., 200:])) and np.all(np.isfinite(full))


def test_mtp_drafts_over_a_draft_vocabulary_keep_greedy_output(tiny_model_path):
    """The echo preset repeats the prompt's last token, and its MTP block drafts it: over the first
    256 ids only, a token past them is never drafted (each draft rejected) and one below them is
    (each accepted); the greedy output is that of plain decoding either way."""
    path = tiny_model_path("tiny-echo")
    for last, acceptance in ((5, 1.0), (420, 0.0)):
        toks = [3, 400, 9, 410, 7, last]
        base = _plain(path, toks, 16)
        assert set(base) == {last}
        out, st = _speculative(path, toks, 16, lambda m: MtpDraft(m), 3, mtp=True, draft_vocab=256)
        assert out == base
        assert st.n_drafted > 0 and st.acceptance == acceptance


def test_the_draft_vocabulary_is_chosen_where_the_lm_head_costs_most(tiny_model_path):
    """Automatic choice: DEFAULT_DRAFT_VOCAB ids when the head is at least MIN_HEAD_SHARE of the
    bytes a token reads and the vocabulary is larger than twice that; 0 (every id) otherwise, for
    an explicit 0, or for N at or past the vocabulary; negative N is an error."""
    import dataclasses

    from deltarun.base.errors import DeltarunError
    from deltarun.base.gguf_file import TensorInfo
    from deltarun.runner.draft_vocab import DEFAULT_DRAFT_VOCAB, head_share, resolve_draft_vocab

    def info(name, nbytes, ne=(1, 1)):
        return TensorInfo(name, 8, ne, 0, nbytes)

    with Model(tiny_model_path("tiny-mtp"), n_ctx=16) as m:
        hp = dataclasses.replace(m.hp, n_vocab=151936, n_expert=8, n_expert_used=2)
    tensors = {"token_embd.weight": info("token_embd.weight", 150_000, (1, 1000)),
               "output.weight": info("output.weight", 150_000),
               "blk.0.attn_qkv.weight": info("blk.0.attn_qkv.weight", 500_000),
               "blk.0.ffn_up_exps.weight": info("blk.0.ffn_up_exps.weight", 800_000)}
    # a token reads one embedding row, the matrices, 2 of 8 experts and the head
    assert head_share(hp, tensors, "output.weight") == pytest.approx(150_000 / (150 + 500_000 + 200_000 + 150_000))
    assert head_share(hp, {**tensors, "output.weight": info("output.weight", 10_000)}, "output.weight") < 0.1
    assert resolve_draft_vocab(None, hp, tensors, "output.weight") == DEFAULT_DRAFT_VOCAB
    small_head = {**tensors, "output.weight": info("output.weight", 50_000)}
    assert resolve_draft_vocab(None, hp, small_head, "output.weight") == 0
    assert resolve_draft_vocab(None, dataclasses.replace(hp, n_vocab=60000), tensors, "output.weight") == 0
    assert resolve_draft_vocab(0, hp, tensors, "output.weight") == 0
    assert resolve_draft_vocab(151936, hp, tensors, "output.weight") == 0
    assert resolve_draft_vocab(4096, hp, small_head, "output.weight") == 4096
    with pytest.raises(DeltarunError, match="draft-vocab"):
        resolve_draft_vocab(-1, hp, tensors, "output.weight")
