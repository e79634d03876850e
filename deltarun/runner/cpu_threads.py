"""Which CPUs the CPU backend's compute threads use: one per physical core, each kept on its own.

ggml-python's CPU backend is built with OpenMP: a graph computes in one parallel region whose
threads meet at a barrier after every node (hundreds per ubatch), so one thread that waits for
a CPU delays them all. Left to the kernel, a region's threads and the process's other threads
(a server's event loop, an HTTP client on the same machine) get stacked on one CPU now and then,
and the graph runs at about one thread's speed. Measured on the 2-vCPU Zen 4 VM with the built-in
model and 2 threads (bench/RESULTS.md, "Compute threads kept on their cores"): a 192-token
prompt sent to `deltarun serve` every 0.3 s took a median 19.8-21.1 ms to evaluate, and the
slowest of 20 took 22.7-27.7 ms, with the threads pinned; 23.6-28.8 and 36.3-54.8 ms without.

So the thread that computes a graph (OpenMP's thread 0) stays on `cpus[0]` from its first graph
on, and OpenMP's worker threads, which do nothing but compute, on `cpus[1]`, `cpus[2]`, ...:
a one-node graph whose custom op pins the thread that runs each of its tasks does that once per
computing thread (OpenMP keeps a team of workers per calling thread). It runs twice: where the
same worker threads do not come back (a ggml built without OpenMP starts new ones for every
graph, and they inherit the computing thread's CPU set) the computing thread is left free. The process's main thread
is the exception: processes and threads it starts inherit its CPU set, so it stays free (its
workers are still pinned). Pinning it for the duration of each graph only (and giving its set
back after) cost 2-8 % of decode speed (`deltarun bench` tg128, 6 alternated rounds): moving
a thread back onto its CPU takes about 28 us here against 1 us for a call that moves nothing.

By default threads are pinned only when there are as many as the process has physical cores
(`core_cpus`; the default thread count): the process then uses every core it may run on
anyway. With fewer threads they are left free, so that two processes with a few threads each on
a large machine are not pinned onto the same cores. `pin=True` pins them to the first cores all
the same (llama.cpp's `--cpu-strict 1`), `pin=False` never does; by default an OMP_PROC_BIND or
GOMP_CPU_AFFINITY in the environment (libgomp then binds its threads itself) also leaves them be.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from deltarun.base.ggml_util import ggml


def core_cpus(sysfs: str = "/sys/devices/system/cpu") -> list[int]:
    """One CPU per physical core this process may run on (the lowest of each core's SMT siblings),
    in order; each CPU counts as a core where the topology cannot be read."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return list(range(max(1, os.cpu_count() or 1)))
    firsts: set[int] = set()
    for cpu in cpus:
        try:
            with open(f"{sysfs}/cpu{cpu}/topology/thread_siblings_list") as f:
                siblings = _parse_cpu_list(f.read()) & set(cpus)
        except (OSError, ValueError):
            siblings = {cpu}
        firsts.add(min(siblings or {cpu}))
    return sorted(firsts)


def _parse_cpu_list(text: str) -> set[int]:
    """Linux's CPU list syntax, e.g. "0-3,8,10-11"."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


class ThreadPinning:
    """Keeps a CPU backend's compute threads one per CPU of `cpus`: call `before_compute()` in the
    thread that is about to compute a graph."""

    def __init__(self, cpus: list[int]):
        self.cpus = list(cpus)
        self._local = threading.local()    # .pinned: this thread and its OpenMP workers are

    @classmethod
    def choose(cls, n_threads: int, pin: bool | None = None) -> "ThreadPinning | None":
        """The pinning for `n_threads` compute threads (see the module docstring), or None."""
        if n_threads < 2 or pin is False or not hasattr(os, "sched_setaffinity"):
            return None
        if pin is None and any(os.environ.get(k, "false").lower() not in ("false", "")
                               for k in ("OMP_PROC_BIND", "GOMP_CPU_AFFINITY")):
            return None                    # the user binds OpenMP's threads themselves
        cores = core_cpus()
        if n_threads > len(cores) or (pin is None and n_threads != len(cores)):
            return None
        return cls(cores[:n_threads])

    def before_compute(self) -> None:
        """Pin this thread (unless it is the main thread) and its OpenMP workers, the first time."""
        if getattr(self._local, "pinned", False):
            return
        self._local.pinned = True
        first, second = self._pin_workers(), self._pin_workers()
        if first != second:
            # not OpenMP: ggml starts new worker threads for every graph, and they would inherit
            # this thread's CPU set: pinning it would put them all on its CPU
            return
        if threading.current_thread() is not threading.main_thread():
            try:
                os.sched_setaffinity(0, {self.cpus[0]})
            except OSError:       # the CPU left this process's set meanwhile: leave it free
                pass

    def _pin_workers(self) -> frozenset[int]:
        """Run a graph of one custom op with a task per thread; task i > 0 pins the thread running
        it to cpus[i] (task 0 runs in the calling thread). Returns the worker threads' ids."""
        cpus = self.cpus
        workers: set[int] = set()

        @ggml.ggml_custom1_op_t
        def pin_this_thread(dst: Any, a: Any, ith: int, nth: int, userdata: Any) -> None:
            if 0 < ith < len(cpus):
                workers.add(threading.get_native_id())
                try:
                    os.sched_setaffinity(0, {cpus[ith]})
                except OSError:       # the CPU left this process's set meanwhile: leave it free
                    pass

        # room for the graph, two tensors and ggml_graph_compute_with_ctx's (empty) work buffer
        size = ggml.ggml_graph_overhead() + 4 * ggml.ggml_tensor_overhead() + 4096
        params = ggml.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=False)
        ctx = ggml.ggml_init(params)
        if not ctx:
            raise MemoryError("ggml_init failed to allocate a context")
        try:
            a = ggml.ggml_new_tensor_1d(ctx, ggml.GGML_TYPE_F32, len(cpus))
            gf = ggml.ggml_new_graph(ctx)
            ggml.ggml_build_forward_expand(gf, ggml.ggml_map_custom1(ctx, a, pin_this_thread, len(cpus), None))
            ggml.ggml_graph_compute_with_ctx(ctx, gf, len(cpus))
        finally:
            ggml.ggml_free(ctx)
        return frozenset(workers)
