"""ggml's CPU CONCAT and SSM_CONV, the two ops that build and convolve a delta-net layer's conv
input, against numpy on every thread count.

scripts/ggml-patches/concat-rows.patch shares concat's rows between the threads (it gave them
dimension 2 only: one sequence, one thread) and copies a dimension-0 concatenation row by row;
the cases cross thread boundaries inside a plane, read the second source through a transposed
view (as `concat(conv_states, transpose(qkv), 0)` does), concatenate a prompt's channel-major conv
input (`concat(transpose(conv_states), qkv, 1)`: rows copied whole, the state's through the
transposed view), and 4-D tensors along each dimension, the row's indices stepped across planes.
scripts/ggml-patches/ssm-conv-tokens.patch computes several tokens per channel along its window
row, up to 16 at a time: token counts of 1 (ggml's own loop), 2-16, and past 16 (a second, partial
group), one and several sequences. scripts/ggml-patches/conv-input-rows.patch copies a d_conv = 4
conv input's rows (three state columns, then T) in runs along each plane, the state read through
slot 0 of rollback cells too (`slots`), and convolves one token of 16 channels at a time where
d_conv = 4 (33 and 70 channels: whole groups and a rest).
scripts/ggml-patches/ssm-conv-windows-permuted.patch convolves 2-4 tokens with d_conv = 4 by
permuting four channels' rows in registers instead of gathering (2, 3 and 4 tokens over 33, 50 and
70 channels, split between threads inside a group of 16). Concat reproduces its sources exactly;
the conv sums float32 products in numpy's order below, within float32 rounding (a compiler may
fuse a product and its sum). They hold for the stock kernels as well.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

import ggml


def _read(t, shape: tuple[int, ...]) -> np.ndarray:
    return np.ctypeslib.as_array(ctypes.cast(ggml.ggml_get_data(t), ctypes.POINTER(ctypes.c_float)),
                                 shape=shape).copy()


def _write(t, a: np.ndarray) -> None:
    ctypes.memmove(ggml.ggml_get_data(t), np.ascontiguousarray(a).ctypes.data, a.nbytes)


def _compute(ctx, out, threads: int) -> None:
    gf = ggml.ggml_new_graph(ctx)
    ggml.ggml_build_forward_expand(gf, out)
    ggml.ggml_graph_compute_with_ctx(ctx, gf, threads)


def _conv_input(d_state: int, n_tokens: int, channels: int, n_seqs: int, threads: int,
                channel_major: bool, slots: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """ggml's conv input of random states and q|k|v, and numpy's: time-major
    `concat(conv_states, transpose(qkv), 0)` -> [d_state + T, channels, n_seqs] (a decoding step),
    or channel-major `concat(transpose(conv_states), qkv, 1)` -> [channels, d_state + T, n_seqs] (a
    prompt: the state's rows read through the transposed view, the ubatch's whole). With `slots`
    > 1 each channel's state is the first of `slots` windows, read through a strided view (as a
    model with rollback slots reads slot 0 of its conv states)."""
    rng = np.random.default_rng(d_state * 100 + n_tokens * 10 + channels + threads + 7 * channel_major)
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=16 * 1024 * 1024, mem_buffer=None))
    try:
        cells = ggml.ggml_new_tensor_3d(ctx, ggml.GGML_TYPE_F32, d_state * slots, channels, n_seqs)
        states = ggml.ggml_view_3d(ctx, cells, d_state, channels, n_seqs, 4 * d_state * slots,
                                   4 * d_state * slots * channels, 0)
        qkv = ggml.ggml_new_tensor_3d(ctx, ggml.GGML_TYPE_F32, channels, n_tokens, n_seqs)
        cells_np = rng.standard_normal((n_seqs, channels, d_state * slots)).astype(np.float32)
        states_np = cells_np[:, :, :d_state]
        qkv_np = rng.standard_normal((n_seqs, n_tokens, channels)).astype(np.float32)
        _write(cells, cells_np)
        _write(qkv, qkv_np)
        if channel_major:
            out = ggml.ggml_concat(ctx, ggml.ggml_transpose(ctx, states), qkv, 1)
            want = np.concatenate([states_np.transpose(0, 2, 1), qkv_np], axis=1)
        else:
            out = ggml.ggml_concat(ctx, states, ggml.ggml_transpose(ctx, qkv), 0)
            want = np.concatenate([states_np, qkv_np.transpose(0, 2, 1)], axis=2)
        _compute(ctx, out, threads)
        return _read(out, want.shape), want
    finally:
        ggml.ggml_free(ctx)


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
@pytest.mark.parametrize("d_state,n_tokens,channels,n_seqs,slots", [(3, 1, 37, 1, 1), (3, 8, 50, 1, 1),
                                                                    (3, 5, 13, 3, 1), (1, 2, 7, 2, 1),
                                                                    (3, 1, 1, 1, 1), (3, 1, 37, 2, 4),
                                                                    (3, 4, 21, 3, 4), (2, 1, 9, 2, 3)])
def test_concat_of_the_conv_state_and_a_transposed_ubatch(d_state: int, n_tokens: int, channels: int,
                                                          n_seqs: int, slots: int, threads: int) -> None:
    got, want = _conv_input(d_state, n_tokens, channels, n_seqs, threads, channel_major=False, slots=slots)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("d_state,n_tokens,channels,n_seqs", [(3, 70, 37, 1), (3, 65, 16, 2), (1, 64, 5, 3)])
def test_channel_major_concat_of_a_transposed_state_and_the_ubatch(d_state: int, n_tokens: int, channels: int,
                                                                   n_seqs: int, threads: int) -> None:
    got, want = _conv_input(d_state, n_tokens, channels, n_seqs, threads, channel_major=True)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dim", [0, 1, 2, 3])
def test_concat_of_4d_tensors(dim: int, threads: int) -> None:
    """Every dimension of 4-D tensors: each thread's rows start inside a plane and cross planes of
    dimensions 2 and 3, whose indices are stepped from row to row."""
    rng = np.random.default_rng(dim * 7 + threads)
    shape_a, shape_b = [5, 4, 3, 2], [5, 4, 3, 2]
    shape_b[dim] = 6
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=16 * 1024 * 1024, mem_buffer=None))
    try:
        a = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F32, *shape_a)
        b = ggml.ggml_new_tensor_4d(ctx, ggml.GGML_TYPE_F32, *shape_b)
        a_np = rng.standard_normal(shape_a[::-1]).astype(np.float32)
        b_np = rng.standard_normal(shape_b[::-1]).astype(np.float32)
        _write(a, a_np)
        _write(b, b_np)
        out = ggml.ggml_concat(ctx, a, b, dim)
        _compute(ctx, out, threads)
        want = np.concatenate([a_np, b_np], axis=3 - dim)
        got = _read(out, want.shape)
    finally:
        ggml.ggml_free(ctx)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("d_conv,n_tokens,channels,n_seqs", [(4, 1, 33, 1), (4, 1, 70, 3), (4, 2, 33, 2),
                                                             (4, 3, 70, 2), (4, 4, 50, 3), (4, 8, 70, 1),
                                                             (4, 16, 9, 1), (4, 37, 21, 2), (3, 5, 6, 1)])
def test_ssm_conv_matches_numpy(d_conv: int, n_tokens: int, channels: int, n_seqs: int, threads: int) -> None:
    rng = np.random.default_rng(d_conv * 1000 + n_tokens * 10 + channels + threads)
    width = d_conv - 1 + n_tokens
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=16 * 1024 * 1024, mem_buffer=None))
    try:
        x = ggml.ggml_new_tensor_3d(ctx, ggml.GGML_TYPE_F32, width, channels, n_seqs)
        w = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, d_conv, channels)
        x_np = rng.standard_normal((n_seqs, channels, width)).astype(np.float32)
        w_np = rng.standard_normal((channels, d_conv)).astype(np.float32)
        _write(x, x_np)
        _write(w, w_np)
        out = ggml.ggml_ssm_conv(ctx, x, w)
        _compute(ctx, out, threads)
        got = _read(out, (n_seqs, n_tokens, channels))
    finally:
        ggml.ggml_free(ctx)
    # float32 sums in ggml's order: ((0 + x0 w0) + x1 w1) + ...; a fused multiply-add in place of
    # a product and a sum rounds once instead of twice, so allow a few units in the last place
    want = np.zeros((n_seqs, n_tokens, channels), dtype=np.float32)
    for i in range(d_conv):
        want += x_np[:, :, i:i + n_tokens].transpose(0, 2, 1) * w_np[:, i]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
