"""Compute threads kept one per core (runner/cpu_threads.py): which CPUs, when, and that it happens."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from deltarun.runner import cpu_threads
from deltarun.runner.cpu_threads import ThreadPinning, core_cpus
from deltarun.runner.model import Model


def _topology(tmp_path, siblings: dict[int, str]) -> str:
    for cpu, text in siblings.items():
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(text + "\n")
    return str(tmp_path)


def test_one_cpu_per_core_the_lowest_sibling_in_the_mask(tmp_path, monkeypatch):
    sysfs = _topology(tmp_path, {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3", 4: "4-5", 5: "4-5"})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert core_cpus(sysfs) == [0, 1]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {2, 3, 5})    # siblings 0, 1, 4 not ours
    assert core_cpus(sysfs) == [2, 3, 5]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {7, 9})       # no topology: each CPU
    assert core_cpus(sysfs) == [7, 9]


@pytest.mark.parametrize("n_threads, pin, cores, want", [
    (4, None, [0, 1, 2, 3], [0, 1, 2, 3]),   # one per core: pinned by default
    (2, None, [0, 1, 2, 3], None),           # fewer than the cores: left free by default
    (2, True, [0, 1, 2, 3], [0, 1]),         # unless asked (llama.cpp --cpu-strict 1)
    (4, False, [0, 1, 2, 3], None),
    (1, True, [0, 1], None),                 # one thread: nothing to keep apart
    (3, True, [0, 1], None),                 # more threads than cores: no CPU each
])
def test_when_threads_are_pinned(monkeypatch, n_threads, pin, cores, want):
    monkeypatch.setattr(cpu_threads, "core_cpus", lambda: cores)
    monkeypatch.delenv("OMP_PROC_BIND", raising=False)
    monkeypatch.delenv("GOMP_CPU_AFFINITY", raising=False)
    got = ThreadPinning.choose(n_threads, pin)
    assert (got.cpus if got is not None else None) == want


def test_the_users_own_openmp_binding_wins_by_default(monkeypatch):
    monkeypatch.setattr(cpu_threads, "core_cpus", lambda: [0, 1])
    monkeypatch.setenv("OMP_PROC_BIND", "close")
    assert ThreadPinning.choose(2) is None
    assert ThreadPinning.choose(2, True).cpus == [0, 1]
    monkeypatch.setenv("OMP_PROC_BIND", "false")
    assert ThreadPinning.choose(2).cpus == [0, 1]


def _affinities() -> dict[int, set[int]]:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = os.sched_getaffinity(int(tid))
        except OSError:      # the thread ended meanwhile
            pass
    return out


@pytest.mark.skipif(len(core_cpus()) < 2 or not os.path.isdir("/proc/self/task"),
                    reason="needs two cores and Linux's /proc")
def test_a_computing_thread_and_its_openmp_worker_each_keep_one_cpu(tiny_model_path):
    path = tiny_model_path("tiny", "f32")
    tokens = [5, 9, 11, 3, 7, 2]
    with Model(path, n_ctx=32, n_threads=1) as m:
        want = m.eval(tokens)
    cpus = core_cpus()[:2]
    main_before = os.sched_getaffinity(0)
    seen: dict = {}

    def compute() -> None:
        before = _affinities()
        with Model(path, n_ctx=32, n_threads=2, pin_threads=True) as m:
            assert m.backend.pinning is not None and m.backend.pinning.cpus == cpus
            seen["logits"] = m.eval(tokens)
            seen["self"] = os.sched_getaffinity(0)
            seen["new"] = {t: a for t, a in _affinities().items() if t not in before}

    t = threading.Thread(target=compute)
    t.start()
    t.join()
    assert seen["self"] == {cpus[0]}                       # the computing thread
    assert {cpus[1]} in seen["new"].values()               # its OpenMP worker, started by the first graph
    assert os.sched_getaffinity(0) == main_before          # the main thread was not touched
    np.testing.assert_allclose(seen["logits"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(len(core_cpus()) < 2, reason="needs two cores")
def test_the_main_thread_keeps_its_cpu_set(tiny_model_path):
    """Processes and threads it starts inherit it: only its OpenMP workers are pinned."""
    before = os.sched_getaffinity(0)
    with Model(tiny_model_path("tiny", "f32"), n_ctx=32, n_threads=2, pin_threads=True) as m:
        m.eval([5, 9, 11])
        assert m.backend.pinning is not None
    assert os.sched_getaffinity(0) == before


def test_no_pinning_option(tiny_model_path):
    with Model(tiny_model_path("tiny", "f32"), n_ctx=32, n_threads=2, pin_threads=False) as m:
        assert m.backend.pinning is None


@pytest.mark.skipif(len(core_cpus()) < 2, reason="needs two cores")
def test_without_lasting_worker_threads_the_computing_thread_stays_free(monkeypatch):
    """A ggml built without OpenMP starts new workers for every graph; they inherit the computing
    thread's CPU set, so pinning that thread would put them all on one CPU."""
    new_ids = iter([frozenset({101}), frozenset({102})])
    monkeypatch.setattr(ThreadPinning, "_pin_workers", lambda self: next(new_ids))
    pinning = ThreadPinning(core_cpus()[:2])
    seen = {}

    def compute() -> None:
        before = os.sched_getaffinity(0)
        pinning.before_compute()
        seen["kept"] = os.sched_getaffinity(0) == before

    t = threading.Thread(target=compute)
    t.start()
    t.join()
    assert seen["kept"]
