"""Capture points: the recurrent state at chosen tokens inside one evaluation (`Model.eval(captures=)`).

A server checkpoints a prompt at its message boundaries; the graph splits the delta rule there
(or reads a rollback snapshot when the point is among the last K tokens) and copies the state to
a capture slot, instead of ending the evaluation there. Checked against ggml's other path: the
same tokens evaluated in pieces ending at those points (itself checked against the numpy
reference in test_forward / test_qwen35_forward), on F32 models in both delta-net forms.
"""

from __future__ import annotations

import numpy as np
import pytest

from deltarun.base.errors import DeltarunError
from deltarun.runner.model import Model

PROMPT = 20      # tokens evaluated before the captured call
N = 130          # tokens of the captured call: ubatches of 64, 64, 2 at --ubatch 64
#: inside a ubatch far from its end (a split), 2 before a ubatch's end (a rollback snapshot when
#: K = 3, a split when K = 1), at a ubatch boundary (the live state then), in the second ubatch
CAPTURES = [5, 17, 62, 64, 100]


def _conv_windows(saved: np.ndarray, model: Model) -> np.ndarray:
    """The conv windows [channels, d_conv-1] of a state copy (bytes of slot 0 of a conv row)."""
    hp = model.hp
    return saved.view(np.float32).reshape(hp.conv_dim, hp.ssm_d_conv - 1)


def _tokens(n: int, seed: int = 1) -> list[int]:
    return np.random.default_rng(seed).integers(10, 200, n).tolist()


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen35"])
@pytest.mark.parametrize("delta_net", ["fused", "primitive"])
@pytest.mark.parametrize("rs_slots", [1, 3])
def test_captured_states_equal_those_of_a_split_evaluation(tiny_model_path, preset, delta_net, rs_slots):
    path = tiny_model_path(preset, "f32")
    toks = _tokens(PROMPT + N)
    opts = dict(n_ctx=512, n_ubatch=64, n_threads=2, rs_slots=rs_slots, delta_net=delta_net)
    with Model(path, capture_slots=4, **opts) as m, Model(path, **opts) as ref:
        m.eval(toks[:PROMPT])
        logits = m.eval(toks[PROMPT:], captures=CAPTURES, all_logits=True)
        assert sorted(m.last_captures) == [PROMPT + t for t in CAPTURES]
        ref.eval(toks[:PROMPT])
        parts, done = [], 0
        for t in CAPTURES + [N]:
            parts.append(ref.eval(toks[PROMPT + done:PROMPT + t], all_logits=True))
            done = t
            if t == N:
                break
            want, got = ref.memory.read_recurrent(0), m.last_captures[PROMPT + t]
            assert got.n_past == want.n_past == PROMPT + t
            for il in want.ssm:
                np.testing.assert_allclose(got.ssm[il].view(np.float32), want.ssm[il].view(np.float32), rtol=0, atol=1e-5)
                np.testing.assert_allclose(_conv_windows(got.conv[il], m), _conv_windows(want.conv[il], ref),
                                           rtol=0, atol=1e-5)   # projections of other batch sizes round apart
        # F32 model: the only differences are summation orders of differently split ubatches
        np.testing.assert_allclose(logits, np.concatenate(parts), rtol=0, atol=2e-4)


@pytest.mark.parametrize("delta_net", ["fused", "primitive"])
@pytest.mark.parametrize("rs_slots", [1, 3])
def test_a_restored_capture_continues_as_the_unbroken_sequence(tiny_model_path, delta_net, rs_slots):
    """A state copy holds the live slot only (`Memory._conv_slot0`); written into a cell with
    rollback slots it fills each of them, and the sequence goes on as if never broken."""
    path = tiny_model_path("tiny", "f32")
    toks = _tokens(80, seed=2)
    with Model(path, n_ctx=256, n_ubatch=64, n_threads=2, capture_slots=2, delta_net=delta_net, n_seq_max=2,
               rs_slots=rs_slots) as m:
        hp = m.hp
        m.eval(toks[:40], seq=0, captures=[13, 29])
        assert m.last_captures[29].nbytes == 4 * sum(hp.conv_state_size_of(il) + hp.ssm_state_size
                                                     for il in hp.linear_layers)
        m.memory.write_recurrent(1, m.last_captures[29])      # a checkpoint restored into another cell
        m.memory.write_kv(1, m.memory.read_kv(0, 29), 29)
        m.memory.set_tokens(1, toks[:29])
        resumed = m.eval(toks[29:60], seq=1, all_logits=True)
        m.reset()
        unbroken = m.eval(toks[:60], seq=0, all_logits=True)[29:]
        np.testing.assert_allclose(resumed, unbroken, rtol=0, atol=2e-4)
        assert int(np.argmax(resumed[-1])) == int(np.argmax(unbroken[-1]))


def test_capture_points_are_checked(tiny_model_path):
    path = tiny_model_path("tiny", "f32")
    with Model(path, n_ctx=256, n_ubatch=32, n_threads=2, capture_slots=2) as m:
        with pytest.raises(DeltarunError, match="inside the 10 tokens"):
            m.eval(_tokens(10), captures=[10])
        with pytest.raises(DeltarunError, match="inside the 10 tokens"):
            m.eval(_tokens(10), captures=[0])
        with pytest.raises(DeltarunError, match="3 capture points in one ubatch; the model has 2"):
            m.eval(_tokens(20), captures=[3, 6, 9])
        assert m.n_past() == 0                                   # nothing was evaluated
        m.eval(_tokens(40), captures=[3, 6, 33, 36])             # two per ubatch of 32
        assert sorted(m.last_captures) == [3, 6, 33, 36]
    with Model(path, n_ctx=256, n_ubatch=32, n_threads=2) as m:
        with pytest.raises(DeltarunError, match="the model has 0 capture slots"):
            m.eval(_tokens(10), captures=[4])


def test_captures_are_part_of_the_graph_shape(tiny_model_path):
    """Graphs are reused per shape: the same capture points reuse one, others build their own."""
    path = tiny_model_path("tiny", "f32")
    with Model(path, n_ctx=256, n_ubatch=64, n_threads=2, capture_slots=2) as m:
        m.eval(_tokens(20), captures=[7])
        builds = m.stats.n_graph_builds
        m.reset()
        m.eval(_tokens(20, seed=3), captures=[7])
        assert m.stats.n_graph_builds == builds
        m.reset()
        m.eval(_tokens(20, seed=3), captures=[8])
        assert m.stats.n_graph_builds == builds + 1
