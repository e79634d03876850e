"""Kimi Delta Attention (KDA): the gated delta rule with a per-channel decay, on the delta net's
recurrent state, rollback slots and capture slots (`delta_net.recurrent_core`).

What differs from the gated delta net (see docs/kimi-linear-gguf.md and llama.cpp's
src/models/kimi-linear.cpp): separate q, k, v projections, each with its own short convolution
(`ssm_conv1d_{q,k,v}`; here they run as one conv over the channels q|k|v, so the conv state is one
row per slot like the delta net's); as many key as value heads; the decay per key channel,
g = ssm_a * softplus(ssm_f_b ssm_f_a x + ssm_dt.bias), which `ggml_gated_delta_net` takes as a
[S_v, H, T, N] gate (the primitive form: `delta_net._delta_net_chunked_per_channel`); the output
RMSNorm gated by sigmoid(ssm_g_b ssm_g_a x) (not SiLU), then `attn_output`.
"""

from __future__ import annotations

from deltarun.base.ggml_util import Tensor, ggml
from deltarun.base.interface import HParams
from deltarun.graphs.blocks.base import GraphContext
from deltarun.graphs.blocks.delta_net import recurrent_core

Spec = dict[str, tuple[tuple[int, ...], bool]]

CONV_NAMES = ("ssm_conv1d_q.weight", "ssm_conv1d_k.weight", "ssm_conv1d_v.weight")


def tensors(hp: HParams, p: str) -> Spec:
    """The weights of one KDA mixer (prefix `blk.N.`)."""
    E, H, d = hp.n_embd, hp.ssm_n_v_heads, hp.ssm_d_state
    t: Spec = {p + f"attn_{x}.weight": ((E, H * d), True) for x in "qkv"}
    for name in CONV_NAMES:
        t[p + name] = ((hp.ssm_d_conv, 1, H * d), True)
    t[p + "ssm_f_a.weight"] = ((E, d), True)
    t[p + "ssm_f_b.weight"] = ((d, H * d), True)
    t[p + "ssm_dt.bias"] = ((H * d,), True)
    t[p + "ssm_a"] = ((1, H), True)
    t[p + "ssm_beta.weight"] = ((E, H), True)
    t[p + "ssm_g_a.weight"] = ((E, d), True)
    t[p + "ssm_g_b.weight"] = ((d, H * d), True)
    t[p + "ssm_norm.weight"] = ((d,), True)
    t[p + "attn_output.weight"] = ((H * d, E), True)
    return t


def kda(g: GraphContext, cur: Tensor, il: int) -> Tensor:
    hp, ub, c, w = g.hp, g.ub, g.ctx, g.w
    p = f"blk.{il}."
    H, d = hp.ssm_n_v_heads, hp.ssm_d_state
    T, N = ub.n_seq_tokens, ub.n_seqs

    q, k, v = (g.mm(w[p + f"attn_{x}.weight"], cur) for x in "qkv")
    qkv = ggml.ggml_concat(c, ggml.ggml_concat(c, q, k, 0), v, 0)
    qkv = g.cb(ggml.ggml_reshape_3d(c, qkv, hp.conv_dim, T, N), "qkv_mixed", il)
    kernels = [ggml.ggml_reshape_2d(c, w[p + name], hp.ssm_d_conv, H * d) for name in CONV_NAMES]
    conv_weight = ggml.ggml_concat(c, ggml.ggml_concat(c, kernels[0], kernels[1], 1), kernels[2], 1)

    f = g.mm(w[p + "ssm_f_b.weight"], g.mm(w[p + "ssm_f_a.weight"], cur))
    gate = ggml.ggml_softplus(c, ggml.ggml_add(c, f, w[p + "ssm_dt.bias"]))
    gate = ggml.ggml_mul(c, ggml.ggml_reshape_3d(c, gate, d, H, T * N), ggml.ggml_reshape_3d(c, w[p + "ssm_a"], 1, H, 1))
    gate = g.cb(ggml.ggml_reshape_4d(c, gate, d, H, T, N), "kda_g1", il)
    beta = ggml.ggml_reshape_4d(c, g.mm(w[p + "ssm_beta.weight"], cur), 1, H, T, N)
    beta = g.cb(ggml.ggml_sigmoid(c, beta), "kda_beta", il)

    out = recurrent_core(g, qkv, conv_weight, gate, beta, il, "tiled")        # [d, H, T, N]

    out_gate = g.mm(w[p + "ssm_g_b.weight"], g.mm(w[p + "ssm_g_a.weight"], cur))
    out_gate = ggml.ggml_sigmoid(c, ggml.ggml_reshape_4d(c, out_gate, d, H, T, N))
    normed = g.rms_norm(out, w[p + "ssm_norm.weight"], "kda_normed", il)
    gated = ggml.ggml_reshape_2d(c, ggml.ggml_mul(c, normed, out_gate), H * d, T * N)
    return g.cb(g.mm(w[p + "attn_output.weight"], gated), "kda_out", il)
