"""ggml backends by name, the device registry, layer placement, and the scheduler that runs graphs.

A `Backend` owns one ggml backend (the device that runs the graph) plus, for a non-CPU device,
the CPU backend the scheduler falls back to for ops the device lacks (and for the layers kept on
the CPU by `--gpu-layers`). The CPU backend is always last, as ggml's scheduler requires.

Backend names (`--backend`):

    cpu          ggml's CPU backend
    cpu-ref      the CPU backend with its reference kernels (ggml_backend_cpu_set_use_ref)
    vulkan[:N]   the N-th Vulkan device of ggml's registry (Vulkan0, Vulkan1, ...), default 0
    cuda[:N]     the N-th CUDA device (CUDA0, ...), default 0
    auto         the best device found: a discrete GPU, then an integrated one, CPU last
                 (software renderers such as Mesa's llvmpipe/lavapipe are never chosen)

A name this build of ggml-python cannot serve raises `BackendError` saying how to install the
variant that can.
"""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from deltarun.runner.cpu_threads import ThreadPinning, core_cpus
from deltarun.runner.errors import BackendError
from deltarun.runner.ggml_util import Tensor, c_array, ctypes, ggml, new_context

GRAPH_SIZE = 16384

GGML_VERSION = "0.0.45"

#: Backend kinds deltarun knows, with the ggml registry name and the build flag of each.
DEVICE_KINDS = {"vulkan": ("Vulkan", "GGML_VULKAN"), "cuda": ("CUDA", "GGML_CUDA")}

#: Device descriptions of software renderers: usable when asked for by name, never picked by `auto`.
SOFTWARE_DEVICE = re.compile(r"llvmpipe|lavapipe|swiftshader|softpipe", re.IGNORECASE)

DEVICE_TYPE_NAMES = {
    ggml.GGML_BACKEND_DEVICE_TYPE_CPU: "cpu",
    ggml.GGML_BACKEND_DEVICE_TYPE_GPU: "gpu",
    ggml.GGML_BACKEND_DEVICE_TYPE_IGPU: "igpu",
    ggml.GGML_BACKEND_DEVICE_TYPE_ACCEL: "accel",
}


def physical_cores(sysfs: str = "/sys/devices/system/cpu") -> int:
    """The default thread count: physical cores this process may run on, as llama.cpp defaults to.

    ggml's matrix kernels saturate a core's vector units with one thread, so a second thread on
    an SMT sibling only adds synchronisation. Cores are counted as distinct sibling sets among the
    CPUs in this process's affinity mask; without that topology information, each CPU is a core.
    """
    return len(core_cpus(sysfs))


CPU_FEATURES = ("sse3", "ssse3", "avx", "avx2", "avx_vnni", "f16c", "fma", "bmi2", "avx512", "avx512_vbmi",
                "avx512_vnni", "avx512_bf16", "amx_int8", "neon", "arm_fma", "dotprod", "matmul_int8", "sve",
                "sme", "llamafile")


def cpu_features() -> list[str]:
    """What ggml's CPU backend was compiled with (ggml_cpu_has_*), llama.cpp's system info.

    `llamafile` matters most for speed: llama.cpp builds with it, ggml's own default leaves it off.
    """
    found = []
    for name in CPU_FEATURES:
        fn = getattr(ggml, f"ggml_cpu_has_{name}", None)
        try:
            if fn is not None and fn():
                found.append(name.upper())
        except (AttributeError, OSError):  # pragma: no cover - symbol missing from this build
            pass
    return found


def llamafile_note(features: list[str]) -> str | None:
    """What to tell a user whose ggml-python lacks llamafile's kernels (None when it has them)."""
    if "LLAMAFILE" in features:
        return None
    return ("note: this ggml-python was built without llamafile's matrix kernels, so prompt processing "
            "is slower than llama.cpp's; scripts/install.sh builds it with them (see the README)")


def patches_note() -> str | None:
    """What to tell a user whose ggml-python was not built with scripts/ggml-patches (None when it
    was: scripts/ggml-wheel.sh labels such builds `0.0.45+deltarun.<patches' hash>`)."""
    if "+deltarun." in getattr(ggml, "__version__", ""):
        return None
    return ("note: this ggml-python lacks deltarun's kernel patches (scripts/ggml-patches: SET_ROWS on "
            "every thread, Q8_0 rows read ahead), so decoding is slower; scripts/install.sh builds it with them")


def install_hint(kind: str) -> str:
    """How to get a ggml-python build with the `kind` backend."""
    flag = DEVICE_KINDS[kind][1]
    script = f"scripts/install-{kind}.sh"
    return (f"install the {kind} variant of ggml-python: `{script}` (see the README), or "
            f"`pip install --no-binary ggml-python --config-settings=cmake.args=-D{flag}=ON "
            f"ggml-python=={GGML_VERSION}`")


def build_has(kind: str) -> bool:
    """Whether this ggml-python build was compiled with the backend `kind` (vulkan, cuda)."""
    flag = {"vulkan": "GGML_USE_VULKAN", "cuda": "GGML_USE_CUDA"}[kind]
    return bool(getattr(ggml, flag, False))


# ----------------------------------------------------------------------------------------------
# The device registry
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceInfo:
    """One entry of ggml's device registry."""

    index: int             # position in ggml_backend_dev_get order
    name: str              # ggml's device name: CPU, Vulkan0, CUDA0
    description: str       # e.g. "NVIDIA H200", "llvmpipe (LLVM 15.0.6, 256 bits)"
    type: str              # cpu, gpu, igpu, accel
    registry: str          # the backend registry: CPU, Vulkan, CUDA
    memory_free: int
    memory_total: int
    handle: int = field(repr=False, compare=False, default=0)

    @property
    def backend_name(self) -> str:
        """What to pass to --backend to use this device."""
        kind = self.registry.lower()
        if kind == "cpu":
            return "cpu"
        if kind == "rpc":          # a device of a `--rpc` server: its description is the endpoint
            return f"rpc:{self.description}"
        m = re.search(r"(\d+)$", self.name)
        return f"{kind}:{m.group(1)}" if m else kind

    @property
    def software(self) -> bool:
        return bool(SOFTWARE_DEVICE.search(self.description))

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "description": self.description, "type": self.type,
                "registry": self.registry, "backend": self.backend_name, "memory_free": self.memory_free,
                "memory_total": self.memory_total, "software": self.software}


_LOADED_ALL = False


def _ensure_registry() -> None:
    """Load dynamically built backends once (a no-op for the usual builds, where they are linked in)."""
    global _LOADED_ALL
    if _LOADED_ALL:
        return
    _LOADED_ALL = True
    if int(ggml.ggml_backend_reg_count()) <= 1 and os.environ.get("DELTARUN_NO_BACKEND_LOAD") != "1":
        try:
            ggml.ggml_backend_load_all()
        except (AttributeError, OSError):  # pragma: no cover - binding without the loader
            pass


def _str(b: bytes | None) -> str:
    return (b or b"").decode(errors="replace")


def list_devices() -> list[DeviceInfo]:
    """Every device in ggml's registry, in registry order (the CPU is usually last)."""
    _ensure_registry()
    out = []
    for i in range(int(ggml.ggml_backend_dev_count())):
        dev = ggml.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        reg = ggml.ggml_backend_dev_backend_reg(dev)
        dtype = int(ggml.ggml_backend_dev_type(dev))
        out.append(DeviceInfo(index=i, name=_str(ggml.ggml_backend_dev_name(dev)),
                              description=_str(ggml.ggml_backend_dev_description(dev)),
                              type=DEVICE_TYPE_NAMES.get(dtype, str(dtype)),
                              registry=_str(ggml.ggml_backend_reg_name(reg)) if reg else "?",
                              memory_free=int(free.value), memory_total=int(total.value), handle=int(dev)))
    return out


def available_backends() -> list[str]:
    """Backend names usable here (for messages and `deltarun devices`)."""
    names = ["cpu", "cpu-ref"]
    for d in list_devices():
        if d.registry.lower() in DEVICE_KINDS:
            names.append(d.backend_name)
    return names + ["auto"]


def parse_backend_name(name: str) -> tuple[str, int | None]:
    """`vulkan:1` -> ("vulkan", 1); `cpu` -> ("cpu", None). Unknown names raise BackendError."""
    key = name.strip().lower()
    m = re.fullmatch(r"(cpu|cpu-ref|auto|vulkan|cuda)(?::(\d+))?", key)
    if not m or (m.group(2) is not None and m.group(1) not in DEVICE_KINDS):
        raise BackendError(f"unknown backend {name!r}; backends are cpu, cpu-ref, vulkan[:N], cuda[:N] and auto "
                           f"(here: {', '.join(available_backends())})")
    return m.group(1), (int(m.group(2)) if m.group(2) is not None else None)


def _find_device(kind: str, index: int | None) -> DeviceInfo:
    registry, _ = DEVICE_KINDS[kind]
    if not build_has(kind):
        raise BackendError(f"this build of ggml-python has no {registry} backend: {install_hint(kind)}")
    devs = [d for d in list_devices() if d.registry.lower() == kind]
    if not devs:
        hint = ""
        if kind == "vulkan":
            hint = ("; ggml-vulkan hides CPU devices such as Mesa's lavapipe (mesa-vulkan-drivers) unless "
                    "GGML_VK_VISIBLE_DEVICES=0 is set, and needs a Vulkan driver (check with `vulkaninfo --summary`)")
        elif kind == "cuda":
            hint = "; check the NVIDIA driver with `nvidia-smi` and CUDA_VISIBLE_DEVICES"
        raise BackendError(f"the {registry} backend is built in but found no device{hint}")
    i = 0 if index is None else index
    if not 0 <= i < len(devs):
        raise BackendError(f"no device {kind}:{i}; this machine has {', '.join(d.backend_name for d in devs)}")
    return devs[i]


def check_backend(name: str) -> str:
    """Raise the BackendError `init_backend(name)` would, without starting anything; returns the
    kind ("cpu", "cpu-ref", "auto", "vulkan", "cuda", "rpc"). Commands call it before any work.
    An `rpc:HOST:PORT[,...]` name is checked for its syntax and for RPC in this build; the server
    itself is probed when the model opens."""
    if name.strip().lower().startswith("rpc:"):
        from deltarun.runner import rpc

        rpc.require()
        rpc.parse_endpoints(name.strip()[4:])
        return "rpc"
    kind, index = parse_backend_name(name)
    if kind in DEVICE_KINDS:
        _find_device(kind, index)
    return kind


def find_device(kind: str, index: int | None) -> DeviceInfo:
    """The registry entry of `--backend kind[:index]` (vulkan, cuda); BackendError when there is none."""
    return _find_device(kind, index)


# ----------------------------------------------------------------------------------------------
# Backends
# ----------------------------------------------------------------------------------------------
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
        return _str(ggml.ggml_backend_name(self.handle)) + (" (reference kernels)" if self.cpu_ref else "")

    def set_threads(self, n_threads: int) -> None:
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


def _init_cpu(n_threads: int | None, ref: bool = False, pin: bool | None = None) -> Backend:
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


def best_device() -> DeviceInfo | None:
    """What `auto` picks: a GPU, then an integrated GPU, skipping software renderers; None = CPU."""
    devs = [d for d in list_devices() if d.registry.lower() in DEVICE_KINDS and not d.software]
    for kind in ("gpu", "igpu"):
        for d in devs:
            if d.type == kind:
                return d
    return None


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
        dev = _find_device(kind, index)
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


# ----------------------------------------------------------------------------------------------
# Layer placement (--gpu-layers)
# ----------------------------------------------------------------------------------------------
_BLK = re.compile(r"^blk\.(\d+)\.")


@dataclass
class Placement:
    """Which backend holds each layer's weights, KV cache and recurrent state.

    `gpu_layers` None (the default) puts everything on the device. An integer N follows llama.cpp's
    -ngl: the token embeddings stay on the CPU, the last min(N, n_layer) repeating layers go to the
    device, and the output layer (final norm, LM head, MTP block) too when N > n_layer. With a CPU
    backend everything is on the CPU whatever N is.
    """

    n_layer: int
    device: Backend
    gpu_layers: int | None = None

    def __post_init__(self) -> None:
        if self.gpu_layers is not None and self.gpu_layers < 0:
            raise BackendError(f"--gpu-layers must be >= 0, not {self.gpu_layers}")

    @property
    def cpu(self) -> Backend:
        return self.device.cpu_backend

    @property
    def first_device_layer(self) -> int:
        """Layers il >= this are on the device."""
        if self.device.cpu is None or self.gpu_layers is None:
            return 0 if self.device.cpu is not None else self.n_layer + 1
        return max(self.n_layer - self.gpu_layers, 0)

    @property
    def output_on_device(self) -> bool:
        if self.device.cpu is None:
            return False
        return self.gpu_layers is None or self.gpu_layers > self.n_layer

    @property
    def input_on_device(self) -> bool:
        return self.device.cpu is not None and self.gpu_layers is None

    def layer(self, il: int) -> Backend:
        """Backend of block il (il >= n_layer: the MTP blocks, placed with the output)."""
        if il >= self.n_layer:
            return self.device if self.output_on_device else self.cpu
        return self.device if il >= self.first_device_layer else self.cpu

    def for_tensor(self, name: str, tied_output: bool = False) -> Backend:
        """Backend of a weight by GGUF name; with tied embeddings the LM head is token_embd."""
        m = _BLK.match(name)
        if m:
            return self.layer(int(m.group(1)))
        if name.startswith("token_embd."):
            on = self.input_on_device or (tied_output and self.output_on_device)
            return self.device if on else self.cpu
        return self.device if self.output_on_device else self.cpu

    @property
    def sched_backends(self) -> list[Backend]:
        """The scheduler's backends: [device, CPU] or [CPU]."""
        return self.device.sched_backends

    def on_loaded(self) -> None:
        """Called once weights and memory are placed (layer_split.LayerSplit sets RPC timeouts then)."""

    def free(self) -> None:
        """Nothing of its own to free (the model frees its backend); see layer_split.LayerSplit."""

    def describe(self) -> str:
        if self.device.cpu is None:
            return f"all layers on {self.device.name}"
        n_dev = sum(1 for il in range(self.n_layer) if self.layer(il) is self.device)
        out = "output" if self.output_on_device else "no output"
        return f"{n_dev}/{self.n_layer} layers and {out} on {self.device.name}, the rest on the CPU"


# ----------------------------------------------------------------------------------------------
# The scheduler
# ----------------------------------------------------------------------------------------------
def _src_span() -> tuple[int, int]:
    field = ggml.ggml_tensor.src
    return field.offset, field.size


def node_addresses(gf: Any) -> np.ndarray:
    """Addresses of the nodes of `gf`, in order (its node array read at once)."""
    n = int(ggml.ggml_graph_n_nodes(gf))
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    array = ctypes.cast(ggml.ggml_graph_nodes(gf), ctypes.c_void_p).value
    return np.ctypeslib.as_array((ctypes.c_int64 * n).from_address(array)).copy()


#: sizeof(struct ggml_object): offs, size, next, type and padding (ggml.c)
_OBJECT_SIZE = 32


def tensor_addresses(ctx: Any) -> np.ndarray:
    """Addresses of every tensor of a context, in creation order.

    A graph context holds the graph object and then tensors only, each object header followed
    by its tensor struct at one fixed stride; that chain is checked whole with numpy (every header's
    offset, size, type and next pointer), and walked with ggml_get_next_tensor where it does not
    hold (about 0.2 ms for a thousand tensors, ten times the check)."""
    first = ggml.ggml_get_first_tensor(ctx)
    if not first:
        return np.zeros(0, dtype=np.int64)
    a0 = ctypes.addressof(first.contents)
    second = ggml.ggml_get_next_tensor(ctx, first)
    if not second:
        return np.array([a0], dtype=np.int64)
    stride = ctypes.addressof(second.contents) - a0
    base = int(ggml.ggml_get_mem_buffer(ctx) or 0)
    end = base + int(ggml.ggml_used_mem(ctx))                 # end of the last object's tensor
    last = end - (stride - _OBJECT_SIZE)
    if stride > _OBJECT_SIZE and stride % 8 == 0 and (a0 - base) % 8 == 0 and last >= a0 and (last - a0) % stride == 0:
        addrs = np.arange(a0, last + 1, stride, dtype=np.int64)
        words = np.ctypeslib.as_array((ctypes.c_int64 * ((end - base) // 8)).from_address(base))
        head = (addrs - _OBJECT_SIZE - base) // 8
        nxt = np.append(addrs[1:] - _OBJECT_SIZE, 0)
        if (np.array_equal(words[head], addrs - base) and (words[head + 1] == stride - _OBJECT_SIZE).all()
                and np.array_equal(words[head + 2], nxt) and not (words[head + 3] & 0xFFFFFFFF).any()):
            return addrs
    out = []
    t = first
    while t:
        out.append(ctypes.addressof(t.contents))
        t = ggml.ggml_get_next_tensor(ctx, t)
    return np.asarray(out, dtype=np.int64)


def snapshot_srcs(gf: Any) -> dict[int, bytes]:
    """The src pointers of every node of `gf`, by node address (raw bytes of ggml_tensor.src)."""
    off, size = _src_span()
    return {int(a): ctypes.string_at(int(a) + off, size) for a in node_addresses(gf)}


def restore_srcs(gf: Any, snapshot: dict[int, bytes]) -> bool:
    """Put back the src pointers saved by `snapshot_srcs`; False if `gf` has nodes it lacks."""
    off, _ = _src_span()
    nodes = [int(a) for a in node_addresses(gf)]
    if len(nodes) != len(snapshot) or any(a not in snapshot for a in nodes):
        return False
    for addr in nodes:
        saved = snapshot[addr]
        ctypes.memmove(addr + off, saved, len(saved))
    return True


def forget_addresses(ctx: Any) -> None:
    """Clear data and buffer of every tensor created in a graph context (nodes, inputs, views)."""
    for a in tensor_addresses(ctx):
        c = ggml.ggml_tensor.from_address(int(a))
        c.data = None
        c.buffer = None


class GraphLayout:
    """`restore_srcs` + `forget_addresses` of one graph as two numpy assignments.

    Both are a ctypes call or two per node / tensor (about 0.5 ms for the built-in model's 318-node
    decode graph, more than ggml's own allocation of it): a server whose graphs alternate pays
    that at every step. Every tensor of a graph context, the graph's nodes included, is a struct
    in the context's one memory buffer, so the words to rewrite are found once: each node's src
    pointers (put back from the saved ones) and each tensor's data and buffer pointers (cleared).
    `matches` checks that the graph is still the one measured (same buffer, node count, first and
    last node) before each use. Made before a graph's first allocation, it saves the srcs as they
    are (the graph's own): a new graph's first allocation then costs two numpy reads, not a
    ctypes call per node.
    """

    def __init__(self, gf: Any, ctx: Any, snapshot: dict[int, bytes] | None = None):
        self.base = int(ggml.ggml_get_mem_buffer(ctx) or 0)
        size = int(ggml.ggml_get_mem_size(ctx)) // 8
        self.words = np.ctypeslib.as_array((ctypes.c_uint64 * size).from_address(self.base))
        off, span = _src_span()
        nodes = node_addresses(gf) if snapshot is None else \
            np.fromiter(snapshot.keys(), dtype=np.int64, count=len(snapshot))
        self.n_nodes = len(nodes)
        self.ends = (int(nodes[0]), int(nodes[-1])) if len(nodes) else (0, 0)
        self.src_idx = ((nodes - self.base + off) // 8)[:, None] + np.arange(span // 8)[None, :]
        addrs = tensor_addresses(ctx) - self.base
        self.ptr_idx = np.concatenate([(addrs + ggml.ggml_tensor.data.offset) // 8,
                                       (addrs + ggml.ggml_tensor.buffer.offset) // 8])
        aligned = (off % 8 == 0 and span % 8 == 0 and ggml.ggml_tensor.data.offset % 8 == 0
                   and ggml.ggml_tensor.buffer.offset % 8 == 0 and not (addrs % 8).any()
                   and not ((nodes - self.base) % 8).any())
        inside = bool(len(addrs)) and addrs.min() >= 0 and addrs.max() + ctypes.sizeof(ggml.ggml_tensor) <= 8 * size \
            and (nodes >= self.base).all() and (nodes - self.base + off + span <= 8 * size).all()
        self.usable = aligned and inside
        if not self.usable:
            return
        if snapshot is None:
            self.src_saved = self.words[self.src_idx].copy()
        else:
            self.src_saved = np.frombuffer(b"".join(snapshot.values()), dtype=np.uint64).reshape(len(nodes), span // 8)

    def snapshot(self) -> dict[int, bytes]:
        """The saved srcs as `snapshot_srcs` gives them."""
        nodes = (self.src_idx[:, 0] * 8 + self.base - _src_span()[0]).tolist()
        return {a: row.tobytes() for a, row in zip(nodes, self.src_saved)}

    @classmethod
    def of(cls, gf: Any, ctx: Any, snapshot: dict[int, bytes] | None = None) -> "GraphLayout | None":
        try:
            layout = cls(gf, ctx, snapshot)
        except (ValueError, TypeError):
            return None
        return layout if layout.usable else None

    def matches(self, gf: Any, ctx: Any) -> bool:
        n = int(ggml.ggml_graph_n_nodes(gf))
        return (n == self.n_nodes and n > 0 and int(ggml.ggml_get_mem_buffer(ctx) or 0) == self.base
                and ctypes.addressof(ggml.ggml_graph_node(gf, 0).contents) == self.ends[0]
                and ctypes.addressof(ggml.ggml_graph_node(gf, n - 1).contents) == self.ends[1])

    def reset(self) -> None:
        """restore_srcs(gf, snapshot) and forget_addresses(ctx)."""
        self.words[self.src_idx] = self.src_saved
        self.words[self.ptr_idx] = 0


EvalCallback = Callable[[Any, bool, Any], bool]


def _null_callback() -> Any:
    return ggml.ggml_backend_sched_eval_callback()


@ggml.ggml_backend_sched_eval_callback
def _pass_through(t: Any, ask: bool, user_data: Any) -> bool:  # pragma: no cover - only if NULL is refused
    return not ask


def _clear_callback(sched: Any) -> None:
    """Remove the eval callback: NULL where the binding accepts it, else a module-level pass-through."""
    try:
        ggml.ggml_backend_sched_set_eval_callback(sched, _null_callback(), None)
    except (ctypes.ArgumentError, TypeError):  # pragma: no cover - older bindings
        ggml.ggml_backend_sched_set_eval_callback(sched, _pass_through, None)


class Scheduler:
    """ggml_backend_sched over the backend(s); remembers which graph is currently allocated.

    With a device and the CPU, ggml splits each graph: an op runs where its weights are, ops the
    device does not support (ggml_backend_dev_supports_op) fall back to the CPU, and with
    op_offload large-batch ops on CPU-resident weights may be offloaded to the device.

    The scheduler owns its eval callback: `set_eval_callback(fn)` installs a Python callback
    (fn(tensor, ask, user_data) -> bool, as ggml's; it must not raise) and keeps it alive until
    `clear_eval_callback()`.
    """

    def __init__(self, backends: list[Backend], graph_size: int = GRAPH_SIZE):
        self.backends = backends
        handles = c_array(ctypes.c_void_p, [b.handle for b in backends])
        bufts = c_array(ctypes.c_void_p, [b.buffer_type for b in backends])
        self.handle = ggml.ggml_backend_sched_new(handles, bufts, len(backends), graph_size, False, True)
        if not self.handle:
            raise BackendError("ggml_backend_sched_new failed")
        self._allocated: Any = None
        self._pristine: dict[int, dict[int, bytes]] = {}   # graph address -> its nodes' own srcs
        self._layouts: dict[int, GraphLayout | None] = {}  # graph address -> where those srcs lie
        self._c_callback: Any = None          # the installed ctypes callback (kept alive)

    def set_eval_callback(self, fn: EvalCallback) -> None:
        self._c_callback = ggml.ggml_backend_sched_eval_callback(fn)
        ggml.ggml_backend_sched_set_eval_callback(self.handle, self._c_callback, None)

    def clear_eval_callback(self) -> None:
        _clear_callback(self.handle)
        self._c_callback = None

    def reserve(self, gf: Any) -> None:
        """Size the compute buffers for the largest graph once, so later graphs never reallocate."""
        self._allocated = None   # reserving resets the scheduler: the next graph is allocated anew
        if not ggml.ggml_backend_sched_reserve(self.handle, gf):
            raise BackendError("the backend could not reserve compute buffers for the largest ubatch "
                               "(lower --batch or --ctx)")

    def allocate(self, gf: Any, ctx: Any) -> None:
        """Allocate `gf` (whose tensors live in `ctx`) unless it is the graph allocated last.

        ggml's allocator keeps a tensor's old address when its data pointer is set, which is
        only right for the graph allocated last: another graph may have moved or reallocated the
        compute buffer since. So a graph coming back is first stripped of its addresses, and is
        then laid out as if new.

        With more than one backend the scheduler also rewrites the graph: a node whose input lives
        on another backend gets `src[j]` pointed at a copy made in the scheduler's own context,
        which the next graph's split frees. A graph coming back would read freed tensors (wrong
        values, heap corruption), so every node's own src pointers are saved before the graph's
        first allocation and put back before each later one.
        """
        key = ctypes.addressof(gf.contents)
        if self._allocated is not None and ctypes.addressof(self._allocated.contents) == key:
            return
        layout = self._layouts.get(key)
        if key not in self._layouts and key not in self._pristine:   # never allocated: its srcs are its own
            layout = self._layouts[key] = GraphLayout.of(gf, ctx)
            if layout is not None:
                self._pristine[key] = layout.snapshot()
        if layout is not None and layout.matches(gf, ctx):
            layout.reset()                # restore_srcs + forget_addresses, see GraphLayout
        else:
            saved = self._pristine.get(key)
            if saved is None or not restore_srcs(gf, saved):
                saved = self._pristine[key] = snapshot_srcs(gf)   # never allocated: its srcs are its own
            forget_addresses(ctx)
            self._layouts[key] = GraphLayout.of(gf, ctx, saved)
        ggml.ggml_backend_sched_reset(self.handle)
        if not ggml.ggml_backend_sched_alloc_graph(self.handle, gf):
            size = self.compute_buffer_size()
            raise BackendError(f"the backend could not allocate the compute graph (compute buffers {size} bytes)")
        self._allocated = gf

    def holds(self, gf: Any) -> bool:
        """Whether `gf` is the graph this scheduler allocated last (its addresses point here)."""
        return self._allocated is not None and ctypes.addressof(self._allocated.contents) == ctypes.addressof(gf.contents)

    def share_snapshots(self, other: "Scheduler") -> None:
        """Use `other`'s snapshots of graphs' own src pointers: a graph that moves between the two
        schedulers is restored to the srcs it had before either rewrote them."""
        self._pristine = other._pristine
        self._layouts = other._layouts

    def drop_graph(self, gf: Any) -> None:
        """`gf` is about to be freed: forget its snapshots, and the allocation when it is the graph
        allocated last (the address may come back as another graph's)."""
        if self.holds(gf):
            self._allocated = None
            ggml.ggml_backend_sched_reset(self.handle)
        key = ctypes.addressof(gf.contents)
        self._pristine.pop(key, None)
        self._layouts.pop(key, None)

    def forget_graph(self) -> None:
        """Another scheduler is about to allocate the graph allocated here last: allocate anew next time."""
        self._allocated = None

    def compute(self, gf: Any) -> None:
        pinning = self.backends[-1].pinning      # the CPU backend's (it is last)
        if pinning is not None:
            pinning.before_compute()
        status = ggml.ggml_backend_sched_graph_compute(self.handle, gf)
        if status != 0:
            raise BackendError(f"graph compute failed with ggml status {status}")

    def forget(self) -> None:
        """Drop the record of the allocated graph (its context is about to be freed)."""
        self._allocated = None
        self._pristine.clear()
        self._layouts.clear()
        ggml.ggml_backend_sched_reset(self.handle)

    def n_splits(self) -> int:
        return int(ggml.ggml_backend_sched_get_n_splits(self.handle))

    def compute_buffer_size(self) -> int:
        return sum(int(ggml.ggml_backend_sched_get_buffer_size(self.handle, b.handle)) for b in self.backends)

    def free(self) -> None:
        if self.handle:
            ggml.ggml_backend_sched_free(self.handle)
            self.handle = 0
        self._c_callback = None


def alloc_tensors(backend: Backend, tensors: list[Tensor], what: str, buft: Any = None) -> Any:
    """One buffer of `backend`'s type (or of `buft`) holding exactly `tensors` (laid out in order,
    aligned)."""
    buft = backend.buffer_type if buft is None else buft
    align = int(ggml.ggml_backend_buft_get_alignment(buft))
    offsets, size = [], 0
    for t in tensors:
        offsets.append(size)
        size += -(-int(ggml.ggml_backend_buft_get_alloc_size(buft, t)) // align) * align
    buffer = ggml.ggml_backend_buft_alloc_buffer(buft, max(size, align))
    if not buffer:
        raise BackendError(f"backend {backend.name} could not allocate {size} bytes for {what}")
    base = int(ggml.ggml_backend_buffer_get_base(buffer) or 0)
    for t, off in zip(tensors, offsets):
        if ggml.ggml_backend_tensor_alloc(buffer, t, ctypes.c_void_p(base + off)) != 0:
            ggml.ggml_backend_buffer_free(buffer)
            raise BackendError(f"backend {backend.name} could not place a tensor of {what}")
    return buffer


# ----------------------------------------------------------------------------------------------
# ggml's CPU repack buffer type
# ----------------------------------------------------------------------------------------------
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
    extra = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn)(dev)
    i = 0
    while extra and extra[i]:
        if ggml.ggml_backend_buft_name(extra[i]) == b"CPU_REPACK":
            return extra[i]
        i += 1
    return None


def repack_supports(weight: Tensor, buft: Any) -> bool:
    """Whether ggml's CPU backend computes the product that reads `weight` (MUL_MAT for a matrix,
    MUL_MAT_ID for stacked experts, F32 activations) with `weight` stored in `buft`: asked of ggml,
    as llama.cpp does, with a probe node whose weight lies in an empty buffer of that type. A
    weight that a graph also reads otherwise (get_rows) must not be repacked: the caller knows."""
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
        if dims == 3:
            x = ggml.ggml_new_tensor_3d(ctx, ggml.GGML_TYPE_F32, ne[0], 1, 1)
            ids = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_I32, 1, 1)
            op = ggml.ggml_mul_mat_id(ctx, w, x, ids)
        else:
            op = ggml.ggml_mul_mat(ctx, w, ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, ne[0], 1))
        return bool(ggml.ggml_backend_dev_supports_op(dev, op))
    finally:
        ggml.ggml_free(ctx)
        if probe_buffer:
            ggml.ggml_backend_buffer_free(probe_buffer)


@contextlib.contextmanager
def without_debug_log() -> Iterator[None]:
    """ggml's log without its DEBUG lines for the duration (the CPU repack announces every tensor
    it lays out); other lines go where they went before."""
    cb, ud = ggml.ggml_log_callback(), ctypes.c_void_p()
    ggml.ggml_log_get(ctypes.byref(cb), ctypes.byref(ud))
    previous = cb if ctypes.cast(cb, ctypes.c_void_p).value else None

    def forward(level: int, text: bytes, user_data: Any) -> None:
        if level == ggml.GGML_LOG_LEVEL_DEBUG:
            return
        if previous is not None:
            previous(level, text, user_data)
        elif text:
            os.write(2, text)

    hook = ggml.ggml_log_callback(forward)
    ggml.ggml_log_set(hook, ud)
    try:
        yield
    finally:
        ggml.ggml_log_set(previous if previous is not None else ggml.ggml_log_callback(), ud)
