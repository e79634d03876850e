"""What the runner knows about a model family, and what a family implements: the contract between
`deltarun.runner` and `deltarun.graphs`, which never import each other.

A family (qwen3next, qwen35, qwen35moe, ...) is a class registered in the `deltarun.graphs`
entry-point group (`deltarun.base.registry` finds it) that follows `GraphFamily`: constructed from
the opened GGUF file, it reads and validates the hyper-parameters (`hp`, an `HParams`), names the
weights it reads, and adds the forward pass of one ubatch shape to a ggml graph. The graph it
returns (`BuiltGraph`) carries its inputs as objects (`Input`; graphs/inputs.py has the family
side) that fill themselves from a `UbatchData`, so the runner never needs to know which inputs an
architecture has.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from deltarun.base.ggml_util import Tensor

DELTA_NET_MODES = ("fused", "primitive")


@dataclass(frozen=True)
class UbatchShape:
    """Everything that fixes a graph's structure; equal shapes share one graph."""

    n_seq_tokens: int   # tokens per sequence in this ubatch
    n_seqs: int         # sequences in this ubatch (cells seq_head .. seq_head + n_seqs - 1)
    n_outputs: int      # rows of logits asked for
    n_kv: int           # KV positions visible to attention (padded)
    seq_head: int = 0   # first state cell of the ubatch
    delta_net: str = "fused"
    mtp: bool = False   # the multi-token-prediction block instead of the trunk
    #: the trunk, then in the same graph the MTP block on every row's (hidden, argmax of its logits):
    #: a greedy verification step's rows and the next first draft in one evaluation (all outputs)
    mtp_argmax: bool = False
    #: token offsets 0 < t < n_seq_tokens (one sequence) whose recurrent state the graph also copies
    #: to capture slot i (Memory.capture_conv / capture_ssm): checkpoints inside one evaluation
    captures: tuple[int, ...] = ()
    #: the ubatch's rows are given as embeddings (`UbatchData.embd`: an image's rows) instead of
    #: token ids looked up in the embedding table
    embeddings: bool = False
    #: every row's hidden state (`result_norm`, n_outputs = n_tokens) but the LM head for each
    #: sequence's last row only: a prompt chunk whose rows an MTP block reads
    logits_last: bool = False
    #: with fewer tokens than rollback slots (T < K), also copy the state the ubatch started from
    #: to slot T, so that a rollback may undo all T tokens (a prompt's); an engine step that keeps
    #: at least its first row (a verification ubatch, or any step of a drafting sequence) leaves
    #: it out: one recurrent state less read and written per sequence and linear-attention layer
    #: (`Memory.advance` then allows T-1)
    keep_start: bool = True
    #: MTP graphs (mtp, mtp_argmax): the MTP block's LM head over the first draft_vocab token ids
    #: only (0: every one; see runner.draft_vocab)
    draft_vocab: int = 0
    #: the caller evaluates more of these sequences next (a prompt's earlier ubatches, a prompt
    #: chunk the next chunk continues): no LM head (`result_norm` is still an output) and the
    #: recurrent layers write their newest state only, no rollback slots (`Memory.advance` then
    #: allows no rollback): at the 0.8B bench shapes the head alone is a fifth of a small chunk
    continued: bool = False
    #: a prompt chunk of another sequence evaluated in the same graph, its rows after the
    #: ubatch's (`Model.eval_batch(..., ride=...)`): the layers' matrix products read each weight
    #: once for both, while its conv, delta rule and attention run on its own shape (`ride_shape`)
    ride: "Ride | None" = None

    @property
    def n_tokens(self) -> int:
        return self.n_seq_tokens * self.n_seqs

    def rollback_slots(self, rs_slots: int) -> int:
        """How many of a sequence's rs_slots rollback slots this ubatch's states fill: all, or the
        newest only (slot 0) in a `continued` ubatch."""
        return 1 if self.continued else rs_slots

    @property
    def n_rows(self) -> int:
        """Rows of the graph: the ubatch's tokens and a riding chunk's."""
        return self.n_tokens + (self.ride.n_tokens if self.ride else 0)

    def ride_shape(self) -> "UbatchShape":
        """The shape the riding chunk's own ops (conv, delta rule, attention) are built for."""
        r = self.ride
        return UbatchShape(n_seq_tokens=r.n_tokens, n_seqs=1, n_outputs=0, n_kv=r.n_kv, seq_head=r.seq,
                           delta_net=self.delta_net, continued=not r.logits, captures=r.captures)


@dataclass(frozen=True)
class Ride:
    """A prompt chunk riding along a ubatch (`UbatchShape.ride`): serve's prompt chunks while others
    decode. Where the prompt goes on after it, it writes its sequence's newest recurrent state only
    (as a `continued` ubatch: no rollback slots); the prompt's last chunk (`logits`) writes them.
    At the 0.8B bench shapes (Q8_0 on AMX tiles) 3 decoding rows take 40 ms, with 13 prompt rows
    riding 64 ms, the 13 apart 45 ms more."""

    seq: int
    n_tokens: int
    n_kv: int                # KV positions its attention sees (padded)
    logits: bool = False     # its last row's logits and hidden state are outputs too (the prompt's end)
    hidden: bool = False     # every row's hidden state is an output (rows an MTP block reads)
    captures: tuple[int, ...] = ()   # its capture points (`UbatchShape.captures`: checkpoints inside it)


@dataclass
class UbatchData:
    """The per-step values graph inputs are filled from.

    `pos` [n_seqs, n_seq_tokens] holds each token's position; `tokens` the token ids in the same
    layout (None when the graph reads none); `hidden` [n_tokens, n_embd] the trunk's hidden states
    an MTP graph drafts from; `embd` [n_tokens, n_embd] the input rows of an embeddings ubatch;
    `rope` [3, n_tokens] the (temporal, height, width) rope positions where they differ from `pos`
    (image tokens, and text after an image: transformers' `get_rope_index`), else None; `out_rows`
    [n_outputs] the rows whose outputs are asked for when not each sequence's last n_outputs /
    n_seqs (an MTP ubatch of sequences padded to one length: each one's last real row).
    """

    pos: np.ndarray
    tokens: Any = None
    hidden: np.ndarray | None = None
    embd: np.ndarray | None = None
    rope: np.ndarray | None = None
    ride: "UbatchData | None" = None     # the riding chunk's (`UbatchShape.ride`)
    out_rows: np.ndarray | None = None


@dataclass(frozen=True)
class HParams:
    """Hyper-parameters of a hybrid (gated delta-net + gated attention) model, named after llama.cpp's.

    Families fill what they use: `n_ff` is the dense FFN width (0 when the FFN is MoE), the
    `n_expert*` fields are 0 for a dense family, `rope_sections` is empty for plain NEOX rope.
    """

    n_layer: int              # trunk layers (block_count minus MTP layers)
    n_ctx_train: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rms_eps: float
    rope_freq_base: float
    n_rot: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_ff_shexp: int
    ssm_d_conv: int
    ssm_d_inner: int
    ssm_d_state: int
    ssm_n_v_heads: int        # ssm.time_step_rank
    ssm_n_k_heads: int        # ssm.group_count
    recurrent: tuple[bool, ...] = field(default=())
    n_mtp: int = 0
    n_vocab: int = 0
    rope_sections: tuple[int, ...] = ()   # rope.dimension_sections (IMRoPE); () for NEOX rope
    #: per layer, floats each K-cache row carries after the attention heads' keys (qwen4exp: the
    #: indexer's raw key, cached per position as K is); () when no layer has any
    k_row_extra: tuple[int, ...] = ()
    #: per layer, floats one conv-state snapshot carries after the delta net's windows (qwen4exp: the
    #: PLE convolution's history, a second recurrent state rolled back with the first); () when none
    conv_state_extra: tuple[int, ...] = ()

    @property
    def head_k_dim(self) -> int:
        return self.ssm_d_state

    @property
    def head_v_dim(self) -> int:
        return self.ssm_d_inner // self.ssm_n_v_heads

    @property
    def key_dim(self) -> int:
        return self.head_k_dim * self.ssm_n_k_heads

    @property
    def value_dim(self) -> int:
        return self.head_v_dim * self.ssm_n_v_heads

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_state_size(self) -> int:
        """Floats of one conv-state snapshot of one layer and sequence."""
        return (self.ssm_d_conv - 1) * self.conv_dim

    def k_row_width(self, il: int) -> int:
        """Elements of one K-cache row of attention layer `il`."""
        return self.head_dim * self.n_head_kv + (self.k_row_extra[il] if self.k_row_extra else 0)

    def conv_state_size_of(self, il: int) -> int:
        """Floats of one conv-state snapshot of linear layer `il` (with its extra state)."""
        return self.conv_state_size + (self.conv_state_extra[il] if self.conv_state_extra else 0)

    @property
    def ssm_state_size(self) -> int:
        """Floats of one SSM-state snapshot of one layer and sequence."""
        return self.head_v_dim * self.head_v_dim * self.ssm_n_v_heads

    @property
    def linear_layers(self) -> list[int]:
        return [i for i in range(self.n_layer) if self.recurrent[i]]

    @property
    def attention_layers(self) -> list[int]:
        return [i for i in range(self.n_layer) if not self.recurrent[i]]


class Input(Protocol):
    """A graph input as the runner uses it (`deltarun.graphs.inputs.GraphInput` is the family side)."""

    #: True when the values follow from the ubatch shape alone (filled once in `bind`)
    constant: bool
    #: the input's tensors by name
    tensors: dict[str, Tensor]

    @property
    def used(self) -> bool:
        """Whether the allocated graph reads any of the tensors (known after `bind`)."""

    def bind(self, shape: UbatchShape) -> list[tuple[Tensor, int, int]]:
        """Make the host arrays of the used tensors; returns (tensor, host address, nbytes) of each."""

    def set_input(self, data: UbatchData) -> None:
        """Write this step's values into the host arrays."""


@dataclass
class BuiltGraph:
    """A family's answer to `build`: the graph inputs (objects that fill themselves) and outputs.

    Outputs: `result_output` (logits), `result_norm` (the hidden state after the final norm) and,
    for the MTP graph, `mtp_out` (the block's output before the final norm). A trunk graph with
    `mtp_argmax` also has `mtp_tokens` (each row's argmax), `mtp_out`, `mtp_result_norm` and
    `mtp_result_output` (the MTP block's logits on those rows).
    """

    inputs: list[Input]
    outputs: dict[str, Tensor]
    #: the riding chunk's own inputs (`UbatchShape.ride`), filled from `UbatchData.ride`
    ride_inputs: list[Input] = field(default_factory=list)

    @property
    def tensors(self) -> dict[str, Tensor]:
        """Every input and output tensor by name (for graph dumps and tests; the riding chunk's
        inputs prefixed `ride.`)."""
        named = {name: t for inp in self.inputs for name, t in inp.tensors.items()}
        named.update({"ride." + name: t for inp in self.ride_inputs for name, t in inp.tensors.items()})
        named.update(self.outputs)
        return named


class GraphFamily(Protocol):
    """What `Model` needs of an architecture's graph builder."""

    arch: str
    hp: HParams
    rides: bool     # the graphs take a riding prompt chunk (`UbatchShape.ride`)

    def graph_size(self, ub: UbatchShape) -> int:
        """Most nodes the graph of this shape can hold, with margin (ggml aborts past its size)."""

    def tensor_names(self) -> list[str]:
        """Names of every weight the graph may read (optional ones included)."""

    def gathered_weights(self) -> frozenset[str]:
        """Names of the weights the graph reads rows of (get_rows) rather than multiplies by."""

    def mtp_lm_head(self) -> str:
        """Name of the weight the MTP block's LM head multiplies by (a draft vocabulary is a view
        of its first rows)."""

    def build(self, ctx: Any, gf: Any, w: dict[str, Tensor], mem: Any, ub: UbatchShape) -> BuiltGraph:
        """Add the forward pass of one ubatch of shape `ub` to `gf`."""
