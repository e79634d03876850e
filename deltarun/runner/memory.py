"""The model's memory: KV cache of the full-attention layers and the rollback-slot recurrent state.

Recurrent state, per linear-attention layer and sequence (one cell per sequence), keeps
K = rs_slots snapshots (`--rs-slots`) so that speculative tokens can be rolled back:

- conv states: one row per cell of (d_conv-1) * K * channels floats, viewed as
  [d_conv-1, K, channels]: slot r of channel c is the window r tokens back; a layer with an extra
  state (`HParams.conv_state_extra`: qwen4exp's PLE convolution) has K more snapshots of it after
  those, slot-major (slot r is one contiguous run), so the row still holds the whole cell.
- SSM states: [D, n_seq_max, K] with D = S_v * S_v * H_v; slot-major, so slot 0 of consecutive
  cells is contiguous (what the graph reads as the live state).

Slot 0 is always the newest state. The KV cache holds n_ctx rows per sequence
(row = seq * n_ctx + position), written with set_rows through an index input; a layer's K rows can
carry extra columns (`HParams.k_row_extra`: qwen4exp's indexer keys), kept and rolled back with K.

Memory also owns the operations on that state (as mlx-lm's cache objects own trim and state):
checkpoint / restore of a sequence's live recurrent state, rollback of the last tokens through the
rollback slots, and copying a sequence into another; the graphs only ever read and write it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

from deltarun.base.errors import BackendError, DeltarunError, RollbackError
from deltarun.base.ggml_compat import cpu_writes_slots_in_place
from deltarun.base.ggml_util import (Tensor, ggml, new_context, set_name,
                                     tensor_to_numpy)
from deltarun.base.interface import HParams
from deltarun.runner.backend import Backend, alloc_tensors
from deltarun.runner.placement import Placement

KV_TYPES = {"f16": ggml.GGML_TYPE_F16, "f32": ggml.GGML_TYPE_F32}
#: the longest context (--ctx): token positions are I32 graph inputs
MAX_CONTEXT = 2**31 - 1
#: the most sequences one model holds (--parallel, n_seq_max): llama.cpp's LLAMA_MAX_SEQ
MAX_SEQUENCES = 256
#: the most rollback slots a sequence keeps (--rs-slots): drafts verify at most 64 tokens
#: (--draft-max) and every slot is a copy of the whole recurrent state, so a wider window is
#: better served by a checkpoint
MAX_RS_SLOTS = 256


def check_memory_shape(n_ctx: int, n_seq_max: int, rs_slots: int) -> None:
    """Refuse sizes ggml cannot lay out (its tensor sizes are 64-bit element counts and a larger
    request aborts the process) before anything is allocated: one line each, the CLI's names."""
    for value, name, most in ((n_ctx, "--ctx", MAX_CONTEXT), (n_seq_max, "the number of sequences", MAX_SEQUENCES),
                              (rs_slots, "--rs-slots", MAX_RS_SLOTS)):
        if not 1 <= value <= most:
            raise DeltarunError(f"{name} must be between 1 and {most} (got {value})")


@dataclass(frozen=True)
class RecurrentState:
    """The live recurrent state of a sequence after `n_past` tokens: host bytes per layer (slot 0 of
    the conv window and of the SSM matrix)."""

    n_past: int
    conv: dict[int, np.ndarray]
    ssm: dict[int, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.conv.values()) + sum(a.nbytes for a in self.ssm.values())


@dataclass(frozen=True)
class KVRows:
    """The KV rows of positions start..start+n-1 of a sequence, per attention layer: (K rows, V
    channels x n)."""

    n: int
    rows: dict[int, tuple[np.ndarray, np.ndarray]]
    start: int = 0

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.rows.values())


@dataclass
class Checkpoint:
    """A point a sequence can return to: its tokens and its live recurrent state (a host copy), see
    `Memory.checkpoint`. The KV rows are not copied: `Memory.can_restore` tells whether they still
    hold (`log_index`: where the sequence's truncations are looked up from)."""

    seq: int
    tokens: list[int]
    log_index: int
    state: RecurrentState

    @property
    def n_past(self) -> int:
        return self.state.n_past

    @property
    def nbytes(self) -> int:
        return self.state.nbytes


@dataclass
class SeqState:
    """Host-side bookkeeping for one sequence."""

    n_past: int = 0
    tokens: list[int] = field(default_factory=list)
    undoable: int = 0      # tokens of the last ubatch a rollback may undo (all, or all but its first)
    rolled_back: int = 0   # tokens already undone since that ubatch


class Memory:
    """Backend tensors of the KV cache and recurrent state, plus per-sequence positions."""

    def __init__(self, hp: HParams, backend: Backend, n_ctx: int, n_seq_max: int = 1, rs_slots: int = 1,
                 kv_type: str = "f16", mtp: bool = False, placement: Placement | None = None,
                 n_capture: int = 0, slots_in_place: bool = True):
        self.hp = hp
        self.n_ctx = n_ctx
        self.n_seq_max = n_seq_max
        self.rs_slots = rs_slots
        self.kv_type = kv_type
        layers = hp.n_layer
        self.ctx = new_context(6 * (layers + hp.n_mtp) + 4)
        self.k: dict[int, Tensor] = {}
        self.v: dict[int, Tensor] = {}
        self.conv: dict[int, Tensor] = {}
        self.ssm: dict[int, Tensor] = {}
        #: capture slots: rows laid out as a cell's, where a graph copies the recurrent state at
        #: chosen tokens inside a ubatch (UbatchShape.captures; read with `read_capture`)
        self.n_capture = n_capture
        self.capture_conv: dict[int, Tensor] = {}
        self.capture_ssm: dict[int, Tensor] = {}
        kv_rows = n_ctx * n_seq_max
        self.mtp_layers = list(range(hp.n_layer, hp.n_layer + hp.n_mtp)) if mtp else []
        width = hp.head_dim * hp.n_head_kv
        for il in hp.attention_layers + self.mtp_layers:
            k_width = hp.k_row_width(il) if il < hp.n_layer else width
            # K: one row per cell. V: transposed, one row per (sequence, channel) across the cells
            # (llama.cpp's layout without flash attention), so attention multiplies the stored rows
            # as they are instead of transposing n_kv cells of V on every step.
            self.k[il] = set_name(ggml.ggml_new_tensor_2d(self.ctx, KV_TYPES[kv_type], k_width, kv_rows), f"cache_k_l{il}")
            self.v[il] = set_name(ggml.ggml_new_tensor_2d(self.ctx, KV_TYPES[kv_type], n_ctx, width * n_seq_max),
                                  f"cache_v_l{il}")
        for il in hp.linear_layers:
            self.conv[il] = set_name(ggml.ggml_new_tensor_2d(
                self.ctx, ggml.GGML_TYPE_F32, hp.conv_state_size_of(il) * self.rs_slots, n_seq_max), f"cache_r_l{il}")
            self.ssm[il] = set_name(ggml.ggml_new_tensor_3d(
                self.ctx, ggml.GGML_TYPE_F32, hp.ssm_state_size, n_seq_max, self.rs_slots), f"cache_s_l{il}")
            if n_capture:
                self.capture_conv[il] = set_name(ggml.ggml_new_tensor_2d(
                    self.ctx, ggml.GGML_TYPE_F32, hp.conv_state_size_of(il) * self.rs_slots, n_capture), f"capture_r_l{il}")
                self.capture_ssm[il] = set_name(ggml.ggml_new_tensor_2d(
                    self.ctx, ggml.GGML_TYPE_F32, hp.ssm_state_size, n_capture), f"capture_s_l{il}")
        self.buffers = self._allocate(backend, placement)
        self._scratch = np.empty(0, dtype=np.uint8)     # host scratch for moving state (`_scratch_of`)
        #: the CPU kernel writes the delta net's rollback snapshots into `ssm` itself (graphs then
        #: leave out the copy): only when every layer computes on the CPU backend, the one kernel
        #: that does (a device's would write its snapshots to its output and the cache would miss
        #: them), and `slots_in_place` allows it
        on_cpu = all(b.is_cpu for b in placement.sched_backends) if placement is not None else backend.is_cpu
        self.ssm_slots_in_place = slots_in_place and on_cpu and cpu_writes_slots_in_place()
        self.buffer = self.buffers[0]
        self.seqs = [SeqState() for _ in range(n_seq_max)]
        #: (seq, new length) each time a sequence got shorter: what makes a checkpoint stale
        self.truncations: list[tuple[int, int]] = []
        self.clear()

    def _allocate(self, backend: Backend, placement: Placement | None) -> list[Any]:
        """Place each layer's tensors in its backend's buffer (one buffer per backend used)."""
        groups: dict[int, tuple[Backend, list[Tensor]]] = {}
        for il, ts in [(il, (self.k[il], self.v[il])) for il in self.k] + \
                      [(il, (self.conv[il], self.ssm[il])) for il in self.conv] + \
                      [(il, (self.capture_conv[il], self.capture_ssm[il])) for il in self.capture_conv]:
            be = placement.layer(il) if placement is not None else backend
            groups.setdefault(be.handle, (be, []))[1].extend(ts)
        if not groups:
            groups[backend.handle] = (backend, [])
        buffers = []
        try:
            for be, tensors in groups.values():
                buffers.append(alloc_tensors(be, tensors, "the KV cache and recurrent state"))
        except BackendError:
            for b in buffers:
                ggml.ggml_backend_buffer_free(b)
            raise
        return buffers

    def nbytes_expected(self) -> int:
        return memory_bytes(self.hp, self.n_ctx, self.n_seq_max, self.rs_slots, self.kv_type, bool(self.mtp_layers),
                            self.n_capture)

    @property
    def nbytes(self) -> int:
        return sum(int(ggml.ggml_backend_buffer_get_size(b)) for b in self.buffers)

    def clear(self) -> None:
        """Forget every sequence (KV cache and recurrent state)."""
        for b in self.buffers:
            ggml.ggml_backend_buffer_clear(b, 0)
        self.seqs = [SeqState() for _ in range(self.n_seq_max)]
        self.truncations.extend((s, 0) for s in range(self.n_seq_max))

    # --- state operations ---------------------------------------------------------------------
    def checkpoint(self, seq: int = 0) -> Checkpoint:
        """Remember the live recurrent state of `seq` at its current length, on the host.

        A recurrent state cannot be rolled back further than its slots, so a chat keeps a
        checkpoint at the end of each prompt: when the next turn re-renders the previous answer
        differently, the model returns to the checkpoint instead of recomputing everything. The KV
        rows need no copy: rows before the checkpoint stay untouched unless the sequence is cut
        shorter than it, which `restore` detects.
        """
        return Checkpoint(seq, list(self.seqs[seq].tokens), len(self.truncations), self.read_recurrent(seq))

    def can_restore(self, cp: Checkpoint) -> bool:
        """True while no rollback, restore or reset has cut the sequence below the checkpoint."""
        return all(not (s == cp.seq and n < cp.n_past) for s, n in self.truncations[cp.log_index:])

    def restore(self, cp: Checkpoint) -> None:
        """Return sequence cp.seq to the checkpoint (its length, tokens and recurrent state)."""
        if not self.can_restore(cp):
            raise RollbackError("the checkpoint is stale: the sequence was cut below it since it was taken")
        self.write_recurrent(cp.seq, cp.state)
        self.set_tokens(cp.seq, cp.tokens)

    def rollback(self, n_tokens: int, seq: int = 0) -> None:
        """Drop the last n_tokens of a sequence: the KV rows are forgotten (masked, then
        overwritten) and the recurrent state is restored from slot r.

        After a ubatch of m tokens slot r holds the state r tokens back for r <= min(m, K-1)
        (slot m, when m < K, is the state the ubatch started from, unless the step left it out:
        `UbatchShape.keep_start`), so at most min(m, K-1) tokens can be undone in total
        (min(m-1, K-1) after such a step).
        """
        state = self.seqs[seq]
        if n_tokens == 0:
            return
        limit = self.rollback_limit(seq)
        if not 0 < n_tokens <= limit:
            raise RollbackError(
                f"cannot roll back {n_tokens} tokens: the recurrent state keeps {self.rs_slots} rollback "
                f"slots and the last ubatch left {state.undoable} of its tokens undoable, so {max(limit, 0)} can be undone")
        self._restore_slot(n_tokens + state.rolled_back, seq)
        state.rolled_back += n_tokens
        state.n_past -= n_tokens
        del state.tokens[len(state.tokens) - n_tokens:]
        self.truncations.append((seq, state.n_past))

    def rollback_limit(self, seq: int = 0) -> int:
        """How many tokens `rollback` can still undo in `seq`: min(m, K-1) after a ubatch of m
        tokens, less those already undone since (the resume planner, runner/resume.py, plans no
        rollback beyond it)."""
        state = self.seqs[seq]
        return min(state.undoable, self.rs_slots - 1) - state.rolled_back

    def advance(self, seq: int, tokens: list[int], keep_start: bool = True, undoable: bool = True) -> None:
        """Bookkeeping after a ubatch appended `tokens` to `seq` (its KV rows and rollback slots
        written by the graph): n_past, tokens, and what a rollback may undo from now on: every
        token, all but the first when the graph left the start state out
        (`UbatchShape.keep_start`), none when it wrote no rollback slots (`undoable=False`:
        `UbatchShape.continued`)."""
        st = self.seqs[seq]
        st.n_past += len(tokens)
        st.tokens.extend(tokens)
        st.undoable = 0 if not undoable else len(tokens) if keep_start else len(tokens) - 1
        st.rolled_back = 0

    def copy_seq(self, src: int, dst: int) -> None:
        """Make sequence dst a copy of src: KV rows, live recurrent state, bookkeeping."""
        for t, block, size in self._cell_regions(self.seqs[src].n_past):
            self._copy_bytes(t, src * block, dst * block, size)
        s, d = self.seqs[src], self.seqs[dst]
        d.n_past, d.tokens, d.undoable, d.rolled_back = s.n_past, list(s.tokens), 0, 0
        self.truncations.append((dst, 0))

    def swap_seqs(self, a: int, b: int) -> None:
        """Exchange sequences a and b: KV rows, live recurrent state, bookkeeping. Rollback slots do
        not survive (nothing needs them between steps). A server keeps its running sequences in
        consecutive cells this way."""
        for t, block, size in self._cell_regions(max(self.seqs[a].n_past, self.seqs[b].n_past)):
            self._swap_bytes(t, a * block, b * block, size)
        ta, tb = list(self.seqs[a].tokens), list(self.seqs[b].tokens)
        self.set_tokens(a, tb)
        self.set_tokens(b, ta)

    def _cell_regions(self, n: int) -> Iterator[tuple[Tensor, int, int]]:
        """What a cell holding n positions owns, per cache tensor: (tensor, bytes from one cell's
        block to the next, bytes of the block to move). K's first n rows are its positions; V
        (transposed) holds them in every row of its block, so all of it moves; a cell's conv row
        and slot 0 of its SSM state are the live recurrent state."""
        for il in self.k:
            for cache in (self.k[il], self.v[il]):
                block = int(ggml.ggml_nbytes(cache)) // self.n_seq_max
                yield cache, block, (n * cache.contents.nb[1] if cache is self.k[il] else block) if n else 0
        for il in self.conv:
            for t in (self.conv[il], self.ssm[il]):
                cell = t.contents.nb[1]
                yield t, cell, cell

    # --- one cell's state on the host (a server moves conversations between cells and host RAM) ---
    # Layout: K holds one row per (cell, position) at row cell * n_ctx + position; V is stored
    # transposed, one row of n_ctx positions per (cell, channel); a cell's conv state is one row of
    # the conv tensor; slot 0 of a cell's SSM state is nb[1] bytes at cell * nb[1]. Everything goes
    # through ggml_backend_tensor_get/set, so it works on any backend.
    def read_recurrent(self, seq: int) -> RecurrentState:
        """Host copy of the live recurrent state of `seq`."""
        return self._read_state(self.conv, self.ssm, seq, self.seqs[seq].n_past)

    def read_capture(self, i: int, n_past: int) -> RecurrentState:
        """Host copy of capture slot i (the state after n_past tokens, as `read_recurrent` gives it:
        only slot 0 of its conv row is written)."""
        return self._read_state(self.capture_conv, self.capture_ssm, i, n_past)

    def _read_state(self, conv: dict[int, Tensor], ssm: dict[int, Tensor], row: int, n_past: int) -> RecurrentState:
        """Slot 0 of row `row` (a cell's, or a capture slot's) of every layer's conv and SSM tensors."""
        return RecurrentState(n_past, {il: self._conv_slot0(t, row) for il, t in conv.items()},
                              {il: self._read_bytes(t, row * t.contents.nb[1], t.contents.nb[1]) for il, t in ssm.items()})

    def _conv_slot_views(self, row: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A conv row's windows [channels, K, d_conv-1] and extra state [K, extra] (see the module
        docstring), as views of its floats."""
        hp, K = self.hp, self.rs_slots
        windows = row[:hp.conv_state_size * K].reshape(hp.conv_dim, K, hp.ssm_d_conv - 1)
        return windows, row[hp.conv_state_size * K:].reshape(K, -1)

    def _conv_slot0(self, t: Tensor, row: int) -> np.ndarray:
        """Slot 0 of row `row` of conv tensor t as bytes: every channel's window, then the extra
        state's slot 0. A state copy keeps only the live slot: with K rollback slots the row holds
        K windows per channel (4 MB of a checkpoint's 24 at Qwen3.5-0.8B's shapes with K = 4), and
        nothing can be rolled back past a restored state."""
        size = t.contents.nb[1]
        if self.rs_slots == 1:
            return self._read_bytes(t, row * size, size)
        whole = self._scratch_array(size)
        ggml.ggml_backend_tensor_get(t, whole.ctypes.data, row * size, size)
        windows, extra = self._conv_slot_views(whole.view(np.float32))
        n = self.hp.conv_state_size
        out = np.empty(n + extra.shape[1], dtype=np.float32)
        out[:n].reshape(windows.shape[0], -1)[:] = windows[:, 0, :]
        out[n:] = extra[0]
        return out.view(np.uint8)

    def _conv_row_of(self, t: Tensor, slot0: np.ndarray) -> np.ndarray:
        """The whole conv row for a saved slot 0 (`_conv_slot0`): the saved state in every slot."""
        if self.rs_slots == 1:
            return slot0
        whole = self._scratch_array(t.contents.nb[1])
        windows, extra = self._conv_slot_views(whole.view(np.float32))
        saved = slot0.view(np.float32)
        n = self.hp.conv_state_size
        windows[:] = saved[:n].reshape(windows.shape[0], 1, -1)
        extra[:] = saved[n:]
        return whole

    def write_recurrent(self, seq: int, state: RecurrentState) -> None:
        """Make `state` the live recurrent state of `seq` (any cell of the same model)."""
        for il in self.conv:
            conv = self.conv[il]
            self._write_bytes(conv, self._conv_row_of(conv, state.conv[il]), seq * conv.contents.nb[1])
            self._write_bytes(self.ssm[il], state.ssm[il], seq * self.ssm[il].contents.nb[1])

    def _v_layout(self, v: Tensor) -> tuple[int, int]:
        """A V tensor's channels per cell and bytes per position: V is stored transposed, a row per
        channel, n_ctx positions wide."""
        return int(v.contents.ne[1]) // self.n_seq_max, int(v.contents.nb[1]) // self.n_ctx

    @property
    def kv_position_bytes(self) -> int:
        """Host bytes of one position's KV rows over every attention layer (what read_kv copies)."""
        total = 0
        for il in self.k:
            width, elem = self._v_layout(self.v[il])
            total += int(self.k[il].contents.nb[1]) + width * elem
        return total

    def read_kv(self, seq: int, n: int, start: int = 0) -> KVRows:
        """Host copy of the KV rows of positions start..n-1 of `seq`."""
        rows = {}
        for il in self.k:
            k, v = self.k[il], self.v[il]
            k_row, v_row = k.contents.nb[1], v.contents.nb[1]       # V row: one channel, n_ctx positions
            width, elem = self._v_layout(v)
            block = self._read_bytes(v, seq * width * v_row, width * v_row).reshape(width, v_row)
            rows[il] = (self._read_bytes(k, (seq * self.n_ctx + start) * k_row, (n - start) * k_row),
                        block[:, start * elem:n * elem].copy())
        return KVRows(n - start, rows, start)

    def write_kv(self, seq: int, kv: KVRows, n: int | None = None) -> None:
        """Write the first n (default all) saved positions of `kv` into cell `seq`, at the
        positions they were read from (kv.start..)."""
        n = kv.n if n is None else n
        if n > kv.n:
            raise ValueError(f"only {kv.n} positions saved, {n} asked")
        for il, (k_part, v_part) in kv.rows.items():
            k, v = self.k[il], self.v[il]
            k_row, v_row = k.contents.nb[1], v.contents.nb[1]
            self._write_bytes(k, k_part[:n * k_row], (seq * self.n_ctx + kv.start) * k_row)
            width, elem = self._v_layout(v)
            if not n:
                continue
            part = np.ascontiguousarray(v_part[:, :n * elem])
            addr, stride = part.ctypes.data, part.strides[0]
            for ch in range(width):                    # the n positions of each channel's row
                # one raw call per row: numpy slicing per row cost more than the copy (a server moves
                # cells with this: PromptCache.swap, resuming from host RAM)
                ggml.ggml_backend_tensor_set(v, addr + ch * stride, (seq * width + ch) * v_row + kv.start * elem,
                                             n * elem)

    def set_tokens(self, seq: int, tokens: list[int]) -> None:
        """Set the bookkeeping of `seq` to hold `tokens` (its state must already match them).

        Nothing can be rolled back afterwards; checkpoints of the cell taken at a greater length
        become stale (the truncation log says so).
        """
        st = self.seqs[seq]
        st.n_past, st.tokens, st.undoable, st.rolled_back = len(tokens), list(tokens), 0, 0
        self.truncations.append((seq, len(tokens)))

    def clear_seq(self, seq: int) -> None:
        """Forget sequence `seq` only: no tokens, and a zero live recurrent state (the conv row, and
        slot 0 of the SSM state, which the next ubatch starts from). The SSM's other rollback slots
        keep what they hold: nothing can be rolled back past the clear (`set_tokens`), and a
        ubatch writes slots 1..min(m, K-1) before a rollback may read them (`rollback_limit`); a
        new request's seq is cleared, and zeroing every slot through fresh arrays took 10 ms of a
        server's admission at K = 4 (72 MB at Qwen3.5-0.8B's shapes); slot 0 through the kept
        scratch takes 3 ms."""
        for t, block, size in self._cell_regions(0):      # (no positions: the KV rows are not touched)
            if size:
                zeros = self._scratch_array(size)
                zeros[:] = 0
                self._write_bytes(t, zeros, seq * block)
        self.set_tokens(seq, [])

    def _restore_slot(self, r: int, seq: int) -> None:
        """Make slot r the live state of `seq`: copy slot r into slot 0 for every linear layer.

        Slots 1..r keep their contents; the graph always reads slot 0, so after this the next
        ubatch continues from the state r tokens back.
        """
        hp = self.hp
        for il in self.conv:
            row_bytes = self.conv[il].contents.nb[1]      # the cell's row only, not every cell's
            cell = self._read_bytes(self.conv[il], seq * row_bytes, row_bytes).view(np.float32)
            windows, extra = self._conv_slot_views(cell)
            windows[:, 0, :] = windows[:, r, :]
            extra[0] = extra[r]
            self._write_bytes(self.conv[il], cell, seq * row_bytes)
            ssm = self.ssm[il]
            slot_stride, cell_stride = ssm.contents.nb[2], ssm.contents.nb[1]
            self._copy_bytes(ssm, r * slot_stride + seq * cell_stride, seq * cell_stride, hp.ssm_state_size * 4)

    @staticmethod
    def _read_bytes(t: Tensor, offset: int, size: int) -> np.ndarray:
        buf = np.empty(size, dtype=np.uint8)
        if size:
            ggml.ggml_backend_tensor_get(t, buf.ctypes.data, offset, size)
        return buf

    @staticmethod
    def _write_bytes(t: Tensor, data: np.ndarray, offset: int) -> None:
        if data.nbytes:
            data = np.ascontiguousarray(data)
            ggml.ggml_backend_tensor_set(t, data.ctypes.data, offset, data.nbytes)

    def _scratch_array(self, size: int) -> np.ndarray:
        """`size` bytes of host scratch, kept between calls, that a cell's state moves through
        (`_copy_bytes`: rollbacks, `copy_seq`; `_swap_bytes`: a server's moves; conv rows of state
        copies). A move through fresh arrays (both cells' KV rows and states alive at once, 4 x 18
        MB at Qwen3.5-0.8B's shapes) spent most of its ~50 ms in page faults."""
        if self._scratch.nbytes < size:
            self._scratch = np.empty(size, dtype=np.uint8)
        return self._scratch[:size]

    def _scratch_of(self, size: int) -> int:
        """The address of `_scratch_array(size)`."""
        return self._scratch_array(size).ctypes.data

    def _copy_bytes(self, t: Tensor, src: int, dst: int, size: int) -> None:
        """Copy `size` bytes of backend tensor t from offset src to offset dst (through the host)."""
        if size:
            buf = self._scratch_of(size)
            ggml.ggml_backend_tensor_get(t, buf, src, size)
            ggml.ggml_backend_tensor_set(t, buf, dst, size)

    def _swap_bytes(self, t: Tensor, off_a: int, off_b: int, size: int) -> None:
        """Exchange `size` bytes of backend tensor t at two offsets (through the host)."""
        if size:
            first = self._scratch_of(2 * size)
            second = first + size
            ggml.ggml_backend_tensor_get(t, first, off_a, size)
            ggml.ggml_backend_tensor_get(t, second, off_b, size)
            ggml.ggml_backend_tensor_set(t, second, off_a, size)
            ggml.ggml_backend_tensor_set(t, first, off_b, size)

    # --- reading state back (tests, debugging) ------------------------------------------------
    def conv_slots(self, il: int, seq: int = 0) -> np.ndarray:
        """Conv state of one sequence as numpy (K, d_conv-1, channels): slot, then oldest column first."""
        row = tensor_to_numpy(self.conv[il]).reshape(self.n_seq_max, -1)[seq]   # [(d_conv-1)*K*channels (+ extra)]
        return self._conv_slot_views(row)[0].transpose(1, 2, 0).copy()

    def ssm_slots(self, il: int, seq: int = 0) -> np.ndarray:
        """SSM state of one sequence as numpy (K, H_v, S_k, S_v): M[k, v] per head and slot."""
        hp = self.hp
        S, H = hp.head_v_dim, hp.ssm_n_v_heads
        arr = tensor_to_numpy(self.ssm[il]).reshape(self.rs_slots, self.n_seq_max, -1)[:, seq, :]   # [K, D]
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
                 mtp: bool = False, n_capture: int = 0) -> int:
    """Bytes the KV cache and recurrent state take (what `inspect` reports)."""
    kv_elem = 2 if kv_type == "f16" else 4
    width = hp.head_dim * hp.n_head_kv
    per_position = sum(hp.k_row_width(il) + width for il in hp.attention_layers) + (2 * width * hp.n_mtp if mtp else 0)
    kv = per_position * n_ctx * n_seq_max * kv_elem
    rs = sum(hp.conv_state_size_of(il) + hp.ssm_state_size for il in hp.linear_layers) * rs_slots * n_seq_max * 4
    rs += sum(hp.conv_state_size_of(il) * rs_slots + hp.ssm_state_size for il in hp.linear_layers) * n_capture * 4
    return kv + rs
