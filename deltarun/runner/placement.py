"""Layer placement (`--gpu-layers`): which backend holds each layer's weights, KV cache and state."""

from __future__ import annotations

import re
from dataclasses import dataclass

from deltarun.base.errors import BackendError
from deltarun.runner.backend import Backend

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
