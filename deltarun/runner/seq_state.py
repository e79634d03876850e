"""Copies of one sequence's state on the host: what a server's prompt cache saves and brings back.

`Model.checkpoint`/`restore` keep the recurrent state of a sequence and rely on its KV rows staying
in the same cell. A server moves conversations between cells and host RAM, so it needs the pieces
apart: the live recurrent state (slot 0 of each linear-attention layer: conv window + SSM matrix),
the KV rows of the first n positions of the full-attention layers, and the bookkeeping. All of it is
read and written through ggml_backend_tensor_get/set, so it works on any backend.

Layout assumptions (see `deltarun.runner.memory`): K holds one row per (cell, position) at
row cell * n_ctx + position; V is stored transposed, one row of n_ctx positions per (cell,
channel); a cell's conv state is one row of the conv tensor; slot 0 of a cell's SSM state is
`nb[1]` bytes at cell * nb[1].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from deltarun.runner.ggml_util import ggml

_get = ggml.ggml_backend_tensor_get
_set = ggml.ggml_backend_tensor_set


@dataclass(frozen=True)
class RecurrentState:
    """The live recurrent state of a sequence after `n_past` tokens (host bytes per layer)."""

    n_past: int
    conv: dict[int, np.ndarray]
    ssm: dict[int, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.conv.values()) + sum(a.nbytes for a in self.ssm.values())


@dataclass(frozen=True)
class KVRows:
    """The KV rows of positions 0..n-1 of a sequence, per attention layer: (K rows, V channels x n)."""

    n: int
    rows: dict[int, tuple[np.ndarray, np.ndarray]]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.rows.values())


def _read(t: Any, offset: int, size: int) -> np.ndarray:
    buf = np.empty(size, dtype=np.uint8)
    if size:
        _get(t, buf.ctypes.data, offset, size)
    return buf


def _write(t: Any, data: np.ndarray, offset: int) -> None:
    if data.nbytes:
        data = np.ascontiguousarray(data)
        _set(t, data.ctypes.data, offset, data.nbytes)


def read_recurrent(model: Any, seq: int) -> RecurrentState:
    """Host copy of the live recurrent state of `seq`."""
    mem = model.memory
    conv, ssm = {}, {}
    for il in mem.conv:
        row = mem.conv[il].contents.nb[1]
        conv[il] = _read(mem.conv[il], seq * row, row)
        cell = mem.ssm[il].contents.nb[1]
        ssm[il] = _read(mem.ssm[il], seq * cell, cell)
    return RecurrentState(mem.seqs[seq].n_past, conv, ssm)


def write_recurrent(model: Any, seq: int, state: RecurrentState) -> None:
    """Make `state` the live recurrent state of `seq` (any cell of the same model)."""
    mem = model.memory
    for il in mem.conv:
        _write(mem.conv[il], state.conv[il], seq * mem.conv[il].contents.nb[1])
        _write(mem.ssm[il], state.ssm[il], seq * mem.ssm[il].contents.nb[1])


def read_kv(model: Any, seq: int, n: int) -> KVRows:
    """Host copy of the KV rows of positions 0..n-1 of `seq`."""
    mem = model.memory
    rows = {}
    for il in mem.k:
        k, v = mem.k[il], mem.v[il]
        k_row = k.contents.nb[1]
        k_part = _read(k, seq * mem.n_ctx * k_row, n * k_row)
        v_row = v.contents.nb[1]                   # one channel: n_ctx positions
        width = int(v.contents.ne[1]) // mem.n_cells
        block = _read(v, seq * width * v_row, width * v_row).reshape(width, v_row)
        elem = v_row // mem.n_ctx
        rows[il] = (k_part, block[:, :n * elem].copy())
    return KVRows(n, rows)


def write_kv(model: Any, seq: int, kv: KVRows, n: int | None = None) -> None:
    """Write the first n (default all) saved positions of `kv` into cell `seq`."""
    n = kv.n if n is None else n
    if n > kv.n:
        raise ValueError(f"only {kv.n} positions saved, {n} asked")
    mem = model.memory
    for il, (k_part, v_part) in kv.rows.items():
        k, v = mem.k[il], mem.v[il]
        k_row = k.contents.nb[1]
        _write(k, k_part[:n * k_row], seq * mem.n_ctx * k_row)
        v_row = v.contents.nb[1]
        width = int(v.contents.ne[1]) // mem.n_cells
        elem = v_row // mem.n_ctx
        for ch in range(width):                    # the first n positions of each channel's row
            _write(v, v_part[ch, :n * elem], (seq * width + ch) * v_row)


def set_tokens(model: Any, seq: int, tokens: list[int]) -> None:
    """Set the bookkeeping of `seq` to hold `tokens` (its state must already match them).

    Nothing can be rolled back afterwards, and `Model` checkpoints of the cell taken before become
    stale when the sequence got shorter than them.
    """
    st = model.memory.seqs[seq]
    st.n_past, st.tokens, st.last_ubatch, st.rolled_back = len(tokens), list(tokens), 0, 0
    log = getattr(model, "_truncations", None)
    if log is not None:
        log.append((seq, len(tokens)))


def clear_seq(model: Any, seq: int) -> None:
    """Forget sequence `seq` only: zero recurrent state (every slot) and no tokens."""
    mem = model.memory
    for il in mem.conv:
        row = mem.conv[il].contents.nb[1]
        _write(mem.conv[il], np.zeros(row, dtype=np.uint8), seq * row)
        ssm = mem.ssm[il]
        cell, slot = ssm.contents.nb[1], ssm.contents.nb[2]
        zeros = np.zeros(cell, dtype=np.uint8)
        for r in range(mem.rs_slots):
            _write(ssm, zeros, r * slot + seq * cell)
    set_tokens(model, seq, [])
