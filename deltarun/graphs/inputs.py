"""Graph inputs as objects: each creates its tensors in the graph context and fills them per step.

As llama.cpp's `llm_graph_input_*` with `set_input`: a block that needs an input (positions, the
attention mask and KV rows, the recurrent-state cells, ...) asks for the object, and the runner
only iterates the graph's inputs. The speed rules of the runner hold here:

- `bind` runs once per graph, after its first allocation (only then is it known which tensors
  the graph really reads: unused ones get no memory and are skipped). It makes one host array
  per used tensor and fills the inputs that depend on the shape only (`constant`), once.
- `set_input` then writes a step's values into those arrays in place (a few numpy writes),
  and the runner copies every used tensor, constant ones included (the allocator reuses input
  memory for later nodes), with one `ggml_backend_tensor_set` each (`transfers`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deltarun.base.ggml_util import Tensor, c_array, ctypes, ggml, set_name
from deltarun.base.interface import UbatchData, UbatchShape

NEG_INF = -np.inf
_NP_OF_GGML = {ggml.GGML_TYPE_F32: np.float32, ggml.GGML_TYPE_I32: np.int32, ggml.GGML_TYPE_I64: np.int64}


class GraphInput:
    """Base: owns named input tensors and, once bound, their host arrays."""

    #: True when the values follow from the ubatch shape alone (filled once in `bind`)
    constant = False

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] = {}
        self.host: dict[str, np.ndarray] = {}

    def new(self, ctx: Any, name: str, gtype: int, *shape: int) -> Tensor:
        t = ggml.ggml_new_tensor(ctx, gtype, len(shape), c_array(ctypes.c_int64, list(shape)))
        set_name(t, name)
        ggml.ggml_set_input(t)
        self.tensors[name] = t
        return t

    def bind(self, shape: UbatchShape) -> list[tuple[Tensor, int, int]]:
        """Make the host arrays of the used tensors; returns (tensor, host address, nbytes) of each."""
        out = []
        for name, t in self.tensors.items():
            c = t.contents
            if not c.buffer:         # not read by the graph: never allocated
                continue
            nd = int(ggml.ggml_n_dims(t))
            arr = np.zeros(tuple(reversed([int(c.ne[i]) for i in range(nd)])), dtype=_NP_OF_GGML[c.type])
            if arr.nbytes != int(ggml.ggml_nbytes(t)):
                raise AssertionError(f"graph input {name} is not a contiguous tensor")
            self.host[name] = arr
            out.append((t, arr.ctypes.data, arr.nbytes))
        if self.host:
            self.prepare(shape)
        return out

    @property
    def used(self) -> bool:
        return bool(self.host)

    def prepare(self, shape: UbatchShape) -> None:
        """Shape-only values, computed once after binding."""

    def set_input(self, data: UbatchData) -> None:
        """Write this step's values into the host arrays."""


class TokensInput(GraphInput):
    """Token ids, one per token (`inp_tokens`; `mtp_tokens` for the MTP graph)."""

    def __init__(self, ctx: Any, ub: UbatchShape, name: str = "inp_tokens"):
        super().__init__()
        self.name = name
        self.tokens = self.new(ctx, name, ggml.GGML_TYPE_I32, ub.n_rows)   # a riding chunk's after

    def prepare(self, shape: UbatchShape) -> None:
        self.arr = self.host[self.name]
        self.shape2d = (shape.n_seqs, shape.n_seq_tokens)
        self.single = shape.n_rows == 1
        self.n = shape.n_tokens

    def set_input(self, data: UbatchData) -> None:
        if self.single:
            self.arr[0] = data.tokens[0][0]
        else:
            self.arr[:self.n].reshape(self.shape2d)[...] = data.tokens
            if data.ride is not None:
                self.arr[self.n:] = data.ride.tokens[0]


class HiddenInput(GraphInput):
    """Hidden states [n_embd, n_tokens] from the trunk (`mtp_hidden`)."""

    def __init__(self, ctx: Any, ub: UbatchShape, n_embd: int, name: str = "mtp_hidden"):
        super().__init__()
        self.name = name
        self.hidden = self.new(ctx, name, ggml.GGML_TYPE_F32, n_embd, ub.n_tokens)

    def set_input(self, data: UbatchData) -> None:
        self.host[self.name].reshape(-1)[:] = np.asarray(data.hidden).reshape(-1)


class PositionsInput(GraphInput):
    """Token positions (`inp_pos`): one per token for NEOX rope, or 4 per token for multi-section
    rope, laid out as llama.cpp's `llm_graph_input_pos` does: 4 blocks of n_tokens, for text the
    position in blocks 0-2 and 0 in block 3."""

    def __init__(self, ctx: Any, ub: UbatchShape, n_pos_per_token: int = 1):
        super().__init__()
        self.per_token = n_pos_per_token
        self.pos = self.new(ctx, "inp_pos", ggml.GGML_TYPE_I32, ub.n_tokens * n_pos_per_token)

    def prepare(self, shape: UbatchShape) -> None:
        arr = self.host["inp_pos"]
        n = shape.n_tokens
        # the blocks a text position goes to (block 3 stays 0)
        self.flat = arr if self.per_token == 1 else arr.reshape(self.per_token, n)[:3]
        self.single = n == 1 and self.per_token == 1

    def set_input(self, data: UbatchData) -> None:
        if data.rope is not None:   # multi-section streams apart from the cache positions
            if self.per_token == 1:
                raise ValueError("rope streams given to a graph with one position per token")
            self.flat[...] = data.rope
        elif self.single:
            self.flat[0] = data.pos[0, 0]
        elif self.per_token == 1:
            self.flat[:] = data.pos.reshape(-1)
        else:
            self.flat[...] = data.pos.reshape(1, -1)


class EmbeddingsInput(GraphInput):
    """Input rows [n_embd, n_tokens] in place of token embeddings (`inp_embd_rows`): an image's
    embeddings, which the text model takes where the chat template put its pad tokens."""

    def __init__(self, ctx: Any, ub: UbatchShape, n_embd: int):
        super().__init__()
        self.embd = self.new(ctx, "inp_embd_rows", ggml.GGML_TYPE_F32, n_embd, ub.n_tokens)

    def set_input(self, data: UbatchData) -> None:
        self.host["inp_embd_rows"].reshape(-1)[:] = np.asarray(data.embd, dtype=np.float32).reshape(-1)


class OutputIdsInput(GraphInput):
    """Rows whose logits are computed (`inp_out_ids`): the last n_outputs/n_seqs of each sequence,
    or the step's `UbatchData.out_rows`."""

    def __init__(self, ctx: Any, ub: UbatchShape):
        super().__init__()
        self.out_ids = self.new(ctx, "inp_out_ids", ggml.GGML_TYPE_I32, ub.n_outputs)

    def prepare(self, shape: UbatchShape) -> None:
        n, n_seqs = shape.n_seq_tokens, shape.n_seqs
        per_seq = shape.n_outputs // n_seqs
        self.last_rows = (np.arange(n_seqs)[:, None] * n + np.arange(n - per_seq, n)[None, :]).reshape(-1)

    def set_input(self, data: UbatchData) -> None:
        self.host["inp_out_ids"][:] = self.last_rows if data.out_rows is None else data.out_rows


class AttentionKVInput(GraphInput):
    """The causal mask over the visible KV cells and the cache rows this ubatch's K and V go to.

    `kq_mask` [n_kv, n_seq_tokens, 1, n_seqs]: 0 up to each token's position, -inf after.
    `kv_idxs` [n_tokens]: the K row of (sequence, position) = seq * n_ctx + position.
    `v_idxs` [width * n_tokens]: V is stored transposed (see Memory), one row per (sequence,
    channel) across the cells, so each V element is its own row: (seq * width + channel) * n_ctx + pos.
    """

    def __init__(self, ctx: Any, ub: UbatchShape, width: int, n_ctx: int):
        super().__init__()
        self.width, self.n_ctx = width, n_ctx
        self.kq_mask = self.new(ctx, "kq_mask", ggml.GGML_TYPE_F32, ub.n_kv, ub.n_seq_tokens, 1, ub.n_seqs)
        self.kv_idxs = self.new(ctx, "kv_idxs", ggml.GGML_TYPE_I64, ub.n_tokens)
        self.v_idxs = self.new(ctx, "v_idxs", ggml.GGML_TYPE_I64, width * ub.n_tokens)

    def prepare(self, shape: UbatchShape) -> None:
        n, n_seqs = shape.n_seq_tokens, shape.n_seqs
        self.decode = n * n_seqs == 1
        self.seq_head = shape.seq_head
        mask = self.host.get("kq_mask")
        self.mask = None if mask is None else mask.reshape(n_seqs, n, shape.n_kv)
        kv = self.host.get("kv_idxs")
        self.kv = None if kv is None else kv.reshape(n_seqs, n)
        self.kv_row0 = np.arange(shape.seq_head, shape.seq_head + n_seqs)[:, None] * self.n_ctx
        v = self.host.get("v_idxs")
        self.v = None if v is None else v.reshape(n_seqs, n, -1)
        #: where the cache row of each (sequence, V channel) starts, [n_seqs, 1, width]
        seq_ids = np.arange(shape.seq_head, shape.seq_head + n_seqs)[:, None, None]
        self.v_row_starts = (seq_ids * self.width + np.arange(self.width)[None, None, :]) * self.n_ctx

    def set_input(self, data: UbatchData) -> None:
        pos = data.pos
        if self.mask is not None:
            # each row 0 up to its position, -inf after, filled row by row: comparing every row with
            # every cell took 8x as long (9 rows over 47,104 cells 0.37-0.61 ms, a 512-token prompt
            # chunk over 4,096 cells 5.6-14.7 ms; so 0.07 and 0.7-1.3 ms)
            self.mask.fill(NEG_INF)
            for (s, t), p in np.ndenumerate(pos):
                self.mask[s, t, :p + 1] = 0.0
        if self.kv is not None:
            if self.decode:
                self.kv[0, 0] = self.seq_head * self.n_ctx + int(pos[0, 0])
            else:
                np.add(self.kv_row0, pos, out=self.kv)
        if self.v is not None:
            np.add(self.v_row_starts, pos[:, :, None], out=self.v)


class RecurrentStateInput(GraphInput):
    """The order in which the last Kw conv windows go to the rollback slots (`rs_s_slot_rev` =
    {Kw-1..0}: newest to slot 0; Kw = 1, slot 0 only, in a `continued` ubatch). The sequences'
    states are read in place: their cells are seq_head.. (Memory keeps each sequence in its own
    cell and copies states between cells itself), so no `s_copy` gather as in llama.cpp's build_rs
    is needed."""

    constant = True

    def __init__(self, ctx: Any, ub: UbatchShape, rs_slots: int):
        super().__init__()
        self.kw = min(ub.n_seq_tokens + 1, ub.rollback_slots(rs_slots))
        self.slot_rev = self.new(ctx, "rs_s_slot_rev", ggml.GGML_TYPE_I32, self.kw)

    def prepare(self, shape: UbatchShape) -> None:
        if "rs_s_slot_rev" in self.host:
            self.host["rs_s_slot_rev"][:] = np.arange(self.kw - 1, -1, -1)
