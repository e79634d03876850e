"""`deltarun serve`: an OpenAI-compatible HTTP server (see deltarun.apps.serve)."""

from __future__ import annotations

import functools
import ipaddress
import socket
from pathlib import Path

import click

from deltarun.base.errors import DeltarunError
from deltarun.cli.options import (check_draft, draft_model_options, draft_options, model_argument, model_options,
                                  open_model, resolve_model)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_port(host: str, port: int) -> None:
    """Fail early, in one line, when the address cannot be listened on (uvicorn would say it later)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise DeltarunError(f"cannot listen on {host}:{port}: {e.strerror}") from e
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise DeltarunError(f"cannot listen on {host}:{port}: {e.strerror}") from e


@click.command()
@model_argument()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback exposes the model to the network.")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8080, show_default=True)
@click.option("--parallel", "-np", type=click.IntRange(min=1, max=64), default=4, show_default=True,
              help="Sequences decoded together (slots); more requests wait in the queue.")
@click.option("--cache-ram", type=click.IntRange(min=0), default=2048, show_default=True, metavar="MiB",
              help="Host RAM for the prompt cache: conversations moved out of their slot, and state checkpoints "
                   "beyond the two newest of each slot (those are always kept).")
@click.option("--api-key", default=None, envvar="DELTARUN_API_KEY",
              help="Require 'Authorization: Bearer KEY' [env DELTARUN_API_KEY].")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests that may wait for a slot; beyond that the answer is 503 with Retry-After.")
@click.option("--chunk", type=click.IntRange(min=1), default=None,
              help="Most prompt tokens evaluated between two decode steps [default: --batch].")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=1024, show_default=True,
              help="Also checkpoint the recurrent state every N prompt tokens (0: only at message boundaries "
                   "and prompt ends).")
@click.option("--prefill-ahead/--no-prefill-ahead", default=True, show_default=True,
              help="While idle, evaluate what a conversation's next request will start with (the answer as the "
                   "template renders an earlier one), so the next turn evaluates only its new message.")
@click.option("--max-body", type=click.IntRange(min=1), default=8, show_default=True, metavar="MiB",
              help="Largest request body accepted.")
@click.option("--alias", default=None, help="Model id reported by /v1/models [default: the file name].")
@draft_options
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              default="warning", show_default=True)
@model_options
def serve(model: Path | None, host: str, port: int, parallel: int, cache_ram: int, api_key: str | None,
          max_queue: int, chunk: int | None, checkpoint_every: int, prefill_ahead: bool, max_body: int,
          alias: str | None,
          draft: str | None, draft_max: int, log_level: str, **opts: object) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, ...)."""
    try:
        from deltarun.apps.serve.server import ServeSettings, serve_forever
        from deltarun.apps.serve.worker import CAPTURE_SLOTS
        from deltarun.runner.rpc import parse_endpoints
    except ImportError as e:   # pragma: no cover - the dependencies are in pyproject.toml
        raise DeltarunError(f"the server needs its dependencies: pip install -e . ({e})") from e
    path = resolve_model(model)
    if not path.is_file():
        raise DeltarunError(f"{path}: no such model file")
    check_port(host, port)
    if not is_loopback(host):
        click.secho(f"warning: listening on {host}: anyone who can reach this address can use the model"
                    + ("" if api_key else " (no --api-key set)"), fg="yellow", err=True)
    check_draft(path, draft)
    open_draft = None
    if draft is not None:      # a rejected draft is rolled back within the recurrent-state slots
        opts["rs_slots"] = max(int(opts["rs_slots"]), draft_max + 1)
        opts["batch"] = max(int(opts["batch"]), draft_max + 1)
        if draft not in ("ngram", "mtp"):      # a draft GGUF: one sequence per slot (a partial: it pickles)
            open_draft = functools.partial(open_model, Path(draft), n_seq_max=parallel, quiet=True,
                                           **draft_model_options(opts))
    settings = ServeSettings(parallel=parallel, cache_ram_mib=cache_ram, api_key=api_key, max_queue=max_queue,
                             chunk=chunk or int(opts["batch"]), checkpoint_every=checkpoint_every,
                             max_body_mib=max_body, model_name=alias or path.name, draft=draft, draft_max=draft_max,
                             rpc=tuple(parse_endpoints(opts.get("rpc"))), open_draft=open_draft,
                             prefill_ahead=prefill_ahead)

    # a partial, not a closure: with --rpc the model opens in a spawned child process (supervisor.py)
    load = functools.partial(open_model, path, n_seq_max=parallel, quiet=True, mtp=draft == "mtp",
                             capture_slots=CAPTURE_SLOTS, **opts)

    def ready() -> None:
        click.echo(f"serving {path.name} on http://{host}:{port}/v1 ({parallel} slots)", err=True)

    serve_forever(load, settings, host, port, log_level=log_level, on_ready=ready)
