"""Multi-head Latent Attention (DeepSeek's MLA) as Kimi-Linear runs it: no rope, KV cache of latents.

The cache keeps what llama.cpp keeps: one row per token, [c | k_pe] (kv_lora_rank + rope dims,
`attention.key_length`, `head_count_kv` = 1), where c is the normalised compressed KV. Attention
runs absorbed (llama.cpp's `build_attn` with `v_mla`): each head's q_nope goes through `attn_k_b`
into the latent space, scores are [q_abs | q_pe] . [c | k_pe] against the cached rows, the values
are the rows' c (a view of the same cache: nothing else is stored), and `attn_v_b` lifts each
head's result back to its value dims before `attn_output`. Kimi applies no rotation to the
"rope" dims (NoPE), so no positions are read. The scale is 1/sqrt(key_length_mla).
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
    width = lora + rope
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
    k_row = g.cb(ggml.ggml_concat(c, latent, k_pe, 0), "Kcur", il)                                  # [width, n]

    k_cache = g.mem.k[il]
    k_store = g.cb(ggml.ggml_set_rows(c, k_cache, k_row, kv.kv_idxs), "k_cache_store", il)
    n_kv, n_ctx = ub.n_kv, g.mem.n_ctx
    row = nb(k_cache)[1]
    k_view = g.cb(g.view(k_store, (width, n_kv, 1, N), (row, n_ctx * row, n_ctx * row), ub.seq_head * n_ctx * row),
                  "k_view", il)                                                                      # [width, n_kv, 1, N]
    v_view = g.view(k_store, (lora, n_kv, 1, N), (row, n_ctx * row, n_ctx * row), ub.seq_head * n_ctx * row)
    v_t = g.cb(ggml.ggml_cont(c, ggml.ggml_transpose(c, v_view)), "v_view", il)                     # [n_kv, lora, 1, N]

    q = ggml.ggml_permute(c, ggml.ggml_reshape_4d(c, q, width, H, T, N), 0, 2, 1, 3)                # [width, T, H, N]
    kq = g.cb(ggml.ggml_mul_mat(c, k_view, q), "kq", il)                                             # [n_kv, T, H, N]
    kq = g.cb(ggml.ggml_soft_max_ext(c, kq, kv.kq_mask, 1.0 / math.sqrt(s.key_length), 0.0), "kq_soft_max", il)
    kqv = g.cb(ggml.ggml_mul_mat(c, v_t, kq), "kqv", il)                                             # [lora, T, H, N]
    kqv = ggml.ggml_mul_mat(c, w[p + "attn_v_b.weight"],
                            ggml.ggml_reshape_3d(c, ggml.ggml_cont(c, ggml.ggml_permute(c, kqv, 0, 1, 3, 2)),
                                                 lora, T * N, H))                                   # [v, T*N, H]
    out = ggml.ggml_cont_2d(c, ggml.ggml_permute(c, kqv, 0, 2, 1, 3), s.value_length * H, n_tokens)
    g.cb(out, "kqv_out", il)
    return g.cb(g.mm(w[p + "attn_output.weight"], out), "mla_out", il)
