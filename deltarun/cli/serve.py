"""`deltarun serve`: an OpenAI-compatible HTTP server (see deltarun.apps.serve)."""

from __future__ import annotations

import functools
import ipaddress
import socket
from pathlib import Path

import click

from deltarun.base.errors import DeltarunError
from deltarun.cli.options import (FiniteFloatRange, check_draft, draft_model_options, draft_options, model_argument,
                                  model_options, open_model, reasoning_budget_option, resolve_model)


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


def _names(values: tuple[str, ...]) -> tuple[str, ...]:
    """Repeated and comma-separated option values as one tuple."""
    return tuple(n.strip() for v in values for n in v.split(",") if n.strip())


def _api_key(given: str | None, key_file: Path | None) -> str | None:
    """The key from --api-key / DELTARUN_API_KEY or --api-key-file (not both); a warning when it was
    typed on the command line, where the process list shows it to every local user."""
    ctx = click.get_current_context()
    if ctx.get_parameter_source("api_key") == click.core.ParameterSource.COMMANDLINE:
        click.secho("warning: --api-key on the command line is visible to every user of this machine (ps); "
                    "use DELTARUN_API_KEY or --api-key-file", fg="yellow", err=True)
    if key_file is None:
        return given
    if given is not None:
        raise DeltarunError("give the API key once: --api-key (or DELTARUN_API_KEY) or --api-key-file")
    try:
        lines = key_file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DeltarunError(f"cannot read the API key file {key_file}: {getattr(e, 'strerror', None) or e}") from e
    key = lines[0].strip() if lines else ""
    if not key:
        raise DeltarunError(f"the API key file {key_file} is empty")
    return key


@click.command()
@model_argument()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback exposes the model to the network.")
@click.option("--port", type=click.IntRange(min=0, max=65535), default=8080, show_default=True)
@click.option("--parallel", "-np", type=click.IntRange(min=1, max=64), default=4, show_default=True,
              help="Sequences decoded together (n_seq_max); more requests wait in the queue.")
@click.option("--cache-ram", type=click.IntRange(min=0), default=2048, show_default=True, metavar="MiB",
              help="Host RAM for the prompt cache: conversations moved out of their sequence, and state "
                   "checkpoints beyond the two newest of each sequence (those are always kept).")
@click.option("--api-key", default=None, envvar="DELTARUN_API_KEY",
              help="Require 'Authorization: Bearer KEY'. Pass it as DELTARUN_API_KEY or with --api-key-file: "
                   "on the command line every local user sees it (ps).")
@click.option("--api-key-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Read the API key from this file (its first line).")
@click.option("--allowed-hosts", multiple=True, metavar="NAMES",
              help="Host names the server answers to besides IP addresses, localhost, this machine's name and "
                   "--host (comma-separated or repeated; '.example.com' for a domain and its subdomains, '*' for "
                   "any). Other names are refused (DNS rebinding).")
@click.option("--allowed-origins", multiple=True, metavar="ORIGINS",
              help="Web origins (https://app.example.com) whose pages may call the API, with CORS for them; '*' "
                   "for any. By default only the server's own pages may.")
@click.option("--header-timeout", type=FiniteFloatRange(min=0.1), default=10.0, show_default=True, metavar="S",
              help="Seconds a client has to send a whole request head.")
@click.option("--body-timeout", type=FiniteFloatRange(min=0.1), default=60.0, show_default=True, metavar="S",
              help="Seconds a client has to send a whole request body.")
@click.option("--keep-alive", type=FiniteFloatRange(min=0.1), default=5.0, show_default=True, metavar="S",
              help="Seconds an idle kept-alive connection stays open.")
@click.option("--max-connections", type=click.IntRange(min=1), default=256, show_default=True,
              help="Open connections at most; more are answered 503 and closed.")
@click.option("--expose-model-path", is_flag=True, default=False,
              help="Report the model's absolute path in /props (else its file name).")
@click.option("--max-queue", type=click.IntRange(min=0), default=64, show_default=True,
              help="Requests that may wait for a sequence; beyond that the answer is 503 with Retry-After.")
@click.option("--chunk", type=click.IntRange(min=1), default=None,
              help="Most prompt tokens evaluated between two decode steps [default: --ubatch].")
@click.option("--checkpoint-every", type=click.IntRange(min=0), default=1024, show_default=True,
              help="Also checkpoint the recurrent state every N prompt tokens (0: only at message boundaries "
                   "and prompt ends).")
@click.option("--prefill-ahead/--no-prefill-ahead", default=True, show_default=True,
              help="While idle, evaluate what a conversation's next request will start with (the answer as the "
                   "template renders an earlier one), so the next turn evaluates only its new message.")
@click.option("--prefill-assistant/--no-prefill-assistant", default=True, show_default=True,
              help="A chat request whose messages end with an assistant message continues that message (its "
                   "text starts the answer), as llama-server; off: the answer is a new message after it, as "
                   "OpenAI's API. A request's 'continue_final_message' decides for itself; /v1/messages always "
                   "continues (Anthropic's prefill).")
@click.option("--max-body", type=click.IntRange(min=1), default=8, show_default=True, metavar="MiB",
              help="Largest request body accepted.")
@click.option("--alias", default=None, help="Model id reported by /v1/models [default: the file name].")
@click.option("--mmproj", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The model's vision tower (mmproj-*.gguf): chat requests may then send images (image_url "
                   "parts with data: URLs).")
@draft_options
@reasoning_budget_option
@click.option("--log-level", type=click.Choice(["critical", "error", "warning", "info", "debug"]),
              default="warning", show_default=True)
@model_options
def serve(model: Path | None, host: str, port: int, parallel: int, cache_ram: int, api_key: str | None,
          api_key_file: Path | None, allowed_hosts: tuple[str, ...], allowed_origins: tuple[str, ...],
          header_timeout: float, body_timeout: float, keep_alive: float, max_connections: int,
          expose_model_path: bool, max_queue: int, chunk: int | None, checkpoint_every: int, prefill_ahead: bool,
          prefill_assistant: bool, max_body: int, alias: str | None, mmproj: Path | None,
          draft: str | None, draft_max: int, log_level: str, reasoning_budget: int = -1, **opts: object) -> None:
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, ...).

    --reasoning-budget is the budget of requests that name none (or -1), as llama-server's.
    """
    api_key = _api_key(api_key, api_key_file)
    try:
        from deltarun.apps.serve.connections import ConnectionLimits
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
    check_draft(path, draft, opts.get("draft_vocab"))
    if mmproj is not None and not mmproj.is_file():
        raise DeltarunError(f"{mmproj}: no such mmproj file")
    open_draft = None
    if draft is not None:      # a rejected draft is rolled back within the recurrent-state slots
        opts["rs_slots"] = max(int(opts["rs_slots"]), draft_max + 1)
        opts["ubatch"] = max(int(opts["ubatch"]), draft_max + 1)
        if draft not in ("ngram", "mtp"):      # a draft GGUF: one sequence per request sequence (a partial: it pickles)
            open_draft = functools.partial(open_model, Path(draft), n_seq_max=parallel, quiet=True,
                                           **draft_model_options(opts))
    settings = ServeSettings(parallel=parallel, cache_ram_mib=cache_ram, api_key=api_key, max_queue=max_queue,
                             chunk=chunk or int(opts["ubatch"]), checkpoint_every=checkpoint_every,
                             max_body_mib=max_body, model_name=alias or path.name, draft=draft, draft_max=draft_max,
                             rpc=tuple(parse_endpoints(opts.get("rpc"))), open_draft=open_draft, mmproj=mmproj,
                             prefill_ahead=prefill_ahead, allowed_hosts=_names(allowed_hosts),
                             reasoning_budget=reasoning_budget, prefill_assistant=prefill_assistant,
                             allowed_origins=_names(allowed_origins), expose_model_path=expose_model_path,
                             limits=ConnectionLimits(header_timeout_s=header_timeout, body_timeout_s=body_timeout,
                                                     keep_alive_s=keep_alive, max_connections=max_connections))

    # a partial, not a closure: with --rpc the model opens in a spawned child process (supervisor.py)
    load = functools.partial(open_model, path, n_seq_max=parallel, quiet=True, mtp=draft == "mtp",
                             capture_slots=CAPTURE_SLOTS, **opts)

    def ready() -> None:
        click.echo(f"serving {path.name} on http://{host}:{port}/v1 ({parallel} sequences)", err=True)

    serve_forever(load, settings, host, port, log_level=log_level, on_ready=ready)
