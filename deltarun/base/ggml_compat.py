"""Fixes for ggml-python 0.0.45 binding bugs, applied once at import.

Some functions declare a `typing.NewType` as their ctypes restype, so ctypes returns a C int and
a 64-bit pointer comes back cut to 32 bits. Setting the restype to c_void_p repairs them. Import
`ggml` through this module (`from deltarun.base.ggml_compat import ggml`) so the fixes are in
place before any call.
"""

from __future__ import annotations

import ctypes

import ggml

#: Functions whose declared restype truncates the returned pointer.
POINTER_RESTYPE_FIXES: tuple[str, ...] = (
    "ggml_backend_cpu_buffer_from_ptr",
    "ggml_backend_cpu_buffer_type",
    "ggml_backend_alloc_buffer",
    "ggml_backend_sched_get_tensor_backend",
    "ggml_backend_vk_buffer_type",
    "ggml_backend_vk_host_buffer_type",
)


def _apply_fixes() -> list[str]:
    fixed = []
    for name in POINTER_RESTYPE_FIXES:
        fn = getattr(ggml, name, None)
        if fn is not None and hasattr(fn, "restype"):
            fn.restype = ctypes.c_void_p
            fixed.append(name)
    return fixed


FIXED_FUNCTIONS: list[str] = _apply_fixes()


def cpu_writes_slots_in_place() -> bool:
    """Whether this ggml's CPU gated delta net can write its snapshot slots into the state's own
    buffer (op param 1; the ggml patch gated-delta-net-slots-in-place exports a marker)."""
    return hasattr(ggml.ggml.lib, "deltarun_gdn_slots_in_place")


def _exported_count(name: str) -> int:
    """An int a ggml patch exports by `name` (0 when this build lacks it)."""
    fn = getattr(ggml.ggml.lib, name, None)
    if fn is None:
        return 0
    fn.restype = ctypes.c_int
    return int(fn())


def amx_columns(weight_type: int) -> int:
    """The columns of one AMX tile this ggml's CPU multiplies weights of `weight_type` by (0: no
    tiles for that type here). The ggml patches q8_0-tiles-amx (Q8_0), widened-half-tiles-amx
    (F16, BF16) and k-quant-tiles-amx (Q4_K, Q6_K) export the count, asking Linux for the tile
    permission first."""
    export = {ggml.GGML_TYPE_Q8_0: "deltarun_q8_0_amx_columns", ggml.GGML_TYPE_F16: "deltarun_half_amx_columns",
              ggml.GGML_TYPE_BF16: "deltarun_half_amx_columns", ggml.GGML_TYPE_Q4_K: "deltarun_k_quant_amx_columns",
              ggml.GGML_TYPE_Q6_K: "deltarun_k_quant_amx_columns"}.get(weight_type)
    return _exported_count(export) if export else 0


def wide_columns(weight_type: int) -> int:
    """The columns this ggml's CPU multiplies weights of `weight_type` by at once for well under
    their count times one column's cost (0: none for that type here): an AMX tile's (`amx_columns`),
    or a group of Q8_0's column lanes on AVX-512 VNNI CPUs (q8_0-few-columns.patch exports it: 16
    columns cost 1.4-1.5x one on Zen 5)."""
    lanes = _exported_count("deltarun_q8_0_lane_columns") if weight_type == ggml.GGML_TYPE_Q8_0 else 0
    return max(amx_columns(weight_type), lanes)


__all__ = ["ggml", "FIXED_FUNCTIONS", "POINTER_RESTYPE_FIXES", "cpu_writes_slots_in_place", "amx_columns",
           "wide_columns"]
