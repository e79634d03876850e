"""A loaded model you can feed tokens to: the Python API under every command.

`Model` ties together the GGUF file, the architecture's graph builder, the weights in backend
buffers, the memory, and a cache of built graphs (one per ubatch shape). `eval` splits tokens
into ubatches, fills the graph inputs and computes; per-step Python work is setting a few input
tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from deltarun.graphs import graph_builder_for
from deltarun.graphs.qwen3next import DELTA_NET_MODES, UbatchShape
from deltarun.runner import layer_split
from deltarun.runner.backend import Backend, Scheduler, init_backend
from deltarun.runner.errors import ContextFullError, DeltarunError, RollbackError
from deltarun.runner.gguf_file import GGUFFile
from deltarun.runner.ggml_util import ggml, new_context, numpy_to_tensor, tensor_to_numpy
from deltarun.runner.memory import Memory
from deltarun.runner.weights import Weights

KV_PAD = 256  # attention sees n_kv rounded up to this, so decode graphs are reused for 256 steps
NEG_INF = -np.inf

# The raw ctypes functions (ggml-python binds them without a Python wrapper): the per-step input
# and output copies call them directly with precomputed host addresses.
_tensor_set = ggml.ggml_backend_tensor_set
_tensor_get = ggml.ggml_backend_tensor_get
_NP_OF_GGML = {ggml.GGML_TYPE_F32: np.float32, ggml.GGML_TYPE_I32: np.int32, ggml.GGML_TYPE_I64: np.int64}


class _InputPlan:
    """Host-side buffers for the inputs one allocated graph reads, filled in place on every step.

    Made on the first step after the graph was allocated: only then is it known which inputs the
    graph really reads (unused ones get no memory and are skipped). Inputs that depend on the
    shape only (state cells, rollback-slot order, output rows) are computed once here; they are
    still copied to the backend every step, because the allocator reuses input memory for later
    nodes. Each step then costs a few numpy writes into preallocated arrays and one
    ggml_backend_tensor_set per input, whatever the number of layers.
    """

    __slots__ = ("bufs", "const", "v_row_starts")

    def __init__(self, io: dict[str, Any], shape: UbatchShape, n_ctx: int):
        #: name -> (tensor, host array, its address, nbytes), for every used input
        self.bufs: dict[str, tuple[Any, np.ndarray, int, int]] = {}
        for name, t in io.items():
            c = t.contents
            if not (c.flags & ggml.GGML_TENSOR_FLAG_INPUT) or not c.buffer:
                continue
            nd = int(ggml.ggml_n_dims(t))
            arr = np.zeros(tuple(reversed([int(c.ne[i]) for i in range(nd)])), dtype=_NP_OF_GGML[c.type])
            if arr.nbytes != int(ggml.ggml_nbytes(t)):
                raise AssertionError(f"graph input {name} is not a contiguous tensor")
            self.bufs[name] = (t, arr, arr.ctypes.data, arr.nbytes)
        n, n_seqs = shape.n_seq_tokens, shape.n_seqs
        per_seq = shape.n_outputs // n_seqs
        fixed = {
            "rs_s_copy": np.arange(shape.seq_head, shape.seq_head + n_seqs, dtype=np.int32),
            "inp_out_ids": (np.arange(n_seqs)[:, None] * n + np.arange(n - per_seq, n)[None, :]).astype(np.int32),
        }
        if "rs_s_slot_rev" in self.bufs:
            kw = self.bufs["rs_s_slot_rev"][1].size
            fixed["rs_s_slot_rev"] = np.arange(kw - 1, -1, -1, dtype=np.int32)
        #: where the cache row of each (sequence, V channel) starts, [n_seqs, 1, width]: V is stored
        #: transposed, so a V element's row index is this plus the token's position
        self.v_row_starts: np.ndarray | None = None
        if "v_idxs" in self.bufs:
            width = self.bufs["v_idxs"][1].size // (n * n_seqs)
            seq_ids = np.arange(shape.seq_head, shape.seq_head + n_seqs)[:, None, None]
            self.v_row_starts = (seq_ids * width + np.arange(width)[None, None, :]) * n_ctx
        #: the used shape-only inputs, already filled: moved out of `bufs`
        self.const: dict[str, tuple[Any, np.ndarray, int, int]] = {}
        for name, values in fixed.items():
            if name in self.bufs:
                self.const[name] = self.bufs.pop(name)
                self.const[name][1].reshape(-1)[:] = values.reshape(-1)

    def array(self, name: str) -> np.ndarray | None:
        """The host array of input `name` to fill in place, or None when the graph does not read it."""
        e = self.bufs.get(name)
        return None if e is None else e[1]

    def send(self) -> None:
        """Copy every used input, the shape-only ones included, to the backend."""
        for t, _, addr, size in self.bufs.values():
            _tensor_set(t, addr, 0, size)
        for t, _, addr, size in self.const.values():
            _tensor_set(t, addr, 0, size)


@dataclass
class _Graph:
    ctx: Any
    gf: Any
    io: dict[str, Any]
    inputs: _InputPlan | None = None    # made on the first step after allocation


@dataclass
class StateCheckpoint:
    """A sequence's length, tokens and live recurrent state (host copies), see `Model.checkpoint`."""

    seq: int
    n_past: int
    tokens: list[int]
    log_index: int
    conv: dict[int, np.ndarray]
    ssm: dict[int, np.ndarray]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.conv.values()) + sum(a.nbytes for a in self.ssm.values())


@dataclass
class EvalStats:
    """Counters a caller can report (tokens/s) or a test can check (incremental prefill)."""

    n_eval_tokens: int = 0
    n_eval_calls: int = 0
    eval_seconds: float = 0.0
    n_graph_builds: int = 0


class Model:
    """A Qwen3-Next (or other registered architecture) GGUF, ready to evaluate tokens."""

    def __init__(self, path: str | Path, *, backend: str = "cpu", n_ctx: int = 4096, n_batch: int = 512,
                 n_threads: int | None = None, rs_slots: int = 1, n_seq_max: int = 1, kv_type: str = "f16",
                 delta_net: str = "fused", mtp: bool = False, gpu_layers: int | None = None,
                 rpc: str | Sequence[str] | None = None, tensor_split: str | Sequence[float] | None = None):
        if delta_net not in DELTA_NET_MODES:
            raise DeltarunError(f"unknown delta-net mode {delta_net!r}; choose from {', '.join(DELTA_NET_MODES)}")
        if n_ctx <= 0 or n_batch <= 0 or rs_slots <= 0 or n_seq_max <= 0:
            raise DeltarunError("n_ctx, n_batch, rs_slots and n_seq_max must be positive")
        if n_batch < rs_slots:
            raise DeltarunError(f"--batch {n_batch} must be at least --rs-slots {rs_slots}")
        self.path = Path(path)
        self.file = GGUFFile(path)
        self.graph_builder = graph_builder_for(self.file)
        self.hp = self.graph_builder.hp
        self.tokenizer = self.file.tokenizer()
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.delta_net = delta_net
        local, endpoints, split = layer_split.resolve(backend, rpc, tensor_split)   # --rpc, --tensor-split
        self.backend: Backend = init_backend(local, n_threads)
        try:   # --gpu-layers, or the layers split over RPC servers and the local device
            self.placement = layer_split.placement(self.hp.n_layer, self.backend, gpu_layers, endpoints, split)
        except BaseException:
            self.backend.free()
            raise
        names = [n for n in self.graph_builder.tensor_names() if n in self.file.tensors]
        self.weights = Weights(self.file, names, self.backend, self.placement)
        if mtp and not self.hp.n_mtp:
            raise DeltarunError(f"{self.path}: the model has no MTP block (nextn_predict_layers is 0)")
        self.memory = Memory(self.hp, self.backend, n_ctx, n_seq_max, rs_slots, kv_type, mtp=mtp,
                             placement=self.placement)
        self.placement.on_loaded()
        n_ub = min(n_batch, n_ctx)
        largest = UbatchShape(n_seq_tokens=n_ub, n_seqs=1, n_outputs=n_ub, n_kv=n_ctx, delta_net=delta_net)
        self.sched = Scheduler(self.placement.sched_backends,   # [devices..., CPU] or [CPU]
                               graph_size=self.graph_builder.graph_size(largest))
        self._reserve_compute_buffers(largest)
        self._graphs: dict[UbatchShape, _Graph] = {}
        self.stats = EvalStats()
        self.last_hidden: np.ndarray | None = None   # [n_seqs, rows, n_embd] of the last ubatch
        self._truncations: list[tuple[int, int]] = []  # (seq, new length) each time a sequence got shorter

    # --- public API ---------------------------------------------------------------------------
    @property
    def rs_slots(self) -> int:
        """K, the rollback slots per sequence: up to K-1 tokens can be rolled back."""
        return self.memory.rs_slots

    def n_past(self, seq: int = 0) -> int:
        return self.memory.seqs[seq].n_past

    def tokens(self, seq: int = 0) -> list[int]:
        return list(self.memory.seqs[seq].tokens)

    def reset(self) -> None:
        """Forget every sequence (KV cache and recurrent state)."""
        self.memory.clear()
        self._truncations.extend((s, 0) for s in range(self.memory.n_cells))

    def checkpoint(self, seq: int = 0) -> StateCheckpoint:
        """Remember the live recurrent state of `seq` at its current length, on the host.

        A recurrent state cannot be rolled back further than its slots, so a chat keeps a
        checkpoint at the end of each prompt: when the next turn re-renders the previous answer
        differently, the model returns to the checkpoint instead of recomputing everything. The KV
        rows need no copy: rows before the checkpoint stay untouched unless the sequence is cut
        shorter than it, which `restore` detects.
        """
        mem = self.memory
        conv, ssm = {}, {}
        for il in self.hp.linear_layers:
            conv[il] = self._read_bytes(mem.conv[il], seq * mem.conv[il].contents.nb[1], mem.conv[il].contents.nb[1])
            ssm[il] = self._read_bytes(mem.ssm[il], seq * mem.ssm[il].contents.nb[1], mem.ssm[il].contents.nb[1])
        st = mem.seqs[seq]
        return StateCheckpoint(seq, st.n_past, list(st.tokens), len(self._truncations), conv, ssm)

    def can_restore(self, cp: StateCheckpoint) -> bool:
        """True while no rollback, restore or reset has cut the sequence below the checkpoint."""
        return all(not (s == cp.seq and n < cp.n_past) for s, n in self._truncations[cp.log_index:])

    def restore(self, cp: StateCheckpoint) -> None:
        """Return sequence cp.seq to the checkpoint (its length, tokens and recurrent state)."""
        if not self.can_restore(cp):
            raise RollbackError("the checkpoint is stale: the sequence was cut below it since it was taken")
        mem = self.memory
        for il in self.hp.linear_layers:
            ggml.ggml_backend_tensor_set(mem.conv[il], cp.conv[il].ctypes.data,
                                         cp.seq * mem.conv[il].contents.nb[1], cp.conv[il].nbytes)
            ggml.ggml_backend_tensor_set(mem.ssm[il], cp.ssm[il].ctypes.data,
                                         cp.seq * mem.ssm[il].contents.nb[1], cp.ssm[il].nbytes)
        st = mem.seqs[cp.seq]
        st.n_past, st.tokens, st.last_ubatch, st.rolled_back = cp.n_past, list(cp.tokens), 0, 0
        self._truncations.append((cp.seq, cp.n_past))

    @staticmethod
    def _read_bytes(t: Any, offset: int, size: int) -> np.ndarray:
        buf = np.empty(size, dtype=np.uint8)
        ggml.ggml_backend_tensor_get(t, buf.ctypes.data, offset, size)
        return buf

    def eval(self, tokens: Iterable[int], seq: int = 0, all_logits: bool = False) -> np.ndarray:
        """Evaluate tokens appended to sequence `seq`; logits of the last token [vocab], or of every
        token [n, vocab]."""
        toks = [int(t) for t in tokens]
        self._check_tokens(toks, seq)
        outs, hiddens = [], []
        done = 0
        for size in self.split_ubatches(len(toks)):
            last = done + size == len(toks)
            logits = self._eval_ubatch([toks[done:done + size]], seq, all_logits)[0]
            done += size
            if all_logits or last:
                outs.append(logits)
                hiddens.append(self.last_hidden[0])
        if all_logits and len(hiddens) > 1:   # hidden states of every token, across ubatches
            self.last_hidden = np.concatenate(hiddens, axis=0)[None]
        return np.concatenate(outs, axis=0) if all_logits else outs[-1][-1]

    def split_ubatches(self, n: int) -> list[int]:
        """Sizes of the ubatches for n tokens of one sequence."""
        return self._split(n, self.n_batch)

    def _split(self, n: int, limit: int) -> list[int]:
        """At most `limit` tokens per ubatch, with the last K tokens of the sequence together.

        Keeping the final min(n, K) tokens in one ubatch means every rollback slot of the sequence
        is written by the last ubatch (the rollback-slot design relies on it).
        """
        sizes = []
        left = n
        while left > 0:
            take = min(limit, left)
            sizes.append(take)
            left -= take
        keep = min(n, self.memory.rs_slots)
        if len(sizes) > 1 and sizes[-1] < keep:
            moved = keep - sizes[-1]
            sizes[-2] -= moved
            sizes[-1] += moved
        return sizes

    def rollback(self, n_tokens: int, seq: int = 0) -> None:
        """Drop the last n_tokens of a sequence: the KV rows are forgotten (masked, then
        overwritten) and the recurrent state is restored from slot r.

        After a ubatch of m tokens slot r holds the state r tokens back for r <= min(m, K-1)
        (slot m, when m < K, is the state the ubatch started from), so at most min(m, K-1)
        tokens can be undone in total. Restoring copies slot r into slot 0: the graph always reads
        the live state from slot 0.
        """
        state = self.memory.seqs[seq]
        if n_tokens == 0:
            return
        limit = min(state.last_ubatch, self.rs_slots - 1) - state.rolled_back
        if not 0 < n_tokens <= limit:
            raise RollbackError(
                f"cannot roll back {n_tokens} tokens: the recurrent state keeps {self.rs_slots} rollback "
                f"slots and the last ubatch had {state.last_ubatch} tokens, so {max(limit, 0)} can be undone")
        self._restore_slot(n_tokens + state.rolled_back, seq)
        state.rolled_back += n_tokens
        state.n_past -= n_tokens
        del state.tokens[len(state.tokens) - n_tokens:]
        self._truncations.append((seq, state.n_past))

    def copy_seq(self, src: int, dst: int) -> None:
        """Make sequence dst a copy of src (KV rows, live recurrent state, bookkeeping).

        A draft model drafts on a copy, so its committed sequence never needs a rollback.
        """
        mem, hp = self.memory, self.hp
        n = mem.seqs[src].n_past
        for il in list(mem.k):
            # each sequence owns one contiguous block of either cache: K's first n rows are its
            # cells; V (transposed) holds the cells in every row of its block, so all of it is copied
            for cache in (mem.k[il], mem.v[il]):
                block = int(ggml.ggml_nbytes(cache)) // mem.n_cells
                size = n * cache.contents.nb[1] if cache is mem.k[il] else block
                buf = np.empty(size, dtype=np.uint8)
                if n:
                    ggml.ggml_backend_tensor_get(cache, buf.ctypes.data, src * block, size)
                    ggml.ggml_backend_tensor_set(cache, buf.ctypes.data, dst * block, size)
        for il in hp.linear_layers:
            conv = mem.conv[il]
            row = conv.contents.nb[1]
            buf = np.empty(row, dtype=np.uint8)
            ggml.ggml_backend_tensor_get(conv, buf.ctypes.data, src * row, row)
            ggml.ggml_backend_tensor_set(conv, buf.ctypes.data, dst * row, row)
            ssm = mem.ssm[il]
            cell = ssm.contents.nb[1]
            buf = np.empty(cell, dtype=np.uint8)
            ggml.ggml_backend_tensor_get(ssm, buf.ctypes.data, src * cell, cell)
            ggml.ggml_backend_tensor_set(ssm, buf.ctypes.data, dst * cell, cell)
        s, d = mem.seqs[src], mem.seqs[dst]
        d.n_past, d.tokens, d.last_ubatch, d.rolled_back = s.n_past, list(s.tokens), 0, 0
        self._truncations.append((dst, 0))

    def mtp_eval(self, tokens: list[int], hidden: np.ndarray, start: int, seq: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Run the MTP block on rows (token i, hidden i) at positions start..; returns logits [n, vocab]
        and the block's output hidden states [n, n_embd] (fed back to chain further drafts)."""
        if not self.memory.mtp_layers:
            raise DeltarunError("the model was not opened with its MTP block (mtp=True)")
        n = len(tokens)
        if start + n > self.n_ctx:
            raise ContextFullError(f"context full: MTP rows up to position {start + n} exceed {self.n_ctx}")
        n_kv = min(self.n_ctx, -(-(start + n) // KV_PAD) * KV_PAD)
        shape = UbatchShape(n_seq_tokens=n, n_seqs=1, n_outputs=n, n_kv=n_kv, seq_head=seq,
                            delta_net=self.delta_net, mtp=True)
        g = self._graph(shape)
        self.sched.allocate(g.gf, g.ctx)
        plan = self._input_plan(g, shape)
        for name, values in (("mtp_tokens", tokens), ("mtp_hidden", hidden)):
            arr = plan.array(name)
            if arr is not None:
                arr.reshape(-1)[:] = np.asarray(values).reshape(-1)
        self._fill_positions(plan, np.arange(start, start + n, dtype=np.int32)[None, :], shape)
        plan.send()
        self.sched.compute(g.gf)
        logits = tensor_to_numpy(g.io["result_output"]).reshape(n, self.hp.n_vocab)
        out = tensor_to_numpy(g.io["mtp_out"]).reshape(n, self.hp.n_embd)
        return logits, out

    def logits_for(self, tokens: list[int]) -> np.ndarray:
        """Logits of every token of a fresh sequence (resets the model); handy for tests and perplexity."""
        self.reset()
        return self.eval(tokens, all_logits=True)

    def close(self) -> None:
        for g in self._graphs.values():
            ggml.ggml_free(g.ctx)
        self._graphs.clear()
        self.sched.free()
        self.memory.free()
        self.weights.free()
        self.placement.free()
        self.backend.free()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ----------------------------------------------------------------------------
    def _restore_slot(self, r: int, seq: int) -> None:
        """Make slot r the live state of `seq`: copy slot r into slot 0 for every linear layer.

        Slots 1..r keep their contents; the graph always reads slot 0, so after this the next
        ubatch continues from the state r tokens back.
        """
        hp, mem = self.hp, self.memory
        K = mem.rs_slots
        for il in hp.linear_layers:
            conv = tensor_to_numpy(mem.conv[il]).reshape(mem.n_cells, -1)
            row = conv[seq].reshape(hp.conv_dim, K, hp.ssm_d_conv - 1)
            row[:, 0, :] = row[:, r, :]
            numpy_to_tensor(mem.conv[il], row.reshape(-1), offset=seq * row.nbytes)
            D = hp.ssm_state_size
            cell = np.empty(D, dtype=np.float32)
            ssm = mem.ssm[il]
            slot_stride, cell_stride = ssm.contents.nb[2], ssm.contents.nb[1]
            ggml.ggml_backend_tensor_get(ssm, cell.ctypes.data, r * slot_stride + seq * cell_stride, cell.nbytes)
            ggml.ggml_backend_tensor_set(ssm, cell.ctypes.data, seq * cell_stride, cell.nbytes)

    def _reserve_compute_buffers(self, largest: UbatchShape) -> None:
        """Size the compute buffers for the largest ubatch now, as llama.cpp does at context creation:
        the memory a session needs is known (and refused) up front, and no later graph reallocates
        the buffers mid-generation. The worst-case graph is built only for this and dropped."""
        size = self.graph_builder.graph_size(largest)
        ctx = new_context(2 * size)
        try:
            gf = ggml.ggml_new_graph_custom(ctx, size, False)
            self.graph_builder.build(ctx, gf, self.weights.tensors, self.memory, largest)
            self.sched.reserve(gf)
        finally:
            ggml.ggml_free(ctx)

    def _graph(self, shape: UbatchShape) -> _Graph:
        g = self._graphs.get(shape)
        if g is None:
            size = self.graph_builder.graph_size(shape)
            ctx = new_context(2 * size)
            gf = ggml.ggml_new_graph_custom(ctx, size, False)
            io = self.graph_builder.build(ctx, gf, self.weights.tensors, self.memory, shape)
            g = _Graph(ctx, gf, io)
            self._graphs[shape] = g
            self.stats.n_graph_builds += 1
        return g

    def eval_batch(self, batch: dict[int, list[int]], all_logits: bool = False) -> dict[int, np.ndarray]:
        """Evaluate several sequences at once: equal-length token lists for consecutive sequence ids
        share ubatches (one graph with n_seqs > 1); other batches are evaluated sequence by sequence."""
        seqs = sorted(batch)
        lengths = {len(batch[s]) for s in seqs}
        consecutive = seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        if len(seqs) == 1 or len(lengths) != 1 or not consecutive:
            return {s: self.eval(batch[s], s, all_logits) for s in seqs}
        n = lengths.pop()
        for s in seqs:
            self._check_tokens(batch[s], s)
        per_ubatch = max(self.memory.rs_slots, self.n_batch // len(seqs))
        outs: dict[int, list[np.ndarray]] = {s: [] for s in seqs}
        done = 0
        for size in self._split(n, per_ubatch):
            chunk = [batch[s][done:done + size] for s in seqs]
            done += size
            last = done == n
            logits = self._eval_ubatch(chunk, seqs[0], all_logits)
            if all_logits or last:
                for i, s in enumerate(seqs):
                    outs[s].append(logits[i])
        return {s: (np.concatenate(outs[s]) if all_logits else outs[s][-1][-1]) for s in seqs}

    def _check_tokens(self, toks: list[int], seq: int) -> None:
        if not toks:
            raise DeltarunError("no tokens to evaluate")
        if not 0 <= seq < self.memory.n_cells:
            raise DeltarunError(f"sequence {seq} out of range (the model was opened for {self.memory.n_cells})")
        bad = [t for t in toks if not 0 <= int(t) < self.hp.n_vocab]
        if bad:
            raise DeltarunError(f"token id {bad[0]} is outside the vocabulary (0..{self.hp.n_vocab - 1})")
        state = self.memory.seqs[seq]
        if state.n_past + len(toks) > self.n_ctx:
            raise ContextFullError(
                f"context full: {state.n_past} tokens + {len(toks)} new exceed the context size {self.n_ctx}")

    def _eval_ubatch(self, tokens: list[list[int]], seq_head: int, want_all: bool) -> np.ndarray:
        """One ubatch of equal-length token lists for sequences seq_head.. ; logits [n_seqs, rows, vocab]."""
        t0 = time.perf_counter()
        n_seqs, n = len(tokens), len(tokens[0])
        seqs = [self.memory.seqs[seq_head + i] for i in range(n_seqs)]
        starts = [st.n_past for st in seqs]
        n_kv = min(self.n_ctx, -(-(max(starts) + n) // KV_PAD) * KV_PAD)
        n_out = n if want_all else 1
        shape = UbatchShape(n_seq_tokens=n, n_seqs=n_seqs, n_outputs=n_out * n_seqs, n_kv=n_kv,
                            seq_head=seq_head, delta_net=self.delta_net)
        g = self._graph(shape)
        self.sched.allocate(g.gf, g.ctx)
        self._set_inputs(g, tokens, starts, shape)
        self.sched.compute(g.gf)
        logits = np.empty((n_seqs, n_out, self.hp.n_vocab), dtype=np.float32)   # F32 outputs, read whole
        _tensor_get(g.io["result_output"], logits.ctypes.data, 0, logits.nbytes)
        hidden = np.empty((n_seqs, n_out, self.hp.n_embd), dtype=np.float32)
        _tensor_get(g.io["result_norm"], hidden.ctypes.data, 0, hidden.nbytes)
        self.last_hidden = hidden
        for st, toks in zip(seqs, tokens):
            st.n_past += n
            st.tokens.extend(toks)
            st.last_ubatch = n
            st.rolled_back = 0
        self.stats.n_eval_tokens += n * n_seqs
        self.stats.n_eval_calls += 1
        self.stats.eval_seconds += time.perf_counter() - t0
        return logits

    def _input_plan(self, g: _Graph, shape: UbatchShape) -> _InputPlan:
        """The input plan of allocated graph `g`, made on its first step."""
        if g.inputs is None:
            g.inputs = _InputPlan(g.io, shape, self.n_ctx)
        return g.inputs

    def _fill_positions(self, plan: _InputPlan, pos: np.ndarray, shape: UbatchShape) -> None:
        """Positions, causal mask and KV rows for positions `pos` [n_seqs, n] of sequences seq_head.."""
        n, n_seqs = shape.n_seq_tokens, shape.n_seqs
        arr = plan.array("inp_pos")
        if arr is not None:
            arr.reshape(-1)[:] = pos.reshape(-1)
        arr = plan.array("kq_mask")
        if arr is not None:
            mask = arr.reshape(n_seqs, n, shape.n_kv)
            if n * n_seqs == 1:        # decode: one row, 0 up to the position, -inf after
                mask.fill(NEG_INF)
                mask[0, 0, :int(pos[0, 0]) + 1] = 0.0
            else:
                cols = np.arange(shape.n_kv)[None, None, :]
                mask[...] = np.where(cols <= pos[:, :, None], 0.0, NEG_INF)
        arr = plan.array("kv_idxs")
        if arr is not None:                # K row of (sequence, position)
            if n * n_seqs == 1:
                arr[0] = shape.seq_head * self.n_ctx + int(pos[0, 0])
            else:
                seq_ids = np.arange(shape.seq_head, shape.seq_head + n_seqs)[:, None]
                arr.reshape(n_seqs, n)[...] = seq_ids * self.n_ctx + pos
        arr = plan.array("v_idxs")
        if arr is not None:                # V element (sequence, channel, position)
            np.add(plan.v_row_starts, pos[:, :, None], out=arr.reshape(n_seqs, n, -1))

    def _set_inputs(self, g: _Graph, tokens: list[list[int]], starts: list[int], shape: UbatchShape) -> None:
        plan = self._input_plan(g, shape)
        n, n_seqs = shape.n_seq_tokens, shape.n_seqs
        arr = plan.array("inp_tokens")
        if n * n_seqs == 1:
            pos = np.array([[starts[0]]], dtype=np.int32)
            if arr is not None:
                arr[0] = tokens[0][0]
        else:
            pos = np.asarray(starts, dtype=np.int32)[:, None] + np.arange(n, dtype=np.int32)[None, :]
            if arr is not None:
                arr.reshape(n_seqs, n)[...] = tokens
        self._fill_positions(plan, pos, shape)
        plan.send()
