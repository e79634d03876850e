"""`deltarun rpc-server`: serve one local device to other machines through ggml's RPC backend.

The server is ggml's own (`ggml_backend_rpc_start_server`, protocol 7.0.0 in ggml 0.25.3), the same as
llama.cpp's `rpc-server`; clients connect with `--rpc HOST:PORT`. It runs in a thread of its own
because ggml's call blocks for ever and has no stop call: the main thread waits for Ctrl-C or
SIGTERM and then ends the process (the server holds nothing that needs saving). The protocol has
no authentication or encryption, so it binds loopback unless told otherwise and warns when it is not.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import click

from deltarun.cli.options import THREAD_COUNT
from deltarun.runner.rpc import DEFAULT_PORT


@click.command("rpc-server")
@click.option("--host", "-H", default="127.0.0.1", show_default=True,
              help="Address to listen on. Anything but loopback exposes the device to the network "
                   "without authentication.")
@click.option("--port", "-p", type=click.IntRange(1, 65535), default=DEFAULT_PORT, show_default=True)
@click.option("--backend", default="cpu", show_default=True, metavar="cpu|vulkan[:N]|cuda[:N]",
              help="The local device to serve (`deltarun devices` lists them).")
@click.option("--threads", "-t", type=THREAD_COUNT, default=None,
              help="CPU threads of the served backend [default: physical cores].")
@click.option("--cache", "cache_dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep large tensors uploaded by clients in this folder (by hash), so a client that "
                   "loads the same model again sends hashes instead of the bytes.")
def rpc_server(host: str, port: int, backend: str, threads: int | None, cache_dir: Path | None) -> None:
    """Serve a local ggml device to `--rpc HOST:PORT` clients (ggml's RPC server; Ctrl-C stops it)."""
    from deltarun.base.errors import BackendError
    from deltarun.runner import devices
    from deltarun.runner import rpc
    from deltarun.runner.backend import vulkan_workaround

    rpc.require()
    kind, index = devices.parse_backend_name(backend)
    if kind in ("cpu-ref", "auto"):
        raise BackendError(f"rpc-server serves cpu, vulkan[:N] or cuda[:N], not {backend!r}")
    if kind == "cpu":
        dev = next(d for d in devices.list_devices() if d.registry == "CPU")
    else:
        dev = devices.find_device(kind, index)
        if dev.registry == "Vulkan":
            vulkan_workaround()
    address = rpc.ipv4_address(host, "rpc-server --host")   # ggml binds an IPv4 dotted quad only
    rpc.check_port_free(address, port)
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
    if not rpc.is_loopback(host):
        click.secho(f"warning: listening on {host}:{port}: the RPC protocol has no authentication or "
                    f"encryption; anyone who can reach this port can run code on {dev.name} and read its "
                    f"memory. Use it on a trusted network only (or an SSH tunnel).", fg="yellow", err=True)
    n_threads = threads or devices.physical_cores()
    endpoint = f"{address}:{port}"
    done = threading.Event()

    def serve() -> None:
        rpc.start_server(endpoint, dev.handle, n_threads, str(cache_dir) if cache_dir else None)
        done.set()    # ggml returns only when it could not start

    def stop(signum: int, _frame: object) -> None:
        click.echo(f"rpc-server {endpoint}: stopped ({signal.Signals(signum).name})", err=True)
        sys.stdout.flush()
        os._exit(0)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    threading.Thread(target=serve, name="ggml-rpc-server", daemon=True).start()
    click.echo(f"rpc-server: serving {dev.name} ({dev.description}) on {endpoint}, {n_threads} threads; "
               f"clients: --rpc {endpoint}", err=True)
    while not done.wait(0.5):
        pass
    raise BackendError(f"ggml's RPC server could not start on {endpoint}")
