"""CPU against Vulkan with `deltarun compare`, on the tiny models (the text models, and the tiny
vision tower: `compare --mmproj`, its embeddings against the float64 reference, an image through
`generate`).

Needs the Vulkan variant of ggml-python (scripts/install-vulkan.sh) and a Vulkan device; on a
machine without a GPU Mesa's lavapipe is one (ggml lists it only with GGML_VK_VISIBLE_DEVICES=0,
which these tests set). Skipped otherwise, unless DELTARUN_REQUIRE_VULKAN=1 (CI), which turns the
skip into a failure. Each comparison runs in a subprocess, so the Vulkan environment variables
are in place before ggml enumerates devices:

- GGML_VK_VISIBLE_DEVICES=0 (default here): the first Vulkan device, lavapipe on such a machine;
- GGML_VK_DISABLE_F16=1: matrix products accumulate in F32 as on the CPU, so F32 models are held
  to the same limits as CPU against CPU (the notes measured 2.8e-7 relative);
- MESA_SHADER_CACHE_DIR: keep it between runs; lavapipe compiles each pipeline on first use
  (10-130 s each), later runs read them back in well under a second.

On lavapipe, quantised matrix products differ from the CPU's by 0.5-1% (the CPU backend
quantises the activations to Q8; lavapipe has no integer dot product), enough to flip the MoE's
expert choice where two experts nearly tie, so the quantised test checks the logits only.

Lavapipe before Mesa 24 corrupts its own heap now and then while it runs these graphs (Debian
12's 22.3.6: 2-3 of 12 `compare` runs of tiny-legacy); scripts/install-vulkan.sh unpacks Mesa 25
from bookworm-backports there and `.ci/run` points the Vulkan loader at it (VK_DRIVER_FILES).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deltarun.runner import devices

REQUIRE = os.environ.get("DELTARUN_REQUIRE_VULKAN") == "1"
ENV = {"GGML_VK_VISIBLE_DEVICES": os.environ.get("GGML_VK_VISIBLE_DEVICES", "0"), "GGML_VK_DISABLE_F16": "1"}
TIMEOUT = int(os.environ.get("DELTARUN_VULKAN_TIMEOUT", "1800"))


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(ENV)
    env.update(extra)
    return env


def _vulkan_devices() -> tuple[list[dict], str]:
    if not devices.build_has("vulkan"):
        return [], "this ggml-python build has no Vulkan backend (scripts/install-vulkan.sh builds one)"
    out = subprocess.run([sys.executable, "-m", "deltarun", "devices", "--json"], env=_env(), capture_output=True,
                         text=True, timeout=120)
    if out.returncode != 0:
        return [], f"`deltarun devices` failed: {out.stderr.strip()}"
    devs = [d for d in json.loads(out.stdout)["devices"] if d["registry"] == "Vulkan"]
    return devs, "" if devs else "no Vulkan device (is mesa-vulkan-drivers installed?)"


DEVICES, WHY = _vulkan_devices()
if not DEVICES:
    if REQUIRE:
        raise RuntimeError(f"DELTARUN_REQUIRE_VULKAN=1 but {WHY}")
    pytestmark = pytest.mark.skip(reason=WHY)


def deltarun(*args: str | Path, env: dict[str, str] | None = None, code: int | None = 0) -> subprocess.CompletedProcess:
    """Run the CLI in a subprocess."""
    p = subprocess.run([sys.executable, "-m", "deltarun", *[str(a) for a in args]], env=env or _env(),
                       capture_output=True, text=True, timeout=TIMEOUT)
    if code is not None:
        assert p.returncode == code, (p.returncode, p.stdout[-4000:], p.stderr[-4000:])
    return p


def compare(model: Path, *args: str, code: int | None = 0) -> dict:
    p = deltarun("compare", model, "--backends", "cpu,vulkan", "--json", "-q", "-t", "1", *args, code=code)
    rep = json.loads(p.stdout)
    lg = rep["logits"]
    worst = max((n for g in rep["graphs"] for n in g["nodes"] if isinstance(n["nmse"], float)),
                key=lambda n: n["nmse"], default=None)
    print(f"\n{model.name} {' '.join(args)}: passed={rep['passed']} logits NMSE {lg['nmse']:.3g} "
          f"top-1 {lg['top1_agreement']:.3f} KL mean {lg['kl_mean']:.3g} max {lg['kl_max']:.3g} "
          f"greedy {'match' if rep['greedy']['match'] else 'differ'}; worst node "
          f"{worst['name'] + ' ' + worst['op'] + ' %.3g' % worst['nmse'] if worst else '-'}; "
          f"splits {rep['sides'][1]['n_splits']}")
    return rep


def _run_script(script: str, model: Path) -> subprocess.CompletedProcess:
    """`python -c script MODEL` with the Vulkan environment; it must exit 0."""
    p = subprocess.run([sys.executable, "-c", script, str(model)], env=_env(), capture_output=True, text=True,
                       timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr[-4000:]
    return p


def test_vulkan_device_is_listed():
    d = DEVICES[0]
    assert d["backend"] == "vulkan:0" and d["name"] == "Vulkan0" and d["memory_total"] > 0


def test_lavapipe_is_hidden_without_the_visible_devices_variable():
    if not any(d["software"] for d in DEVICES):
        pytest.skip("the Vulkan device is a real GPU")
    env = _env()
    env.pop("GGML_VK_VISIBLE_DEVICES")
    p = deltarun("generate", "-p", "hi", "-n", "1", "--backend", "vulkan", env=env, code=5)
    assert "GGML_VK_VISIBLE_DEVICES=0" in p.stderr and "Traceback" not in p.stderr


def test_graphs_coming_back_give_the_same_logits(tiny_model_path):
    """Prefill, decode, prefill again: the cached prefill graph is allocated again after the decode
    graph (the scheduler's input copies of the first allocation are gone by then)."""
    script = (
        "import sys, numpy as np\n"
        "from deltarun.runner.model import Model\n"
        "toks = list(range(5, 21))\n"
        "with Model(sys.argv[1], backend='vulkan', n_ctx=64, n_ubatch=16, n_threads=1, kv_type='f32') as m:\n"
        "    a = m.logits_for(toks); m.eval([7]); b = m.logits_for(toks); m.eval([7]); c = m.logits_for(toks)\n"
        "    print(float(np.abs(a - b).max()), float(np.abs(a - c).max()))\n")
    p = _run_script(script, tiny_model_path("tiny", "f32"))
    assert p.stdout.split() == ["0.0", "0.0"]


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen4exp"])
def test_rollback_slots_match_the_cpu(tiny_model_path, preset):
    """The states are read in place and slot 0 is overwritten by the snapshot store after the
    start state was copied to slot n (n < K): the node order carries that, also on Vulkan (whose
    graph optimiser reorders nodes). Slots after a 2-token ubatch with K = 4 equal the CPU's: the
    delta net's conv windows and states, and qwen4exp's n-gram conv state kept beside them."""
    script = (
        "import sys, numpy as np\n"
        "from deltarun.runner.model import Model\n"
        "from deltarun.base.ggml_util import tensor_to_numpy\n"
        "slots = {}\n"
        "for be in ('cpu', 'vulkan'):\n"
        "    for dn in ('fused', 'primitive'):\n"
        "        with Model(sys.argv[1], backend=be, n_ctx=64, n_threads=1, kv_type='f32', rs_slots=4, delta_net=dn) as m:\n"
        "            m.eval(list(range(5, 13))); m.eval([40, 41])\n"
        "            extra = [m.memory._conv_slot_views(tensor_to_numpy(m.memory.conv[il]).reshape(m.memory.n_seq_max, -1)[0])[1][:3]\n"
        "                     for il in m.hp.linear_layers]\n"
        "            slots[be, dn] = [np.concatenate([m.memory.conv_slots(il)[:3].ravel(), m.memory.ssm_slots(il)[:3].ravel(),\n"
        "                                             x.ravel()]) for il, x in zip(m.hp.linear_layers, extra)]\n"
        "            if be == 'cpu' and dn == 'fused':\n"
        "                print(sum(x.size for x in extra))\n"
        "for dn in ('fused', 'primitive'):\n"
        "    print(max(float(np.abs(a - b).max()) for a, b in zip(slots['cpu', dn], slots['vulkan', dn])))\n")
    p = _run_script(script, tiny_model_path(preset, "f32"))
    n_extra, *errors = p.stdout.split()
    assert (int(n_extra) > 0) == (preset == "tiny-qwen4exp"), p.stdout
    assert all(float(x) < 1e-4 for x in errors), p.stdout


@pytest.mark.parametrize("preset", ["tiny", "tiny-qwen4exp"])
def test_capture_points_match_the_cpu(tiny_model_path, preset):
    """Model.eval(captures=) on Vulkan (what `serve` does with a prompt's checkpoints): the delta
    rule split at the points, the states copied to the capture slots (conv windows, qwen4exp's
    n-gram conv state with them, SSM states), for K = 1 and K = 3 (a point among the last K states
    read from a snapshot), fused and primitive, equal the CPU's."""
    script = (
        "import sys, numpy as np\n"
        "from deltarun.runner.model import Model\n"
        "got = {}\n"
        "for be in ('cpu', 'vulkan'):\n"
        "    for dn in ('fused', 'primitive'):\n"
        "        for k in (1, 3):\n"
        "            with Model(sys.argv[1], backend=be, n_ctx=64, n_threads=1, kv_type='f32', rs_slots=k, delta_net=dn,\n"
        "                       capture_slots=3) as m:\n"
        "                m.eval(list(range(5, 13)))\n"
        "                lg = m.eval(list(range(30, 50)), captures=[3, 11, 18], all_logits=True)\n"
        "                got[be, dn, k] = [lg.ravel()] + [np.frombuffer(part[il], np.float32) for st in\n"
        "                    (m.last_captures[p] for p in (11, 19, 26)) for part in (st.conv, st.ssm)\n"
        "                    for il in m.hp.linear_layers]\n"
        "for dn in ('fused', 'primitive'):\n"
        "    for k in (1, 3):\n"
        "        print(max(float(np.abs(a - b).max()) for a, b in zip(got['cpu', dn, k], got['vulkan', dn, k])))\n")
    p = _run_script(script, tiny_model_path(preset, "f32"))
    assert len(p.stdout.split()) == 4 and all(float(x) < 1e-3 for x in p.stdout.split()), p.stdout


def test_f32_fused_matches_the_cpu_within_the_limits(tiny_model_path):
    rep = compare(tiny_model_path("tiny", "f32"), "--tokens", "16", "-n", "8")
    assert rep["passed"], rep["failures"]
    assert rep["sides"][1]["device"].startswith("Vulkan0")
    for g in rep["graphs"]:
        assert g["n_failed"] == 0 and g["matched_by"] == "index" and not g["only_a"] and not g["only_b"]
        ran_on = {n["backend_b"] for n in g["nodes"] if n["backend_b"]}
        assert "Vulkan0" in ran_on
    assert rep["logits"]["top1_agreement"] == 1.0
    assert rep["greedy"]["match"]


def test_f32_primitive_delta_net_matches_the_cpu(tiny_model_path):
    # 70 tokens: the chunked delta rule (cumsum, tri, solve_tri, ...) crosses a chunk boundary.
    rep = compare(tiny_model_path("tiny", "f32"), "--tokens", "70", "-n", "4", "--delta-net", "primitive")
    assert rep["passed"], rep["failures"]
    assert [g["graph"] for g in rep["graphs"]] == ["prefill", "decode"]
    assert all(g["n_failed"] == 0 for g in rep["graphs"]) and rep["logits"]["top1_agreement"] == 1.0
    assert rep["greedy"]["match"]


def test_gpu_layers_split_the_graph_between_vulkan_and_cpu(tiny_model_path):
    rep = compare(tiny_model_path("tiny", "f32"), "--tokens", "16", "-n", "4", "--gpu-layers", "2")
    assert rep["passed"], rep["failures"]
    side = rep["sides"][1]
    assert side["n_splits"]["prefill"] > 1 and "2/4 layers" in side["placement"]
    where = {n["name"]: n["backend_b"] for n in rep["graphs"][0]["nodes"]}
    assert where["attn_norm-0"] == "CPU" and where["l_out-3"] == "Vulkan0"


def test_graph_and_bench_take_gpu_layers(tiny_model_path):
    path = tiny_model_path("tiny", "f32")
    d = json.loads(deltarun("graph", path, "--backend", "vulkan", "-ngl", "2", "--format", "json", "-t", "1").stdout)
    assert d["summary"]["n_splits"] > 1
    where = {n["name"]: n["backend"] for n in d["nodes"]}
    assert where["attn_norm-0"] == "CPU" and where["l_out-3"] == "Vulkan0"
    p = deltarun("bench", path, "--backend", "vulkan", "-ngl", "0,4", "-p", "8", "-n", "2", "-r", "1", "-t", "1",
                 "-o", "json")
    rows = json.loads(p.stdout)["results"]
    assert [(r["gpu_layers"], r["test"]) for r in rows] == [(0, "pp8"), (0, "tg2"), (4, "pp8"), (4, "tg2")]


@pytest.mark.parametrize("preset", ["tiny-eqheads", "tiny-legacy", "tiny-tied"])
def test_other_presets_match_the_cpu(tiny_model_path, preset):
    rep = compare(tiny_model_path(preset, "f32"), "--tokens", "12", "-n", "4")
    assert rep["passed"], rep["failures"]
    assert rep["greedy"]["match"]


@pytest.mark.parametrize("delta_net", ["fused", "primitive"])
@pytest.mark.parametrize("preset", ["tiny-qwen35", "tiny-qwen35moe"])
def test_qwen35_families_match_the_cpu(tiny_model_path, preset, delta_net):
    """IMRoPE, split beta/alpha and the tiled value-head broadcast (the fused kernel maps value head
    h to key head h % H_k on every backend; the primitive path repeats q/k tiled)."""
    n = "70" if delta_net == "primitive" else "12"
    rep = compare(tiny_model_path(preset, "f32"), "-n", n, "-s", "4", "--delta-net", delta_net)
    assert rep["passed"], rep["failures"]
    assert rep["greedy"]["match"]


@pytest.mark.parametrize("preset", ["tiny-kimi-linear", "tiny-qwen4exp"])
def test_newer_families_match_the_cpu(tiny_model_path, preset):
    """Kimi-Linear (KDA, MLA) and qwen4exp (hyper-connections, n-gram embeddings, the indexer):
    40 prompt tokens take the indexer past its budget of 2 blocks of 4, so its TOP_K chooses (the
    order of its indices differs on Vulkan: `compare_top_k` compares sets)."""
    rep = compare(tiny_model_path(preset, "f32"), "--tokens", "40", "-n", "6")
    assert rep["passed"], rep["failures"]
    assert rep["greedy"]["match"]


def test_q8_0_agrees_at_the_logits_level(tiny_model_path):
    rep = compare(tiny_model_path("tiny", "q8_0"), "--tokens", "16", "-n", "8", code=None)
    lg = rep["logits"]
    assert not lg["nan"]
    assert lg["nmse"] < 1e-2 and lg["kl_mean"] < 1e-2
    assert lg["top1_agreement"] >= 0.8


# --- the vision tower (mmproj) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    """The tiny vision-language pair of tests/test_vision_cli.py and a real image file."""
    import numpy as np
    from PIL import Image

    from deltarun.model_files import qwen35_vision as qv

    folder = tmp_path_factory.mktemp("vlm-vulkan")
    text, mmproj = qv.write_vlm(folder, "tiny-qwen35")
    arr = np.random.default_rng(7).integers(0, 256, (50, 90, 3), dtype=np.uint8)
    picture = folder / "picture.png"
    Image.fromarray(arr).save(picture)
    return text, mmproj, picture


def test_vision_tower_matches_the_cpu(vlm):
    """`compare --mmproj --backends cpu,vulkan` on an image file: every node of the tower (patch
    products, position-grid gather, vision rope, F32 flash attention, tanh GELU, merger) runs on
    Vulkan and stays within the CPU-against-CPU limits (F32 products: GGML_VK_DISABLE_F16=1)."""
    text, mmproj, picture = vlm
    p = deltarun("compare", text, "--mmproj", mmproj, "--image", picture, "--backends", "cpu,vulkan", "--json", "-q",
                 "-t", "1")
    rep = json.loads(p.stdout)
    assert rep["passed"], rep["failures"]
    g, = rep["graphs"]
    assert g["matched_by"] == "index" and g["n_failed"] == 0 and g["n_compared"] == g["n_nodes_a"]
    ran_on = {n["op"]: n["backend_b"] for n in g["nodes"] if n["backend_b"]}
    assert ran_on["FLASH_ATTN_EXT"] == ran_on["ROPE"] == ran_on["MUL_MAT"] == "Vulkan0"
    print(f"\ntower cpu,vulkan: embeddings NMSE {rep['embeddings']['nmse']:.3g}, max rel "
          f"{rep['embeddings']['max_rel_err']:.3g}; splits {rep['sides'][1]['n_splits']}")


def test_vision_tower_on_vulkan_matches_the_reference(vlm):
    """The Vulkan tower's embeddings against the float64 reference from Hugging Face-order weights:
    within 1e-5 of the largest value, the F32 bound the CPU tower is held to (tests/test_vision.py;
    lavapipe with F32 accumulation measured 7e-7 from the CPU)."""
    text, mmproj, picture = vlm
    script = (
        "import sys, numpy as np\n"
        "sys.path.insert(0, 'tests')\n"
        "import reference_vision as rv\n"
        "from deltarun.model_files import qwen35, qwen35_vision as qv\n"
        "from deltarun.runner import images\n"
        "from deltarun.runner.vision import VisionEncoder\n"
        "cfg = qv.vision_for(qwen35.PRESETS['tiny-qwen35'])\n"
        "with VisionEncoder(sys.argv[1], backend='vulkan', n_threads=1) as enc:\n"
        "    assert enc.backend.description.startswith('Vulkan0'), enc.backend.description\n"
        "    prep = images.load_image(sys.argv[2], enc.hp)\n"
        "    out = enc.encode(prep)\n"
        "ref, _ = rv.vision_forward(qv.hf_weights(cfg, 0), cfg, prep.pixels)\n"
        "print(prep.n_tokens, float(np.abs(out - ref).max() / np.abs(ref).max()))\n")
    p = subprocess.run([sys.executable, "-c", script, str(mmproj), str(picture)], env=_env(), capture_output=True,
                       text=True, timeout=TIMEOUT)
    assert p.returncode == 0, p.stderr[-4000:]
    n_tokens, err = p.stdout.split()
    assert int(n_tokens) > 1 and float(err) < 1e-5, p.stdout


def test_image_through_generate_matches_the_cpu(vlm):
    """An image through the whole path on Vulkan (tower, placement, IMRoPE streams, decoding):
    the greedy continuation is the CPU's."""
    text, mmproj, picture = vlm
    args = ["generate", text, "--mmproj", mmproj, "--image", picture, "-p", "<__media__> Say:", "-n", "8",
            "--temp", "0", "--kv-type", "f32", "-t", "1"]
    cpu = deltarun(*args, "--backend", "cpu").stdout
    vk = deltarun(*args, "--backend", "vulkan").stdout
    assert cpu.strip() and vk == cpu
