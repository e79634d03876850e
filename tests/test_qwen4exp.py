"""Qwen3.8-Flash-Next (`qwen4exp`, issue 33): the tiny generator against the converter's definition
(docs/qwen4exp-gguf.md) and the float64 reference (tests/reference_qwen4exp.py) against the
properties transformers' math implies: chunked = token by token, the indexer dense until the
budget is exceeded, the n-gram ids of `_shift_right_ignore_eos` worked by hand, the hash constants
recomputed in a second way (numpy uint64 arithmetic), every new part changing the logits.
"""

from __future__ import annotations

import numpy as np
import pytest

from deltarun.model_files import qwen4exp as q4
from deltarun.model_files.vocab import vocab_named
from reference_qwen4exp import Qwen4ExpReference, ngram_rows, shift_right_ignore_eos
from test_qwen35_files import np_f32, read

PRESET = "tiny-qwen4exp"
CFG = q4.PRESETS[PRESET]
VOCAB = vocab_named(CFG.vocab)
EOS = VOCAB.eos_id


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 2300, n)]


@pytest.fixture(scope="module")
def hf() -> dict[str, np.ndarray]:
    return q4.hf_weights(CFG, VOCAB.n_vocab, 0)


@pytest.fixture(scope="module")
def q4_path(tmp_path_factory):
    return q4.write_model(tmp_path_factory.mktemp("qwen4exp") / "tiny-qwen4exp-f32.gguf", PRESET)


def reference(cfg=CFG, hf_w=None) -> Qwen4ExpReference:
    return Qwen4ExpReference(cfg, hf_w if hf_w is not None else q4.hf_weights(cfg, VOCAB.n_vocab, 0), EOS)


# ---- the file -----------------------------------------------------------------------------------


def test_keys_as_the_converter_writes(q4_path, hf):
    fields, _ = read(q4_path)
    a = "qwen4exp."
    assert fields["general.architecture"] == "qwen4exp"
    assert fields[a + "block_count"] == CFG.num_hidden_layers          # no MTP block
    assert a + "nextn_predict_layers" not in fields
    assert fields[a + "hyper_connection.count"] == 4 and fields[a + "hyper_connection.low_rank"] == 16
    assert fields[a + "attention.indexer.head_count"] == 2 and fields[a + "attention.indexer.key_length"] == 16
    assert fields[a + "attention.indexer.top_k"] == 8                  # the budget in tokens
    assert fields[a + "attention.compress_ratios"] == [0, 0, 0, 4]
    assert fields[a + "attention.recurrent_layers"] == [True, True, True, False]
    assert fields[a + "ple.layers"] == [1]                               # zero-based
    assert fields[a + "ple.eos_token_id"] == EOS
    assert fields[a + "embedding_length_per_layer_input"] == CFG.ple_row_dim == 16
    e = "model.layers.1.ple.ple_embedding."
    assert fields[a + "ple.layer_multipliers"] == hf[e + "layer_multipliers"].tolist()
    assert fields[a + "ple.head_vocab_sizes"] == [1009, 1013, 1019, 1021]
    assert fields[a + "ple.head_offsets"] == [0, 1009, 2022, 3041]


def test_own_tensors_undo_to_the_hf_weights(q4_path, hf):
    """The converter's qwen4exp steps undone from their definition: 1 + w norms, the indexer's
    split projection, the squeezed PLE kernel, the table under its global name."""
    _, tensors = read(q4_path)
    g = {k: np_f32(t) for k, t in tensors.items()}
    H = CFG.hc_count
    for il in range(CFG.num_hidden_layers):
        for hf_mod, short in (("attn_hyper_connection", "hc_attn"), ("mlp_hyper_connection", "hc_ffn")):
            p = f"model.layers.{il}.{hf_mod}."
            np.testing.assert_allclose(g[f"blk.{il}.{short}_norm.weight"] - 1, hf[p + "hc_norm.weight"], atol=1e-6)
            np.testing.assert_array_equal(g[f"blk.{il}.{short}_down.weight"], hf[p + "input_mix_weight_down.weight"])
            np.testing.assert_array_equal(g[f"blk.{il}.{short}_up.weight"], hf[p + "input_mix_weight_up.weight"])
            np.testing.assert_array_equal(g[f"blk.{il}.{short}_inject.weight"], hf[p + "block_inject_weight.weight"])
            assert g[f"blk.{il}.{short}_inject.weight"].shape == (H, H * CFG.hidden_size)
    a = "model.layers.3.self_attn.indexer."
    np.testing.assert_array_equal(np.concatenate([g["blk.3.indexer.q_proj.weight"], g["blk.3.indexer.k_proj.weight"]]),
                                  hf[a + "index_qk_proj.weight"])
    assert g["blk.3.indexer.k_proj.weight"].shape == (CFG.indexer_head_dim, CFG.hidden_size)
    for x in "qk":
        np.testing.assert_allclose(g[f"blk.3.indexer.{x}_norm.weight"] - 1, hf[a + f"{x}_layernorm.weight"], atol=1e-6)
    p = "model.layers.1.ple."
    for n in ("key", "query", "conv"):
        np.testing.assert_allclose(g[f"blk.1.ple_norm_{n}.weight"] - 1, hf[p + f"norm_{n}.weight"], atol=1e-6)
    np.testing.assert_array_equal(g["blk.1.ple_conv1d.weight"], hf[p + "conv1d.weight"][:, 0, :])
    np.testing.assert_array_equal(g["per_layer_token_embd.weight"], hf[p + "ple_embedding.ngram_embedding.weight"])
    for il in range(CFG.num_hidden_layers):                      # hyper-connections replace every layer norm
        assert f"blk.{il}.attn_norm.weight" not in g and f"blk.{il}.post_attention_norm.weight" not in g
    assert "output_norm.weight" not in g
    np.testing.assert_allclose(g["output_hc_norm.weight"] - 1, hf["model.hyper_connection_mixer.hc_norm.weight"],
                               atol=1e-6)
    assert "output_hc_inject.weight" not in g


def test_the_converter_carries_one_ple_layer():
    with pytest.raises(ValueError, match="one PLE layer"):
        cfg = q4.config_with(ple_layer_ids=(1, 2))
        q4.convert(cfg, q4.hf_weights(cfg, VOCAB.n_vocab, 0))


@pytest.mark.parametrize("changes,message", [
    ({"ple_layer_ids": (4,)}, "not a one-based linear-attention layer"),
    ({"indexer_budget": 6}, "divisible"),
    ({"hc_count": 1}, "hc_count"),
    ({"indexer_head_dim": 4}, "fit the indexer head"),
])
def test_config_checks_transformers_invariants(changes, message):
    with pytest.raises(ValueError, match=message):
        q4.config_with(**changes)


# ---- the hash constants --------------------------------------------------------------------------


def test_multipliers_recomputed_with_numpy_uint64():
    """splitmix64 in wrapping uint64 arithmetic, a second way to the same odd multipliers, each
    below (2^63 - 1) / n_vocab so that token x multiplier stays inside int64."""
    def splitmix(v):
        with np.errstate(over="ignore"):
            v = np.uint64(v) + np.uint64(0x9E3779B97F4A7C15)
            v = (v ^ (v >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
            v = (v ^ (v >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
            return int(v ^ (v >> np.uint64(31)))

    n_vocab = VOCAB.n_vocab
    half = (2**63 - 1) // n_vocab // 2
    for k in (0, 3):
        base = CFG.seed + 10007 * k
        want = [2 * (splitmix((base + 0x9E3779B97F4A7C15 * (i + 1)) % 2**64) % half) + 1 for i in range(3)]
        got = q4.layer_multipliers(CFG, n_vocab, k)
        assert got == want
        assert all(m % 2 == 1 and m * (n_vocab - 1) < 2**63 for m in got)


def test_head_sizes_are_the_primes_after_the_base():
    assert q4.head_vocab_sizes(CFG, 0) == [1009, 1013, 1019, 1021]
    assert q4.head_vocab_sizes(CFG, 1) == [1031, 1033, 1039, 1049]     # the next PLE layer's heads
    assert q4.table_rows(CFG, 0) == 4096                               # 4062 padded to 128


def test_shift_right_ignore_eos_by_hand():
    e = 9
    h = [e, e, 1, 2, e, 3, 4, 5]
    assert shift_right_ignore_eos(h, 0, e) == h
    assert shift_right_ignore_eos(h, 1, e) == [e, e, e, 1, 2, e, 3, 4]   # the EOS keeps its predecessor
    assert shift_right_ignore_eos(h, 2, e) == [e, e, e, e, 1, e, e, 3]


def test_ngram_rows_by_hand():
    m, sizes, offsets = [3, 5, 7], [11, 13, 17, 19], [0, 11, 24, 41]
    rows = ngram_rows([9, 9], [1, 2], m, sizes, offsets, 2, eos=9)
    # token 2 after 1 after the start: bigram 2*3 ^ 1*5 = 3, trigram 3 ^ 9*7 = 60
    assert rows[1].tolist() == [3 % 11, 3 % 13 + 11, 60 % 17 + 24, 60 % 19 + 41]
    # token 1 first: its predecessors are EOS
    assert rows[0].tolist() == [(3 ^ 45) % 11, (3 ^ 45) % 13 + 11, (3 ^ 45 ^ 63) % 17 + 24, (3 ^ 45 ^ 63) % 19 + 41]


# ---- the reference ------------------------------------------------------------------------------


def test_reference_chunked_equals_token_by_token_and_clone(hf):
    toks = prompt(22, seed=1)
    toks[7] = EOS
    full = reference(hf_w=hf).forward(toks)
    ref = reference(hf_w=hf)
    parts = [ref.forward(toks[:9])]
    saved = ref.clone()
    parts.append(ref.forward(toks[9:14]))
    parts += [ref.forward([t]) for t in toks[14:]]
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(saved.forward(toks[9:])[-1], full[-1], rtol=1e-12, atol=1e-12)
    assert ref.ple_context(1) == toks[-2:]
    assert ref.index_keys(3).shape == (22, CFG.indexer_head_dim)


def test_indexer_is_dense_until_the_budget_is_exceeded(hf):
    """Budget 8, blocks of 4: with at most 2 complete blocks everything is selected; from the
    12th token on (3 blocks) the sparse selection changes the logits."""
    toks = prompt(20, seed=2)
    sparse = reference(hf_w=hf).forward(toks)
    dense_cfg = q4.config_with(indexer_budget=64)
    dense = reference(dense_cfg, hf).forward(toks)
    diff = np.abs(sparse - dense).max(axis=1)
    assert (diff[:11] == 0).all()
    assert (diff[11:] > 1e-3).all()


@pytest.mark.parametrize("part", ["ple_table", "inject", "indexer_qk", "mixer"])
def test_every_part_changes_the_logits(hf, part):
    toks = prompt(16, seed=3)
    base = reference(hf_w=hf).forward(toks)
    edited = dict(hf)
    name = {"ple_table": "model.layers.1.ple.ple_embedding.ngram_embedding.weight",
            "inject": "model.layers.0.mlp_hyper_connection.block_inject_weight.weight",
            "indexer_qk": "model.layers.3.self_attn.indexer.index_qk_proj.weight",   # only the selection
            "mixer": "model.hyper_connection_mixer.input_mix_weight_up.weight"}[part]
    edited[name] = -hf[name]
    if part == "indexer_qk":        # the query rows only: negating q and k together leaves every score
        edited[name] = np.concatenate([-hf[name][:-CFG.indexer_head_dim], hf[name][-CFG.indexer_head_dim:]])
    assert np.abs(reference(hf_w=edited).forward(toks) - base).max() > 1e-3
