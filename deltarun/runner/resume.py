"""Where a prompt resumes: the one planner chat and the server's prompt cache ask.

A hybrid model's state after n tokens is the KV rows of positions 0..n-1 (any shorter prefix can
reuse them: they are per position) plus the recurrent state, which exists only for the exact length
it was computed at. So a sequence that holds some tokens can resume a new prompt at a length r only

- **live**: the prompt extends what the sequence holds (r = its length);
- **rollback**: r lies within the tokens the rollback slots can still undo
  (`Memory.rollback_limit`);
- **checkpoint**: a saved recurrent state of the sequence at r (the KV rows before r are the
  sequence's own, so r is at most what the sequence shares with the prompt);
- **aside** (the server): a saved state at r in a tail kept aside, whose KV rows from its start on
  were saved with it;
- **host** (the server): a saved state at r in a conversation copied to host RAM, KV rows and all,
  restored into any cell;
- **fresh**: from nothing.

`plan_resume` takes what each candidate sequence holds (`Held`, made from `Memory` with
`Held.of`) and the saved states not in a sequence (`Saved`, host copies), and returns the `Plan`
that reuses the most prompt tokens, at equal reuse the cheaper one (`PREFERENCE`). At least the
last prompt token is always evaluated, for its logits, unless they were kept with the state at the
prompt's end. The callers carry a plan out through `Memory`'s state operations: `rollback`,
`restore` / `write_recurrent` (and `write_kv` for host copies and asides), `clear` / `clear_seq`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    from deltarun.runner.memory import Memory

#: how a plan resumes, cheapest first at equal reuse
PREFERENCE = {"live": 4, "rollback": 3, "checkpoint": 2, "aside": 2, "host": 1, "fresh": 0}


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    x = np.asarray(a[:n], dtype=np.int64)
    y = np.asarray(b[:n], dtype=np.int64)
    diff = np.flatnonzero(x != y)
    return int(diff[0]) if diff.size else n


@dataclass(frozen=True)
class Saved:
    """States saved along one token list: at each position `pos` of `states`, the state after
    tokens[:pos] (whatever object the caller keeps; the planner only passes it on).

    kind: "checkpoint" (a recurrent state of the sequence it is given with, restored in place),
    "aside" (a tail kept aside from that sequence), "host" (a copy in host RAM, given apart).
    `logits_of(state)`: the logits of token pos-1 kept with a state, or None; a state at the
    prompt's end is usable only with them. `restorable(state)`: False for a state that went stale
    (`Memory.can_restore`). `owner`: the caller's container (the aside, the host entry)."""

    kind: str
    tokens: Sequence[int]
    states: Mapping[int, Any]
    logits_of: Callable[[Any], Any] | None = None
    restorable: Callable[[Any], bool] | None = None
    owner: Any = None


@dataclass(frozen=True)
class Held:
    """What one sequence holds: its tokens, how many of them the rollback slots can still undo,
    the logits of its last token when they are at hand, and the saved states that can be restored
    into it (its checkpoints, a tail kept aside). `seq`: the caller's name for it (a cell)."""

    seq: Any
    tokens: Sequence[int]
    rollback_limit: int = 0
    logits: Any = None
    saved: Sequence[Saved] = ()

    @classmethod
    def of(cls, memory: "Memory", seq: int, logits: Any = None, saved: Sequence[Saved] = ()) -> "Held":
        """What sequence `seq` of `memory` holds (its token list itself, not a copy: plan, then change it)."""
        return cls(seq, memory.seqs[seq].tokens, memory.rollback_limit(seq), logits, tuple(saved))


@dataclass(frozen=True)
class Plan:
    """Where a prompt of `n_prompt` tokens resumes: `pos` of them are reused, `n_eval` remain."""

    kind: str = "fresh"                  # live | rollback | checkpoint | aside | host | fresh
    pos: int = 0
    n_prompt: int = 0
    seq: Any = None                      # the sequence resumed in (live, rollback, checkpoint, aside)
    n_rollback: int = 0                  # tokens to roll back (rollback)
    state: Any = None                    # the saved state to restore (checkpoint, aside, host)
    saved: Saved | None = None           # where that state was found
    logits: Any = None                   # the last prompt token's logits, when nothing is left to evaluate

    @property
    def n_eval(self) -> int:
        return self.n_prompt - self.pos

    def beats(self, other: "Plan") -> bool:
        """More prompt tokens reused, or as many the cheaper way."""
        return (self.pos, PREFERENCE[self.kind]) > (other.pos, PREFERENCE[other.kind])


def plan_resume(prompt: Sequence[int], held: Sequence[Held] = (), saved: Sequence[Saved] = ()) -> Plan:
    """The best place to resume `prompt` from: one of the `held` sequences (live, by rollback or from
    a state saved with it), else a state of `saved` (host copies), else fresh."""
    best = Plan(n_prompt=len(prompt))
    if not prompt:
        return best
    for h in held:
        plan = _plan_sequence(prompt, h)
        if plan.beats(best):
            best = plan
    for s in saved:
        best = _restore(s, common_prefix_length(s.tokens, prompt), len(prompt), best)
    return best


def _plan_sequence(prompt: Sequence[int], h: Held) -> Plan:
    """The best place to resume `prompt` in sequence `h`."""
    n, L = len(h.tokens), len(prompt)
    p = common_prefix_length(h.tokens, prompt)
    if 0 < p == n < L:
        return Plan("live", n, L, h.seq)
    if p == n == L and h.logits is not None:
        return Plan("live", L, L, h.seq, logits=h.logits)
    best = Plan(n_prompt=L)
    target = min(p, L - 1)             # the last prompt token is evaluated for its logits
    if 0 < n - target <= h.rollback_limit:
        best = Plan("rollback", target, L, h.seq, n_rollback=n - target)
    for s in h.saved:
        shared = p if s.tokens is h.tokens else common_prefix_length(s.tokens, prompt)
        if s.kind == "checkpoint":
            shared = min(shared, p)    # restored in place: the KV rows before it are the sequence's
        best = _restore(s, shared, L, best, h.seq)
    return best


def _restore(s: Saved, shared: int, L: int, best: Plan, seq: Any = None) -> Plan:
    """`best`, or the plan restoring the state of `s` that reuses the most of a prompt of L tokens
    (of which `s` may serve the first `shared`), when it beats `best`."""
    if shared <= best.pos:
        return best                    # no state of it reuses more (and at 0, fresh is as good)
    pos, state, logits = 0, None, None
    for q, st in s.states.items():
        if not pos < q <= shared:
            continue
        lg = s.logits_of(st) if s.logits_of is not None and q == L else None
        if q == L and lg is None:
            continue                   # at the prompt's end, a state is usable with its logits only
        if s.restorable is not None and not s.restorable(st):
            continue                   # stale: the sequence was cut below it since it was saved
        pos, state, logits = q, st, lg
    plan = Plan(s.kind, pos, L, seq, state=state, saved=s, logits=logits)
    return plan if state is not None and plan.beats(best) else best
