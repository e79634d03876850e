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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
