"""ggml's CPU F16 matrix-vector product (one decode token: ggml_vec_dot_f16 per row) against numpy.

scripts/ggml-patches/f16-dot-read-ahead.patch adds a read-ahead to that loop (x86): one prefetch
per cache line of a step, 4 KB ahead, so the last rows read past the end of the matrix (a prefetch
never faults). The sums stay in F32, as ggml 0.25.3 has them: the bound below is one an FP16
accumulation (ggml 0.15.3 on AVX512-FP16 CPUs: 4e-5 to 3e-4 of sum |w x| on these shapes) fails
by far, so going back to it would not pass unnoticed. Row lengths that are not a multiple of the
SIMD step cover the scalar tail; thread counts split the rows unevenly.
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
