"""`Memory.clear_seq` zeroes only the live recurrent state of a sequence (the conv row and SSM slot
0): the other rollback slots keep an earlier conversation's states, which nothing may read, since a
rollback never goes past the clear and a ubatch writes slots 1..min(m, K-1) (slot m: the state it
started from) before any rollback reads them. Here a sequence holds another conversation (its
slots filled, then overwritten with noise), is cleared, evaluates a new prompt, and rolls back
as far as `rollback_limit` allows, back to the empty state included: the logits are a fresh
model's evaluating the same tokens from nothing, within the summation order of another ubatch
split (F32 models: 4e-6 of logits near 1 seen; a slot of noise read moves them by far more)."""

from __future__ import annotations

import numpy as np
import pytest

from deltarun.base.ggml_util import ggml
from deltarun.runner.model import Model

K = 4


def _close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * max(1.0, float(np.abs(want).max())))


def _fresh_logits(path, tokens: list[int], nxt: int) -> np.ndarray:
    with Model(path, n_ctx=64, rs_slots=K, n_threads=1) as m:
        if tokens:
            m.eval(tokens)
        return m.eval([nxt]).copy()


def _noise_in_every_slot(m: Model, seq: int) -> None:
    rng = np.random.default_rng(seq)
    for il, t in m.memory.ssm.items():
        cell, slot = t.contents.nb[1], t.contents.nb[2]
        for r in range(m.memory.rs_slots):
            noise = rng.standard_normal(cell // 4).astype(np.float32)
            ggml.ggml_backend_tensor_set(t, noise.ctypes.data, r * slot + seq * cell, cell)


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen35", "tiny-kimi-linear", "tiny-qwen4exp"])
@pytest.mark.parametrize("n_prompt", [1, 2, 3, 6])
def test_a_cleared_sequence_rolls_back_as_a_fresh_one(tiny_model_path, preset, n_prompt):
    path = tiny_model_path(preset)
    prompt = [(i * 5) % 40 + 3 for i in range(n_prompt)]
    with Model(path, n_ctx=64, rs_slots=K, n_seq_max=2, n_threads=1) as m:
        m.eval(list(range(4, 24)), seq=1)        # another conversation in seq 1: every slot written
        m.eval([9, 10, 11], seq=1)
        _noise_in_every_slot(m, 1)
        m.memory.clear_seq(1)
        got = m.eval(prompt, seq=1, all_logits=True).copy()
        _close(got[-1], _fresh_logits(path, prompt[:-1], prompt[-1]))
        back = m.memory.rollback_limit(1)
        assert back == min(n_prompt, K - 1)
        m.rollback(back, 1)
        kept = prompt[:n_prompt - back]
        _close(m.eval([7], seq=1), _fresh_logits(path, kept, 7))
