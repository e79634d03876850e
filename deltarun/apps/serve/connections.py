"""Connection limits uvicorn does not have: a deadline for the request head and one for the body, and
a cap on open connections.

uvicorn closes a kept-alive connection that stays idle (`timeout_keep_alive`) and bounds the size
of a request head (h11's incomplete-event limit), but a connection that sends nothing after it
opens, or one header byte now and then, stays open for good (each byte cancels the keep-alive
timer), and so does one that stops halfway through its body: a handful of such clients hold every
connection a process can take. `GuardedH11Protocol` is uvicorn's h11 protocol with two deadlines
on what the client owes, counted from when it began to owe it (more bytes do not extend them):

- the request head, from the connection's start or the first byte after a kept-alive idle time:
  `header_timeout_s`, then a 408 and the connection closes;
- the request body, from the end of its head: `body_timeout_s`, then the connection closes (the
  handler reading it sees the client gone).

Beyond `max_connections` open connections a new one gets a 503 and is closed at once. Nothing
bounds the answer: a stream runs as long as its request asks.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("uvicorn.error")


@dataclass(frozen=True)
class ConnectionLimits:
    #: a whole request head: a client sends it in one packet; 10 s leave room for slow links
    header_timeout_s: float = 10.0
    #: a whole request body (the largest, --max-body 8 MiB, at 140 kB/s)
    body_timeout_s: float = 60.0
    #: idle time of a kept-alive connection between requests (uvicorn's default, as httpx's pool)
    keep_alive_s: float = 5.0
    #: open connections (each costs a socket and a little memory; far above what --parallel serves)
    max_connections: int = 256
    #: a request head (h11's default limit, made explicit): long API keys and cookies fit
    max_header_bytes: int = 16 << 10


def protocol_class(limits: ConnectionLimits) -> type["GuardedH11Protocol"]:
    """The protocol class to give uvicorn (`Config(http=...)`), with these limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


def _raw_response(status: int, reason: str, message: str, code: str, extra: str = "") -> bytes:
    """A whole error answer, written to the socket before h11 has a request to answer."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                 else "unavailable_error", "param": None, "code": code}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n{extra}\r\n").encode() + body


class GuardedH11Protocol(H11Protocol):
    limits = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._owed: str | None = None                  # "head" | "body": what the deadline is for
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            log.warning("refused a connection from %s: %d connections are open already", _peer(self.client),
                        len(self.connections) - 1)
            transport.write(_raw_response(503, "Service Unavailable", f"the server has {self.limits.max_connections}"
                                          " connections open; try again later", "too_many_connections",
                                          "retry-after: 1\r\n"))
            transport.close()
            return
        self._watch()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()

    def connection_lost(self, exc: Exception | None) -> None:
        self._set_deadline(None)
        super().connection_lost(exc)

    def _watch(self) -> None:
        """Start the deadline of what the client owes now, if that changed."""
        state = self.conn.their_state
        if self.transport is None or self.transport.is_closing():
            owed = None
        elif state is h11.IDLE and self.timeout_keep_alive_task is None:
            owed = "head"                # (while the keep-alive timer runs, that one bounds the wait)
        elif state is h11.SEND_BODY:
            owed = "body"
        else:
            owed = None                  # the answer is being made or sent
        if owed != self._owed:
            self._set_deadline(owed)

    def _set_deadline(self, owed: str | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._owed = owed
        if owed is not None:
            delay = self.limits.header_timeout_s if owed == "head" else self.limits.body_timeout_s
            self._deadline = self.loop.call_later(delay, self._expired, owed)

    def _expired(self, owed: str) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        if owed == "head":
            log.info("closed the connection from %s: no whole request head within %g s", _peer(self.client),
                     self.limits.header_timeout_s)
            if self.conn.our_state is h11.IDLE:
                self.transport.write(_raw_response(
                    408, "Request Timeout", f"the request head did not arrive within {self.limits.header_timeout_s:g} s",
                    "request_timeout"))
        else:
            log.info("closed the connection from %s: the request body did not arrive within %g s",
                     _peer(self.client), self.limits.body_timeout_s)
        self.transport.close()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"
