"""Feed-forward blocks: the MoE with a shared expert (qwen3next, qwen35moe: softmax router,
sigmoid-gated shared expert; kimi-linear: DeepSeek-V3's sigmoid router with a selection bias and a
scale, ungated shared expert) and the dense SwiGLU FFN (qwen35, kimi-linear's leading layers)."""

from __future__ import annotations

from dataclasses import dataclass

from deltarun.base.ggml_util import Tensor, ggml, nb, ne
from deltarun.base.interface import HParams
from deltarun.graphs.blocks.base import GraphContext

Spec = dict[str, tuple[tuple[int, ...], bool]]


@dataclass(frozen=True)
class Router:
    """How a family's MoE picks and weighs its experts (llama.cpp's `build_moe_ffn` arguments)."""

    gating: str = "softmax"     # expert scores: "softmax" (Qwen) or "sigmoid" (DeepSeek-V3, Kimi)
    selection_bias: bool = False   # `exp_probs_b.bias` added to the scores for the top-k choice only
    scale: float = 1.0          # the renormalised weights times this (expert_weights_scale)
    shared_gate: bool = True    # the shared expert scaled by sigmoid(ffn_gate_inp_shexp x)


QWEN_ROUTER = Router()


def moe_tensors(hp: HParams, p: str, present: "set[str] | dict", router: Router = QWEN_ROUTER) -> Spec:
    """Router, experts (gate and up separate, or merged gate_up) and the shared expert."""
    E, ff, n_exp = hp.n_embd, hp.n_ff_exp, hp.n_expert
    t: Spec = {p + "ffn_gate_inp.weight": ((E, n_exp), True)}
    if router.selection_bias:
        t[p + "exp_probs_b.bias"] = ((n_exp,), True)
    if p + "ffn_gate_up_exps.weight" in present:
        t[p + "ffn_gate_up_exps.weight"] = ((E, 2 * ff, n_exp), True)
    else:
        t[p + "ffn_gate_exps.weight"] = ((E, ff, n_exp), True)
        t[p + "ffn_up_exps.weight"] = ((E, ff, n_exp), True)
    t[p + "ffn_down_exps.weight"] = ((ff, E, n_exp), True)
    if router.shared_gate:
        t[p + "ffn_gate_inp_shexp.weight"] = ((E,), True)
    t[p + "ffn_gate_shexp.weight"] = ((E, hp.n_ff_shexp), True)
    t[p + "ffn_up_shexp.weight"] = ((E, hp.n_ff_shexp), True)
    t[p + "ffn_down_shexp.weight"] = ((hp.n_ff_shexp, E), True)
    return t


def dense_tensors(hp: HParams, p: str) -> Spec:
    E, ff = hp.n_embd, hp.n_ff
    return {p + "ffn_gate.weight": ((E, ff), True), p + "ffn_up.weight": ((E, ff), True),
            p + "ffn_down.weight": ((ff, E), True)}


def dense_ffn(g: GraphContext, cur: Tensor, il: int) -> Tensor:
    """down(silu(gate x) * up x)."""
    w, p = g.w, f"blk.{il}."
    par = g.cb(ggml.ggml_swiglu_split(g.ctx, g.mm(w[p + "ffn_gate.weight"], cur), g.mm(w[p + "ffn_up.weight"], cur)),
               "ffn_swiglu", il)
    return g.cb(g.mm(w[p + "ffn_down.weight"], par), "ffn_out", il)


def moe(g: GraphContext, cur: Tensor, il: int, router: Router = QWEN_ROUTER) -> Tensor:
    hp, c, w = g.hp, g.ctx, g.w
    p = f"blk.{il}."
    n_tokens = ne(cur)[1]
    k_used, n_exp, ff = hp.n_expert_used, hp.n_expert, hp.n_ff_exp

    logits = g.cb(g.mm(w[p + "ffn_gate_inp.weight"], cur), "ffn_moe_logits", il)  # [n_exp, n_tokens]
    if router.gating == "sigmoid":
        probs = g.cb(ggml.ggml_sigmoid(c, logits), "ffn_moe_probs", il)
    else:
        probs = g.cb(ggml.ggml_soft_max(c, logits), "ffn_moe_probs", il)
    choice = probs
    if router.selection_bias:
        choice = g.cb(ggml.ggml_add(c, probs, w[p + "exp_probs_b.bias"]), "ffn_moe_probs_biased", il)
    selected = g.cb(ggml.ggml_argsort_top_k(c, choice, k_used), "ffn_moe_topk", il)     # [k, n_tokens]
    weights = ggml.ggml_get_rows(c, ggml.ggml_reshape_3d(c, probs, 1, n_exp, n_tokens), selected)
    weights = ggml.ggml_reshape_2d(c, weights, k_used, n_tokens)
    weights = ggml.ggml_div(c, weights, ggml.ggml_sum_rows(c, weights))
    if router.scale != 1.0:
        weights = ggml.ggml_scale(c, weights, router.scale)
    weights = g.cb(ggml.ggml_reshape_3d(c, weights, 1, k_used, n_tokens), "ffn_moe_weights_norm", il)

    x = ggml.ggml_reshape_3d(c, cur, hp.n_embd, 1, n_tokens)
    if p + "ffn_gate_up_exps.weight" in w:
        gu = ggml.ggml_mul_mat_id(c, w[p + "ffn_gate_up_exps.weight"], x, selected)       # [2ff, k, n]
        gate = g.view(gu, (ff, k_used, n_tokens), nb(gu)[1:3], 0)
        up = g.view(gu, (ff, k_used, n_tokens), nb(gu)[1:3], ff * 4)
    else:
        gate = ggml.ggml_mul_mat_id(c, w[p + "ffn_gate_exps.weight"], x, selected)
        up = ggml.ggml_mul_mat_id(c, w[p + "ffn_up_exps.weight"], x, selected)
    par = g.cb(ggml.ggml_swiglu_split(c, gate, up), "ffn_moe_swiglu", il)
    experts = ggml.ggml_mul_mat_id(c, w[p + "ffn_down_exps.weight"], par, selected)     # [E, k, n]
    experts = g.cb(ggml.ggml_mul(c, experts, weights), "ffn_moe_weighted", il)
    moe = g.view(experts, (hp.n_embd, n_tokens), (nb(experts)[2],), 0)
    for j in range(1, k_used):
        moe = ggml.ggml_add(c, moe, g.view(experts, (hp.n_embd, n_tokens), (nb(experts)[2],), j * nb(experts)[1]))
    g.cb(moe, "ffn_moe_out", il)

    sh = ggml.ggml_swiglu_split(c, g.mm(w[p + "ffn_gate_shexp.weight"], cur),
                                g.mm(w[p + "ffn_up_shexp.weight"], cur))
    sh = g.cb(g.mm(w[p + "ffn_down_shexp.weight"], sh), "ffn_shexp", il)
    if router.shared_gate:
        sh_gate = ggml.ggml_sigmoid(c, g.mm(w[p + "ffn_gate_inp_shexp.weight"], cur))   # [1, n_tokens]
        sh = g.cb(ggml.ggml_mul(c, sh, sh_gate), "ffn_shexp_gated", il)
    return g.cb(ggml.ggml_add(c, moe, sh), "ffn_out", il)
