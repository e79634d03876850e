"""Self-checks of the numpy reference (tests/reference.py) on small random weights."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

try:  # tests/ as a package (tests/__init__.py, or the repo root on sys.path)
    from tests.reference import (
        RefHParams, ReferenceModel, causal_conv_step, full_attention, gated_delta_net_step, gated_rmsnorm,
        l2norm, load_gguf_weights, moe, rope_neox,
    )
except ModuleNotFoundError:  # rootdir-relative import: pytest put tests/ itself on sys.path
    from reference import (  # type: ignore[no-redef]
        RefHParams, ReferenceModel, causal_conv_step, full_attention, gated_delta_net_step, gated_rmsnorm,
        l2norm, load_gguf_weights, moe, rope_neox,
    )



# --------------------------------------------------------------------------------------------
# Random weights
# --------------------------------------------------------------------------------------------


def small_hparams(n_v_heads=2, **kw) -> RefHParams:
    base = dict(
        n_layer=4, n_embd=32, n_vocab=64, n_head=4, n_head_kv=2, head_dim=16, eps=1e-6,
        rope_base=10000.0, n_rot=8, n_expert=8, n_expert_used=2, d_conv=4,
        d_inner=n_v_heads * 8, ssm_state=8, n_k_heads=2, n_v_heads=n_v_heads,
        full_attention_interval=2,
    )
    base.update(kw)
    return RefHParams(**base)


def make_weights(hp: RefHParams, seed=0, legacy=False, tied=False, merged_gate_up=False,
                 n_ff_exp=16, n_ff_shexp=24) -> dict[str, np.ndarray]:
    """Random weights in numpy order (reverse of GGUF ne), keyed by GGUF tensor names."""
    rng = np.random.default_rng(seed)
    E = hp.n_embd

    def lin(n_out, n_in):
        return rng.standard_normal((n_out, n_in)) / np.sqrt(n_in)

    def norm(n):
        return 1.0 + 0.1 * rng.standard_normal(n)

    w = {"token_embd.weight": rng.standard_normal((hp.n_vocab, E)), "output_norm.weight": norm(E)}
    if not tied:
        w["output.weight"] = lin(hp.n_vocab, E)
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        w[p + "attn_norm.weight"] = norm(E)
        w[p + "post_attention_norm.weight"] = norm(E)
        if hp.recurrent[il]:
            qkv = lin(hp.conv_dim, E)
            z = lin(hp.value_dim, E)
            if legacy:
                w[p + "ssm_in.weight"] = legacy_ssm_in(qkv, z, hp)
            else:
                w[p + "attn_qkv.weight"] = qkv
                w[p + "attn_gate.weight"] = z
            w[p + "ssm_ba.weight"] = lin(2 * hp.n_v_heads, E)
            w[p + "ssm_conv1d.weight"] = 0.5 * rng.standard_normal((hp.conv_dim, hp.d_conv))
            w[p + "ssm_a"] = -np.exp(0.5 * rng.standard_normal(hp.n_v_heads))
            w[p + "ssm_dt.bias"] = 0.5 * rng.standard_normal(hp.n_v_heads)
            w[p + "ssm_norm.weight"] = norm(hp.ssm_state)
            w[p + "ssm_out.weight"] = lin(E, hp.value_dim)
        else:
            w[p + "attn_q.weight"] = lin(2 * hp.head_dim * hp.n_head, E)
            w[p + "attn_k.weight"] = lin(hp.head_dim * hp.n_head_kv, E)
            w[p + "attn_v.weight"] = lin(hp.head_dim * hp.n_head_kv, E)
            w[p + "attn_q_norm.weight"] = norm(hp.head_dim)
            w[p + "attn_k_norm.weight"] = norm(hp.head_dim)
            w[p + "attn_output.weight"] = lin(E, hp.head_dim * hp.n_head)
        # router scaled up so top-k margins are clear
        w[p + "ffn_gate_inp.weight"] = 3.0 * lin(hp.n_expert, E)
        gate = rng.standard_normal((hp.n_expert, n_ff_exp, E)) / np.sqrt(E)
        up = rng.standard_normal((hp.n_expert, n_ff_exp, E)) / np.sqrt(E)
        if merged_gate_up:
            w[p + "ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)
        else:
            w[p + "ffn_gate_exps.weight"] = gate
            w[p + "ffn_up_exps.weight"] = up
        w[p + "ffn_down_exps.weight"] = rng.standard_normal((hp.n_expert, E, n_ff_exp)) / np.sqrt(n_ff_exp)
        w[p + "ffn_gate_shexp.weight"] = lin(n_ff_shexp, E)
        w[p + "ffn_up_shexp.weight"] = lin(n_ff_shexp, E)
        w[p + "ffn_down_shexp.weight"] = lin(E, n_ff_shexp)
        w[p + "ffn_gate_inp_shexp.weight"] = lin(1, E).reshape(E)
    return w


def legacy_ssm_in(qkv, z, hp: RefHParams):
    """Interleave split-form qkv / z rows into the legacy per-k-head layout [q_g, k_g, v_g, z_g]."""
    S, r, kd = hp.ssm_state, hp.v_per_k, hp.key_dim
    rows = []
    for g in range(hp.n_k_heads):
        rows.append(qkv[g * S:(g + 1) * S])
        rows.append(qkv[kd + g * S:kd + (g + 1) * S])
        rows.append(qkv[2 * kd + g * r * S:2 * kd + (g + 1) * r * S])
        rows.append(z[g * r * S:(g + 1) * r * S])
    return np.concatenate(rows, axis=0)


TOKENS = [3, 17, 42, 5, 60, 0, 9, 33, 12, 7, 51, 28, 2]


@pytest.fixture(params=[2, 4], ids=["nv_eq_nk", "nv_2nk"])
def hp(request):
    return small_hparams(n_v_heads=request.param)


# --------------------------------------------------------------------------------------------
# Chunking, state, variants
# --------------------------------------------------------------------------------------------


def test_hparams_layer_pattern():
    hp = small_hparams()
    assert hp.recurrent == [True, False, True, False]
    assert small_hparams(full_attention_interval=4).recurrent == [True, True, True, False]
    assert hp.conv_dim == 2 * hp.key_dim + hp.value_dim


def test_chunking_is_invisible(hp):
    w = make_weights(hp, seed=1)
    whole = ReferenceModel(w, hp).forward(TOKENS)
    assert whole.shape == (len(TOKENS), hp.n_vocab)
    assert np.all(np.isfinite(whole))

    one = ReferenceModel(w, hp)
    by_one = np.concatenate([one.forward([t]) for t in TOKENS])
    np.testing.assert_allclose(by_one, whole, rtol=1e-10, atol=1e-10)

    uneven = ReferenceModel(w, hp)
    pieces, i = [], 0
    for n in (4, 1, 5, 3):
        pieces.append(uneven.forward(TOKENS[i:i + n]))
        i += n
    assert i == len(TOKENS)
    np.testing.assert_allclose(np.concatenate(pieces), whole, rtol=1e-10, atol=1e-10)

    for il in range(hp.n_layer):
        if hp.recurrent[il]:
            np.testing.assert_allclose(one.ssm_state(il), uneven.ssm_state(il), rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(one.conv_state(il), uneven.conv_state(il), rtol=1e-10, atol=1e-12)
        else:
            for a, b in zip(one.kv_cache(il), uneven.kv_cache(il)):
                np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_reset_and_clone(hp):
    w = make_weights(hp, seed=2)
    m = ReferenceModel(w, hp)
    first = m.forward(TOKENS[:5])
    c = m.clone()
    tail_m = m.forward(TOKENS[5:])
    tail_c = c.forward(TOKENS[5:])
    np.testing.assert_array_equal(tail_m, tail_c)
    m.reset()
    assert m.n_past == 0
    np.testing.assert_array_equal(m.forward(TOKENS[:5]), first)


def test_history_and_state_shapes(hp):
    w = make_weights(hp, seed=3)
    m = ReferenceModel(w, hp)
    m.forward(TOKENS[:6])
    ref = ReferenceModel(w, hp)
    for il in range(hp.n_layer):
        if not hp.recurrent[il]:
            with pytest.raises(ValueError):
                m.history(il)
            k, v = m.kv_cache(il)
            assert k.shape == v.shape == (6, hp.n_head_kv, hp.head_dim)
            continue
        hist = m.history(il)
        assert len(hist) == 6
        assert m.conv_state(il).shape == (hp.d_conv - 1, hp.conv_dim)
        assert m.ssm_state(il).shape == (hp.n_v_heads, hp.ssm_state, hp.ssm_state)
        np.testing.assert_array_equal(hist[-1][0], m.conv_state(il))
        np.testing.assert_array_equal(hist[-1][1], m.ssm_state(il))
    # slot r = the state r tokens back = the state of a model that saw r tokens fewer
    for n in range(1, 7):
        ref.reset()
        ref.forward(TOKENS[:n])
        for il in range(hp.n_layer):
            if hp.recurrent[il]:
                conv, ssm = m.history(il)[n - 1]
                np.testing.assert_allclose(conv, ref.conv_state(il), rtol=1e-12, atol=1e-14)
                np.testing.assert_allclose(ssm, ref.ssm_state(il), rtol=1e-10, atol=1e-12)
    # the conv state holds the last d_conv-1 qkv inputs; after one token only the newest is set
    ref.reset()
    ref.forward(TOKENS[:1])
    conv = ref.conv_state(0)
    assert np.all(conv[:-1] == 0) and np.any(conv[-1] != 0)


def test_legacy_ssm_in_matches_split(hp):
    split = make_weights(hp, seed=4)
    legacy = make_weights(hp, seed=4, legacy=True)
    assert "blk.0.ssm_in.weight" in legacy and "blk.0.attn_qkv.weight" not in legacy
    assert legacy["blk.0.ssm_in.weight"].shape == (2 * hp.key_dim + 2 * hp.value_dim, hp.n_embd)
    a = ReferenceModel(split, hp).forward(TOKENS)
    b = ReferenceModel(legacy, hp).forward(TOKENS)
    np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12)


def test_merged_gate_up_matches():
    hp = small_hparams()
    a = ReferenceModel(make_weights(hp, seed=5), hp).forward(TOKENS)
    b = ReferenceModel(make_weights(hp, seed=5, merged_gate_up=True), hp).forward(TOKENS)
    np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12)


def test_tied_output():
    hp = small_hparams()
    w = make_weights(hp, seed=6, tied=True)
    assert "output.weight" not in w
    tied = ReferenceModel(w, hp).forward(TOKENS)
    w2 = dict(w)
    w2["output.weight"] = w["token_embd.weight"].copy()
    np.testing.assert_array_equal(ReferenceModel(w2, hp).forward(TOKENS), tied)
    # and it differs from an untied head
    w3 = dict(w)
    w3["output.weight"] = make_weights(hp, seed=7)["output.weight"]
    assert not np.allclose(ReferenceModel(w3, hp).forward(TOKENS), tied)


def test_gqa_equals_repeated_kv_heads():
    """n_head_kv < n_head: same logits as n_head_kv == n_head with each kv head repeated."""
    hp = small_hparams(n_head_kv=2)
    w = make_weights(hp, seed=8)
    hp_full = replace(hp, n_head_kv=hp.n_head, recurrent=list(hp.recurrent))
    w_full = dict(w)
    group, hd = hp.n_head // hp.n_head_kv, hp.head_dim
    for il in range(hp.n_layer):
        if hp.recurrent[il]:
            continue
        for name in ("attn_k.weight", "attn_v.weight"):
            blocks = w[f"blk.{il}.{name}"].reshape(hp.n_head_kv, hd, hp.n_embd)
            w_full[f"blk.{il}.{name}"] = np.repeat(blocks, group, axis=0).reshape(-1, hp.n_embd)
    np.testing.assert_allclose(ReferenceModel(w_full, hp_full).forward(TOKENS),
                               ReferenceModel(w, hp).forward(TOKENS), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------------------------
# Blocks against independent formulations
# --------------------------------------------------------------------------------------------


def test_rope_position_zero_is_identity_and_relative():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 16))
    np.testing.assert_array_equal(rope_neox(x, 0, 8, 10000.0), x)
    y = rope_neox(x, 7, 8, 10000.0)
    np.testing.assert_array_equal(y[:, 8:], x[:, 8:])  # dims >= n_rot untouched
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-13)
    # pair (i, i + n_rot/2) is rotated by pos * base^(-2i/n_rot)
    i, half = 1, 4
    ang = 7 * 10000.0 ** (-2 * i / 8)
    c = x[0, i] + 1j * x[0, i + half]
    c2 = c * np.exp(1j * ang)
    np.testing.assert_allclose([y[0, i], y[0, i + half]], [c2.real, c2.imag], rtol=1e-13)
    # scores depend only on the relative position
    q, k = rng.standard_normal(16), rng.standard_normal(16)
    s1 = rope_neox(q, 9, 8, 100.0) @ rope_neox(k, 4, 8, 100.0)
    s2 = rope_neox(q, 15, 8, 100.0) @ rope_neox(k, 10, 8, 100.0)
    np.testing.assert_allclose(s1, s2, rtol=1e-12)


def test_causal_conv_matches_np_convolve():
    rng = np.random.default_rng(1)
    T, C, d = 9, 5, 4
    x = rng.standard_normal((T, C))
    wt = rng.standard_normal((C, d))
    state = np.zeros((d - 1, C))
    got = []
    for t in range(T):
        o, state = causal_conv_step(state, x[t], wt)
        got.append(o)
    want = np.stack([np.convolve(x[:, c], wt[c, ::-1])[:T] for c in range(C)], axis=1)
    np.testing.assert_allclose(np.stack(got), want, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(state, x[-(d - 1):])


def test_delta_rule_closed_form():
    """M_t = e^{g_t} (I - b_t k_t k_t^T) M_{t-1} + b_t k_t v_t^T, unrolled over 3 tokens."""
    rng = np.random.default_rng(2)
    H, S = 3, 5
    M0 = rng.standard_normal((H, S, S))
    steps = []
    for _ in range(3):
        k = l2norm(rng.standard_normal((H, S)), 1e-6)
        q = l2norm(rng.standard_normal((H, S)), 1e-6) / np.sqrt(S)
        v = rng.standard_normal((H, S))
        g = -np.abs(rng.standard_normal(H))
        b = 1 / (1 + np.exp(-rng.standard_normal(H)))
        steps.append((q, k, v, g, b))
    M, outs = M0, []
    for q, k, v, g, b in steps:
        o, M = gated_delta_net_step(M, q, k, v, g, b)
        outs.append(o)
    for h in range(H):
        A = [np.exp(g[h]) * (np.eye(S) - b[h] * np.outer(k[h], k[h])) for q, k, v, g, b in steps]
        B = [b[h] * np.outer(k[h], v[h]) for q, k, v, g, b in steps]
        Ms = [A[0] @ M0[h] + B[0],
              A[1] @ A[0] @ M0[h] + A[1] @ B[0] + B[1],
              A[2] @ A[1] @ A[0] @ M0[h] + A[2] @ A[1] @ B[0] + A[2] @ B[1] + B[2]]
        np.testing.assert_allclose(M[h], Ms[2], rtol=1e-12, atol=1e-12)
        for t in range(3):
            np.testing.assert_allclose(outs[t][h], Ms[t].T @ steps[t][0][h], rtol=1e-12, atol=1e-12)
    # a unit-norm key with beta = 1 and no decay writes v exactly: M^T k == v afterwards
    k = l2norm(rng.standard_normal((1, S)), 1e-6)
    v = rng.standard_normal((1, S))
    _, M1 = gated_delta_net_step(rng.standard_normal((1, S, S)), k, k, v, np.zeros(1), np.ones(1))
    np.testing.assert_allclose(M1[0].T @ k[0], v[0], rtol=1e-12, atol=1e-12)


def test_full_attention_first_token_is_gated_value():
    hp = small_hparams()
    w = make_weights(hp, seed=9)
    rng = np.random.default_rng(3)
    h = rng.standard_normal((1, hp.n_embd))
    k_cache, v_cache = [], []
    y = full_attention(w, "blk.1.", hp, h, [0], k_cache, v_cache)
    hd = hp.head_dim
    qg = (w["blk.1.attn_q.weight"] @ h[0]).reshape(hp.n_head, 2 * hd)
    v = (w["blk.1.attn_v.weight"] @ h[0]).reshape(hp.n_head_kv, hd)
    group = hp.n_head // hp.n_head_kv
    out = np.stack([v[i // group] / (1 + np.exp(-qg[i, hd:])) for i in range(hp.n_head)])
    np.testing.assert_allclose(y[0], w["blk.1.attn_output.weight"] @ out.reshape(-1), rtol=1e-12)
    assert len(k_cache) == 1


# --------------------------------------------------------------------------------------------
# Hand-computed cases: MoE routing, gated RMSNorm, MTP head
# --------------------------------------------------------------------------------------------

LN3 = np.log(3.0)
SILU_LN3 = 0.75 * LN3          # sigmoid(ln 3) = 1 / (1 + 1/3) = 3/4


def two_dim_hparams(**kw) -> RefHParams:
    base = dict(n_layer=0, n_embd=2, n_vocab=3, n_head=1, n_head_kv=1, head_dim=2, eps=0.0, rope_base=10000.0,
                n_rot=2, n_expert=3, n_expert_used=2, d_conv=4, d_inner=2, ssm_state=2, n_k_heads=1, n_v_heads=1)
    base.update(kw)
    return RefHParams(**base)


def test_moe_routing_by_hand():
    """x = [1, 0]; router logits 0, ln 2, ln 3 -> softmax 1/6, 2/6, 3/6; top-2 = experts 2 and 1,
    renormalised 3/5 and 2/5. Expert e: gate . x = ln 3 (silu = 0.75 ln 3), up . x = e + 1,
    down = [1, e], so its output is 0.75 ln 3 (e + 1) [1, e]. The shared expert gives
    0.75 ln 3 [0, 1], gated by sigmoid([ln 3, 0] . x) = 3/4."""
    hp = two_dim_hparams()
    w = {
        "ffn_gate_inp.weight": np.array([[0.0, 0.0], [np.log(2.0), 0.0], [LN3, 0.0]]),
        "ffn_gate_exps.weight": np.tile([[[LN3, 0.0]]], (3, 1, 1)),
        "ffn_up_exps.weight": np.array([[[1.0, 0.0]], [[2.0, 0.0]], [[3.0, 0.0]]]),
        "ffn_down_exps.weight": np.array([[[1.0], [0.0]], [[1.0], [1.0]], [[1.0], [2.0]]]),
        "ffn_gate_shexp.weight": np.array([[LN3, 0.0]]),
        "ffn_up_shexp.weight": np.array([[1.0, 0.0]]),
        "ffn_down_shexp.weight": np.array([[0.0], [1.0]]),
        "ffn_gate_inp_shexp.weight": np.array([LN3, 0.0]),
    }
    x = np.array([[1.0, 0.0]])
    routed = SILU_LN3 * (3 / 5 * 3 * np.array([1.0, 2.0]) + 2 / 5 * 2 * np.array([1.0, 1.0]))   # [13/5, 22/5]
    shared = 0.75 * SILU_LN3 * np.array([0.0, 1.0])
    np.testing.assert_allclose(moe(w, "", hp, x)[0], routed + shared, rtol=1e-12)
    # expert_weights_scale multiplies the routed experts only
    np.testing.assert_allclose(moe(w, "", replace(hp, expert_weights_scale=2.0), x)[0], 2 * routed + shared,
                               rtol=1e-12)
    # without the shared expert's gate its output is added as it is
    w.pop("ffn_gate_inp_shexp.weight")
    np.testing.assert_allclose(moe(w, "", hp, x)[0], routed + shared / 0.75, rtol=1e-12)
    # one expert used: only expert 2, with weight 1 after renormalisation
    np.testing.assert_allclose(moe(w, "", replace(hp, n_expert_used=1), x)[0],
                               SILU_LN3 * 3 * np.array([1.0, 2.0]) + shared / 0.75, rtol=1e-12)


def test_gated_rmsnorm_by_hand():
    """Per head: o / sqrt(mean(o^2) + eps) * weight * silu(z). Head 0: [3, 4] has mean square
    12.5, so [0.6, 0.8] sqrt 2; head 1: [1, 1] stays."""
    o = np.array([[3.0, 4.0], [1.0, 1.0]])
    z = np.array([[LN3, LN3], [0.0, LN3]])
    weight = np.array([1.0, 2.0])
    want = np.array([[0.6 * np.sqrt(2.0) * SILU_LN3, 0.8 * np.sqrt(2.0) * 2 * SILU_LN3], [0.0, 2 * SILU_LN3]])
    np.testing.assert_allclose(gated_rmsnorm(o, z, weight, 0.0), want, rtol=1e-12)
    # eps = 12.5 doubles head 0's mean square: [3, 4] / 5
    np.testing.assert_allclose(gated_rmsnorm(o[:1], z[:1], weight, 12.5),
                               [[0.6 * SILU_LN3, 0.8 * 2 * SILU_LN3]], rtol=1e-12)


def test_mtp_head_by_hand():
    """The MTP block with its attention and FFN outputs zeroed: x = eh_proj [rmsnorm(embed) enorm ;
    rmsnorm(hidden) hnorm]. Token 0's embedding [3, 4] normalises to [0.6, 0.8] sqrt 2; hidden
    [1, -1] to itself, times hnorm 2; eh_proj adds the hidden's first half to the first row, so
    x = [0.6 sqrt 2 + 2, 0.8 sqrt 2]. The LM head is the (tied) embedding after shared_head_norm."""
    hp = two_dim_hparams()
    rng = np.random.default_rng(0)
    embed = np.array([[3.0, 4.0], [1.0, 0.0], [0.0, 1.0]])
    n = "blk.0.nextn."
    w = {"token_embd.weight": embed, "output_norm.weight": np.array([5.0, 5.0]),
         n + "enorm.weight": np.ones(2), n + "hnorm.weight": np.full(2, 2.0),
         n + "eh_proj.weight": np.array([[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]]),
         n + "shared_head_norm.weight": np.array([1.0, 3.0]),
         "blk.0.attn_norm.weight": np.ones(2), "blk.0.post_attention_norm.weight": np.ones(2),
         "blk.0.attn_q.weight": rng.standard_normal((4, 2)), "blk.0.attn_k.weight": rng.standard_normal((2, 2)),
         "blk.0.attn_v.weight": rng.standard_normal((2, 2)), "blk.0.attn_q_norm.weight": np.ones(2),
         "blk.0.attn_k_norm.weight": np.ones(2), "blk.0.attn_output.weight": np.zeros((2, 2)),
         "blk.0.ffn_gate.weight": rng.standard_normal((3, 2)), "blk.0.ffn_up.weight": rng.standard_normal((3, 2)),
         "blk.0.ffn_down.weight": np.zeros((2, 3))}
    logits, x = ReferenceModel(w, hp).mtp_forward([0], np.array([[1.0, -1.0]]))
    want_x = np.array([0.6 * np.sqrt(2.0) + 2.0, 0.8 * np.sqrt(2.0)])
    np.testing.assert_allclose(x[0], want_x, rtol=1e-12)
    xn = want_x / np.sqrt((want_x ** 2).mean()) * np.array([1.0, 3.0])   # shared_head_norm, not output_norm
    np.testing.assert_allclose(logits[0], [3 * xn[0] + 4 * xn[1], xn[0], xn[1]], rtol=1e-12)


# --------------------------------------------------------------------------------------------
# GGUF loading
# --------------------------------------------------------------------------------------------


def write_gguf(path, hp: RefHParams, w, qtypes=None, use_recurrent_array=True):
    import gguf

    qtypes = qtypes or {}
    wr = gguf.GGUFWriter(str(path), "qwen3next")
    a = "qwen3next."
    for key, val in [("block_count", hp.n_layer), ("embedding_length", hp.n_embd),
                     ("attention.head_count", hp.n_head), ("attention.head_count_kv", hp.n_head_kv),
                     ("attention.key_length", hp.head_dim), ("attention.value_length", hp.head_dim),
                     ("rope.dimension_count", hp.n_rot), ("expert_count", hp.n_expert),
                     ("expert_used_count", hp.n_expert_used), ("ssm.conv_kernel", hp.d_conv),
                     ("ssm.inner_size", hp.d_inner), ("ssm.state_size", hp.ssm_state),
                     ("ssm.group_count", hp.n_k_heads), ("ssm.time_step_rank", hp.n_v_heads),
                     ("full_attention_interval", hp.full_attention_interval)]:
        wr.add_uint32(a + key, val)
    wr.add_float32(a + "attention.layer_norm_rms_epsilon", hp.eps)
    wr.add_float32(a + "rope.freq_base", hp.rope_base)
    if use_recurrent_array:
        wr.add_array(a + "attention.recurrent_layers", [bool(r) for r in hp.recurrent])
    for name, arr in w.items():
        qt = qtypes.get(name)
        if qt is None:
            wr.add_tensor(name, arr.astype(np.float32))
        elif qt == gguf.GGMLQuantizationType.F16:
            wr.add_tensor(name, arr.astype(np.float32).astype(np.float16))
        else:
            wr.add_tensor(name, gguf.quants.quantize(arr.astype(np.float32), qt), raw_dtype=qt)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()


def test_gguf_roundtrip_f32(tmp_path):
    hp = small_hparams(n_v_heads=4, full_attention_interval=4)
    hp = replace(hp, recurrent=[True, False, True, False])  # array must win over the interval
    w = {k: v.astype(np.float32).astype(np.float64) for k, v in make_weights(hp, seed=10).items()}
    path = tmp_path / "m.gguf"
    write_gguf(path, hp, w)
    w2, hp2 = load_gguf_weights(path)
    assert hp2 == replace(hp, eps=float(np.float32(hp.eps)))  # stored as F32 in the file
    assert set(w2) == set(w)
    for k in w:
        assert w2[k].dtype == np.float64
        np.testing.assert_array_equal(w2[k], w[k], err_msg=k)
    np.testing.assert_array_equal(ReferenceModel.from_gguf(path).forward(TOKENS[:4]),
                                  ReferenceModel(w, hp2).forward(TOKENS[:4]))


def test_gguf_interval_without_recurrent_array(tmp_path):
    hp = small_hparams(full_attention_interval=4)
    w = make_weights(hp, seed=11)
    path = tmp_path / "m.gguf"
    write_gguf(path, hp, w, use_recurrent_array=False)
    _, hp2 = load_gguf_weights(path)
    assert hp2.recurrent == [True, True, True, False]


def test_gguf_quantized_shapes(tmp_path):
    import gguf

    Q = gguf.GGMLQuantizationType
    hp = small_hparams()
    w = make_weights(hp, seed=12)
    qtypes = {"token_embd.weight": Q.Q8_0, "blk.0.attn_qkv.weight": Q.F16,
              "blk.0.ffn_gate_exps.weight": Q.Q8_0, "blk.1.attn_q.weight": Q.BF16,
              "blk.1.ffn_down_exps.weight": Q.F16}
    path = tmp_path / "q.gguf"
    write_gguf(path, hp, w, qtypes=qtypes)
    w2, _ = load_gguf_weights(path)
    for name, qt in qtypes.items():
        assert w2[name].shape == w[name].shape, name
        assert w2[name].dtype == np.float64
        want = gguf.quants.dequantize(gguf.quants.quantize(w[name].astype(np.float32), qt), qt)
        np.testing.assert_array_equal(w2[name], want.reshape(w[name].shape))
        np.testing.assert_allclose(w2[name], w[name], atol=0.05 * np.abs(w[name]).max())
    assert np.all(np.isfinite(ReferenceModel(w2, hp).forward(TOKENS[:3])))


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """Logits of generated presets (same seed), computed once."""
    from deltarun.model_files import generate as gen

    d = tmp_path_factory.mktemp("gen")
    toks = [1, 2, 3, 100, 7]
    out = {}
    for name in ("tiny", "tiny-eqheads", "tiny-legacy", "tiny-tied", "tiny-mtp"):
        path = gen.write_model(d / f"{name}.gguf", gen.PRESETS[name], wtype="f32", seed=0)
        m = ReferenceModel.from_gguf(path)
        out[name] = (m, m.forward([min(t, m.hp.n_vocab - 1) for t in toks]))
    return out


def test_loads_generated_tiny_model(generated):
    m, logits = generated["tiny"]
    hp = m.hp
    assert any(hp.recurrent) and not all(hp.recurrent)
    assert hp.n_v_heads == 2 * hp.n_k_heads
    assert logits.shape == (5, hp.n_vocab)
    assert np.all(np.isfinite(logits))
    assert np.all(np.isfinite(m.ssm_state(hp.recurrent.index(True))))
    for name, (mm, lg) in generated.items():
        assert np.all(np.isfinite(lg)), name


def test_generated_variants_agree(generated):
    """The generator draws legacy ssm_in from the same q/k/v/z weights, and MTP layers after the
    main ones, so those presets must reproduce the tiny logits exactly."""
    _, base = generated["tiny"]
    for name in ("tiny-legacy", "tiny-mtp"):
        m, lg = generated[name]
        np.testing.assert_allclose(lg, base, rtol=1e-10, atol=1e-10, err_msg=name)
    m = generated["tiny-mtp"][0]
    assert m.hp.n_layer == generated["tiny"][0].hp.n_layer
