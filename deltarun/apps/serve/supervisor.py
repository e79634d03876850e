"""The model in a supervised child process: `serve --rpc` keeps answering when an RPC server goes away.

Why a process. ggml 0.15.3's RPC client has no error return for a broken connection: a failed
send or receive is `GGML_ABORT` (RPC_STATUS_ASSERT in ggml-rpc.cpp), and the compute that hit it
cannot be unwound from Python. `deltarun.runner.rpc` turns that abort into one line and exit 9,
right for a command but fatal for a server. So with `--rpc` the `Model` and the `Worker` thread
that owns it live in a child process (spawned, not forked: the parent runs threads), and this
module's `SupervisedWorker` stands in for the `Worker` in the HTTP process, with the same surface
(`submit`, `call`, `shutdown`, `counts`, `ready`, `load_error`, `model`, `grammars`, `metrics`,
`after_step`). When the child ends:

- every request it was running gets a 503 `unavailable_error` (code `rpc_server_lost`, naming the
  endpoint from the child's last line; a stream ends with that error object, then `[DONE]`, as for
  any other failure), and `/health` and new requests answer 503 with `Retry-After` meanwhile;
- the supervisor probes each endpoint with the protocol's HELLO (`rpc.probe`), with backoff
  (0.5 s doubling to 5 s), and starts a new child once all answer: it reloads the model and
  reconnects, and requests work again without restarting `deltarun serve`. The host-RAM prompt
  cache lived in the child and is lost with it.

An idle child would not notice a lost server until its next request; a watchdog thread in the
child looks at ggml's sockets every WATCH_S (a non-blocking peek, `rpc.broken_connections`) and
ends the child as soon as a server closes its end, so `/health` turns 503 within about a second.
A vanished host is noticed by the kernel keepalive / TCP_USER_TIMEOUT that `rpc.harden_sockets`
sets (about 20-25 s), the same as for the commands.

What crosses the process boundary (pickled over a `multiprocessing` pipe): `GenParams` in, and per
worker step one message with that step's `Event`s, the `Metrics` calls the worker made (replayed
on the parent's `Metrics`, so counters survive a restart) and the worker's counts; `Worker.call(fn)`
sends `fn` (it must pickle: a module-level function or a `functools.partial` of one) and its
result back. The parent keeps what the handlers read: the tokenizer and chat template (from the
GGUF's metadata, read in the parent), the grammar factory, and `ModelInfo` (n_ctx, n_ubatch,
rs_slots, hp, path) reported by the first child. Cancellation (a client gone) is forwarded.

Why only with `--rpc`. Without RPC nothing the child could lose is expected to come back (a local
ggml abort is a bug, not an event to ride out), while the split costs a second copy of the
tokenizer and grammar tables, a spawned interpreter (about 1 s more start-up), and a pickled
message per step: 20-30 us of pipe, 0.1-0.3 ms per step end to end on the built-in model's
0.5-1.4 ms steps on a busy 2-core machine (bench/serve_supervised.py). In-process serving also lets
library users and tests pass any callable as the model opener and read the `Model` directly.
The split is one class: `ServeSettings(supervise=True)` uses it without RPC too (the tests do).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import multiprocessing
import pickle
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Callable

from deltarun.apps.serve.metrics import Metrics
from deltarun.apps.serve.protocol import ApiError
from deltarun.apps.serve.worker import Event, Job, Worker
from deltarun.base.errors import DeltarunError

BACKOFF_MIN_S = 0.5
BACKOFF_MAX_S = 5.0
PROBE_TIMEOUT_S = 2.0
WATCH_S = 1.0
POLL_S = 0.1            # the parent checks for cancelled jobs this often while no message arrives
STOP_WAIT_S = 30.0


class ModelInfo:
    """What the HTTP side reads of the model, in the parent: sizes from the child, tokenizer from the GGUF."""

    def __init__(self, path: str | Path, n_ctx: int, n_ubatch: int, rs_slots: int, hp: Any):
        from deltarun.base.gguf_file import GGUFFile

        self.path = Path(path)
        self.n_ctx, self.n_ubatch, self.rs_slots, self.hp = n_ctx, n_ubatch, rs_slots, hp
        self.file = GGUFFile(self.path)
        self.tokenizer = self.file.tokenizer()


def _unavailable(message: str, code: str) -> ApiError:
    return ApiError(message, status=503, type="unavailable_error", code=code, headers={"Retry-After": "1"})


def _shutting_down() -> ApiError:
    return ApiError("the server is shutting down", status=503, type="unavailable_error", code="shutting_down")


# ----------------------------------------------------------------------------------------------
# The child
# ----------------------------------------------------------------------------------------------
class _Outbox:
    """The child's side of the pipe: events and metric calls of a step go out in one message."""

    def __init__(self, conn: Any, worker_counts: Callable[[], tuple[int, int]]):
        self.conn = conn
        self.counts = worker_counts
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._events: list[tuple[int, Event]] = []
        self._metric_calls: list[tuple[tuple[str, ...], tuple, dict]] = []

    def event(self, jid: int, ev: Event) -> None:
        with self._lock:
            self._events.append((jid, ev))

    def metric_call(self, path: tuple[str, ...], args: tuple, kwargs: dict) -> None:
        with self._lock:
            self._metric_calls.append((path, args, kwargs))

    def flush(self) -> None:
        with self._lock:
            events, self._events = self._events, []
            calls, self._metric_calls = self._metric_calls, []
        if events or calls:
            self.send(("step", events, calls, self.counts()))

    def send(self, msg: tuple, timeout: float = -1) -> bool:
        """Whether `msg` went out (a parent that is gone is noticed by the receive loop)."""
        if not self._send_lock.acquire(timeout=timeout):
            return False
        try:
            self.conn.send(msg)
            return True
        except (OSError, ValueError):
            return False
        finally:
            self._send_lock.release()


class _MetricsRecorder:
    """Stands in for `Metrics` in the child: `metrics.running.set(3)` is recorded, replayed by the parent."""

    def __init__(self, outbox: _Outbox, path: tuple[str, ...] = ()):
        self._outbox, self._path = outbox, path

    def __getattr__(self, name: str) -> "_MetricsRecorder":
        if name.startswith("__"):
            raise AttributeError(name)
        return _MetricsRecorder(self._outbox, self._path + (name,))

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self._outbox.metric_call(self._path, args, kwargs)


def _portable_error(e: BaseException) -> BaseException:
    """`e` if it survives pickling, else a DeltarunError with its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return DeltarunError(f"{type(e).__name__}: {e}")


def _watch_rpc(stop: threading.Event) -> None:
    """End the child as soon as an RPC server closes its connection, even while nothing runs."""
    from deltarun.runner import rpc

    while not stop.wait(WATCH_S):
        if rpc.registered():
            lost = rpc.broken_connections()
            if lost:
                rpc.exit_lost(lost, "the server closed the connection")


def _child_main(conn: Any, open_model: Callable[[], Any], worker_kwargs: dict[str, Any]) -> None:
    """The child process: a `Worker` driven by messages from the parent until shutdown or EOF."""
    from tqdm import tqdm

    from deltarun.runner import rpc

    # tqdm (the weight-upload bar) would make a multiprocessing semaphore, which a child that ends by
    # os._exit leaves to the resource tracker's "leaked semaphore" warning: a thread lock does here
    tqdm.set_lock(threading.RLock())
    worker: Worker | None = None
    outbox = _Outbox(conn, lambda: worker.counts if worker is not None else (0, 0))
    rpc.on_lost(lambda line: outbox.send(("lost", line), timeout=1.0))   # the parent prints it, once
    worker = Worker(open_model, metrics=_MetricsRecorder(outbox), **worker_kwargs)   # type: ignore[arg-type]
    worker.after_step = outbox.flush
    worker.start()
    worker.ready.wait()
    if worker.load_error is not None:
        outbox.send(("load_error", _portable_error(worker.load_error)))
        return
    m = worker.model
    outbox.send(("ready", {"path": str(m.path), "n_ctx": m.n_ctx, "n_ubatch": m.n_ubatch, "rs_slots": m.rs_slots,
                           "hp": m.hp}))
    stop = threading.Event()
    threading.Thread(target=_watch_rpc, args=(stop,), name="deltarun-rpc-watch", daemon=True).start()
    jobs: dict[int, Job] = {}

    def emitter(jid: int) -> Callable[[Event], None]:
        def emit(ev: Event) -> None:
            if ev.finish_reason is not None or ev.error is not None:
                jobs.pop(jid, None)
            outbox.event(jid, ev)
        return emit

    def answer(cid: int, fut: concurrent.futures.Future) -> None:
        e = fut.exception()
        outbox.send(("call", cid, e is None, fut.result() if e is None else _portable_error(e)))

    try:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):      # the parent is gone
                break
            kind = msg[0]
            if kind == "submit":
                _, jid, params = msg
                job = Job(params, emitter(jid))
                jobs[jid] = job
                try:
                    worker.submit(job)
                except ApiError as e:
                    job.emit(Event(error=e))
                    outbox.flush()
            elif kind == "ahead":
                worker.prefill_ahead(msg[1])
            elif kind == "cancel":
                job = jobs.pop(msg[1], None)
                if job is not None:
                    job.cancel()
            elif kind == "call":
                _, cid, fn = msg
                try:
                    worker.call(fn).add_done_callback(lambda f, cid=cid: answer(cid, f))
                except ApiError as e:
                    outbox.send(("call", cid, False, e))
            elif kind == "shutdown":
                break
    finally:
        stop.set()
        worker.shutdown(wait=STOP_WAIT_S)
        outbox.flush()


# ----------------------------------------------------------------------------------------------
# The parent
# ----------------------------------------------------------------------------------------------
class SupervisedWorker:
    """A `Worker` in a child process, restarted (after its RPC servers answer again) when it dies.

    `worker_kwargs` are `Worker`'s keyword arguments less `metrics` (picklable: `grammar_factory`
    must be a module-level function); `open_model` must pickle too (e.g. `functools.partial`).
    `endpoints` are probed before each restart.
    """

    def __init__(self, open_model: Callable[[], Any], worker_kwargs: dict[str, Any], *,
                 endpoints: list[str] | None = None, metrics: Metrics | None = None):
        self._open_model = open_model
        self._kwargs = dict(worker_kwargs)
        self._endpoints = list(endpoints or [])
        self.n_parallel = int(self._kwargs["n_parallel"])
        self.max_queue = int(self._kwargs.get("max_queue", 64))
        self.cache_bytes = int(self._kwargs.get("cache_bytes", 2 << 30))
        self.draft_spec = self._kwargs.get("draft")                 # /props reports these, as Worker's
        self.draft_max = int(self._kwargs.get("draft_max", 8))
        self.metrics = metrics or Metrics()
        self.ready = threading.Event()
        self.load_error: BaseException | None = None
        self.model: ModelInfo | None = None
        self.grammars: Any = None
        #: called after each batch of events is delivered (the app's mailbox wake-up)
        self.after_step: Callable[[], None] | None = None
        #: how many child processes were started (1 + restarts)
        self.n_started = 0
        self._ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._conn: Any = None
        self._proc: Any = None
        self._jobs: dict[int, Job] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count(1)
        self._counts = (0, 0)
        self._down: ApiError | None = None
        self._stopping = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name="deltarun-supervisor", daemon=True)

    # --- the Worker surface ------------------------------------------------------------------------
    @property
    def n_drafted(self) -> int:
        """Drafted tokens verified so far (every child's, replayed on this process's Metrics)."""
        return int(self.metrics.registry.get_sample_value("deltarun_draft_tokens_total") or 0)

    @property
    def n_accepted(self) -> int:
        return int(self.metrics.registry.get_sample_value("deltarun_draft_tokens_accepted_total") or 0)

    def start(self) -> None:
        self._thread.start()

    @property
    def unavailable(self) -> ApiError | None:
        """Why requests are refused right now (a child being restarted), else None."""
        with self._lock:
            if self._stopping:
                return _shutting_down()
            return self._down if self.ready.is_set() and self.load_error is None else None

    def submit(self, job: Job) -> None:
        with self._lock:
            if self._stopping:
                raise _shutting_down()
            if self._down is not None:
                raise self._down
            if self._conn is None:
                raise _unavailable("Loading model", "loading")
            if len(self._jobs) >= self.n_parallel + self.max_queue:    # Worker.submit's limit, seen from here
                running, waiting = self._counts
                raise ApiError(f"the server is busy: {running} requests running and {waiting} waiting", status=503,
                               type="unavailable_error", code="queue_full", headers={"Retry-After": "1"})
            self._jobs[job.id] = job
            self._send(("submit", job.id, job.params))

    def prefill_ahead(self, params: Any) -> None:
        """`Worker.prefill_ahead` in the child (dropped while it is down or loading)."""
        with self._lock:
            if not self._stopping and self._down is None and self._conn is not None:
                self._send(("ahead", params))

    @property
    def idle(self) -> bool:
        """No request of this process's in the child (work ahead there is not seen from here)."""
        return not self._jobs

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run `fn(model)` in the child between two steps; `fn` must pickle."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._stopping:
                raise _shutting_down()
            if self._down is not None or self._conn is None:
                raise self._down or _unavailable("Loading model", "loading")
            cid = next(self._call_ids)
            self._calls[cid] = fut
            self._send(("call", cid, fn))
        return fut

    def shutdown(self, wait: float | None = None) -> None:
        """End every stream (the child's worker does, finish_reason "stop"), stop the child, no restart."""
        with self._lock:
            self._stopping = True
            conn, proc = self._conn, self._proc
            if conn is not None:
                self._send(("shutdown",))
        self._wake.set()
        if conn is None and proc is not None and proc.is_alive():
            proc.terminate()                 # still loading: nothing to end cleanly
        if wait is not None and self._thread.is_alive():
            self._thread.join(wait)

    @property
    def counts(self) -> tuple[int, int]:
        return self._counts

    # --- the supervisor thread ----------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        """Send to the child (the caller holds self._lock); a dead pipe is noticed by the reader."""
        with self._send_lock:
            try:
                self._conn.send(msg)
            except (OSError, ValueError, AttributeError):
                pass

    def _supervise(self) -> None:
        backoff = BACKOFF_MIN_S
        while not self._stopping:
            if self.n_started and not self._endpoints_answer():
                self._wake.wait(backoff)
                backoff = min(2 * backoff, BACKOFF_MAX_S)
                continue
            try:
                served = self._run_child()
            except Exception as e:  # noqa: BLE001 - e.g. no process could be started; never end this thread
                traceback.print_exception(e)
                served = False
                if not self.ready.is_set():
                    self.load_error = DeltarunError(f"the model process could not be started: {e}")
                    self.ready.set()
            if self.load_error is not None:
                return
            backoff = BACKOFF_MIN_S if served else min(2 * backoff, BACKOFF_MAX_S)
            if not served and not self._stopping:
                self._wake.wait(backoff)

    def _endpoints_answer(self) -> bool:
        from deltarun.runner import rpc

        for ep in self._endpoints:
            try:
                rpc.probe(ep, timeout=PROBE_TIMEOUT_S)
            except rpc.RpcError as e:
                with self._lock:
                    self._down = _unavailable(f"{self._down_reason}; waiting for it to come back ({e})",
                                              "rpc_server_lost")
                return False
        return True

    _down_reason = "the model process ended"

    def _run_child(self) -> bool:
        """Start a child, relay its messages until it ends; True if it got to serve."""
        first = self.n_started == 0
        self.n_started += 1
        parent_conn, child_conn = self._ctx.Pipe()
        proc = self._ctx.Process(target=_child_main, args=(child_conn, self._open_model, self._kwargs),
                                 name="deltarun-model", daemon=True)
        with self._lock:
            if self._stopping:
                return False
            self._proc = proc
            proc.start()
        child_conn.close()
        served, lost_line, load_error = False, None, None
        try:
            while True:
                try:
                    if not parent_conn.poll(POLL_S):
                        self._forward_cancels()
                        continue
                    msg = parent_conn.recv()
                except (EOFError, OSError):
                    break
                except Exception as e:  # noqa: BLE001 - a message that does not unpickle: a bug; restart
                    traceback.print_exception(e)
                    proc.kill()
                    break
                kind = msg[0]
                try:
                    if kind == "step":
                        self._deliver(msg[1], msg[2], msg[3])
                    elif kind == "ready":
                        self._on_ready(msg[1], parent_conn)
                        served = True
                    elif kind == "call":
                        with self._lock:
                            fut = self._calls.pop(msg[1], None)
                        if fut is not None and fut.set_running_or_notify_cancel():
                            (fut.set_result if msg[2] else fut.set_exception)(msg[3])
                    elif kind == "lost":
                        lost_line = msg[1]
                    elif kind == "load_error":
                        load_error = msg[1]
                    self._forward_cancels()
                except Exception as e:  # noqa: BLE001 - a bug in relaying: keep the server (and this thread)
                    if kind == "ready":
                        load_error = e
                        proc.kill()
                        break
                    traceback.print_exception(e)
        finally:
            proc.join(STOP_WAIT_S)
            if proc.is_alive():
                proc.kill()
                proc.join(STOP_WAIT_S)
            parent_conn.close()
            self._on_exit(first, proc.exitcode, lost_line, load_error)
        return served

    def _on_ready(self, info: dict[str, Any], conn: Any) -> None:
        if self.model is None:           # the tokenizer and grammars do not change across restarts
            self.model = ModelInfo(info["path"], info["n_ctx"], info["n_ubatch"], info["rs_slots"], info["hp"])
            factory = self._kwargs.get("grammar_factory")
            self.grammars = factory(self.model) if factory is not None else None
        with self._lock:
            self._conn = conn
            self._down = None
            if self._stopping:
                self._send(("shutdown",))
        self.ready.set()

    def _deliver(self, events: list[tuple[int, Event]], calls: list, counts: tuple[int, int]) -> None:
        for path, args, kwargs in calls:
            target: Any = self.metrics
            for name in path:
                target = getattr(target, name)
            target(*args, **kwargs)
        self._counts = counts
        for jid, ev in events:
            with self._lock:
                job = self._jobs.get(jid)
                if job is not None and (ev.finish_reason is not None or ev.error is not None):
                    del self._jobs[jid]
            if job is not None:
                job.emit(ev)
        if self.after_step is not None:
            self.after_step()

    def _forward_cancels(self) -> None:
        with self._lock:
            gone = [jid for jid, job in self._jobs.items() if job.cancelled]
            for jid in gone:
                del self._jobs[jid]
                self._send(("cancel", jid))

    def _on_exit(self, first: bool, exitcode: int | None, lost_line: str | None,
                 load_error: BaseException | None) -> None:
        from deltarun.runner.rpc import RpcError

        if lost_line is not None:
            reason, code = lost_line.removeprefix("error: "), "rpc_server_lost"
            if not (first and not self.ready.is_set()):     # else it is the load error `serve` ends with
                sys.stderr.write(lost_line + "\n")
                sys.stderr.flush()
        elif load_error is not None:
            reason, code = f"the model could not be loaded: {load_error}", "loading_failed"
        elif exitcode == RpcError.exit_code:
            reason, code = "lost an RPC server", "rpc_server_lost"
        else:
            reason, code = f"the model process ended (exit status {exitcode})", "model_process_lost"
        with self._lock:
            self._conn = None
            jobs, self._jobs = self._jobs, {}
            calls, self._calls = self._calls, {}
            self._counts = (0, 0)
            stopping = self._stopping
            if not stopping:
                self._down_reason = reason
                self._down = _unavailable(f"{reason}; restarting the model", code)
            err = _shutting_down() if stopping else self._down
        if first and not self.ready.is_set() and not stopping:
            # the first start failed: `serve` ends with this error, as an in-process load failure does
            self.load_error = load_error if load_error is not None else (
                RpcError(reason) if code == "rpc_server_lost" else DeltarunError(reason))
            self.ready.set()
        self.metrics.running.set(0)
        self.metrics.queued.set(0)
        for job in jobs.values():
            job.emit(Event(error=err))
        for fut in calls.values():
            if fut.set_running_or_notify_cancel():
                fut.set_exception(err)
        if jobs and self.after_step is not None:
            self.after_step()
