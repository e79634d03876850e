"""Plain-numpy float64 reference of the Qwen3.5 forward pass (`qwen35` dense, `qwen35moe`), trunk
and MTP head, computed from Hugging Face-order weights.

Written from the math of transformers' `modeling_qwen3_5.py` / `modeling_qwen3_5_moe.py` (and, for
the MTP block that transformers does not run, llama.cpp's `graph_mtp` in `src/models/qwen35*.cpp`),
not from the GGUF layout: it takes the dict `hf_weights()` makes (names such as
`model.layers.0.linear_attn.in_proj_qkv.weight`, torch shapes) and never sees the converter's
value-head reorder. Where the math is qwen3next's it calls the same functions (`tests/reference.py`):
delta-net scan, gated attention, MoE, norms.

What is Qwen3.5's own:
* RMSNorm is zero-centred: x_normed * (1 + w) (`Qwen3_5RMSNorm`); the gated norm of the delta net
  multiplies by w as it is (`Qwen3_5RMSNormGated`);
* beta = sigmoid(in_proj_b x), g = -exp(A_log) * softplus(in_proj_a x + dt_bias), separate
  projections; q/k heads broadcast to value heads grouped (repeat_interleave) in HF order;
* interleaved multi-section rope on the first head_dim * partial_rotary_factor dims, with three
  position streams (temporal, height, width; equal for text) as `Qwen3_5TextRotaryEmbedding`
  computes it (`rope_imrope`).
The L2 norm of q/k uses ggml's x / max(|x|, eps) where HF has x / sqrt(|x|^2 + 1e-6): the relative
difference is below 1e-7 for the vectors here.
"""

from __future__ import annotations

import numpy as np

from reference import (ReferenceState, RefHParams, delta_net_scan, full_attention, moe, rmsnorm, rotate_neox, sigmoid,
                       silu, softplus)

__all__ = ["Qwen35Reference", "rope_imrope", "hparams_of"]


def rope_imrope(x, pos_thw, n_rot: int, base: float, sections) -> np.ndarray:
    """HF's interleaved M-RoPE on the first n_rot dims of x's last axis.

    pos_thw: the (temporal, height, width) positions of the token. Frequency index i takes the
    height position when i % 3 == 1 and i < 3 * sections[1], the width one when i % 3 == 2 and
    i < 3 * sections[2], else the temporal one (`recomposition_frequencies`); then the rotate_half
    (NEOX) rotation.
    """
    half = n_rot // 2
    inv_freq = base ** (-2.0 * np.arange(half) / n_rot)
    stream = np.zeros(half, dtype=int)
    for dim in (1, 2):
        stream[dim: sections[dim] * 3: 3] = dim
    theta = np.asarray(pos_thw, dtype=np.float64)[stream] * inv_freq
    return rotate_neox(x, theta)


def hparams_of(cfg, n_vocab: int) -> RefHParams:
    """The shared reference's hyper-parameters for a `Qwen35Config`."""
    if cfg.linear_key_head_dim != cfg.linear_value_head_dim:
        raise ValueError("the reference assumes linear_key_head_dim == linear_value_head_dim")
    return RefHParams(
        n_layer=cfg.num_hidden_layers, n_embd=cfg.hidden_size, n_vocab=n_vocab,
        n_head=cfg.num_attention_heads, n_head_kv=cfg.num_key_value_heads, head_dim=cfg.head_dim,
        eps=cfg.rms_norm_eps, rope_base=cfg.rope_theta, n_rot=cfg.n_rot,
        n_expert=cfg.num_experts if cfg.moe else 0, n_expert_used=cfg.num_experts_per_tok if cfg.moe else 0,
        d_conv=cfg.linear_conv_kernel_dim, d_inner=cfg.value_dim, ssm_state=cfg.linear_key_head_dim,
        n_k_heads=cfg.linear_num_key_heads, n_v_heads=cfg.linear_num_value_heads,
        full_attention_interval=cfg.full_attention_interval, recurrent=list(cfg.recurrent),
    )


def _zc(w):
    """The multiplier of a zero-centred RMSNorm weight."""
    return 1.0 + w


class Qwen35Reference(ReferenceState):
    """Float64 Qwen3.5 from HF weights. API as tests/reference.py's ReferenceModel: reset, forward,
    clone, hidden, mtp_forward, conv_state / ssm_state / history (HF head order), kv_cache."""

    #: the gate of the delta net's output norm (Qwen3.5: SiLU; qwen4exp: its output_gate_type)
    gated_norm_gate = staticmethod(silu)

    def __init__(self, cfg, hf: dict[str, np.ndarray], n_vocab: int | None = None):
        self.cfg = cfg
        self.hf = {k: np.asarray(v, dtype=np.float64) for k, v in hf.items()}
        n_vocab = n_vocab or self.hf["model.embed_tokens.weight"].shape[0]
        self.hp = hparams_of(cfg, n_vocab)
        self._views = {il: self._block_view(f"model.layers.{il}.", self.hp.recurrent[il])
                       for il in range(cfg.num_hidden_layers)}
        if cfg.mtp_num_hidden_layers:
            self._mtp_view = self._block_view("mtp.layers.0.", recurrent=False)
        self.reset()

    # ---- weights in the shared reference's vocabulary (names only; norms as multipliers) ------

    def _block_view(self, p: str, recurrent: bool) -> dict[str, np.ndarray]:
        w = self.hf
        v = {}
        if p + "input_layernorm.weight" in w:   # qwen4exp's layers have none (hyper-connections)
            v = {"attn_norm": _zc(w[p + "input_layernorm.weight"]),
                 "post_attention_norm": _zc(w[p + "post_attention_layernorm.weight"])}
        if not recurrent:
            a = p + "self_attn."
            v.update({
                "attn_q.weight": w[a + "q_proj.weight"], "attn_k.weight": w[a + "k_proj.weight"],
                "attn_v.weight": w[a + "v_proj.weight"], "attn_output.weight": w[a + "o_proj.weight"],
                "attn_q_norm.weight": _zc(w[a + "q_norm.weight"]), "attn_k_norm.weight": _zc(w[a + "k_norm.weight"]),
            })
        if p + "mlp.gate.weight" in w:
            gu = w[p + "mlp.experts.gate_up_proj"]
            n_ff = gu.shape[1] // 2
            v.update({
                "ffn_gate_inp.weight": w[p + "mlp.gate.weight"],
                "ffn_gate_exps.weight": gu[:, :n_ff, :], "ffn_up_exps.weight": gu[:, n_ff:, :],
                "ffn_down_exps.weight": w[p + "mlp.experts.down_proj"],
                "ffn_gate_shexp.weight": w[p + "mlp.shared_expert.gate_proj.weight"],
                "ffn_up_shexp.weight": w[p + "mlp.shared_expert.up_proj.weight"],
                "ffn_down_shexp.weight": w[p + "mlp.shared_expert.down_proj.weight"],
                "ffn_gate_inp_shexp.weight": w[p + "mlp.shared_expert_gate.weight"],
            })
        else:
            v.update({"ffn_gate.weight": w[p + "mlp.gate_proj.weight"], "ffn_up.weight": w[p + "mlp.up_proj.weight"],
                      "ffn_down.weight": w[p + "mlp.down_proj.weight"]})
        return v

    # ---- state ----------------------------------------------------------------------------------

    def conv_state(self, layer: int) -> np.ndarray:
        """(d_conv-1, conv_dim), oldest first; channels in HF order (value heads grouped)."""
        return self._layers[layer]["conv"].copy()

    def ssm_state(self, layer: int) -> np.ndarray:
        """(n_v, S_k, S_v) per value head in HF (grouped) order; o = M^T q."""
        return self._layers[layer]["ssm"].copy()

    def history(self, layer: int) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(c.copy(), s.copy()) for c, s in self._layers[layer]["history"]]

    def kv_cache(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        st = self._layers[layer]
        return np.stack(st["k"]), np.stack(st["v"])

    def hidden(self) -> np.ndarray:
        """Residual stream (n_tokens, n_embd) before the final norm, for the last forward call."""
        return self._last_hidden.copy()

    # ---- blocks ---------------------------------------------------------------------------------

    def _rope(self, x, pos):
        """pos: a text position (t = h = w) or an image token's (t, h, w) streams."""
        cfg = self.cfg
        thw = tuple(pos) if isinstance(pos, (tuple, list, np.ndarray)) else (pos, pos, pos)
        return rope_imrope(x, thw, cfg.n_rot, cfg.rope_theta, cfg.mrope_section)

    def _linear_attention(self, p: str, h, state):
        """Qwen3_5GatedDeltaNet.forward on h (T, n_embd), HF weights and head order."""
        w, hp = self.hf, self.hp
        q = p + "linear_attn."
        T, nv, S = h.shape[0], hp.n_v_heads, hp.ssm_state
        qkv = h @ w[q + "in_proj_qkv.weight"].T
        z = (h @ w[q + "in_proj_z.weight"].T).reshape(T, nv, S)
        beta = sigmoid(h @ w[q + "in_proj_b.weight"].T)
        gdecay = -np.exp(w[q + "A_log"]) * softplus(h @ w[q + "in_proj_a.weight"].T + w[q + "dt_bias"])
        conv_w = w[q + "conv1d.weight"][:, 0, :]          # (conv_dim, 1, K) depthwise kernel
        outs = delta_net_scan(state, hp, qkv, z, beta, gdecay, conv_w, None, w[q + "norm.weight"],
                              self.gated_norm_gate)
        return outs.reshape(T, nv * S) @ w[q + "out_proj.weight"].T

    def _decoder_layer(self, view, x, mix):
        """Pre-norm residual block: x + mix(attn_norm(x)), then + FFN(post_attention_norm(x))."""
        hp = self.hp
        x = x + mix(rmsnorm(x, hp.eps) * view["attn_norm"])
        return x + moe(view, "", hp, rmsnorm(x, hp.eps) * view["post_attention_norm"])

    # ---- forward --------------------------------------------------------------------------------

    def forward(self, tokens, embeddings=None, positions=None) -> np.ndarray:
        """Logits (n_tokens, n_vocab) for tokens appended to the sequence.

        `embeddings` (n_tokens, n_embd) replace the token embeddings (rows of NaN keep them): image
        embeddings in place of the pad tokens, as `Qwen3_5Model.forward`'s masked_scatter; `positions`
        are each token's rope position, an int (text) or a (t, h, w) tuple (`get_rope_index`); by
        default n_past, n_past + 1, ... The causal mask follows the sequence index either way."""
        hp, w = self.hp, self.hf
        tokens = [int(t) for t in tokens]
        T = len(tokens)
        if positions is None:
            positions = list(range(self.n_past, self.n_past + T))
        x = w["model.embed_tokens.weight"][tokens].copy()
        if embeddings is not None:
            rows = ~np.isnan(np.asarray(embeddings)).any(axis=1)
            x[rows] = np.asarray(embeddings, dtype=np.float64)[rows]
        for il in range(hp.n_layer):
            st, view = self._layers[il], self._views[il]
            if hp.recurrent[il]:
                def mix(h, p=f"model.layers.{il}.", st=st):
                    return self._linear_attention(p, h, st)
            else:
                def mix(h, view=view, st=st):
                    return full_attention(view, "", hp, h, positions, st["k"], st["v"], rope=self._rope)
            x = self._decoder_layer(view, x, mix)
        self._last_hidden = x.copy()
        self.n_past += T
        xn = rmsnorm(x, hp.eps) * _zc(w["model.norm.weight"])
        return xn @ self._lm_head().T

    def _lm_head(self):
        return self.hf.get("lm_head.weight", self.hf["model.embed_tokens.weight"])

    def final_norm(self, x) -> np.ndarray:
        """The trunk's final norm (what the MTP block takes as its hidden input)."""
        return rmsnorm(np.asarray(x, dtype=np.float64), self.hp.eps) * _zc(self.hf["model.norm.weight"])

    def mtp_forward(self, next_tokens, hiddens, embeddings=None, positions=None) -> tuple[np.ndarray, np.ndarray]:
        """The MTP block on rows (hidden_i, token_{i+1}) at the next MTP positions (0, 1, ... since
        reset); hiddens are the trunk's states after its final norm. `embeddings` (rows of NaN keep
        the token's) replace the next tokens' embeddings, as `forward`'s do (the next position is an
        image row: the block reads the input embeddings of the next positions, as vLLM's Qwen3.5
        MTP with images merged in); `positions` as `forward`'s, each row's (default 0, 1, ...).

        x = fc @ [rmsnorm(embed(token)) * (1 + pre_fc_norm_embedding) ; rmsnorm(hidden) * (1 +
        pre_fc_norm_hidden)], one full-attention decoder layer with its own KV cache, then
        rmsnorm * (1 + mtp.norm) and the LM head. Returns logits (T, n_vocab) and the block output
        (T, n_embd) before that norm.
        """
        hp, w = self.hp, self.hf
        tokens = [int(t) for t in next_tokens]
        T = len(tokens)
        start = len(self._mtp_kv["k"])
        if positions is None:
            positions = list(range(start, start + T))
        x = w["model.embed_tokens.weight"][tokens].copy()
        if embeddings is not None:
            rows = ~np.isnan(np.asarray(embeddings)).any(axis=1)
            x[rows] = np.asarray(embeddings, dtype=np.float64)[rows]
        e = rmsnorm(x, hp.eps) * _zc(w["mtp.pre_fc_norm_embedding.weight"])
        h = rmsnorm(np.asarray(hiddens, dtype=np.float64), hp.eps) * _zc(w["mtp.pre_fc_norm_hidden.weight"])
        x = np.concatenate([e, h], axis=1) @ w["mtp.fc.weight"].T
        view = self._mtp_view

        def mix(a):
            return full_attention(view, "", hp, a, positions, self._mtp_kv["k"], self._mtp_kv["v"], rope=self._rope)

        x = self._decoder_layer(view, x, mix)
        return (rmsnorm(x, hp.eps) * _zc(w["mtp.norm.weight"])) @ self._lm_head().T, x
