"""What the runner knows about a vision tower (an mmproj file), and what a projector implements.

The counterpart of `interface.py` for images: a projector family (registered by
`clip.projector_type`, see `registry.projector_for`) reads and validates the mmproj's keys and
tensors into `VisionHParams` and builds the encoder graph of one image size; the runner prepares
images (`PreparedImage`) and runs the graph without knowing the projector's layers.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from deltarun.base.ggml_util import Tensor


@dataclass(frozen=True)
class VisionHParams:
    """A vision tower's hyper-parameters, named after clip.cpp's."""

    projector: str
    n_layer: int
    n_embd: int
    n_head: int
    n_ff: int
    patch_size: int
    n_merge: int
    eps: float
    n_pos_side: int              # the learned position grid is n_pos_side x n_pos_side
    proj_dim: int                # the text model's hidden size (clip.vision.projection_dim)
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    deepstack_layers: tuple[int, ...] = field(default=())

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def out_dim(self) -> int:
        """Width of one image-embedding row: the merger's output, then each deepstack tap's."""
        return self.proj_dim * (1 + len(self.deepstack_layers))

    @property
    def align(self) -> int:
        """Image sides are multiples of this (patch x merge)."""
        return self.patch_size * self.n_merge


@dataclass(frozen=True)
class PreparedImage:
    """One image as the processor leaves it: normalised pixels (3, height, width), float32, sides
    multiples of patch x merge. `digest` identifies the pixels (the prompt cache keys images by it)."""

    pixels: np.ndarray
    patch_size: int
    n_merge: int
    digest: str = ""

    def __post_init__(self) -> None:
        if not self.digest:
            h = hashlib.sha256(np.ascontiguousarray(self.pixels, dtype=np.float32).tobytes())
            h.update(repr(self.pixels.shape).encode())
            object.__setattr__(self, "digest", h.hexdigest())

    @property
    def grid(self) -> tuple[int, int, int]:
        """(t, h, w) in patches, as `image_grid_thw`."""
        return 1, self.pixels.shape[1] // self.patch_size, self.pixels.shape[2] // self.patch_size

    @property
    def merged_hw(self) -> tuple[int, int]:
        """Rows and columns of image tokens (the merged grid)."""
        _, h, w = self.grid
        return h // self.n_merge, w // self.n_merge

    @property
    def n_tokens(self) -> int:
        h, w = self.merged_hw
        return h * w


class VisionInput(Protocol):
    """A vision graph input: fills its host arrays from the image."""

    tensors: dict[str, Tensor]

    def bind(self) -> list[tuple[Tensor, int, int]]:
        """Host arrays of the used tensors: (tensor, host address, nbytes) of each."""

    def set_input(self, image: PreparedImage) -> None:
        """Write the image's values into the host arrays."""


@dataclass
class VisionGraph:
    """A projector's answer to `build`: its inputs and the `embeddings` output [out_dim, n_tokens]."""

    inputs: list[VisionInput]
    outputs: dict[str, Tensor]


class VisionTower(Protocol):
    """What the runner needs of a projector family."""

    hp: VisionHParams

    def tensor_names(self) -> list[str]:
        """Names of every weight the graph may read."""

    def graph_size(self, grid_h: int, grid_w: int) -> int:
        """Most nodes the graph of this image size can hold."""

    def build(self, ctx: Any, gf: Any, w: dict[str, Tensor], grid_h: int, grid_w: int) -> VisionGraph:
        """Add the encoder of one image of grid_h x grid_w patches to `gf`."""
