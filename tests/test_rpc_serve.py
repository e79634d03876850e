"""`serve` keeps answering when its model process or an RPC server goes away, and recovers.

With `--rpc` (or `ServeSettings(supervise=True)`) the model runs in a child process
(deltarun.apps.serve.supervisor). Checked here:

- without RPC (always runs): the supervised server gives the same greedy text as the in-process
  one, relays streams, `Worker.call` (/graph), metrics and cancellation; a child killed mid-stream
  ends that stream with a 503 error object and `[DONE]`, and a new child serves the same text;
- with two loopback `deltarun rpc-server`s and `deltarun serve --rpc` (skipped without RPC): one
  server killed mid-stream ends the stream with an `rpc_server_lost` error naming it, and a
  non-streaming request running next to it with a 503 JSON error, within 30 s; while it is down
  `/health` and new requests answer 503 with Retry-After; restarted on the same port, the server
  serves the same greedy text again, without restarting `serve`; a server killed while nothing
  runs turns `/health` 503 within seconds;
- a vanished RPC host (packets to and from its port dropped in a private network namespace, both
  processes alive; skipped where `unshare -rn` is not allowed): the running stream ends with the
  503 error object within 30 s (kernel keepalive / TCP_USER_TIMEOUT, about 20 s).

Every wait is bounded in time.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from deltarun.apps.serve.server import ServeHandle, ServeSettings, free_port
from deltarun.runner import rpc
from deltarun.runner.model import Model

try:  # tests/ as a package, or pytest's rootdir-relative import
    from tests.test_rpc import LOST_DEADLINE_S, Server, _env, _netns_available
except ModuleNotFoundError:
    from test_rpc import LOST_DEADLINE_S, Server, _env, _netns_available  # type: ignore[no-redef]

UP_TIMEOUT_S = 120          # a model load (spawned interpreter, tiny model)
RECOVER_TIMEOUT_S = 60      # the supervisor's backoff is at most 5 s; a reload is seconds
ASK = {"messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12, "temperature": 0}
LONG = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 6000, "temperature": 0,
        "ignore_eos": True, "stream": True}


def _text(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def _wait_health(base: str, status: int, timeout: float) -> httpx.Response:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = httpx.get(base + "/health", timeout=5)
            if last.status_code == status:
                return last
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"/health did not answer {status} within {timeout} s (last: {last and last.text})")


def _stream_until_error(base: str, on_started, timeout: float) -> list[str]:
    """Stream LONG; after its second chunk call `on_started()`; return the data lines to the end."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    with httpx.stream("POST", base + "/v1/chat/completions", json=LONG, timeout=timeout) as r:
        assert r.status_code == 200
        for ln in r.iter_lines():
            if ln.startswith("data: "):
                lines.append(ln[6:])
            if len(lines) == 2:
                on_started()
            assert time.monotonic() < deadline, "the stream did not end after the failure"
    return lines


def _assert_unavailable(r: httpx.Response, code: str) -> dict:
    assert r.status_code == 503, r.text
    assert r.headers.get("retry-after") == "1"
    err = r.json()["error"]
    assert err["type"] == "unavailable_error" and err["code"] == code
    return err


@pytest.fixture(scope="module")
def model_path(tiny_model_path):
    return tiny_model_path("tiny", "f32")


def test_supervised_worker_matches_in_process_and_recovers(model_path):
    opener = functools.partial(Model, model_path, n_ctx=8192, n_seq_max=2, n_ubatch=64, rs_slots=4, n_threads=1)
    with ServeHandle(opener, ServeSettings(parallel=2)) as h:
        expected = _text(httpx.post(h.base_url + "/v1/chat/completions", json=ASK, timeout=60))
    with ServeHandle(opener, ServeSettings(parallel=2, supervise=True)) as h:
        base = h.base_url
        assert _text(httpx.post(base + "/v1/chat/completions", json=ASK, timeout=60)) == expected
        streamed = []
        with httpx.stream("POST", base + "/v1/chat/completions", json={**ASK, "stream": True}, timeout=60) as r:
            for ln in r.iter_lines():
                if ln.startswith("data: ") and ln != "data: [DONE]":
                    streamed.append(json.loads(ln[6:])["choices"][0]["delta"].get("content") or "")
        assert "".join(streamed) == expected
        assert httpx.get(base + "/graph?tokens=2", timeout=60).status_code == 200      # Worker.call in the child
        metrics = httpx.get(base + "/metrics").text
        assert any(ln.startswith("deltarun_requests_total 2.0") for ln in metrics.splitlines()), metrics
        props = httpx.get(base + "/props").json()
        assert props["default_generation_settings"]["n_ctx"] == 8192 and props["rs_slots"] == 4

        # a client that goes away frees its slot in the child
        with httpx.stream("POST", base + "/v1/chat/completions", json=LONG, timeout=60) as r:
            next(r.iter_lines())
        deadline = time.monotonic() + 20
        while h.worker.counts != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert h.worker.counts == (0, 0)

        # the child dies mid-stream: that stream ends with a 503 error object, then [DONE]
        lines = _stream_until_error(base, lambda: os.kill(h.worker._proc.pid, signal.SIGKILL), 60)
        assert lines[-1] == "[DONE]"
        err = json.loads(lines[-2])["error"]
        assert err["type"] == "unavailable_error" and err["code"] == "model_process_lost", err
        _wait_health(base, 200, RECOVER_TIMEOUT_S)
        assert _text(httpx.post(base + "/v1/chat/completions", json=ASK, timeout=60)) == expected
        assert h.worker.n_started == 2
        # counters carried over the restart (kept in the parent)
        metrics = httpx.get(base + "/metrics").text
        assert any(ln.startswith("deltarun_requests_total 5.0") for ln in metrics.splitlines()), metrics

        # shutting down (what SIGTERM does first) ends a running stream with finish_reason "stop", no restart
        lines = _stream_until_error(base, h.worker.shutdown, 60)
        assert lines[-1] == "[DONE]" and json.loads(lines[-2])["choices"][0]["finish_reason"] == "stop"
        r = httpx.post(base + "/v1/chat/completions", json=ASK, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
        h.worker._thread.join(30)
        assert not h.worker._thread.is_alive() and h.worker.n_started == 2


def test_supervised_worker_prefills_ahead_in_the_child(model_path):
    """Prefill ahead crosses the process boundary: the child evaluates the next turn's start while
    idle (its counter reaches the parent's /metrics) and the next turn reuses it as in-process."""
    opener = functools.partial(Model, model_path, n_ctx=2048, n_seq_max=1, n_ubatch=64, rs_slots=4, n_threads=1)
    nxt = {**ASK, "chat_template_kwargs": {"enable_thinking": False}}

    def two_turns(h: ServeHandle, settle) -> tuple[str, int]:
        first = httpx.post(h.base_url + "/v1/chat/completions", json=nxt, timeout=60).json()
        settle(h)
        msgs = ASK["messages"] + [first["choices"][0]["message"], {"role": "user", "content": "and then?"}]
        r = httpx.post(h.base_url + "/v1/chat/completions", json={**nxt, "messages": msgs}, timeout=60).json()
        return r["choices"][0]["message"]["content"], r["usage"]["prompt_tokens_details"]["cached_tokens"]

    def ahead_total(h: ServeHandle) -> float:
        return next(float(ln.split()[1]) for ln in httpx.get(h.base_url + "/metrics").text.splitlines()
                    if ln.startswith("deltarun_prompt_tokens_ahead_total "))

    def child_settled(h: ServeHandle) -> None:
        deadline = time.monotonic() + 30
        while ahead_total(h) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)

    with ServeHandle(opener, ServeSettings(parallel=1)) as h:
        expected = two_turns(h, ServeHandle.wait_settled)
    with ServeHandle(opener, ServeSettings(parallel=1, supervise=True)) as h:
        assert two_turns(h, child_settled) == expected
        assert ahead_total(h) > 0


def test_supervised_load_failure_is_reported(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 60)
    h = ServeHandle(functools.partial(Model, bad), ServeSettings(supervise=True))
    with pytest.raises(RuntimeError, match="the model failed to load"):
        h.start(timeout=UP_TIMEOUT_S)
    h.stop()
    # a child that dies while loading (as one whose RPC server goes away then) is a load error too
    h = ServeHandle(functools.partial(os._exit, 3), ServeSettings(supervise=True))
    with pytest.raises(RuntimeError, match=r"the model process ended \(exit status 3\)"):
        h.start(timeout=UP_TIMEOUT_S)
    h.stop()
    assert h.worker.n_started == 1


@pytest.mark.skipif(not rpc.available(), reason="this ggml-python was built without GGML_RPC")
def test_serve_rpc_server_lost_then_back(tiny_model_path):
    model8 = tiny_model_path("tiny", "q8_0", n_layer=8)
    a, b = Server(), Server()
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # --no-prefill-ahead: the last check needs the child idle after an answer (with work ahead the
    # loss may be met by that run instead, the path the stream above tests)
    proc = subprocess.Popen([sys.executable, "-m", "deltarun", "serve", str(model8), "--port", str(port),
                             "--parallel", "2", "--ctx", "8192", "--threads", "1", "--rpc",
                             f"{a.endpoint},{b.endpoint}", "--tensor-split", "1,1,0", "--no-prefill-ahead"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=_env())
    restarted = None
    try:
        _wait_health(base, 200, UP_TIMEOUT_S)
        expected = _text(httpx.post(base + "/v1/chat/completions", json=ASK, timeout=60))

        # a non-streaming request runs next to the stream when b dies: it gets a 503 JSON error
        with cf.ThreadPoolExecutor(1) as ex:
            plain = ex.submit(httpx.post, base + "/v1/chat/completions", json={**LONG, "stream": False},
                              timeout=LOST_DEADLINE_S + 60)
            t_kill = []
            lines = _stream_until_error(base, lambda: t_kill.append(time.monotonic()) or b.proc.kill(),
                                        LOST_DEADLINE_S + 30)
            assert time.monotonic() - t_kill[0] < LOST_DEADLINE_S
            lost = _assert_unavailable(plain.result(), "rpc_server_lost")
            assert b.endpoint in lost["message"]
        assert lines[-1] == "[DONE]"
        err = json.loads(lines[-2])["error"]
        assert err["type"] == "unavailable_error" and err["code"] == "rpc_server_lost", err
        assert b.endpoint in err["message"] and a.endpoint not in err["message"], err

        # degraded while b is down: /health and new requests answer 503 with Retry-After
        health = _wait_health(base, 503, 10)
        assert health.headers.get("retry-after") == "1" and "lost" in health.json()["error"]["message"]
        _assert_unavailable(httpx.post(base + "/v1/chat/completions", json=ASK, timeout=30), "rpc_server_lost")
        time.sleep(2 * 0.5 + 0.5)       # the supervisor has probed b and failed at least once
        err = _assert_unavailable(httpx.post(base + "/v1/chat/completions", json=ASK, timeout=30),
                                  "rpc_server_lost")
        assert b.endpoint in err["message"]
        assert proc.poll() is None

        b.stop()
        restarted = Server(port=b.port, wait=False)      # the same endpoint comes back
        _wait_health(base, 200, RECOVER_TIMEOUT_S)
        assert _text(httpx.post(base + "/v1/chat/completions", json=ASK, timeout=60)) == expected

        # a server lost while nothing runs is noticed too (the child's watchdog), within seconds
        a.proc.kill()
        health = _wait_health(base, 503, 10)
        assert a.endpoint in health.json()["error"]["message"], health.text
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        stderr = proc.stderr.read().decode(errors="replace")
        proc.stderr.close()
        for s in (a, b, restarted):
            if s is not None:
                s.stop()
    assert "Traceback" not in stderr and "GGML_ASSERT" not in stderr, stderr
    assert proc.returncode in (0, -signal.SIGTERM), (proc.returncode, stderr)   # SIGTERM ends it while degraded
    assert stderr.count(f"error: lost the RPC server {b.endpoint}") == 1, stderr     # one line per loss
    assert stderr.count(f"error: lost the RPC server {a.endpoint}: the server closed the connection") == 1, stderr
    assert "leaked semaphore" not in stderr, stderr


# As tests/test_rpc.py's vanished-host test, for `serve`: in a private network namespace, every
# packet to and from the RPC server's port stops routing mid-stream while both processes live on.
_VANISH_SERVE = r"""
import json, signal, subprocess, sys, time
import httpx
from deltarun.runner import rpc
model, port, http_port, body = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
ep, base = f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
procs = [subprocess.Popen([sys.executable, "-m", "deltarun", "rpc-server", "--port", str(port), "--threads", "1"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
try:
    for _ in range(150):
        try:
            rpc.probe(ep, timeout=2)
            break
        except rpc.RpcError:
            time.sleep(0.2)
    serve = subprocess.Popen([sys.executable, "-m", "deltarun", "serve", model, "--port", str(http_port), "--parallel",
                              "1", "--ctx", "8192", "--threads", "1", "--rpc", ep, "--tensor-split", "1,1"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    procs.append(serve)
    for _ in range(600):
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    lines, t0 = [], None
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=90) as r:
        for ln in r.iter_lines():
            if ln.startswith("data: "):
                lines.append(ln[6:])
            if len(lines) == 2 and t0 is None:
                for rule in (["add", "prio", "10", "ipproto", "tcp", "dport", str(port), "prohibit"],
                             ["add", "prio", "11", "ipproto", "tcp", "sport", str(port), "prohibit"],
                             ["del", "prio", "0"], ["add", "prio", "100", "table", "local"]):
                    subprocess.run(["ip", "rule", *rule], check=True)
                t0 = time.monotonic()
    elapsed = time.monotonic() - t0
    health = httpx.get(base + "/health", timeout=5)
    serve.send_signal(signal.SIGTERM)
    serve.wait(60)
    print(json.dumps({"elapsed": elapsed, "tail": lines[-2:], "health": health.status_code,
                      "retry_after": health.headers.get("retry-after"), "stderr": serve.stderr.read().decode()}))
finally:
    for p in procs:
        if p.poll() is None:
            p.kill()
"""


@pytest.mark.skipif(not rpc.available(), reason="this ggml-python was built without GGML_RPC")
def test_serve_vanished_host_answers_503_within_30s(tiny_model_path):
    if not _netns_available():
        pytest.skip("needs `unshare -rn` (user and network namespaces) and iproute2's `ip rule ... dport`")
    model8 = tiny_model_path("tiny", "q8_0", n_layer=8)
    r = subprocess.run(["unshare", "-rn", sys.executable, "-c", _VANISH_SERVE, str(model8), "50052", "8080",
                        json.dumps(LONG)], capture_output=True, text=True, timeout=400, env=_env())
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["tail"][-1] == "[DONE]", res
    err = json.loads(res["tail"][0])["error"]
    assert err["code"] == "rpc_server_lost" and "127.0.0.1:50052" in err["message"], res
    assert res["elapsed"] < LOST_DEADLINE_S, res
    assert res["health"] == 503 and res["retry_after"] == "1", res
    assert res["stderr"].count("error: lost the RPC server 127.0.0.1:50052") == 1, res["stderr"]
