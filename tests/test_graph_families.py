"""The graph families: registration, the qwen35 / qwen35moe file checks, and what their graphs are made of.

Numbers (logits against the float64 reference) are tested elsewhere; here: a malformed Qwen3.5
file is refused with one line naming the problem, and the qwen35 graphs are built the way
llama.cpp builds them: IMRoPE through ggml_rope_multi with 4 positions per token, beta/alpha
from separate projections, and the value-head broadcast tiled (no repeat at all in front of the
fused op, whose kernels map value head h to key head h % H_k; a tiled REPEAT in the primitive
path), where qwen3next repeats q/k interleaved.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from deltarun.base.errors import ModelFileError
from deltarun.base.ggml_util import ggml, name_of
from deltarun.base.registry import available_architectures
from deltarun.runner.model import Model

from test_loader_errors import GV, rewrite


def _graph_tiny(preset: str, tmp: Path, **kv) -> Path:
    """A tiny qwen35 / qwen35moe file, F32. The graph does not depend on the pre-tokenizer: the
    file says qwen2 so that these tests run on the tokenizer every branch has."""
    from deltarun.model_files import qwen35

    src = qwen35.write_model(tmp / f"{preset}-src.gguf", preset, "f32")
    dst = tmp / f"{preset}.gguf"
    rewrite(src, dst, set_kv={"tokenizer.ggml.pre": ("qwen2", GV.STRING), **kv})
    return dst


@pytest.fixture(scope="module")
def q35(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _graph_tiny("tiny-qwen35", tmp_path_factory.mktemp("q35"))


@pytest.fixture(scope="module")
def q35moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _graph_tiny("tiny-qwen35moe", tmp_path_factory.mktemp("q35moe"))


def test_the_three_families_are_registered():
    assert {"qwen3next", "qwen35", "qwen35moe"} <= set(available_architectures())


def _nodes(m: Model, n_tokens: int, mtp: bool = False) -> list:
    m.reset()
    if mtp:
        m.eval(list(range(3, 3 + n_tokens)))
        m.mtp_eval(list(range(4, 4 + n_tokens)), m.last_hidden[0].repeat(n_tokens, 0)[:n_tokens], 0)
    else:
        m.eval(list(range(3, 3 + n_tokens)))
    shape = next(s for s in m._graphs if s.n_seq_tokens == n_tokens and s.mtp == mtp)
    g = m._graphs[shape]
    return [ggml.ggml_graph_node(g.gf, i) for i in range(ggml.ggml_graph_n_nodes(g.gf))]


def _ops(nodes: list, op: int) -> list:
    return [t for t in nodes if t.contents.op == op]


@pytest.mark.parametrize("family", ["q35", "q35moe"])
def test_qwen35_graph_parts(family, request):
    path = request.getfixturevalue(family)
    with Model(path, n_ctx=64, kv_type="f32", rs_slots=2, mtp=True) as m:
        hp = m.hp
        assert hp.rope_sections and len(hp.rope_sections) == 4 and hp.n_mtp == 1
        assert (hp.n_expert > 0) == (family == "q35moe") and (hp.n_ff > 0) == (family == "q35")
        assert hp.ssm_n_v_heads == 2 * hp.ssm_n_k_heads
        for mtp in (False, True):
            nodes = _nodes(m, 5, mtp)
            ropes = _ops(nodes, ggml.GGML_OP_ROPE)
            assert ropes and all(list(t.contents.op_params)[2] == ggml.GGML_ROPE_TYPE_IMROPE for t in ropes)
            # sections travel in the op parameters (ints 11..14)
            assert all(list(t.contents.op_params)[11:15] == list(hp.rope_sections) for t in ropes)
            pos = ropes[0].contents.src[1]
            assert name_of(pos) == "inp_pos" and pos.contents.ne[0] == 4 * 5
        names = {name_of(t) for t in _nodes(m, 5)}
        assert "beta_sigmoid-0" in names and "linear_attn_mixed_ba-0" not in names
        assert ("ffn_moe_out-0" in names) == (family == "q35moe") and ("ffn_swiglu-0" in names) == (family == "q35")
        # fused delta net: no repeat of q/k anywhere
        assert not _ops(_nodes(m, 5), ggml.GGML_OP_REPEAT)
    with Model(path, n_ctx=128, kv_type="f32", rs_slots=2, delta_net="primitive") as m:
        for n in (1, 70):
            reps = _ops(_nodes(m, n), ggml.GGML_OP_REPEAT)
            qk = [t for t in reps if t.contents.ne[1] == m.hp.ssm_n_v_heads and t.contents.ne[0] == m.hp.ssm_d_state]
            # tiled: the repeat reads the [S, H_k, T, N] q/k directly (no interleaving reshape)
            assert len(qk) == 2 * len(m.hp.linear_layers)
            assert all(t.contents.src[0].contents.ne[1] == m.hp.ssm_n_k_heads for t in qk)


def test_qwen3next_repeats_interleaved(tiny_model_path):
    with Model(tiny_model_path("tiny"), n_ctx=64, kv_type="f32") as m:
        reps = _ops(_nodes(m, 3), ggml.GGML_OP_REPEAT)
        # [S, 1, H_k, T*N] -> [S, r, H_k, T*N]: value head j*r+i reads key head j
        assert len(reps) == 2 * len(m.hp.linear_layers)
        assert all(t.contents.src[0].contents.ne[1] == 1 for t in reps)


def _refused(path: Path) -> str:
    with pytest.raises(ModelFileError) as e:
        Model(path, n_ctx=64)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_qwen35_without_ssm_beta(q35, tmp_path):
    bad = tmp_path / "no-beta.gguf"
    rewrite(q35, bad, tensors={"blk.0.ssm_beta.weight": None})
    assert "'blk.0.ssm_beta.weight' is missing" in _refused(bad)


def test_qwen35_with_a_fused_ssm_ba_only(q35, tmp_path):
    """A qwen3next-style linear layer in a qwen35 file is refused, not half-read."""
    bad = tmp_path / "ba.gguf"
    r = gguf.GGUFReader(str(q35))
    beta = np.array(next(t.data for t in r.tensors if t.name == "blk.1.ssm_beta.weight"))
    rewrite(q35, bad, tensors={"blk.1.ssm_beta.weight": None, "blk.1.ssm_alpha.weight": None},
            extra_tensors={"blk.1.ssm_ba.weight": np.concatenate([beta, beta], axis=0)})
    assert "ssm_beta.weight' is missing" in _refused(bad)


@pytest.mark.parametrize("sections,fragment", [
    ([3, 3, 2], "must hold 4 non-negative integers"),
    ([3, 3, 2, 0, 0], "must hold 4 non-negative integers"),
    ([4, 3, 2, 0], "must add up to rope.dimension_count / 2 = 8"),
])
def test_qwen35_rope_sections_of_wrong_length_or_sum(q35moe, tmp_path, sections, fragment):
    bad = tmp_path / "sections.gguf"
    rewrite(q35moe, bad, set_kv={"qwen35moe.rope.dimension_sections": (sections, GV.ARRAY, GV.INT32)})
    msg = _refused(bad)
    assert "rope.dimension_sections" in msg and fragment in msg


def test_qwen35_without_rope_sections(q35, tmp_path):
    bad = tmp_path / "nosections.gguf"
    rewrite(q35, bad, drop_keys=("qwen35.rope.dimension_sections",))
    assert "'qwen35.rope.dimension_sections' is missing" in _refused(bad)


@pytest.mark.parametrize("family", ["q35", "q35moe"])
def test_mtp_block_with_missing_tensors(family, request, tmp_path):
    path = request.getfixturevalue(family)
    with Model(path, n_ctx=64) as m:
        il = m.hp.n_layer
    for name in (f"blk.{il}.nextn.eh_proj.weight", f"blk.{il}.attn_q.weight"):
        bad = tmp_path / "mtp.gguf"
        rewrite(path, bad, tensors={name: None})
        msg = _refused(bad)
        assert "the MTP block" in msg and name in msg


# --- inspect ------------------------------------------------------------------------------------
# (rollback = recomputation and speculative decoding on qwen35 files: tests/test_qwen35_forward.py,
# tests/test_qwen35_cli.py)
def test_inspect_shows_the_mtp_block(tiny_model_path):
    from click.testing import CliRunner

    from deltarun.cli.main import cli

    out = CliRunner().invoke(cli, ["inspect", str(tiny_model_path("tiny-qwen35moe")), "--json"])
    assert out.exit_code == 0, out.output
    rep = json.loads(out.stdout)
    assert rep["runnable"] and rep["layers"]["pattern"] == "LLLAM" and rep["layers"]["mtp"] == [4]


def test_imrope_positions_are_laid_out_as_llama_cpp_does(q35):
    """4 blocks of n_tokens: the text position in blocks 0-2, 0 in block 3 (llm_graph_input_pos)."""
    from deltarun.graphs.inputs import PositionsInput

    with Model(q35, n_ctx=64, kv_type="f32") as m:
        m.eval(list(range(3, 9)))
        m.eval(list(range(20, 25)))          # positions 6..10
        g = next(g for s, g in m._graphs.items() if s.n_seq_tokens == 5)
        pos = next(i for i in g.built.inputs if isinstance(i, PositionsInput)).host["inp_pos"].reshape(4, 5)
    assert pos[:3].tolist() == [list(range(6, 11))] * 3 and pos[3].tolist() == [0] * 5
