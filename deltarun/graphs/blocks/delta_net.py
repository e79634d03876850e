"""The gated delta net (linear attention) with its rollback-slot recurrent state.

Shared by every hybrid family. Per linear-attention layer: the q|k|v and z projections (split
`attn_qkv` + `attn_gate`, or qwen3next's legacy grouped `ssm_in`), beta and the decay gate (from
qwen3next's fused `ssm_ba` or qwen35's separate `ssm_beta` / `ssm_alpha`), the causal conv over
the conv state, whose last Kw windows go to the rollback slots with ONE set_rows ordered by
`rs_s_slot_rev`, L2-normed q/k broadcast to the value heads, and the delta rule itself, fused
(`ggml_gated_delta_net`, which also writes the K state snapshots) or from primitive ops (the
one-token recurrence, or the chunked WY form), then the gated RMSNorm and the output projection.
The part from the conv input to the delta rule's output (`recurrent_core`) is shared with Kimi's
KDA (blocks/kda.py), whose decay gate is per key channel ([S, H, T, N] instead of [1, H, T, N]):
the fused op and the one-token step take either; the chunked form has a per-channel variant.

Value-head order (`DeltaNet.broadcast`): with more value heads than key heads, qwen3next files
keep value heads grouped by key head (value head j*r+i reads key head j), so q/k are repeated
interleaved before the delta rule; qwen35 files store value heads tiled by the converter (value
head h reads key head h % H_k), which is what ggml_gated_delta_net does with fewer q/k heads in
ggml 0.15.3 (CPU, Vulkan and CUDA kernels), so the fused path needs no repeat and the primitive
path repeats tiled (`ggml_repeat_4d`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deltarun.base.ggml_util import Tensor, ggml, nb, ne
from deltarun.base.interface import HParams
from deltarun.graphs.blocks.base import GraphContext
from deltarun.graphs.inputs import RecurrentStateInput

CHUNK_SIZE = 64  # chunk length of the primitive (chunked) delta rule
#: ubatches of at least this many tokens per sequence run the short convolution channel-major
#: (`conv_channel_major`); shorter ones (decoding, verification of drafts, short prompt chunks)
#: run ggml_ssm_conv, one node where the channel-major form takes ten. With the
#: ssm-conv-tokens kernel patch ssm_conv is the faster one up to about 64 tokens (0.8B shapes,
#: Q8_0, 2 threads: a 16-token ubatch 153-161 t/s against 120-136, 64 tokens equal, 512 tokens
#: 156-160 against 163-169; bench/RESULTS.md)
CONV_CHANNEL_MAJOR_MIN_TOKENS = 64
#: chunk length of the per-channel-decay form (Kimi's KDA), whose pairwise decays take
#: S x C x C floats per chunk and head
KDA_CHUNK_SIZE = 16

Spec = dict[str, tuple[tuple[int, ...], bool]]


@dataclass(frozen=True)
class DeltaNet:
    """How a family's files lay out the delta net."""

    beta_alpha: str = "fused"     # "fused": ssm_ba (qwen3next); "split": ssm_beta + ssm_alpha (qwen35)
    broadcast: str = "grouped"    # value-head order: "grouped" (qwen3next) or "tiled" (qwen35)
    legacy_ssm_in: bool = True    # accept qwen3next's older grouped ssm_in projection
    output_gate: str = "silu"     # the gated output norm's gate: "silu", or "sigmoid" (qwen4exp)


def tensors(hp: HParams, p: str, kind: DeltaNet, present: "set[str] | dict") -> Spec:
    """The weights of one linear-attention mixer (prefix `blk.N.`); `present`: the file's tensor names."""
    E, nv = hp.n_embd, hp.ssm_n_v_heads
    t: Spec = {}
    if kind.legacy_ssm_in and p + "ssm_in.weight" in present:
        t[p + "ssm_in.weight"] = ((E, 2 * hp.key_dim + 2 * hp.value_dim), True)
    else:
        t[p + "attn_qkv.weight"] = ((E, hp.conv_dim), True)
        t[p + "attn_gate.weight"] = ((E, hp.value_dim), True)
    t[p + "ssm_conv1d.weight"] = ((hp.ssm_d_conv, hp.conv_dim), True)
    t[p + "ssm_dt.bias"] = ((nv,), True)
    t[p + "ssm_a"] = ((nv,), True)
    if kind.beta_alpha == "fused":
        t[p + "ssm_ba.weight"] = ((E, 2 * nv), True)
    else:
        t[p + "ssm_beta.weight"] = ((E, nv), True)
        t[p + "ssm_alpha.weight"] = ((E, nv), True)
    t[p + "ssm_norm.weight"] = ((hp.head_v_dim,), True)
    t[p + "ssm_out.weight"] = ((hp.value_dim, E), True)
    return t


def recurrent_input(g: GraphContext) -> RecurrentStateInput:
    return g.input(RecurrentStateInput, lambda: RecurrentStateInput(g.ctx, g.ub, g.mem.rs_slots))


def beta_and_gate(g: GraphContext, cur: Tensor, il: int, kind: DeltaNet) -> tuple[Tensor, Tensor]:
    """beta = sigmoid(x W_beta) and the decay gate = softplus(x W_alpha + dt_bias) * ssm_a, each
    [1, H_v, T, N] (`GraphContext.grid`)."""
    hp, c, w = g.hp, g.ctx, g.w
    p = f"blk.{il}."
    nk, nv = hp.ssm_n_k_heads, hp.ssm_n_v_heads
    r = nv // nk
    T, N = g.grid
    f32 = 4
    if kind.beta_alpha == "fused":
        # ssm_ba rows grouped per key head: [beta (r heads), alpha (r heads)]
        ba = g.cb(g.mm(w[p + "ssm_ba.weight"], cur), "linear_attn_mixed_ba", il)
        ba = ggml.ggml_reshape_4d(c, ba, 2 * r, nk, T, N)
        b = ggml.ggml_cont(c, g.view(ba, (r, nk, T, N), nb(ba)[1:], 0))
        a = ggml.ggml_cont_3d(c, g.view(ba, (r, nk, T, N), nb(ba)[1:], r * f32), nv, T, N)
        beta = ggml.ggml_reshape_4d(c, ggml.ggml_sigmoid(c, b), 1, nv, T, N)
    else:
        b = g.cb(ggml.ggml_reshape_4d(c, g.mm(w[p + "ssm_beta.weight"], cur), 1, nv, T, N), "beta", il)
        beta = g.cb(ggml.ggml_sigmoid(c, b), "beta_sigmoid", il)
        a = g.cb(ggml.ggml_reshape_3d(c, g.mm(w[p + "ssm_alpha.weight"], cur), nv, T, N), "alpha", il)
    gate = ggml.ggml_softplus(c, ggml.ggml_add(c, a, w[p + "ssm_dt.bias"]))
    gate = g.cb(ggml.ggml_mul(c, gate, w[p + "ssm_a"]), "gate", il)
    return beta, ggml.ggml_reshape_4d(c, gate, 1, nv, T, N)


def repeat_grouped(g: GraphContext, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
    """q, k [S, H_k, T, N] -> [S, H_v, T, N] with value head j*r+i reading key head j
    (repeat-interleave), as llama.cpp's qwen3next graph does; unchanged when H_v == H_k."""
    hp, c = g.hp, g.ctx
    S, nk, nv = hp.ssm_d_state, hp.ssm_n_k_heads, hp.ssm_n_v_heads
    r = nv // nk
    T, N = g.ub.n_seq_tokens, g.ub.n_seqs
    if r == 1:
        return q, k
    q = ggml.ggml_reshape_4d(c, ggml.ggml_repeat_4d(
        c, ggml.ggml_reshape_4d(c, q, S, 1, nk, T * N), S, r, nk, T * N), S, nv, T, N)
    k = ggml.ggml_reshape_4d(c, ggml.ggml_repeat_4d(
        c, ggml.ggml_reshape_4d(c, k, S, 1, nk, T * N), S, r, nk, T * N), S, nv, T, N)
    return q, k


def repeat_tiled(g: GraphContext, q: Tensor, k: Tensor, il: int) -> tuple[Tensor, Tensor]:
    """q, k [S, H_k, T, N] -> [S, H_v, T, N] with value head h reading key head h % H_k (what the
    fused op does by itself), for the primitive delta rule; unchanged when H_v == H_k."""
    hp, c = g.hp, g.ctx
    if hp.ssm_n_v_heads == hp.ssm_n_k_heads:
        return q, k
    shape = (hp.ssm_d_state, hp.ssm_n_v_heads, g.ub.n_seq_tokens, g.ub.n_seqs)
    return (g.cb(ggml.ggml_repeat_4d(c, q, *shape), "q_conv_tiled", il),
            g.cb(ggml.ggml_repeat_4d(c, k, *shape), "k_conv_tiled", il))


def linear_attention(g: GraphContext, cur: Tensor, il: int, kind: DeltaNet) -> Tensor:
    hp, c, w = g.hp, g.ctx, g.w
    p = f"blk.{il}."
    S, nv = hp.ssm_d_state, hp.ssm_n_v_heads
    T, N = g.grid

    qkv, z = qkvz(g, cur, il)                               # [conv_dim, T, N], [value_dim, T*N]
    beta, gate = beta_and_gate(g, cur, il, kind)
    # the recurrence per part (the ubatch, a riding prompt chunk), the products on all rows
    out = g.per_part(lambda part, take: recurrent_core(part, take(qkv, 1), w[p + "ssm_conv1d.weight"], take(gate, 2),
                                                       take(beta, 2), il, kind.broadcast), dim=2)

    z4 = ggml.ggml_reshape_4d(c, z, S, nv, T, N)
    normed = g.rms_norm(out, w[p + "ssm_norm.weight"], "attn_norm_gated", il)
    gate_of = ggml.ggml_sigmoid if kind.output_gate == "sigmoid" else ggml.ggml_silu
    gated = ggml.ggml_mul(c, normed, gate_of(c, z4))
    final = g.cb(ggml.ggml_reshape_2d(c, gated, hp.value_dim, T * N), "final_output", il)
    return g.cb(g.mm(w[p + "ssm_out.weight"], final), "linear_attn_out", il)


def recurrent_core(g: GraphContext, qkv: Tensor, conv_weight: Tensor, gate: Tensor, beta: Tensor, il: int,
                   broadcast: str) -> Tensor:
    """From the conv input channels q|k|v [conv_dim, T, N] to the delta rule's output [S, H_v, T, N],
    through the layer's recurrent state: the causal conv over the conv state (its last windows
    written to the rollback slots), SiLU, L2-normed q/k broadcast to the value heads (`broadcast`,
    see `DeltaNet`), and the delta rule with `gate` ([1, H_v, T, N] per head, or [S, H_v, T, N] per
    key channel) and `beta`, whose K newest states go to the slots. Shared by the gated delta net
    and Kimi's KDA (graphs/blocks/kda.py)."""
    hp, ub, c = g.hp, g.ub, g.ctx
    S, nk, nv = hp.ssm_d_state, hp.ssm_n_k_heads, hp.ssm_n_v_heads
    T, N = ub.n_seq_tokens, ub.n_seqs
    K = g.mem.rs_slots
    f32 = 4
    rs = recurrent_input(g)

    # conv state: slot 0 of this ubatch's cells, read in place (the sequences' cells are
    # consecutive from seq_head: Memory keeps them there, so nothing is gathered)
    conv_all = g.mem.conv[il]                                   # [(d_conv-1)*K*conv_dim, n_seq_max]
    dc1, ch = hp.ssm_d_conv - 1, hp.conv_dim
    cell = nb(conv_all)[1]
    conv_states = g.cb(g.view(conv_all, (dc1, ch, N), (K * dc1 * f32, cell), ub.seq_head * cell),
                       "conv_states", il)
    channel_major = T >= CONV_CHANNEL_MAJOR_MIN_TOKENS
    if channel_major:
        conv_input, conv_out = conv_channel_major(g, conv_states, qkv, conv_weight, il)
        tail = g.view(conv_input, (ch, dc1 + rs.kw - 1, N), nb(conv_input)[1:3],
                      (T - (rs.kw - 1)) * nb(conv_input)[1])       # the inputs of the last Kw windows
        write_conv_slots(g, rs, conv_all, g.cb(ggml.ggml_cont(c, ggml.ggml_transpose(c, tail)),
                                               "conv_input_tail", il), il)
    else:
        conv_input = ggml.ggml_concat(c, conv_states, ggml.ggml_transpose(c, qkv), 0)
        g.cb(conv_input, "conv_input", il)                      # [d_conv-1+T, conv_dim, N]
        write_conv_slots(g, rs, conv_all, conv_input, il)
        conv_out = ggml.ggml_ssm_conv(c, conv_input, conv_weight)
    g.cb(conv_out, "conv_output_raw", il)
    conv_out = g.cb(ggml.ggml_silu(c, conv_out), "conv_output_silu", il)   # [conv_dim, T, N]

    row = nb(conv_out)[1]
    q = g.view(conv_out, (S, nk, T, N), (S * f32, row, row * T), 0)
    k = g.view(conv_out, (S, nk, T, N), (S * f32, row, row * T), hp.key_dim * f32)
    v = g.view(conv_out, (S, nv, T, N), (S * f32, row, row * T), 2 * hp.key_dim * f32)
    q = ggml.ggml_l2_norm(c, q, hp.rms_eps)
    k = ggml.ggml_l2_norm(c, k, hp.rms_eps)
    if broadcast == "grouped":
        q, k = repeat_grouped(g, q, k)
    g.cb(q, "q_conv_predelta", il)      # qwen35: still H_k heads, as in llama.cpp's fused path
    g.cb(k, "k_conv_predelta", il)
    if ub.delta_net == "fused":
        g.cb(v, "v_conv_predelta", il)  # a view: the fused op reads rows by stride (CPU, Vulkan, CUDA)
    else:
        v = g.cb(ggml.ggml_cont(c, v), "v_conv_predelta", il)   # the primitive ops reshape it
        if broadcast == "tiled":
            q, k = repeat_tiled(g, q, k, il)

    ssm_all = g.mem.ssm[il]                                     # [D, n_seq_max, K]
    D = hp.ssm_state_size
    slot0 = g.view(ssm_all, (D, N), (nb(ssm_all)[1],), ub.seq_head * nb(ssm_all)[1])   # in place, contiguous
    state = g.cb(ggml.ggml_reshape_4d(c, slot0, S, S, nv, N), "state_predelta", il)
    # the delta rule's snapshots: the K newest states, or (a `continued` ubatch) the newest only
    n_snap = ub.rollback_slots(K)
    if T < n_snap and ub.keep_start:
        # slot T: the state the ubatch started from (its conv window is slot T too), so that the
        # whole ubatch can be rolled back; slots beyond stay unwritten. Expanded before the delta
        # rule: it reads slot 0, which the snapshot store below overwrites. (A decoding step
        # leaves it out: `UbatchShape.keep_start`; its conv window is written anyway, 1/50 of
        # the state's size, so the conv slots' single set_rows keeps one shape per T.)
        start = g.view(ssm_all, (D, N), (nb(ssm_all)[1],), T * nb(ssm_all)[2] + ub.seq_head * nb(ssm_all)[1])
        g.expand(g.cb(ggml.ggml_cpy(c, slot0, start), "ssm_state_store_start", il))

    if ub.captures:
        store_conv_captures(g, conv_input, channel_major, il)
        out, snaps = delta_rule_segments(g, q, k, v, gate, beta, state, n_snap, il)
    elif ub.delta_net == "fused" and g.mem.ssm_slots_in_place:
        # the kernel writes the snapshots into the cache's slots itself: no store below
        out, _ = delta_net_fused(g, q, k, v, gate, beta, state, n_snap, slot_stride=nb(ssm_all)[2])
        return g.cb(out, "attn_output", il)
    else:
        out, snaps = delta_rule(g, q, k, v, gate, beta, state, n_snap, il)
    # the output before the snapshot store: the primitive form reads slot 0 (the start state)
    # in branches the snapshots do not depend on, and the store overwrites slot 0
    g.expand(g.cb(out, "attn_output", il))
    n_written = min(T, n_snap)
    dst = g.view(ssm_all, (D, N, n_written), (nb(ssm_all)[1], nb(ssm_all)[2]), ub.seq_head * nb(ssm_all)[1])
    g.expand(g.cb(ggml.ggml_cpy(c, snaps, dst), "ssm_state_store", il))
    return out


def qkvz(g: GraphContext, cur: Tensor, il: int) -> tuple[Tensor, Tensor]:
    """The conv input channels q|k|v per token, and the gate z, from either projection form."""
    hp, c, w = g.hp, g.ctx, g.w
    p = f"blk.{il}."
    T, N = g.grid
    if p + "attn_qkv.weight" in w:
        qkv = g.cb(g.mm(w[p + "attn_qkv.weight"], cur), "linear_attn_qkv_mixed", il)
        z = g.cb(g.mm(w[p + "attn_gate.weight"], cur), "z", il)
        return ggml.ggml_reshape_3d(c, qkv, hp.conv_dim, T, N), z
    # legacy ssm_in: rows grouped per key head j as [q_j, k_j, v_j (r heads), z_j (r heads)]
    S, nk, r = hp.ssm_d_state, hp.ssm_n_k_heads, hp.ssm_n_v_heads // hp.ssm_n_k_heads
    m = g.cb(g.mm(w[p + "ssm_in.weight"], cur), "linear_attn_mixed_qkvz", il)
    m = ggml.ggml_reshape_4d(c, m, 2 * S + 2 * r * S, nk, T, N)
    strides = nb(m)[1:]
    parts = []
    offset = 0
    for size in (S, S, r * S, r * S):
        parts.append(ggml.ggml_cont_3d(c, g.view(m, (size, nk, T, N), strides, offset * 4), size * nk, T, N))
        offset += size
    qf, kf, vf, zf = parts
    qkv = ggml.ggml_concat(c, ggml.ggml_concat(c, qf, kf, 0), vf, 0)
    g.cb(qkv, "qkv_mixed", il)
    return qkv, g.cb(ggml.ggml_reshape_2d(c, zf, hp.value_dim, T * N), "z", il)


def conv_channel_major(g: GraphContext, conv_states: Tensor, qkv: Tensor, conv_weight: Tensor,
                       il: int) -> tuple[Tensor, Tensor]:
    """The causal depthwise conv of a prompt's ubatch from primitive ops, channel-major: the
    input [conv_dim, d_conv-1+T, N] is the conv state (transposed, d_conv-1 columns) followed by
    q|k|v as they come, and the output is the sum over taps j of input columns j..j+T-1 (a
    contiguous view) times tap j's weights, left to right as ggml_ssm_conv sums. Why: ggml's CPU
    ssm_conv walks every channel's row once per token and the time-major input is a transposed
    copy of q|k|v; on the Xeon (one thread, 512 tokens) this form takes 0.55x the conv's time
    (6,144 channels: 15.3 ms against 27.7) and 0.36x the input's (4.9 ms against 13.6).
    Returns the input (the conv slots and capture windows are cut from it) and the output
    [conv_dim, T, N]."""
    c = g.ctx
    T = ne(qkv)[1]
    d_conv = ne(conv_weight)[0]
    x = g.cb(ggml.ggml_concat(c, ggml.ggml_transpose(c, conv_states), qkv, 1), "conv_input_cm", il)
    taps = g.cb(ggml.ggml_cont(c, ggml.ggml_transpose(c, conv_weight)), "conv_taps", il)  # [conv_dim, d_conv]
    out = None
    for j in range(d_conv):
        cols = g.view(x, (ne(x)[0], T, ne(x)[2]), nb(x)[1:3], j * nb(x)[1])
        term = ggml.ggml_mul(c, cols, g.view(taps, (ne(taps)[0],), (), j * nb(taps)[1]))
        out = term if out is None else ggml.ggml_add(c, out, term)
    return x, out


def write_conv_slots(g: GraphContext, rs: RecurrentStateInput, conv_all: Tensor, conv_input: Tensor, il: int) -> None:
    """Store the last Kw conv windows into slots Kw-1..0 with ONE set_rows.

    `conv_input` is time-major, [d_conv-1 + at least Kw-1 columns, channels, n_seqs]: the whole
    conv input, or its last d_conv-1 + Kw-1 columns. The source is a view of one (d_conv-1)-wide
    window, widened to Kw windows that overlap by d_conv-2 columns (row stride one element);
    the destination is the 4D view [d_conv-1, K, channels, n_seqs] of this ubatch's cells;
    `rs_s_slot_rev` = {Kw-1..0} sends the newest window to slot 0.
    """
    hp, ub, c = g.hp, g.ub, g.ctx
    K, Kw, dc1, ch = g.mem.rs_slots, rs.kw, hp.ssm_d_conv - 1, hp.conv_dim
    N = ub.n_seqs
    f32 = 4
    src = g.view(conv_input, (dc1, 1, ch, N), (f32, nb(conv_input)[1], nb(conv_input)[2]),
                 (ne(conv_input)[0] - dc1 - (Kw - 1)) * f32)
    src.contents.ne[1] = Kw
    g.cb(src, "conv_state_windows", il)
    dst = g.view(conv_all, (dc1, K, ch, N), (dc1 * f32, K * dc1 * f32, nb(conv_all)[1]),
                 ub.seq_head * nb(conv_all)[1])
    g.expand(g.cb(ggml.ggml_set_rows(c, dst, src, rs.slot_rev), "conv_state_store", il))


def delta_rule(g: GraphContext, q, k, v, gate, beta, state, K: int, il: int) -> tuple[Tensor, Tensor]:
    """The delta rule over the tokens of q..beta (the ubatch's, or a segment of them) from `state`:
    the output [S, H, T, N] and the snapshots of the last min(T, K) states [D, N, min(T, K)]."""
    if g.ub.delta_net == "fused":
        return delta_net_fused(g, q, k, v, gate, beta, state, K)
    return delta_net_primitive(g, q, k, v, gate, beta, state, K, il)


def capture_splits(T: int, K: int, captures: tuple[int, ...]) -> list[int]:
    """The capture points the delta rule is split at: those more than K-1 tokens before the end.
    The others are states the last segment's K snapshots hold anyway (slot T - t)."""
    return [t for t in captures if t <= T - K]


def delta_rule_segments(g: GraphContext, q, k, v, gate, beta, state, K: int, il: int) -> tuple[Tensor, Tensor]:
    """The delta rule in segments ending at the ubatch's capture points (one sequence), each
    segment starting from the state the previous one ended with; each capture point's state is
    copied to its capture slot (`Memory.capture_ssm`). The recurrence is sequential anyway: the
    segments compute what one call would, and a prompt whose message boundaries must be
    checkpointed is still one graph evaluation (llama.cpp ends a ubatch there instead)."""
    c, ub = g.ctx, g.ub
    T, caps = ub.n_seq_tokens, ub.captures
    cap_all = g.mem.capture_ssm[il]                                  # [D, n_capture]
    D, row = ne(cap_all)[0], nb(cap_all)[1]

    def tokens(x: Tensor, a: int, b: int) -> Tensor:                 # tokens a..b-1 of [_, _, T, 1]
        part = g.view(x, (ne(x)[0], ne(x)[1], b - a, ne(x)[3]), nb(x)[1:], a * nb(x)[2])
        return part if ub.delta_net == "fused" else ggml.ggml_cont(c, part)   # primitive ops reshape

    def capture(i: int, snap: Tensor) -> None:                       # snap: [D, 1] state
        g.expand(g.cb(ggml.ggml_cpy(c, snap, g.view(cap_all, (D, 1), (row,), i * row)), f"ssm_capture{i}", il))

    outs = []
    a = 0
    for t in capture_splits(T, K, caps) + [T]:
        args = [tokens(x, a, t) for x in (q, k, v, gate, beta)]
        out, snaps = delta_rule(g, *args, state, K if t == T else 1, il)
        outs.append(out)
        if t < T:
            capture(caps.index(t), g.view(snaps, (D, 1), (nb(snaps)[1],), 0))
            state = ggml.ggml_reshape_4d(c, g.view(snaps, (D, 1), (nb(snaps)[1],), 0), *ne(state))
        a = t
    for t in caps:
        if t > T - K:                                                # within the last K states
            capture(caps.index(t), g.view(snaps, (D, 1), (nb(snaps)[1],), (T - t) * nb(snaps)[2]))
    return _concat(c, outs, 2), snaps


def store_conv_captures(g: GraphContext, conv_input: Tensor, channel_major: bool, il: int) -> None:
    """Copy the conv window of each capture point t (conv input columns t..t+d_conv-2, the inputs
    before token t) to slot 0 of its capture row (`Memory.capture_conv`, laid out as a cell's);
    `conv_input` is time-major, or channel-major (`conv_channel_major`: the window transposed)."""
    hp, c = g.hp, g.ctx
    dc1, ch, f32 = hp.ssm_d_conv - 1, hp.conv_dim, 4
    cap_all = g.mem.capture_conv[il]                                 # [(d_conv-1)*K*conv_dim, n_capture]
    K = g.mem.rs_slots
    for i, t in enumerate(g.ub.captures):
        if channel_major:
            src = ggml.ggml_transpose(c, g.view(conv_input, (ch, dc1), (nb(conv_input)[1],), t * nb(conv_input)[1]))
        else:
            src = g.view(conv_input, (dc1, ch), (nb(conv_input)[1],), t * f32)
        dst = g.view(cap_all, (dc1, ch), (K * dc1 * f32,), i * nb(cap_all)[1])
        g.expand(g.cb(ggml.ggml_cpy(c, src, dst), f"conv_capture{i}", il))


def delta_net_fused(g: GraphContext, q, k, v, gate, beta, state, K: int,
                    slot_stride: int = 0) -> tuple[Tensor, Tensor]:
    """ggml's fused op; returns the output [S, H, T, N] and the snapshots [D, N, min(T, K)].

    `slot_stride` (bytes between two rollback slots of the cache `state` is slot 0 of): the CPU
    kernel writes the snapshots there itself (`Memory.ssm_slots_in_place`), instead of into the
    op's output for a copy to the cache afterwards, which read and wrote K states per layer (at
    Qwen3.5-0.8B's shapes 3.5 ms of a 4-token verification step's 50); the returned snapshots are
    then the op's unused rows."""
    c = g.ctx
    S, H, T, N = ne(v)
    res = ggml.ggml_gated_delta_net(c, q, k, v, gate, beta, state, K)
    if slot_stride:
        floats = slot_stride // 4
        if not 0 < floats < 2**31:
            raise ValueError(f"rollback slots {slot_stride} bytes apart: too far for the kernel's op param")
        res.contents.op_params[1] = floats
    f32 = 4
    out = g.view(res, (S, H, T, N), (S * f32, S * H * f32, S * H * T * f32), 0)
    D = S * S * H
    snaps = g.view(res, (D, N, min(T, K)), (D * f32, D * N * f32), S * H * T * N * f32)
    return out, snaps


def delta_net_primitive(g: GraphContext, q, k, v, gate, beta, state, K: int, il: int) -> tuple[Tensor, Tensor]:
    """The delta rule from elementary ops: the one-token recurrence, or the chunked form."""
    if ne(v)[2] == 1:
        return _delta_net_step(g, q, k, v, gate, beta, state, il)
    if ne(gate)[0] != 1:
        return _delta_net_chunked_per_channel(g, q, k, v, gate, beta, state, K, il)
    return _delta_net_chunked(g, q, k, v, gate, beta, state, K, il)


def _delta_net_step(g: GraphContext, q, k, v, gate, beta, state, il: int) -> tuple[Tensor, Tensor]:
    """M <- exp(gate) M;  d = beta (v - M^T k);  M <- M + k d^T;  o = M^T q / sqrt(S)."""
    c = g.ctx
    S, H, _, N = ne(v)
    q = ggml.ggml_scale(c, ggml.ggml_reshape_4d(c, q, S, 1, H, N), 1.0 / math.sqrt(S))
    k = ggml.ggml_reshape_4d(c, k, S, 1, H, N)
    v = ggml.ggml_reshape_4d(c, v, S, 1, H, N)
    gate = ggml.ggml_reshape_4d(c, gate, ne(gate)[0], 1, H, N)   # per head, or per key channel (KDA)
    beta = ggml.ggml_reshape_4d(c, beta, 1, 1, H, N)
    m = ggml.ggml_mul(c, state, ggml.ggml_exp(c, gate))                   # [S_k, S_v, H, N]
    kv_mem = ggml.ggml_mul_mat(c, m, k)                                 # [S_v, 1, H, N]
    d = ggml.ggml_mul(c, ggml.ggml_sub(c, v, kv_mem), beta)             # [S_v, 1, H, N]
    outer = ggml.ggml_mul_mat(c, ggml.ggml_reshape_4d(c, k, 1, S, H, N),
                              ggml.ggml_reshape_4d(c, d, 1, S, H, N))  # [S_k, S_v, H, N]
    m = g.cb(ggml.ggml_add(c, m, outer), "dnet_step_state", il)
    o = ggml.ggml_mul_mat(c, m, q)                                      # [S_v, 1, H, N]
    out = ggml.ggml_reshape_4d(c, o, S, H, 1, N)
    return out, ggml.ggml_reshape_3d(c, m, S * S * H, N, 1)


def _delta_net_chunked(g: GraphContext, q, k, v, gate, beta, state, K: int, il: int) -> tuple[Tensor, Tensor]:
    """Chunked (WY) form of the gated delta rule over chunks of C tokens.

    Within a chunk with cumulative log-decay G and start state M0:
      (I + A) U = B V,  (I + A) W = B e^G K   with A[t,s] = b_t e^(G_t-G_s) k_t.k_s (s < t)
      Delta = U - W M0
      O = e^G Q M0 + (L o Q K^T) Delta        with L[t,s] = e^(G_t-G_s) (s <= t)
      M_end = e^(G_last) M0 + K^T diag(e^(G_last - G)) Delta
    Zero padding to a whole chunk adds tokens with beta = 0 and gate = 0, which change nothing.
    The chunk-by-chunk part (Delta, O, M_end) is `_chunk_recurrence`, shared with the per-channel form.
    """
    c = g.ctx
    S, H, T, N = ne(v)
    q, k, v, bc = _chunk_inputs(c, q, k, v, beta, CHUNK_SIZE)           # bc: [1, C, nc, HN]
    _, C, nc, HN = ne(v)
    gc = ggml.ggml_reshape_4d(c, _to_chunks(c, gate, C), C, nc, HN, 1)    # [C, nc, HN]

    G = g.cb(ggml.ggml_cumsum(c, gc), "dnet_g_cumsum", il)          # [C, nc, HN, 1]
    G_row = ggml.ggml_reshape_4d(c, G, 1, C, nc, HN)                   # G_t along ne1
    G_col = ggml.ggml_reshape_4d(c, G, C, 1, nc, HN)                   # G_s along ne0
    diff = ggml.ggml_sub(c, ggml.ggml_repeat_4d(c, G_row, C, C, nc, HN), G_col)   # (s, t): G_t - G_s
    L = ggml.ggml_tri(c, ggml.ggml_exp(c, diff), ggml.GGML_TRI_TYPE_LOWER_DIAG)  # s <= t
    g.cb(L, "dnet_decay", il)

    kk = ggml.ggml_mul_mat(c, k, k)                                    # (s, t): k_s . k_t
    A = ggml.ggml_tri(c, ggml.ggml_mul(c, ggml.ggml_mul(c, kk, L), bc), ggml.GGML_TRI_TYPE_LOWER)
    ident = ggml.ggml_diag(c, ggml.ggml_fill(c, ggml.ggml_view_2d(c, G, C, 1, nb(G)[1], 0), 1.0))
    lhs = g.cb(ggml.ggml_add(c, A, ident), "dnet_lhs", il)          # I + A, lower triangular
    eG = ggml.ggml_exp(c, G_row)                                       # [1, C, nc, HN]
    U = ggml.ggml_solve_tri(c, lhs, ggml.ggml_mul(c, v, bc), True, True, False)            # [S, C, nc, HN]
    W = ggml.ggml_solve_tri(c, lhs, ggml.ggml_mul(c, k, ggml.ggml_mul(c, bc, eG)), True, True, False)
    QK = ggml.ggml_mul(c, ggml.ggml_mul_mat(c, k, q), L)               # (s, t): e^(G_t-G_s) q_t . k_s
    G_last = g.view(G, (1, 1, nc, HN), (nb(G)[1], nb(G)[1], nb(G)[2]), (C - 1) * 4)
    to_end = ggml.ggml_exp(c, ggml.ggml_sub(c, ggml.ggml_repeat_4d(c, G_last, 1, C, nc, HN), G_row))
    KdT = ggml.ggml_cont(c, ggml.ggml_transpose(c, ggml.ggml_mul(c, k, to_end)))  # [C, S, nc, HN]
    eG_last = ggml.ggml_exp(c, ggml.ggml_cont(c, G_last))               # [1, 1, nc, HN]
    out, m, starts, deltas = _chunk_recurrence(g, state, U, W, q, eG, QK, KdT, eG_last, T, il)

    # snapshots: slot 0 is the final state; slot r is the state after token T-1-r
    snaps = [ggml.ggml_reshape_3d(c, m, S * S * H, N, 1)]
    for r in range(1, min(T, K)):
        t = T - 1 - r
        i, l = divmod(t, C)
        decay_row = g.view(_chunk(g, L, i), (1, C, 1, HN), (nb(L)[1] // C, nb(L)[2], nb(L)[3]), l * nb(L)[1])
        kd_t = ggml.ggml_cont(c, ggml.ggml_transpose(c, ggml.ggml_mul(c, _chunk(g, k, i), decay_row)))
        e_l = ggml.ggml_exp(c, g.view(G, (1, 1, 1, HN), (nb(G)[1], nb(G)[2], nb(G)[2]), l * 4 + i * nb(G)[1]))
        m_t = ggml.ggml_add(c, ggml.ggml_mul(c, starts[i], e_l), ggml.ggml_mul_mat(c, kd_t, deltas[i]))
        snaps.append(ggml.ggml_reshape_3d(c, m_t, S * S * H, N, 1))
    return out, _concat(c, snaps, 2)


def _delta_net_chunked_per_channel(g: GraphContext, q, k, v, gate, beta, state, K: int, il: int
                                   ) -> tuple[Tensor, Tensor]:
    """The chunked form with a decay per key channel (Kimi's KDA: gate [S, H, T, N]).

    As `_delta_net_chunked`, with G the per-channel cumulative log-decay: the pairwise decays no
    longer factor out of the dot products, so they are taken explicitly, D[s, t, i] = e^(G_t[i] -
    G_s[i]) for s <= t (never above 1), over chunks of KDA_CHUNK_SIZE tokens:
      A[t,s]  = b_t sum_i k_t[i] k_s[i] D[s,t,i] (s < t),   QK[t,s] = sum_i q_t[i] k_s[i] D[s,t,i]
      (I + A) U = B V,  (I + A) W = B (e^G o K),  Delta = U - W M0
      O = (e^G o Q) M0 + QK Delta,  M_end = e^(G_last) o M0 + (e^(G_last - G) o K)^T Delta
    The chunk-by-chunk part is `_chunk_recurrence`, as for the per-head gate; the decays above and
    the snapshots are this form's own.
    """
    c = g.ctx
    S, H, T, N = ne(v)
    q, k, v, bc = _chunk_inputs(c, q, k, v, beta, KDA_CHUNK_SIZE)       # bc: [1, C, nc, HN]
    _, C, nc, HN = ne(v)
    B = nc * HN

    def by_token(x: Tensor) -> Tensor:             # [S, C, nc, HN] -> [C, S, B]: tokens along ne0
        return ggml.ggml_reshape_3d(c, ggml.ggml_cont(c, ggml.ggml_transpose(c, ggml.ggml_reshape_3d(c, x, S, C, B))),
                                    C, S, B)

    def pairwise(x_t: Tensor, decay: Tensor) -> Tensor:
        """sum_i x_t[i] k_s[i] D[s,t,i] as [C(s), C(t), nc, HN]; x_t, k by token [C, S, B]."""
        xt = ggml.ggml_repeat_4d(c, ggml.ggml_reshape_4d(c, x_t, 1, C, S, B), C, C, S, B)
        prod = ggml.ggml_mul(c, ggml.ggml_mul(c, xt, ggml.ggml_reshape_4d(c, kc, C, 1, S, B)), decay)
        prod = ggml.ggml_cont(c, ggml.ggml_permute(c, prod, 1, 2, 0, 3))               # [S, C(s), C(t), B]
        return ggml.ggml_reshape_4d(c, ggml.ggml_sum_rows(c, prod), C, C, nc, HN)

    Gc = g.cb(ggml.ggml_cumsum(c, by_token(_to_chunks(c, gate, C))), "kda_g_cumsum", il)   # [C, S, B]
    G = ggml.ggml_reshape_4d(c, ggml.ggml_cont(c, ggml.ggml_transpose(c, Gc)), S, C, nc, HN)
    kc = by_token(k)
    diff = ggml.ggml_sub(c, ggml.ggml_repeat_4d(c, ggml.ggml_reshape_4d(c, Gc, 1, C, S, B), C, C, S, B),
                         ggml.ggml_reshape_4d(c, Gc, C, 1, S, B))              # (s, t, i): G_t - G_s
    D = g.cb(ggml.ggml_tri(c, ggml.ggml_exp(c, diff), ggml.GGML_TRI_TYPE_LOWER_DIAG), "kda_decay", il)  # s <= t

    A = ggml.ggml_tri(c, ggml.ggml_mul(c, pairwise(kc, D), bc), ggml.GGML_TRI_TYPE_LOWER)
    QK = pairwise(by_token(q), D)
    ident = ggml.ggml_diag(c, ggml.ggml_fill(c, ggml.ggml_view_2d(c, bc, C, 1, nb(bc)[2], 0), 1.0))
    lhs = g.cb(ggml.ggml_add(c, A, ident), "dnet_lhs", il)
    eG = ggml.ggml_exp(c, G)                                                  # [S, C, nc, HN]
    U = ggml.ggml_solve_tri(c, lhs, ggml.ggml_mul(c, v, bc), True, True, False)
    W = ggml.ggml_solve_tri(c, lhs, ggml.ggml_mul(c, ggml.ggml_mul(c, k, eG), bc), True, True, False)
    G_last = g.view(G, (S, 1, nc, HN), nb(G)[1:], (C - 1) * nb(G)[1])       # [S, 1, nc, HN]
    to_end = ggml.ggml_exp(c, ggml.ggml_sub(c, ggml.ggml_repeat_4d(c, G_last, S, C, nc, HN), G))
    KdT = ggml.ggml_cont(c, ggml.ggml_transpose(c, ggml.ggml_mul(c, k, to_end)))  # [C, S, nc, HN]
    eG_last = ggml.ggml_exp(c, ggml.ggml_cont(c, G_last))                        # [S, 1, nc, HN]
    qG = ggml.ggml_mul(c, q, eG)
    out, m, starts, deltas = _chunk_recurrence(g, state, U, W, qG, None, QK, KdT, eG_last, T, il)

    # snapshots: slot 0 is the final state; slot r is the state after token T-1-r:
    # M_t = e^(G_t) o M0 + (e^(G_t - G_s) o k_s)_{s <= t}^T Delta_{s <= t}
    snaps = [ggml.ggml_reshape_3d(c, m, S * S * H, N, 1)]
    for r in range(1, min(T, K)):
        t = T - 1 - r
        i, l = divmod(t, C)
        G_l = g.view(_chunk(g, G, i), (S, 1, 1, HN), nb(G)[1:], l * nb(G)[1])
        G_s = g.view(_chunk(g, G, i), (S, l + 1, 1, HN), nb(G)[1:], 0)
        k_s = g.view(_chunk(g, k, i), (S, l + 1, 1, HN), nb(k)[1:], 0)
        decay = ggml.ggml_exp(c, ggml.ggml_sub(c, ggml.ggml_repeat_4d(c, G_l, S, l + 1, 1, HN), G_s))
        kd_t = ggml.ggml_cont(c, ggml.ggml_transpose(c, ggml.ggml_mul(c, k_s, decay)))   # [l+1, S]
        d_s = g.view(deltas[i], (l + 1, S, 1, HN), nb(deltas[i])[1:], 0)
        m_t = ggml.ggml_add(c, ggml.ggml_mul(c, starts[i], ggml.ggml_exp(c, ggml.ggml_cont(c, G_l))),
                            ggml.ggml_mul_mat(c, kd_t, ggml.ggml_cont(c, d_s)))
        snaps.append(ggml.ggml_reshape_3d(c, m_t, S * S * H, N, 1))
    return out, _concat(c, snaps, 2)


def _to_chunks(c, x: Tensor, C: int) -> Tensor:
    """[width, H, T, N] -> [width, C, nc, H*N]: the tokens in nc chunks of C, the last one
    zero-padded (a padded token has beta = 0 and gate = 0, so it changes nothing)."""
    width, H, T, N = ne(x)
    pad = (C - T % C) % C
    x = ggml.ggml_cont(c, ggml.ggml_permute(c, x, 0, 2, 1, 3))         # [width, T, H, N]
    if pad:
        x = ggml.ggml_pad(c, x, 0, pad, 0, 0)
    return ggml.ggml_reshape_4d(c, x, width, C, (T + pad) // C, H * N)


def _chunk_inputs(c, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, C: int
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """q (scaled by 1/sqrt(S)), k, v and beta of either chunked form, in chunks of C tokens."""
    q = _to_chunks(c, ggml.ggml_scale(c, q, 1.0 / math.sqrt(ne(q)[0])), C)
    return q, _to_chunks(c, k, C), _to_chunks(c, v, C), _to_chunks(c, beta, C)


def _chunk(g: GraphContext, t: Tensor, i: int) -> Tensor:
    """Chunk i of a chunked tensor [_, _, nc, HN]: [_, _, 1, HN]."""
    return g.view(t, (ne(t)[0], ne(t)[1], 1, ne(t)[3]), nb(t)[1:], i * nb(t)[2])


def _chunk_recurrence(g: GraphContext, state: Tensor, U: Tensor, W: Tensor, q: Tensor, q_decay: Tensor | None,
                      QK: Tensor, KdT: Tensor, eG_last: Tensor, T: int, il: int
                      ) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor]]:
    """The chunked form's sequential part, whatever the gate's shape: chunk by chunk from M0 =
    `state` ([S, S, H, N], (k, v) per head),
      Delta = U - W M0,   O = (Q M0) [o e^G] + QK Delta,   M_end = e^(G_last) o M0 + KdT Delta
    with the decays already in U, W, QK, KdT and `eG_last`, and in `q` too where they act on key
    channels (the per-channel form passes e^G o Q and no `q_decay`); a per-head decay multiplies
    Q M0's rows instead (`q_decay` = e^G [1, C, nc, HN]). All chunked ([_, C, nc, HN]).
    Returns the output [S, H, T, N] (T: the tokens before padding), the final state, and per
    chunk its start state and Delta^T [C, S_v], from which the snapshots are made."""
    c = g.ctx
    S, _, nc, HN = ne(U)
    H, N = ne(state)[2], ne(state)[3]
    m = ggml.ggml_reshape_4d(c, state, S, S, 1, HN)                     # (k, v) per head
    outs, starts, deltas = [], [], []
    for i in range(nc):
        starts.append(m)
        delta = ggml.ggml_sub(c, _chunk(g, U, i), ggml.ggml_mul_mat(c, m, _chunk(g, W, i)))    # [S_v, C]
        delta_t = ggml.ggml_cont(c, ggml.ggml_transpose(c, delta))                          # [C, S_v]
        deltas.append(delta_t)
        inter = ggml.ggml_mul_mat(c, m, _chunk(g, q, i))
        if q_decay is not None:
            inter = ggml.ggml_mul(c, inter, _chunk(g, q_decay, i))
        intra = ggml.ggml_mul_mat(c, delta_t, _chunk(g, QK, i))
        outs.append(ggml.ggml_add(c, inter, intra))                                         # [S_v, C]
        m = ggml.ggml_add(c, ggml.ggml_mul(c, m, _chunk(g, eG_last, i)),
                          ggml.ggml_mul_mat(c, _chunk(g, KdT, i), delta_t))
        g.cb(m, f"dnet_chunk{i}_state", il)
    o = _concat(c, outs, 2)                                                                 # [S_v, C, nc, HN]
    o = g.view(o, (S, T, H, N), (nb(o)[1], nb(o)[2] * nc, nb(o)[2] * nc * H), 0)
    return ggml.ggml_cont(c, ggml.ggml_permute(c, o, 0, 2, 1, 3)), m, starts, deltas         # [S, H, T, N]


def _concat(c, parts: list[Tensor], dim: int) -> Tensor:
    """The tensors one after another along `dim` (left to right, as ggml_concat pairs them)."""
    out = parts[0]
    for part in parts[1:]:
        out = ggml.ggml_concat(c, out, part, dim)
    return out
