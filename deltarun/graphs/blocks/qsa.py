"""Qwen Sparse Attention (qwen4exp's full-attention layers): gated attention over the tokens a
lightning indexer selects (transformers' `Qwen4ExpTextQSAIndexer`, docs/qwen4exp-gguf.md).

The indexer projects the block input to n_i query heads and one key of D dims per token. The raw
key (no norm, no rope) is cached per position after the attention heads' keys in the layer's K-cache
row (`HParams.k_row_extra`), so it is kept, copied and rolled back exactly as K is. For a query at
position p, the complete blocks j of r tokens ((j + 1) r <= p + 1) get a key: the mean of the
block's raw keys, RMS-normed, roped at position j r; a block scores sum over heads of
relu(q . k_j) / sqrt(D); attention then sees the tokens of the best min(B / r, blocks) blocks plus
the incomplete tail r floor((p + 1) / r) .. p. While the complete blocks fit the budget that is
every token (dense causal attention).

In the graph: the scores of all n_kv // r blocks at once, the incomplete ones pushed to -1e30
(`qsa_blk_complete`), `ggml_top_k`, the chosen blocks scattered to ones with `ggml_set_rows`,
masked by completeness again (top-k fills up with incomplete blocks when there are fewer complete
ones than the budget), spread over their r tokens, plus the tail (`qsa_tail`): a 0/1 row per query
that becomes the attention mask (0 / -1e30, so masked tokens get exactly zero weight).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltarun.base.ggml_util import Tensor, ggml, nb
from deltarun.base.interface import HParams, UbatchData, UbatchShape
from deltarun.graphs.blocks import attention
from deltarun.graphs.blocks.base import GraphContext
from deltarun.graphs.inputs import GraphInput

Spec = dict[str, tuple[tuple[int, ...], bool]]
#: what masked scores and tokens get: far below any score, finite (a product with 0 stays 0)
MASKED = 1e30


@dataclass(frozen=True)
class QsaShape:
    """The indexer's sizes (`attention.indexer.*`); the block length r is per layer (`compress_ratios`)."""

    n_heads: int
    key_length: int
    budget: int        # tokens (`attention.indexer.top_k`): budget / ratio blocks


def tensors(hp: HParams, p: str, s: QsaShape) -> Spec:
    """Gated attention's weights plus the indexer's (prefix `blk.N.`)."""
    E, D = hp.n_embd, s.key_length
    t = attention.tensors(hp, p)
    t.update({p + "indexer.q_proj.weight": ((E, s.n_heads * D), True), p + "indexer.k_proj.weight": ((E, D), True),
              p + "indexer.q_norm.weight": ((D,), True), p + "indexer.k_norm.weight": ((D,), True)})
    return t


class QsaInput(GraphInput):
    """Per query, which of the n_kv // r blocks are complete (`qsa_blk_complete` [n_blocks, T, N]),
    which tokens form its incomplete tail (`qsa_tail` [n_kv, T, N]), and the blocks' rope positions
    (`qsa_blk_pos`: j r, laid out as the token positions; the same in every sequence). One block
    length r per model (the family checks `compress_ratios`)."""

    def __init__(self, ctx: Any, ub: UbatchShape, ratio: int, n_pos_per_token: int):
        super().__init__()
        self.ratio, self.per_token = ratio, n_pos_per_token
        self.n_blocks = ub.n_kv // ratio
        T, N, n = ub.n_seq_tokens, ub.n_seqs, max(self.n_blocks, 1)
        self.complete = self.new(ctx, "qsa_blk_complete", ggml.GGML_TYPE_F32, n, T, N)
        self.tail = self.new(ctx, "qsa_tail", ggml.GGML_TYPE_F32, ub.n_kv, T, N)
        self.blk_pos = self.new(ctx, "qsa_blk_pos", ggml.GGML_TYPE_I32, n * N * n_pos_per_token)

    def prepare(self, shape: UbatchShape) -> None:
        self.block_ends = (np.arange(max(self.n_blocks, 1)) + 1) * self.ratio
        self.cols = np.arange(shape.n_kv)
        pos = self.host.get("qsa_blk_pos")
        if pos is not None:    # text: the position streams (IMRoPE blocks 0-2) hold j r, block 3 stays 0
            starts = np.tile(self.block_ends - self.ratio, shape.n_seqs)
            pos.reshape(self.per_token, -1)[:min(3, self.per_token)] = starts

    def set_input(self, data: UbatchData) -> None:
        last = data.pos[:, :, None]                                    # [N, T, 1]
        first_open = (last + 1) // self.ratio * self.ratio             # where the incomplete tail starts
        complete = self.host.get("qsa_blk_complete")
        if complete is not None:
            complete[...] = self.block_ends <= first_open
        tail = self.host.get("qsa_tail")
        if tail is not None:
            tail[...] = (self.cols >= first_open) & (self.cols <= last)


def qsa_input(g: GraphContext, ratio: int) -> QsaInput:
    per_token = 4 if g.hp.rope_sections else 1
    return g.input(QsaInput, lambda: QsaInput(g.ctx, g.ub, ratio, per_token))


def selection_mask(g: GraphContext, cur: Tensor, k_store: Tensor, il: int, s: QsaShape, ratio: int) -> Tensor:
    """The attention mask [n_kv, T, 1, N] (0 / -1e30) of the tokens the indexer selects; `k_store`
    is the layer's K cache after this ubatch's rows (indexer keys after the heads' keys)."""
    hp, ub, c, w = g.hp, g.ub, g.ctx, g.w
    p = f"blk.{il}.indexer."
    T, N, n_kv, D, r = ub.n_seq_tokens, ub.n_seqs, ub.n_kv, s.key_length, ratio
    inp = qsa_input(g, ratio)
    n_blocks = inp.n_blocks
    tokens = inp.tail
    if n_blocks:
        row, n_ctx = nb(k_store)[1], g.mem.n_ctx
        base = ub.seq_head * n_ctx * row + hp.head_dim * hp.n_head_kv * ggml.ggml_element_size(k_store)
        pooled = None
        for i in range(r):                          # the mean of each block's raw keys
            member = ggml.ggml_cast(c, g.view(k_store, (D, n_blocks, N), (r * row, n_ctx * row), base + i * row),
                                    ggml.GGML_TYPE_F32)
            pooled = member if pooled is None else ggml.ggml_add(c, pooled, member)
        pooled = g.rms_norm(ggml.ggml_scale(c, pooled, 1.0 / r), w[p + "k_norm.weight"], "indexer_k_pooled", il)
        keys = attention.rope(g, ggml.ggml_reshape_3d(c, pooled, D, 1, n_blocks * N), inp.blk_pos)
        keys = g.cb(ggml.ggml_reshape_3d(c, keys, D, n_blocks, N), "indexer_k", il)

        q = ggml.ggml_reshape_3d(c, g.mm(w[p + "q_proj.weight"], cur), D, s.n_heads, T * N)
        q = attention.rope(g, g.rms_norm(q, w[p + "q_norm.weight"], "indexer_q_normed", il))
        q = g.cb(ggml.ggml_reshape_3d(c, q, D, s.n_heads * T, N), "indexer_q", il)
        score = ggml.ggml_relu(c, ggml.ggml_mul_mat(c, keys, q))                  # [n_blocks, n_i * T, N]
        score = ggml.ggml_permute(c, ggml.ggml_reshape_4d(c, score, n_blocks, s.n_heads, T, N), 1, 0, 2, 3)
        score = ggml.ggml_sum_rows(c, ggml.ggml_cont(c, score))                   # [1, n_blocks, T, N]
        score = ggml.ggml_reshape_3d(c, ggml.ggml_scale(c, score, 1.0 / math.sqrt(D)), n_blocks, T, N)
        complete = inp.complete
        score = g.cb(ggml.ggml_add(c, score, ggml.ggml_scale_bias(c, complete, MASKED, -MASKED)), "indexer_score", il)

        k = min(s.budget // r, n_blocks)
        top = g.cb(ggml.ggml_top_k(c, score, k), "indexer_top_k", il)            # [k, T, N]
        score4 = ggml.ggml_reshape_4d(c, score, 1, n_blocks, T, N)
        ones = ggml.ggml_fill(c, ggml.ggml_cont(c, g.view(score4, (1, k, T, N), nb(score4)[1:], 0)), 1.0)
        chosen = ggml.ggml_set_rows(c, ggml.ggml_fill(c, score4, 0.0), ones, top)  # 1 on the chosen blocks
        chosen = ggml.ggml_mul(c, ggml.ggml_reshape_3d(c, chosen, n_blocks, T, N), complete)
        spread = ggml.ggml_repeat_4d(c, ggml.ggml_reshape_4d(c, chosen, 1, n_blocks, T, N), r, n_blocks, T, N)
        spread = ggml.ggml_reshape_3d(c, spread, r * n_blocks, T, N)
        if r * n_blocks < n_kv:
            spread = ggml.ggml_pad(c, spread, n_kv - r * n_blocks, 0, 0, 0)
        tokens = ggml.ggml_add(c, spread, tokens)
    mask = ggml.ggml_scale_bias(c, tokens, MASKED, -MASKED)
    return g.cb(ggml.ggml_reshape_4d(c, mask, n_kv, T, 1, N), "qsa_mask", il)


def qsa_attention(g: GraphContext, cur: Tensor, il: int, s: QsaShape, ratio: int) -> Tensor:
    """Gated attention (attention.project / store / attend) whose K rows also carry the indexer's
    raw key, over the tokens `selection_mask` chooses."""
    hp, c = g.hp, g.ctx
    q, k, v, gate = attention.project(g, cur, il)
    index_k = g.cb(g.mm(g.w[f"blk.{il}.indexer.k_proj.weight"], cur), "indexer_k_raw", il)
    k_row = ggml.ggml_concat(c, ggml.ggml_reshape_2d(c, k, hp.head_dim * hp.n_head_kv, g.ub.n_tokens), index_k, 0)
    k_view, v_view, k_store = attention.store(g, k_row, v, il)
    mask = selection_mask(g, cur, k_store, il, s, ratio)
    return attention.attend(g, q, k_view, v_view, mask, gate, il)
