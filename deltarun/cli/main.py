"""The `deltarun` command: a click group whose subcommands live one per module in this package.

Every expected failure is a `DeltarunError`; it is printed as one line and mapped to its exit code.
`--verbose` shows the traceback as well.
"""

from __future__ import annotations

import errno
import importlib
import sys

import click

from deltarun.base.errors import DeltarunError

# command name -> "module:attribute"; modules are imported only when their command runs.
COMMANDS: dict[str, str] = {
    "graph": "deltarun.cli.graph:graph",
    "generate": "deltarun.cli.generate:generate",
    "inspect": "deltarun.cli.inspect:inspect",
    "make-tiny": "deltarun.cli.make_tiny:make_tiny",
    "chat": "deltarun.cli.chat:chat",
    "bench": "deltarun.cli.bench:bench",
    "perplexity": "deltarun.cli.perplexity:perplexity",
    "compare": "deltarun.cli.compare:compare",
    "devices": "deltarun.cli.devices:devices",
    "rpc-server": "deltarun.cli.rpc_server:rpc_server",
    "serve": "deltarun.cli.serve:serve",
}


class LazyGroup(click.Group):
    """Imports a subcommand's module on first use, so `deltarun --help` and each command start fast."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        target = COMMANDS.get(name)
        if target is None:
            return None
        module, attr = target.split(":")
        command = getattr(importlib.import_module(module), attr)
        if not any(p.name == "verbose" for p in command.params):   # `deltarun COMMAND ... --verbose` too
            command.params.append(click.Option(["--verbose"], is_flag=True, expose_value=False,
                                               callback=_set_verbose, help="Show tracebacks for errors."))
        return command

    def invoke(self, ctx: click.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except click.BadParameter as e:   # a value the user got wrong: one line, as every other error
            if ctx.obj and ctx.obj.get("verbose"):
                import traceback

                traceback.print_exc()
            click.secho(f"error: {e.format_message()}", fg="red", err=True)
            sys.exit(e.exit_code)
        except DeltarunError as e:
            if ctx.obj and ctx.obj.get("verbose"):
                import traceback

                traceback.print_exc()
            click.secho(f"error: {e}", fg="red", err=True)
            sys.exit(e.exit_code)
        except MemoryError as e:
            click.secho(f"error: out of memory ({e})", fg="red", err=True)
            sys.exit(6)
        except BrokenPipeError:
            sys.exit(0)
        except OSError as e:   # a file the command reads or writes: say which and why, in one line
            if ctx.obj and ctx.obj.get("verbose"):
                import traceback

                traceback.print_exc()
            where = f"{e.filename}: " if e.filename else ""
            hint = "; free some disk space and try again (files are replaced only once fully written)" \
                if e.errno == errno.ENOSPC else ""
            click.secho(f"error: {where}{e.strerror or e}{hint}", fg="red", err=True)
            sys.exit(7)


def _set_verbose(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    if value:
        ctx.ensure_object(dict)["verbose"] = True


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--verbose", is_flag=True, help="Show tracebacks for errors.")
@click.version_option(package_name="deltarun")
@click.pass_context
def cli(ctx: click.Context, verbose: bool) -> None:
    """Run Qwen3-Next GGUF models through ggml graphs."""
    ctx.ensure_object(dict)
    ctx.obj["verbose"] = verbose


def main() -> None:  # pragma: no cover - console entry
    cli()
