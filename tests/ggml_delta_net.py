"""One ggml_gated_delta_net on the CPU, outside any model: for the tests of ggml's patched kernel."""

from __future__ import annotations

import ctypes

import numpy as np

import ggml


def _tensor(ctx, a: np.ndarray):
    """A new F32 tensor holding `a` (numpy axes reversed: ggml's ne0 is numpy's last axis)."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    t = ggml.ggml_new_tensor(ctx, ggml.GGML_TYPE_F32, a.ndim, (ctypes.c_int64 * a.ndim)(*reversed(a.shape)))
    ctypes.memmove(ggml.ggml_get_data(t), a.ctypes.data, a.nbytes)
    return t


def ggml_gated_delta_net(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                         state: np.ndarray, K: int, threads: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml_gated_delta_net(q, k [N, T, H_k, S], v [N, T, H, S], g [N, T, H, 1 or S],
    beta [N, T, H, 1], state [N, H, S, S] (row j of head h: column j of the state matrix, as the
    kernel keeps it), K) computed by ggml's CPU graph code on `threads` threads -> the output
    [N, T, H, S] and the min(T, K) snapshots [slot, N, H, S, S] (slot 0 the newest state)."""
    N, T, H, S = v.shape
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=64 * 1024 * 1024 + 8 * state.nbytes * (K + 1), mem_buffer=None))
    try:
        args = [_tensor(ctx, a) for a in (q, k, v, g, beta, state)]
        res = ggml.ggml_gated_delta_net(ctx, *args, K)
        gf = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(gf, res)
        ggml.ggml_graph_compute_with_ctx(ctx, gf, threads)
        n_out, n_state = N * T * H * S, N * H * S * S
        flat = np.ctypeslib.as_array(ctypes.cast(ggml.ggml_get_data(res), ctypes.POINTER(ctypes.c_float)),
                                     shape=(n_out + K * n_state,)).copy()
        snaps = flat[n_out:n_out + min(T, K) * n_state].reshape(min(T, K), N, H, S, S)
        return flat[:n_out].reshape(N, T, H, S), snaps
    finally:
        ggml.ggml_free(ctx)
