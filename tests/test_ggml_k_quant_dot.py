"""ggml's CPU Q4_K and Q6_K matrix products with 1-300 columns (decode, verification steps, prompt
chunks) against numpy.

scripts/ggml-patches/k-quant-few-columns.patch gives Q4_K and Q6_K products of 1-23 columns a
kernel of their own on AVX-512 CPUs (ggml's per-pair `ggml_vec_dot_q4_K_q8_K` / `_q6_K_q8_K`
below 8 columns otherwise, its tiled K-quant product from 8): each
row unpacked once (Q4_K's nibbles with the 6-bit scales and mins of ggml's packing, Q6_K's 4+2-bit
values with signed 8-bit scales and the offset 32: for at most 8 columns super-block by super-block
into registers, used at once; for more into a buffer the blocks of columns read), up to 8 prepared
columns per tile, chunks of columns sized for L2, each thread one contiguous range of rows; from 24 columns on ggml's tiled
product runs. These shapes cover one and several super-blocks, row counts that split unevenly
over the threads, every tile width (1-8 columns, a short last block), the mins/offset term's
column groups (four columns for Q4_K, two for Q6_K), more columns than one chunk holds (51,200 x
20: chunks of 8), and the tiled product (37 and 300 columns). They hold for the stock kernels as
well; a wrong high-bit shift of Q6_K or a chunk written at the wrong column fails them.
scripts/ggml-patches/k-quant-tiles-amx.patch takes Q4_K products of 5 or more columns and Q6_K of
12 or more (24 and more too) on CPUs with AMX: groups of 16 rows (the rest to the kernel above),
tiles of 8 columns up to 8 and of 16 from 9 (48, 40, 35, 96 rows; 5-37 columns; 300 columns: two
sets of 256), Q4_K's mins against each column's sub-block sums, Q6_K's values less 32;
`test_k_quant_products_without_amx_tiles` runs the shapes with it switched off (DELTARUN_K_AMX=0).
Q4_K's sub-blocks taken in natural order (not the nibbles') fail 30 cases, as do Q6_K's values less
31 or its scale bytes swapped; the in-register path unpacking the row's first super-block every
time fails 49.

The weights are random blocks (any bit pattern of the values and scales is a valid block, the fp16
super-block scales are set to small positive numbers), dequantized by gguf's numpy code; the activations lie on the Q8_K grid, which ggml's quantizer
reproduces exactly, so the reference is the float64 product of the two dequantized operands.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

import ggml

from ggml_matmul import ggml_mul_mat

QK_K = 256
#: block bytes, and where its fp16 super-block scales lie: Q4_K d, dmin first (then 12 bytes of
#: scales and mins, 128 of nibbles); Q6_K 128 bytes of low bits, 64 of high bits, 16 scales, d last
LAYOUT = {"Q4_K": (144, slice(0, 4)), "Q6_K": (210, slice(208, 210))}


def _random_blocks(rng: np.random.Generator, wtype: str, n_rows: int, k: int) -> np.ndarray:
    size, scales_at = LAYOUT[wtype]
    blocks = rng.integers(0, 256, (n_rows, k // QK_K, size), dtype=np.uint8)
    n_scales = (scales_at.stop - scales_at.start) // 2
    scales = rng.uniform(1e-3, 1e-2, (n_rows, k // QK_K, n_scales)).astype(np.float16)
    blocks[:, :, scales_at] = scales.view(np.uint8).reshape(n_rows, k // QK_K, 2 * n_scales)
    return blocks.reshape(n_rows, k // QK_K * size)


def _on_q8_k_grid(rng: np.random.Generator, n_tok: int, k: int) -> np.ndarray:
    """Per block of 256: integers in [-127, 127], one of them +-127, times a power of two s; ggml's
    quantize_row_q8_K scales the block's first largest magnitude to -127 (scale -+s: exact)."""
    q = rng.integers(-127, 128, (n_tok, k // QK_K, QK_K))
    q[:, :, rng.integers(0, QK_K)] = rng.choice([-127, 127])
    scale = 2.0 ** rng.integers(-8, -2, (n_tok, k // QK_K, 1))
    return (q * scale).reshape(n_tok, k).astype(np.float32)


@pytest.mark.parametrize("wtype", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("k,n_rows,n_tok", [(256, 5, 1), (1024, 33, 1), (256, 7, 2), (512, 17, 3),
                                            (1024, 130, 4), (256, 9, 5), (768, 11, 6), (256, 66, 7),
                                            (1024, 45, 8), (512, 21, 9), (256, 10, 16), (768, 45, 13),
                                            (256, 3, 37), (2816, 5, 300), (51200, 3, 20), (512, 48, 5), (512, 32, 6),
                                            (1024, 35, 16), (256, 40, 23), (768, 96, 12), (512, 40, 37),
                                            (256, 33, 300)])
def test_k_quant_product_matches_numpy(wtype: str, k: int, n_rows: int, n_tok: int, threads: int) -> None:
    rng = np.random.default_rng(k * 7 + n_rows * 3 + n_tok + threads)
    w_q = _random_blocks(rng, wtype, n_rows, k)
    x = _on_q8_k_grid(rng, n_tok, k)
    got = ggml_mul_mat(w_q, getattr(ggml, f"GGML_TYPE_{wtype}"), k, n_rows, x, threads)
    w = dequantize(w_q, GGMLQuantizationType[wtype]).astype(np.float64)
    want = x.astype(np.float64) @ w.T
    # float32 sums of k/256 super-blocks of scaled integer sums (each exact in int32): ~1e-6
    # relative to the terms' magnitude
    scale = np.abs(x).astype(np.float64) @ np.abs(w).T
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 1e-6)


def test_k_quant_products_without_amx_tiles() -> None:
    """The shapes above with the AMX tiles switched off (a process of its own: ggml reads the
    switch once): tinyBLAS_K_fewcols and ggml's tiled product alone."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, DELTARUN_K_AMX="0")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
                        "-k", "matches_numpy"], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def test_k_quant_tiles_are_reported_where_q8_0_tiles_are() -> None:
    """The engine sizes its steps by `amx_columns` (16 columns a tile): Q4_K and Q6_K report the
    tiles wherever Q8_0 does (the same permission and CPU; the K-quant kernel also needs AVX-512
    VBMI), and none with DELTARUN_K_AMX=0."""
    import os

    from deltarun.base.ggml_compat import amx_columns

    with open("/proc/cpuinfo") as f:
        vbmi = "avx512vbmi" in f.read().split()
    on = amx_columns(ggml.GGML_TYPE_Q8_0) == 16 and vbmi and os.environ.get("DELTARUN_K_AMX") != "0"
    assert amx_columns(ggml.GGML_TYPE_Q4_K) == amx_columns(ggml.GGML_TYPE_Q6_K) == (16 if on else 0)
