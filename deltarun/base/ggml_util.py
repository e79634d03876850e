"""Small helpers over the raw ggml-python bindings: shapes, strides, names, contexts."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from deltarun.base.ggml_compat import ggml

Tensor = Any  # ctypes pointer to ggml_tensor

NP_TYPES = {
    ggml.GGML_TYPE_F32: np.float32,
    ggml.GGML_TYPE_F16: np.float16,
    ggml.GGML_TYPE_I32: np.int32,
    ggml.GGML_TYPE_I64: np.int64,
}


def ne(t: Tensor) -> tuple[int, int, int, int]:
    c = t.contents
    return (c.ne[0], c.ne[1], c.ne[2], c.ne[3])


def nb(t: Tensor) -> tuple[int, int, int, int]:
    c = t.contents
    return (c.nb[0], c.nb[1], c.nb[2], c.nb[3])


def name_of(t: Tensor) -> str:
    return ggml.ggml_get_name(t).decode(errors="replace")


def c_text(b: bytes | None) -> str:
    """A C string from ggml (a name, a description) as text; '' for NULL."""
    return (b or b"").decode(errors="replace")


def set_name(t: Tensor, name: str) -> Tensor:
    ggml.ggml_set_name(t, name.encode()[:63])
    return t


def new_context(n_tensors: int) -> Any:
    """A metadata-only context (tensor data lives in backend buffers)."""
    size = ggml.ggml_tensor_overhead() * n_tensors + ggml.ggml_graph_overhead_custom(n_tensors, False) + 1024
    params = ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=True)
    ctx = ggml.ggml_init(params)
    if not ctx:
        raise MemoryError("ggml_init failed to allocate a context")
    return ctx


def tensor_to_numpy(t: Tensor) -> np.ndarray:
    """Copy a contiguous F32/F16/I32 tensor out of its backend buffer; numpy shape is reverse ne."""
    ttype = t.contents.type
    if ttype not in NP_TYPES:
        raise TypeError(f"cannot read tensor of ggml type {ttype} into numpy")
    shape = tuple(reversed(ne(t)[: int(ggml.ggml_n_dims(t))]))
    out = np.empty(shape, dtype=NP_TYPES[ttype])
    ggml.ggml_backend_tensor_get(t, out.ctypes.data, 0, out.nbytes)
    return out


def numpy_to_tensor(t: Tensor, arr: np.ndarray, offset: int = 0) -> None:
    arr = np.ascontiguousarray(arr)
    ggml.ggml_backend_tensor_set(t, arr.ctypes.data, offset, arr.nbytes)


def nbytes(t: Tensor) -> int:
    return int(ggml.ggml_nbytes(t))


def c_array(ctype: Any, values: list[Any]) -> Any:
    return (ctype * len(values))(*values)


__all__ = ["ggml", "ne", "nb", "name_of", "c_text", "set_name", "new_context", "tensor_to_numpy",
           "numpy_to_tensor", "nbytes", "c_array", "ctypes", "Tensor"]
