"""The Qwen3-Next forward pass in torch, for training; the same math as tests/reference.py.

Parameters are named and laid out as the GGUF tensors (numpy order, `y = W @ x`), so export is a
copy. Norm weights are held as the multiplier itself (what the converter stores as 1 + w), and
`ssm_a` as its log (`A_log`; exported as -exp(A_log)). The gated delta rule is computed per chunk
(exact, see `chunk_gated_delta_rule`); `recurrent_gated_delta_rule` is the step-by-step form the
reference uses, kept for the tests.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from deltarun.model_files.generate import ModelConfig


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def l2_norm(x: Tensor, eps: float) -> Tensor:
    """ggml_l2_norm: x / max(||x||, eps)."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(eps)


def rope_neox(x: Tensor, positions: Tensor, n_rot: int, base: float) -> Tensor:
    """NEOX RoPE on the first n_rot dims of x (..., T, heads, head_dim): pairs (i, i + n_rot/2)."""
    half = n_rot // 2
    inv = base ** (-2.0 * torch.arange(half, dtype=torch.float64) / n_rot)
    theta = (positions.to(torch.float64)[:, None] * inv[None, :]).to(x.dtype)  # (T, half)
    cos, sin = theta.cos()[:, None, :], theta.sin()[:, None, :]
    x0, x1, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos, rest], dim=-1)


def recurrent_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """Step by step: M = e^g M; M += k (beta (v - M^T k))^T; o = M^T q.

    q, k (B, T, H, S_k) (q already scaled), v (B, T, H, S_v), g, beta (B, T, H) -> o (B, T, H, S_v)."""
    B, T, H, Sk = k.shape
    M = q.new_zeros(B, H, Sk, v.shape[-1])
    outs = []
    for t in range(T):
        M = M * g[:, t].exp()[..., None, None]
        kv_mem = torch.einsum("bhkv,bhk->bhv", M, k[:, t])
        delta = (v[:, t] - kv_mem) * beta[:, t][..., None]
        M = M + k[:, t][..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", M, q[:, t]))
    return torch.stack(outs, dim=1)


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, chunk: int = 32) -> Tensor:
    """The same recurrence, a chunk at a time (exact up to rounding).

    Within a chunk with cumulative log-decay G and entry state M0, the deltas u_i = beta_i (v_i -
    e^{g_i} M_{i-1}^T k_i) solve (I + A) U = beta V - beta e^G K M0 with A_ij = beta_i e^{G_i-G_j}
    k_i.k_j (j < i); then o_i = e^{G_i} M0^T q_i + sum_{j<=i} e^{G_i-G_j} (q_i.k_j) u_j and
    M_C = e^{G_C} M0 + sum_j e^{G_C-G_j} k_j u_j^T."""
    B, T, H, Sk = k.shape
    Sv = v.shape[-1]
    pad = (-T) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (T + pad) // chunk
    # (B, H, n, C, ...)
    q, k, v = (x.reshape(B, n, chunk, H, -1).permute(0, 3, 1, 2, 4) for x in (q, k, v))
    g, beta = (x.reshape(B, n, chunk, H).permute(0, 3, 1, 2) for x in (g, beta))
    G = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool).tril(-1)
    lower_eq = torch.ones(chunk, chunk, dtype=torch.bool).tril()
    diff = G[..., :, None] - G[..., None, :]
    decay_eq = diff.masked_fill(~lower_eq, float("-inf")).exp()       # e^{G_i - G_j}, j <= i
    kk = k @ k.transpose(-1, -2)
    A = (beta[..., None] * kk * decay_eq).masked_fill(~lower, 0.0)
    # (I + A)^-1 = sum_{n < C} (-A)^n (A is nilpotent) = (I - A)(I + A^2)(I + A^4)...: log2(C) squarings
    # (batched triangular solves are far slower on CPU)
    P = -A
    inverse = torch.eye(chunk, dtype=q.dtype) + P
    for _ in range(max(0, math.ceil(math.log2(chunk)) - 1)):
        P = P @ P
        inverse = inverse + inverse @ P
    solved = inverse @ torch.cat([beta[..., None] * v, (beta * G.exp())[..., None] * k], dim=-1)
    Tinv_v, Tinv_k = solved[..., :Sv], solved[..., Sv:]
    qk = (q @ k.transpose(-1, -2)) * decay_eq
    M = q.new_zeros(B, H, Sk, Sv)
    outs = []
    # per-chunk views through unbind: indexing inside the loop would make autograd zero-fill and
    # accumulate whole tensors once per chunk
    q_decayed = (q * G.exp()[..., None]).unbind(2)
    k_to_end = (k * (G[..., -1:] - G).exp()[..., None]).transpose(-1, -2).unbind(2)
    chunk_decay = G[..., -1].exp()[..., None, None].unbind(2)
    for tv, tk, qd, qkc, kc, dc in zip(Tinv_v.unbind(2), Tinv_k.unbind(2), q_decayed, qk.unbind(2), k_to_end,
                                       chunk_decay):
        u = tv - tk @ M
        outs.append(qd @ M + qkc @ u)
        M = M * dc + kc @ u
    o = torch.stack(outs, dim=2)  # (B, H, n, C, Sv)
    return o.permute(0, 2, 3, 1, 4).reshape(B, n * chunk, H, Sv)[:, :T]


class Block(nn.Module):
    """One decoder block: norm, token mixer (gated delta-net or gated attention), norm, MoE."""

    def __init__(self, cfg: ModelConfig, recurrent: bool):
        super().__init__()
        self.cfg, self.recurrent = cfg, recurrent
        E = cfg.n_embd
        P = nn.Parameter
        self.attn_norm = P(torch.ones(E))
        self.post_attention_norm = P(torch.ones(E))
        if recurrent:
            S, nk, nv = cfg.ssm_d_state, cfg.ssm_n_k_heads, cfg.ssm_n_v_heads
            self.attn_qkv = P(torch.empty(2 * cfg.key_dim + cfg.value_dim, E))
            self.attn_gate = P(torch.empty(cfg.value_dim, E))
            self.ssm_ba = P(torch.empty(2 * nv, E))
            self.ssm_conv1d = P(torch.empty(2 * cfg.key_dim + cfg.value_dim, cfg.ssm_d_conv))
            self.ssm_dt_bias = P(torch.empty(nv))
            self.A_log = P(torch.empty(nv))
            self.ssm_norm = P(torch.ones(S))
            self.ssm_out = P(torch.empty(E, cfg.value_dim))
        else:
            hd, nh, nkv = cfg.head_dim, cfg.n_head, cfg.n_head_kv
            self.attn_q = P(torch.empty(2 * hd * nh, E))
            self.attn_k = P(torch.empty(hd * nkv, E))
            self.attn_v = P(torch.empty(hd * nkv, E))
            self.attn_output = P(torch.empty(E, hd * nh))
            self.attn_q_norm = P(torch.ones(hd))
            self.attn_k_norm = P(torch.ones(hd))
        ne, ff, fs = cfg.n_expert, cfg.n_ff_exp, cfg.n_ff_shexp
        self.ffn_gate_inp = P(torch.empty(ne, E))
        self.ffn_gate_exps = P(torch.empty(ne, ff, E))
        self.ffn_up_exps = P(torch.empty(ne, ff, E))
        self.ffn_down_exps = P(torch.empty(ne, E, ff))
        self.ffn_gate_inp_shexp = P(torch.empty(E))
        self.ffn_gate_shexp = P(torch.empty(fs, E))
        self.ffn_up_shexp = P(torch.empty(fs, E))
        self.ffn_down_shexp = P(torch.empty(E, fs))

    def init_weights(self, gen: torch.Generator, out_scale: float) -> None:
        """GPT-style: N(0, 0.02), outputs into the residual stream scaled down by depth; the
        delta-net decay and step size as Mamba/Qwen initialise them."""
        std = 0.02
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm"):
                    continue
                if name in ("ssm_dt_bias", "A_log", "ssm_conv1d"):
                    continue
                scale = out_scale if name in ("ssm_out", "attn_output", "ffn_down_exps", "ffn_down_shexp") else 1.0
                p.normal_(0.0, std * scale, generator=gen)
            if self.recurrent:
                nv = self.cfg.ssm_n_v_heads
                self.A_log.copy_(torch.empty(nv).uniform_(1.0, 16.0, generator=gen).log())
                dt = torch.exp(torch.empty(nv).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
                self.ssm_dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus^-1(dt)
                bound = 1.0 / math.sqrt(self.cfg.ssm_d_conv)
                self.ssm_conv1d.uniform_(-bound, bound, generator=gen)

    # --- token mixers ---------------------------------------------------------------------------
    def linear_attention(self, h: Tensor, chunked: bool) -> Tensor:
        cfg = self.cfg
        B, T, _ = h.shape
        S, nk, nv, eps = cfg.ssm_d_state, cfg.ssm_n_k_heads, cfg.ssm_n_v_heads, cfg.rms_eps
        r, kd = nv // nk, cfg.key_dim
        qkv = h @ self.attn_qkv.T                                   # (B, T, conv_dim)
        z = (h @ self.attn_gate.T).reshape(B, T, nv, S)
        ba = (h @ self.ssm_ba.T).reshape(B, T, nk, 2 * r)
        beta = torch.sigmoid(ba[..., :r].reshape(B, T, nv))
        a = ba[..., r:].reshape(B, T, nv)
        g = F.softplus(a + self.ssm_dt_bias) * -self.A_log.exp()
        # depthwise causal conv, window oldest first: out_t = sum_j w[:, j] x_{t - (d_conv-1) + j}
        padded = F.pad(qkv, (0, 0, cfg.ssm_d_conv - 1, 0))
        conv = sum(padded[:, j:j + T] * self.ssm_conv1d[:, j] for j in range(cfg.ssm_d_conv))
        c = F.silu(conv)
        q = l2_norm(c[..., :kd].reshape(B, T, nk, S), eps).repeat_interleave(r, dim=2) / math.sqrt(S)
        k = l2_norm(c[..., kd:2 * kd].reshape(B, T, nk, S), eps).repeat_interleave(r, dim=2)
        v = c[..., 2 * kd:].reshape(B, T, nv, S)
        rule = chunk_gated_delta_rule if chunked else recurrent_gated_delta_rule
        o = rule(q, k, v, g, beta)
        o = rms_norm(o, self.ssm_norm, eps) * F.silu(z)
        return o.reshape(B, T, nv * S) @ self.ssm_out.T

    def full_attention(self, h: Tensor, positions: Tensor) -> Tensor:
        cfg = self.cfg
        B, T, _ = h.shape
        hd, nh, nkv, eps = cfg.head_dim, cfg.n_head, cfg.n_head_kv, cfg.rms_eps
        qg = (h @ self.attn_q.T).reshape(B, T, nh, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:]
        k = (h @ self.attn_k.T).reshape(B, T, nkv, hd)
        v = (h @ self.attn_v.T).reshape(B, T, nkv, hd)
        q = rope_neox(rms_norm(q, self.attn_q_norm, eps), positions, cfg.n_rot, cfg.rope_freq_base)
        k = rope_neox(rms_norm(k, self.attn_k_norm, eps), positions, cfg.n_rot, cfg.rope_freq_base)
        group = nh // nkv
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        o = o.transpose(1, 2) * torch.sigmoid(gate)
        return o.reshape(B, T, nh * hd) @ self.attn_output.T

    # --- MoE ----------------------------------------------------------------------------------
    def moe(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Routed experts (softmax, top-k, renormalised) plus the sigmoid-gated shared expert.
        Returns the output and the load-balancing loss (Switch Transformer: n_expert * sum f_e P_e)."""
        cfg = self.cfg
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = torch.softmax(x @ self.ffn_gate_inp.T, dim=-1)
        top_p, top_i = probs.topk(cfg.n_expert_used, dim=-1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        # dispatch: (token, slot) pairs sorted by expert, one gather, one matmul chain per expert, one scatter
        flat_e = top_i.reshape(-1)
        order = torch.argsort(flat_e, stable=True)
        rows = order // cfg.n_expert_used
        counts = torch.bincount(flat_e, minlength=cfg.n_expert).tolist()
        xs = x[rows]
        ys = []
        experts = zip(xs.split(counts), self.ffn_gate_exps.unbind(0), self.ffn_up_exps.unbind(0),
                      self.ffn_down_exps.unbind(0))
        for xe, gate, up, down in experts:
            ys.append((F.silu(xe @ gate.T) * (xe @ up.T)) @ down.T)
        weighted = torch.cat(ys) * top_p.reshape(-1)[order][:, None]
        out = torch.zeros_like(x).index_add(0, rows, weighted)
        shared = (F.silu(x @ self.ffn_gate_shexp.T) * (x @ self.ffn_up_shexp.T)) @ self.ffn_down_shexp.T
        out = out + shared * torch.sigmoid(x @ self.ffn_gate_inp_shexp)[:, None]
        frac = F.one_hot(top_i, cfg.n_expert).sum(1).float().mean(0) / cfg.n_expert_used
        balance = cfg.n_expert * (frac * probs.mean(0)).sum()
        return out.reshape(shape), balance

    def forward(self, x: Tensor, positions: Tensor, chunked: bool = True) -> tuple[Tensor, Tensor]:
        h = rms_norm(x, self.attn_norm, self.cfg.rms_eps)
        x = x + (self.linear_attention(h, chunked) if self.recurrent else self.full_attention(h, positions))
        y, balance = self.moe(rms_norm(x, self.post_attention_norm, self.cfg.rms_eps))
        return x + y, balance


class Qwen3NextLM(nn.Module):
    """Trunk, LM head and `cfg.n_mtp` (0 or 1) MTP blocks."""

    def __init__(self, cfg: ModelConfig, n_vocab: int):
        super().__init__()
        if cfg.n_mtp not in (0, 1) or cfg.tied_output or cfg.legacy_ssm_in or cfg.merged_gate_up:
            raise ValueError("the trainer builds untied, split-layout models with at most one MTP block")
        self.cfg, self.n_vocab = cfg, n_vocab
        E = cfg.n_embd
        self.token_embd = nn.Parameter(torch.empty(n_vocab, E))
        self.output_norm = nn.Parameter(torch.ones(E))
        self.output = nn.Parameter(torch.empty(n_vocab, E))
        self.blocks = nn.ModuleList(Block(cfg, rec) for rec in cfg.recurrent)
        if cfg.n_mtp:
            self.mtp_block = Block(cfg, recurrent=False)
            self.mtp_eh_proj = nn.Parameter(torch.empty(E, 2 * E))
            self.mtp_enorm = nn.Parameter(torch.ones(E))
            self.mtp_hnorm = nn.Parameter(torch.ones(E))
            self.mtp_shared_head_norm = nn.Parameter(torch.ones(E))

    def init_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        out_scale = 1.0 / math.sqrt(2.0 * (self.cfg.n_layer + self.cfg.n_mtp))
        with torch.no_grad():
            self.token_embd.normal_(0.0, 0.02, generator=gen)
            self.output.normal_(0.0, 0.02, generator=gen)
            for b in self.blocks:
                b.init_weights(gen, out_scale)
            if self.cfg.n_mtp:
                self.mtp_block.init_weights(gen, out_scale)
                self.mtp_eh_proj.normal_(0.0, 0.02, generator=gen)

    def forward(self, tokens: Tensor, chunked: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        """tokens (B, T) -> logits (B, T, V), hidden after output_norm (B, T, E), balance loss."""
        positions = torch.arange(tokens.shape[1])
        x = self.token_embd[tokens]
        balance = x.new_zeros(())
        for b in self.blocks:
            x, bl = b(x, positions, chunked)
            balance = balance + bl
        hidden = rms_norm(x, self.output_norm, self.cfg.rms_eps)
        return hidden @ self.output.T, hidden, balance

    def mtp(self, hidden: Tensor, next_tokens: Tensor) -> tuple[Tensor, Tensor]:
        """Row i = (trunk hidden_i after output_norm, token_{i+1}) at position i -> logits for
        token_{i+2}, and the balance loss. hidden (B, T, E), next_tokens (B, T)."""
        eps = self.cfg.rms_eps
        e = rms_norm(self.token_embd[next_tokens], self.mtp_enorm, eps)
        h = rms_norm(hidden, self.mtp_hnorm, eps)
        x = torch.cat([e, h], dim=-1) @ self.mtp_eh_proj.T
        x, balance = self.mtp_block(x, torch.arange(x.shape[1]))
        return rms_norm(x, self.mtp_shared_head_norm, eps) @ self.output.T, balance

    def gguf_tensors(self) -> dict[str, np.ndarray]:
        """Float32 numpy weights under their GGUF names, in the converter's stored conventions."""
        return {k: v.detach().to(torch.float32).numpy().copy() for k, v in self._gguf_parameters().items()}

    @torch.no_grad()
    def load_gguf_tensors(self, tensors: dict[str, np.ndarray]) -> None:
        """Set every parameter from GGUF-named arrays (e.g. a file's dequantised weights)."""
        params = self._gguf_parameters()
        if set(params) != set(tensors):
            raise ValueError(f"tensor names differ: {sorted(set(params) ^ set(tensors))[:5]}")
        for il, b in enumerate(list(self.blocks) + ([self.mtp_block] if self.cfg.n_mtp else [])):
            if b.recurrent:
                b.A_log.copy_(torch.as_tensor(-tensors[f"blk.{il}.ssm_a"], dtype=torch.float32).log())
        for name, param in params.items():
            if not name.endswith("ssm_a"):
                param.copy_(torch.as_tensor(tensors[name], dtype=torch.float32).reshape(param.shape))

    def _gguf_parameters(self) -> dict[str, Tensor]:
        """GGUF name -> parameter (ssm_a: the stored -exp(A_log), computed)."""
        cfg = self.cfg
        t = {"token_embd.weight": self.token_embd, "output_norm.weight": self.output_norm,
             "output.weight": self.output}
        blocks = list(self.blocks) + ([self.mtp_block] if cfg.n_mtp else [])
        for il, b in enumerate(blocks):
            p = f"blk.{il}."
            t[p + "attn_norm.weight"] = b.attn_norm
            t[p + "post_attention_norm.weight"] = b.post_attention_norm
            if b.recurrent:
                t[p + "attn_qkv.weight"] = b.attn_qkv
                t[p + "attn_gate.weight"] = b.attn_gate
                t[p + "ssm_ba.weight"] = b.ssm_ba
                t[p + "ssm_conv1d.weight"] = b.ssm_conv1d
                t[p + "ssm_dt.bias"] = b.ssm_dt_bias
                t[p + "ssm_a"] = -b.A_log.exp()
                t[p + "ssm_norm.weight"] = b.ssm_norm
                t[p + "ssm_out.weight"] = b.ssm_out
            else:
                for name in ("attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm"):
                    t[p + name + ".weight"] = getattr(b, name)
            for name in ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_inp_shexp",
                         "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"):
                t[p + name + ".weight"] = getattr(b, name)
        if cfg.n_mtp:
            n = f"blk.{cfg.n_layer}.nextn."
            t[n + "eh_proj.weight"] = self.mtp_eh_proj
            t[n + "enorm.weight"] = self.mtp_enorm
            t[n + "hnorm.weight"] = self.mtp_hnorm
            t[n + "shared_head_norm.weight"] = self.mtp_shared_head_norm
        return t
