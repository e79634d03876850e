"""One ggml_mul_mat on the CPU, outside any model: for the tests of ggml's patched matrix kernels."""

from __future__ import annotations

import ctypes

import numpy as np

import ggml


def ggml_mul_mat(weight: np.ndarray, wtype: int, k: int, n_rows: int, x: np.ndarray, threads: int) -> np.ndarray:
    """ggml_mul_mat(weight [k, n_rows] of ggml type `wtype`, given as its stored bytes, F32
    activations x [n_tok, k]) -> [n_tok, n_rows], computed by ggml's CPU graph code on `threads`
    threads in a context of its own (which also holds the activations' conversion buffer)."""
    n_tok = x.shape[0]
    mem = 64 * 1024 * 1024 + weight.nbytes
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=mem, mem_buffer=None))
    try:
        w = ggml.ggml_new_tensor_2d(ctx, wtype, k, n_rows)
        a = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, k, n_tok)
        ctypes.memmove(ggml.ggml_get_data(w), weight.ctypes.data, weight.nbytes)
        ctypes.memmove(ggml.ggml_get_data(a), x.ctypes.data, x.nbytes)
        out = ggml.ggml_mul_mat(ctx, w, a)
        gf = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(gf, out)
        ggml.ggml_graph_compute_with_ctx(ctx, gf, threads)
        return np.ctypeslib.as_array(ctypes.cast(ggml.ggml_get_data(out), ctypes.POINTER(ctypes.c_float)),
                                     shape=(n_tok, n_rows)).copy()
    finally:
        ggml.ggml_free(ctx)
