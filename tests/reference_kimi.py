"""Plain-numpy float64 reference of the Kimi-Linear forward pass, from Hugging Face-order weights.

Written from the math (transformers' `modular_kimi_linear.py`: `torch_recurrent_kda`,
`KimiLinearAttention` on DeepseekV3's MLA, `DeepseekV3MoE`; see docs/kimi-linear-gguf.md), not from
the GGUF layout: it takes the dict `models/kimi_linear.hf_weights()` makes (checkpoint names,
torch shapes: `self_attn.q_conv1d.weight` [channels, 1, d_conv], `A_log` [1, 1, H, 1],
`kv_b_proj.weight` [H (nope + v), kv_lora], one weight per expert) and never sees the converter's
split of kv_b, its `-exp(A_log)` or the stacked experts. Token by token:

* KDA: q, k, v = silu(depthwise causal conv(W x)) with their own kernels; per-channel log-decay
  g = -exp(A_log_h) softplus(W_fb W_fa x + dt_bias); beta = sigmoid(W_b x); q, k L2-normalised
  (x rsqrt(|x|^2 + 1e-6)), q / sqrt(d); S <- diag(exp g) S; S <- S + k (beta (v - S^T k))^T;
  o = S^T q; out = W_o (rmsnorm(o) w_o sigmoid(W_gb W_ga x));
* MLA, uncompressed (no weight absorption, no rope: Kimi's NoPE): q_h = [q_nope | q_pe];
  [c | k_pe] = W_kva x, c = rmsnorm(c) w; k_h = [W_kb_h c | k_pe], v_h = W_vb_h c; softmax over
  the past with scale 1/sqrt(nope + rope);
* MoE: s = sigmoid(W_r x), top-k of s + bias, weights s / sum(s) * routed_scaling_factor, plus
  the shared expert (no gate); the first `first_k_dense_replace` layers a dense SwiGLU MLP.
"""

from __future__ import annotations

import numpy as np

from reference import rmsnorm, sigmoid, silu, softplus

__all__ = ["KimiReference"]


def l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


def swiglu(x: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    return down @ (silu(gate @ x) * (up @ x))


class KimiReference:
    """The model on HF weights, with its caches; `forward(tokens)` returns every token's logits."""

    def __init__(self, cfg, hf: dict[str, np.ndarray]):
        self.cfg = cfg
        self.w = {k: np.asarray(v, dtype=np.float64) for k, v in hf.items()}
        self.reset()

    def reset(self) -> None:
        cfg = self.cfg
        H, d, C = cfg.num_attention_heads, cfg.kda_head_dim, cfg.short_conv_kernel_size
        #: per KDA layer: the last d_conv - 1 projected inputs of q, k, v (oldest first) and S [H, d_k, d_v]
        self.conv = {il: {x: np.zeros((C - 1, H * d)) for x in "qkv"} for il in range(cfg.num_hidden_layers)
                     if cfg.recurrent[il]}
        self.ssm = {il: np.zeros((H, d, d)) for il in self.conv}
        #: per MLA layer: each past token's normalised latent c and k_pe
        self.latent: dict[int, list[np.ndarray]] = {il: [] for il in range(cfg.num_hidden_layers) if not cfg.recurrent[il]}
        self.k_pe: dict[int, list[np.ndarray]] = {il: [] for il in self.latent}

    def forward(self, tokens: list[int]) -> np.ndarray:
        return np.stack([self.step(t) for t in tokens])

    def step(self, token: int) -> np.ndarray:
        cfg, w = self.cfg, self.w
        eps = cfg.rms_norm_eps
        h = w["model.embed_tokens.weight"][token]
        for il in range(cfg.num_hidden_layers):
            p = f"model.layers.{il}."
            x = rmsnorm(h, eps) * w[p + "input_layernorm.weight"]
            h = h + (self.kda(il, x) if cfg.recurrent[il] else self.mla(il, x))
            x = rmsnorm(h, eps) * w[p + "post_attention_layernorm.weight"]
            h = h + (self.moe(il, x) if il >= cfg.first_k_dense_replace else
                     swiglu(x, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], w[p + "mlp.down_proj.weight"]))
        return w["lm_head.weight"] @ (rmsnorm(h, eps) * w["model.norm.weight"])

    def kda(self, il: int, x: np.ndarray) -> np.ndarray:
        cfg, w = self.cfg, self.w
        p = f"model.layers.{il}.self_attn."
        H, d = cfg.num_attention_heads, cfg.kda_head_dim
        qkv = {}
        for name in "qkv":
            proj = w[p + f"{name}_proj.weight"] @ x
            window = np.vstack([self.conv[il][name], proj])               # [d_conv, channels], oldest first
            self.conv[il][name] = window[1:]
            kernel = w[p + f"{name}_conv1d.weight"][:, 0, :]               # [channels, d_conv]
            qkv[name] = silu((kernel.T * window).sum(0)).reshape(H, d)
        q = l2norm(qkv["q"]) / np.sqrt(d)
        k = l2norm(qkv["k"])
        v = qkv["v"]
        a = -np.exp(w[p + "A_log"].reshape(H, 1))
        g = a * softplus((w[p + "f_b_proj.weight"] @ (w[p + "f_a_proj.weight"] @ x)).reshape(H, d)
                         + w[p + "dt_bias"].reshape(H, d))                 # [H, d_k]: per key channel
        beta = sigmoid(w[p + "b_proj.weight"] @ x)                          # [H]
        S = self.ssm[il] * np.exp(g)[:, :, None]                            # decay the key rows
        delta = beta[:, None] * (v - np.einsum("hkv,hk->hv", S, k))
        S = S + k[:, :, None] * delta[:, None, :]
        self.ssm[il] = S
        o = np.einsum("hkv,hk->hv", S, q)                                   # [H, d_v]
        gate = sigmoid((w[p + "g_b_proj.weight"] @ (w[p + "g_a_proj.weight"] @ x)).reshape(H, d))
        o = rmsnorm(o, cfg.rms_norm_eps) * w[p + "o_norm.weight"] * gate
        return w[p + "o_proj.weight"] @ o.reshape(-1)

    def mla(self, il: int, x: np.ndarray) -> np.ndarray:
        cfg, w = self.cfg, self.w
        p = f"model.layers.{il}.self_attn."
        H, nope, rope, vd, lora = (cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim,
                                   cfg.v_head_dim, cfg.kv_lora_rank)
        q = (w[p + "q_proj.weight"] @ x).reshape(H, nope + rope)
        ckv = w[p + "kv_a_proj_with_mqa.weight"] @ x
        self.latent[il].append(rmsnorm(ckv[:lora], cfg.rms_norm_eps) * w[p + "kv_a_layernorm.weight"])
        self.k_pe[il].append(ckv[lora:])
        c = np.stack(self.latent[il])                                       # [n_past, lora]
        kv = (c @ w[p + "kv_b_proj.weight"].T).reshape(len(c), H, nope + vd)
        k_nope, v = kv[..., :nope], kv[..., nope:]                          # [n, H, nope], [n, H, v]
        k_pe = np.stack(self.k_pe[il])                                      # [n, rope]: shared by the heads
        scores = (np.einsum("hd,nhd->hn", q[:, :nope], k_nope) + q[:, nope:] @ k_pe.T) / np.sqrt(nope + rope)
        scores = np.exp(scores - scores.max(1, keepdims=True))
        probs = scores / scores.sum(1, keepdims=True)
        o = np.einsum("hn,nhv->hv", probs, v)
        return w[p + "o_proj.weight"] @ o.reshape(-1)

    def moe(self, il: int, x: np.ndarray) -> np.ndarray:
        cfg, w = self.cfg, self.w
        p = f"model.layers.{il}.block_sparse_moe."
        s = sigmoid(w[p + "gate.weight"] @ x)
        chosen = np.argsort(-(s + w[p + "gate.e_score_correction_bias"]), kind="stable")[:cfg.num_experts_per_token]
        weights = s[chosen] / s[chosen].sum() * cfg.routed_scaling_factor
        out = sum(wt * swiglu(x, w[f"{p}experts.{j}.w1.weight"], w[f"{p}experts.{j}.w3.weight"],
                              w[f"{p}experts.{j}.w2.weight"]) for j, wt in zip(chosen, weights))
        sh = p + "shared_experts."
        return out + swiglu(x, w[sh + "gate_proj.weight"], w[sh + "up_proj.weight"], w[sh + "down_proj.weight"])
