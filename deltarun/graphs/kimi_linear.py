"""Kimi-Linear (`general.architecture = kimi-linear`): spec and graph, as a block diagram.

    tokens -> embedding
           -> n_layer x [ RMSNorm -> KDA (head_count_kv = 0) | MLA, NoPE (head_count_kv = 1)
                          -> + residual -> RMSNorm -> dense SwiGLU FFN (the first
                          leading_dense_block_count layers) | MoE: sigmoid router with selection
                          bias and scale, ungated shared expert -> + residual ]
           -> RMSNorm -> LM head

Keys, tensors and the converter's transforms are in docs/kimi-linear-gguf.md; the graph computes
what llama.cpp's src/models/kimi-linear.cpp computes. KDA runs on the delta net's recurrent state
(rollback slots, capture slots, prompt cache alike), its gate per key channel. The MLA layers'
cache rows are the compressed latent [c | k_pe] (`attention.key_length` per token), as in
llama.cpp, split in halves over the K and V caches Memory allocates (`HParams.head_dim` is half
the row: see blocks/mla.py), so memory per token is llama.cpp's.
"""

from __future__ import annotations

import gguf

from deltarun.base.errors import ModelFileError
from deltarun.base.ggml_util import Tensor, ggml
from deltarun.base.gguf_file import GGUFFile
from deltarun.base.interface import HParams
from deltarun.graphs import spec
from deltarun.graphs.blocks import ffn, head, kda, mla
from deltarun.graphs.blocks.attention import output_ids
from deltarun.graphs.blocks.base import GraphContext
from deltarun.graphs.family import HybridFamily, Spec

ARCH = "kimi-linear"
#: besides spec.F32_ONLY: the three conv kernels (concatenated for ggml_ssm_conv) and the router's bias
F32_ONLY = kda.CONV_NAMES + ("exp_probs_b.bias",)
GATING_SIGMOID = 2   # expert_gating_func (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID)


class KimiLinearFamily(HybridFamily):
    """Graph builder for `general.architecture = kimi-linear`."""

    arch = ARCH

    def __init__(self, gguf_file: GGUFFile):
        self.mla_shape, self.n_dense_lead, self.router = self.read_extras(gguf_file)
        super().__init__(gguf_file)
        for name, info in gguf_file.tensors.items():   # element-wise operands ggml's CPU ops need in F32
            if name.endswith(F32_ONLY) and info.ggml_type != gguf.GGMLQuantizationType.F32:
                raise ModelFileError(f"{gguf_file.path}: tensor {name!r} has type "
                                     f"{gguf.GGMLQuantizationType(info.ggml_type).name}; it must be F32 "
                                     "(convert the model again, keeping it unquantized)")

    # --- spec ---------------------------------------------------------------------------------
    @classmethod
    def read_hparams(cls, f: GGUFFile) -> HParams:
        a = cls.arch
        if f.architecture != a:
            raise ModelFileError(f"{f.path}: architecture {f.architecture!r} is not {a!r}")
        n_layer = spec._int(f, a, "block_count")
        if n_layer > len(f.tensors):
            raise ModelFileError(f"{f.path}: {a}.block_count = {n_layer} but the file holds only "
                                 f"{len(f.tensors)} tensors; {spec.REDO}")
        kv_heads = f.get(f"{a}.attention.head_count_kv")
        if not isinstance(kv_heads, list) or len(kv_heads) != n_layer or not all(
                isinstance(x, int) and not isinstance(x, bool) and x in (0, 1) for x in kv_heads):
            raise ModelFileError(f"{f.path}: {a}.attention.head_count_kv must list, per layer, 0 (KDA) or 1 (MLA), "
                                 f"{n_layer} entries; found {spec._show(kv_heads)}; {spec.REDO}")
        n_head = spec._int(f, a, "attention.head_count")
        key_length = spec._int(f, a, "attention.key_length")
        if key_length % 2:
            raise ModelFileError(f"{f.path}: {a}.attention.key_length = {key_length} (kv_lora_rank + rope dims) "
                                 f"is odd; deltarun stores the MLA row in two halves: {spec.REDO}")
        d = spec._int(f, a, "kda.head_dim")
        n_ff_exp = spec._int(f, a, "expert_feed_forward_length")
        hp = HParams(
            n_layer=n_layer,
            n_ctx_train=spec._int(f, a, "context_length", limit=spec.MAX_CONTEXT),
            n_embd=spec._int(f, a, "embedding_length"),
            n_ff=spec._int(f, a, "feed_forward_length"),
            n_head=n_head,
            # the cached latent row (attention.key_length = kv_lora_rank + rope dims) split over the K
            # and V caches of one KV head, half in each (blocks/mla.py)
            n_head_kv=1,
            head_dim=key_length // 2,
            rms_eps=spec._float(f, a, "attention.layer_norm_rms_epsilon"),
            rope_freq_base=spec._float(f, a, "rope.freq_base", 10000.0),
            n_rot=spec._int(f, a, "rope.dimension_count"),
            n_expert=spec._int(f, a, "expert_count"),
            n_expert_used=spec._int(f, a, "expert_used_count"),
            n_ff_exp=n_ff_exp,
            n_ff_shexp=n_ff_exp * spec._int(f, a, "expert_shared_count", 1),
            ssm_d_conv=spec._int(f, a, "ssm.conv_kernel"),
            ssm_d_inner=n_head * d,
            ssm_d_state=d,
            ssm_n_v_heads=n_head,
            ssm_n_k_heads=n_head,
            recurrent=tuple(x == 0 for x in kv_heads),
            n_vocab=spec._vocab_size(f) or spec._vocab_from_embd(f),
        )
        spec.check_hparams(hp, str(f.path))
        return hp

    @classmethod
    def read_extras(cls, f: GGUFFile) -> tuple[mla.MlaShape, int, ffn.Router]:
        """What HParams does not hold: MLA's head sizes, the leading dense layers, the router."""
        a = cls.arch
        s = mla.MlaShape(kv_lora_rank=spec._int(f, a, "attention.kv_lora_rank"),
                         key_length=spec._int(f, a, "attention.key_length_mla"),
                         value_length=spec._int(f, a, "attention.value_length_mla"),
                         n_rope=spec._int(f, a, "rope.dimension_count"))
        if s.n_rope >= s.key_length:
            raise ModelFileError(f"{f.path}: {a}.rope.dimension_count {s.n_rope} must be below key_length_mla "
                                 f"{s.key_length}; {spec.REDO}")
        if f.get(f"{a}.attention.q_lora_rank"):
            raise ModelFileError(f"{f.path}: a compressed query (q_lora_rank) is not supported for {a}; "
                                 "Kimi-Linear's query is one attn_q projection")
        n_dense = f.get(f"{a}.leading_dense_block_count", 0)
        if isinstance(n_dense, bool) or not isinstance(n_dense, int) or n_dense < 0:
            raise ModelFileError(f"{f.path}: {a}.leading_dense_block_count = {spec._show(n_dense)} is not a count; "
                                 f"{spec.REDO}")
        gating = f.get(f"{a}.expert_gating_func", GATING_SIGMOID)
        if gating != GATING_SIGMOID:
            raise ModelFileError(f"{f.path}: {a}.expert_gating_func = {spec._show(gating)}; Kimi-Linear's router "
                                 f"is sigmoid ({GATING_SIGMOID})")
        scale = f.get(f"{a}.expert_weights_scale", 1.0)
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not 0 < scale < 1e6:
            raise ModelFileError(f"{f.path}: {a}.expert_weights_scale = {spec._show(scale)} is not a positive "
                                 f"number; {spec.REDO}")
        router = ffn.Router(gating="sigmoid", selection_bias=True, scale=float(scale), shared_gate=False)
        return s, n_dense, router

    def expected_tensors(self) -> Spec:
        hp = self.hp
        s = self.mla_shape
        if s.row_width != 2 * hp.head_dim:
            raise ModelFileError(f"{self.file.path}: {self.arch}.attention.key_length {2 * hp.head_dim} must be "
                                 f"kv_lora_rank + rope dims = {s.row_width}; {spec.REDO}")
        if s.n_rope > s.kv_lora_rank:
            raise ModelFileError(f"{self.file.path}: {self.arch}.rope.dimension_count {s.n_rope} exceeds "
                                 f"kv_lora_rank {s.kv_lora_rank}; {spec.REDO}")
        E = hp.n_embd
        t = head.tensors(hp)
        t["output.weight"] = ((E, hp.n_vocab), True)
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            t[p + "attn_norm.weight"] = ((E,), True)
            t[p + "ffn_norm.weight"] = ((E,), True)
            t.update(kda.tensors(hp, p) if hp.recurrent[il] else mla.tensors(hp, p, self.mla_shape))
            if il < self.n_dense_lead:
                t.update(ffn.dense_tensors(hp, p))
            else:
                t.update(ffn.moe_tensors(hp, p, self.file.tensors, self.router))
        return t

    # --- graph --------------------------------------------------------------------------------
    def forward(self, g: GraphContext) -> None:
        x = head.embed(g)
        for il in range(g.hp.n_layer):
            x = self.decoder_block(g, x, il, last=il == g.hp.n_layer - 1)
        head.output(g, x)

    def forward_mtp(self, g: GraphContext, tokens: Tensor | None = None, hidden: Tensor | None = None,
                    prefix: str = "") -> None:
        raise ModelFileError(f"{self.file.path}: Kimi-Linear has no MTP block")

    def decoder_block(self, g: GraphContext, x: Tensor, il: int, last: bool) -> Tensor:
        """norm -> KDA | MLA -> + residual -> norm -> dense FFN | MoE -> + residual."""
        c = g.ctx
        residual = x
        cur = g.rms_norm(x, g.w[f"blk.{il}.attn_norm.weight"], "attn_norm", il)
        g.expand(cur)     # layer by layer, as qwen3next.decoder_block (state reads on this layer's device)
        if g.hp.recurrent[il]:
            cur = kda.kda(g, cur, il)
        else:
            cur = mla.mla(g, cur, il, self.mla_shape)
        rows = output_ids(g) if last else None
        if rows is not None:
            cur = ggml.ggml_get_rows(c, cur, rows.out_ids)
            residual = ggml.ggml_get_rows(c, residual, rows.out_ids)
        cur = g.cb(ggml.ggml_add(c, cur, residual), "ffn_inp", il)
        x = g.rms_norm(cur, g.w[f"blk.{il}.ffn_norm.weight"], "ffn_norm", il)
        out = ffn.dense_ffn(g, x, il) if il < self.n_dense_lead else ffn.moe(g, x, il, self.router)
        return g.cb(ggml.ggml_add(c, out, cur), "l_out", il)
