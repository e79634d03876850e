"""An mmproj file, loaded and ready to turn prepared images into embedding rows for the text model.

`VisionEncoder` finds the file's projector family (`registry.projector_for`, which validates the
keys and tensors), maps its weights like a text model's (`Weights`), and runs the graph of each
image size on its own scheduler (built per image: an image's graph is used once). It can share the
text model's backend (`backend=model.backend`) so both use the same threads and device.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from deltarun.base.errors import DeltarunError, UnsupportedModelError
from deltarun.base.ggml_util import ggml, new_context, tensor_to_numpy
from deltarun.base.gguf_file import GGUFFile
from deltarun.base.registry import projector_for
from deltarun.base.vision import PreparedImage, VisionHParams, VisionTower
from deltarun.runner.backend import Backend, init_backend
from deltarun.runner.scheduler import Scheduler
from deltarun.runner.weights import Weights

_tensor_set = ggml.ggml_backend_tensor_set


@dataclass
class VisionRun:
    """One image's graph, allocated with its inputs set (`VisionEncoder.graph`)."""

    gf: Any
    sched: Scheduler
    outputs: dict[str, Any]

    def compute(self) -> None:
        self.sched.compute(self.gf)


class VisionEncoder:
    """A vision tower (mmproj GGUF) on a backend: `encode(image)` -> [n_tokens, out_dim] float32."""

    def __init__(self, path: str | Path, *, backend: Backend | str = "cpu", n_threads: int | None = None):
        self.path = Path(path)
        self.file = GGUFFile(path)
        self.tower: VisionTower = projector_for(self.file)
        self.hp: VisionHParams = self.tower.hp
        self._own_backend = isinstance(backend, str)
        self.backend: Backend = init_backend(backend, n_threads) if isinstance(backend, str) else backend
        try:
            self.weights = Weights(self.file, self.tower.tensor_names(), self.backend)
        except BaseException:
            if self._own_backend:
                self.backend.free()
            raise

    def check_text_model(self, n_embd: int, arch: str) -> None:
        """Refuse a text model this tower does not fit: its hidden size must be the projection's, and
        deepstack taps need a text graph that adds them (the qwen35 families have none)."""
        if self.hp.proj_dim != n_embd:
            raise UnsupportedModelError(
                f"{self.path}: this mmproj projects to {self.hp.proj_dim} dimensions but the text model's hidden "
                f"size is {n_embd}; use the mmproj published with that model")
        if self.hp.deepstack_layers:
            raise UnsupportedModelError(
                f"{self.path}: this mmproj has deepstack layers {list(self.hp.deepstack_layers)} (a Qwen3-VL tower); "
                f"the {arch} text model has no place for them")

    def encode(self, image: PreparedImage) -> np.ndarray:
        """Image embeddings, one row per image token (merged grid, row-major): [n_tokens, out_dim]."""
        with self.graph(image) as run:
            run.compute()
            out = tensor_to_numpy(run.outputs["embeddings"])
        return out.reshape(image.n_tokens, self.hp.out_dim)

    @contextmanager
    def graph(self, image: PreparedImage) -> Iterator["VisionRun"]:
        """The graph of this image's size, allocated on its scheduler with the image's inputs set,
        for `encode` and for the tools that look inside it (`deltarun graph` and `compare` with
        --mmproj: they walk it, or compute it with an eval callback). Freed on leaving."""
        if image.patch_size != self.hp.patch_size or image.n_merge != self.hp.n_merge:
            raise DeltarunError("the image was prepared for another vision tower (patch or merge size differs)")
        _, gh, gw = image.grid
        size = self.tower.graph_size(gh, gw)
        ctx = new_context(2 * size)
        sched = Scheduler(self.backend.sched_backends, graph_size=size)
        try:
            gf = ggml.ggml_new_graph_custom(ctx, size, False)
            built = self.tower.build(ctx, gf, self.weights.tensors, gh, gw)
            sched.allocate(gf, ctx)
            for inp in built.inputs:
                transfers = inp.bind()
                inp.set_input(image)
                for t, addr, nbytes in transfers:
                    _tensor_set(t, addr, 0, nbytes)
            yield VisionRun(gf, sched, built.outputs)
        finally:
            sched.free()
            ggml.ggml_free(ctx)

    def close(self) -> None:
        self.weights.free()
        if self._own_backend:
            self.backend.free()

    def __enter__(self) -> "VisionEncoder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
