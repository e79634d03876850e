"""ggml's RPC backend: servers by endpoint, a handshake probe, and clean failure when one is lost.

deltarun does not invent a protocol: a remote device is ggml's own RPC backend (ggml-rpc.cpp,
protocol 7.0.0 in ggml 0.25.3), the one llama.cpp's `--rpc` and `rpc-server` use, so a deltarun
client can use a llama.cpp rpc-server of the same protocol and the other way round. This module
adds what that client lacks:

- `probe(endpoint)`: a TCP connect with a timeout, then the protocol's HELLO (version check),
  DEVICE_COUNT and GET_DEVICE_MEMORY, spoken from Python. ggml's own connect has no timeout and
  aborts the process on a malformed answer, so every endpoint is probed before ggml touches it:
  an unreachable server, or one of another protocol version, is a one-line `RpcError`.
- `add_servers(endpoints)`: registers each server's devices in ggml's registry once per process
  (`ggml_backend_rpc_add_server`, `ggml_backend_register`).
- Losing a server mid-run. ggml's client turns any failed send or receive into `GGML_ABORT`
  (`RPC_STATUS_ASSERT`), and its sockets have no timeout. Two measures make that a clean end:

  1. `harden_sockets()` finds ggml's connected sockets (by peer address among this process's file
     descriptors) and sets TCP keepalive (idle 5 s, interval 5 s, 3 probes) and TCP_USER_TIMEOUT
     (20 s) on them. A server process that dies closes its connection at once; a server *host*
     that vanishes (power, network) is then noticed by the kernel within about 20-25 s instead of
     never, and the blocked receive fails. Keepalive probes are answered by the peer's kernel
     while its process computes, so a long graph compute is never mistaken for a loss.
  2. `install_abort_hook()` sets ggml's abort callback: when the aborting message comes from
     ggml-rpc.cpp, it finds which endpoint is gone (its socket reads EOF or an error, else a TCP
     connect fails), prints one line ``error: lost the RPC server HOST:PORT (...)`` and ends the
     process with `RpcError.exit_code` through `os._exit`, before ggml's `abort()`: no core
     dump, no backtrace. Other ggml aborts keep their message and abort as before. ggml's log
     goes to stderr as before, less the transport's "recv failed" line that precedes the abort.

  Why not a supervised worker process for every command: the hook gives the same one-line error
  and exit status without moving each command's model, terminal, stdin, signals and progress
  output into a child; it costs nothing per token; and the `Model` API behaves the same for
  library users. What it cannot do is *survive* the loss: `serve --rpc` holds its `Model` in a
  supervised child process (deltarun.apps.serve.supervisor), which `on_lost` lets tell its parent
  which endpoint went, and whose watchdog calls `broken_connections` to notice a loss while idle.
  A vanished host (packets dropped, no FIN or RST) is detected in about 20 s: tests/test_rpc.py
  simulates one with policy-routing rules in a private network namespace. Not detected: a server
  process that stops (SIGSTOP, a hung driver) while its host's kernel keeps the connection alive
  (or a TCP proxy in between that stays connected); ggml waits for it as llama.cpp does.

IPv6: ggml's transport (ggml-rpc/transport.cpp, 0.15.3 and 0.25.3) is IPv4 only: the client opens an AF_INET
socket and resolves with gethostbyname, the server binds `inet_addr(host)` (a dotted quad, not
even a host name), and the endpoint parser splits at the first ':'. So `[::1]:50052` is refused
in one line (`parse_endpoint`), host names are resolved to their IPv4 address as ggml does
(`ipv4_address`), and `rpc-server --host NAME` binds NAME's IPv4 address.
"""

from __future__ import annotations

import os
import re
import socket
import struct
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from deltarun.base.errors import BackendError
from deltarun.base.ggml_util import c_text, ctypes, ggml
from deltarun.runner.devices import DeviceInfo, list_devices

#: The protocol ggml-rpc.cpp speaks (RPC_PROTO_*_VERSION of ggml-rpc.h) in each ggml deltarun is built
#: on: 0.25.3 by scripts/install.sh, 0.15.3 by a plain `pip install ggml-python`.
RPC_PROTOCOLS = {"0.15.3": (4, 0, 1), "0.25.3": (7, 0, 0)}
#: The installed ggml's (tests/test_ggml_abi.py checks it against the installed ggml-rpc.h).
PROTOCOL = RPC_PROTOCOLS.get(c_text(ggml.ggml_version()), RPC_PROTOCOLS["0.25.3"])
CMD_GET_DEVICE_MEMORY = 11
CMD_HELLO = 14
CMD_DEVICE_COUNT = 15
CONN_CAPS_SIZE = 24          # rpc_msg_hello_req: conn_caps[24]; the response adds 4 version bytes
DEFAULT_PORT = 50052

CONNECT_TIMEOUT_S = 5.0
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_COUNT = 3
USER_TIMEOUT_MS = 20000


class RpcError(BackendError):
    """An RPC server is unreachable, speaks another protocol, or was lost during a run."""

    exit_code = 9


def available() -> bool:
    """Whether this ggml-python was built with GGML_RPC=ON (scripts/install.sh builds it so)."""
    return bool(getattr(ggml, "GGML_USE_RPC", False))


def install_hint() -> str:
    return ("this ggml-python was built without ggml's RPC backend: run scripts/install.sh (it builds "
            "ggml-python with -DGGML_RPC=ON), or `pip install --no-binary ggml-python --no-cache-dir "
            "--config-settings=cmake.args=-DGGML_RPC=ON ggml-python==0.0.45`")


def require() -> None:
    if not available():
        raise RpcError(install_hint())


# ----------------------------------------------------------------------------------------------
# Endpoints
# ----------------------------------------------------------------------------------------------
_ENDPOINT = re.compile(r"^([A-Za-z0-9._-]+):(\d{1,5})$")

#: ggml 0.15.3's transport (ggml-rpc/transport.cpp) opens AF_INET sockets only: the client resolves
#: with gethostbyname, the server binds an inet_addr() dotted quad, and the endpoint parser splits at
#: the first ':'. IPv6 is therefore refused here, in one line, instead of failing inside ggml.
IPV6_UNSUPPORTED = ("ggml's RPC transport (ggml 0.15.3) is IPv4 only: use an IPv4 address or a host name "
                    "with an IPv4 address (an SSH tunnel can carry it over IPv6)")


def _looks_ipv6(text: str) -> bool:
    return text.startswith("[") or text.count(":") > 1


def parse_endpoint(text: str) -> tuple[str, int]:
    """"host:port" -> (host, port); IPv6 literals ("[::1]:50052") are refused (IPV6_UNSUPPORTED)."""
    text = text.strip()
    if _looks_ipv6(text):
        raise RpcError(f"RPC endpoint {text!r} is IPv6; {IPV6_UNSUPPORTED}")
    m = _ENDPOINT.match(text)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise RpcError(f"bad RPC endpoint {text!r}: expected HOST:PORT, e.g. 192.168.1.20:{DEFAULT_PORT}")
    return m.group(1), int(m.group(2))


def ipv4_address(host: str, label: str) -> str:
    """The IPv4 address ggml's transport would use for `host` (the first, as gethostbyname gives).

    `label` starts the one-line error (e.g. "RPC server h:50052").
    """
    if ":" in host or host.startswith("["):
        raise RpcError(f"{label}: {host!r} is an IPv6 address; {IPV6_UNSUPPORTED}")
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as e:
        if _has_ipv6_only(host):
            raise RpcError(f"{label}: {host!r} has only IPv6 addresses; {IPV6_UNSUPPORTED}") from None
        raise RpcError(f"{label}: unknown host {host!r} ({e.strerror})") from None


def _has_ipv6_only(host: str) -> bool:
    try:
        return bool(socket.getaddrinfo(host, None, socket.AF_INET6, socket.SOCK_STREAM))
    except OSError:
        return False


def parse_endpoints(value: str | Sequence[str] | None) -> list[str]:
    """`--rpc a:1,b:2` (or a list of such strings) -> ["a:1", "b:2"], validated, duplicates refused."""
    if value is None:
        return []
    parts = value.split(",") if isinstance(value, str) else [p for v in value for p in str(v).split(",")]
    out: list[str] = []
    for p in (p.strip() for p in parts):
        if not p:
            continue
        host, port = parse_endpoint(p)
        ep = f"{host}:{port}"
        if ep in out:
            raise RpcError(f"RPC endpoint {ep} is given twice")
        out.append(ep)
    return out


# ----------------------------------------------------------------------------------------------
# The probe: HELLO, DEVICE_COUNT, GET_DEVICE_MEMORY in Python
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerInfo:
    endpoint: str
    version: tuple[int, int, int]
    devices: tuple[tuple[int, int], ...]     # (free, total) bytes per device

    @property
    def version_text(self) -> str:
        return ".".join(map(str, self.version))


def _recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        out += chunk
    return out


def _command(s: socket.socket, cmd: int, payload: bytes) -> bytes:
    """Send one command (| cmd u8 | size u64 | payload |) and read the answer (| size u64 | data |)."""
    s.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    (size,) = struct.unpack("<Q", _recv_exact(s, 8))
    if size > 1 << 20:
        raise ConnectionError(f"an answer of {size} bytes is not an RPC answer")
    return _recv_exact(s, size)


def probe(endpoint: str, timeout: float = CONNECT_TIMEOUT_S) -> ServerInfo:
    """Connect to `endpoint`, check its protocol version and read its devices' memory.

    Raises RpcError naming the endpoint when nothing answers within `timeout`, when the peer is
    not an RPC server, or when its protocol is not the one this ggml speaks (major 4, minor <= 0,
    as ggml's client checks). The connection is closed again: the server serves one client at a
    time.
    """
    host, port = parse_endpoint(endpoint)
    address = ipv4_address(host, f"RPC server {endpoint}")   # where ggml will connect: IPv4 only
    try:
        s = socket.create_connection((address, port), timeout=timeout)
    except socket.timeout:
        raise RpcError(f"RPC server {endpoint}: no answer within {timeout:g} s (is `deltarun rpc-server` "
                       f"running there, and the port open?)") from None
    except OSError as e:
        raise RpcError(f"RPC server {endpoint} is unreachable: {e.strerror or e} (is `deltarun rpc-server` "
                       f"running there?)") from None
    try:
        with s:
            s.settimeout(timeout)
            try:
                hello = _command(s, CMD_HELLO, bytes(CONN_CAPS_SIZE))
            except (ConnectionError, OSError) as e:
                raise RpcError(f"RPC server {endpoint} did not complete the protocol handshake ({e}): it is "
                               f"not a ggml RPC server of protocol {PROTOCOL[0]}.x, or it is serving another "
                               f"client") from None
            if len(hello) < 3:
                raise RpcError(f"RPC server {endpoint} sent a malformed handshake ({len(hello)} bytes)")
            version = (hello[0], hello[1], hello[2])
            if version[0] != PROTOCOL[0] or version[1] > PROTOCOL[1]:
                raise RpcError(f"RPC server {endpoint} speaks protocol {'.'.join(map(str, version))}, this "
                               f"deltarun's ggml speaks {'.'.join(map(str, PROTOCOL))}: run the same ggml "
                               f"version on both sides")
            (count,) = struct.unpack("<I", _command(s, CMD_DEVICE_COUNT, b"")[:4])
            devices = []
            for i in range(count):
                free, total = struct.unpack("<QQ", _command(s, CMD_GET_DEVICE_MEMORY, struct.pack("<I", i))[:16])
                devices.append((free, total))
    except socket.timeout:
        raise RpcError(f"RPC server {endpoint} accepted the connection but did not answer within {timeout:g} s "
                       f"(busy with another client?)") from None
    except (ConnectionError, OSError, struct.error) as e:
        raise RpcError(f"RPC server {endpoint} broke off the handshake: {e}") from None
    if not devices:
        raise RpcError(f"RPC server {endpoint} serves no device")
    return ServerInfo(endpoint, version, tuple(devices))


# ----------------------------------------------------------------------------------------------
# Registering servers with ggml
# ----------------------------------------------------------------------------------------------
_REGISTERED: dict[str, int] = {}        # endpoint -> ggml_backend_reg_t, registered in this process


def add_servers(endpoints: Iterable[str]) -> list[str]:
    """Probe each endpoint (every call), then add its devices to ggml's registry (once per process).

    Returns the endpoints in order. The abort hook is installed first, so that from here on a lost
    server ends the process with one line.
    """
    eps = list(endpoints)
    if not eps:
        return []
    require()
    install_abort_hook()
    connected = {e for _, e in _rpc_sockets()} if _REGISTERED else set()
    for ep in eps:
        if ep not in connected:
            # every time: a registered server may have gone since. A server this process is
            # connected to already (another Model, e.g. a draft) is not probed: it serves one
            # client at a time, and ggml shares its one connection per endpoint in a process.
            probe(ep)
        if ep in _REGISTERED:
            continue
        reg = ggml.ggml_backend_rpc_add_server(ep.encode())
        if not reg:
            raise RpcError(f"RPC server {ep}: ggml could not connect to it")
        ggml.ggml_backend_register(reg)
        _REGISTERED[ep] = int(reg)
    return eps


def registered() -> list[str]:
    return list(_REGISTERED)


def server_devices(endpoint: str) -> list[DeviceInfo]:
    """The registry's DeviceInfo of each device of a registered server, in its order."""
    return [d for d in list_devices() if d.registry == "RPC" and d.description == endpoint]


# ----------------------------------------------------------------------------------------------
# Faults: socket timeouts and the abort hook
# ----------------------------------------------------------------------------------------------
def _resolved(endpoint: str) -> set[tuple[str, int]]:
    host, port = parse_endpoint(endpoint)
    try:
        return {(ai[4][0], port) for ai in socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)}
    except OSError:
        return set()


_KNOWN: dict[int, str] = {}     # fd -> endpoint of the sockets harden_sockets found


def _socket_of(fd: int) -> socket.socket | None:
    """A socket object on a duplicate of `fd` (closing it leaves `fd` open); None if not a socket."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


def _rpc_sockets() -> list[tuple[int, str]]:
    """(fd, endpoint) of this process's TCP sockets connected to a registered RPC server."""
    peers: dict[tuple[str, int], str] = {}
    for ep in _REGISTERED:
        for addr in _resolved(ep):
            peers[addr] = ep
    out = []
    try:
        fds = [int(n) for n in os.listdir("/proc/self/fd")]
    except OSError:   # pragma: no cover - not Linux
        return out
    for fd in fds:
        s = _socket_of(fd)
        if s is None:
            continue
        try:
            if s.type == socket.SOCK_STREAM and s.family in (socket.AF_INET, socket.AF_INET6):
                ep = peers.get(tuple(s.getpeername()[:2]))
                if ep is not None:
                    out.append((fd, ep))
        except OSError:
            pass
        finally:
            s.close()    # closes the duplicate only
    return out


def harden_sockets() -> int:
    """Set keepalive and TCP_USER_TIMEOUT on ggml's RPC sockets (see the module docstring).

    Options set through a duplicate descriptor apply to the one socket both name. Returns how many
    sockets were found.
    """
    found = _rpc_sockets()
    _KNOWN.clear()
    _KNOWN.update(found)
    for fd, _ in found:
        s = _socket_of(fd)
        if s is None:
            continue
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for opt, val in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                             ("TCP_KEEPCNT", KEEPALIVE_COUNT), ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS)):
                if hasattr(socket, opt):
                    s.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
        except OSError:
            pass
        finally:
            s.close()
    return len(found)


def broken_connections() -> list[str]:
    """Registered endpoints whose ggml connection is broken (the server closed it, or a socket error).

    Only looks at the sockets (a non-blocking MSG_PEEK on a duplicate descriptor): safe to call from
    another thread while ggml waits on the same socket, and it never connects anywhere.
    """
    lost: list[str] = []
    for fd, ep in {**_KNOWN, **dict(_rpc_sockets())}.items():
        s = _socket_of(fd)
        if s is None:
            continue
        try:
            s.setblocking(False)
            s.getpeername()                   # ENOTCONN after a reset
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) or s.recv(1, socket.MSG_PEEK) == b"":
                lost.append(ep)               # an error, or the server closed its end
        except BlockingIOError:
            pass              # open, nothing to read: alive
        except OSError:
            lost.append(ep)   # reset, timed out
        finally:
            s.close()
    return sorted(set(lost), key=list(_REGISTERED).index)


def lost_endpoints() -> list[str]:
    """Registered endpoints whose connection is broken (EOF or a socket error), else unreachable."""
    lost = broken_connections()
    if lost:
        return lost
    for ep in _REGISTERED:
        try:
            socket.create_connection(parse_endpoint(ep), timeout=1.0).close()
        except OSError:
            lost.append(ep)
    return lost


#: Called with the one-line message just before a lost server ends the process (`on_lost`).
_LOST_LISTENERS: list[Any] = []


def on_lost(listener: Any) -> None:
    """Call `listener(line)` before the process ends for a lost RPC server (e.g. to tell a parent).

    A listener that returns True has reported the line itself: it is then not printed here.
    """
    _LOST_LISTENERS.append(listener)


def exit_lost(lost: list[str], detail: str) -> None:
    """Print the one line naming the lost endpoints and end the process with RpcError.exit_code."""
    who = (f"the RPC server {', '.join(lost)}" if lost
           else f"an RPC server ({', '.join(_REGISTERED) or 'unknown'})")
    line = f"error: lost {who}: {detail}\n"
    reported = False
    for listener in _LOST_LISTENERS:
        try:
            reported = bool(listener(line.strip())) or reported
        except Exception:  # noqa: BLE001 - we are about to exit; never raise into C
            pass
    try:
        sys.stdout.flush()
    except Exception:  # noqa: BLE001
        pass
    if not reported:
        os.write(2, line.encode())
    os._exit(RpcError.exit_code)


def _on_abort(message: bytes) -> None:
    text = (message or b"").decode(errors="replace").strip()
    if "ggml-rpc" not in text:
        os.write(2, (text + "\n").encode())     # ggml's own message; abort() follows
        return
    try:
        lost = lost_endpoints()
    except Exception:  # noqa: BLE001 - we are about to exit; never raise into C
        if os.environ.get("DELTARUN_RPC_DEBUG"):
            import traceback

            traceback.print_exc()
        lost = []
    exit_lost(lost, f"the connection broke during the run (ggml: {text.rsplit(': ', 1)[-1]})")


#: ggml-rpc's transport logs these just before the abort that `_on_abort` reports in one line.
_TRANSPORT_NOISE = (b"recv failed", b"send failed")


def _on_log(level: int, text: bytes, user_data: Any) -> None:
    """ggml's default logger (every message to stderr), minus the transport lines above."""
    if text and not text.startswith(_TRANSPORT_NOISE):
        os.write(2, text)


_HOOKS: list[Any] = []


def install_abort_hook() -> None:
    """Route ggml aborts through `_on_abort` and its log through `_on_log` (kept alive here)."""
    if not _HOOKS:
        _HOOKS.append(ggml.ggml_abort_callback_t(_on_abort))
        _HOOKS.append(ggml.ggml_log_callback(_on_log))
        ggml.ggml_set_abort_callback(_HOOKS[0])
        ggml.ggml_log_set(_HOOKS[1], None)


# ----------------------------------------------------------------------------------------------
# The server side
# ----------------------------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    import ipaddress

    return all(ipaddress.ip_address(ai[4][0]).is_loopback for ai in infos)


def check_port_free(host: str, port: int) -> None:
    """Fail early, in one line, when `host:port` cannot be bound (ggml only prints and returns)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError as e:
        raise RpcError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
    except OSError as e:
        raise RpcError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    finally:
        s.close()


def start_server(endpoint: str, device_handle: int, n_threads: int, cache_dir: str | None = None) -> None:
    """ggml_backend_rpc_start_server on one device; blocks until the process ends (no stop call)."""
    require()
    devs = (ctypes.c_void_p * 1)(device_handle)
    ggml.ggml_backend_rpc_start_server(endpoint.encode(), cache_dir.encode() if cache_dir else None,
                                       n_threads, 1, ctypes.cast(devs, ctypes.POINTER(ctypes.c_void_p)))
