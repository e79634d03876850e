"""The synthetic-model generator (models/generate.py): deterministic, loadable, and laid out like a
converted Qwen3-Next file as described in shared/docs/qwen3next-gguf.md.

Expected names and shapes are written out here from the document (ggml `ne` order), not taken
from the spec module, so these tests also cross-check `Qwen3NextFamily.tensor_spec`.
"""

from __future__ import annotations

import numpy as np
import pytest

from deltarun.base.gguf_file import GGUFFile
from deltarun.graphs.qwen3next import Qwen3NextFamily
from deltarun.graphs.spec import _same_shape
from deltarun.model_files import generate as gen
from deltarun.runner.model import Model

F32 = "F32"
RUNNABLE_PRESETS = [p for p in gen.PRESETS if not p.startswith("bench")]   # bench* are ~1 GB in f32: config only

# Relative error bound of dequantized weights against the f32 file, by type.
QUANT_TOLERANCE = {"f32": 0.0, "f16": 5e-4, "bf16": 4e-3, "q8_0": 1e-2, "q6_k": 3e-2, "q5_k": 6e-2,
                   "q4_k": 0.12, "q4_0": 0.12}


def doc_tensors(cfg: gen.ModelConfig, n_vocab: int) -> dict[str, tuple[int, ...]]:
    """Every tensor a file of this config must hold, with its ne, per the GGUF document."""
    E, V = cfg.n_embd, n_vocab
    key_dim, value_dim = cfg.ssm_d_state * cfg.ssm_n_k_heads, cfg.ssm_d_state * cfg.ssm_n_v_heads
    hd, ff, fs, ne = cfg.head_dim, cfg.n_ff_exp, cfg.n_ff_shexp, cfg.n_expert
    t: dict[str, tuple[int, ...]] = {"token_embd.weight": (E, V), "output_norm.weight": (E,)}
    if not cfg.tied_output:
        t["output.weight"] = (E, V)
    recurrent = [(i + 1) % cfg.full_attention_interval != 0 for i in range(cfg.n_layer)] + [False] * cfg.n_mtp
    for il, rec in enumerate(recurrent):
        p = f"blk.{il}."
        t[p + "attn_norm.weight"] = (E,)
        t[p + "post_attention_norm.weight"] = (E,)
        if rec:
            if cfg.legacy_ssm_in:
                t[p + "ssm_in.weight"] = (E, 2 * key_dim + 2 * value_dim)
            else:
                t[p + "attn_qkv.weight"] = (E, 2 * key_dim + value_dim)
                t[p + "attn_gate.weight"] = (E, value_dim)
            t[p + "ssm_ba.weight"] = (E, 2 * cfg.ssm_n_v_heads)
            t[p + "ssm_conv1d.weight"] = (cfg.ssm_d_conv, 2 * key_dim + value_dim)
            t[p + "ssm_a"] = (cfg.ssm_n_v_heads,)
            t[p + "ssm_dt.bias"] = (cfg.ssm_n_v_heads,)
            t[p + "ssm_norm.weight"] = (cfg.ssm_d_state,)
            t[p + "ssm_out.weight"] = (value_dim, E)
        else:
            t[p + "attn_q.weight"] = (E, 2 * hd * cfg.n_head)
            t[p + "attn_k.weight"] = (E, hd * cfg.n_head_kv)
            t[p + "attn_v.weight"] = (E, hd * cfg.n_head_kv)
            t[p + "attn_output.weight"] = (hd * cfg.n_head, E)
            t[p + "attn_q_norm.weight"] = (hd,)
            t[p + "attn_k_norm.weight"] = (hd,)
        t[p + "ffn_gate_inp.weight"] = (E, ne)
        if cfg.merged_gate_up:
            t[p + "ffn_gate_up_exps.weight"] = (E, 2 * ff, ne)
        else:
            t[p + "ffn_gate_exps.weight"] = (E, ff, ne)
            t[p + "ffn_up_exps.weight"] = (E, ff, ne)
        t[p + "ffn_down_exps.weight"] = (ff, E, ne)
        t[p + "ffn_gate_inp_shexp.weight"] = (E,)
        t[p + "ffn_gate_shexp.weight"] = (E, fs)
        t[p + "ffn_up_shexp.weight"] = (E, fs)
        t[p + "ffn_down_shexp.weight"] = (fs, E)
        if il >= cfg.n_layer:
            t[p + "nextn.eh_proj.weight"] = (2 * E, E)
            t[p + "nextn.enorm.weight"] = (E,)
            t[p + "nextn.hnorm.weight"] = (E,)
            t[p + "nextn.shared_head_norm.weight"] = (E,)
    return t


def stays_f32(name: str) -> bool:
    """Tensors the document says stay F32 in every file type: norms, ssm_a, ssm_dt, conv, routers."""
    return (name.endswith("norm.weight") or name.endswith("ssm_a") or "ssm_dt" in name
            or "ssm_conv1d" in name or "ffn_gate_inp" in name)


# --- determinism ----------------------------------------------------------------------------------
@pytest.mark.parametrize("wtype", ["f32", "q4_k"])
def test_same_seed_writes_identical_bytes(tiny_model_path, tmp_path, wtype):
    again = gen.write_model(tmp_path / "again.gguf", "tiny", wtype, seed=0)
    assert again.read_bytes() == tiny_model_path("tiny", wtype).read_bytes()


def test_different_seed_writes_different_weights(tiny_model_path):
    a, b = GGUFFile(tiny_model_path("tiny", "q8_0")), GGUFFile(tiny_model_path("tiny", "q8_0", seed=1))
    assert [(t.name, t.ne, t.ggml_type) for t in a.tensors.values()] == \
           [(t.name, t.ne, t.ggml_type) for t in b.tensors.values()]
    for name in ("token_embd.weight", "blk.0.attn_qkv.weight", "blk.3.attn_q.weight", "blk.2.ssm_a"):
        assert not np.array_equal(a.tensor_array(name), b.tensor_array(name)), name


def test_model_tensors_are_deterministic_without_writing():
    cfg = gen.config_with(n_layer=2, full_attention_interval=2, n_expert=4)
    one, two, other = gen.model_tensors(cfg, 300, 7), gen.model_tensors(cfg, 300, 7), gen.model_tensors(cfg, 300, 8)
    assert list(one) == list(two) == list(other)
    assert all(np.array_equal(one[k], two[k]) for k in one)
    assert not any(np.array_equal(one[k], other[k]) for k in one)


# --- loading back -------------------------------------------------------------------------------
@pytest.mark.parametrize("wtype", list(gen.WEIGHT_TYPES))
def test_every_type_loads_back_with_the_right_shapes_and_types(tiny_model_path, wtype):
    f = GGUFFile(tiny_model_path("tiny", wtype))
    family = Qwen3NextFamily(f)          # reads the hyper-parameters and validates the tensors
    hp = family.hp
    want = doc_tensors(gen.PRESETS["tiny"], hp.n_vocab)
    assert set(f.tensors) == set(want)
    spec = family.expected_tensors()
    for name, ne in want.items():
        info = f.tensors[name]
        assert info.ne == ne, name
        assert _same_shape(info.ne, spec[name][0]), name
        # every row of the tiny preset is a multiple of 256, so nothing falls back to another type
        assert info.type_name == (F32 if stays_f32(name) else gen.WEIGHT_TYPES[wtype].name), name
    assert f.get("general.file_type") == gen._FILE_TYPES[wtype]


@pytest.mark.parametrize("wtype", [w for w in gen.WEIGHT_TYPES if w != "f32"])
def test_quantized_weights_are_close_to_the_f32_ones(tiny_model_path, wtype):
    q, ref = GGUFFile(tiny_model_path("tiny", wtype)), GGUFFile(tiny_model_path("tiny", "f32"))
    for name in ("token_embd.weight", "blk.0.ssm_out.weight", "blk.3.ffn_down_exps.weight"):
        a, b = q.tensor_array(name), ref.tensor_array(name)
        err = float(np.linalg.norm(a - b) / np.linalg.norm(b))
        assert 0 < err < QUANT_TOLERANCE[wtype], (name, err)
    for name in ("blk.0.ssm_a", "blk.0.ssm_conv1d.weight", "blk.1.ffn_gate_inp.weight", "output_norm.weight"):
        assert np.array_equal(q.tensor_array(name), ref.tensor_array(name)), name


def test_rows_not_a_multiple_of_the_block_fall_back_like_llama_cpp():
    arr = np.zeros((4, 96), np.float32)   # 96: a multiple of 32 (Q8_0) but not of 256 (K-quants)
    assert gen.storage_type("blk.0.ffn_up_shexp.weight", arr, "q4_k").name == "Q8_0"
    assert gen.storage_type("blk.0.ffn_up_shexp.weight", np.zeros((4, 40), np.float32), "q4_k").name == "F16"
    assert gen.storage_type("blk.0.ssm_conv1d.weight", np.zeros((4, 256), np.float32), "q8_0").name == "F32"


# --- conventions of shared/docs/qwen3next-gguf.md ----------------------------------------------------
DOC_KEYS = [
    "block_count", "context_length", "embedding_length", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "attention.value_length",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.dimension_count", "expert_count",
    "expert_used_count", "expert_feed_forward_length", "expert_shared_feed_forward_length",
    "ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size",
    "attention.recurrent_layers", "full_attention_interval",
]


@pytest.mark.parametrize("preset", RUNNABLE_PRESETS)
def test_metadata_keys_follow_the_document(tiny_model_path, preset):
    cfg = gen.PRESETS[preset]
    f = GGUFFile(tiny_model_path(preset))
    get = lambda key: f.get(f"qwen3next.{key}")  # noqa: E731
    assert f.get("general.architecture") == "qwen3next"
    for key in DOC_KEYS:
        assert get(key) is not None, key
    assert get("block_count") == cfg.n_layer + cfg.n_mtp
    assert get("nextn_predict_layers") == (cfg.n_mtp or None)
    assert get("ssm.inner_size") == get("ssm.time_step_rank") * get("ssm.state_size")
    assert get("ssm.time_step_rank") % get("ssm.group_count") == 0
    assert get("attention.key_length") == get("attention.value_length")
    assert get("rope.dimension_count") == get("attention.key_length") // 4      # partial rotary 0.25
    rec = get("attention.recurrent_layers")
    interval = get("full_attention_interval")
    assert rec == [(i + 1) % interval != 0 for i in range(cfg.n_layer)] + [False] * cfg.n_mtp
    assert get("expert_used_count") <= get("expert_count")

    tokens = f.get("tokenizer.ggml.tokens")
    assert f.get("tokenizer.ggml.model") == "gpt2" and f.get("tokenizer.ggml.pre") == "qwen2"
    assert len(f.get("tokenizer.ggml.token_type")) == len(tokens)
    assert len(f.get("tokenizer.ggml.merges")) > 0
    bos, eos, pad = (f.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding"))
    assert bos == eos == pad and tokens[eos] == "<|endoftext|>"
    assert f.get("tokenizer.ggml.add_bos_token") is False
    assert "<|im_start|>" in f.get("tokenizer.chat_template")


@pytest.mark.parametrize("preset", RUNNABLE_PRESETS)
def test_tensor_names_and_shapes_follow_the_document(tiny_model_path, preset):
    f = GGUFFile(tiny_model_path(preset))
    hp = Qwen3NextFamily.read_hparams(f)
    want = doc_tensors(gen.PRESETS[preset], hp.n_vocab)
    assert set(f.tensors) == set(want), set(f.tensors) ^ set(want)
    assert {n: f.tensors[n].ne for n in want} == want
    Qwen3NextFamily(f)                   # validates the tensors


@pytest.mark.parametrize("wtype", list(gen.WEIGHT_TYPES))
def test_small_tensors_stay_f32_and_big_ones_take_the_file_type(tiny_model_path, wtype):
    f = GGUFFile(tiny_model_path("tiny-mtp", wtype))
    for name, info in f.tensors.items():
        if stays_f32(name):
            assert info.type_name == F32, name
        else:
            assert len(info.ne) >= 2 and info.type_name == gen.WEIGHT_TYPES[wtype].name, name
    # embeddings and LM head included
    assert f.tensors["token_embd.weight"].type_name == gen.WEIGHT_TYPES[wtype].name
    assert f.tensors["output.weight"].type_name == gen.WEIGHT_TYPES[wtype].name


def test_stored_values_follow_the_document(tiny_model_path):
    f = GGUFFile(tiny_model_path("tiny-mtp"))
    norms = [n for n in f.tensors if n.endswith("norm.weight") and "ssm_norm" not in n]
    assert {"output_norm.weight", "blk.0.attn_norm.weight", "blk.3.attn_q_norm.weight",
            "blk.4.nextn.enorm.weight"} <= set(norms)
    for name in norms:   # RMSNorm weights stored as 1 + w: around 1, never near 0
        w = f.tensor_array(name)
        assert abs(float(w.mean()) - 1.0) < 0.05 and float(w.min()) > 0.5, name
    ssm_a = [n for n in f.tensors if n.endswith("ssm_a")]
    assert len(ssm_a) == 3
    for name in ssm_a:   # -exp(A_log): strictly negative
        assert (f.tensor_array(name) < 0).all(), name
    for name in (n for n in f.tensors if n.endswith("ssm_dt.bias") or n.endswith("ssm_norm.weight")):
        assert np.isfinite(f.tensor_array(name)).all()


# --- head layouts and alternative tensor forms ------------------------------------------------------
@pytest.mark.parametrize("preset, ratio", [("tiny-eqheads", 1), ("tiny", 2)])
def test_head_layouts(tiny_model_path, preset, ratio):
    f = GGUFFile(tiny_model_path(preset))
    hp = Qwen3NextFamily.read_hparams(f)
    assert hp.ssm_n_v_heads == ratio * hp.ssm_n_k_heads
    assert f.tensors["blk.0.attn_qkv.weight"].ne == (hp.n_embd, 2 * hp.key_dim + hp.value_dim)
    assert f.tensors["blk.0.ssm_ba.weight"].ne == (hp.n_embd, 2 * hp.ssm_n_v_heads)
    with Model(f.path, n_ctx=64, n_threads=1) as m:
        logits = m.eval(m.tokenizer.encode("one two three"))
        assert logits.shape == (hp.n_vocab,) and np.isfinite(logits).all()


def test_bench_preset_config():
    cfg = gen.PRESETS["bench"]
    assert cfg.n_embd == 1024 and cfg.n_layer == 8 and cfg.n_expert == 16 and cfg.n_expert_used == 4
    assert cfg.ssm_n_v_heads == 2 * cfg.ssm_n_k_heads
    assert cfg.n_rot * 4 == cfg.head_dim
    # every weight row is a whole number of 256-blocks, so K-quants apply to all of them
    for n in (cfg.n_embd, cfg.n_ff_exp, cfg.n_ff_shexp, cfg.value_dim, cfg.head_dim * cfg.n_head):
        assert n % 256 == 0


def test_real_vocabulary_bench_preset():
    """bench-vocab151k: the bench shape with the real Qwen2 vocabulary (151,936 tokens)."""
    import dataclasses
    import os

    from deltarun.model_files.vocab import qwen2_vocab, qwen2_vocab_path

    cfg = gen.PRESETS["bench-vocab151k"]
    assert cfg.vocab == "qwen2" and dataclasses.replace(cfg, vocab="tiny") == gen.PRESETS["bench"]
    if not os.path.exists(qwen2_vocab_path()):
        pytest.skip("no Qwen2 vocabulary file here")
    v = qwen2_vocab()
    assert v.n_vocab == 151936 and len(v.merges) == 151387 and len(v.token_types) == v.n_vocab
    assert v.tokens[v.eos_id] == "<|endoftext|>"


def test_unknown_vocabulary_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown vocabulary"):
        gen.write_model(tmp_path / "x.gguf", gen.config_with(vocab="nope"))


def test_legacy_ssm_in_groups_rows_per_key_head(tiny_model_path):
    """ssm_in holds, per key head g: q_g, k_g, v_g (n_v/n_k heads), z_g; same numbers as attn_qkv + attn_gate."""
    legacy, split = GGUFFile(tiny_model_path("tiny-legacy")), GGUFFile(tiny_model_path("tiny"))
    cfg = gen.PRESETS["tiny"]
    S, nk, r = cfg.ssm_d_state, cfg.ssm_n_k_heads, cfg.ssm_n_v_heads // cfg.ssm_n_k_heads
    kd = cfg.key_dim
    for il in (0, 1, 2):
        p = f"blk.{il}."
        assert p + "attn_qkv.weight" not in legacy.tensors and p + "attn_gate.weight" not in legacy.tensors
        ssm_in = legacy.tensor_array(p + "ssm_in.weight")             # numpy (rows, n_embd)
        qkv, z = split.tensor_array(p + "attn_qkv.weight"), split.tensor_array(p + "attn_gate.weight")
        q, k, v = qkv[:kd], qkv[kd:2 * kd], qkv[2 * kd:]
        rows = 0
        for g in range(nk):
            for part in (q[g * S:(g + 1) * S], k[g * S:(g + 1) * S], v[g * r * S:(g + 1) * r * S],
                         z[g * r * S:(g + 1) * r * S]):
                assert np.array_equal(ssm_in[rows:rows + len(part)], part), (il, g)
                rows += len(part)
        assert rows == ssm_in.shape[0]
    # the same weights in the other layout compute the same thing
    toks = list(range(40, 60))
    with Model(legacy.path, n_ctx=64, kv_type="f32", n_threads=1) as a, \
            Model(split.path, n_ctx=64, kv_type="f32", n_threads=1) as b:
        np.testing.assert_allclose(a.logits_for(toks), b.logits_for(toks), rtol=1e-4, atol=1e-4)


def test_tied_output_and_merged_gate_up(tiny_model_path):
    f = GGUFFile(tiny_model_path("tiny-tied"))
    cfg = gen.PRESETS["tiny-tied"]
    assert "output.weight" not in f.tensors
    assert "blk.0.ffn_gate_exps.weight" not in f.tensors
    assert f.tensors["blk.0.ffn_gate_up_exps.weight"].ne == (cfg.n_embd, 2 * cfg.n_ff_exp, cfg.n_expert)
    with Model(f.path, n_ctx=64, n_threads=1) as m:
        assert np.isfinite(m.eval([1, 2, 3])).all()


def test_mtp_block(tiny_model_path):
    f = GGUFFile(tiny_model_path("tiny-mtp"))
    hp = Qwen3NextFamily.read_hparams(f)
    E = hp.n_embd
    assert (hp.n_layer, hp.n_mtp) == (4, 1)
    assert f.get("qwen3next.block_count") == 5 and f.get("qwen3next.nextn_predict_layers") == 1
    p = "blk.4."
    assert f.tensors[p + "nextn.eh_proj.weight"].ne == (2 * E, E)
    for name in ("enorm", "hnorm", "shared_head_norm"):
        assert f.tensors[p + f"nextn.{name}.weight"].ne == (E,)
    assert p + "attn_q.weight" in f.tensors and p + "ffn_down_exps.weight" in f.tensors
    assert not any(n.startswith(p + "ssm_") for n in f.tensors)
    # shared with the trunk, so absent: embeddings and LM head of the MTP layer
    assert p + "nextn.embed_tokens.weight" not in f.tensors and p + "nextn.shared_head_head.weight" not in f.tensors
    # the MTP layer is drawn after the trunk: the trunk is the tiny model's, bit for bit
    tiny = GGUFFile(tiny_model_path("tiny"))
    for name in tiny.tensors:
        assert np.array_equal(f.tensor_array(name), tiny.tensor_array(name)), name
    toks = list(range(100, 116))
    with Model(f.path, n_ctx=64, kv_type="f32", n_threads=1) as a, \
            Model(tiny.path, n_ctx=64, kv_type="f32", n_threads=1) as b:
        np.testing.assert_allclose(a.logits_for(toks), b.logits_for(toks), rtol=1e-5, atol=1e-5)
