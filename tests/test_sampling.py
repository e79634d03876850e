"""Sampler: hand-computed distributions for each stage (penalty, top-k, top-p, min-p, temperature)
and draws that follow them."""

from __future__ import annotations

import types
from collections import Counter

import numpy as np
import pytest

from deltarun.runner import sampling
from deltarun.runner.sampling import (GREEDY, Distribution, LogitsProcessors, Sampler, SamplingParams, accept_draft,
                                      log_softmax, sample_rows)

OFF = dict(top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0)


def dist(logits, history=(), **params) -> np.ndarray:
    return Sampler(SamplingParams(**{"temperature": 1.0, **OFF, **params})).distribution(
        np.asarray(logits, dtype=np.float32), list(history))


# probabilities 0.5, 0.25, 0.15, 0.1 in a shuffled order: token 2 is the likeliest
P = {2: 0.5, 0: 0.25, 3: 0.15, 1: 0.1}
LOGITS = np.log([P[i] for i in range(4)]) + 3.0     # a shift changes nothing


def expect(probs: dict[int, float]) -> np.ndarray:
    out = np.zeros(4)
    for i, p in probs.items():
        out[i] = p
    return out


@pytest.mark.parametrize("params, want", [
    ({}, P),                                                          # all stages off
    ({"top_k": 2}, {2: 2 / 3, 0: 1 / 3}),
    ({"top_k": 3}, {2: 0.5 / 0.9, 0: 0.25 / 0.9, 3: 0.15 / 0.9}),
    ({"top_p": 0.7}, {2: 2 / 3, 0: 1 / 3}),                           # 0.5 < 0.7 <= 0.75: two tokens
    ({"top_p": 0.8}, {2: 0.5 / 0.9, 0: 0.25 / 0.9, 3: 0.15 / 0.9}),
    ({"top_p": 0.4}, {2: 1.0}),
    ({"min_p": 0.35}, {2: 2 / 3, 0: 1 / 3}),                          # 0.15 / 0.5 = 0.3 < 0.35
    ({"min_p": 0.25}, {2: 0.5 / 0.9, 0: 0.25 / 0.9, 3: 0.15 / 0.9}),  # 0.1 / 0.5 = 0.2 < 0.25
    ({"temperature": 0.5}, {i: p * p / 0.345 for i, p in P.items()}),  # p^(1/T), renormalised
    ({"temperature": 2.0, "top_k": 2},
     {2: np.sqrt(0.5) / (np.sqrt(0.5) + np.sqrt(0.25)), 0: np.sqrt(0.25) / (np.sqrt(0.5) + np.sqrt(0.25))}),
])
def test_each_stage_on_a_hand_computed_distribution(params, want):
    np.testing.assert_allclose(dist(LOGITS, **params), expect(want), rtol=1e-6, atol=1e-12)


def test_stages_run_in_llama_cpp_order():
    """top-k, then top-p on the renormalised survivors, then min-p, then temperature."""
    logits = np.log([0.4, 0.3, 0.2, 0.1])
    # top-k 3: 0.444, 0.333, 0.222; top-p 0.7 keeps two (0.444 < 0.7 <= 0.778); min-p 0.7 keeps
    # both (0.3 / 0.4 = 0.75); temperature 2: sqrt of the probabilities, renormalised
    a, b = np.sqrt(0.4), np.sqrt(0.3)
    np.testing.assert_allclose(dist(logits, top_k=3, top_p=0.7, min_p=0.7, temperature=2.0),
                               [a / (a + b), b / (a + b), 0, 0], rtol=1e-6)
    # min-p 0.8 drops the second (0.75 < 0.8)
    np.testing.assert_allclose(dist(logits, top_k=3, top_p=0.7, min_p=0.8, temperature=2.0), [1, 0, 0, 0])
    # top-p sees top-k's renormalised output: 0.444 + 0.333 >= 0.75 keeps two, where the full
    # distribution (0.4 + 0.3 < 0.75) would keep three
    np.testing.assert_allclose(dist(logits, top_k=3, top_p=0.75), [4 / 7, 3 / 7, 0, 0], rtol=1e-6)
    np.testing.assert_allclose(dist(logits, top_p=0.75), [4 / 9, 3 / 9, 2 / 9, 0], rtol=1e-6)


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits():
    logits = np.array([2.0, -1.0, 0.5, 1.5], dtype=np.float32)
    s = Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=64))
    np.testing.assert_array_equal(s.penalized(logits, [0, 1, 1]), [1.0, -2.0, 0.5, 1.5])
    np.testing.assert_array_equal(logits, [2.0, -1.0, 0.5, 1.5])             # the input is not changed
    np.testing.assert_allclose(dist(logits, [0, 1], repeat_penalty=2.0),
                               np.exp(log_softmax(np.array([1.0, -2.0, 0.5, 1.5]))), rtol=1e-6)
    # greedy: token 0 (2.0) loses to token 3 (1.5) once penalised to 1.0
    assert Sampler(GREEDY).sample(logits, [0]) == 0
    assert Sampler(SamplingParams(temperature=0, repeat_penalty=2.0)).sample(logits, [0]) == 3


@pytest.mark.parametrize("last_n, penalised", [(1, [1]), (2, [0, 1]), (-1, [3, 0, 1]), (0, [])])
def test_repeat_last_n_window(last_n, penalised):
    logits = np.array([2.0, -1.0, 0.5, 1.5], dtype=np.float32)
    s = Sampler(SamplingParams(repeat_penalty=4.0, repeat_last_n=last_n))
    want = logits.copy()
    for i in penalised:
        want[i] = want[i] / 4 if want[i] > 0 else want[i] * 4
    np.testing.assert_array_equal(s.penalized(logits, [3, 0, 1]), want)


def test_greedy_distribution_is_one_hot():
    np.testing.assert_array_equal(Sampler(GREEDY).distribution(LOGITS), [0, 0, 1, 0])
    assert Sampler(GREEDY).sample(LOGITS) == 2


def test_draws_follow_the_distribution_and_the_seed_repeats_them():
    params = SamplingParams(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0, seed=7)
    n = 20000
    draws = [Sampler(params).sample(LOGITS) for _ in range(3)]
    assert len(set(draws)) == 1                                          # same seed, same first draw
    s = Sampler(params)
    counts = np.bincount([s.sample(LOGITS) for _ in range(n)], minlength=4) / n
    want = expect({2: 0.5 / 0.9, 0: 0.25 / 0.9, 3: 0.15 / 0.9})
    # 5 standard deviations of a frequency over 20000 draws is at most 0.018
    np.testing.assert_allclose(counts, want, atol=0.018)
    assert counts[1] == 0                                                # cut by top-k, never drawn


def test_log_softmax_against_the_definition():
    x = np.array([[1.0, 2.0, 3.0], [1000.0, 1000.0, 0.0]])
    np.testing.assert_allclose(log_softmax(x)[0], np.log(np.exp([1, 2, 3]) / np.exp([1, 2, 3]).sum()))
    np.testing.assert_allclose(log_softmax(x)[1], [np.log(0.5), np.log(0.5), -1000.0 - np.log(2.0)])


# --- the processors the server offers, top-k by partition, the acceptance rule -------------------
class _Grammar:
    """A grammar stub: allows a fixed set of tokens, records what it is moved past; with `length`,
    complete after that many tokens, then allows only `end` (a real grammar's end of generation)."""

    def __init__(self, allowed, length=None, end=None):
        self.allowed, self.accepted, self.length, self.end = allowed, [], length, end

    def mask(self, logits):
        allowed = [self.end] if self.done else self.allowed
        return np.where(np.isin(np.arange(logits.shape[0]), allowed), logits, -np.inf).astype(np.float32)

    def accept(self, token):
        self.accepted.append(token)

    def fork(self):
        twin = _Grammar(self.allowed, self.length, self.end)
        twin.accepted = list(self.accepted)
        return twin

    @property
    def done(self):
        return self.length is not None and len(self.accepted) >= self.length


class _Alternating(_Grammar):
    """A grammar whose mask follows its state: after an even token only odd ones, and the reverse
    (so a row's mask depends on every drafted token before it)."""

    def __init__(self, n_vocab):
        super().__init__(list(range(n_vocab)))
        self.n_vocab = n_vocab

    def mask(self, logits):
        if not self.accepted:
            return np.asarray(logits, dtype=np.float32).copy()
        want = 1 - self.accepted[-1] % 2
        return np.where(np.arange(logits.shape[0]) % 2 == want, logits, -np.inf).astype(np.float32)

    def fork(self):
        twin = _Alternating(self.n_vocab)
        twin.accepted = list(self.accepted)
        return twin


def test_logits_processors_penalties_bias_ban_and_grammar():
    """OpenAI's penalties over the accepted tokens (logit -= count * frequency + (count > 0) *
    presence), logit bias (ids outside the row ignored), banned ids and the grammar mask; the
    input row is not changed, and without processors the row is passed through."""
    x = np.array([1.0, 2.0, 3.0, 4.0, 5.0], dtype=np.float32)
    grammar = _Grammar([0, 1, 2, 3])
    proc = LogitsProcessors(presence_penalty=0.5, frequency_penalty=0.25, logit_bias={1: 2.0, 9: 5.0, -1: 1.0},
                            banned=[3], grammar=grammar)
    np.testing.assert_array_equal(proc(x), [1.0, 4.0, 3.0, -np.inf, -np.inf])     # nothing accepted yet
    for t in (0, 0, 2):
        proc.accept(t)
    np.testing.assert_array_equal(proc(x), [1.0 - 2 * 0.25 - 0.5, 4.0, 3.0 - 0.25 - 0.5, -np.inf, -np.inf])
    np.testing.assert_array_equal(x, [1.0, 2.0, 3.0, 4.0, 5.0])
    assert grammar.accepted == [0, 0, 2]
    assert LogitsProcessors()(x) is x
    twin = proc.fork()                                   # a fork moves on its own
    twin.accept(1)
    assert grammar.accepted == [0, 0, 2] and proc.counts[1] == 0 and twin.counts[1] == 1
    assert Sampler(GREEDY).sample(x, [], proc) == 1
    rows = np.stack([x, x[::-1].copy()])
    assert sample_rows([Sampler(GREEDY), Sampler(GREEDY)], rows, [[], []], processors=[proc, None]) == [1, 0]


def test_top_k_by_partition_gives_the_full_sorts_tokens_and_draws(monkeypatch):
    """Top-k by partition (k < vocab / 8) keeps what a stable sort of the whole row keeps (equal
    logits at the k-th place: the lowest ids): the same distribution and the same seeded draws."""
    rng = np.random.default_rng(0)
    logits = np.round(rng.normal(size=4000), 1).astype(np.float32)         # many equal logits
    logits[rng.integers(4000, size=500)] = -np.inf
    history = [int(t) for t in np.argsort(-logits)[:6]]
    params = SamplingParams(temperature=1.2, top_k=45, top_p=0.99, min_p=0.0, repeat_penalty=1.2, seed=4)
    fast = Sampler(params)
    x = np.sort(fast.penalized(logits, history))[::-1]
    assert fast.partitions(logits.size) and x[params.top_k - 1] == x[params.top_k]   # a tie at the k-th place
    dist, draws = fast.distribution(logits, history), [fast.sample(logits, history) for _ in range(300)]
    monkeypatch.setattr(sampling, "PARTITION_BELOW", 10**9)
    slow = Sampler(params)
    assert not slow.partitions(logits.size)
    np.testing.assert_array_equal(dist, slow.distribution(logits, history))
    assert draws == [slow.sample(logits, history) for _ in range(300)]


def test_top_k_shortlist_keeps_what_a_stable_sort_keeps():
    """`k_best` partitions only the logits that reach the k-th best block maximum: on rows built to
    break that (ties at the k-th place across blocks, the best logits in the last, partial block,
    -inf blocks, rows of one value, every block maximum equal, k near the number of blocks) it
    keeps exactly the k tokens, in the order, of a stable sort of the whole row."""
    rng = np.random.default_rng(11)
    checked = 0
    for case in range(400):
        n = int(rng.choice([640, 1000, 4097, 151936 // 16, 20000 + int(rng.integers(64))]))
        kind = case % 6
        if kind == 0:
            x = np.round(rng.normal(size=n), 1)                       # many ties
        elif kind == 1:
            x = rng.normal(size=n)
            x[-(n % 64 or 64):] += 10                                # the best in the last block
        elif kind == 2:
            x = rng.normal(size=n)
            x[rng.integers(n, size=n // 2)] = -np.inf
        elif kind == 3:
            x = np.full(n, 0.5)                                      # one value
        elif kind == 4:
            x = rng.normal(size=n) - 5
            x[::64] = 1.0                                            # every block maximum equal
        else:
            x = rng.integers(0, 4, size=n).astype(np.float64)        # a few levels
        x = x.astype(np.float32)
        k = int(rng.choice([1, 2, 20, 40, n // 64 - 1, n // 64, n // 64 + 3, n // 9]))
        if not sampling.partitions(k, n):
            continue
        np.testing.assert_array_equal(sampling.k_best(x, k), np.argsort(-x, kind="stable")[:k], err_msg=f"{case} {n} {k}")
        checked += 1
    assert checked > 250
    # NaN logits: in every block (no threshold), or in a row of fewer than k blocks (partitioned whole)
    for n, nan_at in ((5000, slice(None, None, 64)), (1000, [3, 500, 999])):
        x = rng.normal(size=n).astype(np.float32)
        x[nan_at] = np.nan
        assert sampling.partitions(30, n)
        np.testing.assert_array_equal(sampling.k_best(x, 30), np.argsort(-x, kind="stable")[:30])


def _distribution_by_full_sort(x: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The sampling chain written plainly: a stable sort of the whole row, top-k, top-p over the
    kept tokens' softmax, min-p against the best, temperature (llama.cpp's order)."""
    order = np.argsort(-x, kind="stable")
    if 0 < p.top_k < x.size:
        order = order[:p.top_k]
    kept = x[order].astype(np.float64)
    w = np.exp(kept - kept[0])
    w /= w.sum()
    if p.top_p < 1.0:
        cut = int(np.searchsorted(np.cumsum(w), p.top_p) + 1)
        order, kept = order[:cut], kept[:cut]
    if p.min_p > 0.0:
        keep = np.exp(kept - kept[0]) >= p.min_p
        order, kept = order[keep], kept[keep]
    out = np.zeros(x.size)
    w = np.exp((kept - kept[0]) / p.temperature)
    out[order] = w / w.sum()
    return out


def test_top_k_off_ranks_only_what_top_p_and_min_p_can_keep():
    """With top-k off (0, or the whole vocabulary) the chain sorts only the tokens that top-p and
    min-p can keep (a threshold below the best whose tokens hold top-p of the mass; min-p's
    floor), not the whole row: on peaked, flat, tied and masked rows the distribution is the one a
    stable sort of the whole row gives."""
    rng = np.random.default_rng(8)
    n = 20000
    rows = {"peaked": rng.normal(size=n) * 4, "flat": rng.normal(size=n) * 0.05,
            "ties": np.round(rng.normal(size=n) * 2, 0), "gap": np.r_[rng.normal(size=50) + 30, rng.normal(size=n - 50)]}
    masked = rng.normal(size=n) * 3
    masked[rng.random(n) < 0.9] = -np.inf
    rows["masked"] = masked
    checked = 0
    for name, x in rows.items():
        x = x.astype(np.float32)
        for top_k in (0, n):
            for top_p, min_p in ((0.95, 0.0), (0.5, 0.0), (0.999, 0.0), (1.0, 0.05), (0.9, 0.05), (0.99, 1e-4),
                                 (1.0, 0.0), (0.2, 0.5)):
                params = SamplingParams(temperature=0.7, top_k=top_k, top_p=top_p, min_p=min_p, seed=1)
                got, want = Sampler(params).distribution(x), _distribution_by_full_sort(x, params)
                assert set(np.flatnonzero(got)) == set(np.flatnonzero(want)), (name, top_k, top_p, min_p)
                np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
                ranked = Sampler(params)._ranked(x)[0]
                if name == "peaked" and (top_p <= 0.95 or min_p >= 0.05):
                    assert ranked.size < n // 4         # a shortlist, not the whole row
                if min_p > 0.0:                         # never past min-p's floor
                    assert ranked.size <= np.count_nonzero(x >= x.max() + np.log(min_p) - 1e-6)
                checked += 1
    assert checked == 80
    # top-k on: the same distribution as the plain chain, to the last bit
    x = (rng.normal(size=n) * 3).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.01, seed=1)
    np.testing.assert_array_equal(Sampler(params).distribution(x), _distribution_by_full_sort(x, params))


def test_a_distribution_by_its_support_draws_what_the_dense_row_draws():
    """Drafts (`Sampler.draft`) and samples are drawn from the support alone; with the same seed
    they must be the tokens `rng.choice` over the whole dense row gives (the random number mapped to
    tokens in id order), and `prob` must read the dense row's value, 0 off the support."""
    rng = np.random.default_rng(3)
    logits = (rng.normal(size=5000) * 3).astype(np.float32)
    for params in (SamplingParams(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=11),
                   SamplingParams(temperature=1.5, top_k=0, top_p=0.9, min_p=0.0, seed=12)):
        dense = Sampler(params).distribution(logits)
        q = Sampler(params).support(logits)
        assert q.ids.size > 5 and np.all(np.diff(q.ids) > 0)
        np.testing.assert_array_equal(Distribution.of_dense(dense).ids, q.ids)
        for t in (int(q.ids[0]), int(q.ids[-1]), int(np.argmin(dense))):
            assert q.prob(t) == dense[t]
        drafter, sampler, ref = Sampler(params), Sampler(params), np.random.default_rng(params.seed)
        want = [int(ref.choice(dense.size, p=dense)) for _ in range(400)]
        assert [drafter.draft(logits, [])[0] for _ in range(400)] == want
        assert [sampler.sample(logits, []) for _ in range(400)] == want


def _dense_accept(rng: np.random.Generator, p: np.ndarray, q: np.ndarray | None, d: int) -> int | None:
    """Speculative sampling's rule on dense rows, as written in the papers: None (kept) with
    probability min(1, p[d] / q[d]), else a draw from max(p - q, 0) normalised."""
    q_d = 1.0 if q is None else q[d]
    if rng.random() < min(1.0, p[d] / q_d):
        return None
    residual = np.maximum(p - (np.eye(1, p.size, d)[0] if q is None else q), 0.0)
    return int(rng.choice(p.size, p=residual / residual.sum())) if residual.sum() > 0 else int(np.argmax(p))


def test_acceptance_by_the_support_decides_as_the_dense_rule():
    """`accept_draft` reads the distributions by their support; with the same seed every decision
    and every resampled token must be those of the dense rule (drafts from a q that overlaps p in
    part, and point-mass drafts, many of them rejected)."""
    rng = np.random.default_rng(5)
    vocab = 3000
    params = SamplingParams(temperature=1.0, top_k=30, top_p=0.97, min_p=0.0, seed=21)
    kept = rejected = 0
    for trial in range(150):
        logits = (rng.normal(size=(2, vocab)) * 2).astype(np.float32)
        p = Sampler(params).distribution(logits[0])
        q = np.zeros(vocab)
        ps = np.flatnonzero(p)[:10]                           # some of p's tokens, some others
        support = np.concatenate([ps, rng.choice(np.setdiff1d(np.arange(vocab), ps), 25 - ps.size, replace=False)])
        q[support] = rng.dirichlet(np.ones(25))
        if trial % 2:                                         # close to p: most drafts kept
            q = 0.8 * p + 0.2 * q
        point = trial % 3 == 0
        d = int(np.flatnonzero(p)[0]) if point else int(rng.choice(vocab, p=q))
        sampler = Sampler(params)
        n_ok, tok = accept_draft(sampler, logits, types.SimpleNamespace(
            tokens=[d], probs=[None if point else Distribution.of_dense(q)]), [])
        ref_rng = np.random.default_rng(params.seed)
        want = _dense_accept(ref_rng, p, None if point else q, d)
        if want is None:
            kept += 1
            assert n_ok == 1
        else:
            rejected += 1
            assert (n_ok, tok) == (0, want)
    assert kept > 20 and rejected > 20


def test_drafts_are_verified_as_plain_sampling_draws_under_processors_with_state():
    """Greedy verification under penalties and a grammar whose mask follows every token: the kept
    drafts and the token after them are what drawing the rows one by one gives (the processors
    moved past each drawn token), and the request's own processors stay where they were."""
    rng = np.random.default_rng(7)
    n_vocab, cases, rejected_at = 12, 300, Counter()
    for _ in range(cases):
        rows = rng.standard_normal((5, n_vocab)).astype(np.float32)
        history = [int(t) for t in rng.integers(0, n_vocab, 3)]
        make = lambda: LogitsProcessors(presence_penalty=0.7, frequency_penalty=0.3,  # noqa: E731
                                        counts=Counter(history), grammar=_Alternating(n_vocab))
        ref, ref_history, plain = make(), list(history), []
        for row in rows:                                  # plain decoding, one row at a time
            t = Sampler(GREEDY).sample(row, ref_history, ref)
            plain.append(t)
            ref.accept(t)
            ref_history.append(t)
        cut = int(rng.integers(0, 5))                     # drafts right up to `cut`, then one wrong
        tokens = plain[:4]
        if cut < 4:
            tokens = tokens[:cut] + [(plain[cut] + 1 + int(rng.integers(0, n_vocab - 1))) % n_vocab]
        proc = make()
        n_ok, nxt = accept_draft(Sampler(GREEDY), rows, types.SimpleNamespace(tokens=tokens, probs=[None] * len(tokens)),
                                 history, proc)
        assert (n_ok, nxt) == (min(cut, 4), plain[min(cut, 4)])
        assert proc.counts == Counter(history) and proc.grammar.accepted == []
        rejected_at[n_ok] += 1
    assert all(rejected_at[k] > 20 for k in range(5))


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, seed=3)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_draft_that_completes_the_grammar_ends_the_kept_tokens(params, ignore_eos):
    """Drafts the target agrees with, the second of which completes the grammar: two are kept and
    no token is drawn after them (None), since only the end of generation could follow (with
    ignore_eos, banned: nothing could, and drawing from a row that allows nothing failed the
    request); the drafts after it are not verified, and the request's processors do not move."""
    n_vocab, end = 8, 7
    rows = np.full((5, n_vocab), -5.0, dtype=np.float32)
    drafts = [2, 4, 1, 3]
    for i, d in enumerate(drafts):
        rows[i, d] = 20.0                                # the target agrees with every draft
    proc = LogitsProcessors(banned=[end] if ignore_eos else (), grammar=_Grammar(list(range(end)), length=2, end=end))
    n_ok, nxt = accept_draft(Sampler(params), rows, types.SimpleNamespace(tokens=drafts, probs=[None] * 4), [0, 1],
                             proc)
    assert (n_ok, nxt) == (2, None)
    assert proc.grammar.accepted == [] and not proc.counts
