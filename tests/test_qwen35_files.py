"""Qwen3.5 synthetic files (models/qwen35.py) hold what llama.cpp's converter writes, and the
float64 reference (tests/reference_qwen35.py) computes what the HF model computes.

Expected keys, names, shapes and permutations are written out here from the sources
(`conversion/qwen.py`, `src/models/qwen35*.cpp` of llama.cpp as vendored in llama-cpp-python 0.3.36;
transformers' qwen3_5 modelling), not taken from the generator: the value-head permutation is
computed from its definition (tiled position m holds grouped head (m % n_k) * r + m // n_k), and
trunk tensor names are cross-checked against the `gguf` package's own name map.
"""

from __future__ import annotations

import ctypes

import gguf
import numpy as np
import pytest

from deltarun.model_files import qwen35 as q35
from deltarun.model_files.vocab import tiny_vocab
from reference import RefHParams, delta_net_scan, rope_neox
from reference_qwen35 import Qwen35Reference, rope_imrope

N_VOCAB = tiny_vocab().n_vocab
TINY = ["tiny-qwen35", "tiny-qwen35moe"]


def read(path):
    reader = gguf.GGUFReader(str(path))
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    tensors = {t.name: t for t in reader.tensors}
    return fields, tensors


def np_f32(t) -> np.ndarray:
    """A tensor's data in numpy order (reverse of ne), dequantised."""
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(shape)


def tiled_head_order(n_k: int, n_v: int) -> np.ndarray:
    """For each value head of the GGUF (tiled) order, the HF (grouped) value head it holds."""
    r = n_v // n_k
    return np.array([(m % n_k) * r + m // n_k for m in range(n_v)])


def rows_of_heads(order: np.ndarray, head_dim: int) -> np.ndarray:
    return (order[:, None] * head_dim + np.arange(head_dim)[None, :]).reshape(-1)


# --------------------------------------------------------------------------------------------
# metadata and tensors
# --------------------------------------------------------------------------------------------


def expected_tensors(cfg) -> dict[str, tuple[int, ...]]:
    """Name -> ne of every tensor, per llama.cpp's llama_model_qwen35(moe)::load_arch_tensors."""
    E, V, hd = cfg.hidden_size, N_VOCAB, cfg.head_dim
    nk, nv, S = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim
    key_dim, value_dim = nk * S, nv * S
    t = {"token_embd.weight": (E, V), "output_norm.weight": (E,)}
    if not cfg.tie_word_embeddings:
        t["output.weight"] = (E, V)
    n_trunk = cfg.num_hidden_layers
    for il in range(n_trunk + cfg.mtp_num_hidden_layers):
        p = f"blk.{il}."
        t[p + "attn_norm.weight"] = (E,)
        t[p + "post_attention_norm.weight"] = (E,)
        if il < n_trunk and (il + 1) % cfg.full_attention_interval:
            t.update({p + "attn_qkv.weight": (E, 2 * key_dim + value_dim), p + "attn_gate.weight": (E, value_dim),
                      p + "ssm_conv1d.weight": (cfg.linear_conv_kernel_dim, 2 * key_dim + value_dim),
                      p + "ssm_dt.bias": (nv,), p + "ssm_a": (nv,), p + "ssm_beta.weight": (E, nv),
                      p + "ssm_alpha.weight": (E, nv), p + "ssm_norm.weight": (S,), p + "ssm_out.weight": (value_dim, E)})
        else:
            t.update({p + "attn_q.weight": (E, 2 * hd * cfg.num_attention_heads),
                      p + "attn_k.weight": (E, hd * cfg.num_key_value_heads),
                      p + "attn_v.weight": (E, hd * cfg.num_key_value_heads),
                      p + "attn_output.weight": (hd * cfg.num_attention_heads, E),
                      p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)})
        if cfg.moe:
            ne, ff, fs = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
            t.update({p + "ffn_gate_inp.weight": (E, ne), p + "ffn_gate_exps.weight": (E, ff, ne),
                      p + "ffn_up_exps.weight": (E, ff, ne), p + "ffn_down_exps.weight": (ff, E, ne),
                      p + "ffn_gate_inp_shexp.weight": (E, 1), p + "ffn_gate_shexp.weight": (E, fs),
                      p + "ffn_up_shexp.weight": (E, fs), p + "ffn_down_shexp.weight": (fs, E)})
        else:
            ff = cfg.intermediate_size
            t.update({p + "ffn_gate.weight": (E, ff), p + "ffn_up.weight": (E, ff), p + "ffn_down.weight": (ff, E)})
        if il >= n_trunk:
            t.update({p + "nextn.eh_proj.weight": (2 * E, E), p + "nextn.enorm.weight": (E,),
                      p + "nextn.hnorm.weight": (E,), p + "nextn.shared_head_norm.weight": (E,)})
    return t


@pytest.mark.parametrize("preset", TINY)
def test_tensor_names_shapes_and_f32_types(tiny_model_path, preset):
    cfg = q35.PRESETS[preset]
    _, tensors = read(tiny_model_path(preset, "f32"))
    want = expected_tensors(cfg)
    assert sorted(tensors) == sorted(want)
    for name, ne in want.items():
        assert tuple(int(d) for d in tensors[name].shape.tolist()) == ne, name


@pytest.mark.parametrize("preset", TINY)
def test_q8_0_types_follow_the_converter(tiny_model_path, preset):
    """1-D tensors, norms, routers, the shared-expert gate and the conv kernel stay F32
    (conversion/base.py prepare_tensors); every other 2-D/3-D weight is Q8_0."""
    _, tensors = read(tiny_model_path(preset, "q8_0"))
    for name, t in tensors.items():
        keep = (len(t.shape) == 1 or name.endswith("_norm.weight") or "ffn_gate_inp" in name
                or "ssm_conv1d" in name)
        want = gguf.GGMLQuantizationType.F32 if keep else gguf.GGMLQuantizationType.Q8_0
        assert t.tensor_type == want, name


@pytest.mark.parametrize("preset", TINY)
def test_metadata_keys_as_the_converter_writes(tiny_model_path, preset):
    cfg = q35.PRESETS[preset]
    a = cfg.arch
    fields, _ = read(tiny_model_path(preset, "f32"))
    want = {
        f"{a}.block_count": 5, f"{a}.context_length": 4096, f"{a}.embedding_length": 256,
        f"{a}.attention.head_count": 4, f"{a}.attention.head_count_kv": 2,
        f"{a}.rope.dimension_sections": [3, 3, 2, 0], f"{a}.rope.freq_base": 1e7,
        f"{a}.attention.key_length": 64, f"{a}.attention.value_length": 64, "general.file_type": 0,
        f"{a}.nextn_predict_layers": 1, f"{a}.ssm.conv_kernel": 4, f"{a}.ssm.state_size": 32,
        f"{a}.ssm.group_count": 4, f"{a}.ssm.time_step_rank": 8, f"{a}.ssm.inner_size": 256,
        f"{a}.attention.recurrent_layers": [True, True, True, False, False],
        f"{a}.full_attention_interval": 4, f"{a}.rope.dimension_count": 16,
        "general.architecture": a, "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen35",
    }
    if cfg.moe:
        want.update({f"{a}.expert_count": 8, f"{a}.expert_used_count": 2,
                     f"{a}.expert_feed_forward_length": 256, f"{a}.expert_shared_feed_forward_length": 256})
    else:
        want[f"{a}.feed_forward_length"] = 512
    for key, value in want.items():
        got = fields[key]
        assert (pytest.approx(value) == got) if isinstance(value, float) else got == value, key
    assert abs(fields[f"{a}.attention.layer_norm_rms_epsilon"] - 1e-6) < 1e-12
    assert "<tool_call>" in fields["tokenizer.chat_template"] and "enable_thinking" in fields["tokenizer.chat_template"]
    # no qwen3next-only tensors/keys
    assert not any(k.endswith(("ssm_ba.weight", "ssm_in.weight")) for k in read(tiny_model_path(preset, "f32"))[1])
    assert (f"{a}.feed_forward_length" in fields) == (not cfg.moe)


def test_trunk_names_agree_with_the_gguf_package_name_map():
    """The gguf package's TensorNameMap (what convert_hf_to_gguf.py uses) maps each HF trunk name
    to the GGUF name the generator wrote (MTP names are not in gguf 0.19's map for qwen35)."""
    for preset in TINY:
        cfg = q35.PRESETS[preset]
        arch = gguf.MODEL_ARCH.QWEN35MOE if cfg.moe else gguf.MODEL_ARCH.QWEN35
        tmap = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers + 1)
        out = q35.convert(cfg, q35.hf_weights(cfg, 64, 0))
        for hf_name in q35.hf_weights(cfg, 64, 0):
            if hf_name.startswith("mtp."):
                continue
            base = hf_name.removesuffix(".weight").removesuffix(".bias")
            if base.endswith("gate_up_proj"):
                names = [tmap.get_name(base.replace("gate_up_proj", "gate_proj")),
                         tmap.get_name(base.replace("gate_up_proj", "up_proj"))]
            else:
                mapped = tmap.get_name(base.replace(".dt_bias", ".dt_proj"))
                names = [mapped]
            for n in names:
                assert n is not None, hf_name
                suffix = ".bias" if hf_name.endswith("dt_bias") else ("" if hf_name.endswith("A_log") else ".weight")
                assert n + suffix in out, (hf_name, n)


# --------------------------------------------------------------------------------------------
# the converter's transforms, checked against the HF tensors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", TINY)
def test_value_heads_stored_tiled(tiny_model_path, preset):
    cfg = q35.PRESETS[preset]
    hf = q35.hf_weights(cfg, N_VOCAB, 0)
    _, tensors = read(tiny_model_path(preset, "f32"))
    nk, nv, S = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    order = tiled_head_order(nk, nv)
    assert sorted(order) == list(range(nv)) and list(order) != list(range(nv))  # a real permutation
    v_rows = rows_of_heads(order, S)
    qk = 2 * nk * S
    p, g = "model.layers.1.linear_attn.", "blk.1."
    qkv = hf[p + "in_proj_qkv.weight"]
    np.testing.assert_array_equal(np_f32(tensors[g + "attn_qkv.weight"]),
                                  np.concatenate([qkv[:qk], qkv[qk:][v_rows]]))
    conv = hf[p + "conv1d.weight"][:, 0, :]
    np.testing.assert_array_equal(np_f32(tensors[g + "ssm_conv1d.weight"]),
                                  np.concatenate([conv[:qk], conv[qk:][v_rows]]))
    np.testing.assert_array_equal(np_f32(tensors[g + "attn_gate.weight"]), hf[p + "in_proj_z.weight"][v_rows])
    np.testing.assert_array_equal(np_f32(tensors[g + "ssm_beta.weight"]), hf[p + "in_proj_b.weight"][order])
    np.testing.assert_array_equal(np_f32(tensors[g + "ssm_alpha.weight"]), hf[p + "in_proj_a.weight"][order])
    np.testing.assert_array_equal(np_f32(tensors[g + "ssm_dt.bias"]), hf[p + "dt_bias"][order])
    np.testing.assert_allclose(np_f32(tensors[g + "ssm_a"]), -np.exp(hf[p + "A_log"].astype(np.float64))[order],
                               rtol=1e-6)
    np.testing.assert_array_equal(np_f32(tensors[g + "ssm_out.weight"]), hf[p + "out_proj.weight"][:, v_rows])
    # the gated norm is per value-head dim: neither reordered nor shifted
    np.testing.assert_array_equal(np_f32(tensors[g + "ssm_norm.weight"]), hf[p + "norm.weight"])


def test_equal_heads_are_not_reordered():
    cfg = q35.config_with("tiny-qwen35", linear_num_value_heads=4, linear_num_key_heads=4)
    hf = q35.hf_weights(cfg, 64, 0)
    out = q35.convert(cfg, hf)
    np.testing.assert_array_equal(out["blk.0.attn_gate.weight"], hf["model.layers.0.linear_attn.in_proj_z.weight"])


@pytest.mark.parametrize("preset", TINY)
def test_zero_centred_norms_stored_plus_one_and_mtp_renamed(tiny_model_path, preset):
    cfg = q35.PRESETS[preset]
    hf = q35.hf_weights(cfg, N_VOCAB, 0)
    _, tensors = read(tiny_model_path(preset, "f32"))
    n = cfg.num_hidden_layers
    pairs = {
        "model.norm.weight": "output_norm.weight",
        "model.layers.0.input_layernorm.weight": "blk.0.attn_norm.weight",
        "model.layers.3.post_attention_layernorm.weight": "blk.3.post_attention_norm.weight",
        "model.layers.3.self_attn.q_norm.weight": "blk.3.attn_q_norm.weight",
        "model.layers.3.self_attn.k_norm.weight": "blk.3.attn_k_norm.weight",
        "mtp.pre_fc_norm_embedding.weight": f"blk.{n}.nextn.enorm.weight",
        "mtp.pre_fc_norm_hidden.weight": f"blk.{n}.nextn.hnorm.weight",
        "mtp.norm.weight": f"blk.{n}.nextn.shared_head_norm.weight",
        "mtp.layers.0.input_layernorm.weight": f"blk.{n}.attn_norm.weight",
        "mtp.layers.0.self_attn.q_norm.weight": f"blk.{n}.attn_q_norm.weight",
    }
    for hf_name, g_name in pairs.items():
        np.testing.assert_allclose(np_f32(tensors[g_name]), hf[hf_name] + 1.0, rtol=0, atol=1e-7, err_msg=g_name)
    np.testing.assert_array_equal(np_f32(tensors[f"blk.{n}.nextn.eh_proj.weight"]), hf["mtp.fc.weight"])
    np.testing.assert_array_equal(np_f32(tensors[f"blk.{n}.attn_q.weight"]), hf["mtp.layers.0.self_attn.q_proj.weight"])
    if cfg.moe:
        gu = hf["model.layers.0.mlp.experts.gate_up_proj"]
        ff = cfg.moe_intermediate_size
        np.testing.assert_array_equal(np_f32(tensors["blk.0.ffn_gate_exps.weight"]), gu[:, :ff])
        np.testing.assert_array_equal(np_f32(tensors["blk.0.ffn_up_exps.weight"]), gu[:, ff:])
        np.testing.assert_array_equal(np_f32(tensors["blk.0.ffn_down_exps.weight"]),
                                      hf["model.layers.0.mlp.experts.down_proj"])


@pytest.mark.parametrize("preset", TINY)
def test_hf_weights_have_the_transformers_shapes(preset):
    """Names and torch shapes as the modules of modeling_qwen3_5(_moe).py define them (nn.Linear
    weights are (out, in); conv1d is depthwise (conv_dim, 1, kernel); experts are 3-D parameters),
    plus the MTP tensors under mtp.* that the published checkpoints carry."""
    cfg = q35.PRESETS[preset]
    E, V, hd, nh, nkv = cfg.hidden_size, 100, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    kd, vd, nv = cfg.key_dim, cfg.value_dim, cfg.linear_num_value_heads
    want = {"model.embed_tokens.weight": (V, E), "model.norm.weight": (E,), "lm_head.weight": (V, E)}
    blocks = [(f"model.layers.{i}.", rec) for i, rec in enumerate(cfg.recurrent)] + [("mtp.layers.0.", False)]
    for p, rec in blocks:
        want.update({p + "input_layernorm.weight": (E,), p + "post_attention_layernorm.weight": (E,)})
        if rec:
            a = p + "linear_attn."
            want.update({a + "in_proj_qkv.weight": (2 * kd + vd, E), a + "in_proj_z.weight": (vd, E),
                         a + "in_proj_b.weight": (nv, E), a + "in_proj_a.weight": (nv, E),
                         a + "conv1d.weight": (2 * kd + vd, 1, cfg.linear_conv_kernel_dim), a + "dt_bias": (nv,),
                         a + "A_log": (nv,), a + "norm.weight": (cfg.linear_value_head_dim,),
                         a + "out_proj.weight": (E, vd)})
        else:
            a = p + "self_attn."
            want.update({a + "q_proj.weight": (2 * nh * hd, E), a + "k_proj.weight": (nkv * hd, E),
                         a + "v_proj.weight": (nkv * hd, E), a + "o_proj.weight": (E, nh * hd),
                         a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)})
        if cfg.moe:
            ne, ff, fs = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
            want.update({p + "mlp.gate.weight": (ne, E), p + "mlp.experts.gate_up_proj": (ne, 2 * ff, E),
                         p + "mlp.experts.down_proj": (ne, E, ff), p + "mlp.shared_expert.gate_proj.weight": (fs, E),
                         p + "mlp.shared_expert.up_proj.weight": (fs, E),
                         p + "mlp.shared_expert.down_proj.weight": (E, fs), p + "mlp.shared_expert_gate.weight": (1, E)})
        else:
            ff = cfg.intermediate_size
            want.update({p + "mlp.gate_proj.weight": (ff, E), p + "mlp.up_proj.weight": (ff, E),
                         p + "mlp.down_proj.weight": (E, ff)})
    want.update({"mtp.fc.weight": (E, 2 * E), "mtp.pre_fc_norm_embedding.weight": (E,),
                 "mtp.pre_fc_norm_hidden.weight": (E,), "mtp.norm.weight": (E,)})
    got = {k: v.shape for k, v in q35.hf_weights(cfg, V, 0).items()}
    assert got == want


def test_config_checks_its_layer_pattern():
    with pytest.raises(ValueError, match="layer_types"):
        q35.Qwen35Config(num_hidden_layers=8, layer_types=("linear_attention",) * 4)
    assert q35.config_with("tiny-qwen35", num_hidden_layers=8).recurrent == [True, True, True, False] * 2


def test_generation_is_deterministic():
    cfg = q35.PRESETS["tiny-qwen35moe"]
    a, b, c = (q35.model_tensors(cfg, 64, s) for s in (3, 3, 4))
    assert list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["blk.0.attn_qkv.weight"], c["blk.0.attn_qkv.weight"])


def test_bench_preset_has_the_published_small_shapes():
    cfg = q35.PRESETS["bench-qwen35"]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.intermediate_size) == (1024, 24, 8, 2, 256, 3584)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (16, 16, 128)
    assert cfg.n_rot == 64 and cfg.rope_sections == [11, 11, 10, 0] and sum(cfg.mrope_section) == cfg.n_rot // 2
    assert cfg.tie_word_embeddings and cfg.mtp_num_hidden_layers == 1


def test_make_tiny_cli_writes_qwen35(tmp_path):
    from click.testing import CliRunner

    from deltarun.cli.main import cli

    out = tmp_path / "m.gguf"
    res = CliRunner().invoke(cli, ["make-tiny", str(out), "--preset", "tiny-qwen35moe", "--type", "q4_0"])
    assert res.exit_code == 0, res.output
    fields, tensors = read(out)
    assert fields["general.architecture"] == "qwen35moe"
    assert tensors["blk.0.attn_qkv.weight"].tensor_type == gguf.GGMLQuantizationType.Q4_0


# --------------------------------------------------------------------------------------------
# IMRoPE: HF's section rule against ggml_rope_multi
# --------------------------------------------------------------------------------------------


def ggml_rope_multi(x: np.ndarray, pos4: np.ndarray, n_rot: int, sections, base: float, mode: int) -> np.ndarray:
    """Run ggml_rope_multi on the CPU: x numpy (T, heads, head_dim) f32, pos4 (4, T) int32."""
    from deltarun.base.ggml_compat import ggml

    T, H, D = x.shape
    params = ggml.ggml_init_params(mem_size=64 * 1024 * 1024, mem_buffer=None, no_alloc=False)
    ctx = ggml.ggml_init(params)
    try:
        a = ggml.ggml_new_tensor_3d(ctx, ggml.GGML_TYPE_F32, D, H, T)
        p = ggml.ggml_new_tensor_1d(ctx, ggml.GGML_TYPE_I32, 4 * T)
        ctypes.memmove(ggml.ggml_get_data(a), np.ascontiguousarray(x, dtype=np.float32).ctypes.data, x.size * 4)
        ctypes.memmove(ggml.ggml_get_data(p), np.ascontiguousarray(pos4, dtype=np.int32).ctypes.data, pos4.size * 4)
        secs = (ctypes.c_int * 4)(*sections)
        out = ggml.ggml_rope_multi(ctx, a, p, None, n_rot, secs, mode, 0, base, 1.0, 0.0, 1.0, 0.0, 0.0)
        gf = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(gf, out)
        ggml.ggml_graph_compute_with_ctx(ctx, gf, 1)
        buf = (ctypes.c_float * x.size).from_address(ggml.ggml_get_data(out))
        return np.frombuffer(buf, dtype=np.float32).reshape(T, H, D).astype(np.float64)
    finally:
        ggml.ggml_free(ctx)


def test_imrope_sections_match_ggml_with_distinct_position_streams():
    """With different temporal/height/width positions the section rule matters: the reference's
    HF rule and ggml's GGML_ROPE_TYPE_IMROPE agree (sections summing to n_rot / 2, as the published
    [11, 11, 10] for 64 rotary dims and the tiny [3, 3, 2] for 16)."""
    from deltarun.base.ggml_compat import ggml

    rng = np.random.default_rng(0)
    for head_dim, n_rot, sections in ((64, 16, (3, 3, 2, 0)), (256, 64, (11, 11, 10, 0))):
        T, H = 5, 3
        x = rng.standard_normal((T, H, head_dim)).astype(np.float32)
        pos = np.stack([np.arange(T) + 7, np.arange(T) * 3 + 1, np.arange(T)[::-1] * 2, np.zeros(T, int)])
        got = ggml_rope_multi(x, pos, n_rot, sections, 1e7, ggml.GGML_ROPE_TYPE_IMROPE)
        want = np.stack([rope_imrope(x[t].astype(np.float64), pos[:3, t], n_rot, 1e7, sections) for t in range(T)])
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
        # the streams do matter: temporal positions alone give something else
        alone = np.stack([rope_imrope(x[t].astype(np.float64), (pos[0, t],) * 3, n_rot, 1e7, sections)
                          for t in range(T)])
        assert np.abs(alone - want).max() > 1e-2


def test_imrope_on_text_positions_is_neox():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 64))
    for pos in (0, 1, 17, 4000):
        np.testing.assert_allclose(rope_imrope(x, (pos, pos, pos), 16, 1e7, (3, 3, 2)),
                                   rope_neox(x, pos, 16, 1e7), rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------
# value-head broadcast: right (tiled) and wrong (grouped) on the GGUF layout
# --------------------------------------------------------------------------------------------


def _gguf_delta_net(hp: RefHParams, g: dict, il: int, h: np.ndarray, broadcast: str) -> np.ndarray:
    """The delta-net layer computed from GGUF tensors (tiled value heads), broadcasting q/k to value
    heads either tiled (value head m uses key head m % n_k: right for this layout) or grouped
    (m // r: qwen3next's rule, wrong here). Implemented by permuting the value-head tensors back to
    the grouped order the shared scan expects, which is the same computation."""
    p = f"blk.{il}."
    nk, nv, S = hp.n_k_heads, hp.n_v_heads, hp.ssm_state
    order = tiled_head_order(nk, nv) if broadcast == "tiled" else np.arange(nv)
    inv = np.argsort(order)   # grouped head -> its tiled slot
    v_rows = rows_of_heads(inv, S)
    qk = 2 * hp.key_dim
    T = h.shape[0]
    qkv = h @ g[p + "attn_qkv.weight"].T
    qkv = np.concatenate([qkv[:, :qk], qkv[:, qk:][:, v_rows]], axis=1)
    conv = g[p + "ssm_conv1d.weight"]
    conv = np.concatenate([conv[:qk], conv[qk:][v_rows]])
    z = (h @ g[p + "attn_gate.weight"].T)[:, v_rows].reshape(T, nv, S)
    beta = 1 / (1 + np.exp(-(h @ g[p + "ssm_beta.weight"].T)[:, inv]))
    alpha = (h @ g[p + "ssm_alpha.weight"].T)[:, inv] + g[p + "ssm_dt.bias"][inv]
    gdecay = np.logaddexp(0, alpha) * g[p + "ssm_a"][inv]
    state = {"conv": np.zeros((hp.d_conv - 1, hp.conv_dim)), "ssm": np.zeros((nv, S, S)), "history": []}
    o = delta_net_scan(state, hp, qkv, z, beta, gdecay, conv, None, g[p + "ssm_norm.weight"])
    return o.reshape(T, nv * S) @ g[p + "ssm_out.weight"][:, v_rows].T


def test_only_the_tiled_broadcast_reproduces_hf_on_the_gguf_layout(tiny_model_path):
    """Negative control: on the converter's layout the grouped broadcast (qwen3next's rule) gives
    plausible but wrong outputs, far outside any tolerance; the tiled one matches HF to rounding."""
    cfg = q35.PRESETS["tiny-qwen35"]
    hf = q35.hf_weights(cfg, N_VOCAB, 0)
    _, tensors = read(tiny_model_path("tiny-qwen35", "f32"))
    g = {k: np_f32(t) for k, t in tensors.items() if k.startswith("blk.0.")}
    ref = Qwen35Reference(cfg, hf)
    rng = np.random.default_rng(0)
    h = rng.standard_normal((6, cfg.hidden_size))
    state = {"conv": np.zeros((ref.hp.d_conv - 1, ref.hp.conv_dim)), "ssm": np.zeros((8, 32, 32)), "history": []}
    want = ref._linear_attention("model.layers.0.", h, state)
    right = _gguf_delta_net(ref.hp, g, 0, h, "tiled")
    wrong = _gguf_delta_net(ref.hp, g, 0, h, "grouped")
    scale = np.abs(want).max()
    assert np.abs(right - want).max() / scale < 1e-6
    assert np.abs(wrong - want).max() / scale > 0.1
    assert np.isfinite(wrong).all() and 0.2 < np.abs(wrong).max() / scale < 5   # plausible magnitudes


# --------------------------------------------------------------------------------------------
# the reference itself
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", TINY)
def test_reference_chunked_equals_token_by_token_and_clone(preset):
    cfg = q35.PRESETS[preset]
    hf = q35.hf_weights(cfg, 300, 1)
    toks = [5, 17, 200, 3, 99, 42, 7]
    full = Qwen35Reference(cfg, hf).forward(toks)
    r = Qwen35Reference(cfg, hf)
    steps = [r.forward([t])[0] for t in toks[:4]]
    snap = r.clone()
    rest = r.forward(toks[4:])
    np.testing.assert_allclose(np.vstack(steps + [rest]), full, rtol=0, atol=1e-10)
    np.testing.assert_allclose(snap.forward(toks[4:]), rest, rtol=0, atol=1e-12)


def test_reference_uses_every_zero_centred_norm_as_one_plus_w():
    """Setting every zero-centred norm weight to 0 must equal plain RMSNorm (multiplier 1): changes
    the output, and a model whose weights are -1 would zero the stream (guards the 1 + w)."""
    cfg = q35.PRESETS["tiny-qwen35"]
    hf = q35.hf_weights(cfg, 300, 2)
    base = Qwen35Reference(cfg, hf).forward([1, 2, 3])
    zeroed = {k: (np.zeros_like(v) if k.endswith(("layernorm.weight", "q_norm.weight", "k_norm.weight"))
                  or k == "model.norm.weight" else v) for k, v in hf.items()}
    other = Qwen35Reference(cfg, zeroed).forward([1, 2, 3])
    assert np.abs(base - other).max() > 1e-3
    dead = dict(hf, **{"model.norm.weight": -np.ones_like(hf["model.norm.weight"])})
    np.testing.assert_allclose(Qwen35Reference(cfg, dead).forward([1, 2, 3]), 0.0, atol=1e-12)
