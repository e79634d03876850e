"""Token sampling: the one sampler of generate, chat, speculative decoding and the server.

A row of logits goes through the request's logits processors (`LogitsProcessors`, the server's
OpenAI fields; the command line has none), then the sampler's chain (`Sampler`, llama.cpp's
default order):

    presence and frequency penalties -> logit bias -> banned tokens (ignore_eos: the
    end-of-generation ids) -> grammar mask -> thinking budget  |  repetition penalty -> top-k
    -> top-p -> min-p -> temperature -> draw

Temperature <= 0 is greedy (argmax after the processors and the repetition penalty). Top-k takes
the k best by partition where that pays (k < vocab / 8), with the tokens and order a full sort
gives. The processors that keep state (the counts of the presence and frequency penalties, the
grammar, the thinking budget of `runner.reasoning`) advance with `LogitsProcessors.accept`, once
per token kept. `sample_rows` samples the
rows of a batched step together (`runner.engine`), drawing what each row's sampler draws alone.

Speculative decoding's acceptance rule (`accept_draft`: min(1, p/q), a rejection resampled from
the residual max(p - q, 0)) is here too, so verification draws from exactly what plain sampling
draws from.
"""
from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, Protocol, Sequence

import numpy as np

from deltarun.runner.reasoning import ThinkingBudget


#: The range of `repeat_penalty`: it divides a seen token's positive logit and multiplies a negative
#: one, and beyond these bounds takes them past float32's range (inf logits and NaN probabilities:
#: nothing left to sample, or a grammar's allowed tokens all at -inf).
MIN_REPEAT_PENALTY, MAX_REPEAT_PENALTY = 1e-6, 1e6


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


GREEDY = SamplingParams(temperature=0.0)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """log(softmax(logits)) along the last axis, in float64 (perplexity, KL divergence)."""
    x = np.asarray(logits, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(axis=-1, keepdims=True)))


class Grammar(Protocol):
    """A constraint on the output (the server's llguidance matcher): which tokens may come next."""

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """Logits with every token the grammar forbids at -inf (a new array)."""

    def accept(self, token: int) -> None:
        """The grammar's state moves past `token`."""

    def fork(self) -> "Grammar":
        """A copy whose state moves on its own: drafted tokens are verified on one, each row masked
        as it would be after the drafts before it."""

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but the end of generation may follow."""


@dataclass
class LogitsProcessors:
    """What a request changes in the logits before the sampler's chain (OpenAI's fields).

    Presence and frequency penalties follow OpenAI's formula, over the tokens generated so far
    (`accept`): logit[j] -= count[j] * frequency + (count[j] > 0) * presence. `banned` tokens are
    never drawn (ignore_eos bans the end-of-generation ids). `budget` ends a think block after its
    tokens (`runner.reasoning.ThinkingBudget`). One object per generation: the counts, the grammar
    and the budget are its state.
    """

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    banned: Sequence[int] = ()
    grammar: Grammar | None = None
    budget: ThinkingBudget | None = None
    counts: collections.Counter[int] = field(default_factory=collections.Counter)

    def fork(self) -> "LogitsProcessors":
        """A copy whose state (the counts, the grammar, the budget) moves on its own: speculative
        decoding verifies drafted tokens on one (`accept_draft`), so each row is processed as it
        would be after the drafts before it, and the request's own state moves only by the tokens
        kept."""
        return dataclasses.replace(self, counts=collections.Counter(self.counts),
                                   grammar=self.grammar.fork() if self.grammar is not None else None,
                                   budget=self.budget.fork() if self.budget is not None else None)

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        """The logits after the processors: a float32 copy where any applies, else the row itself."""
        x = np.asarray(logits, dtype=np.float32)
        penalties = bool(self.counts) and bool(self.presence_penalty or self.frequency_penalty)
        if penalties or self.logit_bias or len(self.banned):
            x = x.copy()
            if penalties:
                ids = np.fromiter(self.counts.keys(), dtype=np.int64)
                cnt = np.fromiter(self.counts.values(), dtype=np.float32)
                x[ids] -= self.presence_penalty + self.frequency_penalty * cnt
            for t, b in self.logit_bias.items():
                if 0 <= t < x.shape[0]:
                    x[t] += b
            if len(self.banned):
                x[np.asarray(self.banned, dtype=np.int64)] = -np.inf
        if self.grammar is not None:
            x = self.grammar.mask(x)
        if self.budget is not None:
            x = self.budget.force(x)
        return x

    @property
    def ended(self) -> bool:
        """The output is complete (its grammar is): no token may follow but the end of generation."""
        return self.grammar is not None and self.grammar.done

    def accept(self, token: int) -> None:
        """A token was kept: it counts for the penalties from now on, the grammar and the budget
        move past it."""
        self.counts[token] += 1
        if self.grammar is not None:
            self.grammar.accept(token)
        if self.budget is not None:
            self.budget.accept(token)


@dataclass(frozen=True)
class Distribution:
    """Probabilities over a vocabulary of `n_vocab` tokens, kept by their support: the tokens
    `ids` (ascending) and their `probs`.

    What the sampler draws from is a few dozen tokens after top-k, top-p and min-p; speculative
    sampling asks a few probabilities of it per drafted token. A dense float64 row of a 151,936-token
    vocabulary took ~0.5 ms to fill and a draw from it ~0.8 ms (`rng.choice` over every token):
    about an eighth of a depth-3 MTP cycle at temperature > 0. `draw` maps the random number to
    tokens in id order, so it draws the token a draw from the dense row draws.
    """

    ids: np.ndarray      # int64, ascending
    probs: np.ndarray    # float64, summing to 1
    n_vocab: int

    @classmethod
    def of_dense(cls, probs: np.ndarray) -> Distribution:
        p = np.asarray(probs, dtype=np.float64)
        ids = np.flatnonzero(p)
        return cls(ids, p[ids], p.shape[0])

    @classmethod
    def point(cls, token: int, n_vocab: int) -> Distribution:
        """All the mass on one token (a greedy sampler's, a deterministic draft's)."""
        return cls(np.array([token], dtype=np.int64), np.ones(1), n_vocab)

    def at(self, tokens: np.ndarray) -> np.ndarray:
        """The probabilities of `tokens` (0 off the support)."""
        if not self.ids.size:
            return np.zeros(np.shape(tokens))
        where = np.minimum(np.searchsorted(self.ids, tokens), self.ids.size - 1)
        return np.where(self.ids[where] == tokens, self.probs[where], 0.0)

    def prob(self, token: int) -> float:
        return float(self.at(np.array([token]))[0])

    def residual(self, q: Distribution) -> Distribution | None:
        """max(self - q, 0), normalised: what speculative sampling draws from after rejecting a
        draft drawn from q; None where q covers all of self."""
        ids = np.union1d(self.ids, q.ids)
        r = np.maximum(self.at(ids) - q.at(ids), 0.0)
        total = r.sum()
        if total <= 0:
            return None
        return Distribution(ids[r > 0], r[r > 0] / total, self.n_vocab)

    def dense(self) -> np.ndarray:
        out = np.zeros(self.n_vocab, dtype=np.float64)
        out[self.ids] = self.probs
        return out

    def draw(self, rng: np.random.Generator) -> int:
        return int(self.ids[rng.choice(self.ids.size, p=self.probs)])


class Proposal(Protocol):
    """Drafted tokens and the distribution each was drawn from (None: a deterministic proposal, a
    point mass): `runner.speculative.Draft`."""

    tokens: list[int]
    probs: list[Distribution | None]


#: top-k by partition pays when k is below this fraction of the vocabulary
PARTITION_BELOW = 8
#: with top-k off, the logit gaps below the best tried as thresholds for top-p's shortlist
TOP_P_GAPS = (2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
#: the shortlist's mass must exceed top-p by this fraction, so that rounding in the cumulative
#: sum (taken in another order) cannot move the cut past it
TOP_P_SLACK = 1e-9
#: min-p's floor for that shortlist is lowered by this (in logits) against rounding; min-p's own
#: test then decides
MIN_P_MARGIN = 1e-6


class Sampler:
    """Draws tokens; one random generator per sampler so a seed reproduces a whole generation.

    `processors` (the request's `LogitsProcessors`, None: none) apply before the chain in every
    method that takes them. Drafted tokens (`draft`) are drawn with the sampling parameters alone:
    any draft distribution is verified exactly, and the processors' state follows kept tokens only.
    """

    def __init__(self, params: SamplingParams = GREEDY):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def penalized(self, logits: np.ndarray, history: list[int]) -> np.ndarray:
        """Logits after the repetition penalty (llama.cpp: divide positive, multiply negative)."""
        p = self.params
        if p.repeat_penalty == 1.0 or not history or p.repeat_last_n == 0:
            return logits
        recent = history[-p.repeat_last_n:] if p.repeat_last_n > 0 else history
        ids = np.unique(np.asarray(recent, dtype=np.int64))
        ids = ids[(ids >= 0) & (ids < len(logits))]    # an image's tokens (negative ids) are no vocabulary tokens
        out = np.array(logits, dtype=np.float32, copy=True)
        vals = out[ids]
        out[ids] = np.where(vals > 0, vals / p.repeat_penalty, vals * p.repeat_penalty)
        return out

    def adjusted(self, logits: np.ndarray, history: list[int],
                 processors: LogitsProcessors | None = None) -> np.ndarray:
        """The logits the chain's truncation sees: after the processors and the repetition penalty."""
        x = logits if processors is None else processors(logits)
        return self.penalized(x, history)

    def support(self, logits: np.ndarray, history: list[int] | None = None,
                processors: LogitsProcessors | None = None) -> Distribution:
        """The distribution the sampler draws from (a point mass when greedy); speculative sampling's."""
        x = np.asarray(logits, dtype=np.float32) if processors is None else processors(logits)
        if self.params.greedy:
            return Distribution.point(int(np.argmax(self.penalized(x, history or []))), x.shape[0])
        ids, w = self._candidates(x, history or [])
        by_id = np.argsort(ids)
        return Distribution(ids[by_id].astype(np.int64), w[by_id], x.shape[0])

    def distribution(self, logits: np.ndarray, history: list[int] | None = None,
                     processors: LogitsProcessors | None = None) -> np.ndarray:
        """`support` as a dense row over the vocabulary."""
        return self.support(logits, history, processors).dense()

    def sample(self, logits: np.ndarray, history: list[int] | None = None,
               processors: LogitsProcessors | None = None) -> int:
        """One token: the argmax when greedy, else a draw from `support` (the random number
        mapped to tokens in token-id order)."""
        p = self.support(logits, history, processors)
        return int(p.ids[0]) if self.params.greedy else p.draw(self.rng)

    def draft(self, logits: np.ndarray, history: list[int]) -> tuple[int, Distribution | None]:
        """One drafted token and the distribution it was drawn from (None: greedy, a point mass),
        with the sampling parameters alone (see the class)."""
        q = self.support(logits, history)
        if self.params.greedy:
            return int(q.ids[0]), None
        return q.draw(self.rng), q

    # --- the chain ---------------------------------------------------------------------------------
    def _candidates(self, logits: np.ndarray, history: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """The tokens that may be drawn and their probabilities: repetition penalty, top-k, top-p,
        min-p, temperature (best first where top-p or min-p truncate, else in id order)."""
        p = self.params
        x = self.penalized(np.asarray(logits, dtype=np.float32), history)
        order, mass = self._ranked(x)
        kept = x[order].astype(np.float64)
        best = kept.max()
        if p.top_p < 1.0:
            cut = int(np.searchsorted(np.cumsum(np.exp(kept - best) / mass), p.top_p) + 1)
            order, kept = order[:cut], kept[:cut]
        if p.min_p > 0.0:
            keep = np.exp(kept - best) >= p.min_p
            order, kept = order[keep], kept[keep]
        w = np.exp((kept - best) / p.temperature)
        return order, w / w.sum()

    def _ranked(self, x: np.ndarray) -> tuple[np.ndarray, float]:
        """The tokens top-p and min-p choose from, best first, and the mass top-p's fraction is of
        (the sum of exp(logit - best) over them with top-k on, over the whole row with it off).

        With top-k off only the tokens that can pass are ranked: those at most -ln(min_p) below the
        best, and of those the best ones holding top-p of the mass (a stable sort of all 151,936
        logits took 18.6 ms a token); in id order when nothing truncates."""
        p, n = self.params, x.shape[0]
        if 0 < p.top_k < n:
            order = k_best(x, p.top_k)
            kept = x[order].astype(np.float64)
            return order, float(np.exp(kept - kept[0]).sum())
        if p.top_p >= 1.0 and p.min_p <= 0.0:
            return np.arange(n), 1.0
        best = float(x.max())
        e = np.exp(x.astype(np.float64) - best)
        mass = float(e.sum())
        floor = best + np.log(p.min_p) - MIN_P_MARGIN if p.min_p > 0.0 else -np.inf
        if p.top_p < 1.0:
            for gap in TOP_P_GAPS:          # the highest threshold whose tokens hold top-p of the mass
                if best - gap <= floor:
                    break
                if e[x >= best - gap].sum() >= p.top_p * mass * (1 + TOP_P_SLACK):
                    floor = best - gap
                    break
        ids = np.flatnonzero(x >= floor) if floor > -np.inf else np.arange(n)
        return ids[np.argsort(-x[ids], kind="stable")], mass

    def partitions(self, n_vocab: int) -> bool:
        """Whether top-k is taken by partition (instead of a full sort) on rows of n_vocab logits."""
        return partitions(self.params.top_k, n_vocab)


def partitions(k: int, n: int) -> bool:
    """Whether `k_best` takes k of n by partition (instead of a full sort)."""
    return 0 < k < n // PARTITION_BELOW


def k_best(x: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k best values of a row (all of them for k <= 0), best first; equal values in
    id order and the k-th place to the lowest ids, as a stable sort of the whole row has them. By
    partition of a shortlist (`_reaching_kth`) where that pays."""
    n = x.shape[0]
    if not 0 < k < n:
        return np.argsort(-x, kind="stable")
    if not partitions(k, n):
        return np.argsort(-x, kind="stable")[:k]
    ids = _reaching_kth(x, k)
    if ids.size >= k:
        xs = x[ids]
        v = np.partition(xs, xs.size - k)[xs.size - k]        # the k-th best value
        above = ids[xs > v]
        best = np.concatenate([above, ids[xs == v][:k - above.size]])
        if best.size == k:
            return best[np.argsort(-x[best], kind="stable")]
    return np.argsort(-x, kind="stable")[:k]                  # NaN: whatever the sort makes of them


#: logits per block whose maxima narrow a top-k down (`_reaching_kth`)
TOP_K_BLOCK = 64


def _reaching_kth(x: np.ndarray, k: int) -> np.ndarray:
    """The ids (ascending) of a row's logits that reach a threshold the k-th best reaches, so that
    they hold the k best and every logit equal to the k-th: the threshold is the k-th best of the
    maxima of the row's whole blocks of TOP_K_BLOCK logits (k blocks reach it, so at least k logits
    do; the logits past the last whole block are kept when they reach it too). A partition of the
    whole row (151,936 logits) took 1.4-1.9 ms a draw, a fifth of a step of 4 drafted rows at
    temperature > 0; the block maxima and this shortlist take 0.2 ms. Every id when the row holds
    fewer than k blocks."""
    full = x.shape[0] // TOP_K_BLOCK * TOP_K_BLOCK
    if full < k * TOP_K_BLOCK:
        return np.arange(x.shape[0])
    tops = x[:full].reshape(-1, TOP_K_BLOCK).max(axis=1)
    return np.flatnonzero(x >= np.partition(tops, tops.size - k)[tops.size - k])


def sample_rows(samplers: Sequence[Sampler], logits: np.ndarray, histories: Sequence[list[int]],
                processors: Sequence[LogitsProcessors | None] | None = None) -> list[int]:
    """The next token of several sequences at once: row i of `logits` [n, vocab] with samplers[i],
    histories[i] and processors[i], the same tokens as `samplers[i].sample(logits[i], histories[i],
    processors[i])` row by row.

    A batched step decodes one token for every running sequence; the greedy rows (the usual load)
    get their processors and repetition penalty (when they have them) and then one argmax over all
    of them, instead of a Python call chain and an argmax per row. The other rows are drawn in row
    order, each with its own sampler's generator (so a seed gives the same tokens as sampling that
    sequence alone).
    """
    x = np.asarray(logits, dtype=np.float32)
    procs = list(processors) if processors is not None else [None] * len(samplers)
    if x.ndim != 2 or x.shape[0] != len(samplers) or len(histories) != len(samplers) or len(procs) != len(samplers):
        raise ValueError(f"sample_rows: {len(samplers)} samplers, {len(histories)} histories and {len(procs)} "
                         f"processors for logits of shape {x.shape}")
    out = [0] * len(samplers)
    greedy = [i for i, s in enumerate(samplers) if s.params.greedy]
    if greedy:
        rows = x[greedy]                                     # a copy: processors and penalties go into it
        for k, i in enumerate(greedy):
            row = rows[k]
            new = samplers[i].adjusted(row, histories[i], procs[i])
            if new is not row:
                rows[k] = new
        for i, t in zip(greedy, rows.argmax(axis=1).tolist()):
            out[i] = t
    for i, s in enumerate(samplers):
        if not s.params.greedy:
            out[i] = s.sample(x[i], histories[i], procs[i])
    return out


def accept_draft(sampler: Sampler, logits: np.ndarray, draft: Proposal, history: list[int],
                 processors: LogitsProcessors | None = None) -> tuple[int, int | None]:
    """Speculative decoding's acceptance rule: how many of `draft`'s tokens the target keeps and
    the token that follows them (a correction, or the bonus token after all of them); None when a
    kept draft completes the grammar: the output ends at it (as plain sampling's does), so nothing
    after it is verified or drawn (with the end of generation banned, ignore_eos, nothing could be).

    `logits` holds the target's rows for the last kept token and each drafted one. Greedy: a draft
    is kept while it is the target's argmax. Sampled: draft d (drawn from q) is kept with
    probability min(1, p[d] / q[d]); a rejection draws from the residual max(p - q, 0), which leaves
    the output distributed exactly as the target's sampling (a point-mass q when the draft is
    deterministic). The repetition penalty and the logits processors treat each row as they would
    after the drafts kept before it (the history grows, a fork of the processors walks the draft):
    penalties, grammars and thinking budgets verify drafts as plain sampling would draw.
    """
    local = list(history)
    walk = processors.fork() if processors is not None else None     # moves past each kept draft
    for i, d in enumerate(draft.tokens):
        if sampler.params.greedy:
            best = sampler.sample(logits[i], local, walk)
            if best != d:
                return i, best
        else:
            p = sampler.support(logits[i], local, walk)
            q = draft.probs[i]
            q_d = 1.0 if q is None else q.prob(d)
            if sampler.rng.random() >= min(1.0, p.prob(d) / q_d):
                residual = p.residual(q if q is not None else Distribution.point(d, p.n_vocab))
                return i, residual.draw(sampler.rng) if residual is not None else int(p.ids[np.argmax(p.probs)])
        local.append(d)
        if walk is not None:
            walk.accept(d)
            if walk.ended:
                return i + 1, None
    return len(draft.tokens), sampler.sample(logits[len(draft.tokens)], local, walk)
