"""ggml's log, rerouted for a while: lines a caller handles itself instead of printing them.

Why: ggml logs through one process-wide callback (stderr by default; `runner.rpc` installs its own).
Some of its lines are noise for deltarun's users (the CPU repack announces every tensor at DEBUG),
and an allocation that fails prints two or three lines of its own before deltarun's error, where
a user should read one line that says what failed and why (`HeldLog`). Each context puts back the
callback it found, so they nest with each other and with the RPC hook.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Any, Callable, Iterator

from deltarun.base.ggml_util import ggml

#: (level, text) -> True when the line was handled and ggml's previous callback should not see it
Route = Callable[[int, bytes], bool]


@contextlib.contextmanager
def ggml_log_routed(route: Route) -> Iterator[Callable[[int, bytes], None]]:
    """For the duration each of ggml's log lines goes to `route` first; lines it does not handle go
    where they went before. Yields that previous destination (to forward held lines later)."""
    cb, ud = ggml.ggml_log_callback(), ctypes.c_void_p()
    ggml.ggml_log_get(ctypes.byref(cb), ctypes.byref(ud))
    previous = cb if ctypes.cast(cb, ctypes.c_void_p).value else None

    def forward(level: int, text: bytes) -> None:
        if previous is not None:
            previous(level, text, ud)
        elif text:
            os.write(2, text)

    def hook(level: int, text: bytes, user_data: Any) -> None:
        if not route(level, text or b""):
            forward(level, text)

    callback = ggml.ggml_log_callback(hook)
    ggml.ggml_log_set(callback, ud)
    try:
        yield forward
    finally:
        ggml.ggml_log_set(previous if previous is not None else ggml.ggml_log_callback(), ud)


@contextlib.contextmanager
def without_debug_log() -> Iterator[None]:
    """ggml's log without its DEBUG lines for the duration (the CPU repack announces every tensor
    it lays out); other lines go where they went before."""
    with ggml_log_routed(lambda level, text: level == ggml.GGML_LOG_LEVEL_DEBUG):
        yield


class HeldLog:
    """ggml's warnings and errors held while a call that may fail runs (an allocation): on failure
    `reason` goes into deltarun's one-line error; on success `release` prints them as ggml would.

        with HeldLog() as held:
            buffer = ggml.ggml_backend_buft_alloc_buffer(buft, size)
        if not buffer:
            raise BackendError(f"could not allocate {size} bytes: {held.reason}")
        held.release()
    """

    HELD = (ggml.GGML_LOG_LEVEL_WARN, ggml.GGML_LOG_LEVEL_ERROR)

    def __init__(self) -> None:
        self.lines: list[tuple[int, bytes]] = []
        self._forward: Callable[[int, bytes], None] | None = None
        self._context: Any = None

    def __enter__(self) -> "HeldLog":
        self._context = ggml_log_routed(self._hold)
        self._forward = self._context.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._context.__exit__(*exc)

    def _hold(self, level: int, text: bytes) -> bool:
        if level in self.HELD or (level == ggml.GGML_LOG_LEVEL_CONT and self.lines):
            self.lines.append((level, text))
            return True
        return False

    @property
    def reason(self) -> str:
        """ggml's first held line without the function name it starts with ("insufficient memory
        (attempted to allocate 1048576.11 MB)"), or "no reason given"."""
        text = b"".join(t for _, t in self.lines).decode("utf-8", "replace").strip().splitlines()
        if not text:
            return "no reason given"
        head, sep, rest = text[0].partition(": ")
        return rest.strip() if sep and " " not in head else text[0].strip()

    def release(self) -> None:
        """Print the held lines where ggml's log went (the call succeeded: they were only warnings)."""
        if self._forward is not None:
            for level, text in self.lines:
                self._forward(level, text)
        self.lines.clear()
