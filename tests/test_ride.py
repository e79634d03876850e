"""A prompt chunk riding along a ubatch (`UbatchShape.ride`, `Model.eval_batch(..., ride=...)`).

One graph holds the decoding rows of consecutive sequences and another sequence's prompt chunk: the
layers' matrix products run once on all rows, while the conv, the delta rule and attention run per
part on each part's own shape and memory. Checked against the float64 references (each sequence
on its own: the parts must not see each other), against evaluating the chunk apart (same logits,
same recurrent state, same bookkeeping), and for its structure: each weight in as many products as
the decoding graph alone has (read once, not once per part).
"""

from __future__ import annotations

import numpy as np
import pytest

from deltarun.base.ggml_util import ggml, name_of
from deltarun.model_files import qwen35 as q35
from deltarun.runner.model import Model, PromptChunk
from reference import ReferenceModel
from reference_compare import prompt
from reference_qwen35 import Qwen35Reference
from test_qwen35_files import N_VOCAB

F32_TOL = 1e-5     # as tests/test_forward.py: float32 accumulation order against float64
#: against the chunk evaluated apart: the same float32 arithmetic but for the products' column
#: blocking (a row meets other rows in another kernel tile): measured <= 2.3e-7 relative
APART_TOL = 1e-6


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def reference_of(tiny_model_path):
    def get(preset: str):
        if preset in q35.PRESETS:
            cfg = q35.PRESETS[preset]
            return Qwen35Reference(cfg, q35.hf_weights(cfg, N_VOCAB, 0))
        return ReferenceModel.from_gguf(tiny_model_path(preset))
    return get


def _reference_rows(ref, history: list[int], tokens: list[int]) -> np.ndarray:
    ref.reset()
    return ref.forward(history + tokens)[len(history):]


def _weight_products(m: Model, gf) -> list[str]:
    """The weights the graph multiplies by, one entry per MUL_MAT / MUL_MAT_ID node."""
    weights = set(m.weights.tensors)
    out = []
    for i in range(ggml.ggml_graph_n_nodes(gf)):
        c = ggml.ggml_graph_node(gf, i).contents
        if c.op in (ggml.GGML_OP_MUL_MAT, ggml.GGML_OP_MUL_MAT_ID) and c.src[0] and name_of(c.src[0]) in weights:
            out.append(name_of(c.src[0]))
    assert out
    return sorted(out)


@pytest.mark.parametrize("preset, delta_net", [("tiny", "fused"), ("tiny-legacy", "fused"), ("tiny", "primitive"),
                                               ("tiny-qwen35", "fused"), ("tiny-qwen35moe", "fused")])
@pytest.mark.parametrize("width, n_ride, ends, hidden", [(1, 9, False, False), (3, 5, True, True), (1, 1, True, False),
                                                          (1, 6, False, True)])
def test_riding_chunk_matches_the_references_and_evaluating_it_apart(tiny_model_path, reference_of, preset, delta_net,
                                                                     width, n_ride, ends, hidden):
    prompts = [prompt(12, seed=30 + s) for s in range(3)]
    steps = [prompt(width, seed=40), prompt(width, seed=41)]
    chunk = prompt(n_ride, seed=42)
    ref = reference_of(preset)
    results = []
    for mode in ("apart", "ride"):
        with Model(tiny_model_path(preset), n_ctx=128, kv_type="f32", n_seq_max=3, rs_slots=4,
                   delta_net=delta_net) as m:
            for s in range(3):
                m.eval(prompts[s], s)
            calls = m.stats.n_eval_calls
            ride = PromptChunk(2, chunk, logits=ends, hidden=hidden)
            if mode == "apart":
                apart = m.eval_chunk(ride)
                out = m.eval_batch({0: steps[0], 1: steps[1]}, all_logits=width > 1)
            else:
                out = m.eval_batch({0: steps[0], 1: steps[1]}, all_logits=width > 1, ride=ride)
                assert m.stats.n_eval_calls == calls + 1                       # one graph for both
                apart = m.last_ride_logits
            # the prompt's last chunk keeps its rollback slots (as `eval`), an earlier one none
            assert m.tokens(2) == prompts[2] + chunk and m.memory.rollback_limit(2) == (min(n_ride, 3) if ends else 0)
            kept = min(n_ride + 1, 4) if ends else 1
            states = [x for il in m.hp.linear_layers for s in range(3)
                      for x in (m.memory.ssm_slots(il, s)[:kept if s == 2 else 1].copy(),
                                m.memory.conv_slots(il, s)[:kept if s == 2 else 1].copy())]
            rows = m.last_ride_hidden
            assert (rows is not None and rows.shape == (n_ride, m.hp.n_embd)) if hidden else rows is None
            after = m.eval([7], 2)                   # the chunk's KV rows and state, read by the next token
            results.append((out, apart, states, after, rows))
            if mode == "ride":           # each weight in as many products as without the chunk: read once
                m.eval_batch({0: steps[0], 1: steps[1]}, all_logits=width > 1)
                ride_graph, plain = ([g for s, g in m._graphs.items() if (s.ride is not None) is r and s.n_seqs == 2]
                                     for r in (True, False))
                assert len(ride_graph) == 1 and plain
                assert _weight_products(m, ride_graph[0].gf) == _weight_products(m, plain[-1].gf)
    for s in (0, 1):
        want = _reference_rows(ref, prompts[s], steps[s])
        got = np.atleast_2d(results[1][0][s])
        assert rel_err(got, want if width > 1 else want[-1:]) < F32_TOL
        assert rel_err(got, np.atleast_2d(results[0][0][s])) < APART_TOL
    if ends:
        want = _reference_rows(ref, prompts[2], chunk)[-1]
        assert rel_err(results[1][1], want) < F32_TOL
        assert rel_err(results[1][1], results[0][1]) < APART_TOL
    else:
        assert results[0][1] is None and results[1][1] is None
    for a, b in zip(results[0][2], results[1][2]):
        assert rel_err(b, a) < APART_TOL
    assert rel_err(results[1][3], _reference_rows(ref, prompts[2] + chunk, [7])[-1]) < F32_TOL
    if hidden:                                       # the rows an MTP block reads
        assert rel_err(results[1][4], results[0][4]) < APART_TOL


def test_a_family_without_riding_graphs_evaluates_the_chunk_apart(tiny_model_path):
    """Kimi-Linear's graphs take no riding chunk: eval_batch evaluates it first, on its own."""
    with Model(tiny_model_path("tiny-kimi-linear"), n_ctx=128, n_seq_max=3, kv_type="f32") as m:
        assert not m.family.rides
        for s in range(3):
            m.eval(prompt(8, seed=50 + s), s)
        calls = m.stats.n_eval_calls
        m.eval_batch({0: [5], 1: [6]}, ride=PromptChunk(2, prompt(6, seed=53)))
        assert m.stats.n_eval_calls == calls + 2 and m.n_past(2) == 14
        assert all(s.ride is None for s in m._graphs)


def test_a_sequence_cannot_ride_along_itself(tiny_model_path):
    from deltarun.base.errors import DeltarunError

    with Model(tiny_model_path("tiny"), n_ctx=64, n_seq_max=2) as m:
        with pytest.raises(DeltarunError, match="cannot ride along a batch that holds it"):
            m.eval_batch({0: [1], 1: [2]}, ride=PromptChunk(1, [3, 4]))


def _floats(a: np.ndarray) -> np.ndarray:
    return np.frombuffer(np.ascontiguousarray(a).tobytes(), dtype=np.float32)


@pytest.mark.parametrize("preset, delta_net, ends", [("tiny", "fused", False), ("tiny-qwen35", "fused", True),
                                                     ("tiny", "primitive", True)])
def test_riding_chunk_keeps_its_capture_points(tiny_model_path, preset, delta_net, ends):
    """A riding chunk with capture points (a prompt's message boundaries, checkpointed by serve
    without ending the chunk there) leaves in `last_ride_captures` the state after each: equal to
    the live state of the sequence evaluated up to that point alone; the same evaluated apart, and
    when the batch cannot take it in its graph (rows of unequal lengths: the chunk first, then the
    sequences one by one, whose evaluations start `last_captures` afresh)."""
    history, chunk, caps = prompt(10, seed=60), prompt(9, seed=61), (2, 5, 8)
    opts = dict(n_ctx=128, kv_type="f32", n_seq_max=3, rs_slots=4, delta_net=delta_net)
    want = {}
    with Model(tiny_model_path(preset), **opts) as m:
        for t in caps:
            m.reset()
            m.eval(history + chunk[:t], 2)
            want[len(history) + t] = m.memory.read_recurrent(2)
    for mode in ("ride", "apart", "unequal"):
        with Model(tiny_model_path(preset), capture_slots=4, **opts) as m:
            for s in range(3):
                m.eval(history if s == 2 else prompt(6, seed=62 + s), s)
            ride = PromptChunk(2, chunk, logits=ends, captures=caps)
            calls = m.stats.n_eval_calls
            if mode == "ride":
                m.eval_batch({0: [3], 1: [4]}, ride=ride)
                assert m.stats.n_eval_calls == calls + 1                       # one graph for both
                assert any(s.ride is not None and s.ride.captures == caps for s in m._graphs)
            elif mode == "apart":
                m.eval_chunk(ride)
            else:
                m.eval_batch({0: [3], 1: [4, 5]}, ride=ride)
                assert m.stats.n_eval_calls == calls + 3
            assert sorted(m.last_ride_captures) == sorted(want) and m.tokens(2) == history + chunk
            for pos, state in want.items():
                got = m.last_ride_captures[pos]
                assert got.n_past == pos
                for il in m.hp.linear_layers:
                    assert rel_err(_floats(got.ssm[il]), _floats(state.ssm[il])) < APART_TOL
                    assert rel_err(_floats(got.conv[il]), _floats(state.conv[il])) < APART_TOL


def test_riding_chunk_capture_points_are_checked_first(tiny_model_path):
    from deltarun.base.errors import DeltarunError

    with Model(tiny_model_path("tiny"), n_ctx=64, n_seq_max=3, capture_slots=2) as m:
        for s in range(3):
            m.eval(prompt(4, seed=70 + s), s)
        for caps, match in [((0,), "must lie inside"), ((6,), "must lie inside"), ((1, 2, 3), "3 capture points")]:
            with pytest.raises(DeltarunError, match=match):
                m.eval_batch({0: [1], 1: [2]}, ride=PromptChunk(2, prompt(6, seed=73), captures=caps))
        assert [m.n_past(s) for s in range(3)] == [4, 4, 4]
