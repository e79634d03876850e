"""Speculative decoding: guess several tokens cheaply, check them with one target ubatch, keep the
longest right prefix and roll the recurrent state back over the rest.

Draft sources: `NgramDraft` (prompt lookup in the tokens so far), `MtpDraft` (the model's own
multi-token-prediction block) and `ModelDraft` (a smaller GGUF with the same vocabulary). With
greedy sampling the output is token-for-token what plain decoding gives; with temperature > 0
drafts are accepted with probability min(1, p/q) and a rejection resamples from the residual
max(p - q, 0) (`sampling.accept_draft`), which leaves the output distribution exactly the target's.

One step of it, for one sequence or for many in one ubatch: `propose` asks the source for as many
tokens as `DraftLength` allows, the engine (`runner.engine`) evaluates the last kept token and the
drafts, and `verify` accepts, rolls the sequence back over the rest and hands the draft source the
rows it keeps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generator, Protocol, Sequence

import numpy as np

from deltarun.base.errors import DeltarunError
from deltarun.runner.model import Model
from deltarun.runner.sampling import Distribution, LogitsProcessors, Sampler, accept_draft


@dataclass
class Draft:
    """Proposed tokens and, for sampled decoding, the distribution each was drawn from."""

    tokens: list[int]
    probs: list[Distribution | None]   # None: a deterministic proposal (point mass)


class DraftSource(Protocol):
    needs_hidden: bool
    def start(self, prompt: list[int]) -> None:
        """Called once the target has evaluated the prompt."""

    def propose(self, history: list[int], n: int, sampler: Sampler) -> Draft:
        """Up to n tokens that may follow `history` (whose last token the target has not yet evaluated)."""

    def commit(self, next_tokens: list[int], hiddens: np.ndarray | None, start: int) -> None:
        """The target kept rows at positions start..: row i's hidden state (None unless the source
        sets `needs_hidden`) and the token that follows it."""

    def close(self) -> None:
        """Free what the source owns."""


class NgramDraft:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens and propose what followed
    (up to an image: its rows are recorded as negative ids, `image_token`, which are no tokens).

    One source follows one sequence's history (a server gives each request its own): the tokens are
    kept as an array that grows with the history (`_TokenArray`), and the occurrences are found
    from the positions holding the last token, so a step costs one comparison over the context
    (30,000 tokens: 3.0 ms a step before, converting and comparing every window of each length)."""

    needs_hidden = False

    def __init__(self, n_max: int = 4, n_min: int = 1):
        self.n_max, self.n_min = n_max, n_min
        self._tokens = _TokenArray()

    def start(self, prompt: list[int]) -> None:
        pass

    def propose(self, history: list[int], n: int, sampler: Sampler) -> Draft:
        h = self._tokens.of(history)
        last = h.size - 1
        if last < 1:
            return Draft([], [])
        # earlier occurrences end at e < last; matched[i]: how many tokens up to ends[i] equal the
        # history's last ones (at most n_max)
        ends = np.flatnonzero(h[:last] == h[last])
        matched = np.ones(ends.size, dtype=np.int64)
        alive = np.arange(ends.size)
        for j in range(1, min(self.n_max, last)):
            at = ends[alive] - j
            alive = alive[(at >= 0) & (h[np.maximum(at, 0)] == h[last - j])]
            matched[alive] += 1
        for size in range(min(self.n_max, last), self.n_min - 1, -1):
            best: list[int] = []
            for e in ends[matched >= size][::-1]:    # latest first; the latest with n tokens after it wins
                follow = h[e + 1:e + 1 + n]
                image = np.flatnonzero(follow < 0)
                follow = (follow[:image[0]] if image.size else follow).tolist()
                if len(follow) > len(best):
                    best = follow
                if len(best) == n:
                    break
            if best:
                return Draft(best, [None] * len(best))
        return Draft([], [])

    def commit(self, next_tokens: list[int], hiddens: np.ndarray | None, start: int) -> None:
        pass

    def close(self) -> None:
        pass


class _TokenArray:
    """An int64 copy of one history list that converts only what was appended since the last call:
    a sequence's history only grows during a generation (the engine appends kept tokens); another
    list, a shorter one or a changed last token starts the copy again."""

    def __init__(self) -> None:
        self.source: list[int] | None = None
        self.buf = np.empty(0, dtype=np.int64)
        self.n = 0

    def of(self, history: list[int]) -> np.ndarray:
        n = len(history)
        if history is not self.source or n < self.n or (self.n and history[self.n - 1] != self.buf[self.n - 1]):
            self.source, self.n = history, 0
        if n > self.buf.size:
            grown = np.empty(max(n, 2 * self.buf.size, 256), dtype=np.int64)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        self.buf[self.n:n] = history[self.n:n]
        self.n = n
        return self.buf[:n]


def draft_steps(sampler: Sampler, logits: np.ndarray, history: list[int],
                n: int) -> Generator[tuple[int, int], np.ndarray, Draft]:
    """n tokens drafted one after the other (`Sampler.draft`), the first from `logits`: yields
    (i, token i) and is sent the logits that follow drafted token i; returns the Draft. A
    generator, so that the chains of several sequences can advance in lockstep (`propose_mtp`)."""
    tokens: list[int] = []
    probs: list[Distribution | None] = []
    local = list(history)
    for i in range(n):
        tok, q = sampler.draft(logits, local)
        tokens.append(tok)
        probs.append(q)
        local.append(tok)
        if i + 1 < n:
            logits = yield i, tok
    return Draft(tokens, probs)


def draft_chain(sampler: Sampler, logits: np.ndarray, history: list[int], n: int,
                further: Callable[[int, int], np.ndarray]) -> Draft:
    """`draft_steps` driven by `further(i, token i)`, the logits that follow drafted token i."""
    steps = draft_steps(sampler, logits, history, n)
    try:
        need = next(steps)
        while True:
            need = steps.send(further(*need))
    except StopIteration as done:
        return done.value


def check_draft_vocab(draft_vocab: int, target_vocab: int) -> None:
    """A draft model must share the target's vocabulary: its tokens are the target's tokens."""
    if draft_vocab != target_vocab:
        raise DeltarunError(f"the draft model's vocabulary ({draft_vocab} tokens) differs from the "
                            f"target's ({target_vocab}): drafts must share the vocabulary")


def text_tokens(tokens: list[int]) -> list[int]:
    """`tokens` without the rows of images (negative ids, `image_token`): what a text model can read."""
    return [t for t in tokens if t >= 0] if tokens and min(tokens) < 0 else tokens


class ModelDraft:
    """A second, smaller model with the same vocabulary drafts greedily (or by sampling).

    Sequence `seq` of the draft model holds the tokens so far (the last one included, which the
    target has yet to verify). Each round drafts on in that sequence from a host checkpoint of its
    recurrent state and returns to the checkpoint afterwards (the KV rows past it are overwritten
    later), so rejected guesses never need undoing and no sequence is copied. A server gives each
    slot its own sequence of one draft model. The draft model reads text only: it is given the
    history without the rows of its images (`text_tokens`), and drafts from the text around them.
    """

    needs_hidden = False

    def __init__(self, draft: Model, target_vocab: int, seq: int = 0):
        check_draft_vocab(draft.hp.n_vocab, target_vocab)
        if not 0 <= seq < draft.memory.n_seq_max:
            raise DeltarunError(f"draft sequence {seq} out of range (the draft model has {draft.memory.n_seq_max})")
        self.model, self.seq = draft, seq

    def start(self, prompt: list[int]) -> None:
        self.model.memory.clear_seq(self.seq)

    def propose(self, history: list[int], n: int, sampler: Sampler) -> Draft:
        m, seq = self.model, self.seq
        history = text_tokens(history)
        held = m.tokens(seq)
        if len(held) >= len(history) or held != history[:len(held)]:
            m.memory.clear_seq(seq)        # another conversation, or one that changed: evaluate it again
            held = []
        if len(history) > m.n_ctx:
            return Draft([], [])
        logits = m.eval(history[len(held):], seq)
        n = min(n, m.n_ctx - len(history) + 1)
        cp = m.checkpoint(seq) if n > 1 else None
        draft = draft_chain(sampler, logits, history, n, lambda i, tok: m.eval([tok], seq))
        if cp is not None:
            m.restore(cp)
        return draft

    def commit(self, next_tokens: list[int], hiddens: np.ndarray | None, start: int) -> None:
        pass

    def close(self) -> None:
        self.model.close()


class MtpDraft:
    """The target's own MTP block: (embedding of the next token, trunk hidden) -> one token further.

    Its KV cache is filled for every committed position (rows (hidden_i, token_{i+1}) at position
    i), so its attention sees the whole sequence; chained drafts feed the block's output hidden
    state back in.

    `in_graph` (greedy decoding without penalties): the verification step's own graph runs the MTP
    block on every row's (argmax, hidden) (`Model.eval(..., mtp_argmax=True)`), and `commit` takes
    the rows it kept from there instead of evaluating them again: one graph evaluation per step at
    draft-max 1. Rows whose kept token is not the argmax are evaluated separately, as without it.

    `defer` (generate and chat): rows not computed in the graph are kept aside and evaluated
    together, in one MTP ubatch whose LM head runs for the last row only, when the next draft is
    asked for. While `DraftLength` pauses drafting, steps then cost what plain decoding costs
    (the MTP block's LM head is as large as the trunk's). The server commits at once (its prompt
    cache keeps cells whose MTP rows must be filled), but during an engine step (`hold`, set by
    `runner.engine`) its rows wait too, and `commit_held` evaluates every held source's rows
    together, one MTP ubatch (one LM-head pass) for the step's sequences instead of one each;
    the rows of a sequence that does not draft next step (`Running.drafts_next_step`) wait on,
    until it drafts again or the server releases it.
    Rows over an image (next tokens that are an image's, `image_token`) never wait: the model keeps
    only the last few images' embedding rows (`Model.mtp_eval`).
    """

    needs_hidden = True

    def __init__(self, target: Model, in_graph: bool = True, seq: int = 0, defer: bool = False):
        if not target.memory.mtp_layers:
            raise DeltarunError("MTP drafts need a model with an MTP block opened with mtp=True")
        self.model = target
        self.in_graph = in_graph
        self.defer = defer
        self.seq = seq      # the target sequence whose MTP KV rows this source fills (a server moves it)
        self.hold = False   # commits wait for `commit_held` (set by the engine during a step)
        self.first: tuple[np.ndarray, np.ndarray] | None = None   # logits and output of the last row
        #: deferred rows: runs of (tokens, hidden row blocks, first position), in commit order
        self.deferred: list[tuple[list[int], list[np.ndarray], int]] = []

    def start(self, prompt: list[int]) -> None:
        self.first = None

    def propose(self, history: list[int], n: int, sampler: Sampler) -> Draft:
        return propose_mtp(self.model, [(self, history, n, sampler)])[0]

    def chain_start(self, history: list[int], n: int) -> tuple[np.ndarray, np.ndarray, int] | None:
        """What n chained drafts start from: the first draft's logits, the block's output hidden
        state it chains on, and the position of the last committed token (whose hidden row the
        block read); None when there is nothing to draft from or no room."""
        pos = len(history) - 2
        if n > 0 and self.deferred:
            self.evaluate_deferred()
        if self.first is None or n <= 0 or pos + n + 1 > self.model.n_ctx:
            return None
        logits, out = self.first
        return logits, out, pos

    def commit(self, next_tokens: list[int], hiddens: np.ndarray | None, start: int) -> None:
        """Feed rows (hidden_i, token_{i+1}) for positions start.. and keep the last row's output as
        the first draft of the next round. Rows the last trunk evaluation already ran through the
        MTP block with the same token (`Model.last_mtp`) are taken from there; with `defer` the
        others wait for the next `propose`."""
        m = self.model
        # with rows waiting, the graph's MTP rows attended without their K/V: not taken
        done = 0 if self.deferred else self._rows_in_graph(next_tokens, start)
        if done == len(next_tokens):
            rows = m.last_mtp
            self.first = (rows.logits[done - 1], rows.out[done - 1:done])
            return
        over_image = min(next_tokens[done:]) < 0
        if (self.defer or self.hold) and not over_image:
            self.first = None
            self._keep_aside(next_tokens[done:], np.array(hiddens[done:]), start + done)
            return
        if self.deferred:    # rows over an image go now (while the model holds its rows), after those waiting
            self.evaluate_deferred()
        while done < len(next_tokens):
            step = min(m.n_ubatch, len(next_tokens) - done)
            # the LM head for the last row only: only it drafts (a 64-row prompt chunk's MTP rows took
            # 41 ms with every row's head, 11 ms so, at Qwen3.5-0.8B's shapes on 2 threads)
            logits, out = m.mtp_eval(next_tokens[done:done + step], hiddens[done:done + step], start + done,
                                     self.seq, n_outputs=1)
            done += step
        self.first = (logits[-1], out[-1:])

    def _keep_aside(self, tokens: list[int], hiddens: np.ndarray, start: int) -> None:
        """Add rows to the deferred ones, joining the last run when they follow it (its hidden
        rows are joined once, when evaluated)."""
        if self.deferred:
            toks, rows, first = self.deferred[-1]
            if first + len(toks) == start:
                toks.extend(tokens)
                rows.append(hiddens)
                return
        self.deferred.append((list(tokens), [hiddens], start))

    def evaluate_deferred(self) -> None:
        """Write every deferred row's K/V (in commit order: a position committed twice, across a
        rollback, ends with its last rows), computing the LM head for the very last row only."""
        m = self.model
        runs, self.deferred = self.deferred, []
        for toks, parts, first in runs:
            rows = np.concatenate(parts)
            for at in range(0, len(toks), m.n_ubatch):
                logits, out = m.mtp_eval(toks[at:at + m.n_ubatch], rows[at:at + m.n_ubatch], first + at, self.seq,
                                         n_outputs=1)
        self.first = (logits[-1], out[-1:])

    def _rows_in_graph(self, next_tokens: list[int], start: int) -> int:
        """How many leading rows the last trunk graph computed with exactly these tokens."""
        rows = self.model.last_mtp
        if rows is None or rows.seq != self.seq or rows.start != start:
            return 0
        n = 0
        while n < min(len(next_tokens), len(rows.tokens)) and rows.tokens[n] == next_tokens[n]:
            n += 1
        return n

    def wants_mtp_argmax(self, sampler: Sampler) -> bool:
        """Whether verification steps should run the MTP block in their graph: only when the next
        token is the argmax of the logits (greedy, no repetition penalty); else the rows it would
        compute are mostly not the kept ones."""
        p = sampler.params
        return self.in_graph and p.greedy and (p.repeat_penalty == 1.0 or p.repeat_last_n == 0)

    def close(self) -> None:
        pass


class MtpFeed:
    """Hands a draft source that reads hidden rows (an MTP block) a prompt's rows while the prompt
    is evaluated chunk by chunk: a server's prompt chunks, chat's prefill steps, the text and images
    `generate` evaluates before its prompt's last text.

    Row i pairs with the token at position i + 1, so each chunk's rows but its last are handed over
    at once, and the last waits (`tail`) for the chunk after it (prepended there: that position is
    then evaluated, an image's first row included, whose embedding row the MTP row takes) or for the
    first sampled token (`context`). Fed chunk by chunk, an MTP row over an image is evaluated while
    the model still holds the image's rows (it keeps the last MTP_IMAGES images').
    """

    def __init__(self, draft: DraftSource):
        self.draft = draft
        self.tail: tuple[np.ndarray, int] | None = None     # (hidden row, its position)

    def feed(self, tokens: Sequence[int], rows: np.ndarray, start: int) -> None:
        """The hidden rows of positions start.. just evaluated; `tokens`: the sequence's tokens
        (position p's at tokens[p]) through the last of them."""
        rows = np.asarray(rows)
        if self.tail is not None and self.tail[1] == start - 1:
            rows, start = np.concatenate([self.tail[0][None], rows]), start - 1
        self.tail = None
        if not len(rows):
            return
        end = start + len(rows)
        if len(rows) > 1:
            self.draft.commit([int(t) for t in tokens[start + 1:end]], rows[:-1], start)
        self.tail = (rows[-1], end - 1)

    def resume(self, row: np.ndarray | None, pos: int) -> None:
        """The sequence resumes after position `pos` (a cache hit, a checkpoint): its hidden row, when
        kept, waits for the token that now follows it."""
        if row is not None and pos >= 0 and (self.tail is None or self.tail[1] != pos):
            self.tail = (np.asarray(row), pos)

    def context(self, n_past: int) -> tuple[list[int], np.ndarray, int] | None:
        """`Engine.first`'s context once the prompt is evaluated (`n_past` tokens): its last row,
        which meets the first sampled token; None when that row is not the one waiting."""
        tail, self.tail = self.tail, None
        if tail is None or tail[1] != n_past - 1:
            return None
        return [], tail[0][None], tail[1]


class DraftLength:
    """How many tokens to draft for the next verification step, from the acceptance so far.

    After a step whose drafts were all accepted, one more (up to k_max); after a rejection, one
    past the accepted ones (rows of a verification ubatch are not free). When drafts stop paying
    (the moving average of the accepted fraction, weight AVERAGE_WEIGHT per step, falls below
    MIN_ACCEPTANCE) drafting pauses for a few steps of plain decoding, then one drafted token
    probes again: a rejected probe doubles the pause (MIN_PAUSE up to MAX_PAUSE steps), an accepted
    one resumes drafting. So a draft source that is never right costs a few verification steps
    and a probe now and then over plain decoding. The length depends only on earlier steps, never
    on the current step's draws, so sampled output keeps the target's distribution exactly.
    """

    MIN_ACCEPTANCE = 0.3     # a draft token costs about a third of a token here (MTP: its LM head)
    AVERAGE_WEIGHT = 0.5
    MIN_PAUSE = 4
    MAX_PAUSE = 64

    def __init__(self, k_max: int):
        self.k_max = k_max
        self.k = k_max
        self.average = 1.0
        self.paused = 0                 # steps left without drafts
        self.pause = self.MIN_PAUSE     # the next pause's length
        self.probing = False

    def next(self) -> int:
        """The length for this step (call once per step; 0 while paused)."""
        if self.paused:
            self.paused -= 1
            self.probing = self.paused == 0
            return 0
        return 1 if self.probing else self.k

    def update(self, n_drafted: int, n_accepted: int) -> None:
        """What the step's verification kept of its n_drafted tokens."""
        if n_drafted == 0:
            return
        if self.probing:
            self.probing = False
            if n_accepted == 0:
                self._pause()
            else:
                self.average, self.pause, self.k = 1.0, self.MIN_PAUSE, min(self.k_max, 2)
            return
        self.average += self.AVERAGE_WEIGHT * (n_accepted / n_drafted - self.average)
        self.k = min(self.k_max, max(self.k, n_drafted) + 1) if n_accepted == n_drafted else n_accepted + 1
        if self.average < self.MIN_ACCEPTANCE:
            self._pause()

    def _pause(self) -> None:
        self.paused, self.pause = self.pause, min(2 * self.pause, self.MAX_PAUSE)


def draft_limit(model: Model, draft_max: int) -> int:
    """The most tokens one verification step drafts: draft_max, within what a rollback undoes
    (rs_slots - 1 tokens); an error when the model keeps no rollback slot to spare."""
    k_max = min(draft_max, model.rs_slots - 1)
    if k_max < 1:
        raise DeltarunError(f"speculative decoding needs rollback slots: open the model with --rs-slots "
                            f"{draft_max + 1} (it has {model.rs_slots})")
    return k_max


def draft_count(length: DraftLength, budget: int, room: int) -> int:
    """How many drafts a sequence proposes this step: as many as `length` allows now (asked once
    a step), within `budget` (the tokens still wanted, the next one included) and `room` (context
    rows free after the last kept token's)."""
    return max(0, min(length.next(), budget - 1, room))


def verify(model: Model, seq: int, logits: np.ndarray, draft: Draft, sampler: Sampler, history: list[int], *,
           processors: LogitsProcessors | None = None, source: DraftSource | None = None,
           hidden: np.ndarray | None = None, length: DraftLength | None = None) -> tuple[int, list[int]]:
    """Settle one sequence's verification: the drafts the target accepts (`sampling.accept_draft`)
    and the token after them; `seq` rolled back over the rows past the kept ones; `length` told
    what was kept; `source` handed the kept rows (`commit_kept`). Returns (drafts accepted, the
    kept tokens: those drafts and the next token, none after a draft that completes the grammar).

    `logits` (and `hidden`, the hidden states) are the rows the sequence's last ubatch evaluated:
    its last kept token, the drafts, and in a server's shared ubatch filler after them.
    """
    n_ok, nxt = accept_draft(sampler, logits[:len(draft.tokens) + 1], draft, history, processors)
    model.rollback(len(logits) - 1 - n_ok, seq)
    if length is not None:
        length.update(len(draft.tokens), n_ok)
    kept = draft.tokens[:n_ok] + ([] if nxt is None else [nxt])
    commit_kept(source, model, seq, kept, hidden, n_ok + 1)
    return n_ok, kept


def commit_kept(source: DraftSource | None, model: Model, seq: int, kept: list[int],
                hidden: np.ndarray | None, n_rows: int) -> None:
    """Hand the draft source the rows a step kept, once `seq` holds exactly them (its last
    `n_rows`): row i's hidden state (when the source needs them) and kept[i], the token that
    follows it (the last row has none when the output ended at it: `accept_draft`)."""
    if source is not None:
        n = len(kept)
        source.commit(kept, hidden[:n] if source.needs_hidden else None, model.n_past(seq) - n_rows)


@dataclass
class _Chain:
    """One sequence's MTP chain in progress: its drafting generator, the drafted token it waits on
    the logits after (at chain level `level`), the block's last output hidden state, and the
    position of the last committed token."""

    seq: int
    steps: Generator[tuple[int, int], np.ndarray, Draft]
    level: int
    token: int
    out: np.ndarray
    pos: int

    def row(self) -> tuple[list[int], np.ndarray, int]:
        """The MTP row that gives those logits: the token, at the position after the previous one."""
        return [self.token], self.out[-1:], self.pos + 1 + self.level


def propose_mtp(model: Model, wants: list[tuple[MtpDraft, list[int], int, Sampler]]) -> list[Draft]:
    """Chained MTP drafts of several sequences: wants[i] = (source, history, drafts wanted,
    sampler). The chains advance in lockstep: level i of every chain that goes on is one MTP
    ubatch per run of consecutive sequences (`Model.mtp_eval_rows`: one row each, the drafted
    token at the position after the previous one, on the block's output hidden state), so a step
    whose sequences draft d tokens each evaluates the MTP block and its LM head d - 1 times, not
    (d - 1) x sequences times. An evaluation that fails raises for all (the engine then proposes
    for each alone)."""
    drafts = [Draft([], []) for _ in wants]
    chains: dict[int, _Chain] = {}
    for i, (source, history, n, sampler) in enumerate(wants):
        start = source.chain_start(history, n)
        if start is None:
            continue
        logits, out, pos = start
        steps = draft_steps(sampler, logits, history, n)
        try:
            chains[i] = _Chain(source.seq, steps, *next(steps), out, pos)
        except StopIteration as done:
            drafts[i] = done.value
    while chains:
        for run in _consecutive(sorted(chains, key=lambda i: chains[i].seq), lambda i: chains[i].seq):
            results = model.mtp_eval_rows([chains[i].row() for i in run], chains[run[0]].seq)
            for i, (logits, out) in zip(run, results):
                chain = chains[i]
                chain.out = out
                try:
                    chain.level, chain.token = chain.steps.send(logits)
                except StopIteration as done:
                    drafts[i] = done.value
                    del chains[i]
    return drafts


def _consecutive(items: list, seq_of: Callable[[Any], int]) -> list[list]:
    """`items` (sorted by sequence) cut into runs of consecutive sequences."""
    runs: list[list] = []
    for item in items:
        if runs and seq_of(runs[-1][-1]) + 1 == seq_of(item):
            runs[-1].append(item)
        else:
            runs.append([item])
    return runs


def commit_held(model: Model, sources: list[MtpDraft]) -> dict[int, Exception]:
    """Evaluate the rows MTP sources held during an engine step (`MtpDraft.hold`): the sources of
    consecutive sequences together, one MTP ubatch per run of them (`Model.mtp_eval_rows`), each
    source then holding its next first draft. A source with rows of several runs (deferred across
    rollbacks) or too many rows for one ubatch is evaluated alone. Returns the errors by sequence."""
    errors: dict[int, Exception] = {}
    alone = [s for s in sources if len(s.deferred) != 1 or len(s.deferred[0][0]) > model.memory.rs_slots]
    together = sorted((s for s in sources if s not in alone and s.deferred), key=lambda s: s.seq)
    for run in _consecutive(together, lambda s: s.seq):
        if len(run) == 1:
            alone.append(run[0])
            continue
        rows = [(toks, np.concatenate(parts), first) for toks, parts, first in (s.deferred[0] for s in run)]
        try:
            results = model.mtp_eval_rows(rows, run[0].seq)
        except Exception:  # noqa: BLE001 - each is then evaluated alone and reports its own error
            alone.extend(run)
            continue
        for s, (logits, out) in zip(run, results):
            s.deferred, s.first = [], (logits, out)
    for s in alone:
        if s.deferred:
            try:
                s.evaluate_deferred()
            except Exception as e:  # noqa: BLE001
                errors[s.seq] = e
    return errors
