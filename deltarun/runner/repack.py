"""ggml's CPU repack buffer type: weights laid out for the CPU's GEMV/GEMM kernels at load."""

from __future__ import annotations

import os
import re
from typing import Any, Literal, Union

from deltarun.base.ggml_util import Tensor, ctypes, ggml, new_context

#: Model(repack=...): True repacks what pays (the default: not TILED_TYPES where ggml's tiled
#: product runs), "all" everything CPU_REPACK takes (llama.cpp's default), False nothing.
RepackMode = Union[bool, Literal["all"]]


#: `ggml_backend_dev_get_extra_bufts_t` (ggml-backend.h): the CPU registry's proc address that lists
#: its extra buffer types (a NULL-terminated array); ggml-python has no binding for it.
EXTRA_BUFTS_FN = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)


def cpu_repack_buffer_type() -> Any | None:
    """ggml's CPU_REPACK buffer type, when this build has it (None otherwise).

    Weights set into it are stored as interleaved rows for ggml's AVX2 / AVX-512 / NEON GEMV and
    GEMM kernels of their type (Q4_0, Q4_K, IQ4_NL, MXFP4 on x86; Q2_K with AVX-512; more on ARM):
    llama.cpp's default CPU "extra buffer type". Found through the CPU registry's
    `ggml_backend_dev_get_extra_bufts`, which ggml exports by name only.
    """
    reg = ggml.ggml_backend_cpu_reg()
    fn = ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    dev = ggml.ggml_backend_dev_by_type(ggml.GGML_BACKEND_DEVICE_TYPE_CPU)
    if not fn or not dev:
        return None
    extra = EXTRA_BUFTS_FN(fn)(dev)
    i = 0
    while extra and extra[i]:
        if ggml.ggml_backend_buft_name(extra[i]) == b"CPU_REPACK":
            return extra[i]
        i += 1
    return None


#: Types CPU_REPACK takes that stay in the file's layout by default where ggml's tiled K-quant
#: product runs (`tiled_kquant_product`): ggml 0.25 computes prompts (>= 8 columns) with it only from
#: weights that are not repacked. Q4_K_M on the AVX-512 Xeon (1 thread, bench/RESULTS.md): pp512
#: 1.41x the repacked GEMM's speed, tg128 the same within 3%. Q2_K (repacked on AVX-512 too) is a
#: tiled type as well but was not measured, so it is still repacked.
TILED_TYPES = frozenset({ggml.GGML_TYPE_Q4_K})


def tiled_kquant_product() -> bool:
    """Whether ggml's CPU backend multiplies K-quant weights by its tiled product (ggml-cpu/tiled,
    ggml >= 0.25): the kernel is in the library, compiled for x86 with AVX2 (elsewhere it declines
    every product) and not switched off with GGML_CPU_TILED_MM=0, ggml's own switch."""
    from ggml import ggml as bindings   # the module whose `lib` holds every ggml library

    if not hasattr(bindings.lib, "ggml_compute_forward_mul_mat_tiled") or not ggml.ggml_cpu_has_avx2():
        return False
    switch = os.environ.get("GGML_CPU_TILED_MM")     # ggml reads it with atoi(): on unless a number != 0
    number = re.match(r"\s*[+-]?\d+", switch or "")
    return switch is None or (number is not None and int(number.group()) != 0)


def worth_repacking(weight: Tensor, mode: RepackMode) -> bool:
    """Whether `mode` lays `weight` out for CPU_REPACK (when ggml has a kernel for it): "all" every
    such weight, True all but TILED_TYPES where the tiled product takes them instead."""
    if mode == "all":
        return True
    return bool(mode) and not (int(weight.contents.type) in TILED_TYPES and tiled_kquant_product())


def repack_supports(weight: Tensor, buft: Any) -> bool:
    """Whether ggml's CPU backend computes the product that reads `weight` (F32 activations) with
    `weight` stored in `buft`: asked of ggml, as llama.cpp does, with a probe node of the op the
    graphs use, whose weight lies in an empty buffer of that type. Stacked experts (`*_exps`) are
    read by MUL_MAT_ID; every other matrix by MUL_MAT, a 3-D one (MLA's per-head `attn_k_b` /
    `attn_v_b`) batched over its heads, which the repack kernels do not take: repacking it left the
    node without a backend (ggml aborted at the first graph). A weight that a graph also reads
    otherwise (get_rows) must not be repacked: the caller knows."""
    dims = int(ggml.ggml_n_dims(weight))
    if dims not in (2, 3):
        return False
    dev = ggml.ggml_backend_dev_by_type(ggml.GGML_BACKEND_DEVICE_TYPE_CPU)
    probe_buffer = ggml.ggml_backend_buft_alloc_buffer(buft, 0)
    ctx = new_context(8)
    try:
        ne = weight.contents.ne
        w = ggml.ggml_new_tensor(ctx, weight.contents.type, dims, ne)
        w.contents.buffer = probe_buffer
        if dims == 3 and b"_exps" in ggml.ggml_get_name(weight):
            x = ggml.ggml_new_tensor_3d(ctx, ggml.GGML_TYPE_F32, ne[0], 1, 1)
            ids = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_I32, 1, 1)
            op = ggml.ggml_mul_mat_id(ctx, w, x, ids)
        else:
            op = ggml.ggml_mul_mat(ctx, w, ggml.ggml_new_tensor_3d(ctx, ggml.GGML_TYPE_F32, ne[0], 1, ne[2]))
        return bool(ggml.ggml_backend_dev_supports_op(dev, op))
    finally:
        ggml.ggml_free(ctx)
        if probe_buffer:
            ggml.ggml_backend_buffer_free(probe_buffer)


