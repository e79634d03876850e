"""The load progress bar: shown on a terminal while a large model is copied to a device."""

from __future__ import annotations

import io

from deltarun.runner import weights


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_for_large_uploads_on_a_terminal(monkeypatch):
    monkeypatch.setattr("sys.stderr", _Terminal())
    big = weights.PROGRESS_MIN_BYTES * 2
    with weights._upload_progress(big, "vulkan0") as bar:
        assert not bar.disable
        bar.update(big)
    assert "loading weights to vulkan0" in __import__("sys").stderr.getvalue()
    with weights._upload_progress(1024, "vulkan0") as bar:     # small: no bar
        assert bar.disable
    monkeypatch.setattr("sys.stderr", io.StringIO())             # not a terminal: no bar
    with weights._upload_progress(big, "vulkan0") as bar:
        assert bar.disable
