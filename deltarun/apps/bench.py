"""llama-bench style throughput measurements: prompt processing (pp) and token generation (tg).

    results = run_bench(BenchConfig(model=path, n_prompt=[512], n_gen=[128], threads=[8], batch=[512]))
    print(format_markdown(results))

Tests
-----
- ``pp<P>``: P random tokens evaluated from an empty state, in ubatches of ``batch`` tokens
  (`Model.eval`); tokens/s = P / seconds.
- ``tg<N>``: after a short prompt of TG_PROMPT tokens (not timed), N single-token evaluations,
  each feeding the argmax of the previous logits; tokens/s = N / seconds.

Each test runs once as a warm-up (builds the graphs of every shape it uses) and then
`repetitions` times; the result is the mean and sample standard deviation of the per-repetition
tokens/s (as llama-bench reports them). Times come from `time.perf_counter`.

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
         "backend": str, "gpu_layers": int | null, "threads": int, "batch": int, "repetitions": int,
         "samples_s": [float], "samples_tps": [float],
         "avg_s": float, "avg_tps": float, "stddev_tps": float}
      ]
    }

``size_bytes`` and ``n_params`` count every tensor in the file (llama-bench's model size and
parameter count). ``gpu_layers`` is the --gpu-layers value (null: everything on the backend's
device; with --rpc the backend is "rpc:HOST:PORT+...+cpu (a/b/c layers)"). Rows come in grid order: backend, gpu_layers, batch, threads, then the pp tests, then
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
from typing import Any, Callable, Iterator, Sequence

import numpy as np

import deltarun
from deltarun.runner.errors import DeltarunError
from deltarun.runner.units import format_bytes, format_count

SCHEMA = "deltarun-bench"
SCHEMA_VERSION = 1
TG_PROMPT = 16    # tokens evaluated (untimed) before a tg test, so generation starts from a real state
TOKEN_SEED = 1234


def machine_info() -> dict[str, Any]:
    from deltarun.runner.backend import cpu_features

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


def model_info(model: Any) -> dict[str, Any]:
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
    batch: Sequence[int] = (512,)
    backends: Sequence[str] = ("cpu",)
    gpu_layers: Sequence[int] = ()       # empty: everything on the backend's device
    repetitions: int = 5
    kv_type: str = "f16"
    delta_net: str = "fused"
    rpc: str | None = None               # --rpc HOST:PORT[,...]: layers split with these servers
    tensor_split: str | None = None      # --tensor-split with --rpc


@dataclass
class BenchResult:
    test: str
    kind: str
    n_prompt: int
    n_gen: int
    backend: str
    gpu_layers: int | None
    threads: int
    batch: int
    repetitions: int
    samples_s: list[float] = field(default_factory=list)
    samples_tps: list[float] = field(default_factory=list)

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

    def as_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "deltarun_version": deltarun.__version__,
                "machine": self.machine, "model": self.model, "settings": self.settings,
                "results": [r.as_dict() for r in self.results]}


def _time_pp(model: Any, tokens: list[int]) -> float:
    model.reset()
    t0 = time.perf_counter()
    model.eval(tokens)
    return time.perf_counter() - t0


def _time_tg(model: Any, prompt: list[int], n: int) -> float:
    model.reset()
    logits = model.eval(prompt)
    t0 = time.perf_counter()
    for _ in range(n):
        logits = model.eval([int(np.argmax(logits))])
    return time.perf_counter() - t0


def bench_context(cfg: BenchConfig) -> int:
    """Context size that fits every test of the grid."""
    need = max([p for p in cfg.n_prompt] + [TG_PROMPT + n for n in cfg.n_gen if n > 0] + [1])
    return need


def iter_bench(cfg: BenchConfig, settings_out: dict[str, Any] | None = None,
               info_out: dict[str, Any] | None = None) -> Iterator[BenchResult]:
    """Run the grid, yielding each result as it is measured."""
    from deltarun.runner.backend import physical_cores
    from deltarun.runner.model import Model

    if cfg.repetitions < 1:
        raise DeltarunError("repetitions must be at least 1")
    pps = [p for p in cfg.n_prompt if p > 0]
    tgs = [n for n in cfg.n_gen if n > 0]
    if not pps and not tgs:
        raise DeltarunError("nothing to measure: every -p and -n is 0")
    threads = list(cfg.threads) or [physical_cores()]
    n_ctx = bench_context(cfg)
    if settings_out is not None:
        settings_out.update(repetitions=cfg.repetitions, tg_prompt=TG_PROMPT, kv_type=cfg.kv_type,
                            delta_net=cfg.delta_net, n_ctx=n_ctx)
    gpu_layers: list[int | None] = list(cfg.gpu_layers) or [None]
    grid = [(b, ngl, batch) for b in cfg.backends for ngl in gpu_layers for batch in cfg.batch]
    for backend, ngl, batch in grid:
        with Model(cfg.model, backend=backend, n_ctx=n_ctx, n_batch=batch, n_threads=threads[0],
                   kv_type=cfg.kv_type, delta_net=cfg.delta_net, gpu_layers=ngl, rpc=cfg.rpc,
                   tensor_split=cfg.tensor_split) as m:
            if info_out is not None and not info_out:
                info_out.update(model_info(m))
            rng = np.random.default_rng(TOKEN_SEED)
            tokens = rng.integers(0, m.hp.n_vocab, size=max(pps + [TG_PROMPT]), dtype=np.int64).tolist()
            for t in threads:
                m.backend.set_threads(t)
                jobs: list[tuple[str, int, int, Callable[[], float]]] = []
                for p in pps:
                    jobs.append(("pp", p, 0, lambda p=p: _time_pp(m, tokens[:p])))
                for n in tgs:
                    jobs.append(("tg", 0, n, lambda n=n: _time_tg(m, tokens[:TG_PROMPT], n)))
                for kind, p, n, run in jobs:
                    run()  # warm-up: builds every graph shape the test uses
                    r = BenchResult(test=f"{kind}{p or n}", kind=kind, n_prompt=p, n_gen=n,
                                    backend=backend_label(m), gpu_layers=ngl, threads=t, batch=batch,
                                    repetitions=cfg.repetitions)
                    for _ in range(cfg.repetitions):
                        s = run()
                        r.samples_s.append(s)
                        r.samples_tps.append((p or n) / s if s > 0 else float("inf"))
                    yield r
            m.reset()


def backend_label(m: Any) -> str:
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
    results = list(iter_bench(cfg, settings, info))
    return BenchReport(machine_info(), info, settings, results)


# --------------------------------------------------------------------------------------------- output
MD_COLUMNS = ("model", "size", "params", "backend", "ngl", "threads", "n_batch", "test", "t/s")


def markdown_header() -> str:
    head = "| " + " | ".join(MD_COLUMNS) + " |"
    rule = "| " + " | ".join("-" * len(c) for c in MD_COLUMNS) + " |"
    return head + "\n" + rule


def markdown_row(model: dict[str, Any], r: BenchResult) -> str:
    name = model.get("name") or Path(model.get("path", "?")).name
    cells = (str(name), format_bytes(model.get("size_bytes", 0)), format_count(model.get("n_params", 0)),
             r.backend, "all" if r.gpu_layers is None else str(r.gpu_layers), str(r.threads), str(r.batch),
             r.test, f"{r.avg_tps:.2f} ± {r.stddev_tps:.2f}")
    return "| " + " | ".join(cells) + " |"


def to_markdown(report: BenchReport) -> str:
    return "\n".join([markdown_header()] + [markdown_row(report.model, r) for r in report.results])


def to_json(report: BenchReport) -> str:
    return json.dumps(report.as_dict(), indent=2)


CSV_FIELDS = ("model", "size_bytes", "n_params", "backend", "gpu_layers", "threads", "batch", "test", "kind",
              "n_prompt", "n_gen", "repetitions", "avg_s", "avg_tps", "stddev_tps")


def to_csv(report: BenchReport) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_FIELDS)
    for r in report.results:
        d = r.as_dict()
        w.writerow([report.model.get("path"), report.model.get("size_bytes"), report.model.get("n_params")]
                   + [d[k] for k in CSV_FIELDS[3:]])
    return buf.getvalue()
