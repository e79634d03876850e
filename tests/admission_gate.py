"""Hold a serve Worker at its first admission until N requests were submitted (tests that need
requests admitted together, so that they decode in the same ubatches)."""

from __future__ import annotations

import threading
import time
from typing import Any


class AdmissionGate:
    """`with AdmissionGate(worker, n) as gate:` send the n requests, then `gate.release()`.

    The worker waits inside its first admission; the others are queued behind it, or were taken
    from the queue in the same step. Counting submissions (not the queue) covers both."""

    def __init__(self, worker: Any, n: int, timeout: float = 60.0):
        self.worker, self.n, self.timeout = worker, n, timeout
        self._open, self._held, self._submitted = threading.Event(), threading.Event(), []
        self._admit, self._submit = worker._admit, worker.submit

    def __enter__(self) -> "AdmissionGate":
        self.worker._admit = lambda job: (self._held.set(), self._open.wait(self.timeout), self._admit(job))
        self.worker.submit = lambda job: (self._submitted.append(job), self._submit(job))
        return self

    def release(self) -> None:
        deadline = time.monotonic() + self.timeout
        while not (self._held.is_set() and len(self._submitted) >= self.n) and time.monotonic() < deadline:
            time.sleep(0.005)
        self._open.set()

    def __exit__(self, *exc: object) -> None:
        self._open.set()
        self.worker._admit, self.worker.submit = self._admit, self._submit
