"""The Qwen3-Next forward pass as one ggml graph per ubatch shape.

This is the whole model: embeddings, the gated-DeltaNet linear-attention layers with their
rollback-slot recurrent state, the gated full-attention layers over the KV cache, the MoE FFN with
its shared expert, and the LM head. It computes what llama.cpp's `qwen3next` graph computes, built
through the ggml-python bindings, and names nodes the way llama.cpp does (`attn_norm-0`,
`conv_states-0`, `result_output`, ...) so dumps and comparisons line up.

Per-step values (tokens, positions, mask, KV rows, state cells, output rows, rollback slot order)
are host-filled graph inputs, so a graph is built once per shape and reused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from deltarun.graphs.qwen3next_spec import HParams, expected_tensors, read_hparams, validate_tensors
from deltarun.runner.ggml_util import Tensor, c_array, ctypes, ggml, nb, ne, set_name

DELTA_NET_MODES = ("fused", "primitive")
CHUNK_SIZE = 64  # chunk length of the primitive (chunked) delta rule


@dataclass(frozen=True)
class UbatchShape:
    """Everything that fixes a graph's structure; equal shapes share one graph."""

    n_seq_tokens: int   # tokens per sequence in this ubatch
    n_seqs: int         # sequences in this ubatch (cells seq_head .. seq_head + n_seqs - 1)
    n_outputs: int      # rows of logits asked for
    n_kv: int           # KV positions visible to attention (padded)
    seq_head: int = 0   # first state cell of the ubatch
    delta_net: str = "fused"
    mtp: bool = False   # the multi-token-prediction block instead of the trunk

    @property
    def n_tokens(self) -> int:
        return self.n_seq_tokens * self.n_seqs


class Qwen3NextGraph:
    """Graph builder for `general.architecture = qwen3next`."""

    arch = "qwen3next"

    def __init__(self, gguf_file: Any):
        self.hp: HParams = read_hparams(gguf_file)
        validate_tensors(self.hp, gguf_file)
        self.file = gguf_file

    def graph_size(self, ub: UbatchShape) -> int:
        """Most nodes the graph of this shape can hold, with margin (ggml aborts past its size).

        Measured: about 80 nodes per layer, and in the primitive delta net about 19 more per chunk
        of 64 tokens per linear-attention layer (plus a few per rollback snapshot).
        """
        hp = self.hp
        per_layer = 120 * (hp.n_layer + hp.n_mtp)
        chunks = 0
        if ub.delta_net == "primitive" and ub.n_seq_tokens > 1:
            n_chunks = -(-ub.n_seq_tokens // CHUNK_SIZE)
            chunks = len(hp.linear_layers) * (32 * n_chunks + 16 * min(ub.n_seq_tokens, 64))
        return 2048 + per_layer + chunks

    def tensor_names(self) -> list[str]:
        """Names of every weight the graph may read (optional ones included)."""
        return list(expected_tensors(self.hp, self.file))

    # ------------------------------------------------------------------------------------------
    def build(self, ctx: Any, gf: Any, w: dict[str, Tensor], mem: Any, ub: UbatchShape) -> dict[str, Tensor]:
        """Add the forward pass of one ubatch to `gf`; returns the graph inputs and outputs by name."""
        b = _Builder(ctx, gf, self.hp, w, mem, ub)
        return b.forward_mtp() if ub.mtp else b.forward()


class _Builder:
    """Holds the per-build state so each block reads like the math."""

    def __init__(self, ctx: Any, gf: Any, hp: HParams, w: dict[str, Tensor], mem: Any, ub: UbatchShape):
        self.ctx, self.gf, self.hp, self.w, self.mem, self.ub = ctx, gf, hp, w, mem, ub
        self.io: dict[str, Tensor] = {}

    # --- small helpers ------------------------------------------------------------------------
    def cb(self, t: Tensor, name: str, il: int = -1) -> Tensor:
        return set_name(t, f"{name}-{il}" if il >= 0 else name)

    def input(self, name: str, gtype: int, *shape: int) -> Tensor:
        t = ggml.ggml_new_tensor(self.ctx, gtype, len(shape), c_array(ctypes.c_int64, list(shape)))
        set_name(t, name)
        ggml.ggml_set_input(t)
        self.io[name] = t
        return t

    def rms_norm(self, x: Tensor, weight: Tensor | None, name: str, il: int) -> Tensor:
        x = ggml.ggml_rms_norm(self.ctx, x, self.hp.rms_eps)
        if weight is not None:
            x = ggml.ggml_mul(self.ctx, x, weight)
        return self.cb(x, name, il)

    def mm(self, weight: Tensor, x: Tensor) -> Tensor:
        return ggml.ggml_mul_mat(self.ctx, weight, x)

    def expand(self, t: Tensor) -> None:
        ggml.ggml_build_forward_expand(self.gf, t)

    def view(self, t: Tensor, shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> Tensor:
        c = self.ctx
        if len(shape) == 1:
            return ggml.ggml_view_1d(c, t, shape[0], offset)
        if len(shape) == 2:
            return ggml.ggml_view_2d(c, t, shape[0], shape[1], strides[0], offset)
        if len(shape) == 3:
            return ggml.ggml_view_3d(c, t, shape[0], shape[1], shape[2], strides[0], strides[1], offset)
        return ggml.ggml_view_4d(c, t, *shape, *strides, offset)

    # --- the model ----------------------------------------------------------------------------
    def attention_inputs(self) -> None:
        ub = self.ub
        self.inp_pos = self.input("inp_pos", ggml.GGML_TYPE_I32, ub.n_tokens)
        if ub.n_outputs != ub.n_tokens:
            self.out_ids = self.input("inp_out_ids", ggml.GGML_TYPE_I32, ub.n_outputs)
        if self.hp.attention_layers or ub.mtp:
            self.kq_mask = self.input("kq_mask", ggml.GGML_TYPE_F32, ub.n_kv, ub.n_seq_tokens, 1, ub.n_seqs)
            self.kv_idxs = self.input("kv_idxs", ggml.GGML_TYPE_I64, ub.n_tokens)
            # V is stored transposed: each value element is its own row, at (seq, channel, cell)
            self.v_idxs = self.input("v_idxs", ggml.GGML_TYPE_I64, self.hp.head_dim * self.hp.n_head_kv * ub.n_tokens)

    def head(self, x: Tensor, norm: Tensor, lm_head: Tensor) -> None:
        """Final norm (kept as output `result_norm`: the hidden state MTP drafts from) and LM head."""
        x = self.rms_norm(x, norm, "result_norm", -1)
        ggml.ggml_set_output(x)
        self.expand(x)
        self.io["result_norm"] = x
        logits = self.cb(self.mm(lm_head, x), "result_output")
        ggml.ggml_set_output(logits)
        self.expand(logits)
        self.io["result_output"] = logits

    def forward(self) -> dict[str, Tensor]:
        hp, ub, c = self.hp, self.ub, self.ctx
        n_tokens = ub.n_tokens
        tokens = self.input("inp_tokens", ggml.GGML_TYPE_I32, n_tokens)
        self.attention_inputs()
        if hp.linear_layers:
            self.s_copy = self.input("rs_s_copy", ggml.GGML_TYPE_I32, ub.n_seqs)
            self.kw = min(ub.n_seq_tokens + 1, self.mem.rs_slots)
            self.slot_rev = self.input("rs_s_slot_rev", ggml.GGML_TYPE_I32, self.kw)

        x = ggml.ggml_get_rows(c, self.w["token_embd.weight"], tokens)
        self.cb(x, "inp_embd")
        for il in range(hp.n_layer):
            x = self.block(x, il, last=il == hp.n_layer - 1)
        self.head(x, self.w["output_norm.weight"], self.w.get("output.weight", self.w["token_embd.weight"]))
        return self.io

    def block(self, x: Tensor, il: int, last: bool) -> Tensor:
        """One decoder block: norm, token mixer, residual, norm, MoE, residual."""
        c, ub = self.ctx, self.ub
        residual = x
        cur = self.rms_norm(x, self.w[f"blk.{il}.attn_norm.weight"], "attn_norm", il)
        # Emit the previous layer and this norm before the state reads below, so the graph runs
        # layer by layer: ggml's scheduler then puts this layer's state gather on this layer's
        # device, not the previous one's (a layer split over devices or RPC servers would copy
        # the whole state across and back on every ubatch).
        self.expand(cur)
        if il < self.hp.n_layer and self.hp.recurrent[il]:
            cur = self.linear_attention(cur, il)
        else:
            cur = self.full_attention(cur, il)
        if last and ub.n_outputs != ub.n_tokens:
            cur = ggml.ggml_get_rows(c, cur, self.out_ids)
            residual = ggml.ggml_get_rows(c, residual, self.out_ids)
        cur = self.cb(ggml.ggml_add(c, cur, residual), "attn_residual", il)
        ffn_in = self.rms_norm(cur, self.w[f"blk.{il}.post_attention_norm.weight"], "attn_post_norm", il)
        return self.cb(ggml.ggml_add(c, self.moe(ffn_in, il), cur), "l_out", il)

    def forward_mtp(self) -> dict[str, Tensor]:
        """The MTP block: next token's embedding and the trunk's hidden state -> logits one further.

        x = eh_proj(concat(enorm(embed(token)), hnorm(hidden))), then one full-attention block with
        its MoE (its own KV cache), then shared_head_norm (or output_norm) and the LM head
        (shared_head_head, or the trunk's). `mtp_out` (before the final norm) is what a chained
        draft feeds back as the next hidden state.
        """
        hp, ub, c, w = self.hp, self.ub, self.ctx, self.w
        il = hp.n_layer
        p = f"blk.{il}.nextn."
        tokens = self.input("mtp_tokens", ggml.GGML_TYPE_I32, ub.n_tokens)
        hidden = self.input("mtp_hidden", ggml.GGML_TYPE_F32, hp.n_embd, ub.n_tokens)
        self.attention_inputs()
        embed = w.get(p + "embed_tokens.weight", w["token_embd.weight"])
        e = self.rms_norm(ggml.ggml_get_rows(c, embed, tokens), w[p + "enorm.weight"], "mtp_enorm", il)
        h = self.rms_norm(hidden, w[p + "hnorm.weight"], "mtp_hnorm", il)
        x = self.cb(self.mm(w[p + "eh_proj.weight"], ggml.ggml_concat(c, e, h, 0)), "mtp_eh_proj", il)
        x = self.block(x, il, last=True)
        self.cb(x, "mtp_out")
        ggml.ggml_set_output(x)
        self.io["mtp_out"] = x
        norm = w.get(p + "shared_head_norm.weight", w["output_norm.weight"])
        lm_head = w.get(p + "shared_head_head.weight", w.get("output.weight", w["token_embd.weight"]))
        self.head(x, norm, lm_head)
        return self.io

    # --- full attention -----------------------------------------------------------------------
    def full_attention(self, cur: Tensor, il: int) -> Tensor:
        hp, ub, c, w = self.hp, self.ub, self.ctx, self.w
        p = f"blk.{il}."
        hd, nh, nkv = hp.head_dim, hp.n_head, hp.n_head_kv
        T, N = ub.n_seq_tokens, ub.n_seqs
        n_tokens = ub.n_tokens

        qg = self.cb(self.mm(w[p + "attn_q.weight"], cur), "Qcur_full", il)
        qg = ggml.ggml_reshape_4d(c, qg, hd * 2, nh, n_tokens, 1)
        q = self.view(qg, (hd, nh, n_tokens, 1), nb(qg)[1:], 0)
        gate = self.cb(self.view(qg, (hd, nh, n_tokens, 1), nb(qg)[1:], hd * ggml.ggml_element_size(qg)), "gate", il)
        k = ggml.ggml_reshape_3d(c, self.mm(w[p + "attn_k.weight"], cur), hd, nkv, n_tokens)
        v = self.cb(self.mm(w[p + "attn_v.weight"], cur), "Vcur", il)

        q = self.rms_norm(q, w[p + "attn_q_norm.weight"], "Qcur_normed", il)
        k = self.rms_norm(k, w[p + "attn_k_norm.weight"], "Kcur_normed", il)
        q = ggml.ggml_reshape_3d(c, q, hd, nh, n_tokens)
        rope = dict(n_dims=hp.n_rot, mode=ggml.GGML_ROPE_TYPE_NEOX, n_ctx_orig=hp.n_ctx_train,
                    freq_base=hp.rope_freq_base)
        q = self.cb(self._rope(q, **rope), "Qcur", il)
        k = self.cb(self._rope(k, **rope), "Kcur", il)

        # store K rows and V elements of this ubatch into the cache (V transposed, see Memory);
        # later reads go through views of the stored tensors
        k_cache, v_cache = self.mem.k[il], self.mem.v[il]
        width = hd * nkv
        k2 = ggml.ggml_reshape_2d(c, k, width, n_tokens)
        k_store = self.cb(ggml.ggml_set_rows(c, k_cache, k2, self.kv_idxs), "k_cache_store", il)
        v_rows = ggml.ggml_reshape_2d(c, v_cache, 1, ggml.ggml_nelements(v_cache))
        v_store = self.cb(ggml.ggml_set_rows(c, v_rows, ggml.ggml_reshape_2d(c, v, 1, width * n_tokens), self.v_idxs),
                          "v_cache_store", il)

        n_kv, n_ctx = ub.n_kv, self.mem.n_ctx
        row_k, esz_k = nb(k_cache)[1], ggml.ggml_element_size(k_cache)
        row_v = n_ctx * ggml.ggml_element_size(v_cache)
        k_view = self.cb(self.view(k_store, (hd, n_kv, nkv, N), (row_k, hd * esz_k, n_ctx * row_k),
                                   ub.seq_head * n_ctx * row_k), "k_view", il)
        v_view = self.cb(self.view(v_store, (n_kv, hd, nkv, N), (row_v, hd * row_v, width * row_v),
                                   ub.seq_head * width * row_v), "v_view", il)                # [n_kv, hd, nkv, N]

        q = ggml.ggml_permute(c, ggml.ggml_reshape_4d(c, q, hd, nh, T, N), 0, 2, 1, 3)  # [hd, T, nh, N]
        kq = self.cb(ggml.ggml_mul_mat(c, k_view, q), "kq", il)                           # [n_kv, T, nh, N]
        kq = self.cb(ggml.ggml_soft_max_ext(c, kq, self.kq_mask, 1.0 / math.sqrt(hd), 0.0), "kq_soft_max", il)
        kqv = self.cb(ggml.ggml_mul_mat(c, v_view, kq), "kqv", il)                        # [hd, T, nh, N]
        out = ggml.ggml_cont_2d(c, ggml.ggml_permute(c, kqv, 0, 2, 1, 3), hd * nh, n_tokens)
        self.cb(out, "attn_pregate", il)

        gate = ggml.ggml_sigmoid(c, ggml.ggml_cont_2d(c, gate, hd * nh, n_tokens))
        out = self.cb(ggml.ggml_mul(c, out, gate), "attn_gated", il)
        return self.cb(self.mm(w[p + "attn_output.weight"], out), "attn_output", il)

    def _rope(self, x: Tensor, n_dims: int, mode: int, n_ctx_orig: int, freq_base: float) -> Tensor:
        return ggml.ggml_rope_ext(self.ctx, x, self.inp_pos, None, n_dims, mode, n_ctx_orig, freq_base,
                                  1.0, 0.0, 1.0, 32.0, 1.0)

    # --- linear attention (gated delta net) ---------------------------------------------------
    def linear_attention(self, cur: Tensor, il: int) -> Tensor:
        hp, ub, c, w = self.hp, self.ub, self.ctx, self.w
        p = f"blk.{il}."
        S, nk, nv = hp.ssm_d_state, hp.ssm_n_k_heads, hp.ssm_n_v_heads
        r = nv // nk
        T, N = ub.n_seq_tokens, ub.n_seqs
        K = self.mem.rs_slots
        f32 = 4

        qkv, z = self.qkvz(cur, il)                                    # [conv_dim, T, N], [value_dim, T*N]

        ba = self.cb(self.mm(w[p + "ssm_ba.weight"], cur), "linear_attn_mixed_ba", il)
        ba = ggml.ggml_reshape_4d(c, ba, 2 * r, nk, T, N)
        b = ggml.ggml_cont(c, self.view(ba, (r, nk, T, N), nb(ba)[1:], 0))
        a = ggml.ggml_cont_3d(c, self.view(ba, (r, nk, T, N), nb(ba)[1:], r * f32), nv, T, N)
        beta = ggml.ggml_reshape_4d(c, ggml.ggml_sigmoid(c, b), 1, nv, T, N)
        g = ggml.ggml_softplus(c, ggml.ggml_add(c, a, w[p + "ssm_dt.bias"]))
        g = self.cb(ggml.ggml_mul(c, g, w[p + "ssm_a"]), "gate", il)
        g = ggml.ggml_reshape_4d(c, g, 1, nv, T, N)

        # conv state: gather this ubatch's cells (all K slots), read slot 0 as the live state
        conv_all = self.mem.conv[il]                                   # [(d_conv-1)*K*conv_dim, n_cells]
        dc1, ch = hp.ssm_d_conv - 1, hp.conv_dim
        gathered = ggml.ggml_get_rows(c, conv_all, self.s_copy)        # [(d_conv-1)*K*conv_dim, N]
        conv_states = self.cb(self.view(gathered, (dc1, ch, N), (K * dc1 * f32, nb(gathered)[1]), 0),
                              "conv_states", il)
        conv_input = ggml.ggml_concat(c, conv_states, ggml.ggml_transpose(c, qkv), 0)
        self.cb(conv_input, "conv_input", il)                          # [d_conv-1+T, conv_dim, N]
        self.write_conv_slots(conv_all, conv_input, il)

        conv_out = ggml.ggml_ssm_conv(c, conv_input, w[p + "ssm_conv1d.weight"])
        self.cb(conv_out, "conv_output_raw", il)
        conv_out = self.cb(ggml.ggml_silu(c, conv_out), "conv_output_silu", il)   # [conv_dim, T, N]

        row = nb(conv_out)[1]
        q = self.view(conv_out, (S, nk, T, N), (S * f32, row, row * T), 0)
        k = self.view(conv_out, (S, nk, T, N), (S * f32, row, row * T), hp.key_dim * f32)
        v = self.view(conv_out, (S, nv, T, N), (S * f32, row, row * T), 2 * hp.key_dim * f32)
        q = ggml.ggml_l2_norm(c, q, hp.rms_eps)
        k = ggml.ggml_l2_norm(c, k, hp.rms_eps)
        if r > 1:  # value head j*r+i reads key head j (repeat-interleave), as llama.cpp does
            q = ggml.ggml_reshape_4d(c, ggml.ggml_repeat_4d(
                c, ggml.ggml_reshape_4d(c, q, S, 1, nk, T * N), S, r, nk, T * N), S, nv, T, N)
            k = ggml.ggml_reshape_4d(c, ggml.ggml_repeat_4d(
                c, ggml.ggml_reshape_4d(c, k, S, 1, nk, T * N), S, r, nk, T * N), S, nv, T, N)
        self.cb(q, "q_conv_predelta", il)
        self.cb(k, "k_conv_predelta", il)
        v = self.cb(ggml.ggml_cont(c, v), "v_conv_predelta", il)

        ssm_all = self.mem.ssm[il]                                     # [D, n_cells, K]
        D = hp.ssm_state_size
        live = self.view(ssm_all, (D, self.mem.n_cells), (nb(ssm_all)[1],), 0)
        state = ggml.ggml_reshape_4d(c, ggml.ggml_get_rows(c, live, self.s_copy), S, S, nv, N)
        self.cb(state, "state_predelta", il)

        if ub.delta_net == "fused":
            out, snaps = self.delta_net_fused(q, k, v, g, beta, state, K)
        else:
            out, snaps = self.delta_net_primitive(q, k, v, g, beta, state, K, il)
        self.cb(out, "attn_output", il)
        n_written = min(T, K)
        dst = self.view(ssm_all, (D, N, n_written), (nb(ssm_all)[1], nb(ssm_all)[2]), ub.seq_head * nb(ssm_all)[1])
        self.expand(self.cb(ggml.ggml_cpy(c, snaps, dst), "ssm_state_store", il))
        if T < K:
            # slot T: the state the ubatch started from (its conv window is slot T too), so that
            # the whole ubatch can be rolled back; slots beyond stay unwritten
            start = self.view(ssm_all, (D, N), (nb(ssm_all)[1],), T * nb(ssm_all)[2] + ub.seq_head * nb(ssm_all)[1])
            self.expand(self.cb(ggml.ggml_cpy(c, ggml.ggml_reshape_2d(c, state, D, N), start),
                                "ssm_state_store_start", il))

        z4 = ggml.ggml_reshape_4d(c, z, S, nv, T, N)
        normed = self.rms_norm(out, w[p + "ssm_norm.weight"], "attn_norm_gated", il)
        gated = ggml.ggml_mul(c, normed, ggml.ggml_silu(c, z4))
        final = self.cb(ggml.ggml_reshape_2d(c, gated, hp.value_dim, T * N), "final_output", il)
        return self.cb(self.mm(w[p + "ssm_out.weight"], final), "linear_attn_out", il)

    def qkvz(self, cur: Tensor, il: int) -> tuple[Tensor, Tensor]:
        """The conv input channels q|k|v per token, and the gate z, from either projection form."""
        hp, ub, c, w = self.hp, self.ub, self.ctx, self.w
        p = f"blk.{il}."
        T, N = ub.n_seq_tokens, ub.n_seqs
        if p + "attn_qkv.weight" in w:
            qkv = self.cb(self.mm(w[p + "attn_qkv.weight"], cur), "linear_attn_qkv_mixed", il)
            z = self.cb(self.mm(w[p + "attn_gate.weight"], cur), "z", il)
            return ggml.ggml_reshape_3d(c, qkv, hp.conv_dim, T, N), z
        # legacy ssm_in: rows grouped per key head g as [q_g, k_g, v_g (r heads), z_g (r heads)]
        S, nk, r = hp.ssm_d_state, hp.ssm_n_k_heads, hp.ssm_n_v_heads // hp.ssm_n_k_heads
        m = self.cb(self.mm(w[p + "ssm_in.weight"], cur), "linear_attn_mixed_qkvz", il)
        m = ggml.ggml_reshape_4d(c, m, 2 * S + 2 * r * S, nk, T, N)
        strides = nb(m)[1:]
        parts = []
        offset = 0
        for size in (S, S, r * S, r * S):
            parts.append(ggml.ggml_cont_3d(c, self.view(m, (size, nk, T, N), strides, offset * 4), size * nk, T, N))
            offset += size
        qf, kf, vf, zf = parts
        qkv = ggml.ggml_concat(c, ggml.ggml_concat(c, qf, kf, 0), vf, 0)
        self.cb(qkv, "qkv_mixed", il)
        return qkv, self.cb(ggml.ggml_reshape_2d(c, zf, hp.value_dim, T * N), "z", il)

    def write_conv_slots(self, conv_all: Tensor, conv_input: Tensor, il: int) -> None:
        """Store the last Kw conv windows into slots Kw-1..0 with ONE set_rows.

        The source is a view of one (d_conv-1)-wide window, widened to Kw windows that overlap
        by d_conv-2 columns (row stride one element); the destination is the 4D view
        [d_conv-1, K, channels, n_seqs] of this ubatch's cells; `rs_s_slot_rev` = {Kw-1..0}
        sends the newest window to slot 0.
        """
        hp, ub, c = self.hp, self.ub, self.ctx
        K, Kw, dc1, ch = self.mem.rs_slots, self.kw, hp.ssm_d_conv - 1, hp.conv_dim
        T, N = ub.n_seq_tokens, ub.n_seqs
        f32 = 4
        src = self.view(conv_input, (dc1, 1, ch, N), (f32, nb(conv_input)[1], nb(conv_input)[2]),
                        (T - (Kw - 1)) * f32)
        src.contents.ne[1] = Kw
        self.cb(src, "conv_state_windows", il)
        dst = self.view(conv_all, (dc1, K, ch, N), (dc1 * f32, K * dc1 * f32, nb(conv_all)[1]),
                        ub.seq_head * nb(conv_all)[1])
        self.expand(self.cb(ggml.ggml_set_rows(c, dst, src, self.slot_rev), "conv_state_store", il))

    # --- delta rule ---------------------------------------------------------------------------
    def delta_net_fused(self, q, k, v, g, beta, state, K: int) -> tuple[Tensor, Tensor]:
        """ggml's fused op; returns the output [S, H, T, N] and the snapshots [D, N, min(T, K)]."""
        c, ub = self.ctx, self.ub
        S, H = ne(v)[0], ne(v)[1]
        T, N = ub.n_seq_tokens, ub.n_seqs
        res = ggml.ggml_gated_delta_net(c, q, k, v, g, beta, state, K)
        f32 = 4
        out = self.view(res, (S, H, T, N), (S * f32, S * H * f32, S * H * T * f32), 0)
        D = S * S * H
        snaps = self.view(res, (D, N, min(T, K)), (D * f32, D * N * f32), S * H * T * N * f32)
        return out, snaps

    def delta_net_primitive(self, q, k, v, g, beta, state, K: int, il: int) -> tuple[Tensor, Tensor]:
        """The delta rule from elementary ops: the one-token recurrence, or the chunked form."""
        if self.ub.n_seq_tokens == 1:
            return self._delta_net_step(q, k, v, g, beta, state, il)
        return self._delta_net_chunked(q, k, v, g, beta, state, K, il)

    def _delta_net_step(self, q, k, v, g, beta, state, il: int) -> tuple[Tensor, Tensor]:
        """M <- exp(g) M;  d = beta (v - M^T k);  M <- M + k d^T;  o = M^T q / sqrt(S)."""
        c = self.ctx
        S, H, _, N = ne(v)
        q = ggml.ggml_scale(c, ggml.ggml_reshape_4d(c, q, S, 1, H, N), 1.0 / math.sqrt(S))
        k = ggml.ggml_reshape_4d(c, k, S, 1, H, N)
        v = ggml.ggml_reshape_4d(c, v, S, 1, H, N)
        g = ggml.ggml_reshape_4d(c, g, 1, 1, H, N)
        beta = ggml.ggml_reshape_4d(c, beta, 1, 1, H, N)
        m = ggml.ggml_mul(c, state, ggml.ggml_exp(c, g))                   # [S_k, S_v, H, N]
        kv_mem = ggml.ggml_mul_mat(c, m, k)                                 # [S_v, 1, H, N]
        d = ggml.ggml_mul(c, ggml.ggml_sub(c, v, kv_mem), beta)             # [S_v, 1, H, N]
        outer = ggml.ggml_mul_mat(c, ggml.ggml_reshape_4d(c, k, 1, S, H, N),
                                  ggml.ggml_reshape_4d(c, d, 1, S, H, N))  # [S_k, S_v, H, N]
        m = self.cb(ggml.ggml_add(c, m, outer), "dnet_step_state", il)
        o = ggml.ggml_mul_mat(c, m, q)                                      # [S_v, 1, H, N]
        out = ggml.ggml_reshape_4d(c, o, S, H, 1, N)
        return out, ggml.ggml_reshape_3d(c, m, S * S * H, N, 1)

    def _delta_net_chunked(self, q, k, v, g, beta, state, K: int, il: int) -> tuple[Tensor, Tensor]:
        """Chunked (WY) form of the gated delta rule over chunks of C tokens.

        Within a chunk with cumulative log-decay G and start state M0:
          (I + A) U = B V,  (I + A) W = B e^G K   with A[t,s] = b_t e^(G_t-G_s) k_t.k_s (s < t)
          Delta = U - W M0
          O = e^G Q M0 + (L o Q K^T) Delta        with L[t,s] = e^(G_t-G_s) (s <= t)
          M_end = e^(G_last) M0 + K^T diag(e^(G_last - G)) Delta
        Zero padding to a whole chunk adds tokens with beta = 0 and g = 0, which change nothing.
        """
        c = self.ctx
        S, H, T, N = ne(v)
        C = CHUNK_SIZE
        pad = (C - T % C) % C
        nc = (T + pad) // C
        HN = H * N

        def chunked(x: Tensor, width: int) -> Tensor:  # [width, H, T, N] -> [width, C, nc, H*N]
            x = ggml.ggml_cont(c, ggml.ggml_permute(c, x, 0, 2, 1, 3))     # [width, T, H, N]
            if pad:
                x = ggml.ggml_pad(c, x, 0, pad, 0, 0)
            return ggml.ggml_reshape_4d(c, x, width, C, nc, HN)

        q = chunked(ggml.ggml_scale(c, q, 1.0 / math.sqrt(S)), S)
        k = chunked(k, S)
        v = chunked(v, S)
        gc = ggml.ggml_reshape_4d(c, chunked(g, 1), C, nc, HN, 1)          # [C, nc, HN]
        bc = chunked(beta, 1)                                              # [1, C, nc, HN]

        G = self.cb(ggml.ggml_cumsum(c, gc), "dnet_g_cumsum", il)          # [C, nc, HN, 1]
        G_row = ggml.ggml_reshape_4d(c, G, 1, C, nc, HN)                   # G_t along ne1
        G_col = ggml.ggml_reshape_4d(c, G, C, 1, nc, HN)                   # G_s along ne0
        diff = ggml.ggml_sub(c, ggml.ggml_repeat_4d(c, G_row, C, C, nc, HN), G_col)   # (s, t): G_t - G_s
        L = ggml.ggml_tri(c, ggml.ggml_exp(c, diff), ggml.GGML_TRI_TYPE_LOWER_DIAG)  # s <= t
        self.cb(L, "dnet_decay", il)

        kk = ggml.ggml_mul_mat(c, k, k)                                    # (s, t): k_s . k_t
        A = ggml.ggml_tri(c, ggml.ggml_mul(c, ggml.ggml_mul(c, kk, L), bc), ggml.GGML_TRI_TYPE_LOWER)
        ident = ggml.ggml_diag(c, ggml.ggml_fill(c, ggml.ggml_view_2d(c, G, C, 1, nb(G)[1], 0), 1.0))
        lhs = self.cb(ggml.ggml_add(c, A, ident), "dnet_lhs", il)          # I + A, lower triangular
        eG = ggml.ggml_exp(c, G_row)                                       # [1, C, nc, HN]
        U = ggml.ggml_solve_tri(c, lhs, ggml.ggml_mul(c, v, bc), True, True, False)            # [S, C, nc, HN]
        W = ggml.ggml_solve_tri(c, lhs, ggml.ggml_mul(c, k, ggml.ggml_mul(c, bc, eG)), True, True, False)
        QK = ggml.ggml_mul(c, ggml.ggml_mul_mat(c, k, q), L)               # (s, t): e^(G_t-G_s) q_t . k_s
        G_last = self.view(G, (1, 1, nc, HN), (nb(G)[1], nb(G)[1], nb(G)[2]), (C - 1) * 4)
        to_end = ggml.ggml_exp(c, ggml.ggml_sub(c, ggml.ggml_repeat_4d(c, G_last, 1, C, nc, HN), G_row))
        KdT = ggml.ggml_cont(c, ggml.ggml_transpose(c, ggml.ggml_mul(c, k, to_end)))  # [C, S, nc, HN]
        eG_last = ggml.ggml_exp(c, ggml.ggml_cont(c, G_last))               # [1, 1, nc, HN]

        def chunk(t: Tensor, i: int) -> Tensor:
            return self.view(t, (ne(t)[0], ne(t)[1], 1, ne(t)[3]), nb(t)[1:], i * nb(t)[2])

        m = ggml.ggml_reshape_4d(c, state, S, S, 1, HN)                     # (k, v) per head
        outs, starts, deltas = [], [], []
        for i in range(nc):
            starts.append(m)
            delta = ggml.ggml_sub(c, chunk(U, i), ggml.ggml_mul_mat(c, m, chunk(W, i)))    # [S_v, C]
            delta_t = ggml.ggml_cont(c, ggml.ggml_transpose(c, delta))                      # [C, S_v]
            deltas.append(delta_t)
            inter = ggml.ggml_mul(c, ggml.ggml_mul_mat(c, m, chunk(q, i)), chunk(eG, i))
            intra = ggml.ggml_mul_mat(c, delta_t, chunk(QK, i))
            outs.append(ggml.ggml_add(c, inter, intra))                                     # [S_v, C]
            m = ggml.ggml_add(c, ggml.ggml_mul(c, m, chunk(eG_last, i)),
                              ggml.ggml_mul_mat(c, chunk(KdT, i), delta_t))
            self.cb(m, f"dnet_chunk{i}_state", il)
        o = outs[0]
        for part in outs[1:]:
            o = ggml.ggml_concat(c, o, part, 2)                                             # [S_v, C, nc, HN]
        o = self.view(o, (S, T, H, N), (nb(o)[1], nb(o)[2] * nc, nb(o)[2] * nc * H), 0)
        out = ggml.ggml_cont(c, ggml.ggml_permute(c, o, 0, 2, 1, 3))                        # [S, H, T, N]

        # snapshots: slot 0 is the final state; slot r is the state after token T-1-r
        snaps = [ggml.ggml_reshape_3d(c, m, S * S * H, N, 1)]
        for r in range(1, min(T, K)):
            t = T - 1 - r
            i, l = divmod(t, C)
            decay_row = self.view(chunk(L, i), (1, C, 1, HN), (nb(L)[1] // C, nb(L)[2], nb(L)[3]), l * nb(L)[1])
            kd_t = ggml.ggml_cont(c, ggml.ggml_transpose(c, ggml.ggml_mul(c, chunk(k, i), decay_row)))
            e_l = ggml.ggml_exp(c, self.view(G, (1, 1, 1, HN), (nb(G)[1], nb(G)[2], nb(G)[2]), l * 4 + i * nb(G)[1]))
            m_t = ggml.ggml_add(c, ggml.ggml_mul(c, starts[i], e_l), ggml.ggml_mul_mat(c, kd_t, deltas[i]))
            snaps.append(ggml.ggml_reshape_3d(c, m_t, S * S * H, N, 1))
        snap = snaps[0]
        for s in snaps[1:]:
            snap = ggml.ggml_concat(c, snap, s, 2)
        return out, snap

    # --- MoE ----------------------------------------------------------------------------------
    def moe(self, cur: Tensor, il: int) -> Tensor:
        hp, c, w = self.hp, self.ctx, self.w
        p = f"blk.{il}."
        n_tokens = ne(cur)[1]
        k_used, n_exp, ff = hp.n_expert_used, hp.n_expert, hp.n_ff_exp

        logits = self.cb(self.mm(w[p + "ffn_gate_inp.weight"], cur), "ffn_moe_logits", il)  # [n_exp, n_tokens]
        probs = self.cb(ggml.ggml_soft_max(c, logits), "ffn_moe_probs", il)
        selected = self.cb(ggml.ggml_argsort_top_k(c, probs, k_used), "ffn_moe_topk", il)      # [k, n_tokens]
        weights = ggml.ggml_get_rows(c, ggml.ggml_reshape_3d(c, probs, 1, n_exp, n_tokens), selected)
        weights = ggml.ggml_reshape_2d(c, weights, k_used, n_tokens)
        weights = ggml.ggml_div(c, weights, ggml.ggml_sum_rows(c, weights))
        weights = self.cb(ggml.ggml_reshape_3d(c, weights, 1, k_used, n_tokens), "ffn_moe_weights_norm", il)

        x = ggml.ggml_reshape_3d(c, cur, hp.n_embd, 1, n_tokens)
        if p + "ffn_gate_up_exps.weight" in w:
            gu = ggml.ggml_mul_mat_id(c, w[p + "ffn_gate_up_exps.weight"], x, selected)       # [2ff, k, n]
            gate = self.view(gu, (ff, k_used, n_tokens), nb(gu)[1:3], 0)
            up = self.view(gu, (ff, k_used, n_tokens), nb(gu)[1:3], ff * 4)
        else:
            gate = ggml.ggml_mul_mat_id(c, w[p + "ffn_gate_exps.weight"], x, selected)
            up = ggml.ggml_mul_mat_id(c, w[p + "ffn_up_exps.weight"], x, selected)
        par = self.cb(ggml.ggml_swiglu_split(c, gate, up), "ffn_moe_swiglu", il)
        experts = ggml.ggml_mul_mat_id(c, w[p + "ffn_down_exps.weight"], par, selected)     # [E, k, n]
        experts = self.cb(ggml.ggml_mul(c, experts, weights), "ffn_moe_weighted", il)
        moe = self.view(experts, (hp.n_embd, n_tokens), (nb(experts)[2],), 0)
        for j in range(1, k_used):
            moe = ggml.ggml_add(c, moe, self.view(experts, (hp.n_embd, n_tokens), (nb(experts)[2],), j * nb(experts)[1]))
        self.cb(moe, "ffn_moe_out", il)

        sh = ggml.ggml_swiglu_split(c, self.mm(w[p + "ffn_gate_shexp.weight"], cur),
                                    self.mm(w[p + "ffn_up_shexp.weight"], cur))
        sh = self.cb(self.mm(w[p + "ffn_down_shexp.weight"], sh), "ffn_shexp", il)
        sh_gate = ggml.ggml_sigmoid(c, self.mm(w[p + "ffn_gate_inp_shexp.weight"], cur))   # [1, n_tokens]
        sh = self.cb(ggml.ggml_mul(c, sh, sh_gate), "ffn_shexp_gated", il)
        return self.cb(ggml.ggml_add(c, moe, sh), "ffn_out", il)

