"""Per-layer embeddings from hashed n-grams (qwen4exp's PLE, transformers' `Qwen4ExpTextPLELayer` and
`Qwen4ExpTextNGramEmbedding`; docs/qwen4exp-gguf.md).

Each token reads n_heads rows of one table (`per_layer_token_embd.weight`, tens of GB in the
published model): for n-gram order n = 2..N and head g, row `offset[h] + mix % size[h]` with
`mix = (c_0 m_0) ^ ... ^ (c_{n-1} m_{n-1})`, c_s the token s back (EOS where that lies before the
sequence or behind an EOS). The row indices are computed on the host (`PleRowsInput`: ggml has no
64-bit integers), from the ubatch's tokens and the tokens Memory holds for the sequence; the graph
gathers the rows with get_rows from the mapped file, so only the rows a prompt touches are ever
read (the family lists the table as a gathered weight: it keeps the file's layout and mapping).

The layer gates a projection of the concatenated rows into every residual stream (signed square
root of a per-stream dot product, sigmoid), then adds a dilated depthwise causal convolution
(kernel K, dilation N) of the normed result. The convolution's history, (K - 1) N rows, is a
recurrent state kept after the layer's delta-net conv windows in the same cell row, slot-major
(`HParams.conv_state_extra`), so rollback, checkpoints and sequence copies carry it along.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from deltarun.base.errors import UnsupportedModelError
from deltarun.base.ggml_util import Tensor, ggml, nb, ne
from deltarun.base.interface import UbatchData, UbatchShape
from deltarun.graphs.blocks.base import GraphContext
from deltarun.graphs.blocks.delta_net import recurrent_input
from deltarun.graphs.inputs import GraphInput

Spec = dict[str, tuple[tuple[int, ...], bool]]
TABLE = "per_layer_token_embd.weight"


@dataclass(frozen=True)
class PleShape:
    """The `ple.*` keys: the PLE layer, the hash constants, the convolution."""

    layer: int
    ngram_size: int
    heads_per_ngram: int
    conv_kernel: int
    eos: int
    row_dim: int
    multipliers: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @property
    def n_heads(self) -> int:
        return (self.ngram_size - 1) * self.heads_per_ngram

    @property
    def width(self) -> int:
        """The concatenated rows of one token (P)."""
        return self.n_heads * self.row_dim

    @property
    def rows_addressed(self) -> int:
        """Rows the heads' ranges reach: the table needs at least these."""
        return max(o + n for o, n in zip(self.offsets, self.sizes))

    @property
    def history(self) -> int:
        """Rows of the convolution's state."""
        return (self.conv_kernel - 1) * self.ngram_size


def tensors(n_embd: int, n_streams: int, s: PleShape, p: str) -> Spec:
    """The PLE layer's weights (prefix `blk.N.`); the table is listed by the family."""
    width = n_embd * n_streams
    t = {p + "ple_key.weight": ((s.width, width), True), p + "ple_value.weight": ((s.width, n_embd), True),
         p + "ple_conv1d.weight": ((s.conv_kernel, width), True)}
    for n in ("key", "query", "conv"):
        t[p + f"ple_norm_{n}.weight"] = ((width,), True)
    return t


def ngram_rows(context: np.ndarray, s: PleShape) -> np.ndarray:
    """Table rows [T, n_heads] of tokens context[:, 0] given their predecessors context[:, 1:]
    (s back in column s; -1 where there is none)."""
    T = context.shape[0]
    ctx = np.empty((T, s.ngram_size), dtype=np.uint64)
    ctx[:, 0] = context[:, 0]
    cut = np.zeros(T, dtype=bool)
    for back in range(1, s.ngram_size):     # an EOS, or the sequence start, cuts everything behind it
        cut |= (context[:, back] < 0) | (context[:, back] == s.eos)
        ctx[:, back] = np.where(cut, s.eos, np.maximum(context[:, back], 0))
    products = ctx * np.asarray(s.multipliers, dtype=np.uint64)   # each below 2^63 (the multipliers' bound)
    rows = np.empty((T, s.n_heads), dtype=np.int64)
    mixed = products[:, 0]
    for order in range(2, s.ngram_size + 1):
        mixed = mixed ^ products[:, order - 1]
        for g in range(s.heads_per_ngram):
            h = (order - 2) * s.heads_per_ngram + g
            rows[:, h] = (mixed % np.uint64(s.sizes[h])).astype(np.int64) + s.offsets[h]
    return rows


class PleRowsInput(GraphInput):
    """The table rows of every token of the ubatch (`ple_rows` [n_heads * n_tokens]), from its
    tokens and, before them, the last N - 1 tokens Memory holds for each sequence."""

    def __init__(self, ctx: Any, ub: UbatchShape, mem: Any, s: PleShape):
        super().__init__()
        self.mem, self.shape = mem, s
        self.rows = self.new(ctx, "ple_rows", ggml.GGML_TYPE_I32, s.n_heads * ub.n_tokens)

    def prepare(self, shape: UbatchShape) -> None:
        self.seq_head = shape.seq_head

    def set_input(self, data: UbatchData) -> None:
        s, back = self.shape, self.shape.ngram_size - 1
        out = self.host["ple_rows"].reshape(len(data.tokens), -1, s.n_heads)
        for i, toks in enumerate(data.tokens):
            before = self.mem.seqs[self.seq_head + i].tokens[-back:] if back else []
            history = np.array([-1] * (back - len(before)) + list(before) + list(toks), dtype=np.int64)
            n = len(toks)
            context = np.stack([history[back - b: back - b + n] for b in range(back + 1)], axis=1)
            out[i] = ngram_rows(context, s)


def embeddings(g: GraphContext, s: PleShape) -> Tensor:
    """The concatenated n-gram rows [P, n_tokens], gathered from the mapped table."""
    if g.ub.embeddings:
        raise UnsupportedModelError("qwen4exp's n-gram embeddings need token ids: images (rows given as "
                                    "embeddings) are not supported with a PLE layer")
    rows = g.input(PleRowsInput, lambda: PleRowsInput(g.ctx, g.ub, g.mem, s)).rows
    gathered = ggml.ggml_get_rows(g.ctx, g.w[TABLE], rows)                # [d, n_heads * n_tokens]
    return g.cb(ggml.ggml_reshape_2d(g.ctx, gathered, s.width, g.ub.n_tokens), "ple_embd")


def ple(g: GraphContext, x: Tensor, il: int, s: PleShape) -> Tensor:
    """What the PLE layer adds to the streams x [n_embd, H, n_tokens]."""
    c, w = g.ctx, g.w
    p = f"blk.{il}."
    E, H, n_tokens = ne(x)[:3]
    emb = embeddings(g, s)

    def grouped_norm(t: Tensor, name: str) -> Tensor:
        gamma = ggml.ggml_reshape_2d(c, w[p + f"ple_norm_{name}.weight"], E, H)
        return g.rms_norm(ggml.ggml_reshape_3d(c, t, E, H, n_tokens), gamma, f"ple_norm_{name}", il)

    key = grouped_norm(g.mm(w[p + "ple_key.weight"], emb), "key")
    value = g.mm(w[p + "ple_value.weight"], emb)                         # [E, n_tokens]
    query = grouped_norm(x, "query")
    a = ggml.ggml_scale(c, ggml.ggml_sum_rows(c, ggml.ggml_mul(c, key, query)), 1.0 / math.sqrt(E))   # [1, H, T]
    magnitude = ggml.ggml_sqrt(c, ggml.ggml_clamp(c, ggml.ggml_abs(c, a), 1e-6, math.inf))
    gate = g.cb(ggml.ggml_sigmoid(c, ggml.ggml_mul(c, ggml.ggml_sgn(c, a), magnitude)), "ple_gate", il)
    spread = ggml.ggml_repeat_4d(c, ggml.ggml_reshape_3d(c, value, E, 1, n_tokens), E, H, n_tokens, 1)
    gated = g.cb(ggml.ggml_mul(c, spread, gate), "ple_gated_value", il)             # [E, H, T]
    normed = grouped_norm(gated, "conv")
    conv = convolution(g, ggml.ggml_reshape_2d(c, normed, E * H, n_tokens), il, s)
    return g.cb(ggml.ggml_add(c, gated, ggml.ggml_reshape_3d(c, conv, E, H, n_tokens)), "ple_out", il)


def convolution(g: GraphContext, u: Tensor, il: int, s: PleShape) -> Tensor:
    """silu(dilated depthwise causal conv of u [channels, T*N]) over the state's history, whose
    newest windows go to the rollback slots (as the delta net's, `write_conv_slots`)."""
    hp, ub, c, w = g.hp, g.ub, g.ctx, g.w
    T, N = ub.n_seq_tokens, ub.n_seqs
    ch, hist, K, f32 = ne(u)[0], s.history, g.mem.rs_slots, 4
    cells = g.mem.conv[il]
    cell = nb(cells)[1]
    extra = ub.seq_head * cell + hp.conv_state_size * K * f32          # slot 0 of the PLE part
    state = g.cb(g.view(cells, (hist, ch, N), (hist * f32, cell), extra), "ple_conv_state", il)
    inputs = ggml.ggml_transpose(c, ggml.ggml_reshape_3d(c, u, ch, T, N))
    window = g.cb(ggml.ggml_concat(c, state, inputs, 0), "ple_conv_input", il)   # [hist + T, ch, N]

    rs = recurrent_input(g)
    src = g.view(window, (hist, 1, ch, N), (f32, nb(window)[1], nb(window)[2]), (T - (rs.kw - 1)) * f32)
    src.contents.ne[1] = rs.kw                          # the last kw windows, overlapping
    dst = g.view(cells, (hist, K, ch, N), (hist * ch * f32, hist * f32, cell), extra)
    g.expand(g.cb(ggml.ggml_set_rows(c, dst, src, rs.slot_rev), "ple_conv_state_store", il))
    if ub.captures:
        for i, t in enumerate(ub.captures):             # the history before token t, to capture row i
            cap = g.mem.capture_conv[il]
            into = g.view(cap, (hist, ch), (hist * f32,), i * nb(cap)[1] + hp.conv_state_size * K * f32)
            g.expand(g.cb(ggml.ggml_cpy(c, g.view(window, (hist, ch), (nb(window)[1],), t * f32), into),
                          f"ple_conv_capture{i}", il))

    kernel = w[f"blk.{il}.ple_conv1d.weight"]                          # [kernel, ch]
    if kernel.contents.type != ggml.GGML_TYPE_F32:
        kernel = ggml.ggml_cast(c, kernel, ggml.GGML_TYPE_F32)
    out = None
    for j in range(s.conv_kernel):                      # tap j reads (kernel - 1 - j) * N rows back
        shifted = g.view(window, (T, ch, N), (nb(window)[1], nb(window)[2]),
                         (hist - (s.conv_kernel - 1 - j) * s.ngram_size) * f32)
        tap = ggml.ggml_cont(c, g.view(kernel, (1, ch), (nb(kernel)[1],), j * f32))
        term = ggml.ggml_mul(c, ggml.ggml_cont(c, shifted), tap)
        out = term if out is None else ggml.ggml_add(c, out, term)
    out = g.cb(ggml.ggml_silu(c, out), "ple_conv", il)                 # [T, ch, N]
    return ggml.ggml_reshape_2d(c, ggml.ggml_cont(c, ggml.ggml_permute(c, out, 1, 0, 2, 3)), ch, T * N)
