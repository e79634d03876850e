"""A loaded model you can feed tokens to: the Python API under every command.

`Model` ties together the GGUF file, the architecture's graph builder, the weights in backend
buffers, the memory, and a cache of built graphs (one per ubatch shape, the MAX_GRAPHS most
recently used). `eval` splits tokens into ubatches, fills the graph inputs and computes; per-step
Python work is setting a few input tensors.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from deltarun.base.errors import ContextFullError, DeltarunError
from deltarun.base.ggml_util import ggml, new_context, tensor_to_numpy
from deltarun.base.gguf_file import GGUFFile
from deltarun.base.interface import DELTA_NET_MODES, BuiltGraph, GraphFamily, Ride, UbatchData, UbatchShape
from deltarun.base.registry import graph_family_for
from deltarun.runner import layer_split
from deltarun.runner.backend import Backend, init_backend
from deltarun.runner.draft_vocab import resolve_draft_vocab
from deltarun.runner.memory import Checkpoint, Memory, RecurrentState, check_memory_shape
from deltarun.runner.repack import RepackMode
from deltarun.runner.scheduler import Scheduler
from deltarun.runner.weights import Weights

KV_PAD = 256  # attention sees n_kv rounded up to this, so decode graphs are reused for 256 steps

#: Graphs kept built, least recently used out. A shape's graph stays until MAX_GRAPHS others
#: were used after it: a server sees a new prompt length (and cell run, KV window) in most
#: requests, and each kept graph holds its context (0.46 MiB for the built-in model, 2.7 MiB for
#: the 48-layer tiny preset), so keeping every one grew a long-running server's memory without
#: bound; the shapes a server decodes with are used every step and stay.
MAX_GRAPHS = 64
#: images whose embedding rows a model with an MTP block keeps for the MTP rows over them
#: (`Model.mtp_eval`): those rows are committed right after the image's evaluation (a server's
#: prompt chunk, chat's prompt) or with the next draft, so a few suffice whatever the number of
#: parallel sequences; each image holds its tokens x n_embd floats
MTP_IMAGES = 8


def padded_n_kv(n_tokens: int, n_ctx: int) -> int:
    """KV rows a ubatch's attention reads when its sequence reaches n_tokens: rounded up to KV_PAD."""
    return min(n_ctx, -(-n_tokens // KV_PAD) * KV_PAD)

# The raw ctypes functions (ggml-python binds them without a Python wrapper): the per-step input
# and output copies call them directly with precomputed host addresses.
_tensor_set = ggml.ggml_backend_tensor_set
_tensor_get = ggml.ggml_backend_tensor_get


class _InputPlan:
    """The inputs one allocated graph reads, bound to host buffers that are filled in place per step.

    Made on the first step after the graph was allocated: only then is it known which input
    tensors the graph really reads (see `GraphInput.bind`). Each step then costs the used inputs'
    `set_input` (a few numpy writes into preallocated arrays; shape-only inputs were filled once)
    and one ggml_backend_tensor_set per used tensor, whatever the number of layers.
    """

    __slots__ = ("fill", "ride_fill", "transfers")

    def __init__(self, built: BuiltGraph, shape: UbatchShape):
        #: (tensor, host address, nbytes) of every used input tensor, the shape-only ones included:
        #: they are copied every step because the allocator reuses input memory for later nodes
        self.transfers: list[tuple[Any, int, int]] = []
        #: set_input of the used inputs that change per step
        self.fill: list[Any] = []
        for inp in built.inputs:
            self.transfers.extend(inp.bind(shape))
            if inp.used and not inp.constant:
                self.fill.append(inp.set_input)
        #: those of a riding chunk's inputs (`UbatchShape.ride`), filled from `UbatchData.ride`
        self.ride_fill: list[Any] = []
        for inp in built.ride_inputs:
            self.transfers.extend(inp.bind(shape.ride_shape()))
            if inp.used and not inp.constant:
                self.ride_fill.append(inp.set_input)

    def set(self, data: UbatchData) -> None:
        """Fill every input from this step's values and copy them all to the backend."""
        for fill in self.fill:
            fill(data)
        for fill in self.ride_fill:
            fill(data.ride)
        for t, addr, size in self.transfers:
            _tensor_set(t, addr, 0, size)


@dataclass
class _Graph:
    ctx: Any
    gf: Any
    built: BuiltGraph
    inputs: _InputPlan | None = None    # made on the first step after allocation

    @property
    def outputs(self) -> dict[str, Any]:
        return self.built.outputs

    @property
    def io(self) -> dict[str, Any]:
        """Every input and output tensor by name (graph dumps, tests)."""
        return self.built.tensors


@dataclass(frozen=True)
class PromptChunk:
    """A prompt chunk of sequence `seq` to evaluate along a decode step (`Model.eval_batch(...,
    ride=...)`, `Engine.step(..., ride=...)`): the prompt goes on after it, or, with `logits`, it
    ends there and its last row's logits are wanted (`Model.last_ride_logits`)."""

    seq: int
    tokens: list[int]
    logits: bool = False
    hidden: bool = False     # every row's hidden state too (`Model.last_ride_hidden`: an MTP block reads them)
    #: states to keep inside it, as `eval(..., captures=...)` keeps them (`Model.last_ride_captures`):
    #: a prompt's message boundaries, checkpointed without ending the chunk there
    captures: tuple[int, ...] = ()


@dataclass
class MtpRows:
    """The MTP block's rows computed in the last trunk evaluation (`eval(..., mtp_argmax=True)`):
    for each row i of the ubatch (position start + i) the argmax token of its trunk logits, and
    the MTP block's logits and output for (that token, the row's hidden state)."""

    seq: int
    start: int
    tokens: list[int]        # argmax of each row's trunk logits
    logits: np.ndarray       # [n, vocab]
    out: np.ndarray          # [n, n_embd] before the MTP block's final norm


@dataclass(frozen=True)
class ImageSpan:
    """An image placed in a sequence: its `n` rows from cache position `start`, a merged grid of
    `rows` x `cols` tokens, and the rope position of its first token (`rope0`). Text after it
    continues at rope0 + max(rows, cols) (transformers' `get_rope_index`), so each image shifts
    the rope positions of what follows by max(rows, cols) - n."""

    start: int
    n: int
    rows: int
    cols: int
    rope0: int
    token: int               # what the sequence records for each of its rows (Model.eval_image)

    @property
    def shift(self) -> int:
        return max(self.rows, self.cols) - self.n

    def streams(self) -> np.ndarray:
        """[3, n] (temporal, height, width) rope positions of the image's tokens, row-major."""
        r, c = np.divmod(np.arange(self.n, dtype=np.int32), np.int32(self.cols))
        return np.stack([np.full(self.n, self.rope0, dtype=np.int32), self.rope0 + r, self.rope0 + c])


def image_token(digest: bytes | str) -> int:
    """The id a sequence's token list records for each row of the image with this digest: negative,
    so no vocabulary token is one, and different for different images (56 bits of the digest), so
    the token lists that chat and the prompt cache compare to resume a prompt tell images apart
    although their pad tokens are the same id (the cache is keyed on image content)."""
    raw = bytes.fromhex(digest) if isinstance(digest, str) else bytes(digest)
    return -1 - int.from_bytes(raw[:7], "little")


def image_spans(tokens: Sequence[int], grids: dict[int, tuple[int, int]]) -> list[ImageSpan]:
    """The whole images in a token list: runs of an image token (`grids` gives each one's merged
    grid), rope positions counted from the start as `Model.eval_image` gives them."""
    arr = np.asarray(tokens, dtype=np.int64)
    idx = np.flatnonzero(arr < 0)
    spans: list[ImageSpan] = []
    shift, i = 0, 0
    while i < idx.size:
        start = int(idx[i])
        tok = int(arr[start])
        rows, cols = grids.get(tok, (0, 0))
        n = rows * cols
        if n and start + n <= arr.size and bool(np.all(arr[start:start + n] == tok)):
            span = ImageSpan(start, n, rows, cols, start + shift, tok)
            spans.append(span)
            shift += span.shift
            i = int(np.searchsorted(idx, start + n))
        else:
            i += 1
    return spans


@dataclass
class EvalStats:
    """Counters a caller can report (tokens/s) or a test can check (incremental prefill)."""

    n_eval_tokens: int = 0
    n_eval_calls: int = 0
    eval_seconds: float = 0.0
    n_graph_builds: int = 0


class Model:
    """A Qwen3-Next (or other registered architecture) GGUF, ready to evaluate tokens."""

    def __init__(self, path: str | Path, *, backend: str = "cpu", n_ctx: int = 4096, n_ubatch: int = 512,
                 n_threads: int | None = None, rs_slots: int = 1, n_seq_max: int = 1, kv_type: str = "f16",
                 delta_net: str = "fused", mtp: bool = False, gpu_layers: int | None = None,
                 rpc: str | Sequence[str] | None = None, tensor_split: str | Sequence[float] | None = None,
                 capture_slots: int = 0, repack: RepackMode = True, pin_threads: bool | None = None,
                 draft_vocab: int | None = None, ssm_slots_in_place: bool = True):
        if delta_net not in DELTA_NET_MODES:
            raise DeltarunError(f"unknown delta-net mode {delta_net!r}; choose from {', '.join(DELTA_NET_MODES)}")
        if n_ubatch <= 0:
            raise DeltarunError(f"--ubatch must be positive (got {n_ubatch})")
        check_memory_shape(n_ctx, n_seq_max, rs_slots)
        if n_ubatch < rs_slots:
            raise DeltarunError(f"--ubatch {n_ubatch} must be at least --rs-slots {rs_slots}")
        if repack not in (True, False, "all"):
            raise DeltarunError(f"unknown repack mode {repack!r}; choose True, False or 'all'")
        self.path = Path(path)
        self.file = GGUFFile(path)
        self.family: GraphFamily = graph_family_for(self.file)
        self.hp = self.family.hp
        self.tokenizer = self.file.tokenizer()
        self.n_ctx = n_ctx
        self.n_ubatch = n_ubatch
        self.delta_net = delta_net
        local, endpoints, split = layer_split.resolve(backend, rpc, tensor_split)   # --rpc, --tensor-split
        self.backend: Backend = init_backend(local, n_threads, pin=pin_threads)
        try:   # --gpu-layers, or the layers split over RPC servers and the local device
            self.placement = layer_split.placement(self.hp.n_layer, self.backend, gpu_layers, endpoints, split)
        except BaseException:
            self.backend.free()
            raise
        if mtp and not self.hp.n_mtp:
            self.backend.free()
            raise DeltarunError(f"{self.path}: the model has no MTP block (nextn_predict_layers is 0)")
        names = [n for n in self.family.tensor_names() if n in self.file.tensors]
        # the MTP block's LM head over the first ids only (runner.draft_vocab); a view of its rows,
        # so that weight keeps the file's layout (not repacked)
        mtp_head = self.family.mtp_lm_head()
        self.draft_vocab = resolve_draft_vocab(draft_vocab, self.hp, self.file.tensors, mtp_head) if mtp else 0
        kept = self.family.gathered_weights() | ({mtp_head} if self.draft_vocab else set())
        # repack: on a CPU-only model, the matrices ggml's CPU_REPACK kernels take are laid out
        # for them at load (Q4_0 / IQ4_NL on x86; Q4_K too where ggml has no tiled K-quant product, or
        # with "all": see Weights)
        self.weights = Weights(self.file, names, self.backend, self.placement, repack=repack,
                               gathered=kept)
        # ssm_slots_in_place=False: the graph every backend builds (compare, the graph pin), where
        # the CPU's delta net would write its snapshots into the cache itself (Memory)
        self.memory = Memory(self.hp, self.backend, n_ctx, n_seq_max, rs_slots, kv_type, mtp=mtp,
                             placement=self.placement, n_capture=capture_slots, slots_in_place=ssm_slots_in_place)
        self.placement.on_loaded()
        n_ub = min(n_ubatch, n_ctx)
        spread = tuple(sorted({max(1, n_ub * (i + 1) // (capture_slots + 1)) for i in range(capture_slots)}
                              - {n_ub})) if self.hp.linear_layers else ()
        largest = UbatchShape(n_seq_tokens=n_ub, n_seqs=1, n_outputs=n_ub, n_kv=n_ctx, delta_net=delta_net,
                              captures=spread)
        self.sched = Scheduler(self.placement.sched_backends,   # [devices..., CPU] or [CPU]
                               graph_size=self.family.graph_size(largest))
        self._reserve_compute_buffers(largest)
        self._graphs: OrderedDict[UbatchShape, _Graph] = OrderedDict()   # least recently used first
        self._mtp_sched: Scheduler | None = None   # small MTP graphs (drafts), made on first use
        self._step_scheds: list[Scheduler] = []    # see keep_step_graphs (most recently used first)
        self.stats = EvalStats()
        self.last_hidden: np.ndarray | None = None   # [n_seqs, rows, n_embd] of the last ubatch
        #: the last row's logits of a prompt chunk that rode along with `logits` (`eval_batch`), and
        #: its rows' hidden states [n, n_embd] with `hidden`
        self.last_ride_logits: np.ndarray | None = None
        self.last_ride_hidden: np.ndarray | None = None
        self.last_ride_captures: dict[int, RecurrentState] = {}   # a riding chunk's captures: length -> state
        self.last_mtp: MtpRows | None = None         # the last ubatch's MTP rows, when it computed them
        self.last_captures: dict[int, RecurrentState] = {}   # eval(captures=...): length -> state
        #: the merged grid of each image token a sequence may hold (eval_image's `token`)
        self._image_grids: dict[int, tuple[int, int]] = {}
        #: per sequence, its images as of a length of `memory.truncations` (see `images`)
        self._images: dict[int, tuple[int, list[ImageSpan]]] = {}
        #: with an MTP block: the embedding rows of the images evaluated last (image token -> rows),
        #: which the MTP rows over an image take as their "next token" (`mtp_eval`)
        self._mtp_image_rows: OrderedDict[int, np.ndarray] = OrderedDict()

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
        self._images.clear()
        self._image_grids.clear()
        self._mtp_image_rows.clear()

    def checkpoint(self, seq: int = 0) -> Checkpoint:
        """Remember the live recurrent state of `seq` at its current length (see Memory.checkpoint)."""
        return self.memory.checkpoint(seq)

    def can_restore(self, cp: Checkpoint) -> bool:
        """True while no rollback, restore or reset has cut the sequence below the checkpoint."""
        return self.memory.can_restore(cp)

    def restore(self, cp: Checkpoint) -> None:
        """Return sequence cp.seq to the checkpoint (its length, tokens and recurrent state)."""
        self.memory.restore(cp)

    def eval(self, tokens: Iterable[int], seq: int = 0, all_logits: bool = False, mtp_argmax: bool = False,
             captures: Sequence[int] = (), all_hidden: bool = False, keep_start: bool = True,
             continued: bool = False) -> np.ndarray | None:
        """Evaluate tokens appended to sequence `seq`; logits of the last token [vocab], or of every
        token [n, vocab].

        Every ubatch but the last, and with `continued` (the caller evaluates more of the sequence
        next: a prompt chunk; returns None) the last too, runs without the LM head and writes no
        rollback slots (`UbatchShape.continued`); after a continued call nothing can be rolled back.

        `all_hidden`: `last_hidden` holds every token's hidden state (as with all_logits) while the
        LM head runs for the last token only (a prompt whose rows an MTP block reads: with a large
        vocabulary the LM head of every row would cost a fifth of the trunk).

        `captures` (0 < t < len(tokens), a model opened with capture_slots): also keep the recurrent
        state after the first t tokens, in `last_captures` by sequence length, without ending a
        graph evaluation there (at most capture_slots per ubatch; a server's checkpoints at the
        message boundaries inside a prompt).

        `mtp_argmax` (all_logits, one ubatch, a model opened with mtp=True): the same graph also
        runs the MTP block on every row's (argmax token, hidden state) and leaves them in
        `last_mtp` (a greedy speculative step's next draft without a separate evaluation).

        `keep_start=False`: an engine step that keeps at least its first token; the graph does not
        save the state it started from, so a rollback may undo all but that token
        (`UbatchShape.keep_start`).
        """
        toks = [int(t) for t in tokens]
        if continued and (all_logits or mtp_argmax):
            raise DeltarunError("a continued evaluation computes no logits (all_logits, mtp_argmax)")
        self._check_tokens(toks, seq)
        caps = self._capture_points(captures, len(toks))
        if caps and mtp_argmax:
            raise DeltarunError("captures and mtp_argmax do not go together")
        self.last_captures = {}
        start = self.memory.seqs[seq].n_past
        if mtp_argmax:
            if not self.memory.mtp_layers:
                raise DeltarunError("the model was not opened with its MTP block (mtp=True)")
            if not all_logits or len(toks) > self.n_ubatch:
                raise DeltarunError("mtp_argmax evaluates one ubatch with every row's logits (all_logits)")
            return self._eval_ubatch([toks], seq, True, mtp_argmax=True, keep_start=keep_start)[0]
        outs, hiddens = [], []
        done = 0
        sizes = self.split_ubatches(len(toks))
        bounds = np.cumsum([0] + sizes)
        most = max(sum(1 for t in caps if a < t < b) for a, b in zip(bounds, bounds[1:]))
        if most > self.memory.n_capture:
            raise DeltarunError(f"{most} capture points in one ubatch; the model has {self.memory.n_capture} "
                                f"capture slots")
        for size in sizes:
            last = done + size == len(toks)
            inner = tuple(t - done for t in caps if done < t < done + size)
            out = self._eval_ubatch([toks[done:done + size]], seq, all_logits, captures=inner,
                                    all_hidden=all_hidden and not all_logits, keep_start=keep_start,
                                    continued=not all_logits and (continued or not last))
            for i, t in enumerate(inner):
                self.last_captures[start + done + t] = self.memory.read_capture(i, start + done + t)
            done += size
            if done in caps:
                self.last_captures[start + done] = self.memory.read_recurrent(seq)
            if out is not None and (all_logits or last):
                outs.append(out[0])
            if all_logits or all_hidden or last:
                hiddens.append(self.last_hidden[0])
        if (all_logits or all_hidden) and len(hiddens) > 1:   # hidden states of every token, across ubatches
            self.last_hidden = np.concatenate(hiddens, axis=0)[None]
        if continued:
            return None
        return np.concatenate(outs, axis=0) if all_logits else outs[-1][-1]

    def eval_image(self, rows: np.ndarray, grid: tuple[int, int], pad_token: int, seq: int = 0, *,
                   token: int | None = None, skip: int = 0, all_hidden: bool = False) -> np.ndarray:
        """Evaluate an image's embedding rows [n, n_embd] (a merged grid of grid[0] x grid[1] tokens,
        row-major) appended to sequence `seq`, where the prompt has n `pad_token`s; logits of its last
        row. As `Qwen3_5Model.forward`: the rows replace the pad tokens' embeddings, the image's
        tokens take the rope streams (p, p + row, p + col) from the next text position p, and the
        text after it continues at p + max(rows, cols); KV cells and the causal mask stay in
        sequence order. The sequence records `token` for each row (default the pad token; callers that
        resume prompts by comparing token lists give an id that names the image, `image_token`, so a
        different image with the same pad tokens is never taken for this one). `skip`: the first rows
        are already held (the sequence was resumed inside the image). `all_hidden`: `last_hidden`
        holds the hidden state of every row evaluated (an MTP block's KV rows read them). With an
        MTP block the rows are kept (the last MTP_IMAGES images') for the MTP rows over the image."""
        rows = np.ascontiguousarray(rows, dtype=np.float32)
        n = int(grid[0]) * int(grid[1])
        if rows.ndim != 2 or rows.shape != (n, self.hp.n_embd):
            raise DeltarunError(f"image rows of shape {rows.shape} for a {grid[0]} x {grid[1]} grid of "
                                f"{self.hp.n_embd}-wide tokens")
        if not self.hp.rope_sections:
            raise DeltarunError(f"{self.path}: images need a model with multi-section rope (qwen35, qwen35moe)")
        if not 0 <= pad_token < self.hp.n_vocab:
            raise DeltarunError(f"image pad token {pad_token} is outside the vocabulary")
        recorded = int(image_token(hashlib.blake2b(rows.tobytes(), digest_size=8).digest()) if token is None
                       else token)
        if recorded >= 0 or self._image_grids.get(recorded, (int(grid[0]), int(grid[1]))) != (grid[0], grid[1]):
            raise DeltarunError(f"image token {recorded} is not negative or names an image of another grid")
        held = self.memory.seqs[seq].tokens if 0 <= seq < self.memory.n_seq_max else []
        if not 0 <= skip < n or (skip and held[len(held) - skip:] != [recorded] * skip):
            raise DeltarunError(f"cannot resume image evaluation after {skip} of its {n} rows: the sequence "
                                f"does not end with them")
        self._check_tokens([pad_token] * (n - skip), seq)
        start = self.n_past(seq) - skip
        self._image_grids[recorded] = (int(grid[0]), int(grid[1]))
        span = ImageSpan(start, n, int(grid[0]), int(grid[1]), start + self._rope_shift(seq), recorded)
        streams = span.streams()
        if self.memory.mtp_layers:
            self._mtp_image_rows[recorded] = rows
            self._mtp_image_rows.move_to_end(recorded)
            while len(self._mtp_image_rows) > MTP_IMAGES:
                self._mtp_image_rows.popitem(last=False)
        done, logits, hiddens = skip, None, []
        for size in self.split_ubatches(n - skip):
            chunk = slice(done, done + size)
            logits = self._eval_ubatch([[pad_token] * size], seq, False, embd=rows[chunk], rope=streams[:, chunk],
                                       all_hidden=all_hidden)
            self.memory.seqs[seq].tokens[-size:] = [recorded] * size
            if all_hidden:
                hiddens.append(self.last_hidden[0])
            done += size
        if len(hiddens) > 1:
            self.last_hidden = np.concatenate(hiddens)[None]
        self._images[seq] = (len(self.memory.truncations), self._images_now(seq)[1] + [span])
        return logits[0][-1]

    def images(self, seq: int = 0) -> list[ImageSpan]:
        """The images placed in sequence `seq` that it still holds whole."""
        return list(self._images_now(seq)[1])

    def _images_now(self, seq: int) -> tuple[int, list[ImageSpan]]:
        """The images of `seq`, found again in its tokens when its token list was replaced or cut
        since they were last listed (a checkpoint or host copy restored, a rollback, a copy):
        every replacement appends to `memory.truncations`, and only eval_image appends images."""
        log = len(self.memory.truncations)
        cached = self._images.get(seq)
        if cached is None or cached[0] != log:
            cached = (log, image_spans(self.memory.seqs[seq].tokens, self._image_grids) if self._image_grids else [])
            self._images[seq] = cached
        return cached

    def rope_streams(self, seq: int, start: int, n: int) -> np.ndarray | None:
        """The (temporal, height, width) rope positions [3, n] of positions start..start+n-1 of `seq`
        as its images place them (an image's rows its grid's streams, later text shifted; see
        `eval_image`), or None when `seq` holds no image (each position is its own rope position)."""
        spans = self._images_now(seq)[1] if self._image_grids else []
        if not spans:
            return None
        pos = np.arange(start, start + n, dtype=np.int32)
        text = pos + sum(np.where(pos >= s.start + s.n, s.shift, 0).astype(np.int32) for s in spans)
        out = np.repeat(text[None], 3, axis=0)
        for s in spans:
            inside = (pos >= s.start) & (pos < s.start + s.n)
            if inside.any():
                out[:, inside] = s.streams()[:, pos[inside] - s.start]
        return out

    def _rope_shift(self, seq: int) -> int:
        """How far the rope positions of new text in `seq` are from its cache positions."""
        return sum(s.shift for s in self._images_now(seq)[1]) if self._image_grids else 0

    def split_ubatches(self, n: int) -> list[int]:
        """Sizes of the ubatches for n tokens of one sequence."""
        return self._split(n, self.n_ubatch)

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
        """Drop the last n_tokens of a sequence (at most `Memory.rollback_limit`: K-1 within the last
        ubatch; see Memory.rollback)."""
        self.memory.rollback(n_tokens, seq)

    def copy_seq(self, src: int, dst: int) -> None:
        """Make sequence dst a copy of src (KV rows, live recurrent state, bookkeeping).

        A draft model drafts on a copy, so its committed sequence never needs a rollback.
        """
        self.memory.copy_seq(src, dst)

    def mtp_eval(self, tokens: list[int], hidden: np.ndarray, start: int, seq: int = 0,
                 n_outputs: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Run the MTP block on rows (token i, hidden i) at positions start..; returns logits
        [n_outputs, vocab] and the block's output hidden states [n_outputs, n_embd] (fed back to
        chain further drafts) of the last n_outputs rows (default: every row). Every row's K/V is
        written to the MTP block's cache either way; fewer outputs skip their LM-head columns.

        A token may be an image's (`image_token`: the row's next position is an image row, as
        `eval_image` recorded it): the block then takes that image row's embedding in place of a
        token's, as the trunk did (Qwen3.5's MTP reads the input embeddings of the next positions,
        images merged in), one ubatch per run of image rows; rows at or after an image take the
        rope positions the trunk gave them (`rope_streams`)."""
        if not self.memory.mtp_layers:
            raise DeltarunError("the model was not opened with its MTP block (mtp=True)")
        n = len(tokens)
        if start + n > self.n_ctx:
            raise ContextFullError(f"context full: MTP rows up to position {start + n} exceed {self.n_ctx}")
        n_out = n if n_outputs is None else n_outputs
        if not 1 <= n_out <= n:
            raise DeltarunError(f"n_outputs must be 1..{n} (got {n_out})")
        tokens = [int(t) for t in tokens]
        hidden = np.asarray(hidden)
        if min(tokens) >= 0:
            logits, out = self._mtp_ubatch([tokens], hidden[None], [start], seq, n_out)
            return logits[0], out[0]
        parts: list[tuple[np.ndarray, np.ndarray]] = []
        for a, b, embd in self._mtp_runs(tokens, seq, start):
            wanted = min(b, n) - max(a, n - n_out)            # of the last n_out rows, in this run
            logits, out = self._mtp_ubatch([tokens[a:b]], hidden[None, a:b], [start + a], seq, max(1, wanted),
                                           embd=embd)
            if wanted > 0:
                parts.append((logits[0], out[0]))
        return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])

    def _mtp_runs(self, tokens: list[int], seq: int, start: int) -> list[tuple[int, int, np.ndarray | None]]:
        """MTP rows (next tokens of positions start..) in runs (a, b, embedding rows or None): text
        tokens, or rows of one image (its kept embedding rows in their order)."""
        spans = self._images_now(seq)[1]
        runs: list[tuple[int, int, np.ndarray | None]] = []
        a = 0
        while a < len(tokens):
            t = tokens[a]
            b = a + 1
            while b < len(tokens) and (tokens[b] < 0) == (t < 0) and (t >= 0 or tokens[b] == t):
                b += 1
            if t < 0:                              # the image whose row follows (one image may recur)
                nxt = start + a + 1
                span = next((s for s in spans if s.token == t and s.start <= nxt < s.start + s.n), None)
                rows = self._mtp_image_rows.get(t)
                if span is None or rows is None:
                    raise DeltarunError("the MTP rows over an image need its embedding rows: evaluate the image "
                                        "again (the model keeps the last few images' rows)")
                first = start + a + 1 - span.start            # the image row at the next position
                if not 0 <= first <= span.n - (b - a):
                    raise DeltarunError(f"MTP rows {start + a}..{start + b} do not precede rows of their image")
                runs.append((a, b, rows[first:first + b - a]))
            else:
                runs.append((a, b, None))
            a = b
        return runs

    def mtp_eval_rows(self, rows: list[tuple[list[int], np.ndarray, int]],
                      seq_head: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The MTP block on the rows of consecutive sequences seq_head.. in one ubatch: rows[i] =
        (tokens, hidden rows, first position) of sequence seq_head + i. Returns each sequence's
        logits [vocab] and output hidden state [1, n_embd] of its last row.

        Shorter row lists are padded with copies of their last row at the positions after it: those
        K/V rows lie past what the sequence has committed, masked from every query until the rows of
        those positions are written (as a rollback leaves them). The LM head runs for each
        sequence's last real row only (`UbatchData.out_rows`)."""
        if not self.memory.mtp_layers:
            raise DeltarunError("the model was not opened with its MTP block (mtp=True)")
        if any(min(t) < 0 for t, _, _ in rows if len(t)):     # rows over an image: per sequence
            out = []
            for i, (toks, hid, start) in enumerate(rows):
                logits, last = self.mtp_eval(list(toks), hid, start, seq_head + i, n_outputs=1)
                out.append((logits[0], last))
            return out
        lengths = [len(t) for t, _, _ in rows]
        n = max(lengths)
        if min(lengths) < 1 or any(start + n > self.n_ctx for _, _, start in rows):
            raise ContextFullError(f"MTP rows of {n} tokens exceed the context size {self.n_ctx}")
        tokens = [list(t) + [t[-1]] * (n - len(t)) for t, _, _ in rows]
        hidden = np.stack([np.concatenate([h, np.repeat(h[-1:], n - len(h), axis=0)]) if len(h) < n else h
                           for _, h, _ in rows])
        last_rows = np.array([i * n + length - 1 for i, length in enumerate(lengths)], dtype=np.int32)
        logits, out = self._mtp_ubatch(tokens, hidden, [start for _, _, start in rows], seq_head, 1, out_rows=last_rows)
        return [(logits[i, 0], out[i, 0:1]) for i in range(len(rows))]

    def _mtp_ubatch(self, tokens: list[list[int]], hidden: np.ndarray, starts: list[int], seq_head: int,
                    n_out: int, embd: np.ndarray | None = None,
                    out_rows: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One MTP ubatch of equal-length rows (hidden [n_seqs, n, n_embd]) for sequences seq_head..;
        logits [n_seqs, n_out, vocab] and output hidden states [n_seqs, n_out, n_embd] of the last
        n_out rows of each sequence (or of the rows `out_rows` names, n_out per sequence). `embd` (one
        sequence): the next positions' input rows, an image's, in place of the tokens' embeddings.
        Rope positions as the trunk's (`rope_streams`)."""
        n_seqs, n = len(tokens), len(tokens[0])
        n_kv = padded_n_kv(max(starts) + n, self.n_ctx)
        shape = UbatchShape(n_seq_tokens=n, n_seqs=n_seqs, n_outputs=n_out * n_seqs, n_kv=n_kv, seq_head=seq_head,
                            delta_net=self.delta_net, mtp=True, draft_vocab=self.draft_vocab,
                            embeddings=embd is not None)
        g = self.graph(shape)
        sched = self._draft_sched() if n <= self.memory.rs_slots else self.sched
        sched.allocate(g.gf, g.ctx)
        pos = np.asarray(starts, dtype=np.int32)[:, None] + np.arange(n, dtype=np.int32)[None, :]
        self._input_plan(g, shape).set(UbatchData(pos=pos, tokens=tokens, hidden=hidden.reshape(n_seqs * n, -1),
                                                  embd=embd, rope=self._rope_rows(seq_head, starts, n),
                                                  out_rows=out_rows))
        sched.compute(g.gf)
        logits = self._whole_vocab(tensor_to_numpy(g.outputs["result_output"]).reshape(n_seqs, n_out, -1))
        out = tensor_to_numpy(g.outputs["mtp_out"]).reshape(n_seqs, n_out, self.hp.n_embd)
        return logits, out

    def _draft_sched(self) -> Scheduler:
        """The scheduler of MTP graphs of up to rs_slots rows (chained drafts, a step's rows).

        ggml's scheduler holds one allocated graph: a speculative step that alternated the trunk's
        graph and an MTP graph on one scheduler re-allocated both every time (forgetting and
        re-planning every tensor's address), which cost several times their computation on this
        small model. With their own scheduler and compute buffers (sized here for the largest of
        them: a few rows), both stay allocated.
        """
        if self._mtp_sched is None:
            largest = UbatchShape(n_seq_tokens=self.memory.rs_slots, n_seqs=1, n_outputs=self.memory.rs_slots,
                                  n_kv=self.n_ctx, delta_net=self.delta_net, mtp=True, draft_vocab=self.draft_vocab)
            self._mtp_sched = self._scheduler_for(largest)
        return self._mtp_sched

    def _scheduler_for(self, largest: UbatchShape) -> Scheduler:
        """A scheduler of its own with compute buffers reserved for graphs up to `largest`."""
        sched = Scheduler(self.placement.sched_backends, graph_size=self.family.graph_size(largest))
        try:
            self._reserve_compute_buffers(largest, sched)
        except BaseException:
            sched.free()
            raise
        return sched

    def keep_step_graphs(self, n_graphs: int = 3) -> None:
        """Keep up to `n_graphs` step graphs allocated side by side, each on a scheduler of its own.

        A step graph is a ubatch of at most rs_slots tokens per sequence: a server's decode (or
        draft verification) step. ggml's scheduler holds one allocated graph, so a server that
        interleaves prompt chunks with decode steps, or decodes two runs of cells, re-allocated
        graphs every step (`Scheduler.allocate`: 0.6 ms for the built-in model's decode graph before
        `scheduler.GraphLayout`, two decode steps of one sequence). Each extra scheduler reserves
        compute buffers for the largest step graph (rs_slots tokens of every cell): small next to
        the prompt graphs'. Off by default: tools that profile or dump `model.sched` see every
        graph there.
        """
        largest = UbatchShape(n_seq_tokens=self.memory.rs_slots, n_seqs=self.memory.n_seq_max,
                              n_outputs=self.memory.rs_slots * self.memory.n_seq_max, n_kv=self.n_ctx,
                              delta_net=self.delta_net)
        while len(self._step_scheds) < n_graphs:
            sched = self._scheduler_for(largest)
            # a graph moves between schedulers: the snapshot of its nodes' own srcs (taken on its
            # first allocation, see Scheduler.allocate) must be the one every scheduler restores
            sched.share_snapshots(self.sched)
            self._step_scheds.append(sched)

    def _sched_for(self, g: "_Graph", shape: UbatchShape) -> Scheduler:
        """The scheduler to allocate and compute `g` on: `sched`, or with `keep_step_graphs` for a
        step graph the step scheduler holding it (else the least recently used one). A graph is
        valid on one scheduler only: any other that last allocated it (also `sched`, through a
        graph dump) is told to forget it."""
        if not self._step_scheds or shape.n_seq_tokens > self.memory.rs_slots or shape.mtp_argmax:
            return self.sched
        holders = [s for s in [self.sched] + self._step_scheds if s.holds(g.gf)]
        if len(holders) == 1 and holders[0] is not self.sched:
            chosen = holders[0]
        else:
            for s in holders:
                s.forget_graph()
            chosen = self._step_scheds[-1]
        self._step_scheds.remove(chosen)
        self._step_scheds.insert(0, chosen)
        return chosen

    def logits_for(self, tokens: list[int]) -> np.ndarray:
        """Logits of every token of a fresh sequence (resets the model); handy for tests and perplexity."""
        self.reset()
        return self.eval(tokens, all_logits=True)

    def close(self) -> None:
        for g in self._graphs.values():
            ggml.ggml_free(g.ctx)
        self._graphs.clear()
        self.sched.free()
        if self._mtp_sched is not None:
            self._mtp_sched.free()
        for sched in self._step_scheds:
            sched.free()
        self._step_scheds.clear()
        self.memory.free()
        self.weights.free()
        self.placement.free()
        self.backend.free()

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- internals ----------------------------------------------------------------------------
    def _reserve_compute_buffers(self, largest: UbatchShape, sched: Scheduler | None = None) -> None:
        """Size the compute buffers for the largest ubatch now, as llama.cpp does at context creation:
        the memory a session needs is known (and refused) up front, and no later graph reallocates
        the buffers mid-generation. The worst-case graph is built only for this and dropped."""
        size = self.family.graph_size(largest)
        ctx = new_context(2 * size)
        try:
            gf = ggml.ggml_new_graph_custom(ctx, size, False)
            self.family.build(ctx, gf, self.weights.tensors, self.memory, largest)
            (sched or self.sched).reserve(gf)
        finally:
            ggml.ggml_free(ctx)

    def graph(self, shape: UbatchShape) -> _Graph:
        """The graph of one ubatch shape (`ctx`, `gf`, `outputs`, `io`), built on first use and kept
        while it is among the MAX_GRAPHS most recently used: what `eval` computes for that shape,
        and what graph dumps describe."""
        g = self._graphs.get(shape)
        if g is not None:
            self._graphs.move_to_end(shape)
            return g
        size = self.family.graph_size(shape)
        ctx = new_context(2 * size)
        gf = ggml.ggml_new_graph_custom(ctx, size, False)
        built = self.family.build(ctx, gf, self.weights.tensors, self.memory, shape)
        g = _Graph(ctx, gf, built)
        self._graphs[shape] = g
        self.stats.n_graph_builds += 1
        while len(self._graphs) > MAX_GRAPHS:
            self._free_graph(self._graphs.popitem(last=False)[1])
        return g

    def _free_graph(self, g: _Graph) -> None:
        """Free a graph dropped from the cache, once no scheduler refers to it any more."""
        for sched in [self.sched, self._mtp_sched, *self._step_scheds]:
            if sched is not None:
                sched.drop_graph(g.gf)
        ggml.ggml_free(g.ctx)

    def eval_batch(self, batch: dict[int, list[int]], all_logits: bool = False,
                   keep_start: bool = True, ride: PromptChunk | None = None) -> dict[int, np.ndarray]:
        """Evaluate several sequences at once: equal-length token lists for consecutive sequence ids
        share ubatches (one graph with n_seqs > 1); other batches are evaluated sequence by sequence.
        `keep_start` as in `eval`.

        `ride`: a prompt chunk of another sequence, evaluated as `eval(tokens, seq, continued=True,
        captures=ride.captures)` is (with `ride.logits` as `eval(tokens, seq)`, its last logits in
        `last_ride_logits`, its captured states in `last_ride_captures`); where
        the family's graphs take it and the batch is one ubatch, in the same graph
        (`UbatchShape.ride`: every weight read once for both), else first, apart."""
        seqs = sorted(batch)
        lengths = {len(batch[s]) for s in seqs}
        consecutive = seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        per_ubatch = max(self.memory.rs_slots, self.n_ubatch // len(seqs))
        if ride is not None:
            self.last_ride_logits = self.last_ride_hidden = None
            self.last_ride_captures = {}
            if ride.seq in batch:
                raise DeltarunError(f"sequence {ride.seq} cannot ride along a batch that holds it")
            if self.family.rides and len(lengths) == 1 and consecutive and max(lengths) <= per_ubatch \
                    and len(ride.tokens) <= self.n_ubatch:
                self.check_chunk(ride)
                for s in seqs:
                    self._check_tokens(batch[s], s)
                logits = self._eval_ubatch([batch[s] for s in seqs], seqs[0], all_logits,
                                           keep_start=keep_start, ride=ride)
                return {s: logits[i] if all_logits else logits[i][-1] for i, s in enumerate(seqs)}
            self.eval_chunk(ride)
        if len(seqs) == 1 or len(lengths) != 1 or not consecutive:
            return {s: self.eval(batch[s], s, all_logits, keep_start=keep_start) for s in seqs}
        n = lengths.pop()
        for s in seqs:
            self._check_tokens(batch[s], s)
        outs: dict[int, list[np.ndarray]] = {s: [] for s in seqs}
        done = 0
        for size in self._split(n, per_ubatch):
            chunk = [batch[s][done:done + size] for s in seqs]
            done += size
            last = done == n
            logits = self._eval_ubatch(chunk, seqs[0], all_logits, keep_start=keep_start)
            if all_logits or last:
                for i, s in enumerate(seqs):
                    outs[s].append(logits[i])
        return {s: (np.concatenate(outs[s]) if all_logits else outs[s][-1][-1]) for s in seqs}

    def check_chunk(self, chunk: PromptChunk) -> None:
        """A DeltarunError when the chunk cannot be evaluated (no tokens, ids outside the
        vocabulary, a sequence out of range, a full context, capture points it cannot keep), before
        anything is."""
        self._check_tokens([int(t) for t in chunk.tokens], chunk.seq)
        caps = self._capture_points(chunk.captures, len(chunk.tokens))
        if len(caps) > self.memory.n_capture:
            raise DeltarunError(f"{len(caps)} capture points in one prompt chunk; the model has "
                                f"{self.memory.n_capture} capture slots")

    def eval_chunk(self, chunk: PromptChunk) -> np.ndarray | None:
        """Evaluate a prompt chunk apart (what `eval_batch` does with one that cannot ride along):
        its last logits with `chunk.logits` (also in `last_ride_logits`), else None; its rows'
        hidden states in `last_ride_hidden` with `chunk.hidden`; its captured states in
        `last_ride_captures` (the batch evaluated after it starts `last_captures` afresh)."""
        self.last_ride_logits = self.eval(chunk.tokens, chunk.seq, continued=not chunk.logits, all_hidden=chunk.hidden,
                                          captures=chunk.captures)
        self.last_ride_hidden = self.last_hidden[0] if chunk.hidden else None
        self.last_ride_captures = dict(self.last_captures)
        return self.last_ride_logits

    def _capture_points(self, captures: Iterable[int], n: int) -> tuple[int, ...]:
        """Capture points of n tokens, sorted without repeats; a DeltarunError unless they lie
        inside them, on a model with recurrent layers."""
        caps = tuple(sorted({int(t) for t in captures}))
        if caps and (caps[0] < 1 or caps[-1] >= n):
            raise DeltarunError(f"capture points must lie inside the {n} tokens (1..{n - 1})")
        if caps and not self.hp.linear_layers:
            raise DeltarunError("captures need a model with recurrent layers")
        return caps

    def _check_tokens(self, toks: list[int], seq: int) -> None:
        if not toks:
            raise DeltarunError("no tokens to evaluate")
        if not 0 <= seq < self.memory.n_seq_max:
            raise DeltarunError(f"sequence {seq} out of range (the model was opened for {self.memory.n_seq_max})")
        bad = [t for t in toks if not 0 <= int(t) < self.hp.n_vocab]
        if bad:
            raise DeltarunError(f"token id {bad[0]} is outside the vocabulary (0..{self.hp.n_vocab - 1})")
        state = self.memory.seqs[seq]
        if state.n_past + len(toks) > self.n_ctx:
            raise ContextFullError(
                f"context full: {state.n_past} tokens + {len(toks)} new exceed the context size {self.n_ctx}")

    def _eval_ubatch(self, tokens: list[list[int]], seq_head: int, want_all: bool,
                     mtp_argmax: bool = False, captures: tuple[int, ...] = (),
                     embd: np.ndarray | None = None, rope: np.ndarray | None = None,
                     all_hidden: bool = False, keep_start: bool = True, continued: bool = False,
                     ride: PromptChunk | None = None) -> np.ndarray | None:
        """One ubatch of equal-length token lists for sequences seq_head.. ; logits [n_seqs, rows, vocab].
        With `embd` (one sequence) the rows are given instead of looked up (an image), at rope
        streams `rope` [3, n]. `all_hidden`: every row's hidden state, the last row's logits.
        `continued` (`UbatchShape.continued`): no logits (None), no rollback slots. `ride`: a prompt
        chunk evaluated in the same graph (`UbatchShape.ride`; its logits in `last_ride_logits`)."""
        t0 = time.perf_counter()
        n_seqs, n = len(tokens), len(tokens[0])
        starts = [self.memory.seqs[seq_head + i].n_past for i in range(n_seqs)]
        n_kv = padded_n_kv(max(starts) + n, self.n_ctx)
        n_out = n if want_all else 1
        logits_last = all_hidden and not want_all and n > 1
        n_hidden = n if logits_last else n_out
        ride_shape = None
        if ride is not None:
            ride_start = self.memory.seqs[ride.seq].n_past
            ride_shape = Ride(ride.seq, len(ride.tokens), padded_n_kv(ride_start + len(ride.tokens), self.n_ctx),
                              ride.logits, ride.hidden, self._capture_points(ride.captures, len(ride.tokens)))
        shape = UbatchShape(n_seq_tokens=n, n_seqs=n_seqs, n_outputs=n_hidden * n_seqs, n_kv=n_kv,
                            seq_head=seq_head, delta_net=self.delta_net, mtp_argmax=mtp_argmax, captures=captures,
                            embeddings=embd is not None, logits_last=logits_last,
                            keep_start=keep_start or n >= self.memory.rs_slots,
                            draft_vocab=self.draft_vocab if mtp_argmax else 0, continued=continued,
                            ride=ride_shape)
        g = self.graph(shape)
        sched = self._sched_for(g, shape)
        sched.allocate(g.gf, g.ctx)
        data = self._ubatch_data(tokens, starts, shape, embd, rope)
        if ride is not None:
            data.ride = self._ubatch_data([list(ride.tokens)], [ride_start], shape.ride_shape())
        self._input_plan(g, shape).set(data)
        sched.compute(g.gf)
        self.last_mtp = self._read_mtp_rows(g, n, seq_head, starts[0]) if mtp_argmax else None
        # a riding chunk's rows after the ubatch's: its last row's logits, its hidden rows
        extra = 1 if ride is not None and ride.logits else 0
        extra_hidden = len(ride.tokens) if ride is not None and ride.hidden else extra
        logits = None
        if not continued:
            rows = np.empty((n_seqs * n_out + extra, self.hp.n_vocab), dtype=np.float32)   # F32, read whole
            _tensor_get(g.outputs["result_output"], rows.ctypes.data, 0, rows.nbytes)
            logits = rows[:n_seqs * n_out].reshape(n_seqs, n_out, -1)
            if ride is not None:
                self.last_ride_logits = rows[-1] if extra else None
        hidden = np.empty((n_seqs * n_hidden + extra_hidden, self.hp.n_embd), dtype=np.float32)
        _tensor_get(g.outputs["result_norm"], hidden.ctypes.data, 0, hidden.nbytes)
        self.last_hidden = hidden[:n_seqs * n_hidden].reshape(n_seqs, n_hidden, -1)
        if ride is not None:
            self.last_ride_hidden = hidden[n_seqs * n_hidden:] if ride.hidden else None
        for i, toks in enumerate(tokens):
            self.memory.advance(seq_head + i, toks, keep_start, undoable=not continued)
        if ride is not None:
            for i, t in enumerate(ride_shape.captures):
                self.last_ride_captures[ride_start + t] = self.memory.read_capture(i, ride_start + t)
            self.memory.advance(ride.seq, list(ride.tokens), undoable=ride.logits)
            self.stats.n_eval_tokens += len(ride.tokens)
        self.stats.n_eval_tokens += n * n_seqs
        self.stats.n_eval_calls += 1
        self.stats.eval_seconds += time.perf_counter() - t0
        return logits

    def _read_mtp_rows(self, g: _Graph, n: int, seq: int, start: int) -> MtpRows:
        """The MTP outputs of an mtp_argmax graph of one sequence's n rows from position `start`."""
        hp = self.hp
        tokens = np.empty(n, dtype=np.int32)
        _tensor_get(g.outputs["mtp_tokens"], tokens.ctypes.data, 0, tokens.nbytes)
        rows = g.outputs["mtp_result_output"]
        logits = np.empty((n, int(rows.contents.ne[0])), dtype=np.float32)
        _tensor_get(rows, logits.ctypes.data, 0, logits.nbytes)
        logits = self._whole_vocab(logits)
        out = np.empty((n, hp.n_embd), dtype=np.float32)
        _tensor_get(g.outputs["mtp_out"], out.ctypes.data, 0, out.nbytes)
        return MtpRows(seq, start, tokens.tolist(), logits, out)

    def _whole_vocab(self, logits: np.ndarray) -> np.ndarray:
        """MTP logits [..., draft_vocab] as [..., n_vocab]: the ids past the draft vocabulary at -inf
        (never drafted; a draft distribution with zeros there, see runner.draft_vocab)."""
        n = logits.shape[-1]
        if n == self.hp.n_vocab:
            return logits
        whole = np.full(logits.shape[:-1] + (self.hp.n_vocab,), -np.inf, dtype=np.float32)
        whole[..., :n] = logits
        return whole

    def _input_plan(self, g: _Graph, shape: UbatchShape) -> _InputPlan:
        """The input plan of allocated graph `g`, made on its first step."""
        if g.inputs is None:
            g.inputs = _InputPlan(g.built, shape)
        return g.inputs

    def _set_inputs(self, g: _Graph, tokens: list[list[int]], starts: list[int], shape: UbatchShape,
                    embd: np.ndarray | None = None, rope: np.ndarray | None = None) -> None:
        """Fill the graph's inputs for token lists of sequences seq_head.. starting at positions `starts`."""
        self._input_plan(g, shape).set(self._ubatch_data(tokens, starts, shape, embd, rope))

    def _ubatch_data(self, tokens: list[list[int]], starts: list[int], shape: UbatchShape,
                     embd: np.ndarray | None = None, rope: np.ndarray | None = None) -> UbatchData:
        """The step's values of token lists of sequences seq_head.. starting at positions `starts`
        (rope positions shifted after the images a sequence holds; see `eval_image`)."""
        n = shape.n_seq_tokens
        if n * shape.n_seqs == 1:
            pos = np.array([[starts[0]]], dtype=np.int32)
        else:
            pos = np.asarray(starts, dtype=np.int32)[:, None] + np.arange(n, dtype=np.int32)[None, :]
        if rope is None:
            rope = self._rope_rows(shape.seq_head, starts, n)
        return UbatchData(pos=pos, tokens=tokens, embd=embd, rope=rope)

    def _rope_rows(self, seq_head: int, starts: list[int], n: int) -> np.ndarray | None:
        """The rope streams [3, n_seqs * n] of n positions from `starts` of sequences seq_head..
        (`rope_streams`), or None when none of them holds an image."""
        if not self._image_grids:
            return None
        streams = [self.rope_streams(seq_head + i, start, n) for i, start in enumerate(starts)]
        if all(r is None for r in streams):
            return None
        plain = [np.repeat(np.arange(start, start + n, dtype=np.int32)[None], 3, 0) for start in starts]
        return np.concatenate([r if r is not None else p for r, p in zip(streams, plain)], axis=1)
