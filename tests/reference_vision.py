"""Plain-numpy float64 reference of the Qwen3.5 vision tower and of `get_rope_index`, from
Hugging Face-order weights (`models/qwen35_vision.hf_weights`: `model.visual.*`, torch shapes).

Written from transformers' `modeling_qwen3_5.py` (Qwen3_5VisionModel, Qwen3_5VisionPatchMerger,
Qwen3_5VisionRotaryEmbedding, `get_rope_index`) and the Qwen2-VL image processor's patch layout,
never from the mmproj layout: the Conv3D is the flattened (C, T, P, P) patch times the whole
kernel (the converter's split into two 2-D kernels is not seen here), the learned position grid is
resampled with linspace / floor / ceil weights, and patches come in the processor's merge-window
order. See docs/mmproj-qwen3vl.md.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["to_patches", "vision_forward", "rope_positions", "layer_norm", "gelu_tanh", "gelu_erf"]


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def gelu_tanh(x):
    """`gelu_pytorch_tanh`."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def gelu_erf(x):
    """`nn.GELU()` (exact)."""
    from math import erf
    return 0.5 * x * (1.0 + np.vectorize(erf)(x / math.sqrt(2.0)))


def to_patches(image, cfg):
    """The processor's `pixel_values` of one image (3, H, W), H and W multiples of patch x merge:
    the picture repeated temporal_patch_size times, cut into patches in merge-window order, each
    flattened (C, T, P, P). Returns (patches [n, C*T*P*P], grid (t, h, w))."""
    img = np.asarray(image, dtype=np.float64)
    C, H, W = img.shape
    P, m, T = cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size
    gh, gw = H // P, W // P
    x = np.repeat(img[None], T, axis=0)                           # (T, C, H, W)
    x = x.reshape(1, T, C, gh // m, m, P, gw // m, m, P)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)                    # t, bh, bw, mh, mw, C, T, P, P
    return x.reshape(gh * gw, C * T * P * P), (1, gh, gw)


def _merge_order(a, gh, gw, m):
    """Rows of a (gh*gw, ...) row-major grid put in merge-window order."""
    rest = a.shape[1:]
    return a.reshape(gh // m, m, gw // m, m, *rest).swapaxes(1, 2).reshape(gh * gw, *rest)


def _interpolated_pos_embed(pos, cfg, gh, gw):
    """`pos_embed` (N*N, hidden) resampled to (gh, gw), bilinear with align_corners, merge order."""
    n = cfg.grid_side
    hs, ws = np.linspace(0, n - 1, gh), np.linspace(0, n - 1, gw)
    h0, w0 = hs.astype(int), ws.astype(int)
    h1, w1 = np.minimum(h0 + 1, n - 1), np.minimum(w0 + 1, n - 1)
    dh, dw = (hs - h0)[:, None, None], (ws - w0)[None, :, None]
    grid = pos.reshape(n, n, -1)
    out = ((1 - dh) * (1 - dw) * grid[h0][:, w0] + (1 - dh) * dw * grid[h0][:, w1]
           + dh * (1 - dw) * grid[h1][:, w0] + dh * dw * grid[h1][:, w1])
    return _merge_order(out.reshape(gh * gw, -1), gh, gw, cfg.spatial_merge_size)


def _rotary(x, rows, cols, theta=10000.0):
    """2D rotary on x (n, heads, head_dim): rotate_half over head_dim, angles [row freqs, col freqs]."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d // 2, 2) / (d // 2))          # head_dim / 4 frequencies
    ang = np.concatenate([rows[:, None] * inv, cols[:, None] * inv], axis=1)   # (n, d/2)
    ang = np.concatenate([ang, ang], axis=1)[:, None, :]
    half = d // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * np.cos(ang) + rot * np.sin(ang)


def vision_forward(hf, cfg, image, eps: float = 1e-6, deepstack: bool = True):
    """Image embeddings (n_merged, out_hidden x (1 + n_deepstack)) of one preprocessed image (3, H, W):
    the merger's output, then (Qwen3-VL) each deepstack merger's, concatenated per row as llama.cpp
    lays the mmproj output out. Also returns the grid (t, h, w) in patches."""
    w = {k.removeprefix("model.visual."): np.asarray(v, dtype=np.float64) for k, v in hf.items()
         if k.startswith("model.visual.")}
    patches, (_, gh, gw) = to_patches(image, cfg)
    Hd, nh, m = cfg.hidden_size, cfg.num_heads, cfg.spatial_merge_size
    hd = Hd // nh
    x = patches @ w["patch_embed.proj.weight"].reshape(Hd, -1).T + w["patch_embed.proj.bias"]
    x = x + _interpolated_pos_embed(w["pos_embed.weight"], cfg, gh, gw)
    rr, cc = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
    rows = _merge_order(rr.reshape(-1), gh, gw, m).astype(np.float64)
    cols = _merge_order(cc.reshape(-1), gh, gw, m).astype(np.float64)
    n = x.shape[0]
    taps = []
    for i in range(cfg.depth):
        b = f"blocks.{i}."
        h = layer_norm(x, w[b + "norm1.weight"], w[b + "norm1.bias"], eps)
        qkv = (h @ w[b + "attn.qkv.weight"].T + w[b + "attn.qkv.bias"]).reshape(n, 3, nh, hd)
        q, k, v = _rotary(qkv[:, 0], rows, cols), _rotary(qkv[:, 1], rows, cols), qkv[:, 2]
        s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        att = np.einsum("hqk,khd->qhd", p, v).reshape(n, Hd)
        x = x + att @ w[b + "attn.proj.weight"].T + w[b + "attn.proj.bias"]
        h = layer_norm(x, w[b + "norm2.weight"], w[b + "norm2.bias"], eps)
        h = gelu_tanh(h @ w[b + "mlp.linear_fc1.weight"].T + w[b + "mlp.linear_fc1.bias"])
        x = x + h @ w[b + "mlp.linear_fc2.weight"].T + w[b + "mlp.linear_fc2.bias"]
        if deepstack and i in cfg.deepstack_visual_indexes:
            d = f"deepstack_merger_list.{cfg.deepstack_visual_indexes.index(i)}."
            f = layer_norm(x.reshape(n // (m * m), -1), w[d + "norm.weight"], w[d + "norm.bias"], eps)
            f = gelu_erf(f @ w[d + "linear_fc1.weight"].T + w[d + "linear_fc1.bias"])
            taps.append(f @ w[d + "linear_fc2.weight"].T + w[d + "linear_fc2.bias"])
    h = layer_norm(x, w["merger.norm.weight"], w["merger.norm.bias"], eps).reshape(n // (m * m), -1)
    h = gelu_erf(h @ w["merger.linear_fc1.weight"].T + w["merger.linear_fc1.bias"])
    out = h @ w["merger.linear_fc2.weight"].T + w["merger.linear_fc2.bias"]
    return np.concatenate([out] + taps, axis=1), (1, gh, gw)


def rope_positions(tokens, image_token: int, grids, merge: int = 2):
    """`Qwen3_5Model.get_rope_index` for one sequence: each token's (t, h, w) position and the
    rope delta (max position + 1 - length). `grids`: (t, h, w) in patches of each image, in order;
    each maximal run of image pad tokens is one image."""
    out, cur, i, k = [], 0, 0, 0
    toks = list(tokens)
    while i < len(toks):
        if toks[i] != image_token:
            out.append((cur, cur, cur))
            cur += 1
            i += 1
            continue
        _, gh, gw = grids[k]
        k += 1
        lh, lw = gh // merge, gw // merge
        for r in range(lh):
            for c in range(lw):
                out.append((cur, cur + r, cur + c))
        i += lh * lw
        cur += max(lh, lw)
    delta = max(max(p) for p in out) + 1 - len(toks)
    return out, delta
