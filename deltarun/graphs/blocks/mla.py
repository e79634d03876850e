"""Multi-head Latent Attention (DeepSeek's MLA) as Kimi-Linear runs it: no rope, KV cache of latents.

The cache keeps what llama.cpp keeps: one row per token, [c | k_pe] (kv_lora_rank + rope dims,
`attention.key_length`), where c is the normalised compressed KV, and nothing else. deltarun's
Memory gives every attention layer a K and a V cache of equal width (`HParams.head_dim` x
`n_head_kv`), V laid out a row per channel across the cells; MLA has one row per token, so the
family sets that width to half the row and the row is split: its first half goes to the K cache,
its second half to the V cache (per token: kv_lora_rank + rope elements in all, as llama.cpp,
which keeps the row in K and no V for MLA). Attention runs absorbed (llama.cpp's `build_attn`
with `v_mla`): each head's q_nope goes through `attn_k_b` into the latent space, the scores are
[q_abs | q_pe] . [c | k_pe] summed over the two halves, the values are the rows' c (read from
both halves), and `attn_v_b` lifts each head's result to its value dims before `attn_output`.
Kimi applies no rotation to the "rope" dims (NoPE), so no positions are read. The scale is
1/sqrt(key_length_mla).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from deltarun.base.ggml_util import Tensor, ggml, nb
from deltarun.base.interface import HParams
from deltarun.graphs.blocks.attention import kv_input
from deltarun.graphs.blocks.base import GraphContext

Spec = dict[str, tuple[tuple[int, ...], bool]]


@dataclass(frozen=True)
class MlaShape:
    """MLA's head sizes (`attention.kv_lora_rank`, `key_length_mla`, `value_length_mla`,
    `rope.dimension_count`)."""

    kv_lora_rank: int
    key_length: int     # per head: nope + rope
    value_length: int
    n_rope: int

    @property
    def n_nope(self) -> int:
        return self.key_length - self.n_rope

    @property
    def row_width(self) -> int:
        """Elements cached per token: the latent and the shared rope key."""
        return self.kv_lora_rank + self.n_rope


def tensors(hp: HParams, p: str, s: MlaShape) -> Spec:
    """The weights of one MLA mixer (prefix `blk.N.`), query uncompressed (Kimi's q_lora_rank = None)."""
    E, H = hp.n_embd, hp.n_head
    return {
        p + "attn_q.weight": ((E, H * s.key_length), True),
        p + "attn_kv_a_mqa.weight": ((E, s.kv_lora_rank + s.n_rope), True),
        p + "attn_kv_a_norm.weight": ((s.kv_lora_rank,), True),
        p + "attn_k_b.weight": ((s.n_nope, s.kv_lora_rank, H), True),
        p + "attn_v_b.weight": ((s.kv_lora_rank, s.value_length, H), True),
        p + "attn_output.weight": ((H * s.value_length, E), True),
    }


def mla(g: GraphContext, cur: Tensor, il: int, s: MlaShape) -> Tensor:
    hp, ub, c, w = g.hp, g.ub, g.ctx, g.w
    p = f"blk.{il}."
    H, lora, rope, nope = hp.n_head, s.kv_lora_rank, s.n_rope, s.n_nope
    T, N, n_tokens = ub.n_seq_tokens, ub.n_seqs, ub.n_tokens
    width, half = s.row_width, s.row_width // 2
    kv = kv_input(g)

    q = g.cb(ggml.ggml_reshape_3d(c, g.mm(w[p + "attn_q.weight"], cur), s.key_length, H, n_tokens), "q", il)
    esz = ggml.ggml_element_size(q)
    q_nope = g.view(q, (nope, H, n_tokens), nb(q)[1:], 0)
    q_pe = g.cb(g.view(q, (rope, H, n_tokens), nb(q)[1:], nope * esz), "q_pe", il)
    q_abs = ggml.ggml_mul_mat(c, w[p + "attn_k_b.weight"], ggml.ggml_permute(c, q_nope, 0, 2, 1, 3))  # [lora, n, H]
    q_abs = g.cb(ggml.ggml_permute(c, q_abs, 0, 2, 1, 3), "q_nope_absorbed", il)                      # [lora, H, n]
    q = g.cb(ggml.ggml_concat(c, q_abs, q_pe, 0), "Qcur", il)                                         # [width, H, n]

    kv_pe = g.mm(w[p + "attn_kv_a_mqa.weight"], cur)                                                  # [width, n]
    latent = g.view(kv_pe, (lora, n_tokens), (nb(kv_pe)[1],), 0)
    k_pe = g.view(kv_pe, (rope, n_tokens), (nb(kv_pe)[1],), lora * esz)
    latent = g.rms_norm(latent, w[p + "attn_kv_a_norm.weight"], "kv_cmpr", il)
    row = g.cb(ggml.ggml_concat(c, latent, k_pe, 0), "Kcur", il)                                    # [width, n]

    # the row's first half to the K cache (a row per cell), its second half to the V cache (one row
    # per channel across the cells, as Memory lays V out)
    k_cache, v_cache = g.mem.k[il], g.mem.v[il]
    k_half = ggml.ggml_cont(c, g.view(row, (half, n_tokens), (nb(row)[1],), 0))
    k_store = g.cb(ggml.ggml_set_rows(c, k_cache, k_half, kv.kv_idxs), "k_cache_store", il)
    v_half = ggml.ggml_cont(c, g.view(row, (half, n_tokens), (nb(row)[1],), half * esz))
    v_rows = ggml.ggml_reshape_2d(c, v_cache, 1, ggml.ggml_nelements(v_cache))
    v_store = g.cb(ggml.ggml_set_rows(c, v_rows, ggml.ggml_reshape_2d(c, v_half, 1, half * n_tokens), kv.v_idxs),
                   "v_cache_store", il)

    n_kv, n_ctx = ub.n_kv, g.mem.n_ctx
    row_k = nb(k_cache)[1]
    row_v = n_ctx * ggml.ggml_element_size(v_cache)
    k_view = g.cb(g.view(k_store, (half, n_kv, 1, N), (row_k, n_ctx * row_k, n_ctx * row_k),
                         ub.seq_head * n_ctx * row_k), "k_view", il)                               # [half, n_kv, 1, N]
    v_view = g.cb(g.view(v_store, (n_kv, half, 1, N), (row_v, half * row_v, half * row_v),
                         ub.seq_head * half * row_v), "v_view", il)                                # [n_kv, half, 1, N]

    # every head reads the same cached rows (one KV head): the heads' queries are the columns of
    # one product per sequence ([.., T*H, 1, N]), so a decoding step reads the cache once, not once
    # per head as a product broadcast over H does (at 4096 cached tokens that read was most of
    # the layer's time)
    q = ggml.ggml_cont(c, ggml.ggml_permute(c, ggml.ggml_reshape_4d(c, q, width, H, T, N), 0, 2, 1, 3))  # [width, T, H, N]
    cols = (nb(q)[1], nb(q)[1] * T * H, nb(q)[3])
    q_first = g.view(q, (half, T * H, 1, N), cols, 0)
    q_second = g.view(q, (half, T * H, 1, N), cols, half * esz)
    kq = ggml.ggml_add(c, ggml.ggml_mul_mat(c, k_view, q_first),
                       ggml.ggml_mul_mat(c, ggml.ggml_cont(c, ggml.ggml_transpose(c, v_view)), q_second))
    kq = g.cb(ggml.ggml_reshape_4d(c, kq, n_kv, T, H, N), "kq", il)                                 # [n_kv, T, H, N]
    kq = g.cb(ggml.ggml_soft_max_ext(c, kq, kv.kq_mask, 1.0 / math.sqrt(s.key_length), 0.0), "kq_soft_max", il)
    # the values are the rows' latent c: the K half, and the V half's first lora - half channels
    kq = ggml.ggml_reshape_4d(c, kq, n_kv, T * H, 1, N)
    latent_first = ggml.ggml_cont(c, ggml.ggml_transpose(c, k_view))                                # [n_kv, half, 1, N]
    latent_second = g.view(v_view, (n_kv, lora - half, 1, N), nb(v_view)[1:], 0)
    kqv = ggml.ggml_concat(c, ggml.ggml_mul_mat(c, latent_first, kq), ggml.ggml_mul_mat(c, latent_second, kq), 0)
    kqv = g.cb(ggml.ggml_reshape_4d(c, kqv, lora, T, H, N), "kqv", il)                              # [lora, T, H, N]
    kqv = ggml.ggml_mul_mat(c, w[p + "attn_v_b.weight"],
                            ggml.ggml_reshape_3d(c, ggml.ggml_cont(c, ggml.ggml_permute(c, kqv, 0, 1, 3, 2)),
                                                 lora, T * N, H))                                   # [v, T*N, H]
    out = ggml.ggml_cont_2d(c, ggml.ggml_permute(c, kqv, 0, 2, 1, 3), s.value_length * H, n_tokens)
    g.cb(out, "kqv_out", il)
    return g.cb(g.mm(w[p + "attn_output.weight"], out), "mla_out", il)
