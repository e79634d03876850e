"""Wiring: a model opener + settings -> worker, app and a uvicorn server that ends streams cleanly.

    handle = ServeHandle(open_model, ServeSettings(parallel=4), host="127.0.0.1", port=0)
    with handle:                     # starts uvicorn in a thread, waits for the port
        print(handle.base_url)       # http://127.0.0.1:PORT

`serve_forever` is what the CLI runs: uvicorn in the main thread, where SIGTERM/SIGINT first make
the worker end every stream (a final chunk with finish_reason, then `data: [DONE]`) and refuse
queued requests, then let uvicorn close the connections. The model loads while the server already
answers (`/health` is 503 until it is ready); a model that fails to load stops the server and
its error is raised.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import uvicorn

from deltarun.apps.serve.app import ServerState, create_app
from deltarun.apps.serve.connections import ConnectionLimits, protocol_class
from deltarun.apps.serve.grammar import GrammarFactory
from deltarun.apps.serve.guard import HostPolicy
from deltarun.apps.serve.metrics import Metrics
from deltarun.apps.serve.prompts import PromptBuilder
from deltarun.apps.serve.worker import Worker, end_of_generation_ids
from deltarun.base.chat_template import ChatTemplate
from deltarun.base.gguf_file import GGUFFile
from deltarun.base.registry import projector_for


@dataclass
class ServeSettings:
    parallel: int = 1
    cache_ram_mib: int = 2048
    api_key: str | None = None
    max_queue: int = 64
    chunk: int = 512
    checkpoint_every: int = 1024
    max_body_mib: int = 8
    model_name: str = "deltarun"
    draft: str | None = None          # speculative decoding: "ngram", "mtp" or a draft GGUF's path
    draft_max: int = 8
    rpc: tuple[str, ...] = ()         # RPC endpoints of the model: it then runs in a supervised child process
    supervise: bool = False           # the supervised child process without RPC too (supervisor.py)
    prefill_ahead: bool = True        # evaluate a conversation's likely next prompt start while idle
    allowed_hosts: tuple[str, ...] = ()       # Host names answered besides localhost, IPs and the bound name
    allowed_origins: tuple[str, ...] = ()     # web origins that may call the API (CORS for them); none by default
    expose_model_path: bool = False   # /props reports the model's absolute path (else its file name)
    limits: ConnectionLimits = ConnectionLimits()    # header, body and keep-alive timeouts, connections
    #: opens the draft GGUF with one sequence per slot (n_seq_max = parallel), when draft is a path
    open_draft: Callable[[], Any] | None = None
    mmproj: Path | None = None        # the model's vision tower (mmproj GGUF): chat requests may send images
    #: thinking tokens of a request that names no budget (-1: no limit; llama-server's --reasoning-budget)
    reasoning_budget: int = -1
    #: a chat request ending with an assistant message continues it (llama-server's default;
    #: --no-prefill-assistant: a new answer after it, as OpenAI's API)
    prefill_assistant: bool = True


def _grammar_factory(m: Any) -> GrammarFactory:      # module level: it pickles (supervisor.py)
    return GrammarFactory(m.tokenizer, m.hp.n_vocab, end_of_generation_ids(m))


def build(open_model: Callable[[], Any], s: ServeSettings, host: str = "127.0.0.1") -> tuple[Any, ServerState]:
    """The Starlette app and its state (the worker is not started yet); `host`: the address it will
    be bound to (a name there is an allowed Host).

    With RPC endpoints (or `supervise`) the worker runs in a child process that is restarted when
    it dies (supervisor.SupervisedWorker); `open_model` must then pickle.
    """
    kwargs = dict(n_parallel=s.parallel, max_queue=s.max_queue, cache_bytes=s.cache_ram_mib << 20,
                  chunk=s.chunk, checkpoint_every=s.checkpoint_every, grammar_factory=_grammar_factory,
                  draft=s.draft, draft_max=s.draft_max, open_draft=s.open_draft, mmproj=s.mmproj)
    # the tower's hyper-parameters, read here (the handlers prepare images for it): a file that is not
    # an mmproj fails before the server starts
    vision = projector_for(GGUFFile(s.mmproj)).hp if s.mmproj is not None else None
    if s.rpc or s.supervise:
        from deltarun.apps.serve.supervisor import SupervisedWorker

        worker: Any = SupervisedWorker(open_model, kwargs, endpoints=list(s.rpc), metrics=Metrics())
    else:
        worker = Worker(open_model, metrics=Metrics(), **kwargs)

    def make_builder(w: Worker) -> PromptBuilder:
        return PromptBuilder(w.model, ChatTemplate.from_model(w.model), w.grammars, s.checkpoint_every, vision,
                             reasoning_budget=s.reasoning_budget, prefill_assistant=s.prefill_assistant)

    state = ServerState(worker, make_builder, model_name=s.model_name, api_key=s.api_key,
                        max_body=s.max_body_mib << 20, n_parallel=s.parallel, prefill_ahead=s.prefill_ahead,
                        policy=HostPolicy(host, s.allowed_hosts, s.allowed_origins),
                        expose_model_path=s.expose_model_path)
    return create_app(state), state


class _Server(uvicorn.Server):
    """uvicorn, but a shutdown signal first ends the model's streams (they would otherwise run on)."""

    def __init__(self, config: uvicorn.Config, worker: Worker):
        super().__init__(config)
        self.worker = worker

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.worker.shutdown()
        super().handle_exit(sig, frame)


def _config(app: Any, host: str, port: int, log_level: str, limits: ConnectionLimits) -> uvicorn.Config:
    """uvicorn with the h11 protocol that has head and body deadlines (connections.py). uvicorn counts
    the connection asking against `limit_concurrency`, so one more than the cap: its 503 then only
    answers for request tasks left over beyond the cap, which the protocol enforces itself."""
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10,
                          lifespan="off", access_log=log_level == "debug", http=protocol_class(limits),
                          timeout_keep_alive=limits.keep_alive_s,  # type: ignore[arg-type] - a float works
                          limit_concurrency=limits.max_connections + 1,
                          h11_max_incomplete_event_size=limits.max_header_bytes)


#: How long a thread holding the GIL keeps it while another waits (Python's default is 5 ms): the
#: event loop waits for it behind a request's CPU work in the thread pool and the model thread's
#: bookkeeping; 1 ms cut the loop's p99 stall with hostile requests from ~72 to ~50 ms on 2 busy
#: cores (bench/serve_hostile.py). Threads that do not compete never switch.
SWITCH_INTERVAL_S = 0.001


def serve_forever(open_model: Callable[[], Any], s: ServeSettings, host: str, port: int,
                  log_level: str = "warning", on_ready: Callable[[], None] | None = None) -> None:
    sys.setswitchinterval(SWITCH_INTERVAL_S)     # the process is the server's
    app, state = build(open_model, s, host)
    worker = state.worker
    worker.start()
    server = _Server(_config(app, host, port, log_level, s.limits), worker)

    def watch() -> None:            # a model that fails to load stops the server with its error
        worker.ready.wait()
        if worker.load_error is not None:
            server.should_exit = True
            return
        state.prepare()
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.started and on_ready is not None:
            on_ready()

    threading.Thread(target=watch, daemon=True).start()
    try:
        server.run()
    finally:
        worker.shutdown(wait=30)
    if worker.load_error is not None:
        raise worker.load_error


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServeHandle:
    """A server in a background thread (tests, benchmarks): `with ServeHandle(...) as h: h.base_url`."""

    def __init__(self, open_model: Callable[[], Any], s: ServeSettings, host: str = "127.0.0.1", port: int = 0):
        self.app, self.state = build(open_model, s, host)
        self.host, self.port = host, port or free_port(host)
        self.server = _Server(_config(self.app, self.host, self.port, "warning", s.limits), self.state.worker)
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def worker(self) -> Worker:
        return self.state.worker

    def wait_settled(self, timeout: float = 60.0) -> None:
        """Wait until the worker has nothing left to do, work ahead included."""
        deadline = time.monotonic() + timeout
        while not self.state.settled:
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not settle")
            time.sleep(0.005)

    def start(self, timeout: float = 120.0) -> "ServeHandle":
        self.state.worker.start()
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        if not self.state.worker.ready.wait(max(0.0, deadline - time.monotonic())):
            raise RuntimeError("the model did not load in time")
        if self.state.worker.load_error is not None:
            raise RuntimeError(f"the model failed to load: {self.state.worker.load_error}")
        self.state.prepare()
        return self

    def stop(self) -> None:
        self.state.worker.shutdown()
        self.server.should_exit = True
        self._thread.join(30)
        self.state.worker.shutdown(wait=30)

    def __enter__(self) -> "ServeHandle":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
