"""The model's memory: KV cache of the full-attention layers and the rollback-slot recurrent state.

Recurrent state, per linear-attention layer and sequence (one cell per sequence), keeps
K = rs_slots snapshots (`--rs-slots`) so that speculative tokens can be rolled back:

- conv states: one row per cell of (d_conv-1) * K * channels floats, viewed as
  [d_conv-1, K, channels]: slot r of channel c is the window r tokens back.
- SSM states: [D, n_cells, K] with D = S_v * S_v * H_v; slot-major, so slot 0 of consecutive
  cells is contiguous (what the graph reads as the live state).

Slot 0 is always the newest state. The KV cache holds n_ctx rows per sequence
(row = seq * n_ctx + position), written with set_rows through an index input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from deltarun.graphs.interface import HParams
from deltarun.runner.backend import Backend, Placement
from deltarun.runner.errors import BackendError
from deltarun.runner.ggml_util import Tensor, ctypes, ggml, name_of, new_context, set_name, tensor_to_numpy

KV_TYPES = {"f16": ggml.GGML_TYPE_F16, "f32": ggml.GGML_TYPE_F32}


@dataclass
class SeqState:
    """Host-side bookkeeping for one sequence."""

    n_past: int = 0
    tokens: list[int] = field(default_factory=list)
    last_ubatch: int = 0   # tokens evaluated by the last ubatch (what a rollback may undo)
    rolled_back: int = 0   # tokens already undone since that ubatch


class Memory:
    """Backend tensors of the KV cache and recurrent state, plus per-sequence positions."""

    def __init__(self, hp: HParams, backend: Backend, n_ctx: int, n_seq_max: int = 1, rs_slots: int = 1,
                 kv_type: str = "f16", mtp: bool = False, placement: Placement | None = None):
        self.hp = hp
        self.n_ctx = n_ctx
        self.n_cells = n_seq_max
        self.rs_slots = rs_slots
        self.kv_type = kv_type
        layers = hp.n_layer
        self.ctx = new_context(4 * (layers + hp.n_mtp) + 4)
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}
        self.conv: dict[int, Tensor] = {}
        self.ssm: dict[int, Tensor] = {}
        kv_rows = n_ctx * n_seq_max
        self.mtp_layers = list(range(hp.n_layer, hp.n_layer + hp.n_mtp)) if mtp else []
        width = hp.head_dim * hp.n_head_kv
        for il in hp.attention_layers + self.mtp_layers:
            # K: one row per cell. V: transposed, one row per (sequence, channel) across the cells
            # (llama.cpp's layout without flash attention), so attention multiplies the stored rows
            # as they are instead of transposing n_kv cells of V on every step.
            self.k[il] = set_name(ggml.ggml_new_tensor_2d(self.ctx, KV_TYPES[kv_type], width, kv_rows), f"cache_k_l{il}")
            self.v[il] = set_name(ggml.ggml_new_tensor_2d(self.ctx, KV_TYPES[kv_type], n_ctx, width * n_seq_max),
                                  f"cache_v_l{il}")
        for il in hp.linear_layers:
            self.conv[il] = set_name(ggml.ggml_new_tensor_2d(
                self.ctx, ggml.GGML_TYPE_F32, hp.conv_state_size * self.rs_slots, n_seq_max), f"cache_r_l{il}")
            self.ssm[il] = set_name(ggml.ggml_new_tensor_3d(
                self.ctx, ggml.GGML_TYPE_F32, hp.ssm_state_size, n_seq_max, self.rs_slots), f"cache_s_l{il}")
        self.buffers = self._allocate(backend, placement)
        self.buffer = self.buffers[0]
        self.seqs = [SeqState() for _ in range(n_seq_max)]
        self.clear()

    def _allocate(self, backend: Backend, placement: Placement | None) -> list[Any]:
        """Place each layer's tensors in its backend's buffer (one buffer per backend used)."""
        groups: dict[int, tuple[Backend, list[Tensor]]] = {}
        for il, ts in [(il, (self.k[il], self.v[il])) for il in self.k] + \
                      [(il, (self.conv[il], self.ssm[il])) for il in self.conv]:
            be = placement.layer(il) if placement is not None else backend
            groups.setdefault(be.handle, (be, []))[1].extend(ts)
        if not groups:
            groups[backend.handle] = (backend, [])
        buffers = []
        for be, tensors in groups.values():
            buft = be.buffer_type
            align = int(ggml.ggml_backend_buft_get_alignment(buft))
            offsets, size = [], 0
            for t in tensors:
                offsets.append(size)
                size += -(-int(ggml.ggml_backend_buft_get_alloc_size(buft, t)) // align) * align
            buffer = ggml.ggml_backend_buft_alloc_buffer(buft, max(size, align))
            if not buffer:
                for b in buffers:
                    ggml.ggml_backend_buffer_free(b)
                raise BackendError(f"backend {be.name} could not allocate {size} bytes "
                                   f"for the KV cache and recurrent state")
            base = int(ggml.ggml_backend_buffer_get_base(buffer) or 0)
            for t, off in zip(tensors, offsets):
                if ggml.ggml_backend_tensor_alloc(buffer, t, ctypes.c_void_p(base + off)) != 0:
                    raise BackendError(f"backend {be.name} could not place {name_of(t)}")
            buffers.append(buffer)
        return buffers

    def nbytes_expected(self) -> int:
        return memory_bytes(self.hp, self.n_ctx, self.n_cells, self.rs_slots, self.kv_type, bool(self.mtp_layers))

    @property
    def nbytes(self) -> int:
        return sum(int(ggml.ggml_backend_buffer_get_size(b)) for b in self.buffers)

    def clear(self) -> None:
        for b in self.buffers:
            ggml.ggml_backend_buffer_clear(b, 0)
        self.seqs = [SeqState() for _ in range(self.n_cells)]

    # --- reading state back (tests, debugging) ------------------------------------------------
    def conv_slots(self, il: int, seq: int = 0) -> np.ndarray:
        """Conv state of one sequence as numpy (K, d_conv-1, channels): slot, then oldest column first."""
        hp = self.hp
        row = tensor_to_numpy(self.conv[il]).reshape(self.n_cells, -1)[seq]   # [(d_conv-1)*K*channels]
        arr = row.reshape(hp.conv_dim, self.rs_slots, hp.ssm_d_conv - 1)   # numpy of ne [dc1, K, ch]
        return arr.transpose(1, 2, 0).copy()

    def ssm_slots(self, il: int, seq: int = 0) -> np.ndarray:
        """SSM state of one sequence as numpy (K, H_v, S_k, S_v): M[k, v] per head and slot."""
        hp = self.hp
        S, H = hp.head_v_dim, hp.ssm_n_v_heads
        arr = tensor_to_numpy(self.ssm[il]).reshape(self.rs_slots, self.n_cells, -1)[:, seq, :]   # [K, D]
        # ggml stores each head as ne [S_k, S_v] (k fastest) = numpy (S_v, S_k): transpose to (S_k, S_v)
        return arr.reshape(self.rs_slots, H, S, S).transpose(0, 1, 3, 2).copy()

    def free(self) -> None:
        for b in self.buffers:
            ggml.ggml_backend_buffer_free(b)
        self.buffers = []
        self.buffer = None
        if self.ctx:
            ggml.ggml_free(self.ctx)
            self.ctx = None


def memory_bytes(hp: HParams, n_ctx: int, n_seq_max: int, rs_slots: int, kv_type: str = "f16",
                 mtp: bool = False) -> int:
    """Bytes the KV cache and recurrent state take (what `inspect` reports)."""
    kv_elem = 2 if kv_type == "f16" else 4
    kv = 2 * (len(hp.attention_layers) + (hp.n_mtp if mtp else 0)) * hp.head_dim * hp.n_head_kv * n_ctx * n_seq_max * kv_elem
    rs = len(hp.linear_layers) * (hp.conv_state_size + hp.ssm_state_size) * rs_slots * n_seq_max * 4
    return kv + rs
