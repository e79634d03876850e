"""Reading the user's text files and leaving quietly when stdout goes away: shared by the commands."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click


def read_text_file(file: Path, param_hint: str = "'-f' / '--file'") -> str:
    """The file's text (UTF-8); a file that cannot be read is a bad value of the option."""
    try:
        return file.read_text(encoding="utf-8")
    except OSError as e:
        raise click.BadParameter(f"cannot read {file}: {e.strerror or e}", param_hint=param_hint)
    except UnicodeDecodeError as e:
        raise click.BadParameter(f"{file} is not UTF-8 text ({e.reason} at byte {e.start})", param_hint=param_hint)


def silence_stdout() -> None:
    """Point stdout at /dev/null (the reader is gone, e.g. `| head`), so the interpreter's final
    flush does not raise again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # not a real file (e.g. under a test runner)
        pass
