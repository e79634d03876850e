"""What this machine and this ggml build offer: ggml's device registry, backend names, CPU features
and cores.

Backend names (`--backend`):

    cpu          ggml's CPU backend
    cpu-ref      the CPU backend with its reference kernels (ggml_backend_cpu_set_use_ref)
    vulkan[:N]   the N-th Vulkan device of ggml's registry (Vulkan0, Vulkan1, ...), default 0
    cuda[:N]     the N-th CUDA device (CUDA0, ...), default 0
    auto         the best device found: a discrete GPU, then an integrated one, CPU last
                 (software renderers such as Mesa's llvmpipe/lavapipe are never chosen)

A name this build of ggml-python cannot serve raises `BackendError` saying how to install the
variant that can. Opening a backend is backend.py's business; nothing here starts a device.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from deltarun.base.errors import BackendError
from deltarun.base.ggml_util import c_text, ctypes, ggml
from deltarun.runner.cpu_threads import core_cpus

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


def ggml_version() -> str:
    """The version of the ggml library under ggml-python's bindings (ggml_version(), e.g. 0.25.3):
    scripts/install.sh builds them on a newer ggml than the one ggml-python 0.0.45 vendors."""
    return c_text(ggml.ggml_version()) or "?"


def amx_tile_types() -> list[str]:
    """The weight types this ggml's CPU multiplies on AMX tiles in this process (the patches
    q8_0-tiles-amx, widened-half-tiles-amx and k-quant-tiles-amx; none without AMX, without the
    kernel's permission, or with DELTARUN_Q8_0_AMX=0 / DELTARUN_HALF_AMX=0 / DELTARUN_K_AMX=0)."""
    from deltarun.base.ggml_compat import amx_columns

    types = {"Q8_0": ggml.GGML_TYPE_Q8_0, "F16": ggml.GGML_TYPE_F16, "BF16": ggml.GGML_TYPE_BF16,
             "Q4_K": ggml.GGML_TYPE_Q4_K, "Q6_K": ggml.GGML_TYPE_Q6_K}
    return [name for name, t in types.items() if amx_columns(t) > 0]


def llamafile_note(features: list[str]) -> str | None:
    """What to tell a user whose ggml-python lacks llamafile's kernels (None when it has them)."""
    if "LLAMAFILE" in features:
        return None
    return ("note: this ggml-python was built without llamafile's matrix kernels, so prompt processing "
            "is slower than llama.cpp's; scripts/install.sh builds it with them (see the README)")


def patches_note() -> str | None:
    """What to tell a user whose ggml-python was not built with scripts/ggml-patches (None when it
    was: scripts/ggml-wheel.sh labels such builds `0.0.45+deltarun.<hash of the source and patches>`)."""
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


def _reachable(endpoint: str) -> bool:
    """Whether an RPC server's HOST:PORT accepts a TCP connection now (closed at once)."""
    import socket

    host, _, port = endpoint.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=1.0).close()
        return True
    except (OSError, ValueError):
        return False


def list_devices() -> list[DeviceInfo]:
    """Every device in ggml's registry, in registry order (the CPU is usually last)."""
    _ensure_registry()
    out = []
    for i in range(int(ggml.ggml_backend_dev_count())):
        dev = ggml.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        reg = ggml.ggml_backend_dev_backend_reg(dev)
        registry = c_text(ggml.ggml_backend_reg_name(reg)) if reg else "?"
        # ggml 0.25 asks an RPC server for its memory on every call and aborts when it has gone
        # (a server this process used earlier): such a device is listed with 0 bytes
        if registry != "RPC" or _reachable(c_text(ggml.ggml_backend_dev_description(dev))):
            ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        dtype = int(ggml.ggml_backend_dev_type(dev))
        out.append(DeviceInfo(index=i, name=c_text(ggml.ggml_backend_dev_name(dev)),
                              description=c_text(ggml.ggml_backend_dev_description(dev)),
                              type=DEVICE_TYPE_NAMES.get(dtype, str(dtype)),
                              registry=registry,
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


def find_device(kind: str, index: int | None) -> DeviceInfo:
    """The registry entry of `--backend kind[:index]` (vulkan, cuda); BackendError when there is none."""
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


def best_device() -> DeviceInfo | None:
    """What `auto` picks: a GPU, then an integrated GPU, skipping software renderers; None = CPU."""
    devs = [d for d in list_devices() if d.registry.lower() in DEVICE_KINDS and not d.software]
    for kind in ("gpu", "igpu"):
        for d in devs:
            if d.type == kind:
                return d
    return None
