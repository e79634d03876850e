"""Layers split over several devices: `--rpc HOST:PORT[,...]` servers plus the local backend.

The device list is llama.cpp's order: every device of each `--rpc` server, in the order given,
then the local `--backend` device (the CPU itself for `--backend cpu`). `--tensor-split a,b,...`
gives each device's share of the layers in that order (missing entries are 0); without it the
shares are the devices' free memory. As in llama.cpp, the repeating layers and the output layer
are n_layer + 1 slots cut in order by the cumulative shares: layer il goes to the first device
whose cumulative share exceeds il / (n_layer + 1), and the output layer (final norm, LM head, MTP
blocks) to the device of the last slot. The token embeddings go with the first layer when that is
on an RPC server (llama.cpp keeps them on the CPU): then 4 bytes of token id cross the network per
token instead of a row of n_embd floats, and the first layer's graph split starts at the lookup, so
the server sees one split per graph and ggml-rpc's GRAPH_RECOMPUTE can reuse the graph it has
(it remembers one graph per device; a second split on the same device makes it resend the whole
graph, ~250 KiB for the bench model, on every token). Otherwise they stay on the local CPU. With
tied embeddings (the LM head shares them) they go with the output layer.

Each layer's weights, KV cache and recurrent state live on its device (Weights and Memory place
them through `layer` / `for_tensor`, the same interface as `placement.Placement`), and
ggml_backend_sched runs each op where its weights are, copying activations across devices at
layer boundaries. The scheduler's backends are the split devices in order, then the CPU.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

from deltarun.base.errors import BackendError
from deltarun.base.ggml_util import ctypes, ggml
from deltarun.runner import rpc
from deltarun.runner.backend import Backend
from deltarun.runner.devices import DeviceInfo
from deltarun.runner.placement import Placement

_BLK = re.compile(r"^blk\.(\d+)\.")


def parse_tensor_split(value: str | Sequence[float] | None) -> list[float] | None:
    """`--tensor-split 3,1` -> [3.0, 1.0]; None stays None (split by free memory)."""
    if value is None:
        return None
    parts = value.split(",") if isinstance(value, str) else list(value)
    try:
        out = [float(p) for p in parts if str(p).strip() != ""]
    except ValueError:
        raise BackendError(f"bad --tensor-split {value!r}: expected non-negative numbers such as 3,1") from None
    if not out or any(x < 0 or x != x for x in out) or sum(out) <= 0:
        raise BackendError(f"bad --tensor-split {value!r}: expected non-negative numbers, not all zero")
    return out


def assign_layers(n_layer: int, shares: Sequence[float]) -> list[int]:
    """Device index of each of the n_layer + 1 slots (the last is the output layer), llama.cpp's rule."""
    total = float(sum(shares))
    cum, acc = [], 0.0
    for s in shares:
        acc += s / total
        cum.append(acc)
    n_slots = n_layer + 1
    out = []
    for il in range(n_slots):
        x = il / n_slots
        j = sum(1 for c in cum if c <= x)          # upper_bound: the first cumulative share above x
        while j < len(shares) - 1 and shares[j] == 0:
            j += 1
        out.append(min(j, len(shares) - 1))
    return out


def _open_rpc_backend(dev: DeviceInfo) -> Backend:
    handle = ggml.ggml_backend_dev_init(dev.handle, None)
    if not handle:
        raise rpc.RpcError(f"RPC server {dev.description}: ggml could not open its device {dev.name}")
    return Backend(dev.backend_name, handle, kind="rpc", device=dev)


def _memory_free(b: Backend) -> int:
    if b.device is not None:
        dev = b.device.handle
    else:
        dev = ggml.ggml_backend_get_device(b.handle)
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
    return int(free.value)


@dataclass
class LayerSplit:
    """Where each layer lives when the layers are split over several devices (module docstring)."""

    n_layer: int
    devices: list[Backend]          # the split devices, RPC first, the local backend last
    local: Backend                  # the --backend backend (its CPU fallback is `cpu`)
    shares: list[float]
    slots: list[int] = field(default_factory=list)    # device index per layer, then the output

    def __post_init__(self) -> None:
        if not self.slots:
            self.slots = assign_layers(self.n_layer, self.shares)

    @property
    def cpu(self) -> Backend:
        return self.local.cpu_backend

    @property
    def sched_backends(self) -> list[Backend]:
        """Every device with its own backend in split order, then the CPU (ggml wants it last)."""
        out = [d for d in self.devices if d is not self.cpu]
        if self.local.cpu is not None and self.local not in out:   # pragma: no cover - local is a split device
            out.append(self.local)
        return out + [self.cpu]

    def layer(self, il: int) -> Backend:
        """Backend of block il (il >= n_layer: the MTP blocks, placed with the output layer)."""
        return self.devices[self.slots[min(il, self.n_layer)]]

    @property
    def output(self) -> Backend:
        return self.devices[self.slots[self.n_layer]]

    def for_tensor(self, name: str, tied_output: bool = False) -> Backend:
        m = _BLK.match(name)
        if m:
            return self.layer(int(m.group(1)))
        if name.startswith("token_embd."):
            if tied_output:
                return self.output
            first = self.layer(0)
            return first if first.kind == "rpc" else self.cpu
        return self.output

    def layers_on(self, i: int) -> list[int]:
        return [il for il in range(self.n_layer) if self.slots[il] == i]

    def describe(self) -> str:
        parts = []
        for i, d in enumerate(self.devices):
            n = len(self.layers_on(i))
            out = " + output" if self.slots[self.n_layer] == i else ""
            name = d.name if d.kind != "rpc" else f"{d.device.name} ({d.device.description})"
            parts.append(f"{name}: {n} layers{out}")
        return "layers split: " + ", ".join(parts)

    def to_dict(self) -> dict[str, object]:
        return {"devices": [d.name for d in self.devices], "shares": self.shares,
                "layers": [self.devices[s].name for s in self.slots[:self.n_layer]],
                "output": self.output.name}

    def on_loaded(self) -> None:
        """Weights and memory are on their devices, so ggml's RPC sockets exist: set their timeouts."""
        rpc.harden_sockets()

    def free(self) -> None:
        """Free the RPC backends (the local backend is the model's to free)."""
        for d in self.devices:
            if d.kind == "rpc":
                d.free()


def open_split(n_layer: int, local: Backend, endpoints: Sequence[str], tensor_split: Sequence[float] | None,
               gpu_layers: int | None = None) -> LayerSplit:
    """Register the RPC servers, open their devices and cut the layers (see the module docstring)."""
    if gpu_layers is not None:
        raise BackendError("--gpu-layers does not combine with --rpc or --tensor-split: give the local "
                           "device's share as the last --tensor-split entry")
    eps = rpc.add_servers(endpoints)
    devices: list[Backend] = []
    try:
        for ep in eps:
            for dev in rpc.server_devices(ep):
                devices.append(_open_rpc_backend(dev))
        devices.append(local)
        if tensor_split is None:
            shares = [float(max(_memory_free(d), 1)) for d in devices]
        else:
            if len(tensor_split) > len(devices):
                names = ", ".join(d.name for d in devices)
                raise BackendError(f"--tensor-split has {len(tensor_split)} entries but there are "
                                   f"{len(devices)} devices ({names})")
            shares = list(tensor_split) + [0.0] * (len(devices) - len(tensor_split))
        return LayerSplit(n_layer, devices, local, shares)
    except BaseException:
        for d in devices:
            if d.kind == "rpc":
                d.free()
        raise


def resolve(backend: str, endpoints: str | Sequence[str] | None,
            tensor_split: str | Sequence[float] | None) -> tuple[str, list[str], list[float] | None]:
    """(local backend name, RPC endpoints, shares) from the model options.

    `--backend rpc:HOST:PORT` is a shorthand for `--rpc HOST:PORT` with every layer on that
    server (`compare --backends cpu,rpc:HOST:PORT` compares a server against the local CPU).
    """
    eps = rpc.parse_endpoints(endpoints)
    split = parse_tensor_split(tensor_split)
    name = backend.strip()
    if name.lower().startswith("rpc:"):
        first = rpc.parse_endpoints(name[4:])
        eps = first + [e for e in eps if e not in first]
        name = "cpu"
        if split is None:
            split = [1.0]
    return name, eps, split


def placement(n_layer: int, local: Backend, gpu_layers: int | None, endpoints: Sequence[str],
              tensor_split: Sequence[float] | None) -> "Placement | LayerSplit":
    """`placement.Placement` (one device and the CPU) unless the layers are split over several devices."""
    if not endpoints and tensor_split is None:
        return Placement(n_layer, local, gpu_layers)
    return open_split(n_layer, local, endpoints, tensor_split, gpu_layers)
