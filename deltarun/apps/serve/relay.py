"""Request plumbing every API of the server shares: a request's body read and parsed, its CPU work
run off the event loop, and the relay that carries the worker's events for one job to its handler.

Chat Completions (`app.py`), Anthropic Messages (`messages_api.py`) and OpenAI Responses
(`responses_api.py`) each turn a body into `GenParams` with these and read `Event`s back through a
`Relay`: one path from the HTTP handlers to the worker.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, AsyncIterator, Callable, TypeVar

import anyio.to_thread
from anyio import CapacityLimiter
from starlette.requests import Request

from deltarun.apps.serve.output import Delta
from deltarun.apps.serve.protocol import ApiError, parse_json_body, prompt_chars
from deltarun.apps.serve.worker import Event, GenParams, Job

DISCONNECT_POLL_S = 0.25
#: Threads doing a request's CPU work at once (parsing, templates, tokenizing, grammars): each one
#: more makes the event loop wait longer for the GIL (about one switch interval, 5 ms, each)
CPU_THREADS = 2
_cpu = CapacityLimiter(CPU_THREADS)
#: Text per token of the context that /tokenize and a prompt may have before tokenizing: text longer
#: than the context's tokens at this many characters each is refused without tokenizing it (an
#: English token is about 4 characters; 16 leaves room for long runs of spaces or symbols)
MAX_CHARS_PER_TOKEN = 16
T = TypeVar("T")


async def run_cpu(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` in a worker thread, at most CPU_THREADS at once: a request's CPU work, off the event
    loop (CPU work of other requests waits for a thread rather than slowing the loop)."""
    return await anyio.to_thread.run_sync(fn, *args, limiter=_cpu)


async def read_json(request: Request, limit: int) -> Any:
    """The request's JSON body: at most `limit` bytes (413 before reading more), parsed and checked
    off the event loop (`protocol.parse_json_body`)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(f"the request body has {declared} bytes; the limit is {limit}", status=413,
                       code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(f"the request body exceeds the limit of {limit} bytes", status=413, code="body_too_large")
        chunks.append(chunk)
    return await run_cpu(parse_json_body, b"".join(chunks))


def check_prompt_size(req: Any, n_ctx: int, param: str) -> None:
    """Refuse, before rendering and tokenizing it, text that cannot fit the context (see
    MAX_CHARS_PER_TOKEN)."""
    n = prompt_chars(req)
    if n > n_ctx * MAX_CHARS_PER_TOKEN:
        raise ApiError(f"the prompt has {n} characters; the context holds {n_ctx} tokens, which is at most "
                       f"{n_ctx * MAX_CHARS_PER_TOKEN} characters here", param=param, code="context_length_exceeded",
                       type="exceed_context_size_error")


class Mailbox:
    """Carries worker events to the event loop, waking it once per worker step.

    Every `call_soon_threadsafe` writes to the loop's self-pipe and then waits for the GIL the
    woken loop holds: measured at about 3-5 ms per event with 8 streams on 2 busy cores, a third
    of the worker's time when done per token. The worker posts during a step and calls `wake`
    once at its end (`Worker.after_step`).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, Event]] = []
        self._scheduled = False

    def post(self, queue: asyncio.Queue, ev: Event) -> None:
        with self._lock:
            self._pending.append((queue, ev))

    def wake(self) -> None:
        with self._lock:
            if self._scheduled or not self._pending:
                return
            self._scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:       # the loop is gone (server stopped)
            pass

    def _deliver(self) -> None:
        with self._lock:
            batch, self._pending, self._scheduled = self._pending, [], False
        for queue, ev in batch:
            queue.put_nowait(ev)


class Relay:
    """A job plus the asyncio queue its events arrive on (put there from the worker thread)."""

    def __init__(self, state: Any, params: GenParams):   # state: app.ServerState
        self.state = state
        mailbox = state.mailbox()
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        queue = self.queue
        self.job = Job(params, lambda ev: mailbox.post(queue, ev))
        state.worker.submit(self.job)
        self.finished = False
        self._held: Event | None = None     # taken from the queue by _merge_queued, not yet yielded

    def _merge_queued(self, ev: Event) -> Event:
        """`ev` plus the text events already queued behind it, as one event (a stream only).

        While the event loop keeps up, each step's token is its own event; when it falls behind
        (both cores busy), a stream's tokens of several steps are sent as one chunk instead of one
        chunk, JSON encoding and socket write each, as a client reading the socket late would have
        received them in one read anyway. The end of the job (finish, error) stays its own event.
        """
        if not plain_event(ev):
            return ev
        while not self.queue.empty() and self._held is None:
            nxt = self.queue.get_nowait()
            if not plain_event(nxt):
                self._held = nxt
                break
            if nxt.delta is not None:
                if ev.delta is None:
                    ev.delta = Delta()
                ev.delta.add(nxt.delta)
            if nxt.logprobs:
                ev.logprobs = (ev.logprobs or []) + nxt.logprobs
        return ev

    async def events(self, request: Request | None = None) -> AsyncIterator[Event]:
        """Events until the job ends; with `request`, a client disconnect cancels the job. A stream
        (no `request`: its response notices the disconnect) gets queued text events merged
        (`_merge_queued`)."""
        loop = asyncio.get_running_loop()
        checked = loop.time()
        try:
            while True:
                if request is None and self._held is not None:
                    ev, self._held = self._held, None
                elif request is None:
                    ev = await self.queue.get()
                else:                # events may keep coming: check the connection every so often
                    try:
                        ev = await asyncio.wait_for(self.queue.get(), DISCONNECT_POLL_S)
                    except asyncio.TimeoutError:
                        ev = None
                    if loop.time() - checked >= DISCONNECT_POLL_S:
                        checked = loop.time()
                        if await request.is_disconnected():
                            return
                    if ev is None:
                        continue
                if request is None:
                    ev = self._merge_queued(ev)
                if ev.finish_reason is not None:
                    self.state.answered(self.job.params, ev)
                yield ev
                if ev.finish_reason is not None or ev.error is not None:
                    self.finished = True
                    return
        finally:
            if not self.finished:
                self.job.cancel()


def plain_event(ev: Event) -> bool:
    """A text (or logprobs) event that is neither the end of the job nor an error."""
    return ev.finish_reason is None and ev.error is None and ev.result is None


