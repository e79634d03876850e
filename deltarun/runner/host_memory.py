"""Host memory of a process that runs a model: numpy's transparent-huge-page advice turned off.

numpy (1.16 on, Linux) advises the kernel to back every array of 4 MiB or more with transparent
huge pages (madvise MADV_HUGEPAGE). A decoding step's logits are such arrays (16 rows of a
151,936-token vocabulary: 9.7 MB), and once glibc's mmap threshold has grown past their size it
serves them from its heap, so the advice stays on heap ranges that later hold other arrays: the
prompt cache's state copies (`Memory.read_recurrent`, 24 MB of 1 MB rows at Qwen3.5-0.8B's shapes)
and the next steps' outputs. With the kernel's default THP defrag setting ("madvise") a fault in
such a range compacts memory to find a huge page. In a `serve --draft mtp` process (Zen 5 VM, after
a load test) touching a fresh 24 MB array took 120-163 ms against 17-24 ms with the advice off, and
the server's checkpoints (`read_recurrent`) 72-89 ms against 14-35 ms (medians of 28); a plain
server, whose logits (4 rows, 2.4 MB) stay under numpy's threshold, took 10 ms either way. A model's
arrays gain nothing measurable from huge pages (they are read once or copied once), so
`settle_host_memory` turns the advice off for the process; `cli.options.open_model` calls it, so
every command and the server's model process (`serve --rpc`'s child too) run with it off.
"""

from __future__ import annotations


def _madvise_switch():
    """numpy's setter of the advice (it returns the previous setting), or None where numpy has none."""
    try:
        from numpy._core import multiarray        # numpy 2
    except ImportError:                           # pragma: no cover - numpy 1.x
        from numpy.core import multiarray
    return getattr(multiarray, "_set_madvise_hugepage", None)


def settle_host_memory() -> None:
    """Turn numpy's huge-page advice off for this process (see the module docstring)."""
    switch = _madvise_switch()
    if switch is not None:
        switch(False)


def hugepage_advice_on() -> bool:
    """Whether numpy advises huge pages for large arrays now (for tests and diagnostics)."""
    switch = _madvise_switch()
    if switch is None:
        return False
    was = switch(True)
    switch(was)
    return bool(was)
