"""Where the time of one ubatch goes: seconds per ggml op type and per named node group.

    prof = profile_ubatch(model, tokens, n_past_tokens=prompt, repetitions=5)   # deltarun.Model
    print(format_profiles([prof]))

How a node's time is measured
-----------------------------
ggml_backend_sched calls the scheduler's eval callback twice for a node it is asked about: once
with ``ask=True`` before computing ("do you want this node's data?") and once with ``ask=False``
after it. When the callback answers yes for a node, the scheduler computes the graph up to and
including that node as a graph of its own, waits for the backend (ggml_backend_synchronize) and
only then calls back. The callback here answers yes for every node that computes something, so
the graph runs node by node, and the time between two consecutive ``ask=False`` calls is the
time of the node reported by the second one. Nodes that compute nothing (VIEW, RESHAPE, PERMUTE,
TRANSPOSE, NONE) are answered no: they run in the same graph as the next computed node, which
costs nothing. The first node's interval starts when the compute call starts and the last node's
ends when it returns, so the node times add up exactly to the profiled compute time (``total_s``),
and so do the op and group sums.

Overhead: this is not free. Every computed node becomes a graph computation of its own, so the
CPU backend starts its thread pool (an OpenMP parallel region) and ends with a barrier once per
node instead of once per graph, and two Python callbacks run per node (a few microseconds each).
`profile_ubatch` therefore also times the same ubatch without the callback (``plain_s``, the
compute call only) and reports ``overhead = total_s / plain_s - 1`` and the overhead per computed
node; small, cheap nodes (norms, adds) carry most of it in relative terms. llama.cpp's eval
callback (``cb_eval``, bench/compare_llamacpp.py) is driven by the same scheduler code, so the two
profiles have the same kind of overhead and can be read side by side.

Groups
------
Each computed node is put in one of GROUPS from the node names both engines give (``name-IL``
for layer IL, llama.cpp's conventions): ``lm_head`` (``result_*``: final norm, output rows,
LM head product), ``moe_ffn`` (``ffn_*``, the post-attention norm and the layer output),
``attention`` or ``delta_net`` (the rest of a layer: its norm, mixer and residual; a layer is an
attention layer when one of its nodes is a ROPE) and ``other`` (token embedding and anything not
in a layer). Unnamed nodes (ggml's ``node_N``) belong to the next named node in graph order (their
consumer usually follows them), trailing ones to the last named node; so do views of memory
tensors (``cache_*``), named without a layer. See `classify_nodes`.
"""

from __future__ import annotations

import ctypes
import re
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

if TYPE_CHECKING:  # annotations only: the applications open models lazily
    from deltarun.runner.model import Model

GROUPS = ("attention", "delta_net", "moe_ffn", "lm_head", "other")
#: ggml ops that compute nothing on the CPU (views and shape changes).
NO_OPS = frozenset({"NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"})

_LAYER = re.compile(r"^(.*)-(\d+)$")
_UNNAMED = re.compile(r"^node_\d+$")
_FFN_NAMES = ("ffn_", "attn_post_norm", "post_attention_norm", "post_ffw_norm", "l_out", "shared_expert")


@dataclass
class NodeTime:
    """One computed node: position in the graph, name, ggml op, group, mean seconds per run."""

    index: int
    name: str
    op: str
    group: str
    seconds: float


@dataclass
class OpProfile:
    """The profile of one ubatch; `as_dict` is its JSON form (see deltarun.apps.bench)."""

    test: str                   # e.g. "pp512", "tg1@16" (one token after 16 of context)
    kind: str                   # "pp" | "tg"
    n_tokens: int               # tokens per sequence in the ubatch
    n_seqs: int
    n_past: int                 # tokens of context before the ubatch
    threads: int
    repetitions: int
    n_nodes: int                # every node of the graph
    nodes: list[NodeTime]       # the computed ones, graph order
    total_s: float              # profiled compute time (mean), = sum of node seconds
    plain_s: float = 0.0        # the same compute without the callback (mean); 0 if not measured
    engine: str = "deltarun"

    @property
    def overhead(self) -> float:
        return self.total_s / self.plain_s - 1.0 if self.plain_s > 0 else float("nan")

    def by_op(self) -> list[dict[str, Any]]:
        return _sum_by(self.nodes, lambda n: n.op, self.total_s, "op")

    def by_group(self) -> list[dict[str, Any]]:
        rows = {r["group"]: r for r in _sum_by(self.nodes, lambda n: n.group, self.total_s, "group")}
        return [rows.get(g, {"group": g, "count": 0, "seconds": 0.0, "share": 0.0}) for g in GROUPS]

    def as_dict(self, with_nodes: bool = False) -> dict[str, Any]:
        n_comp = len(self.nodes)
        d: dict[str, Any] = {
            "engine": self.engine, "test": self.test, "kind": self.kind, "n_tokens": self.n_tokens,
            "n_seqs": self.n_seqs, "n_past": self.n_past, "threads": self.threads,
            "repetitions": self.repetitions, "n_nodes": self.n_nodes, "n_computed": n_comp,
            "total_s": self.total_s, "plain_s": self.plain_s,
            "overhead": None if self.plain_s <= 0 else self.overhead,
            "overhead_per_node_us": (None if self.plain_s <= 0 or not n_comp
                                     else (self.total_s - self.plain_s) / n_comp * 1e6),
            "ops": self.by_op(), "groups": self.by_group(),
        }
        if with_nodes:
            d["nodes"] = [vars(n).copy() for n in self.nodes]
        return d


def _sum_by(nodes: Iterable[NodeTime], key: Callable[[NodeTime], str], total: float, label: str
            ) -> list[dict[str, Any]]:
    acc: dict[str, list[float]] = {}
    for n in nodes:
        acc.setdefault(key(n), []).append(n.seconds)
    rows = [{label: k, "count": len(v), "seconds": sum(v), "share": (sum(v) / total if total > 0 else 0.0)}
            for k, v in acc.items()]
    return sorted(rows, key=lambda r: -r["seconds"])


# ----------------------------------------------------------------------------------------------
# Groups from names (pure: also used on llama.cpp's node lists)
# ----------------------------------------------------------------------------------------------
def base_name(name: str) -> str:
    """`linear_attn_qkv_mixed-0 (reshaped) (transposed)` -> `linear_attn_qkv_mixed-0`."""
    return name.split(" (", 1)[0].strip()


def _named(name: str) -> bool:
    """Names that place a node: `name-IL` (layer IL), `result_*` (output), `inp_*` and `*embed*`
    (inputs, token embedding: llama.cpp names it `model.embed_tokens`).

    Everything else is grouped by position: ggml's `node_N`, and views of memory tensors
    (`cache_s_l0 (view)`), which both engines name without a layer suffix."""
    b = base_name(name)
    return bool(b) and not _UNNAMED.match(b) and bool(_LAYER.match(b) or b.startswith(("result_", "inp_"))
                                                      or "embed" in b)


def classify_nodes(names: Sequence[str], ops: Sequence[str]) -> list[str]:
    """The group (one of GROUPS) of every node of a graph, given node names and ops in graph order."""
    if len(names) != len(ops):
        raise ValueError("names and ops differ in length")
    attention_layers = set()
    for name, op in zip(names, ops):
        m = _LAYER.match(base_name(name))
        if m and op == "ROPE":
            attention_layers.add(int(m.group(2)))
    own: list[str | None] = []
    for name in names:
        if not _named(name):
            own.append(None)
            continue
        b = base_name(name)
        m = _LAYER.match(b)
        stem = m.group(1) if m else b
        if stem.startswith("result_"):
            own.append("lm_head")
        elif stem.startswith(_FFN_NAMES):
            own.append("moe_ffn")
        elif m:
            own.append("attention" if int(m.group(2)) in attention_layers else "delta_net")
        else:
            own.append("other")
    out: list[str] = [""] * len(names)
    following: str | None = None
    for i in range(len(names) - 1, -1, -1):      # unnamed nodes: the next named node's group
        if own[i] is not None:
            following = own[i]
        out[i] = own[i] or following or ""
    last = "other"
    for i in range(len(names)):                   # trailing unnamed nodes: the last named one's
        if out[i]:
            last = out[i]
        else:
            out[i] = last
    return out


def make_profile(records: Sequence[tuple[str, str, list[float]]], n_nodes: int, **fields: Any) -> OpProfile:
    """An OpProfile from (name, op, seconds per run) of every node in graph order (no-op nodes may
    be included: they are grouped with the rest but carry no time of their own)."""
    names = [r[0] for r in records]
    ops = [r[1] for r in records]
    groups = classify_nodes(names, ops)
    nodes = [NodeTime(i, name, op, g, statistics.fmean(secs) if secs else 0.0)
             for i, ((name, op, secs), g) in enumerate(zip(records, groups)) if op not in NO_OPS]
    total = sum(n.seconds for n in nodes)
    return OpProfile(nodes=nodes, n_nodes=n_nodes, total_s=total, **fields)


# ----------------------------------------------------------------------------------------------
# Measuring deltarun through the scheduler's eval callback
# ----------------------------------------------------------------------------------------------
class NodeClock:
    """Eval callback that times every computed node of the graphs computed while it is installed.

    `start()` must be called right before each compute call and `stop()` right after it; each
    compute's node intervals go to `runs` as {node address: seconds}.
    """

    def __init__(self, computed: set[int], clock_ns: Callable[[], int] = time.perf_counter_ns):
        self.computed = computed
        self.clock_ns = clock_ns
        self.runs: list[dict[int, float]] = []
        self._last = 0
        self._current: dict[int, float] = {}
        self._last_addr = 0
        self.errors: list[BaseException] = []

    def __call__(self, t: Any, ask: bool, user_data: Any) -> bool:
        try:
            addr = ctypes.addressof(t.contents)
            if ask:
                return addr in self.computed
            now = self.clock_ns()
            self._current[addr] = (now - self._last) * 1e-9
            self._last = now
            self._last_addr = addr
            return True
        except BaseException as e:  # never let an exception cross into C
            self.errors.append(e)
            return False

    def start(self) -> None:
        self._current = {}
        self._last_addr = 0
        self._last = self.clock_ns()

    def stop(self) -> None:
        now = self.clock_ns()
        if self._last_addr:                      # the tail (nothing computed) joins the last node
            self._current[self._last_addr] += (now - self._last) * 1e-9
        self.runs.append(self._current)


class _ComputeTimer:
    """Wraps `model.sched.compute` for a while: times each call, optionally with a NodeClock."""

    def __init__(self, model: Model, clock: Callable[[], float] = time.perf_counter):
        self.model = model
        self.clock = clock
        self.node_clock: NodeClock | None = None
        self.seconds: list[float] = []
        self.graphs: list[Any] = []

    def __enter__(self) -> "_ComputeTimer":
        sched = self.model.sched
        original = sched.compute

        def timed(gf: Any) -> None:
            t0 = self.clock()
            if self.node_clock is not None:
                self.node_clock.start()
            try:
                original(gf)
            finally:
                if self.node_clock is not None:
                    self.node_clock.stop()
                self.seconds.append(self.clock() - t0)
                self.graphs.append(gf)

        sched.compute = timed                   # instance attribute: shadows the method
        return self

    def __exit__(self, *exc: object) -> None:
        del self.model.sched.compute
        if self.node_clock is not None:
            self.model.sched.clear_eval_callback()


def _graph_nodes(gf: Any) -> list[tuple[int, str, str]]:
    from deltarun.base.ggml_util import ggml, name_of

    out = []
    for i in range(int(ggml.ggml_graph_n_nodes(gf))):
        t = ggml.ggml_graph_node(gf, i)
        op = ggml.ggml_op_desc(t)
        out.append((ctypes.addressof(t.contents), name_of(t), op.decode() if op else "?"))
    return out


def profile_ubatch(model: Model, tokens: Sequence[int], *, n_past_tokens: Sequence[int] = (), n_seqs: int = 1,
                   repetitions: int = 3, test: str | None = None, threads: int = 0,
                   cpu_clock: bool = False) -> OpProfile:
    """Profile one ubatch of `tokens` (per sequence; at most n_ubatch of them) after `n_past_tokens`
    of context, for `n_seqs` sequences (the model must have been opened with n_seq_max >= n_seqs).

    The model is reset, the context evaluated (untimed), then the ubatch is evaluated once to build
    its graph, and `repetitions` times each without and with the node clock, alternating. Each run
    starts from the same context: a prompt ubatch restarts from a reset (or a restored
    checkpoint), a decode ubatch continues the sequence by one token per run (the graph stays the
    same within a KV_PAD block; the state grows by one token a run).

    `cpu_clock` times nodes and runs by the calling thread's CPU time instead of wall time: with
    one thread (ggml then computes in the calling thread) other processes' time slices on a busy
    machine do not count. With more threads it would miss the other threads' work: not for them.
    """
    toks = [int(t) for t in tokens]
    past = [int(t) for t in n_past_tokens]
    if not toks:
        raise ValueError("no tokens to profile")
    if len(toks) > model.n_ubatch:
        raise ValueError(f"a ubatch holds at most {model.n_ubatch} tokens (--ubatch)")
    decode = len(toks) == 1
    need = len(past) + (2 + 2 * repetitions if decode else len(toks))
    if need > model.n_ctx:
        raise ValueError(f"profiling needs a context of {need} tokens (the model has {model.n_ctx})")
    batch = (lambda ts: model.eval(ts)) if n_seqs == 1 else (
        lambda ts: model.eval_batch({s: list(ts) for s in range(n_seqs)}))

    def prepare() -> None:
        model.reset()
        if past:
            batch(past)

    prepare()
    checkpoints = [model.checkpoint(s) for s in range(n_seqs)] if past and not decode else []

    def rewind() -> None:
        if decode:
            return
        if checkpoints:
            for cp in checkpoints:
                model.restore(cp)
        else:
            model.reset()

    batch(toks)                                  # builds the graph (not timed)
    plain: list[float] = []
    with _ComputeTimer(model, time.thread_time if cpu_clock else time.perf_counter) as timer:
        rewind()
        batch(toks)                              # one untimed run to learn which graph it is
        gf = timer.graphs[-1]
        nodes = _graph_nodes(gf)
        clock = NodeClock({a for a, _, op in nodes if op not in NO_OPS},
                          time.thread_time_ns if cpu_clock else time.perf_counter_ns)
        for _ in range(repetitions):
            rewind()
            timer.node_clock = None
            n0 = len(timer.seconds)
            batch(toks)
            plain.append(sum(timer.seconds[n0:]))
            rewind()
            timer.node_clock = clock
            model.sched.set_eval_callback(clock)
            try:
                batch(toks)
            finally:
                model.sched.clear_eval_callback()
                timer.node_clock = None
        if clock.errors:
            raise RuntimeError(f"profiling callback failed: {clock.errors[0]!r}")
        if any(g is not gf and ctypes.addressof(g.contents) != ctypes.addressof(gf.contents)
               for g in timer.graphs):
            raise RuntimeError("the profiled ubatch used more than one graph (more tokens than one ubatch?)")
    records = [(name, op, [run.get(addr, 0.0) for run in clock.runs]) for addr, name, op in nodes]
    kind = "tg" if decode else "pp"
    return make_profile(records, len(nodes), test=test or (f"tg1@{len(past)}" if decode else f"pp{len(toks)}"),
                        kind=kind, n_tokens=len(toks), n_seqs=n_seqs, n_past=len(past),
                        threads=threads,
                        repetitions=repetitions,
                        plain_s=statistics.fmean(plain) if plain else 0.0)


# ----------------------------------------------------------------------------------------------
# Output
# ----------------------------------------------------------------------------------------------
def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}"


def format_profiles(profiles: Sequence[OpProfile | dict[str, Any]], top: int = 0) -> str:
    """Markdown: one table of ops and one of groups, a column pair (ms, share) per profile."""
    docs = [p.as_dict() if isinstance(p, OpProfile) else p for p in profiles]
    if not docs:
        return ""
    heads = [f"{d.get('engine', 'deltarun')} {d['test']}" for d in docs]
    lines: list[str] = []

    def table(label: str, key: str, order: list[str]) -> None:
        lines.append("| " + label + " | " + " | ".join(f"{h} ms | {h} %" for h in heads) + " |")
        lines.append("|---|" + "---|---|" * len(docs))
        for name in order:
            cells = []
            for d in docs:
                row = next((r for r in d[key] if r[label] == name), None)
                cells += ([_ms(row["seconds"]), f"{100 * row['share']:.1f}"] if row else ["", ""])
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("| **total** | " + " | ".join(f"**{_ms(d['total_s'])}** | 100.0" for d in docs) + " |")

    seen: dict[str, float] = {}
    for d in docs:
        for r in d["ops"]:
            seen[r["op"]] = max(seen.get(r["op"], 0.0), r["share"])
    ops = sorted(seen, key=lambda k: -seen[k])
    if top:
        ops = ops[:top]
    table("op", "ops", ops)
    lines.append("")
    table("group", "groups", list(GROUPS))
    lines.append("")
    for h, d in zip(heads, docs):
        over = d.get("overhead")
        if over is not None:
            lines.append(f"{h}: {d['n_computed']} computed nodes of {d['n_nodes']}; compute without the "
                         f"callback {_ms(d['plain_s'])} ms, with it {_ms(d['total_s'])} ms "
                         f"(overhead {100 * over:+.1f} %, {d['overhead_per_node_us']:.1f} us per node)")
        else:
            lines.append(f"{h}: {d['n_computed']} computed nodes of {d['n_nodes']}, {_ms(d['total_s'])} ms")
    return "\n".join(lines)


__all__ = ["GROUPS", "NO_OPS", "NodeTime", "OpProfile", "classify_nodes", "make_profile", "profile_ubatch",
           "format_profiles", "base_name", "NodeClock"]
