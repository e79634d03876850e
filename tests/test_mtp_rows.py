"""The MTP block's KV rows: every position a draft attends over holds the row a fresh evaluation
writes there, (hidden_i, token_{i+1}) at position i, in chat as in the server (test_serve_draft).

A draft's attention reads the MTP rows of every earlier position, so a prompt position without its
row (or with one left from another conversation) changes the drafts, never the output (the target
verifies them): only the rows themselves show it. Tiny F32 models with an F32 KV cache.
"""

from __future__ import annotations

import numpy as np

from deltarun.apps.chat import ChatSession
from deltarun.runner.model import Model
from deltarun.runner.speculative import MtpDraft

N_CTX = 256


def mtp_kv_rows(m: Model, seq: int, n: int) -> list[np.ndarray]:
    """The K rows of the MTP layers for positions 0..n-1 of `seq`."""
    kv = m.memory.read_kv(seq, n)
    return [np.frombuffer(kv.rows[il][0], dtype=np.float32).reshape(n, -1) for il in m.memory.mtp_layers]


def fresh_mtp_kv_rows(path, tokens: list[int]) -> list[np.ndarray]:
    """What a fresh model writes for positions 0..len-2 of `tokens`: the trunk over them, then the
    MTP block on every (hidden_i, token_{i+1})."""
    with Model(path, n_ctx=N_CTX, kv_type="f32", mtp=True) as m:
        m.eval(tokens, all_hidden=True)
        m.mtp_eval(tokens[1:], m.last_hidden[0][:-1], 0)
        return mtp_kv_rows(m, 0, len(tokens) - 1)


def test_chat_with_mtp_drafts_writes_the_mtp_rows_of_every_prompt_position(tiny_model_path):
    """Three turns with --draft mtp, the next turn's start evaluated ahead before the last: the MTP
    rows of the prompts (the template re-renders earlier answers, so turns resume from the
    checkpoint or roll back), of the answers and of the work done ahead are a fresh evaluation's."""
    path = tiny_model_path("tiny-mtp")
    with Model(path, n_ctx=N_CTX, kv_type="f32", mtp=True, rs_slots=4) as m:
        draft = MtpDraft(m, defer=True)
        chat = ChatSession(m, draft=draft, draft_max=3, n_predict=12, system="Repeat after me.")
        for turn in range(3):
            if turn == 2:
                assert chat.prefill_next_turn() > 0
            chat.ask(f"turn {turn}: " + "one two three " * (turn + 2))
            assert chat.draft_stats.n_drafted > 0
        if draft.deferred:                   # rows kept aside until the next draft: written now
            draft.evaluate_deferred()
        tokens = m.tokens(0)
        got = mtp_kv_rows(m, 0, len(tokens) - 1)
    for a, b in zip(got, fresh_mtp_kv_rows(path, tokens)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
