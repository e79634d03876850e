"""Token embedding, the output head, and the multi-token-prediction (MTP) block's ends.

The MTP block (`blk.{n_layer}`, nextn_predict_layers = 1) drafts one token further than the trunk:
x = eh_proj(concat(enorm(embed(token)), hnorm(hidden))), then one full-attention decoder block of
the family (its own KV cache), then shared_head_norm (or output_norm) and the LM head
(shared_head_head, or the trunk's).
"""

from __future__ import annotations

from typing import Container

from deltarun.base.ggml_util import Tensor, ggml
from deltarun.base.interface import HParams
from deltarun.graphs.blocks.base import GraphContext
from deltarun.graphs.inputs import EmbeddingsInput, HiddenInput, TokensInput

Spec = dict[str, tuple[tuple[int, ...], bool]]


def tensors(hp: HParams) -> Spec:
    E, V = hp.n_embd, hp.n_vocab
    return {"token_embd.weight": ((E, V), True), "output_norm.weight": ((E,), True),
            "output.weight": ((E, V), False)}


def mtp_tensors(hp: HParams, p: str) -> Spec:
    """The MTP-specific weights of block `p` (`blk.N.`); its decoder block is listed by the family."""
    E, V = hp.n_embd, hp.n_vocab
    n = p + "nextn."
    return {n + "eh_proj.weight": ((2 * E, E), True), n + "enorm.weight": ((E,), True),
            n + "hnorm.weight": ((E,), True), n + "shared_head_norm.weight": ((E,), False),
            n + "shared_head_head.weight": ((E, V), False), n + "embed_tokens.weight": ((E, V), False)}


def is_gathered(name: str) -> bool:
    """Whether the graphs read rows of this weight (get_rows in `embed` and `mtp_input`)."""
    return name == "token_embd.weight" or name.endswith(".nextn.embed_tokens.weight")


def embed(g: GraphContext) -> Tensor:
    """The ubatch's input rows: token embeddings, or given rows (an image's) with `ub.embeddings`."""
    if g.ub.embeddings:
        rows = g.input(EmbeddingsInput, lambda: EmbeddingsInput(g.ctx, g.ub, g.hp.n_embd)).embd
        return g.cb(rows, "inp_embd")
    tokens = g.input(TokensInput, lambda: TokensInput(g.ctx, g.ub)).tokens
    return g.cb(ggml.ggml_get_rows(g.ctx, g.w["token_embd.weight"], tokens), "inp_embd")


def output(g: GraphContext, x: Tensor, norm: Tensor | None = None, lm_head: Tensor | None = None,
           prefix: str = "") -> None:
    """Final norm (kept as output `result_norm`: the hidden state MTP drafts from) and LM head;
    `prefix` names them apart when the MTP block shares the trunk's graph (`mtp_result_output`)."""
    norm = g.w["output_norm.weight"] if norm is None else norm
    logits(g, g.rms_norm(x, norm, prefix + "result_norm", -1), lm_head, prefix)


def logits(g: GraphContext, x: Tensor, lm_head: Tensor | None = None, prefix: str = "") -> None:
    """The final hidden state `x` kept as output `result_norm`, then the LM head (`result_output`);
    for a family whose last block is its own output norm (qwen4exp's hyper-connection mixer)."""
    w = g.w
    lm_head = w.get("output.weight", w["token_embd.weight"]) if lm_head is None else lm_head
    x = g.output(g.cb(x, prefix + "result_norm"), prefix + "result_norm")
    g.expand(x)
    if g.ub.continued and not prefix:        # the evaluation goes on: nobody reads these logits
        return
    if g.ub.logits_last and not prefix:      # the LM head for each sequence's last row only
        ub = g.ub
        last = ggml.ggml_view_2d(g.ctx, x, int(x.contents.ne[0]), ub.n_seqs, x.contents.nb[1] * ub.n_seq_tokens,
                                 x.contents.nb[1] * (ub.n_seq_tokens - 1))
        x = ggml.ggml_cont(g.ctx, last)
    ride = g.ub.ride
    if ride is not None and ride.hidden and not prefix:   # a riding chunk's rows: the head for its last
        width, rows, row = int(x.contents.ne[0]), int(x.contents.ne[1]), x.contents.nb[1]
        ubatch_rows = ggml.ggml_view_2d(g.ctx, x, width, rows - ride.n_tokens, row, 0)
        x = ubatch_rows if not ride.logits else \
            ggml.ggml_concat(g.ctx, ubatch_rows, ggml.ggml_view_2d(g.ctx, x, width, 1, row, (rows - 1) * row), 1)
    out = g.output(g.cb(g.mm(lm_head, x), prefix + "result_output"), prefix + "result_output")
    g.expand(out)


def mtp_input(g: GraphContext, il: int, tokens: Tensor | None = None, hidden: Tensor | None = None) -> Tensor:
    """eh_proj(concat(enorm(embed(token)), hnorm(hidden))) for MTP block `il`; tokens and hidden
    states are graph inputs unless given as nodes of the same graph (see `argmax_rows`). With
    `ub.embeddings` the next positions' rows are given (an image's) in place of embed(token)."""
    c, w = g.ctx, g.w
    p = f"blk.{il}.nextn."
    if hidden is None:
        hidden = g.input(HiddenInput, lambda: HiddenInput(g.ctx, g.ub, g.hp.n_embd)).hidden
    if tokens is None and g.ub.embeddings:      # the next positions are an image's rows (Model.mtp_eval)
        rows = g.input(EmbeddingsInput, lambda: EmbeddingsInput(g.ctx, g.ub, g.hp.n_embd)).embd
    else:
        if tokens is None:
            tokens = g.input(TokensInput, lambda: TokensInput(g.ctx, g.ub, "mtp_tokens")).tokens
        rows = ggml.ggml_get_rows(c, w.get(p + "embed_tokens.weight", w["token_embd.weight"]), tokens)
    e = g.rms_norm(rows, w[p + "enorm.weight"], "mtp_enorm", il)
    h = g.rms_norm(hidden, w[p + "hnorm.weight"], "mtp_hnorm", il)
    return g.cb(g.mm(w[p + "eh_proj.weight"], ggml.ggml_concat(c, e, h, 0)), "mtp_eh_proj", il)


def mtp_lm_head_name(il: int, names: Container[str]) -> str:
    """The weight the LM head of MTP block `il` reads: its own shared_head_head, or the trunk's."""
    for name in (f"blk.{il}.nextn.shared_head_head.weight", "output.weight"):
        if name in names:
            return name
    return "token_embd.weight"


def mtp_output(g: GraphContext, x: Tensor, il: int, prefix: str = "") -> None:
    """`mtp_out` (before the final norm: what a chained draft feeds back as the next hidden
    state), then the MTP block's norm and LM head (outputs named with `prefix`, see `output`).
    With `ub.draft_vocab` the head computes the logits of the first draft_vocab token ids only
    (a view of its first rows: runner.draft_vocab)."""
    w = g.w
    p = f"blk.{il}.nextn."
    g.output(g.cb(x, "mtp_out"), "mtp_out")
    norm = w.get(p + "shared_head_norm.weight", w["output_norm.weight"])
    lm_head = w[mtp_lm_head_name(il, w)]
    if g.ub.draft_vocab:
        lm_head = ggml.ggml_view_2d(g.ctx, lm_head, int(lm_head.contents.ne[0]), g.ub.draft_vocab,
                                    lm_head.contents.nb[1], 0)
    output(g, x, norm, lm_head, prefix)


def argmax_rows(g: GraphContext) -> tuple[Tensor, Tensor]:
    """(argmax of each row's logits, the row's hidden state): after a trunk `output` with every row.

    In greedy decoding the token that follows a kept row is exactly its argmax (a kept draft equals
    it, and so does the correction or bonus token after the last kept one), so these are the MTP
    block's rows (token_{i+1}, hidden_i) of every position a verification step keeps, known inside
    the graph: the MTP block can run in the trunk's evaluation instead of a separate one.
    """
    tokens = g.output(g.cb(ggml.ggml_argmax(g.ctx, g.outputs["result_output"]), "mtp_tokens"), "mtp_tokens")
    return tokens, g.outputs["result_norm"]
