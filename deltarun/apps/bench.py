"""llama-bench style throughput measurements: prompt processing (pp) and token generation (tg).

    results = run_bench(BenchConfig(model=path, n_prompt=[512], n_gen=[128], threads=[8], ubatch=[512]))
    print(format_markdown(results))

Tests
-----
- ``pp<P>``: P random tokens evaluated from an empty state, in ubatches of ``ubatch`` tokens
  (`Model.eval`); tokens/s = P / seconds.
- ``tg<N>``: after a short prompt of TG_PROMPT tokens (not timed), N single-token evaluations,
  each feeding the argmax of the previous logits; tokens/s = N / seconds.

- ``tg<N>@d<D>`` (``depth``, llama-bench's -d): the same, after D tokens of context (evaluated
  once, untimed; each repetition restores the recurrent state to that point with
  `Model.checkpoint`/`restore` and overwrites the KV rows after it).
- ``tg<N>x<P>`` (``parallel``): P sequences decoding together, N steps of one token each, every
  step one `Model.eval_batch` call (one ubatch of P tokens), after an untimed TG_PROMPT-token
  prompt per sequence; tokens/s = P * N / seconds (aggregate, what a server decoding P requests
  gets).

Each test runs once as a warm-up (builds the graphs of every shape it uses) and then
`repetitions` times; the result is the mean and sample standard deviation of the per-repetition
tokens/s (as llama-bench reports them). Times come from `time.perf_counter` (`CLOCK`).

JSON schema (`to_json`, `deltarun bench --output json`), version 1::

    {
      "schema": "deltarun-bench", "schema_version": 1,
      "deltarun_version": "0.1.0",
      "machine": {"platform": str, "machine": str, "processor": str, "python": str,
                  "cpu_count": int, "cpu_affinity": int, "ggml_cpu_features": [str]},
      "model": {"path": str, "name": str | null, "file_type": int | null,
                "size_bytes": int, "n_params": int},
      "settings": {"repetitions": int, "tg_prompt": int, "kv_type": str, "delta_net": str,
                   "n_ctx": int},
      "results": [
        {"test": "pp512" | "tg128", "kind": "pp" | "tg", "n_prompt": int, "n_gen": int,
         "backend": str, "gpu_layers": int | null, "threads": int, "ubatch": int, "repetitions": int,
         "samples_s": [float], "samples_tps": [float],
         "avg_s": float, "avg_tps": float, "stddev_tps": float,
         "ubatch_cost": float | null}
      ]
    }

``n_depth`` and ``n_parallel`` (0 and 1 for plain pp/tg rows) are in each result row.
``ubatch_cost`` (pp rows, when the grid measures pp1 too, e.g. ``-p 1,2,4,8``): the row's seconds
over pp1's at the same backend, ngl, ubatch and threads (the markdown table's "x pp1" column);
null elsewhere. pp1 is measured first whatever the order of -p. With
``profile`` the report also has ``"profiles": [...]``, one per backend/ngl/ubatch/threads for a pp
ubatch (min(first -p, ubatch) tokens) and a tg ubatch (one token after TG_PROMPT): the objects of
`deltarun.apps.op_profile.OpProfile.as_dict` (seconds per ggml op and per node group, the
profiling overhead; see that module for how node times are taken).

``size_bytes`` and ``n_params`` count every tensor in the file (llama-bench's model size and
parameter count). ``gpu_layers`` is the --gpu-layers value (null: everything on the backend's
device; with --rpc the backend is "rpc:HOST:PORT+...+cpu (a/b/c layers)"). Rows come in grid order: backend, gpu_layers, ubatch, threads, then the pp tests, then
the tg tests.
"""

from __future__ import annotations

import csv
import io
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np

import deltarun
from deltarun.base.errors import DeltarunError
from deltarun.runner.units import format_bytes, format_count

if TYPE_CHECKING:  # annotations only: the applications open models lazily
    from deltarun.runner.model import Model

SCHEMA = "deltarun-bench"
SCHEMA_VERSION = 1
TG_PROMPT = 16    # tokens evaluated (untimed) before a tg test, so generation starts from a real state
TOKEN_SEED = 1234
#: The clock of every timed run. bench/_deltarun_worker.py --clock cpu sets time.process_time: with
#: one thread, the CPU time of a run, which other processes' time slices on a shared machine do not
#: lengthen (with more threads it would count OpenMP's barrier spinning, so it is not used there).
CLOCK: Callable[[], float] = time.perf_counter


def machine_info() -> dict[str, Any]:
    from deltarun.runner.devices import cpu_features

    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        affinity = os.cpu_count() or 1
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count() or 1,
        "cpu_affinity": affinity,
        "ggml_cpu_features": cpu_features(),
    }


def model_info(model: Model) -> dict[str, Any]:
    """Size and parameter count of every tensor in the file, as llama-bench reports them."""
    f = model.file
    return {
        "path": str(model.path),
        "name": f.get("general.name"),
        "file_type": f.get("general.file_type"),
        "size_bytes": int(sum(t.nbytes for t in f.tensors.values())),
        "n_params": int(sum(t.n_elements for t in f.tensors.values())),
    }


@dataclass
class BenchConfig:
    model: str | Path
    n_prompt: Sequence[int] = (512,)
    n_gen: Sequence[int] = (128,)
    threads: Sequence[int] = ()          # empty: the physical-core default
    ubatch: Sequence[int] = (512,)
    backends: Sequence[str] = ("cpu",)
    gpu_layers: Sequence[int] = ()       # empty: everything on the backend's device
    repetitions: int = 5
    kv_type: str = "f16"
    delta_net: str = "fused"
    depth: Sequence[int] = ()            # tg after this many tokens of context (llama-bench -d)
    parallel: Sequence[int] = ()         # aggregate tg with this many sequences decoding together
    profile: bool = False                # per-op / per-group time of a pp and a tg ubatch
    profile_repetitions: int = 3
    rpc: str | None = None               # --rpc HOST:PORT[,...]: layers split with these servers
    tensor_split: str | None = None      # --tensor-split with --rpc
    repack: bool = True                  # CPU_REPACK layout for the matrices ggml has kernels for
    pin_threads: bool | None = None      # cpu_threads.ThreadPinning: None = when one thread per core


@dataclass
class BenchResult:
    test: str
    kind: str
    n_prompt: int
    n_gen: int
    backend: str
    gpu_layers: int | None
    threads: int
    ubatch: int
    repetitions: int
    samples_s: list[float] = field(default_factory=list)
    samples_tps: list[float] = field(default_factory=list)
    n_depth: int = 0
    n_parallel: int = 1
    #: pp tests when the grid has pp1: this ubatch's seconds over pp1's (same backend, ngl, ubatch,
    #: threads). Decoding is weight-bound, so verifying N draft tokens pays off only while this
    #: stays near 1 (issue 28's targets: pp2 <= 1.15, pp4 <= 1.3, pp8 <= 1.6).
    ubatch_cost: float | None = None

    @property
    def avg_s(self) -> float:
        return statistics.fmean(self.samples_s) if self.samples_s else 0.0

    @property
    def avg_tps(self) -> float:
        return statistics.fmean(self.samples_tps) if self.samples_tps else 0.0

    @property
    def stddev_tps(self) -> float:
        return statistics.stdev(self.samples_tps) if len(self.samples_tps) > 1 else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(avg_s=self.avg_s, avg_tps=self.avg_tps, stddev_tps=self.stddev_tps)
        return d


@dataclass
class BenchReport:
    machine: dict[str, Any]
    model: dict[str, Any]
    settings: dict[str, Any]
    results: list[BenchResult]
    profiles: list[Any] = field(default_factory=list)    # op_profile.OpProfile, with --profile

    def as_dict(self) -> dict[str, Any]:
        d = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "deltarun_version": deltarun.__version__,
             "machine": self.machine, "model": self.model, "settings": self.settings,
             "results": [r.as_dict() for r in self.results]}
        if self.profiles:
            d["profiles"] = [p.as_dict() for p in self.profiles]
        return d


def _time_pp(model: Model, tokens: list[int]) -> float:
    model.reset()
    t0 = CLOCK()
    model.eval(tokens)
    return CLOCK() - t0


def _time_tg(model: Model, prompt: list[int], n: int) -> float:
    model.reset()
    logits = model.eval(prompt)
    t0 = CLOCK()
    for _ in range(n):
        logits = model.eval([int(np.argmax(logits))])
    return CLOCK() - t0


def _time_tg_depth(model: Model, start: Any, first_logits: np.ndarray, n: int) -> float:
    """N decode steps from a checkpoint taken after the depth prompt (`start`)."""
    model.restore(start)
    logits = first_logits
    t0 = CLOCK()
    for _ in range(n):
        logits = model.eval([int(np.argmax(logits))])
    return CLOCK() - t0


def parallel_prompts(tokens: list[int], n_seqs: int) -> dict[int, list[int]]:
    """TG_PROMPT tokens per sequence, a different slice of the random tokens for each."""
    return {s: [tokens[(s * TG_PROMPT + i) % len(tokens)] for i in range(TG_PROMPT)] for s in range(n_seqs)}


def _time_tg_parallel(model: Model, prompts: dict[int, list[int]], n: int) -> float:
    """N steps of P sequences decoding together (one eval_batch per step)."""
    model.reset()
    logits = model.eval_batch(prompts)
    t0 = CLOCK()
    for _ in range(n):
        logits = model.eval_batch({s: [int(np.argmax(row))] for s, row in logits.items()})
    return CLOCK() - t0


def bench_context(cfg: BenchConfig) -> int:
    """Context size that fits every plain pp/tg test of the grid."""
    need = max([p for p in cfg.n_prompt] + [TG_PROMPT + n for n in cfg.n_gen if n > 0] + [1])
    return need


def check_config(cfg: BenchConfig) -> None:
    """Refuse a grid that cannot run, before anything is measured or printed."""
    from deltarun.runner.memory import MAX_CONTEXT

    if cfg.repetitions < 1:
        raise DeltarunError("repetitions must be at least 1")
    tgs = [n for n in cfg.n_gen if n > 0]
    depths = _depths(cfg)
    if (depths or any(p > 0 for p in cfg.parallel)) and not tgs:
        raise DeltarunError("--depth and --parallel measure generation: give -n N > 0")
    if not any(p > 0 for p in cfg.n_prompt) and not tgs and not cfg.profile:
        raise DeltarunError("nothing to measure: every -p and -n is 0")
    longest = max([bench_context(cfg)] + ([max(depths) + max(tgs)] if depths else []))
    if longest > MAX_CONTEXT:
        raise DeltarunError(f"the tests need a context of {longest} tokens, above the longest, {MAX_CONTEXT}")


def _bench_tokens(n_vocab: int, n: int) -> list[int]:
    """The tests' token ids, the same for every model of a vocabulary size (TOKEN_SEED)."""
    return np.random.default_rng(TOKEN_SEED).integers(0, n_vocab, size=n, dtype=np.int64).tolist()


def _depths(cfg: BenchConfig) -> list[int]:
    return [d for d in cfg.depth if d > 0]


def iter_bench(cfg: BenchConfig, settings_out: dict[str, Any] | None = None,
               info_out: dict[str, Any] | None = None, profiles_out: list[Any] | None = None
               ) -> Iterator[BenchResult]:
    """Run the grid, yielding each result as it is measured (profiles go to `profiles_out`).

    Plain pp/tg tests run on a model opened with the context they need (`bench_context`), as
    before; depth tests and parallel tests each open the model again with the context / number
    of sequences they need, so they never change the plain tests' setup."""
    from deltarun.runner.devices import physical_cores
    from deltarun.runner.model import Model

    check_config(cfg)
    pps = sorted((p for p in cfg.n_prompt if p > 0), key=lambda p: p != 1)   # pp1 first: ubatch_cost
    tgs = [n for n in cfg.n_gen if n > 0]
    depths = _depths(cfg)
    parallel = [p for p in cfg.parallel if p > 0]
    threads = list(cfg.threads) or [physical_cores()]
    n_ctx = bench_context(cfg)
    if settings_out is not None:
        settings_out.update(repetitions=cfg.repetitions, tg_prompt=TG_PROMPT, kv_type=cfg.kv_type,
                            delta_net=cfg.delta_net, n_ctx=n_ctx, repack=cfg.repack,
                            pin_threads="auto" if cfg.pin_threads is None else cfg.pin_threads)
        if depths:
            settings_out["depth"] = depths
        if parallel:
            settings_out["parallel"] = parallel
    gpu_layers: list[int | None] = list(cfg.gpu_layers) or [None]
    grid = [(b, ngl, ubatch) for b in cfg.backends for ngl in gpu_layers for ubatch in cfg.ubatch]

    def open_model(backend: str, ngl: int | None, ubatch: int, ctx: int, n_seq_max: int = 1) -> Any:
        return Model(cfg.model, backend=backend, n_ctx=ctx, n_ubatch=ubatch, n_threads=threads[0],
                     kv_type=cfg.kv_type, delta_net=cfg.delta_net, gpu_layers=ngl, n_seq_max=n_seq_max,
                     rpc=cfg.rpc, tensor_split=cfg.tensor_split, repack=cfg.repack, pin_threads=cfg.pin_threads)

    def measure(m: Model, ngl: int | None, ubatch: int, t: int, kind: str, p: int, n: int,
                run: Callable[[], float], test: str, depth: int = 0, n_par: int = 1) -> BenchResult:
        run()  # warm-up: builds every graph shape the test uses
        r = BenchResult(test=test, kind=kind, n_prompt=p, n_gen=n, backend=backend_label(m), gpu_layers=ngl,
                        threads=t, ubatch=ubatch, repetitions=cfg.repetitions, n_depth=depth, n_parallel=n_par)
        for _ in range(cfg.repetitions):
            sec = run()
            r.samples_s.append(sec)
            r.samples_tps.append((p or n) * n_par / sec if sec > 0 else float("inf"))
        if kind == "pp" and p == 1:
            one_token[(backend, ngl, ubatch, t)] = r.avg_s
        elif kind == "pp" and (backend, ngl, ubatch, t) in one_token:
            r.ubatch_cost = r.avg_s / one_token[(backend, ngl, ubatch, t)]
        return r

    one_token: dict[tuple[Any, ...], float] = {}   # pp1 seconds per grid point, for ubatch_cost

    for backend, ngl, ubatch in grid:
        n_pp_profile = min(pps[0] if pps else 512, ubatch)
        ctx = max(n_ctx, n_pp_profile if cfg.profile else 0,
                  TG_PROMPT + 2 + 2 * cfg.profile_repetitions if cfg.profile else 0)   # decode runs
        with open_model(backend, ngl, ubatch, ctx) as m:
            if info_out is not None and not info_out:
                info_out.update(model_info(m))
            n_tok = max(pps + [TG_PROMPT] + ([n_pp_profile] if cfg.profile else []))
            tokens = _bench_tokens(m.hp.n_vocab, n_tok)
            for t in threads:
                m.backend.set_threads(t)
                for p in pps:
                    yield measure(m, ngl, ubatch, t, "pp", p, 0, lambda p=p: _time_pp(m, tokens[:p]), f"pp{p}")
                for n in tgs:
                    yield measure(m, ngl, ubatch, t, "tg", 0, n, lambda n=n: _time_tg(m, tokens[:TG_PROMPT], n),
                                  f"tg{n}")
                if cfg.profile and profiles_out is not None:
                    profiles_out.extend(_profiles(m, tokens, n_pp_profile, t, cfg.profile_repetitions))
            m.reset()
        if depths:
            with open_model(backend, ngl, ubatch, max(depths) + max(tgs)) as m:
                context = _bench_tokens(m.hp.n_vocab, max(depths))   # once its cache is allocated
                for t in threads:
                    m.backend.set_threads(t)
                    for d in depths:
                        m.reset()
                        first = m.eval(context[:d])
                        start = m.checkpoint()
                        for n in tgs:
                            yield measure(m, ngl, ubatch, t, "tg", 0, n,
                                          lambda n=n, start=start, first=first: _time_tg_depth(m, start, first, n),
                                          f"tg{n}@d{d}", depth=d)
        if parallel:
            with open_model(backend, ngl, ubatch, TG_PROMPT + max(tgs), n_seq_max=max(parallel)) as m:
                for t in threads:
                    m.backend.set_threads(t)
                    for n_par in parallel:
                        prompts = parallel_prompts(tokens, n_par)
                        for n in tgs:
                            yield measure(m, ngl, ubatch, t, "tg", 0, n,
                                          lambda n=n, prompts=prompts: _time_tg_parallel(m, prompts, n),
                                          f"tg{n}x{n_par}", n_par=n_par)


def _profiles(m: Model, tokens: list[int], n_pp: int, threads: int, repetitions: int) -> list[Any]:
    """Per-op profiles of a pp ubatch of n_pp tokens and of a one-token decode after TG_PROMPT."""
    from deltarun.apps.op_profile import profile_ubatch

    pp = profile_ubatch(m, tokens[:n_pp], repetitions=repetitions, threads=threads, test=f"pp{n_pp}")
    tg = profile_ubatch(m, tokens[:1], n_past_tokens=tokens[:TG_PROMPT],
                        repetitions=repetitions, threads=threads, test=f"tg1@{TG_PROMPT}")
    m.reset()
    return [pp, tg]


def backend_label(m: Model) -> str:
    """The backend column: the local backend, plus the RPC devices and layers per device when split."""
    split = getattr(m.placement, "slots", None)
    if split is None:
        return m.backend.name
    devs = m.placement.devices
    counts = "/".join(str(len(m.placement.layers_on(i))) for i in range(len(devs)))
    return "+".join(d.name for d in devs) + f" ({counts} layers)"


def run_bench(cfg: BenchConfig) -> BenchReport:
    settings: dict[str, Any] = {}
    info: dict[str, Any] = {}
    profiles: list[Any] = []
    results = list(iter_bench(cfg, settings, info, profiles))
    return BenchReport(machine_info(), info, settings, results, profiles)


# --------------------------------------------------------------------------------------------- output
MD_COLUMNS = ("model", "size", "params", "backend", "ngl", "threads", "n_ubatch", "test", "t/s")
COST_COLUMN = "x pp1"   # with ubatch costs: seconds of the ubatch relative to one token's


def has_ubatch_cost(n_prompt: Sequence[int]) -> bool:
    """Whether a grid reports ubatch costs: it measures pp1 and at least one larger ubatch."""
    return 1 in n_prompt and any(p > 1 for p in n_prompt)


def markdown_header(cost: bool = False) -> str:
    cols = MD_COLUMNS + ((COST_COLUMN,) if cost else ())
    head = "| " + " | ".join(cols) + " |"
    rule = "| " + " | ".join("-" * len(c) for c in cols) + " |"
    return head + "\n" + rule


def markdown_row(model: dict[str, Any], r: BenchResult, cost: bool = False) -> str:
    name = model.get("name") or Path(model.get("path", "?")).name
    cells = (str(name), format_bytes(model.get("size_bytes", 0)), format_count(model.get("n_params", 0)),
             r.backend, "all" if r.gpu_layers is None else str(r.gpu_layers), str(r.threads), str(r.ubatch),
             r.test, f"{r.avg_tps:.2f} ± {r.stddev_tps:.2f}")
    if cost:
        cells += ("1.00" if r.kind == "pp" and r.n_prompt == 1
                  else "" if r.ubatch_cost is None else f"{r.ubatch_cost:.2f}",)
    return "| " + " | ".join(cells) + " |"


def to_markdown(report: BenchReport) -> str:
    cost = any(r.ubatch_cost is not None for r in report.results)
    return "\n".join([markdown_header(cost)] + [markdown_row(report.model, r, cost) for r in report.results])


def to_json(report: BenchReport) -> str:
    return json.dumps(report.as_dict(), indent=2)


CSV_FIELDS = ("model", "size_bytes", "n_params", "backend", "gpu_layers", "threads", "ubatch", "test", "kind",
              "n_prompt", "n_gen", "repetitions", "avg_s", "avg_tps", "stddev_tps", "n_depth", "n_parallel",
              "ubatch_cost")


def to_csv(report: BenchReport) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_FIELDS)
    for r in report.results:
        d = r.as_dict()
        w.writerow([report.model.get("path"), report.model.get("size_bytes"), report.model.get("n_params")]
                   + [d[k] for k in CSV_FIELDS[3:]])
    return buf.getvalue()
