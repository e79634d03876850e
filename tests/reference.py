"""Plain-numpy float64 reference of the Qwen3-Next forward pass.

Written from the math of the model (see shared/docs/qwen3next-gguf.md), not from any ggml
graph, so other tests can use it as ground truth for logits and recurrent states.

Weights are a dict keyed by GGUF tensor names (``blk.N.attn_qkv.weight``...) holding numpy arrays
in numpy order (the reverse of GGUF ``ne``), so a projection is ``y = W @ x``.

API:
    load_gguf_weights(path) -> (weights, RefHParams)
    ReferenceModel(weights, hp) / ReferenceModel.from_gguf(path)
        .reset(), .forward(tokens) -> logits (n_tokens, n_vocab), .clone()
        .conv_state(layer) -> (d_conv-1, conv_dim), oldest row first
        .ssm_state(layer)  -> (n_v, S_k, S_v)
        .history(layer)    -> [(conv, ssm)] after each token processed so far
        .hidden()          -> residual stream before output_norm for the last forward call
        .kv_cache(layer)   -> (k, v) arrays (n_pos, n_head_kv, head_dim), k after RoPE
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import numpy as np

__all__ = [
    "RefHParams",
    "ReferenceModel",
    "load_gguf_weights",
    "hparams_from_metadata",
    "rmsnorm",
    "l2norm",
    "silu",
    "sigmoid",
    "softplus",
    "rope_neox",
    "rotate_neox",
    "delta_net_scan",
    "causal_conv_step",
    "gated_delta_net_step",
    "gated_rmsnorm",
    "full_attention",
    "linear_attention",
    "moe",
    "split_legacy_ssm_in",
]


# --------------------------------------------------------------------------------------------
# Hyper-parameters
# --------------------------------------------------------------------------------------------


@dataclass
class RefHParams:
    n_layer: int
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    head_dim: int
    eps: float
    rope_base: float
    n_rot: int
    n_expert: int
    n_expert_used: int
    d_conv: int
    d_inner: int
    ssm_state: int  # S = head_k_dim = head_v_dim
    n_k_heads: int  # ssm.group_count
    n_v_heads: int  # ssm.time_step_rank
    full_attention_interval: int = 4
    recurrent: list[bool] = field(default_factory=list)
    attn_scale: float = 0.0  # attention.scale; 0 means 1/sqrt(head_dim)
    expert_weights_scale: float = 0.0  # expert_weights_scale; 0 (absent) or 1 means no scaling

    def __post_init__(self) -> None:
        if not self.recurrent:
            self.recurrent = [
                (i + 1) % self.full_attention_interval != 0 for i in range(self.n_layer)
            ]
        if len(self.recurrent) != self.n_layer:
            raise ValueError(f"recurrent has {len(self.recurrent)} entries for {self.n_layer} layers")
        self.recurrent = [bool(r) for r in self.recurrent]
        if self.n_v_heads % self.n_k_heads:
            raise ValueError("time_step_rank must be a multiple of group_count")
        if self.n_head % self.n_head_kv:
            raise ValueError("head_count must be a multiple of head_count_kv")

    @property
    def key_dim(self) -> int:
        return self.n_k_heads * self.ssm_state

    @property
    def value_dim(self) -> int:
        return self.n_v_heads * self.ssm_state

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def v_per_k(self) -> int:
        return self.n_v_heads // self.n_k_heads


def _field_value(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def hparams_from_metadata(reader, n_vocab: int) -> RefHParams:
    """Build RefHParams from a gguf.GGUFReader's metadata."""
    arch = _field_value(reader, "general.architecture", "qwen3next")
    p = arch + "."

    def get(key, default=None, required=True):
        v = _field_value(reader, p + key, default)
        if v is None and required:
            raise KeyError(p + key)
        return v

    block_count = int(get("block_count"))
    nextn = int(get("nextn_predict_layers", 0) or 0)
    n_layer = block_count - nextn  # MTP layers (if any) are not part of the main forward
    n_embd = int(get("embedding_length"))
    n_head = int(get("attention.head_count"))
    n_head_kv = int(get("attention.head_count_kv", n_head))
    head_dim = int(get("attention.key_length", n_embd // n_head))
    interval = int(get("full_attention_interval", 4))
    rec = _field_value(reader, p + "attention.recurrent_layers")
    recurrent = [bool(x) for x in rec][:n_layer] if rec is not None else []
    return RefHParams(
        n_layer=n_layer,
        n_embd=n_embd,
        n_vocab=n_vocab,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_base=float(get("rope.freq_base", 10000.0)),
        n_rot=int(get("rope.dimension_count", head_dim)),
        n_expert=int(get("expert_count", 0)),
        n_expert_used=int(get("expert_used_count", 0)),
        d_conv=int(get("ssm.conv_kernel")),
        d_inner=int(get("ssm.inner_size")),
        ssm_state=int(get("ssm.state_size")),
        n_k_heads=int(get("ssm.group_count")),
        n_v_heads=int(get("ssm.time_step_rank")),
        full_attention_interval=interval,
        recurrent=recurrent,
        attn_scale=float(get("attention.scale", 0.0)),
        expert_weights_scale=float(get("expert_weights_scale", 0.0)),
    )


def load_gguf_weights(path) -> tuple[dict[str, np.ndarray], RefHParams]:
    """Read every tensor of a GGUF file, dequantised to float64 in numpy order (reversed ne)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    weights: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        np_shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if t.tensor_type == gguf.GGMLQuantizationType.F64:
            arr = np.asarray(t.data, dtype=np.float64)
        else:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        weights[t.name] = np.asarray(arr, dtype=np.float64).reshape(np_shape)
    n_vocab = weights["token_embd.weight"].shape[0]
    return weights, hparams_from_metadata(reader, n_vocab)


# --------------------------------------------------------------------------------------------
# Elementary functions
# --------------------------------------------------------------------------------------------


def sigmoid(x):
    # 1 / (1 + e^-x) without overflow warnings for large |x|
    return np.exp(-np.logaddexp(0.0, -np.asarray(x, dtype=np.float64)))


def silu(x):
    return x * sigmoid(x)


def softplus(x):
    # log(1 + e^x), stable for large |x|
    return np.logaddexp(0.0, x)


def rmsnorm(x, eps):
    """x / sqrt(mean(x^2) + eps) over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def l2norm(x, eps):
    """ggml_l2_norm: x / max(||x||, eps) over the last axis."""
    return x / np.maximum(np.sqrt(np.sum(x * x, axis=-1, keepdims=True)), eps)


def rope_neox(x, pos, n_rot, base):
    """NEOX RoPE on the first n_rot dims of the last axis of x (..., head_dim) at position pos.

    Pairs (i, i + n_rot/2), angle = pos * base^(-2i/n_rot); dims >= n_rot are left untouched.
    """
    half = n_rot // 2
    return rotate_neox(x, pos * base ** (-2.0 * np.arange(half) / n_rot))


def rotate_neox(x, theta):
    """Rotate the pairs (i, i + len(theta)) of the last axis of x by the angles theta (rotate_half
    form); dims >= 2 * len(theta) are left untouched."""
    half = len(theta)
    cos, sin = np.cos(theta), np.sin(theta)
    out = np.array(x, dtype=np.float64, copy=True)
    x0 = x[..., :half]
    x1 = x[..., half:2 * half]
    out[..., :half] = x0 * cos - x1 * sin
    out[..., half:2 * half] = x0 * sin + x1 * cos
    return out


# --------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------


def full_attention(w, prefix, hp: RefHParams, h, positions, k_cache, v_cache, rope=None, select=None):
    """Gated full attention for a chunk h (T, n_embd) at absolute positions; caches are lists
    (one (n_head_kv, head_dim) entry per past position) extended in place. Returns (T, n_embd).

    rope(x (heads, head_dim), pos) -> rotated x; default NEOX on the first n_rot dims.
    select(i) -> the cache indices the query at sequence index i attends to (sparse attention);
    default every index up to i (causal)."""
    if rope is None:
        def rope(x, pos):
            return rope_neox(x, pos, hp.n_rot, hp.rope_base)
    T = h.shape[0]
    hd, nh, nkv = hp.head_dim, hp.n_head, hp.n_head_kv
    qg = (h @ w[prefix + "attn_q.weight"].T).reshape(T, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:]
    k = (h @ w[prefix + "attn_k.weight"].T).reshape(T, nkv, hd)
    v = (h @ w[prefix + "attn_v.weight"].T).reshape(T, nkv, hd)
    q = rmsnorm(q, hp.eps) * w[prefix + "attn_q_norm.weight"]
    k = rmsnorm(k, hp.eps) * w[prefix + "attn_k_norm.weight"]
    for t, pos in enumerate(positions):
        q[t] = rope(q[t], pos)
        k[t] = rope(k[t], pos)
    n_past = len(k_cache)
    k_cache.extend(k[t].copy() for t in range(T))
    v_cache.extend(v[t].copy() for t in range(T))
    K = np.stack(k_cache)  # (n_pos, nkv, hd)
    V = np.stack(v_cache)
    group = nh // nkv
    scale = hp.attn_scale or 1.0 / np.sqrt(hd)
    out = np.zeros((T, nh, hd))
    for t in range(T):
        n_vis = n_past + t + 1  # causal: this position and everything before it
        seen = np.arange(n_vis) if select is None else np.asarray(select(n_past + t))
        for hh in range(nh):
            kv = hh // group
            s = K[seen, kv, :] @ q[t, hh] * scale
            p = np.exp(s - s.max())
            p /= p.sum()
            out[t, hh] = p @ V[seen, kv, :]
    out = out * sigmoid(gate)
    return out.reshape(T, nh * hd) @ w[prefix + "attn_output.weight"].T


def split_legacy_ssm_in(m, hp: RefHParams):
    """Legacy ssm_in output m (..., 2*key_dim + 2*value_dim), grouped per k-head g as
    [q_g (S), k_g (S), v_g (r*S), z_g (r*S)] -> (qkv in split-form order, z)."""
    S, r, nk = hp.ssm_state, hp.v_per_k, hp.n_k_heads
    m = m.reshape(m.shape[:-1] + (nk, 2 * S + 2 * r * S))
    lead = m.shape[:-2]
    q = m[..., :S].reshape(lead + (nk * S,))
    k = m[..., S : 2 * S].reshape(lead + (nk * S,))
    v = m[..., 2 * S : 2 * S + r * S].reshape(lead + (nk * r * S,))
    z = m[..., 2 * S + r * S :].reshape(lead + (nk * r * S,))
    return np.concatenate([q, k, v], axis=-1), z


def causal_conv_step(conv_state, x, weight, bias=None):
    """One step of the depthwise causal conv.

    conv_state (d_conv-1, C) oldest row first, x (C,), weight (C, d_conv).
    Returns (out (C,) before the activation, new conv_state).
    """
    window = np.concatenate([conv_state, x[None, :]], axis=0)  # (d_conv, C), oldest first
    out = np.sum(weight.T * window, axis=0)
    if bias is not None:
        out = out + bias
    return out, window[1:].copy()


def gated_delta_net_step(M, q, k, v, gdecay, beta):
    """One step of the gated delta rule for all v-heads.

    M (n_v, S_k, S_v); q, k (n_v, S_k) already L2-normalised, q already scaled by 1/sqrt(S);
    v (n_v, S_v); gdecay, beta (n_v,). Returns (o (n_v, S_v), new M).
    """
    M = M * np.exp(gdecay)[:, None, None]
    kv_mem = np.einsum("hkv,hk->hv", M, k)  # M^T k
    delta = (v - kv_mem) * beta[:, None]
    M = M + k[:, :, None] * delta[:, None, :]  # + outer(k, delta)
    o = np.einsum("hkv,hk->hv", M, q)  # M^T q
    return o, M


def gated_rmsnorm(o, z, weight, eps, gate=silu):
    """rmsnorm(o) * weight * gate(z), per head over the last axis (gate: SiLU, or sigmoid for qwen4exp)."""
    return rmsnorm(o, eps) * weight * gate(z)


def linear_attention(w, prefix, hp: RefHParams, h, state):
    """Gated DeltaNet over a chunk h (T, n_embd). state: dict with 'conv' (d_conv-1, conv_dim),
    'ssm' (n_v, S, S) and 'history' (list), updated in place. Returns (T, n_embd)."""
    T = h.shape[0]
    S, nk, nv, r = hp.ssm_state, hp.n_k_heads, hp.n_v_heads, hp.v_per_k
    if prefix + "ssm_in.weight" in w:
        qkv, z = split_legacy_ssm_in(h @ w[prefix + "ssm_in.weight"].T, hp)
    else:
        qkv = h @ w[prefix + "attn_qkv.weight"].T
        z = h @ w[prefix + "attn_gate.weight"].T
    z = z.reshape(T, nv, S)
    ba = (h @ w[prefix + "ssm_ba.weight"].T).reshape(T, nk, 2 * r)
    b = ba[..., :r].reshape(T, nv)
    a = ba[..., r:].reshape(T, nv)
    beta = sigmoid(b)
    gdecay = softplus(a + w[prefix + "ssm_dt.bias"].reshape(nv)) * w[prefix + "ssm_a"].reshape(nv)

    outs = delta_net_scan(state, hp, qkv, z, beta, gdecay, w[prefix + "ssm_conv1d.weight"],
                          w.get(prefix + "ssm_conv1d.bias"), w[prefix + "ssm_norm.weight"])
    return outs.reshape(T, nv * S) @ w[prefix + "ssm_out.weight"].T


def delta_net_scan(state, hp: RefHParams, qkv, z, beta, gdecay, conv_w, conv_b, norm_w, gate=silu):
    """The gated delta net after its input projections, token by token: causal conv + SiLU, L2-norm
    of q and k, q/k heads broadcast to value heads grouped (value head hv uses key head hv // r, as
    HF's repeat_interleave), the delta rule, the gated RMSNorm. qkv (T, conv_dim), z (T, n_v, S),
    beta/gdecay (T, n_v); state as in linear_attention, updated in place. Returns (T, n_v, S)."""
    T = qkv.shape[0]
    S, nk, nv, r = hp.ssm_state, hp.n_k_heads, hp.n_v_heads, hp.v_per_k
    norm_w = norm_w.reshape(S) if norm_w.size == S else norm_w.reshape(nv, S)  # shared or per head
    kd = hp.key_dim
    outs = np.zeros((T, nv, S))
    for t in range(T):
        c, state["conv"] = causal_conv_step(state["conv"], qkv[t], conv_w, conv_b)
        c = silu(c)
        q = l2norm(c[:kd].reshape(nk, S), hp.eps)
        k = l2norm(c[kd : 2 * kd].reshape(nk, S), hp.eps)
        v = c[2 * kd :].reshape(nv, S)
        q = np.repeat(q, r, axis=0) / np.sqrt(S)  # v-head hv uses k-head hv // r
        k = np.repeat(k, r, axis=0)
        o, state["ssm"] = gated_delta_net_step(state["ssm"], q, k, v, gdecay[t], beta[t])
        outs[t] = gated_rmsnorm(o, z[t], norm_w, hp.eps, gate)
        state["history"].append((state["conv"].copy(), state["ssm"].copy()))
    return outs


def _swiglu_ffn(x, gate, up, down):
    return down @ (silu(gate @ x) * (up @ x))


def moe(w, prefix, hp: RefHParams, h2):
    """Routed experts (softmax, top-k, renormalised) plus the sigmoid-gated shared expert.
    h2 (T, n_embd) -> (T, n_embd). Falls back to a dense SwiGLU FFN when the layer has no router."""
    T = h2.shape[0]
    out = np.zeros_like(h2)
    if prefix + "ffn_gate_inp.weight" not in w:
        for t in range(T):
            out[t] = _swiglu_ffn(h2[t], w[prefix + "ffn_gate.weight"], w[prefix + "ffn_up.weight"],
                                 w[prefix + "ffn_down.weight"])
        return out
    router = w[prefix + "ffn_gate_inp.weight"]
    if prefix + "ffn_gate_up_exps.weight" in w:
        gu = w[prefix + "ffn_gate_up_exps.weight"]
        n_ff = gu.shape[1] // 2
        gate_e, up_e = gu[:, :n_ff, :], gu[:, n_ff:, :]
    else:
        gate_e, up_e = w[prefix + "ffn_gate_exps.weight"], w[prefix + "ffn_up_exps.weight"]
    down_e = w[prefix + "ffn_down_exps.weight"]
    has_shared = prefix + "ffn_up_shexp.weight" in w
    for t in range(T):
        x = h2[t]
        logits = router @ x
        p = np.exp(logits - logits.max())
        p /= p.sum()
        chosen = np.argsort(-p, kind="stable")[: hp.n_expert_used]
        wts = p[chosen] / p[chosen].sum()
        if hp.expert_weights_scale not in (0.0, 1.0):
            wts = wts * hp.expert_weights_scale
        for e, we in zip(chosen, wts):
            out[t] += we * _swiglu_ffn(x, gate_e[e], up_e[e], down_e[e])
        if has_shared:
            sh = _swiglu_ffn(x, w[prefix + "ffn_gate_shexp.weight"], w[prefix + "ffn_up_shexp.weight"],
                             w[prefix + "ffn_down_shexp.weight"])
            g_key = prefix + "ffn_gate_inp_shexp.weight"
            if g_key in w:
                sh = sh * sigmoid(float(w[g_key].reshape(-1) @ x))
            out[t] += sh
    return out


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------


class ReferenceState:
    """The state a float64 reference keeps between calls, the same for every family: per linear
    layer the conv window, the SSM matrix and its history, per attention layer the K/V lists, the
    MTP block's K/V, and the last hidden states. Subclasses set `self.hp` and call `reset()`."""

    def reset(self) -> None:
        hp = self.hp
        self.n_past = 0
        self._last_hidden = np.zeros((0, hp.n_embd))
        self._layers: list[dict] = []
        for il in range(hp.n_layer):
            if hp.recurrent[il]:
                self._layers.append({
                    "conv": np.zeros((hp.d_conv - 1, hp.conv_dim)),
                    "ssm": np.zeros((hp.n_v_heads, hp.ssm_state, hp.ssm_state)),
                    "history": [],
                })
            else:
                self._layers.append({"k": [], "v": []})
        self._mtp_kv: dict[str, list] = {"k": [], "v": []}

    def clone(self) -> "ReferenceState":
        """A copy with its own state (weights are shared, read-only)."""
        new = copy.copy(self)
        new._layers = copy.deepcopy(self._layers)
        new._mtp_kv = copy.deepcopy(self._mtp_kv)
        new._last_hidden = self._last_hidden.copy()
        return new


class ReferenceModel(ReferenceState):
    def __init__(self, weights: dict[str, np.ndarray], hp: RefHParams):
        self.w = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
        self.hp = hp
        self.reset()

    @classmethod
    def from_gguf(cls, path) -> "ReferenceModel":
        weights, hp = load_gguf_weights(path)
        return cls(weights, hp)

    # ---- state ----------------------------------------------------------------------------

    def _rec(self, layer: int) -> dict:
        if not self.hp.recurrent[layer]:
            raise ValueError(f"layer {layer} is a full-attention layer")
        return self._layers[layer]

    def conv_state(self, layer: int) -> np.ndarray:
        """(d_conv-1, conv_dim), oldest input first.

        llama.cpp keeps it as ggml ne [d_conv-1, conv_dim] (time fastest), i.e. numpy
        (conv_dim, d_conv-1): the transpose of this.
        """
        return self._rec(layer)["conv"].copy()

    def ssm_state(self, layer: int) -> np.ndarray:
        """(n_v, S_k, S_v): per v-head the delta-rule matrix M (o = M^T q).

        llama.cpp keeps this state as ggml ne [S_v, S_v, H_v] with ne0 = the key index, which read
        as numpy (n_v, S_v, S_k) is M transposed: compare with ``ssm_state(l).transpose(0, 2, 1)``.
        """
        return self._rec(layer)["ssm"].copy()

    def history(self, layer: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """(conv, ssm) after each token processed since reset; history[-1 - r] is r tokens back."""
        return [(c.copy(), s.copy()) for c, s in self._rec(layer)["history"]]

    def kv_cache(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(k, v), each (n_pos, n_head_kv, head_dim); k after norm and RoPE."""
        if self.hp.recurrent[layer]:
            raise ValueError(f"layer {layer} is a linear-attention layer")
        st = self._layers[layer]
        shape = (0, self.hp.n_head_kv, self.hp.head_dim)
        k = np.stack(st["k"]) if st["k"] else np.zeros(shape)
        v = np.stack(st["v"]) if st["v"] else np.zeros(shape)
        return k, v

    def hidden(self) -> np.ndarray:
        """Residual stream (n_tokens, n_embd) before output_norm, for the last forward call."""
        return self._last_hidden.copy()

    # ---- forward --------------------------------------------------------------------------

    def forward(self, tokens) -> np.ndarray:
        """Logits (n_tokens, n_vocab) for tokens appended to the sequence."""
        hp, w = self.hp, self.w
        tokens = [int(t) for t in tokens]
        T = len(tokens)
        if T == 0:
            return np.zeros((0, hp.n_vocab))
        positions = list(range(self.n_past, self.n_past + T))
        x = w["token_embd.weight"][tokens].copy()
        for il in range(hp.n_layer):
            p = f"blk.{il}."
            h = rmsnorm(x, hp.eps) * w[p + "attn_norm.weight"]
            st = self._layers[il]
            if hp.recurrent[il]:
                y = linear_attention(w, p, hp, h, st)
            else:
                y = full_attention(w, p, hp, h, positions, st["k"], st["v"])
            x = x + y
            h2 = rmsnorm(x, hp.eps) * w[p + "post_attention_norm.weight"]
            x = x + moe(w, p, hp, h2)
        self._last_hidden = x.copy()
        self.n_past += T
        xn = rmsnorm(x, hp.eps) * w["output_norm.weight"]
        out_w = w.get("output.weight", w["token_embd.weight"])
        return xn @ out_w.T

    def mtp_forward(self, next_tokens, hiddens) -> tuple[np.ndarray, np.ndarray]:
        """The first MTP block (layer n_layer) on rows (hidden_i, token_{i+1}) appended at the next
        MTP positions (0, 1, ... since reset). hiddens: the trunk's states after output_norm.

        x = eh_proj @ [rmsnorm(embed(token)) * enorm ; rmsnorm(hidden) * hnorm], one full-attention
        block with its MoE and its own KV cache, then shared_head_norm (or output_norm) and the
        LM head. Returns logits (T, n_vocab) and the block output (T, n_embd) before the final norm.
        """
        hp, w = self.hp, self.w
        il = hp.n_layer
        p, n = f"blk.{il}.", f"blk.{il}.nextn."
        tokens = [int(t) for t in next_tokens]
        T = len(tokens)
        positions = list(range(len(self._mtp_kv["k"]), len(self._mtp_kv["k"]) + T))
        embed = w.get(n + "embed_tokens.weight", w["token_embd.weight"])
        e = rmsnorm(embed[tokens], hp.eps) * w[n + "enorm.weight"]
        h = rmsnorm(np.asarray(hiddens, dtype=np.float64), hp.eps) * w[n + "hnorm.weight"]
        x = np.concatenate([e, h], axis=1) @ w[n + "eh_proj.weight"].T
        a = rmsnorm(x, hp.eps) * w[p + "attn_norm.weight"]
        x = x + full_attention(w, p, hp, a, positions, self._mtp_kv["k"], self._mtp_kv["v"])
        h2 = rmsnorm(x, hp.eps) * w[p + "post_attention_norm.weight"]
        x = x + moe(w, p, hp, h2)
        norm = w.get(n + "shared_head_norm.weight", w["output_norm.weight"])
        head = w.get(n + "shared_head_head.weight", w.get("output.weight", w["token_embd.weight"]))
        return (rmsnorm(x, hp.eps) * norm) @ head.T, x
