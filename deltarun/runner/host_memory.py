"""Host memory of a process that runs a model: numpy's transparent-huge-page advice turned off.

numpy (1.16 on, Linux) advises the kernel to back every array of 4 MiB or more with transparent
huge pages (madvise MADV_HUGEPAGE). A decoding step's logits are such arrays (16 rows of a
151,936-token vocabulary: 9.7 MB), and once glibc's mmap threshold has grown past their size it
serves them from its heap, so the advice stays on heap ranges that later hold other arrays: the
prompt cache's state copies (`Memory.read_recurrent`, 24 MB of 1 MB rows at Qwen3.5-0.8B's shapes)
and the next steps' outputs. With the kernel's default THP defrag setting ("madvise") a fault in
such a range allocates a huge page (compacting memory for it), which on a VM that backs guest memory
lazily costs several times what small pages cost (Zen 5 VM: 2.6-3.4 against 0.5-1.2 ms/MB). In a
`serve --draft mtp` process after a load test, the server's checkpoints (`read_recurrent`, medians
of 28) took 58-78 ms in five runs of six with the advice on, 12-17 ms in seven runs of twelve with
it off (bench/RESULTS.md, thirteenth session: new memory on that VM costs more at some minutes than
at others, for every process, which the other five show); a plain server, whose logits (4 rows,
2.4 MB) stay under numpy's threshold, took 8-13 ms. Huge pages would only save TLB misses on arrays that are
written or read once, so `settle_host_memory` turns the advice off for the process;
`cli.options.open_model` calls it, so every command and the server's model process (`serve
--rpc`'s child too) run with it off.
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
