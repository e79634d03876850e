"""The scheduler that runs graphs (ggml_backend_sched over a `Backend` and its CPU fallback), and the
bookkeeping that lets an allocated graph come back: its nodes' own src pointers saved and restored,
its tensors' addresses cleared (`GraphLayout` does both as two numpy assignments).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from deltarun.base.errors import BackendError
from deltarun.base.ggml_log import HeldLog
from deltarun.base.ggml_util import c_array, ctypes, ggml
from deltarun.runner.backend import Backend

GRAPH_SIZE = 16384


def _src_span() -> tuple[int, int]:
    field = ggml.ggml_tensor.src
    return field.offset, field.size


def node_addresses(gf: Any) -> np.ndarray:
    """Addresses of the nodes of `gf`, in order (its node array read at once)."""
    n = int(ggml.ggml_graph_n_nodes(gf))
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    array = ctypes.cast(ggml.ggml_graph_nodes(gf), ctypes.c_void_p).value
    return np.ctypeslib.as_array((ctypes.c_int64 * n).from_address(array)).copy()


#: sizeof(struct ggml_object): offs, size, next, type and padding (ggml.c)
_OBJECT_SIZE = 32


def tensor_addresses(ctx: Any) -> np.ndarray:
    """Addresses of every tensor of a context, in creation order.

    A graph context holds the graph object and then tensors only, each object header followed
    by its tensor struct at one fixed stride; that chain is checked whole with numpy (every header's
    offset, size, type and next pointer), and walked with ggml_get_next_tensor where it does not
    hold (about 0.2 ms for a thousand tensors, ten times the check)."""
    first = ggml.ggml_get_first_tensor(ctx)
    if not first:
        return np.zeros(0, dtype=np.int64)
    a0 = ctypes.addressof(first.contents)
    second = ggml.ggml_get_next_tensor(ctx, first)
    if not second:
        return np.array([a0], dtype=np.int64)
    stride = ctypes.addressof(second.contents) - a0
    base = int(ggml.ggml_get_mem_buffer(ctx) or 0)
    end = base + int(ggml.ggml_used_mem(ctx))                 # end of the last object's tensor
    last = end - (stride - _OBJECT_SIZE)
    if stride > _OBJECT_SIZE and stride % 8 == 0 and (a0 - base) % 8 == 0 and last >= a0 and (last - a0) % stride == 0:
        addrs = np.arange(a0, last + 1, stride, dtype=np.int64)
        words = np.ctypeslib.as_array((ctypes.c_int64 * ((end - base) // 8)).from_address(base))
        head = (addrs - _OBJECT_SIZE - base) // 8
        nxt = np.append(addrs[1:] - _OBJECT_SIZE, 0)
        if (np.array_equal(words[head], addrs - base) and (words[head + 1] == stride - _OBJECT_SIZE).all()
                and np.array_equal(words[head + 2], nxt) and not (words[head + 3] & 0xFFFFFFFF).any()):
            return addrs
    out = []
    t = first
    while t:
        out.append(ctypes.addressof(t.contents))
        t = ggml.ggml_get_next_tensor(ctx, t)
    return np.asarray(out, dtype=np.int64)


def snapshot_srcs(gf: Any) -> dict[int, bytes]:
    """The src pointers of every node of `gf`, by node address (raw bytes of ggml_tensor.src)."""
    off, size = _src_span()
    return {int(a): ctypes.string_at(int(a) + off, size) for a in node_addresses(gf)}


def restore_srcs(gf: Any, snapshot: dict[int, bytes]) -> bool:
    """Put back the src pointers saved by `snapshot_srcs`; False if `gf` has nodes it lacks."""
    off, _ = _src_span()
    nodes = [int(a) for a in node_addresses(gf)]
    if len(nodes) != len(snapshot) or any(a not in snapshot for a in nodes):
        return False
    for addr in nodes:
        saved = snapshot[addr]
        ctypes.memmove(addr + off, saved, len(saved))
    return True


def forget_addresses(ctx: Any) -> None:
    """Clear data and buffer of every tensor created in a graph context (nodes, inputs, views)."""
    for a in tensor_addresses(ctx):
        c = ggml.ggml_tensor.from_address(int(a))
        c.data = None
        c.buffer = None


class GraphLayout:
    """`restore_srcs` + `forget_addresses` of one graph as two numpy assignments.

    Both are a ctypes call or two per node / tensor (about 0.5 ms for the built-in model's 318-node
    decode graph, more than ggml's own allocation of it): a server whose graphs alternate pays
    that at every step. Every tensor of a graph context, the graph's nodes included, is a struct
    in the context's one memory buffer, so the words to rewrite are found once: each node's src
    pointers (put back from the saved ones) and each tensor's data and buffer pointers (cleared).
    `matches` checks that the graph is still the one measured (same buffer, node count, first and
    last node) before each use. Made before a graph's first allocation, it saves the srcs as they
    are (the graph's own): a new graph's first allocation then costs two numpy reads, not a
    ctypes call per node.
    """

    def __init__(self, gf: Any, ctx: Any, snapshot: dict[int, bytes] | None = None):
        self.base = int(ggml.ggml_get_mem_buffer(ctx) or 0)
        size = int(ggml.ggml_get_mem_size(ctx)) // 8
        self.words = np.ctypeslib.as_array((ctypes.c_uint64 * size).from_address(self.base))
        off, span = _src_span()
        nodes = node_addresses(gf) if snapshot is None else \
            np.fromiter(snapshot.keys(), dtype=np.int64, count=len(snapshot))
        self.n_nodes = len(nodes)
        self.ends = (int(nodes[0]), int(nodes[-1])) if len(nodes) else (0, 0)
        self.src_idx = ((nodes - self.base + off) // 8)[:, None] + np.arange(span // 8)[None, :]
        addrs = tensor_addresses(ctx) - self.base
        self.ptr_idx = np.concatenate([(addrs + ggml.ggml_tensor.data.offset) // 8,
                                       (addrs + ggml.ggml_tensor.buffer.offset) // 8])
        aligned = (off % 8 == 0 and span % 8 == 0 and ggml.ggml_tensor.data.offset % 8 == 0
                   and ggml.ggml_tensor.buffer.offset % 8 == 0 and not (addrs % 8).any()
                   and not ((nodes - self.base) % 8).any())
        inside = bool(len(addrs)) and addrs.min() >= 0 and addrs.max() + ctypes.sizeof(ggml.ggml_tensor) <= 8 * size \
            and (nodes >= self.base).all() and (nodes - self.base + off + span <= 8 * size).all()
        self.usable = aligned and inside
        if not self.usable:
            return
        if snapshot is None:
            self.src_saved = self.words[self.src_idx].copy()
        else:
            self.src_saved = np.frombuffer(b"".join(snapshot.values()), dtype=np.uint64).reshape(len(nodes), span // 8)

    def snapshot(self) -> dict[int, bytes]:
        """The saved srcs as `snapshot_srcs` gives them."""
        nodes = (self.src_idx[:, 0] * 8 + self.base - _src_span()[0]).tolist()
        return {a: row.tobytes() for a, row in zip(nodes, self.src_saved)}

    @classmethod
    def of(cls, gf: Any, ctx: Any, snapshot: dict[int, bytes] | None = None) -> "GraphLayout | None":
        try:
            layout = cls(gf, ctx, snapshot)
        except (ValueError, TypeError):
            return None
        return layout if layout.usable else None

    def matches(self, gf: Any, ctx: Any) -> bool:
        n = int(ggml.ggml_graph_n_nodes(gf))
        return (n == self.n_nodes and n > 0 and int(ggml.ggml_get_mem_buffer(ctx) or 0) == self.base
                and ctypes.addressof(ggml.ggml_graph_node(gf, 0).contents) == self.ends[0]
                and ctypes.addressof(ggml.ggml_graph_node(gf, n - 1).contents) == self.ends[1])

    def reset(self) -> None:
        """restore_srcs(gf, snapshot) and forget_addresses(ctx)."""
        self.words[self.src_idx] = self.src_saved
        self.words[self.ptr_idx] = 0


EvalCallback = Callable[[Any, bool, Any], bool]


def _null_callback() -> Any:
    return ggml.ggml_backend_sched_eval_callback()


@ggml.ggml_backend_sched_eval_callback
def _pass_through(t: Any, ask: bool, user_data: Any) -> bool:  # pragma: no cover - only if NULL is refused
    return not ask


def _clear_callback(sched: Any) -> None:
    """Remove the eval callback: NULL where the binding accepts it, else a module-level pass-through."""
    try:
        ggml.ggml_backend_sched_set_eval_callback(sched, _null_callback(), None)
    except (ctypes.ArgumentError, TypeError):  # pragma: no cover - older bindings
        ggml.ggml_backend_sched_set_eval_callback(sched, _pass_through, None)


class Scheduler:
    """ggml_backend_sched over the backend(s); remembers which graph is currently allocated.

    With a device and the CPU, ggml splits each graph: an op runs where its weights are, ops the
    device does not support (ggml_backend_dev_supports_op) fall back to the CPU, and with
    op_offload large-batch ops on CPU-resident weights may be offloaded to the device.

    The scheduler owns its eval callback: `set_eval_callback(fn)` installs a Python callback
    (fn(tensor, ask, user_data) -> bool, as ggml's; it must not raise) and keeps it alive until
    `clear_eval_callback()`.
    """

    def __init__(self, backends: list[Backend], graph_size: int = GRAPH_SIZE):
        self.backends = backends
        handles = c_array(ctypes.c_void_p, [b.handle for b in backends])
        bufts = c_array(ctypes.c_void_p, [b.buffer_type for b in backends])
        self.handle = ggml.ggml_backend_sched_new(handles, bufts, len(backends), graph_size, False, True)
        if not self.handle:
            raise BackendError("ggml_backend_sched_new failed")
        self._allocated: Any = None
        self._pristine: dict[int, dict[int, bytes]] = {}   # graph address -> its nodes' own srcs
        self._layouts: dict[int, GraphLayout | None] = {}  # graph address -> where those srcs lie
        self._c_callback: Any = None          # the installed ctypes callback (kept alive)

    def set_eval_callback(self, fn: EvalCallback) -> None:
        self._c_callback = ggml.ggml_backend_sched_eval_callback(fn)
        ggml.ggml_backend_sched_set_eval_callback(self.handle, self._c_callback, None)

    def clear_eval_callback(self) -> None:
        _clear_callback(self.handle)
        self._c_callback = None

    def reserve(self, gf: Any) -> None:
        """Size the compute buffers for the largest graph once, so later graphs never reallocate."""
        self._allocated = None   # reserving resets the scheduler: the next graph is allocated anew
        with HeldLog() as held:
            reserved = ggml.ggml_backend_sched_reserve(self.handle, gf)
        if not reserved:
            raise BackendError(f"the backend could not reserve compute buffers for the largest ubatch: {held.reason} "
                               "(lower --ubatch or --ctx)")
        held.release()

    def allocate(self, gf: Any, ctx: Any) -> None:
        """Allocate `gf` (whose tensors live in `ctx`) unless it is the graph allocated last.

        ggml's allocator keeps a tensor's old address when its data pointer is set, which is
        only right for the graph allocated last: another graph may have moved or reallocated the
        compute buffer since. So a graph coming back is first stripped of its addresses, and is
        then laid out as if new.

        With more than one backend the scheduler also rewrites the graph: a node whose input lives
        on another backend gets `src[j]` pointed at a copy made in the scheduler's own context,
        which the next graph's split frees. A graph coming back would read freed tensors (wrong
        values, heap corruption), so every node's own src pointers are saved before the graph's
        first allocation and put back before each later one.
        """
        key = ctypes.addressof(gf.contents)
        if self._allocated is not None and ctypes.addressof(self._allocated.contents) == key:
            return
        layout = self._layouts.get(key)
        if key not in self._layouts and key not in self._pristine:   # never allocated: its srcs are its own
            layout = self._layouts[key] = GraphLayout.of(gf, ctx)
            if layout is not None:
                self._pristine[key] = layout.snapshot()
        if layout is not None and layout.matches(gf, ctx):
            layout.reset()                # restore_srcs + forget_addresses, see GraphLayout
        else:
            saved = self._pristine.get(key)
            if saved is None or not restore_srcs(gf, saved):
                saved = self._pristine[key] = snapshot_srcs(gf)   # never allocated: its srcs are its own
            forget_addresses(ctx)
            self._layouts[key] = GraphLayout.of(gf, ctx, saved)
        ggml.ggml_backend_sched_reset(self.handle)
        if not ggml.ggml_backend_sched_alloc_graph(self.handle, gf):
            size = self.compute_buffer_size()
            raise BackendError(f"the backend could not allocate the compute graph (compute buffers {size} bytes)")
        self._allocated = gf

    def holds(self, gf: Any) -> bool:
        """Whether `gf` is the graph this scheduler allocated last (its addresses point here)."""
        return self._allocated is not None and ctypes.addressof(self._allocated.contents) == ctypes.addressof(gf.contents)

    def share_snapshots(self, other: "Scheduler") -> None:
        """Use `other`'s snapshots of graphs' own src pointers: a graph that moves between the two
        schedulers is restored to the srcs it had before either rewrote them."""
        self._pristine = other._pristine
        self._layouts = other._layouts

    def drop_graph(self, gf: Any) -> None:
        """`gf` is about to be freed: forget its snapshots, and the allocation when it is the graph
        allocated last (the address may come back as another graph's)."""
        if self.holds(gf):
            self._allocated = None
            ggml.ggml_backend_sched_reset(self.handle)
        key = ctypes.addressof(gf.contents)
        self._pristine.pop(key, None)
        self._layouts.pop(key, None)

    def forget_graph(self) -> None:
        """Another scheduler is about to allocate the graph allocated here last: allocate anew next time."""
        self._allocated = None

    def compute(self, gf: Any) -> None:
        pinning = self.backends[-1].pinning      # the CPU backend's (it is last)
        if pinning is not None:
            pinning.before_compute()
        status = ggml.ggml_backend_sched_graph_compute(self.handle, gf)
        if status != 0:
            raise BackendError(f"graph compute failed with ggml status {status}")

    def forget(self) -> None:
        """Drop the record of the allocated graph (its context is about to be freed)."""
        self._allocated = None
        self._pristine.clear()
        self._layouts.clear()
        ggml.ggml_backend_sched_reset(self.handle)

    def n_splits(self) -> int:
        return int(ggml.ggml_backend_sched_get_n_splits(self.handle))

    def compute_buffer_size(self) -> int:
        return sum(int(ggml.ggml_backend_sched_get_buffer_size(self.handle, b.handle)) for b in self.backends)

    def free(self) -> None:
        if self.handle:
            ggml.ggml_backend_sched_free(self.handle)
            self.handle = 0
        self._c_callback = None
