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
        #: the riding prompt chunk's context (`UbatchShape.ride`): same graph, its own shape and inputs
        self.ride = GraphContext(ctx, gf, hp, w, mem, ub.ride_shape()) if ub.ride else None

    @property
    def grid(self) -> tuple[int, int]:
        """(T, N) of the rows the row-wise ops (norms, products, FFN) see: the ubatch's tokens per
        sequence and sequences, or, with a riding chunk, all rows as one (n_rows, 1)."""
        return (self.ub.n_rows, 1) if self.ride else (self.ub.n_seq_tokens, self.ub.n_seqs)

    def per_part(self, build: Callable[["GraphContext", Callable[[Tensor, int], Tensor]], Tensor],
                 dim: int, split: bool = True) -> Tensor:
        """`build(part, take)` for the ubatch (this context), and with a riding chunk also for it,
        joined along the token axis `dim`. `take(x, d)` gives a part its rows of x (token axis d,
        laid out by `grid`): with `split` its (T, N) at axes d, d+1, else its T*N rows at d. The
        per-sequence ops (conv, delta rule, attention) run per part; everything else on all rows
        (one read of each weight)."""
        if self.ride is None:
            return build(self, lambda x, d: x)
        parts = ((self, 0, self.ub.n_seq_tokens, self.ub.n_seqs),
                 (self.ride, self.ub.n_tokens, self.ride.ub.n_seq_tokens, 1))
        outs = []
        for part, first, T, N in parts:
            def take(x: Tensor, d: int, first: int = first, T: int = T, N: int = N) -> Tensor:
                shape = [int(x.contents.ne[i]) for i in range(4)]
                shape[d] = T * N
                rows = self.view(x, tuple(shape), tuple(int(x.contents.nb[i]) for i in range(1, 4)),
                                 first * int(x.contents.nb[d]))
                if split:
                    shape[d], shape[d + 1] = T, N
                return ggml.ggml_reshape_4d(self.ctx, rows, *shape)
            out = build(part, take)
            shape = [int(out.contents.ne[i]) for i in range(4)]
            n = shape[dim] * (shape[dim + 1] if split else 1)
            flat = shape[:dim] + [n] + [1] * (3 - dim)
            outs.append(ggml.ggml_reshape_4d(self.ctx, out, *flat) if split else out)
        return ggml.ggml_concat(self.ctx, outs[0], outs[1], dim)

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
