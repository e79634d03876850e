"""Fuzzing the GGUF loader: damaged headers, metadata and tensor tables never crash deltarun.

Hypothesis mutates the bytes before the tensor data of a generated tiny model (the header, the
metadata and the tensor-info table; the tensor data itself only changes numbers): bit flips,
overwrites with random or boundary values, small arithmetic on counts and lengths, inserted and
deleted bytes, truncation. Half the mutations aim at the start of a field (a count, a length, a
type, a shape, an offset), found by walking the good file; the rest land anywhere in the region.

Each case is written to a file and loaded in a subprocess (`python -m deltarun.apps.fault_probe`,
which opens the model and evaluates one token). It must end either loaded (exit 0) or refused with
deltarun's own error: exit code of a `DeltarunError` subclass and one `ERROR <Class>: <file>: ...`
line. A signal (GGML_ASSERT abort, segfault), a Python traceback, or a timeout fails the test. The
probe also caps its address space, so a file that makes the loader allocate gigabytes fails too.

The default run is 60 derandomized cases; `-m slow` runs 500.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import gguf
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from deltarun.base import errors
from deltarun.model_files.generate import write_model

sys.path.insert(0, str(Path(__file__).parent))
from test_loader_errors import SCALAR_SIZES, walk  # noqa: E402  (the tests' own GGUF field walker)

GV_STRING = gguf.GGUFValueType.STRING

TIMEOUT_S = 20
MEMORY_CAP_MB = 4096   # a normal probe peaks near 600 MB of address space
DEFAULT_CASES = 60
SLOW_CASES = 500

#: exit code -> names of the DeltarunError classes that use it
ERROR_EXIT_CODES: dict[int, set[str]] = {}
for _cls in vars(errors).values():
    if isinstance(_cls, type) and issubclass(_cls, errors.DeltarunError):
        ERROR_EXIT_CODES.setdefault(_cls.exit_code, set()).add(_cls.__name__)


@dataclass(frozen=True)
class Base:
    path: Path
    data: bytes          # the whole good file
    region_end: int      # where tensor data starts: mutations stay before it
    hot: tuple[int, ...]  # starts of counts, lengths and types (changing them shifts what follows)
    values: tuple[tuple[int, int], ...]  # (position, width) of scalar values, tensor shapes, types, offsets
    texts: tuple[tuple[int, int], ...]   # (position, length) of the bytes of string values


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Base:
    return make_base(tmp_path_factory.mktemp("fuzz-gguf"))


def make_base(d: Path) -> Base:
    """The tiny Q8_0 model written into `d`, with the positions mutations aim at."""
    path = write_model(d / "tiny-q8_0.gguf", "tiny", "q8_0")
    pos = walk(path)
    hot = {4, 8, 16}
    values: set[tuple[int, int]] = set()
    texts: list[tuple[int, int]] = []
    data = path.read_bytes()
    for kv in pos.kv.values():
        hot.update((kv.pos, kv.type_pos, kv.value_pos, kv.value_pos + 4))
        if kv.vtype in SCALAR_SIZES:
            values.add((kv.value_pos, SCALAR_SIZES[kv.vtype]))
        elif kv.vtype == GV_STRING:
            (n,) = struct.unpack_from("<Q", data, kv.value_pos)
            texts.append((kv.value_pos + 8, n))
    for ti in pos.tensors.values():
        hot.update((ti.pos, ti.ndims_pos))
        values.update((ti.dims_pos + 8 * i, 8) for i in range(len(ti.ne)))
        values.update({(ti.type_pos, 4), (ti.offset_pos, 8)})
    return Base(path, data, pos.data_offset, tuple(sorted(hot)), tuple(sorted(values)), tuple(texts))


# --- mutations ----------------------------------------------------------------------------------
KINDS = ("flip", "set", "arith", "random", "insert", "delete", "truncate")
BOUNDARY = {1: [0, 1, 2, 0x7F, 0x80, 0xFF], 2: [0, 1, 0x7FFF, 0x8000, 0xFFFF]}
BOUNDARY[4] = [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 24, 31, 32, 33, 63, 64, 255, 256, 0x7FFF, 0xFFFF, 0x10000,
               0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF]
BOUNDARY[8] = BOUNDARY[4] + [1 << 32, (1 << 32) + 1, 1 << 40, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 32,
                             (1 << 64) - 1]
FORMATS = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}


@st.composite
def mutation_lists(draw: st.DrawFn, base: Base) -> list[tuple]:
    """1-3 mutations, each (kind, position, width, argument).

    Most keep the layout intact, so they reach the checks behind it and ggml: "value" changes a
    number in place (a hyper-parameter, a tensor's shape, type or offset), "text" the bytes of a
    string (architecture, tokenizer model, chat template...). "hot" hits the counts, lengths and
    types that the layout hangs on; "anywhere" lands anywhere in the region.
    """
    out = []
    for _ in range(draw(st.integers(1, 3))):
        target = draw(st.sampled_from(("value", "value", "text", "hot", "anywhere")))
        if target == "value":
            pos, width = draw(st.sampled_from(base.values))
            kind = draw(st.sampled_from(("flip", "set", "arith")))
        elif target == "text":
            start, n = draw(st.sampled_from(base.texts))
            pos = start + draw(st.integers(0, max(n - 1, 0)))
            kind, width = "random", 1
            out.append((kind, pos, width, draw(st.binary(min_size=1, max_size=max(1, min(4, start + n - pos))))))
            continue
        else:
            kind = draw(st.sampled_from(KINDS))
            width = draw(st.sampled_from((4, 8)))
            if target == "hot":
                pos = max(4, draw(st.sampled_from(base.hot)) + draw(st.integers(-2, 4)))  # leave the magic alone
            else:
                pos = draw(st.integers(0, base.region_end - 1))
        pos = min(pos, base.region_end - 1)
        if kind == "flip":
            arg = (draw(st.integers(0, width - 1)) << 8) | (1 << draw(st.integers(0, 7)))  # byte index, bit
        elif kind == "set":
            arg = draw(st.sampled_from(BOUNDARY[width]))
        elif kind == "arith":
            arg = draw(st.integers(-35, 35).filter(bool))
        elif kind in ("random", "insert"):
            arg = draw(st.binary(min_size=1, max_size=16))
        elif kind == "delete":
            arg = draw(st.integers(1, 16))
        else:
            arg = None
        out.append((kind, pos, width, arg))
    return out


def apply(base: Base, mutations: list[tuple]) -> bytes:
    """The base file with `mutations` applied to its header/metadata/tensor-info region."""
    head = bytearray(base.data[:base.region_end])
    tail = base.data[base.region_end:]
    for kind, pos, width, arg in mutations:
        pos = min(pos, len(head))
        fits = pos + width <= len(head)
        if kind == "flip" and pos + (arg >> 8) < len(head):
            head[pos + (arg >> 8)] ^= arg & 0xFF
        elif kind == "set" and fits:
            struct.pack_into(FORMATS[width], head, pos, arg)
        elif kind == "arith" and fits:
            (v,) = struct.unpack_from(FORMATS[width], head, pos)
            struct.pack_into(FORMATS[width], head, pos, (v + arg) % (1 << (8 * width)))
        elif kind == "random":
            head[pos:pos + len(arg)] = arg
        elif kind == "insert":
            head[pos:pos] = arg
        elif kind == "delete":
            del head[pos:pos + arg]
        elif kind == "truncate":
            return bytes(head[:pos])
    return bytes(head) + tail


# --- running one case ---------------------------------------------------------------------------
def probe(path: Path) -> tuple[str, str]:
    """Load `path` in a subprocess; returns (outcome, detail) or fails the test with the reason."""
    cmd = [sys.executable, "-m", "deltarun.apps.fault_probe", str(path), "--max-memory-mb", str(MEMORY_CAP_MB)]
    env = dict(os.environ, PYTHONFAULTHANDLER="1", OMP_NUM_THREADS="1")
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"loading the case hung (> {TIMEOUT_S} s)")
    detail = f"exit {r.returncode}\nstdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-4000:]}"
    assert r.returncode >= 0, f"killed by signal {-r.returncode}: {detail}"
    assert "Traceback" not in r.stderr, f"a Python traceback: {detail}"
    if r.returncode == 0:
        assert r.stdout.startswith("OK"), detail
        return "OK", r.stdout.strip()
    assert r.returncode in ERROR_EXIT_CODES, f"exit code of no DeltarunError: {detail}"
    assert r.stdout.startswith("ERROR "), detail
    cls = r.stdout.split()[1].rstrip(":")
    assert cls in ERROR_EXIT_CODES[r.returncode], f"{cls} does not exit with {r.returncode}: {detail}"
    assert str(path) in r.stdout, f"the message does not name the file: {detail}"
    return cls, r.stdout.strip()


def run_fuzz(base: Base, tmp_path: Path, n_cases: int) -> Counter:
    outcomes: Counter = Counter()
    case_path = tmp_path / "case.gguf"

    @settings(max_examples=n_cases, derandomize=True, database=None, deadline=None,
              phases=(Phase.generate, Phase.shrink), suppress_health_check=list(HealthCheck))
    @given(mutations=mutation_lists(base))
    def one_case(mutations: list[tuple]) -> None:
        case_path.write_bytes(apply(base, mutations))
        outcome, _ = probe(case_path)
        outcomes[outcome] += 1

    t0 = time.perf_counter()
    try:
        one_case()
    finally:
        case_path.unlink(missing_ok=True)
        elapsed = time.perf_counter() - t0
        total = sum(outcomes.values())
        summary = ", ".join(f"{k} {v}" for k, v in outcomes.most_common())
        print(f"\nfuzz: {total} cases in {elapsed:.1f} s ({summary})")
    return outcomes


def test_fuzz_header_metadata_and_tensor_table(base, tmp_path):
    outcomes = run_fuzz(base, tmp_path, DEFAULT_CASES)
    assert sum(outcomes.values()) >= DEFAULT_CASES * 0.9   # hypothesis may skip a few duplicates
    assert len(outcomes) >= 2                              # the mutations reach more than one check


@pytest.mark.slow
def test_fuzz_header_metadata_and_tensor_table_long(base, tmp_path):
    outcomes = run_fuzz(base, tmp_path, SLOW_CASES)
    assert sum(outcomes.values()) >= SLOW_CASES * 0.9


# --- the harness itself -------------------------------------------------------------------------
def test_unmutated_base_loads_in_the_probe(base):
    assert probe(base.path)[0] == "OK"


def test_mutations_stay_before_the_tensor_data(base):
    muts = [("random", base.region_end - 1, 4, b"\x00" * 16), ("insert", 5, 4, b"xy"), ("delete", 100, 4, 3)]
    out = apply(base, muts)
    assert out.endswith(base.data[base.region_end:])
    assert len(out) == len(base.data) + 15 + 2 - 3  # the overwrite at the last byte spills 15 bytes
