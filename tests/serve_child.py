"""A `deltarun serve` child process for the tests that talk to the real command over HTTP: started
with its log in a file, waited for until /health answers, stopped (terminated, then killed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest


def start_serve(args: list[str], log: Path, port: int, timeout: float = 120) -> subprocess.Popen:
    """`python -m deltarun serve ARGS --port PORT`, its stdout and stderr in `log`; returns once
    /health answers, or fails the test with the log's tail."""
    return start_server([sys.executable, "-m", "deltarun", "serve", *args, "--port", str(port)], log, port, timeout)


def start_server(cmd: list[str], log: Path, port: int, timeout: float = 120) -> subprocess.Popen:
    """Any server command listening on 127.0.0.1:PORT (deltarun's, llama-server), as `start_serve`."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stderr=out, stdout=out, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            stop_serve(proc)
            pytest.fail(f"the server did not come up: {log.read_text(errors='replace')[-2000:]}")
        time.sleep(0.05)


def stop_serve(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
