"""The resume planner (runner/resume.py) on its own: which plan it picks for what a sequence holds,
and the rollback limit `Memory` owns (issue 27). Chat and the prompt cache carry the plans out;
tests/test_chat.py and tests/test_serve_parts.py check that end to end."""

from __future__ import annotations

import numpy as np
import pytest

from deltarun.base.errors import RollbackError
from deltarun.runner.model import Model
from deltarun.runner.resume import PREFERENCE, Held, Plan, Saved, plan_resume

HELD = list(range(100, 120))           # what the sequence holds: 20 tokens


def held(tokens=HELD, limit=0, logits=None, saved=(), seq=0) -> Held:
    return Held(seq, tokens, limit, logits, tuple(saved))


def checkpoints(tokens, *positions, logits_at=(), stale=(), kind="checkpoint", owner=None) -> Saved:
    """States named ("state", pos) along `tokens`; those at `logits_at` keep logits ("logits", pos)."""
    states = {p: ("state", p) for p in positions}
    return Saved(kind, tokens, states, logits_of=lambda st: ("logits", st[1]) if st[1] in logits_at else None,
                 restorable=lambda st: st[1] not in stale, owner=owner)


def summary(plan: Plan) -> tuple:
    return plan.kind, plan.pos, plan.n_eval


# --- each kind when it should be ------------------------------------------------------------------
def test_live_when_the_prompt_extends_what_is_held():
    plan = plan_resume(HELD + [1, 2, 3], [held(limit=3, saved=[checkpoints(HELD, 10, 20)])])
    assert summary(plan) == ("live", 20, 3) and plan.seq == 0 and plan.state is None
    assert summary(plan_resume(HELD + [1], [held(limit=3)])) == ("live", 20, 1)


def test_the_whole_prompt_held_is_live_only_with_its_logits():
    assert plan_resume(HELD, [held(limit=3, logits="L")]) == Plan("live", 20, 20, 0, logits="L")
    # without them the last token is evaluated again: one back, by rollback
    assert summary(plan_resume(HELD, [held(limit=3)])) == ("rollback", 19, 1)


def test_rollback_within_the_limit_and_not_one_token_beyond():
    prompt = HELD[:17] + [1, 2]                  # 3 tokens of the sequence to undo
    plan = plan_resume(prompt, [held(limit=3)])
    assert summary(plan) == ("rollback", 17, 2) and plan.n_rollback == 3
    assert summary(plan_resume(prompt, [held(limit=2)])) == ("fresh", 0, 19)
    # a prompt that is a prefix of what is held: back to one before its end
    assert plan_resume(HELD[:18], [held(limit=3)]).n_rollback == 3


def test_a_rollback_to_nothing_is_still_a_rollback():
    plan = plan_resume([7, 8], [held(HELD[:2], limit=2)])
    assert summary(plan) == ("rollback", 0, 2) and plan.n_rollback == 2


def test_checkpoint_beyond_the_rollback_limit():
    prompt = HELD[:15] + [1, 2]
    plan = plan_resume(prompt, [held(limit=3, saved=[checkpoints(HELD, 5, 12, 16)])])
    assert summary(plan) == ("checkpoint", 12, 5) and plan.state == ("state", 12) and plan.seq == 0
    assert plan.logits is None


def test_rollback_preferred_to_a_checkpoint_at_the_same_length():
    prompt = HELD[:18] + [1]
    assert summary(plan_resume(prompt, [held(limit=3, saved=[checkpoints(HELD, 18)])])) == ("rollback", 18, 1)


def test_a_checkpoint_at_the_prompts_end_only_with_its_logits():
    longer = HELD + [5, 6, 7, 8]
    without = plan_resume(HELD, [held(longer, limit=3, saved=[checkpoints(longer, 10, 20)])])
    assert summary(without) == ("checkpoint", 10, 10)
    with_logits = plan_resume(HELD, [held(longer, limit=3, saved=[checkpoints(longer, 10, 20, logits_at=[20])])])
    assert summary(with_logits) == ("checkpoint", 20, 0) and with_logits.logits == ("logits", 20)


def test_a_stale_checkpoint_is_never_chosen():
    prompt = HELD[:15] + [1, 2]
    plan = plan_resume(prompt, [held(saved=[checkpoints(HELD, 5, 12, stale=[12])])])
    assert summary(plan) == ("checkpoint", 5, 12)
    assert summary(plan_resume(prompt, [held(saved=[checkpoints(HELD, 12, stale=[12])])])) == ("fresh", 0, 17)


def test_a_checkpoint_past_what_the_sequence_shares_is_never_chosen():
    """A checkpoint restores the recurrent state only: its tokens matching the prompt is not enough
    when the sequence's KV rows before it are of other tokens."""
    other = HELD[:8] + [1] * 12                  # what the sequence holds now: diverges at 8
    prompt = HELD + [5]
    plan = plan_resume(prompt, [held(other, saved=[checkpoints(HELD, 4, 12)])])
    assert summary(plan) == ("checkpoint", 4, 17)
    # an aside brings its own KV rows: its states count as far as its tokens match
    aside = plan_resume(prompt, [held(other, saved=[checkpoints(HELD, 12, kind="aside", owner="A")])])
    assert summary(aside) == ("aside", 12, 9) and aside.saved.owner == "A" and aside.seq == 0


def test_aside_when_it_reaches_further_than_the_sequence():
    ahead = HELD[:16] + [1, 2, 3]
    plan = plan_resume(HELD, [held(ahead, limit=3, saved=[checkpoints(ahead, 16),
                                                          checkpoints(HELD, 20, logits_at=[20], kind="aside")])])
    assert summary(plan) == ("aside", 20, 0) and plan.logits == ("logits", 20)


def test_host_copy_when_no_sequence_reaches_as_far():
    prompt = HELD + [5]
    host = [checkpoints(HELD[:10], 10, kind="host", owner="near"), checkpoints(HELD, 4, 20, kind="host", owner="far")]
    plan = plan_resume(prompt, [held([1, 2, 3], limit=3)], host)
    assert summary(plan) == ("host", 20, 1) and plan.saved.owner == "far" and plan.seq is None
    # a sequence that holds as much wins: restoring in place is cheaper than copying in
    plan = plan_resume(prompt, [held(limit=3, saved=[checkpoints(HELD, 20)])], host)
    assert summary(plan) == ("live", 20, 1)
    assert summary(plan_resume(prompt, [held(HELD[:19] + [9], limit=3)], host)) == ("host", 20, 1)


def test_fresh_when_nothing_matches():
    assert plan_resume([1, 2, 3], [held(limit=3, saved=[checkpoints(HELD, 5)])],
                       [checkpoints(HELD, 5, kind="host")]) == Plan(n_prompt=3)
    assert plan_resume([1, 2, 3]) == Plan(n_prompt=3)
    assert plan_resume([], [held(limit=3)]) == Plan()
    # an empty sequence: nothing live to extend
    assert summary(plan_resume([1, 2, 3], [held([], limit=3)])) == ("fresh", 0, 3)


def test_the_sequence_that_reuses_most_and_at_equal_reuse_the_cheapest():
    prompt = HELD + [5]
    plan = plan_resume(prompt, [held(HELD[:5], seq=0), held(HELD[:12], seq=1), held(HELD[:8], seq=2)])
    assert (plan.kind, plan.pos, plan.seq) == ("live", 12, 1)
    tails = [held(HELD[:12] + [1], limit=1, seq=0, saved=[checkpoints(HELD, 12)]),
             held(HELD[:12] + [1], limit=0, seq=1, saved=[checkpoints(HELD, 12)]), held(HELD[:12], seq=2)]
    assert [(p.kind, p.seq) for p in (plan_resume(prompt, tails[:2]), plan_resume(prompt, tails))] == \
        [("rollback", 0), ("live", 2)]
    assert sorted(PREFERENCE, key=PREFERENCE.get) == ["fresh", "host", "checkpoint", "aside", "rollback", "live"]


# --- the rollback limit Memory owns ----------------------------------------------------------------
def test_the_rollback_limit_is_what_memory_rolls_back(tiny_model_path):
    """min(last ubatch, K-1) less what was undone since, the same number for `Memory.rollback`
    and the planner (`Held.of`); an evaluation or a restore of the tokens starts it over."""
    with Model(tiny_model_path("tiny"), n_ctx=64, rs_slots=4, n_threads=1) as m:
        mem = m.memory
        assert mem.rollback_limit(0) == 0
        m.eval(list(range(10, 20)))
        assert mem.rollback_limit(0) == 3 and Held.of(mem, 0).rollback_limit == 3
        m.rollback(2)
        assert mem.rollback_limit(0) == 1
        with pytest.raises(RollbackError, match="so 1 can be undone"):
            m.rollback(2)
        tokens = m.tokens()
        plan = plan_resume(tokens[:-2] + [5], [Held.of(mem, 0)])
        assert plan.kind == "fresh"                   # two back: one more than the slots left
        plan = plan_resume(tokens[:-1] + [5], [Held.of(mem, 0)])
        assert (plan.kind, plan.n_rollback) == ("rollback", 1)
        m.rollback(plan.n_rollback)
        assert mem.rollback_limit(0) == 0
        m.eval([5, 6])
        assert mem.rollback_limit(0) == 2 and m.tokens() == tokens[:-1] + [5, 6]
        mem.set_tokens(0, m.tokens())
        assert mem.rollback_limit(0) == 0



def test_a_verification_step_leaves_the_start_state_out_and_undoes_all_but_its_first_token(tiny_model_path):
    """`keep_start=False` (the engine's verification steps): the graph does not copy the state the
    ubatch started from to slot T, and Memory lets a rollback undo T-1 tokens, which land on the
    states the step computed (equal to evaluating the kept tokens alone). The engine steps
    sequences with a draft source that way, drafted or not; a one-token step of a sequence without
    one keeps the start, so its token can still be undone (a stop string's leftover)."""
    from deltarun.base.ggml_util import ggml, name_of
    from deltarun.runner.engine import Engine, Running
    from deltarun.runner.sampling import GREEDY, Sampler
    from deltarun.runner.speculative import DraftLength, NgramDraft

    def start_copies(m: Model, keep_start: bool) -> int:
        g = next(g for s, g in m._graphs.items() if s.n_seq_tokens == 3 and s.keep_start is keep_start)
        nodes = [ggml.ggml_graph_node(g.gf, i) for i in range(ggml.ggml_graph_n_nodes(g.gf))]
        return sum(name_of(t).startswith("ssm_state_store_start") for t in nodes)

    prompt = list(range(10, 20))
    with Model(tiny_model_path("tiny"), n_ctx=64, rs_slots=4, n_threads=1) as m:
        m.eval(prompt + [7])
        want = m.eval([3])                            # the kept token, then the next, from scratch
        m.reset()
        m.eval(prompt)
        m.eval([7, 8, 9], all_logits=True, keep_start=False)
        assert m.memory.rollback_limit(0) == 2
        with pytest.raises(RollbackError, match="so 2 can be undone"):
            m.rollback(3)
        m.rollback(2)
        assert m.tokens() == prompt + [7]
        np.testing.assert_allclose(m.eval([3]), want, rtol=0, atol=1e-5)
        m.eval([1, 2, 3])                             # a prompt's ubatch: all of it can be undone
        assert m.memory.rollback_limit(0) == 3
        assert start_copies(m, True) == len(m.hp.linear_layers) and start_copies(m, False) == 0

        engine = Engine(m, max_rows=64)
        m.reset()
        m.eval(prompt)
        engine.step([Running(seq=0, sampler=Sampler(GREEDY), history=prompt + [5])])
        assert m.tokens() == prompt + [5] and m.memory.rollback_limit(0) == 1
        m.reset()                                     # a source that drafts nothing this step: its
        m.eval(prompt)                                # one-token step leaves the start out as well
        o = engine.step([Running(seq=0, sampler=Sampler(GREEDY), history=prompt + [5], draft=NgramDraft(),
                                 length=DraftLength(2))])[0]
        assert o.n_drafted == 0 and m.tokens() == prompt + [5] and m.memory.rollback_limit(0) == 0
        m.reset()
        motif = prompt[:4] * 3                        # repeats: the n-gram source drafts
        m.eval(motif)
        s = Running(seq=0, sampler=Sampler(GREEDY), history=motif + motif[:1], draft=NgramDraft(),
                    length=DraftLength(2))       # 3 rows, fewer than the 4 slots: the start could be kept
        o = engine.step([s])[0]
        assert o.n_drafted == 2 and m.memory.rollback_limit(0) == o.n_accepted

def test_memory_advance_is_the_bookkeeping_of_an_evaluation(tiny_model_path):
    with Model(tiny_model_path("tiny"), n_ctx=64, rs_slots=3, n_threads=1, n_seq_max=2) as m:
        m.eval_batch({0: [1, 2, 3], 1: [4, 5, 6]})
        st = m.memory.seqs[1]
        assert (st.n_past, st.tokens, st.undoable, st.rolled_back) == (3, [4, 5, 6], 3, 0)
        m.memory.advance(0, [7])     # what Model._eval_ubatch calls after a graph computed
        assert m.tokens(0) == [1, 2, 3, 7] and m.memory.rollback_limit(0) == 1 and m.n_past(0) == 4
