"""Gated full attention over the KV cache (qwen3next / qwen35 style), and its graph inputs.

Q projection holds query and gate per head; q and k get RMSNorm per head, then rope: NEOX
through `ggml_rope_ext`, or, when the model has `rope.dimension_sections`, interleaved
multi-section rope (IMRoPE) through `ggml_rope_multi` with 4 positions per token, as llama.cpp
builds qwen35. K rows and V elements of the ubatch are written into the cache with set_rows (V
stored transposed, see Memory); attention reads views of the stored tensors; a sigmoid gate
scales the output before the output projection.
"""

from __future__ import annotations

import math

from deltarun.base.ggml_util import Tensor, c_array, ctypes, ggml, nb, ne
from deltarun.base.interface import HParams
from deltarun.graphs.blocks.base import GraphContext
from deltarun.graphs.inputs import AttentionKVInput, OutputIdsInput, PositionsInput

Spec = dict[str, tuple[tuple[int, ...], bool]]


def tensors(hp: HParams, p: str) -> Spec:
    """The weights of one full-attention mixer (prefix `blk.N.`)."""
    E, hd = hp.n_embd, hp.head_dim
    return {
        p + "attn_q.weight": ((E, 2 * hd * hp.n_head), True),
        p + "attn_k.weight": ((E, hd * hp.n_head_kv), True),
        p + "attn_v.weight": ((E, hd * hp.n_head_kv), True),
        p + "attn_output.weight": ((hd * hp.n_head, E), True),
        p + "attn_q_norm.weight": ((hd,), True),
        p + "attn_k_norm.weight": ((hd,), True),
    }


def positions(g: GraphContext) -> PositionsInput:
    per_token = 4 if g.hp.rope_sections else 1
    return g.input(PositionsInput, lambda: PositionsInput(g.ctx, g.ub, per_token))


def output_ids(g: GraphContext) -> OutputIdsInput | None:
    """The rows whose logits are asked for, when not every row is."""
    if g.ub.n_outputs == g.ub.n_tokens:
        return None
    return g.input(OutputIdsInput, lambda: OutputIdsInput(g.ctx, g.ub))


def output_rows(g: GraphContext, x: Tensor) -> Tensor:
    """The rows of x [width, rows] whose outputs are asked for: the ubatch's last n_outputs /
    n_seqs of each sequence, then a riding chunk's rows where it asks for their hidden states,
    else its last row where it asks for its logits."""
    whole = x
    if g.ride is not None:
        x = g.view(whole, (ne(whole)[0], g.ub.n_tokens), (nb(whole)[1],), 0)
    rows = output_ids(g)
    x = x if rows is None else ggml.ggml_get_rows(g.ctx, x, rows.out_ids)
    ride = g.ub.ride
    if ride is not None and (ride.hidden or ride.logits):
        n = ride.n_tokens if ride.hidden else 1
        tail = g.view(whole, (ne(whole)[0], n), (nb(whole)[1],), (g.ub.n_rows - n) * nb(whole)[1])
        x = ggml.ggml_concat(g.ctx, x, tail, 1)
    return x


def kv_input(g: GraphContext) -> AttentionKVInput:
    width = g.hp.head_dim * g.hp.n_head_kv
    return g.input(AttentionKVInput, lambda: AttentionKVInput(g.ctx, g.ub, width, g.mem.n_ctx))


def rope(g: GraphContext, x: Tensor, pos: Tensor | None = None) -> Tensor:
    """The model's rope on x [dims, heads, n]: at the ubatch's token positions, or at `pos` (an
    input laid out the same way: qwen4exp's indexer ropes its block keys at their first token)."""
    hp = g.hp
    pos = positions(g).pos if pos is None else pos
    if hp.rope_sections:
        sections = c_array(ctypes.c_int, list(hp.rope_sections))
        return ggml.ggml_rope_multi(g.ctx, x, pos, None, hp.n_rot, sections, ggml.GGML_ROPE_TYPE_IMROPE,
                                    hp.n_ctx_train, hp.rope_freq_base, 1.0, 0.0, 1.0, 32.0, 1.0)
    return ggml.ggml_rope_ext(g.ctx, x, pos, None, hp.n_rot, ggml.GGML_ROPE_TYPE_NEOX, hp.n_ctx_train,
                              hp.rope_freq_base, 1.0, 0.0, 1.0, 32.0, 1.0)


def full_attention(g: GraphContext, cur: Tensor, il: int) -> Tensor:
    """Products on all rows; rope, the cache and attention per part (`GraphContext.per_part`)."""
    q, k, v, gate = project_rows(g, cur, il)

    def part(p: GraphContext, take) -> Tensor:
        qp, kp = p.cb(rope(p, take(q, 2)), "Qcur", il), p.cb(rope(p, take(k, 2)), "Kcur", il)
        k_row = ggml.ggml_reshape_2d(p.ctx, kp, p.hp.head_dim * p.hp.n_head_kv, p.ub.n_tokens)
        k_view, v_view, _ = store(p, k_row, take(v, 1), il)
        return attend_rows(p, qp, k_view, v_view, kv_input(p).kq_mask, il)

    return gate_output(g, g.per_part(part, dim=1, split=False), gate, il)


def project(g: GraphContext, cur: Tensor, il: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """`project_rows` with q and k roped at the ubatch's positions."""
    q, k, v, gate = project_rows(g, cur, il)
    return g.cb(rope(g, q), "Qcur", il), g.cb(rope(g, k), "Kcur", il), v, gate


def project_rows(g: GraphContext, cur: Tensor, il: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Normed q [hd, nh, n_tokens] and k [hd, nkv, n_tokens] (not roped), v [hd * nkv, n_tokens]
    and the gate (a view of the query projection: per head hd query rows, then hd gate rows), for
    every row of the graph (`GraphContext.grid`)."""
    hp, c, w = g.hp, g.ctx, g.w
    p = f"blk.{il}."
    hd, nh, nkv = hp.head_dim, hp.n_head, hp.n_head_kv
    n_tokens = g.grid[0] * g.grid[1]

    qg = g.cb(g.mm(w[p + "attn_q.weight"], cur), "Qcur_full", il)
    qg = ggml.ggml_reshape_4d(c, qg, hd * 2, nh, n_tokens, 1)
    q = g.view(qg, (hd, nh, n_tokens, 1), nb(qg)[1:], 0)
    gate = g.cb(g.view(qg, (hd, nh, n_tokens, 1), nb(qg)[1:], hd * ggml.ggml_element_size(qg)), "gate", il)
    k = ggml.ggml_reshape_3d(c, g.mm(w[p + "attn_k.weight"], cur), hd, nkv, n_tokens)
    v = g.cb(g.mm(w[p + "attn_v.weight"], cur), "Vcur", il)

    q = g.rms_norm(q, w[p + "attn_q_norm.weight"], "Qcur_normed", il)
    k = g.rms_norm(k, w[p + "attn_k_norm.weight"], "Kcur_normed", il)
    return ggml.ggml_reshape_3d(c, q, hd, nh, n_tokens), k, v, gate


def store(g: GraphContext, k_row: Tensor, v: Tensor, il: int) -> tuple[Tensor, Tensor, Tensor]:
    """Write this ubatch's K rows [K-cache row width, n_tokens] and V elements into the cache (V
    transposed, see Memory); returns views of the stored keys [hd, n_kv, nkv, N] and values
    [n_kv, hd, nkv, N] (later reads go through them), and the stored K tensor itself."""
    hp, ub, c = g.hp, g.ub, g.ctx
    hd, nkv = hp.head_dim, hp.n_head_kv
    N, n_tokens = ub.n_seqs, ub.n_tokens
    kv = kv_input(g)
    k_cache, v_cache = g.mem.k[il], g.mem.v[il]
    width = hd * nkv
    k_store = g.cb(ggml.ggml_set_rows(c, k_cache, k_row, kv.kv_idxs), "k_cache_store", il)
    v_rows = ggml.ggml_reshape_2d(c, v_cache, 1, ggml.ggml_nelements(v_cache))
    v_store = g.cb(ggml.ggml_set_rows(c, v_rows, ggml.ggml_reshape_2d(c, v, 1, width * n_tokens), kv.v_idxs),
                   "v_cache_store", il)

    n_kv, n_ctx = ub.n_kv, g.mem.n_ctx
    row_k, esz_k = nb(k_cache)[1], ggml.ggml_element_size(k_cache)
    row_v = n_ctx * ggml.ggml_element_size(v_cache)
    k_view = g.cb(g.view(k_store, (hd, n_kv, nkv, N), (row_k, hd * esz_k, n_ctx * row_k),
                         ub.seq_head * n_ctx * row_k), "k_view", il)
    v_view = g.cb(g.view(v_store, (n_kv, hd, nkv, N), (row_v, hd * row_v, width * row_v),
                         ub.seq_head * width * row_v), "v_view", il)                # [n_kv, hd, nkv, N]
    return k_view, v_view, k_store


def attend(g: GraphContext, q: Tensor, k_view: Tensor, v_view: Tensor, mask: Tensor, gate: Tensor, il: int) -> Tensor:
    """softmax(k q / sqrt(hd) + mask) v, times sigmoid(gate), through the output projection."""
    return gate_output(g, attend_rows(g, q, k_view, v_view, mask, il), gate, il)


def attend_rows(g: GraphContext, q: Tensor, k_view: Tensor, v_view: Tensor, mask: Tensor, il: int) -> Tensor:
    """softmax(k q / sqrt(hd) + mask) v of the ubatch's queries, [hd * nh, n_tokens]."""
    hp, ub, c = g.hp, g.ub, g.ctx
    hd, nh = hp.head_dim, hp.n_head
    T, N, n_tokens = ub.n_seq_tokens, ub.n_seqs, ub.n_tokens
    # the r = nh / nkv query heads that share a KV head (consecutive, as ggml broadcasts) are the
    # columns of one product per KV head ([.., T*r, nkv, N]): a decoding step reads each cached
    # head once, not once per query head as a product broadcast over the heads does
    nkv = ne(k_view)[2]
    r = nh // nkv
    q = ggml.ggml_cont(c, ggml.ggml_permute(c, ggml.ggml_reshape_4d(c, q, hd, nh, T, N), 0, 2, 1, 3))  # [hd, T, nh, N]
    kq = g.cb(ggml.ggml_mul_mat(c, k_view, ggml.ggml_reshape_4d(c, q, hd, T * r, nkv, N)), "kq", il)
    kq = ggml.ggml_reshape_4d(c, kq, ne(kq)[0], T, nh, N)                          # [n_kv, T, nh, N]
    kq = g.cb(ggml.ggml_soft_max_ext(c, kq, mask, 1.0 / math.sqrt(hd), 0.0), "kq_soft_max", il)
    kqv = g.cb(ggml.ggml_mul_mat(c, v_view, ggml.ggml_reshape_4d(c, kq, ne(kq)[0], T * r, nkv, N)), "kqv", il)
    kqv = ggml.ggml_reshape_4d(c, kqv, hd, T, nh, N)                               # [hd, T, nh, N]
    out = ggml.ggml_cont_2d(c, ggml.ggml_permute(c, kqv, 0, 2, 1, 3), hd * nh, n_tokens)
    return g.cb(out, "attn_pregate", il)


def gate_output(g: GraphContext, out: Tensor, gate: Tensor, il: int) -> Tensor:
    """The attention rows [hd * nh, n] times sigmoid(gate), through the output projection."""
    c = g.ctx
    gate = ggml.ggml_sigmoid(c, ggml.ggml_cont_2d(c, gate, ne(out)[0], ne(out)[1]))
    out = g.cb(ggml.ggml_mul(c, out, gate), "attn_gated", il)
    return g.cb(g.mm(g.w[f"blk.{il}.attn_output.weight"], out), "attn_output", il)
