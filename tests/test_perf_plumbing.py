"""The plumbing that keeps Python out of the way: graph reuse, zero-copy weights, fast metadata.

No timings are asserted here (bench/compare_llamacpp.py measures speed); these tests pin down
the mechanisms the speed depends on, and that the fast paths give exactly what the plain ones do.
"""

from __future__ import annotations

import ctypes
import struct

import gguf
import numpy as np
import pytest

from deltarun.base.fast_gguf import ArrayParts, FastGGUFReader, array_values
from deltarun.base.ggml_util import ggml
from deltarun.base.gguf_file import GGUFFile
from deltarun.base.tokenizer import Tokenizer, TokenizerError, _rank_merges, _rank_merges_loop
from deltarun.runner.model import KV_PAD, Model

from shipped_data import qwen2_vocab_gguf


def prompt(n: int, seed: int = 3) -> list[int]:
    return np.random.default_rng(seed).integers(0, 2000, size=n).tolist()


# ------------------------------------------------------------------------------------ graphs
def test_the_graph_cache_keeps_the_most_recently_used_graphs(tiny_model_path, monkeypatch):
    """A server meets a new prompt length in most requests: graphs beyond MAX_GRAPHS are freed,
    least recently used first (also by the step schedulers of keep_step_graphs), and a shape that
    comes back is built again and computes the same."""
    from deltarun.runner import model as model_module

    path = tiny_model_path("tiny", "q8_0")
    lengths = [5, 6, 7, 8, 5, 9, 6, 5]

    def run(m: Model) -> list[np.ndarray]:
        out = []
        for n in lengths:
            for k in (n, n + 10, n + 20):        # three prompt shapes in a row push the decode graph out
                logits = m.eval(prompt(k, seed=k))
            for _ in range(3):                   # decode steps: the step schedulers' graphs
                logits = m.eval([int(np.argmax(logits))])
            out.append(logits)
            m.reset()
        return out

    with Model(path, n_ctx=256, n_threads=1, rs_slots=2) as m:
        m.keep_step_graphs(2)
        want = run(m)
        assert m.stats.n_graph_builds == 16       # 15 prompt lengths + one decode shape, all kept
    monkeypatch.setattr(model_module, "MAX_GRAPHS", 3)
    with Model(path, n_ctx=256, n_threads=1, rs_slots=2) as m:
        m.keep_step_graphs(2)
        got = run(m)
        assert len(m._graphs) == 3
        assert m.stats.n_graph_builds > 16         # shapes that came back were built again
        for sched in [m.sched, *m._step_scheds]:
            assert len(sched._pristine) <= 3 and len(sched._layouts) <= 3
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)


def test_decode_steps_reuse_one_graph(tiny_model_path):
    with Model(tiny_model_path("tiny", "q8_0"), n_ctx=1024, n_threads=1) as m:
        logits = m.eval(prompt(20))
        logits = m.eval([int(np.argmax(logits))])
        builds = m.stats.n_graph_builds
        n_graphs = len(m._graphs)
        for _ in range(60):                     # stays inside one KV_PAD window: one decode shape
            logits = m.eval([int(np.argmax(logits))])
        assert m.stats.n_graph_builds == builds
        assert len(m._graphs) == n_graphs
        # the per-graph input buffers are made once too, on the graph's first step
        plans = {id(g.inputs) for g in m._graphs.values()}
        for _ in range(3):
            logits = m.eval([int(np.argmax(logits))])
        assert {id(g.inputs) for g in m._graphs.values()} == plans and None not in plans


def test_graph_count_does_not_grow_with_decode_length(tiny_model_path):
    """Past a KV_PAD boundary exactly one more decode graph appears, then none for KV_PAD steps."""
    with Model(tiny_model_path("tiny", "q8_0"), n_ctx=1024, n_threads=1) as m:
        m.eval(prompt(KV_PAD - 4))
        for t in range(8):                      # crosses n_kv = 256 -> 512
            m.eval([t + 1])
        builds = m.stats.n_graph_builds
        for t in range(60):
            m.eval([t + 1])
        assert m.stats.n_graph_builds == builds


@pytest.mark.parametrize("delta_net", ["fused", "primitive"])
def test_compute_buffers_are_reserved_once_for_the_largest_ubatch(tiny_model_path, delta_net):
    with Model(tiny_model_path("tiny", "f32"), n_ctx=96, n_ubatch=32, n_threads=1, delta_net=delta_net) as m:
        reserved = m.sched.compute_buffer_size()
        assert reserved > 0 and m.stats.n_graph_builds == 0       # the worst-case graph is not kept
        logits = m.eval(prompt(70), all_logits=True)[-1]          # two full ubatches and a short one
        for _ in range(5):
            logits = m.eval([int(np.argmax(logits))])
        m.reset()
        m.logits_for(prompt(32, seed=4))                            # a full ubatch with every output
        assert m.sched.compute_buffer_size() == reserved


# ------------------------------------------------------------------------------------ weights
def test_cpu_weights_are_not_copied(tiny_model_path):
    path = tiny_model_path("tiny", "q8_0")
    with Model(path, n_ctx=64, n_threads=1) as m:
        f = m.file
        base, size = f.data_base_address, f.file_size
        assert base % 32 == 0
        # the weights buffer is the file mapping itself
        assert int(ggml.ggml_backend_buffer_get_base(m.weights.buffer) or 0) == base
        assert int(ggml.ggml_backend_buffer_get_size(m.weights.buffer)) == size
        assert len(m.weights.buffers) == 1
        for name, t in m.weights.tensors.items():
            addr = ctypes.cast(t.contents.data, ctypes.c_void_p).value
            info = f.tensors[name]
            assert base <= addr and addr + info.nbytes <= base + size, name
            assert addr == base + info.offset, name
        # and the mapping is the reader's memmap of the file, not a copy
        assert isinstance(f.reader.data, np.memmap)
        assert f.reader.data.ctypes.data == base


# ------------------------------------------------------------------------------------ fast GGUF
def assert_same_reader(plain: gguf.GGUFReader, fast: gguf.GGUFReader) -> None:
    assert isinstance(fast, gguf.GGUFReader)
    assert list(plain.fields) == list(fast.fields)
    for key, a in plain.fields.items():
        b = fast.fields[key]
        assert (a.offset, a.name) == (b.offset, b.name), key
        assert list(a.types) == list(b.types), key
        assert list(a.data) == list(b.data), key
        assert len(a.parts) == len(b.parts), key
        for x, y in zip(a.parts, b.parts):
            assert x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes(), key
        assert a.contents() == b.contents(), key
        assert array_values(b) == a.contents(), key
        if a.data:                                           # indexing a single item
            assert a.contents(0) == b.contents(0), key
            assert a.contents(-1) == b.contents(-1), key
    assert (plain.data_offset, plain.alignment, plain.byte_order) == (fast.data_offset, fast.alignment,
                                                                       fast.byte_order)
    assert len(plain.tensors) == len(fast.tensors)
    for x, y in zip(plain.tensors, fast.tensors):
        assert (x.name, x.tensor_type, x.n_elements, x.n_bytes, x.data_offset) == \
               (y.name, y.tensor_type, y.n_elements, y.n_bytes, y.data_offset)
        assert np.array_equal(x.shape, y.shape)
        assert x.data.dtype == y.data.dtype and x.data.shape == y.data.shape
        assert x.data.ctypes.data == y.data.ctypes.data - fast.data.ctypes.data + plain.data.ctypes.data


def test_fast_reader_equals_gguf_reader_on_the_shipped_vocab():
    VOCAB_GGUF = qwen2_vocab_gguf()
    plain = gguf.GGUFReader(str(VOCAB_GGUF))
    fast = FastGGUFReader(str(VOCAB_GGUF))
    assert isinstance(fast.fields["tokenizer.ggml.tokens"].parts, ArrayParts)   # the fast path ran
    assert_same_reader(plain, fast)
    a, b = Tokenizer.from_gguf(plain), Tokenizer.from_gguf(fast)
    assert a._tokens == b._tokens and a._types == b._types
    assert a._merge_ranks == b._merge_ranks and a._token_to_id == b._token_to_id
    text = "Hello world, ünïcödé 你好 <|im_start|>user\n  123  "
    assert a.encode(text) == b.encode(text)


def test_fast_reader_equals_gguf_reader_on_a_model(tiny_model_path):
    path = tiny_model_path("tiny-mtp", "q4_k")
    assert_same_reader(gguf.GGUFReader(str(path)), FastGGUFReader(str(path)))
    assert isinstance(GGUFFile(path).reader, FastGGUFReader)


def test_fast_reader_every_value_type(tmp_path):
    """Arrays of each scalar type, of strings, empty arrays and scalars read as the plain reader does."""
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "test")
    T = gguf.GGUFValueType
    for vt, values in [(T.UINT8, [1, 2, 255]), (T.INT8, [-1, 2]), (T.UINT16, [7, 65535]), (T.INT16, [-3]),
                       (T.UINT32, [1, 2, 3]), (T.INT32, [-5, 6]), (T.FLOAT32, [1.5, -2.25]),
                       (T.UINT64, [2**40]), (T.INT64, [-(2**40)]), (T.FLOAT64, [0.125]), (T.BOOL, [True, False])]:
        w.add_key_value(f"arr.{vt.name.lower()}.typed", values, T.ARRAY, sub_type=vt)
    w.add_array("arr.strings", ["a", "", "ünï", "x y"])
    w.add_string("s", "text")
    w.add_uint32("u", 7)
    w.add_tensor("t", np.arange(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert_same_reader(gguf.GGUFReader(str(path)), FastGGUFReader(str(path)))


def test_fast_reader_empty_arrays(tmp_path):
    """GGUFWriter refuses empty arrays, but files may hold them: written by hand here."""
    def key(name: str) -> bytes:
        return struct.pack("<Q", len(name)) + name.encode()

    T = gguf.GGUFValueType
    body = (key("arr.empty") + struct.pack("<IIQ", T.ARRAY, T.INT32, 0)
            + key("arr.empty_strings") + struct.pack("<IIQ", T.ARRAY, T.STRING, 0)
            + key("after") + struct.pack("<I", T.UINT32) + struct.pack("<I", 9))
    raw = b"GGUF" + struct.pack("<IQQ", 3, 0, 3) + body
    path = tmp_path / "empty.gguf"
    path.write_bytes(raw + b"\0" * (-len(raw) % 32))
    fast = FastGGUFReader(str(path))
    assert_same_reader(gguf.GGUFReader(str(path)), fast)
    assert fast.fields["arr.empty"].contents() == [] and fast.fields["after"].contents() == 9


def test_fast_reader_rejects_a_truncated_string_array(tmp_path):
    path = tmp_path / "cut.gguf"
    w = gguf.GGUFWriter(str(path), "test")
    w.add_array("arr.strings", ["abc", "def"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    raw = path.read_bytes()
    cut = tmp_path / "cut2.gguf"
    cut.write_bytes(raw[:-2])
    with pytest.raises((ValueError, IndexError, struct.error)):
        FastGGUFReader(str(cut))


# ------------------------------------------------------------------------------------ tokenizer
@pytest.mark.parametrize("merges", [
    ["a b", "ab c"],
    ["a b", "a b", "ab c"],                   # a repeated pair keeps its first rank
    ["a b", "a  b"],                          # two spaces
    ["a b", "ab"],                            # no space
    ["a b", " b"],                            # empty left
    ["a b", "a\nb c"],                        # newline inside a line
    ["a b", "a z"],                           # unknown token
    [],
])
def test_rank_merges_fast_path_matches_loop(merges):
    vocab = {t: i for i, t in enumerate(["a", "b", "c", "ab", "abc", "a\nb", "a\nbc", " b"])}
    try:
        want = _rank_merges_loop(merges, vocab)
    except TokenizerError as e:
        with pytest.raises(TokenizerError) as got:
            _rank_merges(merges, vocab)
        assert str(got.value) == str(e)
    else:
        assert _rank_merges(merges, vocab) == want
