"""The part every hybrid family shares: from the opened file to a `BuiltGraph` per ubatch shape.

A family subclasses `HybridFamily` and writes three things (see qwen3next.py, qwen35.py):
`read_hparams(f)` (its key prefix and keys), `tensor_spec(hp, present)` (built from the blocks'
parts)
and `forward(g)` / `forward_mtp(g)` (the block diagram). This class reads and validates the file
when constructed, sizes graphs, and turns a build into the graph's inputs and outputs.
"""

from __future__ import annotations

from typing import Any

from deltarun.base.ggml_util import Tensor
from deltarun.base.gguf_file import GGUFFile
from deltarun.base.interface import BuiltGraph, HParams, UbatchShape
from deltarun.graphs import spec
from deltarun.graphs.blocks import head
from deltarun.graphs.blocks.base import GraphContext
from deltarun.graphs.blocks.delta_net import CHUNK_SIZE

Spec = dict[str, tuple[tuple[int, ...], bool]]


class HybridFamily:
    """Base of the graph builders of hybrid gated-delta-net / gated-attention families."""

    arch = "?"
    #: whether the graphs take a riding prompt chunk (`UbatchShape.ride`); the runner evaluates
    #: the chunk apart where not
    rides = False

    def __init__(self, gguf_file: GGUFFile):
        self.file = gguf_file
        self.hp: HParams = self.read_hparams(gguf_file)
        spec.validate_tensors(self.hp, gguf_file, self.expected_tensors())

    # --- what a family defines ----------------------------------------------------------------
    @classmethod
    def read_hparams(cls, f: GGUFFile) -> HParams:
        raise NotImplementedError

    @classmethod
    def tensor_spec(cls, hp: HParams, present: dict[str, Any]) -> Spec:
        """name -> (ne, required) for every tensor the graph reads; where a family accepts
        alternative layouts, `present` (the file's tensors by name) decides which one."""
        raise NotImplementedError

    def expected_tensors(self) -> Spec:
        return self.tensor_spec(self.hp, self.file.tensors)

    def forward(self, g: GraphContext) -> None:
        raise NotImplementedError

    def forward_mtp(self, g: GraphContext, tokens: Tensor | None = None, hidden: Tensor | None = None,
                    prefix: str = "") -> None:
        """The MTP block on rows (tokens, hidden): graph inputs, or nodes of the trunk's graph
        (then its outputs are named with `prefix`, apart from the trunk's)."""
        raise NotImplementedError

    def forward_mtp_argmax(self, g: GraphContext) -> None:
        """After `forward` with every row: the MTP block on each row's (argmax token, hidden state)
        in the same graph, writing the MTP layer's KV cache at the ubatch's positions as the trunk's
        attention layers do (rows a rollback drops are masked, then overwritten, alike)."""
        tokens, hidden = head.argmax_rows(g)
        self.forward_mtp(g, tokens, hidden, prefix="mtp_")

    # --- the runner's interface ---------------------------------------------------------------
    def graph_size(self, ub: UbatchShape) -> int:
        """Most nodes the graph of this shape can hold, with margin (ggml aborts past its size).

        Measured: about 80 nodes per layer, and in the primitive delta net about 19 more per chunk
        of 64 tokens per linear-attention layer (plus a few per rollback snapshot).
        """
        hp = self.hp
        per_layer = 120 * (hp.n_layer + hp.n_mtp)
        chunks = 0
        if ub.delta_net == "primitive" and ub.n_seq_tokens > 1:
            n_chunks = -(-ub.n_seq_tokens // CHUNK_SIZE)
            chunks = len(hp.linear_layers) * (32 * n_chunks + 16 * min(ub.n_seq_tokens, 64))
        # each capture point: two copies, a delta-rule segment (a chunk more in the primitive form)
        captures = len(ub.captures) * len(hp.linear_layers) * (64 if ub.delta_net == "primitive" else 8)
        ride = self.graph_size(ub.ride_shape()) if ub.ride else 0   # a riding chunk's part, and more
        return 2048 + per_layer + chunks + captures + ride

    def tensor_names(self) -> list[str]:
        """Names of every weight the graph may read (optional ones included)."""
        return list(self.expected_tensors())

    def gathered_weights(self) -> frozenset[str]:
        """The weights the graphs read rows of (get_rows: the token embeddings of the trunk and of
        the MTP block), which must keep the file's layout (no repacking, see Weights)."""
        return frozenset(n for n in self.tensor_names() if head.is_gathered(n))

    def mtp_lm_head(self) -> str:
        return head.mtp_lm_head_name(self.hp.n_layer, self.file.tensors)

    def build(self, ctx: Any, gf: Any, w: dict[str, Tensor], mem: Any, ub: UbatchShape) -> BuiltGraph:
        """Add the forward pass of one ubatch (the trunk, or the MTP block when ub.mtp; the trunk and
        then the MTP block on its argmax rows when ub.mtp_argmax) to `gf`."""
        g = GraphContext(ctx, gf, self.hp, w, mem, ub)
        if ub.mtp:
            self.forward_mtp(g)
        else:
            self.forward(g)
            if ub.mtp_argmax:
                if ub.n_outputs != ub.n_tokens or not self.hp.n_mtp:
                    raise ValueError("an MTP-on-argmax graph needs every row's logits and a model with an MTP block")
                self.forward_mtp_argmax(g)
        return BuiltGraph(list(g.inputs.values()), g.outputs, list(g.ride.inputs.values()) if g.ride else [])
