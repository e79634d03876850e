"""Backend names, the device registry, --gpu-layers placement and per-layer buffers (CPU only)."""

from __future__ import annotations

import ctypes
import json
import os
import re

import numpy as np
import pytest
from click.testing import CliRunner

from deltarun.base.errors import BackendError, DeltarunError
from deltarun.base.ggml_util import ggml
from deltarun.cli.main import cli
from deltarun.runner import backend as be
from deltarun.runner import devices, placement, scheduler
from deltarun.runner.memory import Memory
from deltarun.runner.model import Model


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.mark.parametrize("name, want", [
    ("cpu", ("cpu", None)), ("CPU", ("cpu", None)), ("cpu-ref", ("cpu-ref", None)), ("auto", ("auto", None)),
    ("vulkan", ("vulkan", None)), ("vulkan:1", ("vulkan", 1)), ("cuda:0", ("cuda", 0)),
])
def test_backend_names_parse(name, want):
    assert devices.parse_backend_name(name) == want


@pytest.mark.parametrize("name", ["gpu9", "cpu:0", "vulkan:x", "metal", "", "cuda:-1"])
def test_unknown_backend_names_are_backend_errors(name):
    with pytest.raises(BackendError, match="unknown backend"):
        be.init_backend(name)


@pytest.mark.parametrize("kind, flag", [("vulkan", "-DGGML_VULKAN=ON"), ("cuda", "-DGGML_CUDA=ON")])
def test_a_backend_missing_from_the_build_says_how_to_install_it(kind, flag):
    if devices.build_has(kind):
        pytest.skip(f"this ggml-python build has {kind}")
    with pytest.raises(BackendError) as e:
        be.init_backend(f"{kind}:0")
    msg = str(e.value)
    assert isinstance(e.value, DeltarunError) and e.value.exit_code == 5
    assert f"no {devices.DEVICE_KINDS[kind][0]} backend" in msg
    assert f"--config-settings=cmake.args={flag} ggml-python==0.0.45" in msg
    assert f"scripts/install-{kind}.sh" in msg


def test_missing_backend_is_one_clear_cli_line(tiny_model):
    if devices.build_has("cuda"):
        pytest.skip("this ggml-python build has CUDA")
    r = run("generate", tiny_model, "-p", "hi", "-n", "1", "--backend", "cuda", "--threads", "1")
    assert r.exit_code == 5
    assert "Traceback" not in r.output
    assert "-DGGML_CUDA=ON" in r.stderr


def test_registry_lists_the_cpu():
    devs = devices.list_devices()
    cpu = [d for d in devs if d.registry == "CPU"]
    assert len(cpu) == 1
    d = cpu[0]
    assert d.type == "cpu" and d.backend_name == "cpu" and d.name == "CPU"
    assert d.memory_total > 0 and 0 < d.memory_free <= d.memory_total
    assert set(d.to_dict()) >= {"index", "name", "description", "type", "memory_free", "memory_total", "backend"}
    assert "cpu" in devices.available_backends() and "auto" in devices.available_backends()


def test_devices_command_table_and_json():
    r = run("devices")
    assert r.exit_code == 0, r.output
    assert "CPU" in r.stdout and "cpu, cpu-ref" in r.stdout and "auto picks:" in r.stdout
    r = run("devices", "--json")
    assert r.exit_code == 0
    data = json.loads(r.stdout)
    assert any(d["registry"] == "CPU" for d in data["devices"])
    assert set(data["built_with"]) == {"vulkan", "cuda"}
    assert data["auto"] == (devices.best_device().backend_name if devices.best_device() else "cpu")
    assert data["cpu_features"] == devices.cpu_features()


def test_devices_names_the_ggml_version(monkeypatch):
    # the ggml under the bindings (scripts/install.sh: a newer one than ggml-python vendors)
    version = ggml.ggml_version().decode()
    assert re.fullmatch(r"\d+\.\d+\.\d+", version)
    r = run("devices")
    assert f"on ggml {version}" in r.stdout
    assert json.loads(run("devices", "--json").stdout)["ggml"] == version
    monkeypatch.setattr(ggml, "ggml_version", lambda: b"9.8.7")
    assert "on ggml 9.8.7" in run("devices").stdout


def test_devices_names_the_types_multiplied_on_amx_tiles():
    """`devices` says which weight types ggml multiplies on AMX tiles here, as the engine sees them
    (`amx_columns`), and none with the tiles switched off (a process of its own: ggml reads the
    switches once)."""
    import subprocess
    import sys

    from deltarun.base.ggml_compat import amx_columns

    want = [n for n, t in (("Q8_0", ggml.GGML_TYPE_Q8_0), ("F16", ggml.GGML_TYPE_F16),
                           ("BF16", ggml.GGML_TYPE_BF16), ("Q4_K", ggml.GGML_TYPE_Q4_K),
                           ("Q6_K", ggml.GGML_TYPE_Q6_K)) if amx_columns(t)]
    assert json.loads(run("devices", "--json").stdout)["amx_tiles"] == want
    line = next(ln for ln in run("devices").stdout.splitlines() if ln.startswith("matrix products on AMX tiles:"))
    assert line.endswith(", ".join(want) + " weights (several columns)" if want else "none")
    env = dict(os.environ, DELTARUN_Q8_0_AMX="0", DELTARUN_HALF_AMX="0", DELTARUN_K_AMX="0")
    r = subprocess.run([sys.executable, "-m", "deltarun", "devices", "--json"], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and json.loads(r.stdout)["amx_tiles"] == [], r.stderr[-2000:]


def test_cpu_features_say_whether_llamafile_kernels_are_built_in(monkeypatch):
    assert ("LLAMAFILE" in devices.cpu_features()) == bool(ggml.ggml_cpu_has_llamafile())
    monkeypatch.setattr(ggml, "ggml_cpu_has_llamafile", lambda: 0)
    r = run("devices")
    assert "LLAMAFILE" not in r.stdout and "scripts/install.sh" in r.stdout
    monkeypatch.setattr(ggml, "ggml_cpu_has_llamafile", lambda: 1)
    r = run("devices")
    assert "LLAMAFILE" in r.stdout and "scripts/install.sh" not in r.stdout


def test_auto_without_a_gpu_is_the_cpu():
    if devices.best_device() is not None:
        pytest.skip("this machine has a GPU backend")
    b = be.init_backend("auto", 1)
    try:
        assert b.is_cpu and b.name == "cpu" and b.cpu is None and b.sched_backends == [b]
    finally:
        b.free()


def _flash_attention(kind: str, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """ggml_flash_attn_ext on backend `kind`: q [heads, rows, d] f32, k/v [heads, kv, d] f16 ->
    [rows, heads, d]."""
    backend = be.init_backend(kind, 1)
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=ggml.ggml_tensor_overhead() * 8 + ggml.ggml_graph_overhead(),
                                               mem_buffer=None, no_alloc=True))
    try:
        tq, tk, tv = (ggml.ggml_new_tensor_3d(ctx, t, a.shape[2], a.shape[1], a.shape[0])
                      for t, a in ((ggml.GGML_TYPE_F32, q), (ggml.GGML_TYPE_F16, k), (ggml.GGML_TYPE_F16, v)))
        out = ggml.ggml_flash_attn_ext(ctx, tq, tk, tv, None, 0.125, 0.0, 0.0)
        gf = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(gf, out)
        buf = ggml.ggml_backend_alloc_ctx_tensors(ctx, backend.handle)
        for t, a in ((tq, q), (tk, k), (tv, v)):
            a = np.ascontiguousarray(a)
            ggml.ggml_backend_tensor_set(t, a.ctypes.data, 0, a.nbytes)
        assert ggml.ggml_backend_graph_compute(backend.handle, gf) == ggml.GGML_STATUS_SUCCESS
        res = np.empty((q.shape[1], q.shape[0], q.shape[2]), np.float32)
        ggml.ggml_backend_tensor_get(out, res.ctypes.data, 0, res.nbytes)
        ggml.ggml_backend_buffer_free(buf)
        return res
    finally:
        ggml.ggml_free(ctx)
        backend.free()


def test_cpu_ref_switches_ggml_to_its_reference_kernels():
    """`cpu-ref` sets ggml_backend_cpu_set_use_ref. In ggml 0.15.3 that turns off op fusion
    (RMS_NORM+MUL, bit-identical) and the tiled flash-attention kernel, which ggml uses for 64 or
    more query rows; deltarun's graphs have no flash attention, so for them cpu-ref gives the same
    bits as cpu. A flash-attention graph shows the switch: with it, 64 rows are computed by the
    row-by-row kernel (the one short ubatches get), which rounds Q to F16 for its dot products."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 64, 64)).astype(np.float32)
    k = rng.standard_normal((2, 256, 64)).astype(np.float16)
    v = rng.standard_normal((2, 256, 64)).astype(np.float16)
    s = np.einsum("hqd,hkd->hqk", q.astype(np.float64), k.astype(np.float64)) * 0.125
    p = np.exp(s - s.max(-1, keepdims=True))
    want = np.einsum("hqk,hkd->qhd", p / p.sum(-1, keepdims=True), v.astype(np.float64))
    tiled, ref = _flash_attention("cpu", q, k, v), _flash_attention("cpu-ref", q, k, v)
    row_by_row = np.concatenate([_flash_attention("cpu", q[:, i:i + 16], k, v) for i in range(0, 64, 16)])
    assert np.array_equal(ref, row_by_row)              # the reference kernel, whatever the row count
    assert np.abs(tiled - want).max() < 1e-5            # tiled: F32 dot products
    assert 1e-4 < np.abs(ref - want).max() < 1e-2       # row by row: Q rounded to F16
    assert np.array_equal(_flash_attention("cpu-ref", q[:, :16], k, v), row_by_row[:16])


# --- placement (--gpu-layers) ----------------------------------------------------------------------
@pytest.fixture
def fake_device():
    """A 'device' backend that is really a second CPU backend, with its own CPU fallback: enough to
    check which layers go where, and that each buffer gets its layers."""
    dev = be.init_backend("cpu", 1)
    dev.name = "fake-device"
    dev.cpu = be.init_backend("cpu", 1)
    yield dev
    dev.free()


@pytest.mark.parametrize("n, on_device, output", [
    (None, [0, 1, 2, 3], True),       # default: everything on the device
    (0, [], False),
    (1, [3], False),
    (3, [1, 2, 3], False),
    (4, [0, 1, 2, 3], False),         # all repeating layers, output stays on the CPU ...
    (5, [0, 1, 2, 3], True),          # ... until N > n_layer (llama.cpp -ngl)
    (99, [0, 1, 2, 3], True),
])
def test_gpu_layers_follow_llama_cpp(fake_device, n, on_device, output):
    p = placement.Placement(4, fake_device, n)
    assert [il for il in range(4) if p.layer(il) is fake_device] == on_device
    assert p.output_on_device is output
    assert (p.for_tensor("output.weight") is fake_device) is output
    assert (p.for_tensor("output_norm.weight") is fake_device) is output
    assert (p.layer(4) is fake_device) is output             # MTP block goes with the output
    assert (p.for_tensor("token_embd.weight") is fake_device) is (n is None)
    # tied embeddings: the LM head is token_embd, so it follows the output
    assert (p.for_tensor("token_embd.weight", tied_output=True) is fake_device) is output
    assert p.for_tensor("blk.3.attn_norm.weight") is p.layer(3)
    assert "layers" in p.describe()


def test_placement_on_a_cpu_backend_is_all_cpu():
    cpu = be.init_backend("cpu", 1)
    try:
        for n in (None, 0, 2, 10):
            p = placement.Placement(4, cpu, n)
            assert all(p.layer(il) is cpu for il in range(5)) and p.for_tensor("token_embd.weight") is cpu
    finally:
        cpu.free()
    with pytest.raises(BackendError):
        placement.Placement(4, cpu, -1)


def test_memory_places_each_layer_in_its_backends_buffer(tiny_model_path, fake_device):
    with Model(tiny_model_path("tiny", "f32"), n_ctx=32, n_threads=1) as m:
        hp = m.hp
    p = placement.Placement(hp.n_layer, fake_device, 2)
    mem = Memory(hp, fake_device, 32, 2, 1, "f32", placement=p)
    try:
        assert len(mem.buffers) == 2
        last = hp.n_layer - 1
        dev_buffer = (mem.k[last] if last in mem.k else mem.conv[last]).contents.buffer
        for d, partner in ((mem.k, mem.v), (mem.conv, mem.ssm)):
            for il, t in d.items():
                assert t.contents.buffer in mem.buffers
                assert (t.contents.buffer == dev_buffer) is (il >= hp.n_layer - 2), il
                assert partner[il].contents.buffer == t.contents.buffer
        assert mem.nbytes >= mem.nbytes_expected()
        # clear() zeroes every buffer
        il = hp.linear_layers[0]
        ggml.ggml_backend_tensor_set(mem.ssm[il], np.ones(4, np.float32).ctypes.data, 0, 16)
        mem.clear()
        assert not mem.ssm_slots(il).any()
    finally:
        mem.free()
    assert mem.buffers == []


def test_model_with_gpu_layers_on_the_cpu_matches(tiny_model_path):
    """--gpu-layers on the CPU backend changes nothing (everything stays on the CPU)."""
    path = tiny_model_path("tiny", "f32")
    toks = list(range(5, 25))
    with Model(path, n_ctx=64, n_threads=1) as a, Model(path, n_ctx=64, n_threads=1, gpu_layers=2) as b:
        assert b.weights.bytes_by_backend == {"cpu": b.weights.nbytes}
        assert np.array_equal(a.eval(toks), b.eval(toks))
        assert b.sched.n_splits() >= 1



# --- the scheduler's eval callback -----------------------------------------------------------------
def test_the_scheduler_owns_the_eval_callback(tiny_model_path):
    """A callback set through the scheduler sees the nodes it asks for and changes no result."""
    path = tiny_model_path("tiny", "f32")
    toks = list(range(5, 25))
    with Model(path, n_ctx=64, n_threads=1) as m:
        want = m.eval(toks, all_logits=True)
        asked: list[str] = []
        seen: list[str] = []

        def observe(t, ask, user_data):
            name = ggml.ggml_get_name(t).decode()
            if ask:
                asked.append(name)
                return name == "result_norm"
            seen.append(name)
            return True

        m.reset()
        m.sched.set_eval_callback(observe)
        got = m.eval(toks, all_logits=True)
        m.sched.clear_eval_callback()
        assert seen == ["result_norm"] and len(asked) > 100
        assert np.array_equal(got, want) and m.sched._c_callback is None
        n = len(asked)
        m.reset()
        assert np.array_equal(m.eval(toks, all_logits=True), want) and len(asked) == n


def test_vulkan_workaround_respects_the_user(monkeypatch):
    for var in ("GGML_VK_DISABLE_GRAPH_OPTIMIZE", "DELTARUN_VK_WORKAROUNDS"):
        monkeypatch.delenv(var, raising=False)
    be.vulkan_workaround()
    assert os.environ["GGML_VK_DISABLE_GRAPH_OPTIMIZE"] == "1"
    monkeypatch.delenv("GGML_VK_DISABLE_GRAPH_OPTIMIZE")
    monkeypatch.setenv("DELTARUN_VK_WORKAROUNDS", "0")
    be.vulkan_workaround()
    assert "GGML_VK_DISABLE_GRAPH_OPTIMIZE" not in os.environ


def test_scheduler_puts_back_the_srcs_it_rewrote(tiny_model_path):
    """ggml's scheduler points a node's src at its own copy of an input that lives on another
    backend, in a context it frees on the next split; Scheduler.allocate saves every node's srcs
    before a graph's first allocation and puts them back before each later one."""
    with Model(tiny_model_path("tiny", "f32"), n_ctx=64, n_threads=1) as m:
        toks = list(range(5, 21))
        want = m.logits_for(toks)
        g = next(iter(m._graphs.values()))
        saved = m.sched._pristine[ctypes.addressof(g.gf.contents)]
        assert len(saved) == ggml.ggml_graph_n_nodes(g.gf)
        # what the scheduler does with a cross-backend input: point src[0] elsewhere
        node = next(ggml.ggml_graph_node(g.gf, i) for i in range(ggml.ggml_graph_n_nodes(g.gf))
                    if ggml.ggml_graph_node(g.gf, i).contents.src[0])
        original = ctypes.addressof(node.contents.src[0].contents)
        node.contents.src[0] = ggml.ggml_graph_node(g.gf, 0)
        m.eval([7])                                   # another graph is allocated in between
        assert np.array_equal(m.logits_for(toks), want)
        assert ctypes.addressof(node.contents.src[0].contents) == original
        # a graph whose nodes are not those of the snapshot is not touched
        other = next(x for x in m._graphs.values() if x is not g)
        assert not scheduler.restore_srcs(other.gf, saved)


def test_default_threads_count_physical_cores_in_the_affinity_mask(tmp_path, monkeypatch):
    # 4 CPUs in 2 cores (SMT pairs 0,2 and 1,3) plus a core (4,5) outside this process's mask
    siblings = {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3", 4: "4-5", 5: "4-5"}
    for cpu, text in siblings.items():
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "thread_siblings_list").write_text(text + "\n")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert devices.physical_cores(str(tmp_path)) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 4})
    assert devices.physical_cores(str(tmp_path)) == 3
    # no topology: one core per CPU
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {7, 8})
    assert devices.physical_cores(str(tmp_path)) == 2
