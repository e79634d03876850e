"""Qwen3-Next (`general.architecture = qwen3next`): spec and graph, as a block diagram.

    tokens -> embedding
           -> n_layer x [ RMSNorm -> gated delta net (3 of 4 layers) | gated attention (every 4th)
                          -> + residual -> RMSNorm -> MoE with shared expert -> + residual ]
           -> RMSNorm -> LM head
    MTP block (optional): enorm(embed(next token)) ++ hnorm(hidden) -> eh_proj -> one gated-attention
           decoder block -> shared_head_norm -> LM head

The blocks live in deltarun/graphs/blocks/; this file says which ones and how they are laid out
in a qwen3next GGUF: NEOX rope, fused `ssm_ba`, value heads grouped by key head (the legacy
`ssm_in` projection accepted too), MoE FFN. It computes what llama.cpp's `qwen3next` graph
computes and names nodes the way llama.cpp does, so dumps and comparisons line up.
"""

from __future__ import annotations

from typing import Any

from deltarun.base.ggml_util import Tensor, ggml
from deltarun.base.gguf_file import GGUFFile
from deltarun.base.interface import HParams
from deltarun.graphs import spec
from deltarun.graphs.blocks import attention, delta_net, ffn, head
from deltarun.graphs.blocks.attention import full_attention, output_rows
from deltarun.graphs.blocks.base import GraphContext
from deltarun.graphs.blocks.delta_net import CHUNK_SIZE, DeltaNet, linear_attention
from deltarun.graphs.family import HybridFamily, Spec

__all__ = ["Qwen3NextFamily", "CHUNK_SIZE"]


class Qwen3NextFamily(HybridFamily):
    """Graph builder for `general.architecture = qwen3next`."""

    arch = "qwen3next"
    delta_net_layout = DeltaNet(beta_alpha="fused", broadcast="grouped", legacy_ssm_in=True)
    moe = True              # MoE + shared expert in every block (else a dense SwiGLU FFN)
    rope_sections = False   # NEOX rope (else IMRoPE with rope.dimension_sections)
    rides = True            # a prompt chunk may ride along a ubatch (UbatchShape.ride)

    # --- spec ---------------------------------------------------------------------------------
    @classmethod
    def read_hparams(cls, f: GGUFFile) -> HParams:
        return spec.read_hparams(f, cls.arch, moe=cls.moe, rope_sections=cls.rope_sections)

    @classmethod
    def tensor_spec(cls, hp: HParams, present: dict[str, Any]) -> Spec:
        E = hp.n_embd
        t = head.tensors(hp)
        for il in range(hp.n_layer + hp.n_mtp):
            p = f"blk.{il}."
            t[p + "attn_norm.weight"] = ((E,), True)
            t[p + "post_attention_norm.weight"] = ((E,), True)
            if il < hp.n_layer and hp.recurrent[il]:
                t.update(delta_net.tensors(hp, p, cls.delta_net_layout, present))
            else:
                t.update(attention.tensors(hp, p))
            if cls.moe:
                t.update(ffn.moe_tensors(hp, p, present))
            else:
                t.update(ffn.dense_tensors(hp, p))
            if il >= hp.n_layer:
                t.update(head.mtp_tensors(hp, p))
        return t

    # --- graph --------------------------------------------------------------------------------
    def forward(self, g: GraphContext) -> None:
        hp = g.hp
        x = head.embed(g)
        for il in range(hp.n_layer):
            x = self.decoder_block(g, x, il, last=il == hp.n_layer - 1)
        head.output(g, x)

    def forward_mtp(self, g: GraphContext, tokens: Tensor | None = None, hidden: Tensor | None = None,
                    prefix: str = "") -> None:
        il = g.hp.n_layer
        x = head.mtp_input(g, il, tokens, hidden)
        x = self.decoder_block(g, x, il, last=True)
        head.mtp_output(g, x, il, prefix)

    def decoder_block(self, g: GraphContext, x: Tensor, il: int, last: bool) -> Tensor:
        """norm -> token mixer -> + residual -> norm -> FFN -> + residual."""
        c, hp = g.ctx, g.hp
        residual = x
        cur = g.rms_norm(x, g.w[f"blk.{il}.attn_norm.weight"], "attn_norm", il)
        # Emit the previous layer and this norm before the state reads below, so the graph runs
        # layer by layer: ggml's scheduler then puts the ops reading this layer's state on this
        # layer's device, not the previous one's (a layer split over devices or RPC servers would
        # copy the whole state across and back on every ubatch).
        g.expand(cur)
        if il < hp.n_layer and hp.recurrent[il]:
            cur = linear_attention(g, cur, il, self.delta_net_layout)
        else:
            cur = full_attention(g, cur, il)
        if last:                 # only the rows whose logits are asked for go on
            cur, residual = output_rows(g, cur), output_rows(g, residual)
        cur = g.cb(ggml.ggml_add(c, cur, residual), "attn_residual", il)
        ffn_in = g.rms_norm(cur, g.w[f"blk.{il}.post_attention_norm.weight"], "attn_post_norm", il)
        return g.cb(ggml.ggml_add(c, self.feed_forward(g, ffn_in, il), cur), "l_out", il)

    def feed_forward(self, g: GraphContext, x: Tensor, il: int) -> Tensor:
        return ffn.moe(g, x, il) if self.moe else ffn.dense_ffn(g, x, il)
