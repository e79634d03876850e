"""ggml's CPU SET_ROWS against numpy, on every thread count and index broadcast.

scripts/ggml-patches/set-rows-threads.patch rewrites that kernel's loop (all rows of all planes
split between the threads, broadcast indices stepped instead of divided): these cases cross every
wrap of the stepped indices (rows, planes, index rows ne11 < ne02, index planes ne12 < ne03) and
thread boundaries that fall inside a plane, and a strided source such as the conv-window view the
delta net stores. scripts/ggml-patches/set-rows-short-copy.patch copies F32 rows of up to 32
bytes inline (two overlapping moves of 4, 8 or 16 bytes): rows of 1 to 9 floats take each size
and the memcpy past it. They hold for the stock kernel as well.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import ggml

CASES = [  # nc, nr (rows per plane), ne02, ne03, ne11, ne12, dst rows
    (3, 1, 61, 2, 1, 1, 2),        # the conv-state store: 3-float rows, one window (K = 1)
    (3, 4, 37, 3, 1, 1, 5),        # K = 5 slots, 4 windows
    (5, 3, 12, 4, 4, 2, 7),        # per-plane index rows and index planes (broadcast wraps)
    (8, 7, 6, 1, 6, 1, 9),         # one index row per plane
    (2, 1, 1, 1, 1, 1, 1),         # a single row (threads without work)
    (1, 2, 5, 1, 1, 1, 3),         # rows of 4, 16, 28 and 36 bytes: each way
    (4, 3, 7, 2, 1, 1, 4),         # set-rows-short-copy.patch copies rows of
    (7, 2, 9, 1, 1, 1, 3),         # up to 32 bytes (the 12-byte windows
    (9, 2, 5, 1, 1, 1, 3),         # too), longer ones with memcpy
]


def _set_rows(case: tuple[int, ...], threads: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    nc, nr, ne02, ne03, ne11, ne12, ne1 = case
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=16 * 1024 * 1024, mem_buffer=None))
    try:
        # source rows strided inside a wider tensor, as the conv-window view is
        wide = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F32, nc + 2, nr, ne02, ne03)
        src = ggml.ggml_view_4d(ctx, wide, nc, nr, ne02, ne03, wide.contents.nb[1], wide.contents.nb[2],
                                wide.contents.nb[3], 4)
        dst = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F32, nc, ne1, ne02, ne03)
        idx = ggml.ggml_new_tensor_3d(ctx, ggml.GGML_TYPE_I32, nr, ne11, ne12)
        wide_np = rng.standard_normal((ne03, ne02, nr, nc + 2)).astype(np.float32)
        dst_np = rng.standard_normal((ne03, ne02, ne1, nc)).astype(np.float32)
        # distinct destination rows per index row, so the result does not depend on write order
        idx_np = np.stack([np.stack([rng.permutation(ne1)[:nr] for _ in range(ne11)]) for _ in range(ne12)])
        idx_np = idx_np.astype(np.int32)
        for t, a in ((wide, wide_np), (dst, dst_np), (idx, idx_np)):
            ctypes.memmove(ggml.ggml_get_data(t), a.ctypes.data, a.nbytes)
        gf = ggml.ggml_new_graph(ctx)
        out = ggml.ggml_set_rows(ctx, dst, src, idx)
        ggml.ggml_build_forward_expand(gf, out)
        ggml.ggml_graph_compute_with_ctx(ctx, gf, threads)
        got = np.ctypeslib.as_array(ctypes.cast(ggml.ggml_get_data(out), ctypes.POINTER(ctypes.c_float)),
                                    shape=(ne03, ne02, ne1, nc)).copy()
    finally:
        ggml.ggml_free(ctx)
    want = dst_np.copy()
    src_np = wide_np[..., 1:1 + nc]
    for i3 in range(ne03):
        for i2 in range(ne02):
            for i in range(nr):
                want[i3, i2, idx_np[i3 % ne12, i2 % ne11, i]] = src_np[i3, i2, i]
    return got, want


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_set_rows_matches_numpy(case: tuple[int, ...], threads: int) -> None:
    got, want = _set_rows(case, threads, np.random.default_rng(sum(case) * 31 + threads))
    np.testing.assert_array_equal(got, want)
