"""ggml backends by name, and the scheduler that runs graphs on them.

A `Backend` owns one ggml backend (the device that runs the graph) plus the CPU backend the
scheduler falls back to for ops the device lacks. The CPU backend is always last, as ggml's
scheduler requires.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from deltarun.runner.errors import BackendError
from deltarun.runner.ggml_util import c_array, ctypes, ggml

GRAPH_SIZE = 16384


def physical_cores() -> int:
    """A default thread count: the cores this process may use (ggml does best at one per core)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


@dataclass
class Backend:
    """A ready-to-use backend: the ggml handle, its name and its default buffer type."""

    name: str
    handle: int
    cpu_ref: bool = False

    @property
    def buffer_type(self) -> int:
        return ggml.ggml_backend_get_default_buffer_type(self.handle)

    @property
    def is_cpu(self) -> bool:
        return bool(ggml.ggml_backend_is_cpu(self.handle))

    def set_threads(self, n_threads: int) -> None:
        if self.is_cpu:
            ggml.ggml_backend_cpu_set_n_threads(self.handle, n_threads)

    def free(self) -> None:
        if self.handle:
            ggml.ggml_backend_free(self.handle)
            self.handle = 0


def init_backend(name: str = "cpu", n_threads: int | None = None) -> Backend:
    """Open a backend by name: `cpu`, or `cpu-ref` (CPU with ggml's reference kernels)."""
    key = name.lower()
    if key not in ("cpu", "cpu-ref", "auto"):
        raise BackendError(f"unknown backend {name!r}; this build supports: cpu, cpu-ref")
    handle = ggml.ggml_backend_cpu_init()
    if not handle:
        raise BackendError("ggml could not start the CPU backend")
    backend = Backend("cpu-ref" if key == "cpu-ref" else "cpu", handle, cpu_ref=key == "cpu-ref")
    if backend.cpu_ref:
        ggml.ggml_backend_cpu_set_use_ref(handle, True)
    backend.set_threads(n_threads or physical_cores())
    return backend


def forget_addresses(ctx: Any) -> None:
    """Clear data and buffer of every tensor created in a graph context (nodes, inputs, views)."""
    t = ggml.ggml_get_first_tensor(ctx)
    while t:
        c = t.contents
        c.data = None
        c.buffer = None
        t = ggml.ggml_get_next_tensor(ctx, t)


class Scheduler:
    """ggml_backend_sched over the backend(s); remembers which graph is currently allocated."""

    def __init__(self, backends: list[Backend], graph_size: int = GRAPH_SIZE):
        self.backends = backends
        handles = c_array(ctypes.c_void_p, [b.handle for b in backends])
        bufts = c_array(ctypes.c_void_p, [b.buffer_type for b in backends])
        self.handle = ggml.ggml_backend_sched_new(handles, bufts, len(backends), graph_size, False, True)
        if not self.handle:
            raise BackendError("ggml_backend_sched_new failed")
        self._allocated: Any = None

    def reserve(self, gf: Any) -> None:
        """Size the compute buffers for the largest graph once, so later graphs never reallocate."""
        if not ggml.ggml_backend_sched_reserve(self.handle, gf):
            raise BackendError("the backend refused to reserve compute buffers for the graph")

    def allocate(self, gf: Any, ctx: Any) -> None:
        """Allocate `gf` (whose tensors live in `ctx`) unless it is the graph allocated last.

        ggml's allocator keeps a tensor's old address when its data pointer is set, which is
        only right for the graph allocated last: another graph may have moved or reallocated the
        compute buffer since. So a graph coming back is first stripped of its addresses, and is
        then laid out as if new.
        """
        if self._allocated is not None and ctypes.addressof(self._allocated.contents) == ctypes.addressof(gf.contents):
            return
        forget_addresses(ctx)
        ggml.ggml_backend_sched_reset(self.handle)
        if not ggml.ggml_backend_sched_alloc_graph(self.handle, gf):
            size = self.compute_buffer_size()
            raise BackendError(f"the backend could not allocate the compute graph (compute buffers {size} bytes)")
        self._allocated = gf

    def compute(self, gf: Any) -> None:
        status = ggml.ggml_backend_sched_graph_compute(self.handle, gf)
        if status != 0:
            raise BackendError(f"graph compute failed with ggml status {status}")

    def forget(self) -> None:
        """Drop the record of the allocated graph (its context is about to be freed)."""
        self._allocated = None
        ggml.ggml_backend_sched_reset(self.handle)

    def n_splits(self) -> int:
        return int(ggml.ggml_backend_sched_get_n_splits(self.handle))

    def compute_buffer_size(self) -> int:
        return sum(int(ggml.ggml_backend_sched_get_buffer_size(self.handle, b.handle)) for b in self.backends)

    def free(self) -> None:
        if self.handle:
            ggml.ggml_backend_sched_free(self.handle)
            self.handle = 0
