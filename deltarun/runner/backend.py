"""Opening ggml backends by name (see devices.py for the names), and buffers on them.

A `Backend` owns one ggml backend (the device that runs the graph) plus, for a non-CPU device,
the CPU backend the scheduler falls back to for ops the device lacks (and for the layers kept on
the CPU by `--gpu-layers`). The CPU backend is always last, as ggml's scheduler requires.
Which backend holds which layer is placement.py's, running graphs on them scheduler.py's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from deltarun.base.errors import BackendError, DeltarunError
from deltarun.base.ggml_log import HeldLog
from deltarun.base.ggml_util import Tensor, c_text, ctypes, ggml
from deltarun.runner import rpc
from deltarun.runner.cpu_threads import ThreadPinning
from deltarun.runner.devices import (DEVICE_KINDS, DeviceInfo, best_device, find_device, parse_backend_name,
                                     physical_cores)
from deltarun.runner.units import format_bytes


@dataclass
class Backend:
    """A ready-to-use backend: the ggml handle, its name and its default buffer type.

    `cpu` is the CPU fallback of a device backend (None for a CPU backend, which is its own).
    """

    name: str
    handle: int
    cpu_ref: bool = False
    kind: str = "cpu"
    device: DeviceInfo | None = None
    cpu: "Backend | None" = None
    #: pin the compute threads (cpu_threads.ThreadPinning): None = when they are one per core
    pin: bool | None = None
    pinning: ThreadPinning | None = None

    @property
    def buffer_type(self) -> int:
        return ggml.ggml_backend_get_default_buffer_type(self.handle)

    @property
    def is_cpu(self) -> bool:
        return bool(ggml.ggml_backend_is_cpu(self.handle))

    @property
    def cpu_backend(self) -> "Backend":
        """The CPU backend that runs what the device does not (itself for a CPU backend)."""
        return self if self.cpu is None else self.cpu

    @property
    def sched_backends(self) -> list["Backend"]:
        """The backends a scheduler needs, in priority order, CPU last."""
        return [self] if self.cpu is None else [self, self.cpu]

    @property
    def description(self) -> str:
        if self.device is not None:
            return f"{self.device.name} ({self.device.description})"
        return c_text(ggml.ggml_backend_name(self.handle)) + (" (reference kernels)" if self.cpu_ref else "")

    def set_threads(self, n_threads: int) -> None:
        check_threads(n_threads)
        if self.is_cpu:
            ggml.ggml_backend_cpu_set_n_threads(self.handle, n_threads)
            self.pinning = ThreadPinning.choose(n_threads, self.pin)
        if self.cpu is not None:
            self.cpu.set_threads(n_threads)

    def supports_op(self, t: Any) -> bool:
        return bool(ggml.ggml_backend_supports_op(self.handle, t))

    def free(self) -> None:
        if self.cpu is not None:
            self.cpu.free()
            self.cpu = None
        if self.handle:
            ggml.ggml_backend_free(self.handle)
            self.handle = 0


#: the most CPU threads a graph computes with: ggml's GGML_MAX_N_THREADS (more aborts the process)
MAX_THREADS = int(ggml.GGML_MAX_N_THREADS)


def check_threads(n_threads: int) -> None:
    """Refuse a thread count ggml's CPU backend cannot take, before it is given one."""
    if not 1 <= n_threads <= MAX_THREADS:
        raise DeltarunError(f"--threads must be between 1 and {MAX_THREADS} (got {n_threads})")


def _init_cpu(n_threads: int | None, ref: bool = False, pin: bool | None = None) -> Backend:
    if n_threads is not None:
        check_threads(n_threads)
    handle = ggml.ggml_backend_cpu_init()
    if not handle:
        raise BackendError("ggml could not start the CPU backend")
    backend = Backend("cpu-ref" if ref else "cpu", handle, cpu_ref=ref, pin=pin)
    if ref:
        ggml.ggml_backend_cpu_set_use_ref(handle, True)
    backend.set_threads(n_threads or physical_cores())
    return backend


def vulkan_workaround() -> None:
    """Switch off ggml-vulkan's graph reordering (GGML_VK_DISABLE_GRAPH_OPTIMIZE=1).

    ggml-vulkan reorders each split's nodes in place in the caller's graph to run independent
    nodes together. deltarun keeps its graphs and allocates them again when a shape comes back;
    with the reordering on, a prefill / decode / prefill sequence on the tiny model corrupted the
    heap on Mesa's lavapipe (Debian 12: Mesa 22.3.6, LLVM 15) in 33 of 98 runs (6 of 10 once the
    scheduler's source rewrites were undone, see Scheduler.allocate), in none of 26 with it off.
    That crash no longer shows (2026-11-30: 0 of 12 such runs with the reordering on, on Mesa
    22.3.6 and on 25.0.7) and lavapipe 22.3 turned out to corrupt its heap on its own (see
    scripts/install-vulkan.sh). It stays off because the order then is deltarun's: `compare`
    matches a device graph to the CPU's node by node and `graph` shows the order that ran; with it
    on, graphs are matched by name and unnamed nodes go unchecked (133 instead of 321 nodes per
    graph of the tiny model). Not measured on a GPU; it only costs some overlap between nodes.
    The user's own GGML_VK_DISABLE_GRAPH_OPTIMIZE, or DELTARUN_VK_WORKAROUNDS=0, wins. ggml reads
    it when it first opens the device, so it is set before that.
    """
    if os.environ.get("DELTARUN_VK_WORKAROUNDS") != "0":
        os.environ.setdefault("GGML_VK_DISABLE_GRAPH_OPTIMIZE", "1")


def init_backend(name: str = "cpu", n_threads: int | None = None, pin: bool | None = None) -> Backend:
    """Open a backend by name (see the module docstring); `pin`: see cpu_threads.ThreadPinning.choose."""
    kind, index = parse_backend_name(name)
    if kind in ("cpu", "cpu-ref"):
        return _init_cpu(n_threads, ref=kind == "cpu-ref", pin=pin)
    if kind == "auto":
        dev = best_device()
        if dev is None:
            return _init_cpu(n_threads, pin=pin)
    else:
        dev = find_device(kind, index)
    if dev.registry == "Vulkan":
        vulkan_workaround()
    handle = ggml.ggml_backend_dev_init(dev.handle, None)
    if not handle:
        raise BackendError(f"ggml could not start {dev.name} ({dev.description})")
    backend = Backend(dev.backend_name, handle, kind=dev.registry.lower(), device=dev)
    try:
        backend.cpu = _init_cpu(n_threads, pin=pin)
    except BackendError:
        backend.free()
        raise
    return backend


def check_backend(name: str) -> str:
    """Raise the BackendError `init_backend(name)` would, without starting anything; returns the
    kind ("cpu", "cpu-ref", "auto", "vulkan", "cuda", "rpc"). Commands call it before any work.
    An `rpc:HOST:PORT[,...]` name is checked for its syntax and for RPC in this build; the server
    itself is probed when the model opens."""
    if name.strip().lower().startswith("rpc:"):
        rpc.require()
        rpc.parse_endpoints(name.strip()[4:])
        return "rpc"
    kind, index = parse_backend_name(name)
    if kind in DEVICE_KINDS:
        find_device(kind, index)
    return kind


def alloc_tensors(backend: Backend, tensors: list[Tensor], what: str, buft: Any = None) -> Any:
    """One buffer of `backend`'s type (or of `buft`) holding exactly `tensors` (laid out in order,
    aligned)."""
    buft = backend.buffer_type if buft is None else buft
    align = int(ggml.ggml_backend_buft_get_alignment(buft))
    offsets, size = [], 0
    for t in tensors:
        offsets.append(size)
        size += -(-int(ggml.ggml_backend_buft_get_alloc_size(buft, t)) // align) * align
    with HeldLog() as held:     # ggml says why in lines of its own: the error says it in one
        buffer = ggml.ggml_backend_buft_alloc_buffer(buft, max(size, align))
    if not buffer:
        raise BackendError(f"backend {backend.name} could not allocate {format_bytes(size)} for {what}: "
                           f"{held.reason}")
    held.release()
    base = int(ggml.ggml_backend_buffer_get_base(buffer) or 0)
    for t, off in zip(tensors, offsets):
        if ggml.ggml_backend_tensor_alloc(buffer, t, ctypes.c_void_p(base + off)) != 0:
            ggml.ggml_backend_buffer_free(buffer)
            raise BackendError(f"backend {backend.name} could not place a tensor of {what}")
    return buffer
