"""The per-build context every block writes into, and the small helpers they share.

A `GraphContext` holds one build's ggml context and graph, the hyper-parameters, the weights by
GGUF name, the memory (KV cache and recurrent state tensors), the ubatch shape, and the graph
inputs made so far; blocks are functions of it, so a family's builder reads like its block
diagram. Node names follow llama.cpp's (`attn_norm-0`, `result_output`), so dumps line up.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from deltarun.base.ggml_util import Tensor, ggml, set_name
from deltarun.base.interface import HParams, UbatchShape
from deltarun.graphs.inputs import GraphInput

In = TypeVar("In", bound=GraphInput)


class GraphContext:
    """One build: where blocks add nodes, find weights and memory, and ask for inputs."""

    def __init__(self, ctx: Any, gf: Any, hp: HParams, w: dict[str, Tensor], mem: Any, ub: UbatchShape):
        self.ctx, self.gf, self.hp, self.w, self.mem, self.ub = ctx, gf, hp, w, mem, ub
        self.inputs: dict[type, GraphInput] = {}
        self.outputs: dict[str, Tensor] = {}

    def input(self, kind: type[In], make: Callable[[], In]) -> In:
        """The graph's input of this kind, made on first request (one per graph, as in llama.cpp)."""
        found = self.inputs.get(kind)
        if found is None:
            found = self.inputs[kind] = make()
        return found  # type: ignore[return-value]

    def output(self, t: Tensor, name: str) -> Tensor:
        ggml.ggml_set_output(t)
        self.outputs[name] = t
        return t

    def cb(self, t: Tensor, name: str, il: int = -1) -> Tensor:
        return set_name(t, f"{name}-{il}" if il >= 0 else name)

    def rms_norm(self, x: Tensor, weight: Tensor | None, name: str, il: int) -> Tensor:
        x = ggml.ggml_rms_norm(self.ctx, x, self.hp.rms_eps)
        if weight is not None:
            x = ggml.ggml_mul(self.ctx, x, weight)
        return self.cb(x, name, il)

    def mm(self, weight: Tensor, x: Tensor) -> Tensor:
        return ggml.ggml_mul_mat(self.ctx, weight, x)

    def expand(self, t: Tensor) -> None:
        ggml.ggml_build_forward_expand(self.gf, t)

    def view(self, t: Tensor, shape: tuple[int, ...], strides: tuple[int, ...], offset: int) -> Tensor:
        c = self.ctx
        if len(shape) == 1:
            return ggml.ggml_view_1d(c, t, shape[0], offset)
        if len(shape) == 2:
            return ggml.ggml_view_2d(c, t, shape[0], shape[1], strides[0], offset)
        if len(shape) == 3:
            return ggml.ggml_view_3d(c, t, shape[0], shape[1], shape[2], strides[0], strides[1], offset)
        return ggml.ggml_view_4d(c, t, *shape, *strides, offset)
