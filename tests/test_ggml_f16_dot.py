"""ggml's CPU F16 and BF16 matrix products with 1-8 columns (decode tokens, verification steps)
against numpy.

One column whose length is not a multiple of 16 goes through ggml_vec_dot_f16, row by row.

scripts/ggml-patches/f16-dot-read-ahead.patch adds a read-ahead to that loop (x86): one prefetch
per cache line of a step, 4 KB ahead, so the last rows read past the end of the matrix (a prefetch
never faults). The sums stay in F32, as ggml 0.25.3 has them: the bound below is one an FP16
accumulation (ggml 0.15.3 on AVX512-FP16 CPUs: 4e-5 to 3e-4 of sum |w x| on these shapes) fails
by far, so going back to it would not pass unnoticed. Row lengths that are not a multiple of the
SIMD step cover the scalar tail; thread counts split the rows unevenly.

scripts/ggml-patches/half-few-columns.patch gives F16 and BF16 weights with 1-4 F32 columns a kernel
of its own on AVX-512 CPUs (row lengths that are multiples of 16): tiles of 4 rows (a partial tile
row by row; x86-one-row-streams.patch: 1-2 columns of at most 12 KB one row at a time, so 1,024
values and 2 columns or 3,072 and 1 column, longer rows in tiles: 3,584 x 1 and x 2 here), each
thread one contiguous range of rows, the next tile read ahead, the columns
rounded to the weights' type as ggml's own path rounds them. x86-widened-half-more-columns.patch
gives it F16 weights with 5-11 columns too, 5-8 in tiles of 3 rows and 9-11 in tiles of 2 (row
counts that leave rows of a thread's range past the last tile below). BF16 from 5 columns, F16 from
12 (where no AMX tiles take them), and rows whose length is not a multiple of 16 go to ggml's
conversion and llamafile's tinyBLAS; the shapes below cover both sides, and hold for the stock
kernels as well.

scripts/ggml-patches/widened-half-tiles-amx.patch takes F16 products of 12 or more columns and BF16
products of 5 or more on CPUs with AMX-BF16 (row counts that are multiples of 16, row lengths that
are multiples of 32): F16 weights and columns split into two BF16 parts each, four tile products
summed. `test_half_products_on_tiles_match_numpy` covers its shapes (partial tiles of columns, an odd
number of row groups for a thread, column sets of more than one L2 load, the thresholds on both
sides); `test_half_products_without_amx_tiles` runs them with the tiles switched off
(DELTARUN_HALF_AMX=0), so that tinyBLAS stays checked on such a CPU.
"""

from __future__ import annotations

import numpy as np
import pytest

import ggml

from ggml_matmul import ggml_mul_mat


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("k,n_rows", [(16, 3), (100, 7), (1024, 129), (1040, 33), (3584, 65), (2049, 300)])
def test_f16_matvec_matches_numpy(k: int, n_rows: int, threads: int) -> None:
    rng = np.random.default_rng(k * 13 + n_rows + threads)
    w = (0.05 * rng.standard_normal((n_rows, k))).astype(np.float16)
    x = rng.standard_normal((1, k)).astype(np.float32)
    x[0, ::97] *= 30.0            # a few large activations, as real hidden states have
    got = ggml_mul_mat(w, ggml.GGML_TYPE_F16, k, n_rows, x, threads)
    # ggml rounds the activations to F16 (the vec_dot type of F16 weights); the products of two
    # F16 values are exact in float32 and float64, so the only error left is float32 summation:
    # measured <= 7e-8 of sum |w x| here (FP16 sums: median 4e-5 to 6e-5, up to 3e-4)
    x16 = x.astype(np.float16).astype(np.float64)
    w64 = w.astype(np.float64)
    want = x16 @ w64.T
    scale = np.abs(x16) @ np.abs(w64).T
    assert np.all(np.abs(got - want) <= 1e-6 * scale + 1e-30), float(np.max(np.abs(got - want) / scale))


def _bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> the bf16 bit patterns (uint16), rounded to nearest even as ggml rounds them."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _bf16_values(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("wtype", ["f16", "bf16"])
@pytest.mark.parametrize("k,n_rows,n_tok", [(16, 3, 1), (1024, 129, 1), (3584, 65, 1), (100, 7, 2), (1024, 130, 2),
                                            (16, 5, 3), (2048, 33, 3), (1024, 129, 4), (3584, 9, 4), (1040, 66, 5),
                                            (1024, 45, 8), (2049, 30, 4), (512, 300, 7), (3584, 66, 2),
                                            (3072, 9, 1), (16, 4, 5), (1024, 31, 6), (2048, 50, 8), (3584, 17, 7),
                                            (1024, 40, 9), (1024, 33, 9), (2048, 18, 10), (512, 31, 11),
                                            (3584, 21, 11)])
def test_half_products_match_numpy(k: int, n_rows: int, n_tok: int, wtype: str, threads: int) -> None:
    _check_half_product(k, n_rows, n_tok, wtype, threads)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("wtype", ["f16", "bf16"])
@pytest.mark.parametrize("k,n_rows,n_tok", [(1024, 96, 5), (768, 48, 11), (768, 48, 12), (1024, 80, 16),
                                            (3072, 32, 17), (64, 208, 33), (3072, 16, 100), (768, 112, 300),
                                            (1040, 64, 20), (1024, 72, 20)])
def test_half_products_on_tiles_match_numpy(k: int, n_rows: int, n_tok: int, wtype: str, threads: int) -> None:
    _check_half_product(k, n_rows, n_tok, wtype, threads)


def test_half_products_without_amx_tiles() -> None:
    """The shapes above with the AMX tiles switched off (a process of its own: ggml reads the
    switch once): tinyBLAS and the few-column kernel alone."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, DELTARUN_HALF_AMX="0")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
                        "-k", "half_products and match_numpy"], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def _check_half_product(k: int, n_rows: int, n_tok: int, wtype: str, threads: int) -> None:
    rng = np.random.default_rng(k * 17 + n_rows * 3 + n_tok + threads)
    w = (0.05 * rng.standard_normal((n_rows, k))).astype(np.float32)
    x = rng.standard_normal((n_tok, k)).astype(np.float32)
    x[:, ::97] *= 30.0
    if wtype == "f16":
        stored, gtype = w.astype(np.float16), ggml.GGML_TYPE_F16
        w64, x_r = stored.astype(np.float64), x.astype(np.float16).astype(np.float64)
    else:
        stored, gtype = _bf16(w), ggml.GGML_TYPE_BF16
        w64, x_r = _bf16_values(stored), _bf16_values(_bf16(x))
    got = ggml_mul_mat(stored, gtype, k, n_rows, x, threads)
    # the activations rounded to the weights' type (ggml's vec_dot type for them); products of two
    # such values are exact in float32, so only the float32 summation differs
    want = x_r @ w64.T
    scale = np.abs(x_r) @ np.abs(w64).T
    assert np.all(np.abs(got - want) <= 1e-6 * scale + 1e-30), float(np.max(np.abs(got - want) / scale))
