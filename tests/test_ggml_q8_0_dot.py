"""ggml's CPU Q8_0 matrix products with 1-700 columns (decode, verification steps, prompt chunks)
against numpy.

scripts/ggml-patches/q8_0-read-ahead.patch rewrites the x86 loop of ggml_vec_dot_q8_0_q8_0 (two
blocks per iteration on two accumulators, rows read ahead): one token (a vector) takes that path.
scripts/ggml-patches/q8_0-few-columns.patch gives Q8_0 products a kernel of their own on AVX-512
VNNI CPUs (llamafile's tinyBLAS otherwise): up to 4 columns block pairs with a one-block tail, one
row at a time (x86-one-row-streams.patch: the columns offset to unsigned bytes, each row's sums the
dots' starting value; long rows such as ffn_down's 3,584 and 3,616 values with 2-4 columns); from 5 columns column lanes (16/P columns x P 4-byte groups per register: P = 2 up
to 8 columns, 1 from 9) in tiles of 8 rows, the columns gathered in groups of 16/P within chunks
sized for L2, past 16 columns a partial last group in narrower lanes (P = 4 for 1-4 of its columns:
17, 20, 34 and 276 = 256 + 16 + 4, the last in the second chunk; P = 2 for 5-8: 24, 37, 200; the 16
lanes for 9-15: 300, 700); each thread one contiguous range of rows, the next tile read
ahead. These shapes cover an odd block count (the pairs' tail), a single block, row counts that
leave a partial tile and rows that end where the read-ahead runs past the matrix, column counts of
every tile and lane shape, several groups with a short last one, more columns than one chunk holds
(3,200 x 300: chunks of 256 columns), and thread counts that split the rows unevenly. They hold for
the stock kernels as well.
scripts/ggml-patches/q8_0-tiles-amx.patch takes 5 or more columns on CPUs with AMX: groups of 16
rows per thread (130 rows: 8 groups and 2 rows left to the AVX-512 kernel; 9, 10, 11 rows: none),
tiles of 8 columns up to 8 columns (5-8: padded; 48 and 35 rows: 3 and 2 groups, one thread's
range empty at 3 threads) and of 16 from 9 (9-16 in one tile; 37 columns: three with a shorter
last one; 300: two sets of 256 columns);
`test_q8_0_products_without_amx_tiles` runs the same shapes with it switched off
(DELTARUN_Q8_0_AMX=0), so that both kernels stay checked on such a CPU.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

import ggml

from ggml_matmul import ggml_mul_mat

Q8_0 = GGMLQuantizationType.Q8_0


def _on_q8_0_grid(rng: np.random.Generator, n_tok: int, k: int) -> np.ndarray:
    """Activations that Q8_0 quantizes exactly: per block of 32, integers in [-127, 127] (one of
    them +-127) times a power of two. Random normals can sit on a rounding tie, which ggml's
    quantizer (its SIMD rounding, from about 32 columns on also its threading) and gguf's
    numpy quantizer break differently: one value off by a step in 0.3-1 % of the outputs."""
    q = rng.integers(-127, 128, (n_tok, k // 32, 32))
    q[:, :, 0] = rng.choice([-127, 127], (n_tok, k // 32))
    scale = 2.0 ** rng.integers(-8, -2, (n_tok, k // 32, 1))
    return (q * scale).reshape(n_tok, k).astype(np.float32)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("k,n_rows,n_tok", [(32, 5, 1), (64, 33, 1), (96, 17, 1), (1024, 129, 1), (3200, 7, 1),
                                            (160, 40, 2), (32, 3, 2), (96, 37, 3), (1024, 130, 4), (64, 9, 5),
                                            (3200, 11, 6), (224, 66, 7), (1056, 45, 8), (96, 21, 9),
                                            (64, 10, 16), (1056, 45, 13), (3200, 11, 37), (2048, 6, 200),
                                            (32, 3, 700), (512, 64, 16), (32, 16, 12), (4096, 35, 10),
                                            (96, 48, 5), (3200, 35, 6), (160, 50, 37), (64, 40, 300),
                                            (3200, 9, 300), (1024, 45, 17), (96, 21, 20), (160, 40, 34),
                                            (64, 33, 24), (3200, 9, 276), (3584, 19, 4), (3616, 9, 2),
                                            (3616, 10, 3)])
def test_q8_0_matvec_matches_numpy(k: int, n_rows: int, n_tok: int, threads: int) -> None:
    rng = np.random.default_rng(k * 7 + n_rows + threads)
    w = rng.standard_normal((n_rows, k)).astype(np.float32)
    x = _on_q8_0_grid(rng, n_tok, k)
    w_q = quantize(w, Q8_0)
    got = ggml_mul_mat(w_q, ggml.GGML_TYPE_Q8_0, k, n_rows, x, threads)
    # ggml quantizes the activations to Q8_0 too (exactly, on this grid): the product of the two
    # dequantized operands, in float64; float32 accumulation of k/32 scaled integer block sums
    # differs by ~1e-6
    x_q = dequantize(quantize(x, Q8_0), Q8_0).astype(np.float64)
    assert np.array_equal(x_q, x)
    want = x_q @ dequantize(w_q, Q8_0).astype(np.float64).T
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.sqrt(k))


def test_q8_0_products_without_amx_tiles() -> None:
    """The shapes above with the AMX tiles switched off (a process of its own: ggml reads the
    switch once): the AVX-512 kernel alone."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, DELTARUN_Q8_0_AMX="0")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
                        "-k", "matches_numpy"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def test_column_lanes_are_announced_where_they_are_compiled() -> None:
    """q8_0-few-columns.patch exports deltarun_q8_0_lane_columns: 16 where its column lanes are
    compiled (ggml built for AVX-512 VNNI: every such x86 CPU has AVX-512 F and BW too), else 0;
    `wide_columns(Q8_0)` (the engine's rows per step) counts it, other types do not."""
    from deltarun.base.ggml_compat import _exported_count, amx_columns, wide_columns

    lanes = 16 if ggml.ggml_cpu_has_avx512() and ggml.ggml_cpu_has_avx512_vnni() else 0
    assert hasattr(ggml.ggml.lib, "deltarun_q8_0_lane_columns")     # every build of the patch exports it
    assert _exported_count("deltarun_q8_0_lane_columns") == lanes
    assert wide_columns(ggml.GGML_TYPE_Q8_0) == max(lanes, amx_columns(ggml.GGML_TYPE_Q8_0))
    assert wide_columns(ggml.GGML_TYPE_F32) == 0
    assert wide_columns(ggml.GGML_TYPE_F16) == amx_columns(ggml.GGML_TYPE_F16)
