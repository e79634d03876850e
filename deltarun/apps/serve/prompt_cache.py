"""The prompt cache for hybrid models: resume each request from the longest usable saved state.

A hybrid model's state after n tokens is the KV rows of positions 0..n-1 (which any shorter
prefix can reuse: they are per position) plus the recurrent state, which exists only for the exact
length it was computed at. So the cache keeps, per conversation, its KV rows and recurrent-state
checkpoints at chosen lengths:

- in a **seq** (a sequence slot of the model) the KV rows are live and the live recurrent state
  is the one at the seq's length; host checkpoints hold earlier lengths, and the rollback slots
  reach the last few tokens of the last ubatch;
- in **host RAM** an evicted conversation keeps a copy of its KV rows plus its checkpoints
  (including one at its end), bounded with the seq checkpoints by `--cache-ram`, least recently
  used first out.

Checkpoints are taken where the next request is likely to diverge: at message boundaries, at
the position where the next turn's rendering of this turn's answer begins (Qwen3 templates drop
the think block of earlier answers, so the next prompt differs right there), every M tokens of a
long prompt, and at the end of each prompt (with its logits, so re-sending the same prompt
evaluates nothing).

When the server prefills a conversation's next turn ahead (`Worker.prefill_ahead`), its seq goes
back to the answer start and the tail it replaces is kept **aside** (`apply(..., keep_tail=True)`):
its tokens, the KV rows of those positions and the checkpoints among them. So the prompt of the
turn just answered stays resumable: regenerating the answer still evaluates nothing. (Only work
ahead keeps a tail: it runs while the server is idle, where a request would pay for the copy.)

While the server is idle with every seq taken, the conversation a new one would push out next
(the least recently used seq) is **copied to host RAM ahead** (`copy_ahead`): the request that
pushes it out then finds the copy made and does not wait for it. The copy stays tied to its
seq (`CellInfo.copy`) only while the seq holds exactly those tokens; once the seq moves on, the
copy is a stale prefix of it and is dropped.

For a request the cache describes every idle seq (its tokens, the rollback its slots still
reach, its checkpoints and aside) and host entry to the resume planner (`runner/resume.py`, which
chat asks too). It computes the common token prefix p with the prompt and the longest length
r <= p each can resume at (the seq's live state when the prompt extends it, a rollback, or a
checkpoint), and picks the largest r. Only the prompt after r is evaluated; r is the request's
`cached_tokens`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from deltarun.runner.memory import KVRows, RecurrentState
from deltarun.runner.resume import Held, Plan, Saved, plan_resume


@dataclass
class CachedState:
    """A recurrent state the prompt cache keeps at a prompt position (a checkpoint of a
    conversation), with the logits of the last token when it ends a prompt."""

    state: RecurrentState
    logits: np.ndarray | None = None     # logits of the last token, for a prompt-end checkpoint

    @property
    def pos(self) -> int:
        return self.state.n_past

    @cached_property
    def nbytes(self) -> int:
        """Host bytes (a checkpoint never changes; the cache adds these up after every prompt)."""
        return self.state.nbytes + (self.logits.nbytes if self.logits is not None else 0)


@dataclass
class Aside:
    """The tail of a seq from `start` on, kept when the seq went back to `start` (see the module
    docstring): the seq's positions before `start` are still these tokens' KV rows."""

    start: int
    tokens: list[int]                    # all of them, the shared first `start` included
    kv: KVRows                           # rows of positions start..len(tokens)-1
    checkpoints: dict[int, CachedState]   # after start
    hidden: dict[int, np.ndarray]        # as CellInfo.hidden, at those checkpoints
    answer_start: int

    @cached_property
    def nbytes(self) -> int:
        return (self.kv.nbytes + sum(c.nbytes for c in self.checkpoints.values())
                + sum(h.nbytes for h in self.hidden.values()))


@dataclass
class CellInfo:
    """What the cache knows about one seq beyond the model's own bookkeeping."""

    checkpoints: dict[int, CachedState] = field(default_factory=dict)
    answer_start: int = 0     # where the next turn is expected to diverge from the last prompt
    last_used: float = 0.0
    #: trunk hidden rows by prefix length L (the row of token L-1), for the lengths a request can
    #: resume at (the last rs_slots lengths and the checkpoints): an MTP draft needs the row before
    #: the resume point to fill its KV row there (see `note_hidden`)
    hidden: dict[int, np.ndarray] = field(default_factory=dict)
    aside: Aside | None = None
    copy: "HostEntry | None" = None   # this seq's conversation copied to host RAM ahead (copy_ahead)

    def truncate(self, n: int) -> None:
        self.checkpoints = {p: c for p, c in self.checkpoints.items() if p <= n}
        self.answer_start = min(self.answer_start, n)
        self.hidden = {p: h for p, h in self.hidden.items() if p <= n}
        if self.aside is not None and n < self.aside.start:
            self.aside = None


@dataclass(eq=False)      # an entry is itself: removed and looked for by identity
class HostEntry:
    tokens: list[int]
    kv: KVRows
    checkpoints: dict[int, CachedState]
    answer_start: int
    last_used: float
    hidden: dict[int, np.ndarray] = field(default_factory=dict)   # as CellInfo.hidden

    @cached_property
    def own_bytes(self) -> int:
        """Host bytes of the KV copy and hidden rows (fixed once the entry is made), checkpoints apart."""
        return self.kv.nbytes + sum(h.nbytes for h in self.hidden.values())


@dataclass
class Resume:
    """Where a request starts: `pos` prompt tokens are reused (`logits` set when pos == len(prompt))."""

    pos: int = 0
    how: str = "fresh"                   # fresh | live | rollback | checkpoint | aside | host
    seq: int | None = None              # for live / rollback / checkpoint / aside
    entry: HostEntry | None = None       # for host
    checkpoint: CachedState | None = None
    logits: np.ndarray | None = None
    hidden: np.ndarray | None = None     # the trunk hidden row of token pos-1, when the cache kept it


KEEP_PER_SEQ = 2


def _kept_logits(cp: CachedState) -> np.ndarray | None:
    """The logits kept with a checkpoint (prompt ends only): what the planner asks of a state."""
    return cp.logits


class PromptCache:
    def __init__(self, model: Any, n_seq_max: int, budget_bytes: int):
        self.model = model
        self.seqs = [CellInfo() for _ in range(n_seq_max)]
        self.host: list[HostEntry] = []
        self.budget = budget_bytes
        self.n_evictions = 0

    # --- lookup ------------------------------------------------------------------------------
    def _held(self, seq: int) -> Held:
        """What `seq` holds, for the planner: its tokens and rollback slots, its checkpoints (the
        one at its end may keep the logits) and its aside."""
        info, memory = self.seqs[seq], self.model.memory
        tokens = memory.seqs[seq].tokens
        end = info.checkpoints.get(len(tokens))
        saved = [Saved("checkpoint", tokens, info.checkpoints, _kept_logits)]
        if info.aside is not None:
            saved.append(Saved("aside", info.aside.tokens, info.aside.checkpoints, _kept_logits, owner=info.aside))
        return Held.of(memory, seq, end.logits if end is not None else None, saved)

    def lookup(self, prompt: list[int], idle: list[int]) -> Resume:
        """The best place to resume `prompt` from among the idle seqs and the host entries (the
        choice is `runner.resume.plan_resume`'s)."""
        plan: Plan = plan_resume(prompt, [self._held(c) for c in idle],
                                 [Saved("host", e.tokens, e.checkpoints, _kept_logits, owner=e) for e in self.host])
        best = Resume(plan.pos, plan.kind, plan.seq, entry=plan.saved.owner if plan.kind == "host" else None,
                      checkpoint=plan.state, logits=plan.logits)
        if best.how == "aside":
            rows = self.seqs[best.seq].aside.hidden
        else:
            rows = self.seqs[best.seq].hidden if best.seq is not None else best.entry.hidden if best.entry else {}
        best.hidden = rows.get(best.pos)
        return best

    def pick_seq(self, idle: list[int]) -> int:
        """A seq for a request that resumes from host RAM or from nothing: an empty one, else the LRU."""
        empty = [c for c in idle if self.model.n_past(c) == 0]
        if empty:
            return empty[0]
        return min(idle, key=lambda c: self.seqs[c].last_used)

    # --- applying a lookup ---------------------------------------------------------------------
    def apply(self, r: Resume, seq: int, keep_tail: bool = False) -> None:
        """Make `seq` hold the first r.pos tokens of the request's prompt; with keep_tail, what a
        rollback or checkpoint resume replaces goes aside (see the module docstring)."""
        model, info = self.model, self.seqs[seq]
        if r.how in ("fresh", "host") and model.n_past(seq) > 0:
            self._evict(seq)
        if r.how == "fresh":
            model.memory.clear_seq(seq)
            self.seqs[seq] = CellInfo()
        elif r.how == "live":
            pass
        elif r.how == "rollback":
            if keep_tail:
                self._set_aside(seq, r.pos)
            model.memory.rollback(model.n_past(seq) - r.pos, seq)
            info.truncate(r.pos)
        elif r.how == "checkpoint":
            if r.pos < info.answer_start:          # a branch or another conversation: keep the old one too
                self._evict(seq, keep_seq=True)
            elif keep_tail:
                self._set_aside(seq, r.pos)
            tokens = model.tokens(seq)[:r.pos]
            model.memory.write_recurrent(seq, r.checkpoint.state)
            model.memory.set_tokens(seq, tokens)
            info.truncate(r.pos)
        elif r.how == "aside":
            a, info.aside = info.aside, None       # what the seq holds after a.start is dropped
            model.memory.write_kv(seq, a.kv, r.pos - a.start)
            model.memory.write_recurrent(seq, r.checkpoint.state)
            model.memory.set_tokens(seq, a.tokens[:r.pos])
            info.checkpoints = {p: c for p, c in info.checkpoints.items() if p <= a.start} | \
                {p: c for p, c in a.checkpoints.items() if p <= r.pos}
            info.hidden = {p: h for p, h in info.hidden.items() if p <= a.start} | \
                {p: h for p, h in a.hidden.items() if p <= r.pos}
            info.answer_start = min(a.answer_start, r.pos)
        elif r.how == "host":
            e = r.entry
            model.memory.write_kv(seq, e.kv, r.pos)
            model.memory.write_recurrent(seq, r.checkpoint.state)
            model.memory.set_tokens(seq, e.tokens[:r.pos])
            self.seqs[seq] = CellInfo({p: c for p, c in e.checkpoints.items() if p <= r.pos},
                                        min(e.answer_start, r.pos),
                                        hidden={p: h for p, h in e.hidden.items() if p <= r.pos})
            # (the eviction above may have pushed it out already: it made room, least recently used
            # first, and brought it up to date when it was this seq's copy made ahead)
            if e in self.host:
                self.host.remove(e)
        self.seqs[seq].last_used = time.monotonic()

    def _set_aside(self, seq: int, start: int) -> None:
        """Keep the tail of `seq` after `start` aside (replacing the one there) when it has
        checkpoints to resume from and the budget allows; else forget it."""
        model, info = self.model, self.seqs[seq]
        later = {p: c for p, c in info.checkpoints.items() if p > start}
        info.aside = None
        if not later or self.budget <= 0 or model.n_past(seq) <= start:
            return
        a = Aside(start, model.tokens(seq), model.memory.read_kv(seq, model.n_past(seq), start), later,
                  {p: h for p, h in info.hidden.items() if p in later}, info.answer_start)
        if a.nbytes <= self.budget:
            info.aside = a
            self._enforce_budget(protect=seq)

    def checkpoint(self, seq: int, logits: np.ndarray | None = None, state: RecurrentState | None = None) -> None:
        """Save the live recurrent state of `seq` at its current length, or `state` (captured
        inside the evaluation that just ended, at an earlier length)."""
        state = state if state is not None else self.model.memory.read_recurrent(seq)
        cp = CachedState(state, None if logits is None else np.array(logits))
        self.seqs[seq].checkpoints[cp.pos] = cp
        self._enforce_budget(protect=seq)

    def note_hidden(self, seq: int, rows: np.ndarray) -> None:
        """Remember the trunk hidden rows of the last len(rows) tokens of `seq` (called after each
        ubatch when the server drafts with the MTP block); those of the lengths a rollback reaches
        and of the checkpoints are kept, so a request resuming here can fill the MTP block's KV row
        at the resume point as a fresh evaluation would have."""
        info, n = self.seqs[seq], self.model.n_past(seq)
        for i, row in enumerate(rows):
            info.hidden[n - len(rows) + 1 + i] = np.array(row, dtype=np.float32)
        oldest = n - self.model.rs_slots + 1
        info.hidden = {p: h for p, h in info.hidden.items() if p <= n and (p >= oldest or p in info.checkpoints)}

    def finished(self, seq: int, answer_start: int) -> None:
        info = self.seqs[seq]
        info.answer_start = min(answer_start, self.model.n_past(seq))
        info.last_used = time.monotonic()

    def swap(self, a: int, b: int) -> None:
        """Exchange the contents of seqs a and b (KV rows, recurrent state, tokens, checkpoints).

        The worker keeps running sequences in consecutive seqs this way, so that one ubatch decodes
        all of them; rollback slots do not survive the move (nothing needs them between requests).
        """
        self.model.memory.swap_seqs(a, b)
        self.seqs[a], self.seqs[b] = self.seqs[b], self.seqs[a]

    # --- host RAM ------------------------------------------------------------------------------
    def _evict(self, seq: int, keep_seq: bool = False) -> None:
        """Move the conversation in `seq` to host RAM (when the budget allows it): its copy made
        ahead, brought up to date, or a copy made now."""
        model, info = self.model, self.seqs[seq]
        if model.n_past(seq) == 0 or self.budget <= 0:
            return
        entry = self._copy_of(seq)
        if entry is not None:
            info.copy = None
            entry.checkpoints.update(info.checkpoints)
            entry.hidden.update({p: h for p, h in info.hidden.items() if p in entry.checkpoints})
            entry.__dict__.pop("own_bytes", None)    # cached: the hidden rows may have grown
            entry.answer_start, entry.last_used = info.answer_start, info.last_used
        elif self._copy(seq) is None:
            return
        self.n_evictions += 1
        if not keep_seq:
            self.seqs[seq] = CellInfo()
        self._enforce_budget(protect=seq)

    def _copy(self, seq: int) -> HostEntry | None:
        """A host entry holding a copy of the conversation in `seq` (None when over the budget)."""
        model, info = self.model, self.seqs[seq]
        n = model.n_past(seq)
        cps = dict(info.checkpoints)
        if n not in cps:
            cps[n] = CachedState(model.memory.read_recurrent(seq))
        kv = model.memory.read_kv(seq, n)
        entry = HostEntry(model.tokens(seq), kv, cps, info.answer_start, info.last_used,
                          {p: h for p, h in info.hidden.items() if p in cps})
        if self._entry_bytes(entry) > self.budget:
            return None
        self.host.append(entry)
        return entry

    def _copy_of(self, seq: int) -> HostEntry | None:
        """The copy of `seq` made ahead, if the seq still holds exactly its tokens; a stale one
        (the seq moved on: the copy is a prefix of it, or another conversation's) is dropped."""
        info = self.seqs[seq]
        e = info.copy
        if e is None:
            return None
        held = e in self.host        # not pushed out by the budget, nor resumed elsewhere
        if held and e.tokens == self.model.tokens(seq):
            return e
        info.copy = None
        if held:
            self.host.remove(e)
        return None

    def copy_ahead(self, idle: list[int]) -> bool:
        """With the server idle: copy to host RAM the conversation a new one would push out next
        (the least recently used of the `idle` seqs, when none is empty), unless it is copied
        already or the copy would not fit beside what host RAM holds; stale copies of other seqs
        are dropped first. Returns whether it copied."""
        for c in range(len(self.seqs)):
            self._copy_of(c)
        if self.budget <= 0 or not idle or any(self.model.n_past(c) == 0 for c in idle):
            return False
        seq = self.pick_seq(idle)
        info = self.seqs[seq]
        if info.copy is not None:
            return False
        n = self.model.n_past(seq)
        state = next(iter(info.checkpoints.values())).nbytes if info.checkpoints and n not in info.checkpoints else 0
        if self.nbytes() + n * self.model.memory.kv_position_bytes + state > self.budget:
            return False     # it would push out what host RAM holds already: left to the eviction
        copy = self._copy(seq)
        if copy is not None and self.nbytes() > self.budget:     # the estimate left out hidden rows
            self.host.remove(copy)
            copy = None
        info.copy = copy
        return copy is not None

    @staticmethod
    def _entry_bytes(e: HostEntry) -> int:
        return e.own_bytes + sum(c.nbytes for c in e.checkpoints.values())

    def nbytes(self) -> int:
        """Host bytes held: KV copies plus every distinct checkpoint."""
        seen: dict[int, int] = {}
        total = 0
        for e in self.host:
            total += e.own_bytes
            for c in e.checkpoints.values():
                seen[id(c)] = c.nbytes
        for info in self.seqs:
            for c in info.checkpoints.values():
                seen[id(c)] = c.nbytes
            if info.aside is not None:
                total += info.aside.nbytes
        return total + sum(seen.values())

    def _enforce_budget(self, protect: int | None = None) -> None:
        """Drop least recently used host entries, then the asides of the least recently used seqs
        (the protected one's last), then the oldest checkpoints of the least recently used seqs.
        The two newest checkpoints of every seq stay whatever the budget: usually the start of the
        last answer and the end of the last prompt, which the next turn and a regeneration resume
        from."""
        while self.nbytes() > self.budget and self.host:
            self.host.remove(min(self.host, key=lambda e: e.last_used))
        order = sorted(range(len(self.seqs)), key=lambda c: (c == protect, self.seqs[c].last_used))
        for c in order:
            if self.nbytes() <= self.budget:
                return
            self.seqs[c].aside = None
        for c in order:
            cps = self.seqs[c].checkpoints
            for pos in sorted(cps)[:-KEEP_PER_SEQ]:
                if self.nbytes() <= self.budget:
                    return
                del cps[pos]
