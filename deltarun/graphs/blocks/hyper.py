"""Hyper-connections (qwen4exp): H residual streams, mixed by learned low-rank maps, in place of the
layer norms (transformers' `Qwen4ExpTextGatedResidual`, docs/qwen4exp-gguf.md).

The residual is [n_embd, H, n_tokens]: H copies of the embedding at the start. Before each token
mixer and each FFN a module normalises every stream (one RMSNorm per stream, gammas stored 1 + w),
computes a sigmoid gate per channel from a low-rank map (down, SiLU, up) of all streams together,
and takes the mean over the streams of gate x normed stream as the block's input; after the block,
stream s adds inject[s] x block output, inject = 2 sigmoid(W_inject normed / H). The model's last
module (`output_hc_*`, no inject) makes the hidden state the LM head reads: there is no other
output norm.
"""

from __future__ import annotations

from deltarun.base.ggml_util import Tensor, ggml, nb, ne
from deltarun.graphs.blocks.base import GraphContext

Spec = dict[str, tuple[tuple[int, ...], bool]]


def tensors(n_embd: int, n_streams: int, low_rank: int, prefix: str, inject: bool) -> Spec:
    """One module's weights (prefix `blk.N.hc_attn_`, `blk.N.hc_ffn_` or `output_hc_`)."""
    width = n_embd * n_streams
    t = {prefix + "norm.weight": ((width,), True), prefix + "down.weight": ((width, low_rank), True),
         prefix + "up.weight": ((low_rank, width), True)}
    if inject:
        t[prefix + "inject.weight"] = ((width, n_streams), True)
    return t


def streams(g: GraphContext, x: Tensor, n_streams: int) -> Tensor:
    """[n_embd, n_tokens] -> H identical streams [n_embd, H, n_tokens]."""
    E, T = ne(x)[:2]
    x3 = ggml.ggml_reshape_3d(g.ctx, x, E, 1, T)
    return g.cb(ggml.ggml_repeat_4d(g.ctx, x3, E, n_streams, T, 1), "hc_init")


def mix(g: GraphContext, x: Tensor, prefix: str, il: int, n_streams: int) -> tuple[Tensor, Tensor | None]:
    """The block input [n_embd, n_tokens] from the streams x [n_embd, H, n_tokens], and the
    injection weights [H, n_tokens] (None for the output module, which has none)."""
    c, w = g.ctx, g.w
    E, H, T = ne(x)[0], n_streams, ne(x)[2]
    gamma = ggml.ggml_reshape_2d(c, w[prefix + "norm.weight"], E, H)
    normed = ggml.ggml_reshape_2d(c, g.rms_norm(x, gamma, "hc_norm", il), E * H, T)
    low = ggml.ggml_silu(c, ggml.ggml_scale(c, g.mm(w[prefix + "down.weight"], normed), 1.0 / H))
    gate = ggml.ggml_sigmoid(c, g.mm(w[prefix + "up.weight"], low))
    gated = ggml.ggml_reshape_3d(c, ggml.ggml_mul(c, normed, g.cb(gate, "hc_gate", il)), E, H, T)
    row, stream = nb(gated)[2], nb(gated)[1]
    mixed = ggml.ggml_cont(c, g.view(gated, (E, T), (row,), 0))
    for s in range(1, H):                          # the mean over the streams
        mixed = ggml.ggml_add(c, mixed, g.view(gated, (E, T), (row,), s * stream))
    mixed = g.cb(ggml.ggml_scale(c, mixed, 1.0 / H), "hc_mixed", il)
    if prefix + "inject.weight" not in w:
        return mixed, None
    inject = ggml.ggml_sigmoid(c, ggml.ggml_scale(c, g.mm(w[prefix + "inject.weight"], normed), 1.0 / H))
    return mixed, g.cb(ggml.ggml_scale(c, inject, 2.0), "hc_inject", il)


def combine(g: GraphContext, x: Tensor, out: Tensor, inject: Tensor, il: int) -> Tensor:
    """Stream s of x [n_embd, H, n_tokens] plus inject[s] [H, n_tokens] x the block output [n_embd, n_tokens]."""
    c = g.ctx
    E, H, T = ne(x)[:3]
    spread = ggml.ggml_repeat_4d(c, ggml.ggml_reshape_3d(c, out, E, 1, T), E, H, T, 1)
    scaled = ggml.ggml_mul(c, spread, ggml.ggml_reshape_3d(c, inject, 1, H, T))
    return g.cb(ggml.ggml_add(c, x, scaled), "hc_combine", il)
