"""The ggml forward pass against the independent numpy reference (tests/reference.py).

Tolerances, measured on the tiny presets (2 cores, x86-64) and why they are what they are:
- F32 weights, F32 KV cache: max |ggml - ref| / max |ref| was <= 7.4e-7 over every preset and
  both delta-net paths; the bound 1e-5 leaves room for float32 accumulation order (ggml sums in
  float32 in another order than the float64 reference) and for other CPUs' SIMD widths.
- F16 weights: ggml's CPU kernel rounds activations to F16 before the dot product (about 5e-4
  relative per element); measured max 3.9e-4, bound 2e-3.
- BF16, Q8_0, Q4_0, Q4_K, Q5_K, Q6_K: activations are rounded to BF16 / Q8_0 / Q8_K blocks for
  the dot products (0.4-1% relative noise per matmul; the reference runs on the dequantised
  weights, so this rounding is the error). Measured per-position error (max over the vocabulary
  / max |ref|) on 40-token prompts, seeds 5-7, median (95th percentile): bf16 2.4e-3 (3.2e-3),
  q8_0 9.0e-3 (1.4e-2), q4_0 8.6e-3 (1.2e-2), q4_k 1.3e-2 (1.9e-2), q5_k 1.4e-2 (3.1e-2),
  q6_k 1.4e-2 (2.9e-2). MoE top-k routing is discontinuous: a token whose two best experts
  nearly tie can switch expert, which moves that position's logits by up to 12% (see
  shared/docs/qwen3next-gguf.md), one or two positions in 40. So each type is bounded at its own
  measured median: the median position within 2x, at least 95% of positions within 3x, and greedy
  agreement wherever the reference's top-2 margin is clear (> 10% of the logit range).
- Re-measured on ggml 0.25.3 under the bindings (issue 29; prompts of seeds 5-7, tiny preset):
  bf16, q8_0 and q4_0 give bit for bit the logits of 0.15.3, q4_k within 4e-7; median (95th
  percentile) 0.15.3 -> 0.25.3: q5_k 1.30e-2 (2.28e-2) -> 1.29e-2 (2.28e-2), q6_k 1.33e-2
  (2.06e-2) -> 1.31e-2 (2.27e-2), F16 7.5e-4 (9.4e-4) -> 2.8e-4 (4.3e-4), largest 1.1e-3 -> 8.6e-4
  (closer on 0.25.3; the cause not traced). No bound needed to change: every median is 0.46-0.49
  of its bound, F16's largest error on these prompts 0.43 of 2e-3.
"""

from __future__ import annotations

import numpy as np
import pytest

from deltarun.base.errors import RollbackError
from deltarun.graphs.qwen3next import CHUNK_SIZE
from deltarun.runner.model import Model

from reference import ReferenceModel

F32_TOL = 1e-5


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 2300, n)]


def greedy_continuation(model: Model, tokens: list[int], n: int) -> list[int]:
    model.reset()
    logits = model.eval(tokens)
    out = []
    for _ in range(n):
        tok = int(np.argmax(logits))
        out.append(tok)
        logits = model.eval([tok])
    return out


def reference_greedy(ref: ReferenceModel, tokens: list[int], n: int) -> list[int]:
    ref.reset()
    logits = ref.forward(tokens)[-1]
    out = []
    for _ in range(n):
        tok = int(np.argmax(logits))
        out.append(tok)
        logits = ref.forward([tok])[-1]
    return out


@pytest.fixture(scope="module")
def reference_of(tiny_model_path):
    cache: dict = {}

    def get(preset: str, wtype: str = "f32") -> ReferenceModel:
        key = (preset, wtype)
        if key not in cache:
            cache[key] = ReferenceModel.from_gguf(tiny_model_path(preset, wtype))
        return cache[key]

    return get


@pytest.mark.parametrize("preset", ["tiny", "tiny-eqheads", "tiny-legacy", "tiny-tied"])
@pytest.mark.parametrize("delta_net", ["fused", "primitive"])
def test_f32_logits_match_reference(tiny_model_path, reference_of, preset, delta_net):
    toks = prompt(80, seed=1)   # > 64: the primitive path crosses a chunk boundary
    ref = reference_of(preset)
    ref.reset()
    expected = ref.forward(toks)
    with Model(tiny_model_path(preset), n_ctx=256, kv_type="f32", delta_net=delta_net) as m:
        got = m.logits_for(toks)
        assert rel_err(got, expected) < F32_TOL
        assert (got.argmax(1) == expected.argmax(1)).all()
        assert greedy_continuation(m, toks[:20], 12) == reference_greedy(ref, toks[:20], 12)


def test_f16_kv_cache_stays_close(tiny_model_path, reference_of):
    toks = prompt(40, seed=2)
    ref = reference_of("tiny")
    ref.reset()
    expected = ref.forward(toks)
    with Model(tiny_model_path("tiny"), n_ctx=256, kv_type="f16") as m:
        got = m.logits_for(toks)
    # an F16 cache rounds K and V to 11-bit mantissas: measured 5.4e-5 (an F32 cache: 2.7e-7, so
    # the lower bound fails if the cache type were ignored)
    assert 1e-5 < rel_err(got, expected) < 5e-4
    assert (got.argmax(1) == expected.argmax(1)).all()


def test_f16_weights(tiny_model_path, reference_of):
    toks = prompt(40, seed=3)
    ref = reference_of("tiny", "f16")
    ref.reset()
    expected = ref.forward(toks)
    with Model(tiny_model_path("tiny", "f16"), n_ctx=256, kv_type="f32") as m:
        got = m.logits_for(toks)
        assert rel_err(got, expected) < 2e-3
        assert greedy_continuation(m, toks[:16], 10) == reference_greedy(ref, toks[:16], 10)


#: measured median per-position error of each weight type (see the module docstring)
MEASURED_MEDIAN = {"bf16": 2.4e-3, "q8_0": 9.0e-3, "q4_0": 8.6e-3, "q4_k": 1.3e-2, "q5_k": 1.4e-2, "q6_k": 1.4e-2}


@pytest.mark.parametrize("wtype", sorted(MEASURED_MEDIAN))
def test_quantized_weights(tiny_model_path, reference_of, wtype):
    toks = prompt(40, seed=5)
    ref = reference_of("tiny", wtype)   # the reference runs on the dequantised weights
    ref.reset()
    expected = ref.forward(toks)
    with Model(tiny_model_path("tiny", wtype), n_ctx=256, kv_type="f32") as m:
        got = m.logits_for(toks)
    scale = np.abs(expected).max()
    per_pos = np.abs(got - expected).max(axis=1) / scale
    assert np.median(per_pos) < 2 * MEASURED_MEDIAN[wtype]
    assert (per_pos < 3 * MEASURED_MEDIAN[wtype]).mean() >= 0.95
    top2 = np.sort(expected, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) / scale > 0.1
    assert clear.any()
    assert (got.argmax(1) == expected.argmax(1))[clear].all()


@pytest.mark.parametrize("delta_net", ["fused", "primitive"])
def test_ubatch_splits_agree(tiny_model_path, delta_net):
    toks = prompt(150, seed=4)
    path = tiny_model_path("tiny")
    with Model(path, n_ctx=256, kv_type="f32", delta_net=delta_net, n_ubatch=512) as m:
        whole = m.logits_for(toks)
        cont_whole = greedy_continuation(m, toks, 8)
    for n_ubatch in (7, 64, 100):
        with Model(path, n_ctx=256, kv_type="f32", delta_net=delta_net, n_ubatch=n_ubatch) as m:
            assert rel_err(m.logits_for(toks), whole) < F32_TOL
            assert greedy_continuation(m, toks, 8) == cont_whole
    with Model(path, n_ctx=256, kv_type="f32", delta_net=delta_net) as m:
        m.reset()
        one_by_one = np.stack([m.eval([t]) for t in toks[:70]])
    assert rel_err(one_by_one, whole[:70]) < F32_TOL


def test_fused_and_primitive_agree(tiny_model_path):
    toks = prompt(2 * CHUNK_SIZE + 5, seed=6)
    path = tiny_model_path("tiny-eqheads")
    results = {}
    for mode in ("fused", "primitive"):
        with Model(path, n_ctx=256, kv_type="f32", delta_net=mode, rs_slots=4) as m:
            logits = m.logits_for(toks)
            results[mode] = (logits, m.memory.ssm_slots(0), m.memory.conv_slots(0))
    # both paths are float32; measured 6e-7 on logits, states agree to float32 rounding
    assert rel_err(results["primitive"][0], results["fused"][0]) < F32_TOL
    np.testing.assert_allclose(results["primitive"][1], results["fused"][1], atol=1e-5, rtol=1e-4)
    np.testing.assert_array_equal(results["primitive"][2], results["fused"][2])


def test_several_sequences_in_one_ubatch(tiny_model_path, reference_of):
    a, b = prompt(30, seed=7), prompt(30, seed=8)
    ref = reference_of("tiny")
    ref.reset()
    ra = ref.forward(a)
    ref.reset()
    rb = ref.forward(b)
    with Model(tiny_model_path("tiny"), n_ctx=128, kv_type="f32", n_seq_max=3, rs_slots=2) as m:
        m.eval(prompt(5, seed=9), seq=0)            # another sequence's state must not leak
        out = m.eval_batch({1: a, 2: b}, all_logits=True)
        assert m.stats.n_eval_calls == 2           # the pair shared one ubatch
    assert rel_err(out[1], ra) < F32_TOL
    assert rel_err(out[2], rb) < F32_TOL


def test_several_sequences_decode_together(tiny_model_path, reference_of):
    """Decode ubatches of one token per sequence (positions differ per sequence) against the reference."""
    prompts = {0: prompt(9, seed=1), 1: prompt(14, seed=2)}
    ref = reference_of("tiny")
    with Model(tiny_model_path("tiny"), n_ctx=64, kv_type="f32", n_seq_max=2) as m:
        last = {s: m.eval(p, seq=s) for s, p in prompts.items()}
        for _ in range(4):
            nxt = {s: [int(np.argmax(last[s]))] for s in prompts}
            calls = m.stats.n_eval_calls
            last = m.eval_batch(nxt)
            assert m.stats.n_eval_calls == calls + 1          # both sequences in one ubatch
        for s, p in prompts.items():
            ref.reset()
            expected = ref.forward(m.tokens(s))[-1]
            assert rel_err(last[s], expected) < F32_TOL


def test_copied_sequence_continues_like_the_original(tiny_model_path):
    """copy_seq copies the KV cells (K rows, transposed V rows) and the live recurrent state."""
    toks = prompt(21, seed=4)
    with Model(tiny_model_path("tiny"), n_ctx=64, kv_type="f32", n_seq_max=3) as m:
        m.eval(prompt(30, seed=5), seq=1)          # stale cells in the destination must not matter
        m.eval(prompt(7, seed=6), seq=2)
        m.eval(toks, seq=2)
        m.reset()
        first = m.eval(toks, seq=0)
        m.copy_seq(0, 1)
        assert m.tokens(1) == toks and m.n_past(1) == len(toks)
        nxt = [int(np.argmax(first))]
        np.testing.assert_array_equal(m.eval(nxt, seq=1), m.eval(nxt, seq=0))


def test_swapped_sequences_continue_like_fresh_evaluations(tiny_model_path, reference_of):
    """Memory.swap_seqs (a server's move of a conversation to another cell) exchanges the K rows,
    the transposed V rows, the conv rows and the live SSM state: each conversation continues in its
    new cell as the float64 reference evaluates it afresh. Unequal lengths, rollback slots in use
    (a multi-token ubatch wrote older snapshots), and a third, stale cell that must not leak."""
    convs = {0: prompt(23, seed=11), 2: prompt(9, seed=12)}
    ref = reference_of("tiny")
    with Model(tiny_model_path("tiny"), n_ctx=64, kv_type="f32", n_seq_max=3, rs_slots=4) as m:
        m.eval(prompt(30, seed=13), seq=1)
        last = {s: m.eval(p, seq=s) for s, p in convs.items()}
        m.memory.swap_seqs(0, 2)
        assert m.tokens(0) == convs[2] and m.tokens(2) == convs[0] and m.tokens(1) == prompt(30, seed=13)
        for new, old in ((2, 0), (0, 2)):
            nxt = [int(np.argmax(last[old])), 5, 17]
            got = m.eval(nxt, seq=new, all_logits=True)
            ref.reset()
            assert rel_err(got, ref.forward(convs[old] + nxt)[-3:]) < F32_TOL


def test_attention_reads_the_stored_v_rows_without_a_copy(tiny_model_path):
    """V is stored transposed (one row per channel across the cells), so the decode graph multiplies
    a view of the cache: no per-step CONT of n_kv cells of V."""
    from deltarun.base.ggml_util import ggml, name_of, ne

    with Model(tiny_model_path("tiny"), n_ctx=512, kv_type="f16") as m:
        m.eval(prompt(300, seed=3))
        m.eval([1])
        shape, g = next((s, g) for s, g in m._graphs.items() if s.n_seq_tokens == 1)
        il = m.hp.attention_layers[0]
        nodes = [ggml.ggml_graph_node(g.gf, i) for i in range(ggml.ggml_graph_n_nodes(g.gf))]
        kqv = next(t for t in nodes if name_of(t) == f"kqv-{il}")
        v = kqv.contents.src[0]
        assert name_of(v) == f"v_view-{il}" and name_of(v.contents.view_src) == f"cache_v_l{il}"
        assert tuple(ne(v)[:3]) == (shape.n_kv, m.hp.head_dim, m.hp.n_head_kv)
        assert not any(t.contents.op == ggml.GGML_OP_CONT and t.contents.src[0]
                       and name_of(t.contents.src[0]).startswith(f"v_view-{il}") for t in nodes)


@pytest.mark.parametrize("delta_net", ["fused", "primitive"])
@pytest.mark.parametrize("K,n_tokens", [(1, 5), (4, 2), (4, 3), (4, 9), (3, 70)])
def test_rollback_slots_hold_past_states(tiny_model_path, reference_of, delta_net, K, n_tokens):
    """After a ubatch, slot r holds the state r tokens back (n_tokens < K-1, == K-1, > K, K = 1)."""
    ref = reference_of("tiny")
    ref.reset()
    first = prompt(6, seed=10)
    toks = prompt(n_tokens, seed=11)
    ref.forward(first + toks)
    with Model(tiny_model_path("tiny"), n_ctx=128, kv_type="f32", rs_slots=K, delta_net=delta_net) as m:
        m.eval(first)
        m.eval(toks)
        for il in m.hp.linear_layers:
            hist = ref.history(il)
            conv, ssm = m.memory.conv_slots(il), m.memory.ssm_slots(il)
            for r in range(min(n_tokens, K)):       # slots written by this ubatch
                ref_conv, ref_ssm = hist[-1 - r]
                np.testing.assert_allclose(conv[r], ref_conv, rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(ssm[r], ref_ssm, rtol=1e-4, atol=1e-5)
            if n_tokens < K:                         # the state before the ubatch lands in slot n
                np.testing.assert_allclose(conv[n_tokens], hist[-1 - n_tokens][0], rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(ssm[n_tokens], hist[-1 - n_tokens][1], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("delta_net", ["fused", "primitive"])
@pytest.mark.parametrize("n_first", [2, 9])
def test_a_continued_chunk_writes_the_newest_state_only_and_no_logits(tiny_model_path, reference_of, delta_net,
                                                                      n_first):
    """`eval(..., continued=True)` (a prompt chunk the next one continues): no LM head in its graph,
    the delta rule asked for one state (op param 0), one conv window written (rs_s_slot_rev = {0}),
    no start-state copy; slot 0 then holds the reference's state after the chunk, nothing can be
    rolled back, and the next chunk's logits and rollback slots are the reference's."""
    from deltarun.base.ggml_util import ggml, name_of, tensor_to_numpy

    ref = reference_of("tiny")
    ref.reset()
    first, rest = prompt(n_first, seed=20), prompt(6, seed=21)
    ref.forward(first)
    expected = ref.forward(rest)[-1]
    K = 4
    with Model(tiny_model_path("tiny"), n_ctx=128, kv_type="f32", rs_slots=K, delta_net=delta_net) as m:
        assert m.eval(first, continued=True) is None
        assert m.memory.rollback_limit(0) == 0 and m.tokens() == first
        with pytest.raises(RollbackError):
            m.rollback(1)
        shape, g = next((s, g) for s, g in m._graphs.items() if s.continued)
        nodes = [ggml.ggml_graph_node(g.gf, i) for i in range(ggml.ggml_graph_n_nodes(g.gf))]
        names = [name_of(t) for t in nodes]
        assert "result_output" not in g.outputs and "result_norm" in g.outputs
        assert not any(n.startswith("ssm_state_store_start") for n in names)
        if delta_net == "fused":
            gdn = [t for t in nodes if t.contents.op == ggml.GGML_OP_GATED_DELTA_NET]
            assert len(gdn) == len(m.hp.linear_layers) and all(t.contents.op_params[0] == 1 for t in gdn)
        m._set_inputs(g, [first], [0], shape)
        assert tensor_to_numpy(g.io["rs_s_slot_rev"]).tolist() == [0]
        for il in m.hp.linear_layers:
            conv, ssm = m.memory.conv_slots(il), m.memory.ssm_slots(il)
            ref_conv, ref_ssm = ref.history(il)[n_first - 1]      # after the first chunk
            np.testing.assert_allclose(conv[0], ref_conv, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(ssm[0], ref_ssm, rtol=1e-4, atol=1e-5)
        got = m.eval(rest)
        assert rel_err(got, expected) < F32_TOL
        assert m.memory.rollback_limit(0) == K - 1
        for il in m.hp.linear_layers:
            hist = ref.history(il)
            conv, ssm = m.memory.conv_slots(il), m.memory.ssm_slots(il)
            for r in range(K):
                np.testing.assert_allclose(conv[r], hist[-1 - r][0], rtol=1e-5, atol=1e-5)
                np.testing.assert_allclose(ssm[r], hist[-1 - r][1], rtol=1e-4, atol=1e-5)


def test_decode_reuses_graphs(tiny_model_path):
    with Model(tiny_model_path("tiny"), n_ctx=512, kv_type="f32") as m:
        m.eval(prompt(10))
        m.eval([1])
        builds = m.stats.n_graph_builds
        for t in range(50):
            m.eval([t + 2])
        assert m.stats.n_graph_builds == builds    # every decode step reused the one graph


@pytest.mark.parametrize("K,n_tokens", [(1, 1), (1, 6), (3, 1), (3, 2), (3, 7), (5, 2)])
def test_conv_state_written_by_one_set_rows(tiny_model_path, K, n_tokens):
    """The graph holds exactly one SET_ROWS into each layer's conv states, indexed by
    rs_s_slot_rev = {Kw-1..0} with Kw = min(n_tokens + 1, K)."""
    from deltarun.base.ggml_util import ggml, name_of, ne, nb, tensor_to_numpy

    with Model(tiny_model_path("tiny"), n_ctx=64, kv_type="f32", rs_slots=K) as m:
        toks = prompt(n_tokens, seed=12)
        m.eval(toks)
        (shape, g), = m._graphs.items()
        kw = min(n_tokens + 1, K)
        # inputs share the compute buffer with later nodes: read them back before computing
        m._set_inputs(g, [toks], [0], shape)
        assert tensor_to_numpy(g.io["rs_s_slot_rev"]).tolist() == list(range(kw - 1, -1, -1))
        conv_caches = {name_of(m.memory.conv[il]): il for il in m.hp.linear_layers}
        writes: dict[int, list] = {il: [] for il in m.hp.linear_layers}
        for i in range(ggml.ggml_graph_n_nodes(g.gf)):
            node = ggml.ggml_graph_node(g.gf, i)
            c = node.contents
            if c.op == ggml.GGML_OP_SET_ROWS and c.view_src and name_of(c.view_src) in conv_caches:
                writes[conv_caches[name_of(c.view_src)]].append(node)
        hp = m.hp
        for il, nodes in writes.items():
            assert len(nodes) == 1, f"layer {il}: {len(nodes)} conv-state writes"
            c = nodes[0].contents
            src, idx, dst = c.src[0], c.src[1], c.src[2]
            assert ne(src) == (hp.ssm_d_conv - 1, kw, hp.conv_dim, 1)
            assert nb(src)[1] == 4                   # overlapping windows, one column apart
            assert ne(dst) == (hp.ssm_d_conv - 1, K, hp.conv_dim, 1)
            assert name_of(idx) == "rs_s_slot_rev"
