"""ggml's RPC backend: layers split over two loopback rpc-servers, and the faults around them.

Two `deltarun rpc-server` processes are started on 127.0.0.1 (free ports, one thread each) for the
module and stopped with SIGTERM at the end. A model split over them must give the same greedy
tokens as a single-process CPU run and logits within the matrix-product NMSE limit of `compare`
(the servers run the same CPU kernels, so in practice the error is 0); the KV cache and the
recurrent state on the remote devices must roll back exactly as on the CPU. A killed server and an
unreachable or silent endpoint must end a command with one line naming the endpoint, in bounded
time. Skipped when ggml-python was built without RPC (scripts/install.sh builds it with).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from deltarun.apps.compare import MATMUL_LIMIT
from deltarun.runner import rpc

pytestmark = pytest.mark.skipif(not rpc.available(), reason="this ggml-python was built without GGML_RPC "
                                                          "(scripts/install.sh builds it with RPC)")

START_TIMEOUT_S = 30
LOST_DEADLINE_S = 30
PROMPT = [3, 141, 59, 26, 535, 89, 79, 323, 84, 62, 64, 33, 83, 279, 502, 88, 41, 97, 169, 399]
STEPS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONUNBUFFERED="1")


def _die_with_parent() -> None:
    """prctl(PR_SET_PDEATHSIG, SIGTERM): a server never outlives a test process that died."""
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGTERM)


class Server:
    """A `deltarun rpc-server` subprocess on 127.0.0.1."""

    def __init__(self, port: int | None = None, wait: bool = True) -> None:
        """On a free port (or `port`); `wait`: until it answers a probe (not while a client holds it)."""
        self.port = port or _free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "deltarun", "rpc-server", "--port", str(self.port),
                                      "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=_env(), preexec_fn=_die_with_parent)
        deadline = time.monotonic() + START_TIMEOUT_S
        while wait:
            try:
                rpc.probe(self.endpoint, timeout=2)
                return
            except rpc.RpcError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"rpc-server on {self.endpoint} did not start: "
                                       f"{self.proc.stderr.read().decode(errors='replace')}")
                time.sleep(0.2)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        for f in (self.proc.stdout, self.proc.stderr):
            f.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def servers():
    started: list[Server] = []
    try:
        started.append(Server())
        started.append(Server())
        yield [s.endpoint for s in started]
    finally:
        codes = [s.stop() for s in started]
    assert codes == [0, 0], f"rpc-server did not end cleanly on SIGTERM: exit codes {codes}"


@pytest.fixture(scope="module")
def model8(tiny_model_path) -> Path:
    """Eight layers (L L L A L L L A): every split below puts both layer kinds on a remote device."""
    return tiny_model_path("tiny", "q8_0", n_layer=8)


def _run(path: Path, **kw) -> tuple[np.ndarray, list[int], list[np.ndarray], str]:
    """Prompt logits (two ubatches), then STEPS greedy decode steps."""
    from deltarun.runner.model import Model

    with Model(path, n_ctx=64, n_ubatch=12, n_threads=1, **kw) as m:
        logits = m.eval(PROMPT, all_logits=True)
        toks, steps = [], []
        last = logits[-1]
        for _ in range(STEPS):
            toks.append(int(np.argmax(last)))
            last = m.eval([toks[-1]])
            steps.append(last)
        return logits, toks, steps, m.placement.describe()


def _nmse(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(((a - b) ** 2).sum() / (a ** 2).sum())


@pytest.fixture(scope="module")
def cpu_run(model8):
    return _run(model8)


@pytest.mark.parametrize("split, expect", [
    ("1,1,0", {"RPC0": 5, "RPC1": 3, "cpu": 0}),     # 1:1 over the two servers
    ("3,1,0", {"RPC0": 7, "RPC1": 1, "cpu": 0}),     # 3:1
    ("1,0,0", {"RPC0": 8, "RPC1": 0, "cpu": 0}),     # every layer (and the output) remote
    ("1,1,1", {"RPC0": 3, "RPC1": 3, "cpu": 2}),     # remote and local
])
def test_split_matches_cpu(servers, model8, cpu_run, split, expect):
    logits, toks, steps, where = _run(model8, rpc=",".join(servers), tensor_split=split)
    for name, n in expect.items():
        assert f"{name}" in where and f": {n} layers" in where.split(name, 1)[1].split(",")[0], where
    ref_logits, ref_toks, ref_steps, _ = cpu_run
    assert toks == ref_toks
    assert _nmse(ref_logits, logits) <= MATMUL_LIMIT
    for a, b in zip(ref_steps, steps):
        assert _nmse(a, b) <= MATMUL_LIMIT


def test_backend_name_rpc_puts_everything_on_the_server(servers, model8, cpu_run):
    logits, toks, _, where = _run(model8, backend=f"rpc:{servers[0]}")
    assert "RPC0" in where and ": 8 layers + output" in where
    assert toks == cpu_run[1]
    assert _nmse(cpu_run[0], logits) <= MATMUL_LIMIT


def test_remote_state_rolls_back(servers, model8):
    """Speculative-style steps on a model whose KV cache and recurrent state are on the servers."""
    from deltarun.runner.model import Model

    def steps(**kw):
        with Model(model8, n_ctx=64, n_ubatch=16, n_threads=1, rs_slots=4, **kw) as m:
            out = [m.eval(PROMPT[:10])]
            out.append(m.eval([7, 8, 9], all_logits=True))
            m.rollback(2)                       # keep 7; drop 8, 9
            out.append(m.eval([11, 12], all_logits=True))
            cp = m.checkpoint()
            out.append(m.eval([13, 14, 15], all_logits=True))
            m.restore(cp)
            out.append(m.eval([13], all_logits=True))
            states = [m.memory.conv_slots(il) for il in m.hp.linear_layers]
            states += [m.memory.ssm_slots(il) for il in m.hp.linear_layers]
            return out, states, m.tokens(), m.placement.describe()

    ref, ref_states, ref_tokens, _ = steps()
    got, states, tokens, where = steps(rpc=",".join(servers), tensor_split="1,1,0")
    assert "RPC0" in where and "RPC1" in where and "cpu: 0 layers" in where
    assert tokens == ref_tokens == PROMPT[:10] + [7, 11, 12, 13]
    for a, b in zip(ref, got):
        assert _nmse(a, b) <= MATMUL_LIMIT
    for a, b in zip(ref_states, states):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_two_models_share_a_server(servers, model8, cpu_run):
    """A second Model in the same process (a draft model) shares ggml's connection to the server."""
    from deltarun.runner.model import Model

    with Model(model8, n_ctx=64, n_threads=1, backend=f"rpc:{servers[0]}") as first:
        with Model(model8, n_ctx=64, n_threads=1, backend=f"rpc:{servers[0]}") as second:
            a = second.eval(PROMPT)
        b = first.eval(PROMPT)
    assert _nmse(cpu_run[0][-1], a) <= MATMUL_LIMIT and _nmse(cpu_run[0][-1], b) <= MATMUL_LIMIT


def test_ggml_sockets_get_keepalive_and_user_timeout(servers, model8):
    """A vanished server machine must fail ggml's blocked receive within ~25 s, not never."""
    from deltarun.runner.model import Model

    with Model(model8, n_ctx=64, n_threads=1, rpc=",".join(servers), tensor_split="1,1,0"):
        found = rpc._rpc_sockets()
        assert {ep for _, ep in found} == set(servers)
        for fd, _ in found:
            s = socket.socket(fileno=os.dup(fd))
            try:
                assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == rpc.USER_TIMEOUT_MS
                idle = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
                intvl = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
                cnt = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)
                assert idle + intvl * cnt <= LOST_DEADLINE_S
            finally:
                s.close()


def test_cli_generate_and_devices(servers, model8):
    """The command-line path: --rpc/--tensor-split on generate, devices --rpc, graph --rpc."""
    base = [sys.executable, "-m", "deltarun"]
    gen = ["generate", str(model8), "-p", "hello world", "-n", "12", "--temp", "0", "-t", "1", "--ctx", "64"]
    local = subprocess.run(base + gen, capture_output=True, text=True, timeout=120, env=_env())
    remote = subprocess.run(base + gen + ["--rpc", ",".join(servers), "--tensor-split", "1,1,0"],
                            capture_output=True, text=True, timeout=120, env=_env())
    assert local.returncode == 0 and remote.returncode == 0, remote.stderr
    assert remote.stdout == local.stdout and local.stdout.strip()
    dev = subprocess.run(base + ["devices", "--rpc", servers[0]], capture_output=True, text=True, timeout=60,
                         env=_env())
    assert dev.returncode == 0, dev.stderr
    assert f"rpc:{servers[0]}" in dev.stdout and "rpc: built in" in dev.stdout
    g = subprocess.run(base + ["graph", str(model8), "--rpc", servers[1], "-ts", "1,1", "--ctx", "64", "-t", "1"],
                       capture_output=True, text=True, timeout=120, env=_env())
    assert g.returncode == 0, g.stderr
    assert "placement: layers split: RPC" in g.stdout and f"[{servers[1]}]" in g.stdout


def test_cli_compare_and_bench(servers, model8):
    """compare --backends cpu,rpc:HOST:PORT passes node by node; bench --rpc names the split."""
    base = [sys.executable, "-m", "deltarun"]
    c = subprocess.run(base + ["compare", str(model8), "--backends", f"cpu,rpc:{servers[0]}", "-t", "1", "-q",
                               "--decode-steps", "4", "--json"], capture_output=True, text=True, timeout=180,
                       env=_env())
    assert c.returncode == 0, c.stderr
    import json

    report = json.loads(c.stdout)
    assert report["passed"] and "RPC0" in json.dumps(report)
    b = subprocess.run(base + ["bench", str(model8), "-p", "8", "-n", "4", "-r", "1", "-t", "1", "--rpc",
                               ",".join(servers), "--tensor-split", "1,1,0", "-o", "json"],
                       capture_output=True, text=True, timeout=180, env=_env())
    assert b.returncode == 0, b.stderr
    rows = json.loads(b.stdout)["results"]
    assert {r["test"] for r in rows} == {"pp8", "tg4"}
    assert all(r["backend"].startswith(f"rpc:{servers[0]}+rpc:{servers[1]}+cpu (5/3/0") for r in rows)


# ----------------------------------------------------------------------------------------------
# Faults
# ----------------------------------------------------------------------------------------------
def _one_line_error(proc: subprocess.CompletedProcess | subprocess.Popen, stderr: str, endpoint: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert lines, "no error message"
    last = lines[-1]
    assert last.startswith("error: ") and endpoint in last, stderr
    assert "Traceback" not in stderr and "GGML_ASSERT" not in stderr and "recv failed" not in stderr, stderr
    return last


def test_unreachable_server_is_one_line(model8):
    port = _free_port()          # nothing listens there
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "deltarun", "generate", str(model8), "-p", "hi", "-n", "2",
                        "--rpc", f"127.0.0.1:{port}"], capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == rpc.RpcError.exit_code
    assert "unreachable" in _one_line_error(r, r.stderr, f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 30


def test_silent_endpoint_times_out():
    """A port that accepts connections but never answers (not an RPC server, or a busy one)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        ep = f"127.0.0.1:{listener.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(rpc.RpcError, match="did not"):
            rpc.probe(ep, timeout=1.0)
        assert time.monotonic() - t0 < 10


def test_protocol_version_mismatch_is_refused():
    """A server answering HELLO with protocol 3.0.0 is refused with both versions named."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    ep = f"127.0.0.1:{listener.getsockname()[1]}"

    def serve_one():
        conn, _ = listener.accept()
        with conn:
            conn.settimeout(5)
            head = conn.recv(9)
            cmd, size = struct.unpack("<BQ", head)
            conn.recv(size)
            assert cmd == rpc.CMD_HELLO
            conn.sendall(struct.pack("<Q", 4 + rpc.CONN_CAPS_SIZE) + bytes([3, 0, 0, 0]) + bytes(rpc.CONN_CAPS_SIZE))

    t = threading.Thread(target=serve_one, daemon=True)
    t.start()
    try:
        with pytest.raises(rpc.RpcError, match=r"speaks protocol 3\.0\.0.*" + re.escape(".".join(map(str, rpc.PROTOCOL)))):
            rpc.probe(ep, timeout=5)
    finally:
        t.join(5)
        listener.close()


def test_server_killed_mid_generation(model8):
    """Kill -9 one of two servers while `generate` streams: one line naming it, exit 9, within 30 s."""
    a, b = Server(), Server()
    proc = None
    try:
        proc = subprocess.Popen([sys.executable, "-m", "deltarun", "generate", str(model8), "-p", "hello", "-n",
                                 "6000", "--ctx", "8192", "--temp", "0", "-t", "1", "--rpc",
                                 f"{a.endpoint},{b.endpoint}", "--tensor-split", "1,1,0"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env())
        first = proc.stdout.read(16)       # blocks until tokens stream: the model is loaded and decoding
        assert first, proc.stderr.read().decode()
        b.proc.kill()
        t0 = time.monotonic()
        try:
            out, err = proc.communicate(timeout=LOST_DEADLINE_S + 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail("generate did not end after its RPC server was killed")
        elapsed = time.monotonic() - t0
        assert proc.returncode == rpc.RpcError.exit_code, err.decode()
        line = _one_line_error(proc, err.decode(errors="replace"), b.endpoint)
        assert "lost" in line and a.endpoint not in line
        assert elapsed < LOST_DEADLINE_S
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)
        a.stop()
        b.stop()


def test_rpc_server_port_in_use_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "deltarun", "rpc-server", "--port", str(port)],
                           capture_output=True, text=True, timeout=60, env=_env())
    assert r.returncode == rpc.RpcError.exit_code
    assert "cannot listen" in _one_line_error(r, r.stderr, f"127.0.0.1:{port}")


def test_endpoint_parsing():
    assert rpc.parse_endpoints("a:1, b.example:50052") == ["a:1", "b.example:50052"]
    for bad in ("nohost", "h:0", "h:70000", "::1:5", "h:p"):
        with pytest.raises(rpc.RpcError):
            rpc.parse_endpoints(bad)
    with pytest.raises(rpc.RpcError, match="twice"):
        rpc.parse_endpoints("a:1,a:1")
    assert rpc.is_loopback("127.0.0.1") and not rpc.is_loopback("0.0.0.0")
    # ggml 0.15.3's transport is AF_INET only (and splits the endpoint at its first ':')
    for v6 in ("[::1]:50052", "::1:50052", "[fe80::1%eth0]:1"):
        with pytest.raises(rpc.RpcError, match="IPv6.*IPv4 only"):
            rpc.parse_endpoints(v6)
    assert rpc.ipv4_address("localhost", "x") == "127.0.0.1"


def test_ipv6_host_is_one_line():
    for args in (["rpc-server", "--host", "::1"], ["generate", "-p", "hi", "--rpc", "[::1]:50052"]):
        r = subprocess.run([sys.executable, "-m", "deltarun", *args], capture_output=True, text=True, timeout=60,
                           env=_env())
        assert r.returncode == rpc.RpcError.exit_code, r.stderr
        assert "IPv4 only" in _one_line_error(r, r.stderr, "::1"), r.stderr


def test_assign_layers_follows_llama_cpp():
    from deltarun.runner.layer_split import assign_layers, parse_tensor_split

    assert assign_layers(8, [1, 1, 0]) == [0, 0, 0, 0, 0, 1, 1, 1, 1]
    assert assign_layers(8, [0, 1]) == [1] * 9
    assert assign_layers(4, [1, 0, 0]) == [0] * 5
    assert parse_tensor_split("3,1") == [3.0, 1.0]
    for bad in ("0,0", "-1,2", "a,b"):
        with pytest.raises(Exception, match="tensor-split"):
            parse_tensor_split(bad)


# A host that vanishes (no FIN, no RST: its packets simply stop) is simulated in a network namespace
# of the test's own (`unshare -rn`, no privileges needed where user namespaces are allowed): policy
# routing rules put ahead of the local table make every packet to and from the server's port fail
# to route, while both processes stay alive. Only the kernel keepalive / TCP_USER_TIMEOUT that
# rpc.harden_sockets sets can notice that.
_VANISH = r"""
import json, subprocess, sys, time
from deltarun.runner import rpc
model, port = sys.argv[1], int(sys.argv[2])
ep = f"127.0.0.1:{port}"
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
server = subprocess.Popen([sys.executable, "-m", "deltarun", "rpc-server", "--port", str(port), "--threads", "1"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
try:
    for _ in range(150):
        try:
            rpc.probe(ep, timeout=2)
            break
        except rpc.RpcError:
            time.sleep(0.2)
    gen = subprocess.Popen([sys.executable, "-m", "deltarun", "generate", model, "-p", "hello", "-n", "6000",
                            "--ctx", "8192", "--temp", "0", "-t", "1", "--rpc", ep, "--tensor-split", "1,1"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first = gen.stdout.read(16)
    for rule in (["add", "prio", "10", "ipproto", "tcp", "dport", str(port), "prohibit"],
                 ["add", "prio", "11", "ipproto", "tcp", "sport", str(port), "prohibit"],
                 ["del", "prio", "0"], ["add", "prio", "100", "table", "local"]):
        subprocess.run(["ip", "rule", *rule], check=True)
    t0 = time.monotonic()
    try:
        out, err = gen.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        gen.kill()
        out, err = gen.communicate()
    print(json.dumps({"first": first.decode(errors="replace"), "rc": gen.returncode,
                      "elapsed": time.monotonic() - t0, "stderr": err.decode(errors="replace")}))
finally:
    server.kill()
"""


def _netns_available() -> bool:
    import shutil

    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    r = subprocess.run(["unshare", "-rn", "ip", "rule", "add", "prio", "10", "ipproto", "tcp", "dport", "1",
                        "prohibit"], capture_output=True, timeout=30)
    return r.returncode == 0


def test_vanished_host_is_detected_within_30s(model8):
    if not _netns_available():
        pytest.skip("needs `unshare -rn` (user and network namespaces) and iproute2's `ip rule ... dport`")
    r = subprocess.run(["unshare", "-rn", sys.executable, "-c", _VANISH, str(model8), "50052"], capture_output=True,
                       text=True, timeout=240, env=_env())
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["first"], res
    assert res["rc"] == rpc.RpcError.exit_code, res
    line = _one_line_error(None, res["stderr"], "127.0.0.1:50052")
    assert "lost" in line, line
    assert res["elapsed"] < LOST_DEADLINE_S, res


def test_devices_listed_after_a_server_went_away():
    """A process that added an RPC server which has gone since still lists its devices (ggml 0.25
    asks a server for its memory on every call and aborts when it cannot connect): the gone
    server's device is listed with 0 bytes, the process goes on."""
    server = Server()
    child = subprocess.Popen(
        [sys.executable, "-c",
         "import sys\nfrom deltarun.runner import rpc\nfrom deltarun.runner.devices import list_devices\n"
         f"rpc.add_servers([{server.endpoint!r}])\n"
         "print([d.memory_total > 0 for d in list_devices() if d.registry == 'RPC'], flush=True)\n"
         "sys.stdin.readline()\n"
         "print([d.memory_total for d in list_devices() if d.registry == 'RPC'], flush=True)\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), text=True)
    try:
        assert child.stdout.readline().strip() == "[True]", child.stderr.read()
        server.stop()
        out, err = child.communicate("go\n", timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
        server.stop()
    assert child.returncode == 0, err
    assert out.strip() == "[0]"
