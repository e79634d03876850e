"""Writing files so that a failure (a full disk, an interrupt) never leaves one half-written."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomically(path: str | Path, data: bytes | str) -> None:
    """Write to a temporary file beside `path`, flush it to disk, then rename it over `path`.

    On any error the temporary file is removed and `path` keeps its old content (or stays
    absent); the OSError propagates for the caller to report.
    """
    path = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    fd, tmp = temporary_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError) and e.filename in (tmp, None):
            e.filename, e.filename2 = str(path), None    # the user's path, not the temporary
        raise


def temporary_beside(path: Path) -> tuple[int, str]:
    """A new temporary file (fd, name) in `path`'s folder; an error names `path`, not the temporary."""
    try:
        return tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from None
