"""Qwen3.8-Flash-Next (`qwen4exp`, issue 33): the tiny generator against the converter's definition
(docs/qwen4exp-gguf.md); the float64 reference (tests/reference_qwen4exp.py) against the properties
transformers' math implies: chunked = token by token, the indexer dense until the budget is
exceeded, the n-gram ids of `_shift_right_ignore_eos` worked by hand, the hash constants recomputed
in a second way (numpy uint64 arithmetic), every new part changing the logits; then the ggml graph
(graphs/qwen4exp.py) against the reference.

Tolerances (tiny preset, F32 weights and KV cache, 2 vCPU x86-64 shared with other sessions): 1e-5
on max |ggml - ref| / max |ref| (measured 1.6e-7 on 60 tokens). The indexer's top-k is a hard
choice: the prompts are checked to have a clear gap (> 1e-3) between the last chosen and the first
dropped block score in the reference, so F32 rounding cannot flip the selection.
"""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest

from deltarun.base.ggml_util import ggml
from deltarun.graphs.blocks import ple
from deltarun.model_files import qwen4exp as q4
from deltarun.model_files.vocab import vocab_named
from deltarun.runner.engine import Engine, Running
from deltarun.runner.model import Model
from deltarun.runner.sampling import GREEDY, Sampler
from deltarun.runner.speculative import DraftLength, NgramDraft
import llamacpp
from llamacpp import needs_llamacpp
from reference_qwen4exp import Qwen4ExpReference, ngram_rows, shift_right_ignore_eos
from test_qwen35_files import np_f32, read, rows_of_heads, tiled_head_order
from test_engine import still_wanted
from reference_compare import (F32_TOL, assert_capture_resumes, assert_close_everywhere, assert_f32_matches,
                               assert_one_ubatch_matches, assert_quantised_close, assert_rollback_equals_recomputation,
                               greedy, prompt, rel_err)

PRESET = "tiny-qwen4exp"
CFG = q4.PRESETS[PRESET]
VOCAB = vocab_named(CFG.vocab)
EOS = VOCAB.eos_id


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
    assert fields[a + "attention.indexer.head_count"] == 4 and fields[a + "attention.indexer.key_length"] == 16
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


def hf_from_gguf(path) -> dict[str, np.ndarray]:
    """Dequantised GGUF tensors back in the checkpoint's names and shapes (the hash buffers from
    the keys): the converter undone from its definition (docs/qwen4exp-gguf.md, qwen35-gguf.md),
    not from models/qwen4exp.py's tables: value heads from tiled back to grouped order, 1 + w
    norms, -exp(A_log), the split gate_up and indexer projections, the squeezed kernels."""
    fields, tensors = read(path)
    heads = tiled_head_order(CFG.linear_num_key_heads, CFG.linear_num_value_heads)
    v_rows = rows_of_heads(heads, CFG.linear_value_head_dim)
    g = {k: np_f32(t) for k, t in tensors.items()}
    hf = {"model.embed_tokens.weight": g.pop("token_embd.weight"), "lm_head.weight": g.pop("output.weight")}
    table = g.pop("per_layer_token_embd.weight")
    hc = {"norm.weight": "hc_norm.weight", "down.weight": "input_mix_weight_down.weight",
          "up.weight": "input_mix_weight_up.weight", "inject.weight": "block_inject_weight.weight"}
    plain = {"attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
             "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
             "ffn_gate_inp.weight": "mlp.gate.weight", "ffn_down_exps.weight": "mlp.experts.down_proj",
             "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
             "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
             "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
             "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
             "ple_key.weight": "ple.key_proj.weight", "ple_value.weight": "ple.value_proj.weight",
             "ssm_norm.weight": "linear_attn.norm.weight"}
    for name, x in g.items():
        if name.startswith("output_hc_"):
            hf["model.hyper_connection_mixer." + hc[name[10:]]] = x - 1 if name.endswith("norm.weight") else x
            continue
        _, il, rest = name.split(".", 2)
        p = f"model.layers.{il}."
        if rest.startswith(("hc_attn_", "hc_ffn_")):
            mod, leaf = ("attn", rest[8:]) if rest.startswith("hc_attn_") else ("mlp", rest[7:])
            hf[p + f"{mod}_hyper_connection." + hc[leaf]] = x - 1 if leaf == "norm.weight" else x
        elif rest in plain:
            hf[p + plain[rest]] = x
        elif rest in ("attn_q_norm.weight", "attn_k_norm.weight"):
            hf[p + f"self_attn.{rest[5]}_norm.weight"] = x - 1
        elif rest.startswith("indexer."):
            if rest in ("indexer.q_norm.weight", "indexer.k_norm.weight"):
                hf[p + f"self_attn.indexer.{rest[8]}_layernorm.weight"] = x - 1
            elif rest == "indexer.q_proj.weight":
                k_rows = g[f"blk.{il}.indexer.k_proj.weight"]
                hf[p + "self_attn.indexer.index_qk_proj.weight"] = np.concatenate([x, k_rows])
        elif rest.startswith("ple_norm_"):
            hf[p + f"ple.norm_{rest[9:-7]}.weight"] = x - 1
        elif rest == "ple_conv1d.weight":
            hf[p + "ple.conv1d.weight"] = x[:, None, :]
        elif rest in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            if rest == "ffn_gate_exps.weight":
                hf[p + "mlp.experts.gate_up_proj"] = np.concatenate([x, g[f"blk.{il}.ffn_up_exps.weight"]], axis=1)
        else:                                        # the delta net: value heads back to grouped order
            kd = 2 * CFG.key_dim
            unreorder = {
                "attn_qkv.weight": lambda y: np.concatenate([y[:kd], y[kd:][np.argsort(v_rows)]]),
                "attn_gate.weight": lambda y: y[np.argsort(v_rows)],
                "ssm_beta.weight": lambda y: y[np.argsort(heads)],
                "ssm_alpha.weight": lambda y: y[np.argsort(heads)],
                "ssm_dt.bias": lambda y: y[np.argsort(heads)],
                "ssm_a": lambda y: np.log(-y[np.argsort(heads)]),
                "ssm_conv1d.weight": lambda y: np.concatenate([y[:kd], y[kd:][np.argsort(v_rows)]])[:, None, :],
                "ssm_out.weight": lambda y: y[:, np.argsort(v_rows)],
            }
            target = {"attn_qkv.weight": "in_proj_qkv.weight", "attn_gate.weight": "in_proj_z.weight",
                      "ssm_beta.weight": "in_proj_b.weight", "ssm_alpha.weight": "in_proj_a.weight",
                      "ssm_dt.bias": "dt_bias", "ssm_a": "A_log", "ssm_conv1d.weight": "conv1d.weight",
                      "ssm_out.weight": "out_proj.weight"}
            hf[p + "linear_attn." + target[rest]] = unreorder[rest](x)
    e = f"model.layers.{fields['qwen4exp.ple.layers'][0]}.ple.ple_embedding."
    hf[e + "ngram_embedding.weight"] = table
    for buffer, key in (("layer_multipliers", "layer_multipliers"), ("ngram_heads_vocab_sizes", "head_vocab_sizes"),
                        ("ngram_heads_offsets", "head_offsets")):
        hf[e + buffer] = np.array(fields["qwen4exp.ple." + key], dtype=np.int64)
    return hf


def test_hf_from_gguf_inverts_the_conversion(q4_path, hf):
    got = hf_from_gguf(q4_path)
    assert sorted(got) == sorted(hf)
    for k in hf:
        np.testing.assert_allclose(got[k], hf[k], rtol=1e-6, atol=1e-6, err_msg=k)


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


# ---- the graph ----------------------------------------------------------------------------------


def long_prompt(n: int = 60, seed: int = 1) -> list[int]:
    toks = prompt(n, seed)
    toks[n // 3] = EOS                    # an EOS inside: the n-gram context restarts after it
    return toks


def selection_gaps(ref: Qwen4ExpReference, toks: list[int]) -> float:
    """The smallest gap, over the queries that select, between the last chosen and the first dropped
    block score of the reference's indexer (run on a clone, token by token)."""
    r, gaps = CFG.indexer_compress_ratio, []
    original = Qwen4ExpReference._indexer

    def spy(self, il, h, positions):
        out = original(self, il, h, positions)
        keys = np.stack(self._layers[il]["index_k"])
        w, p = self.hf, f"model.layers.{il}.self_attn.indexer."
        D, n_i = CFG.indexer_head_dim, CFG.indexer_n_heads
        from reference import rmsnorm
        for t, pos in enumerate(positions):
            n_blocks = (pos + 1) // r
            if n_blocks <= CFG.indexer_budget // r:
                continue
            q = rmsnorm((h[t] @ w[p + "index_qk_proj.weight"].T)[:n_i * D].reshape(n_i, D), self.hp.eps)
            qt = self._rope(q * (1 + w[p + "q_layernorm.weight"]), pos)
            pooled = rmsnorm(keys[:n_blocks * r].reshape(n_blocks, r, D).mean(1), self.hp.eps)
            pooled = np.stack([self._rope(k, j * r) for j, k in enumerate(pooled * (1 + w[p + "k_layernorm.weight"]))])
            score = np.sort(np.maximum(qt @ pooled.T, 0).sum(0) / np.sqrt(D))[::-1]
            gaps.append(score[CFG.indexer_budget // r - 1] - score[CFG.indexer_budget // r])
        return out

    Qwen4ExpReference._indexer = spy
    try:
        ref.clone().forward(toks)
    finally:
        Qwen4ExpReference._indexer = original
    return min(gaps)


def test_f32_logits_and_greedy_match_reference(q4_path, hf):
    toks = long_prompt()
    ref = reference(hf_w=hf)
    assert selection_gaps(ref, toks) > 1e-3
    with Model(q4_path, n_ctx=128, kv_type="f32", n_ubatch=16) as m:       # four ubatches
        assert_f32_matches(m, ref, toks, 30, "qwen4exp f32")


def test_states_match_reference(q4_path, hf):
    """The PLE convolution's history (slot 0 of the conv row's extra part) and the indexer keys (the
    K rows' last columns) are the reference's."""
    toks = long_prompt(23)
    ref = reference(hf_w=hf)
    ref.forward(toks)
    H, E = CFG.hc_count, CFG.hidden_size
    with Model(q4_path, n_ctx=64, kv_type="f32", rs_slots=2) as m:
        m.eval(toks)
        hp = m.hp
        row = m.memory.read_recurrent(0).conv[1].view(np.float32)
        hist = (CFG.ple_conv_kernel_size - 1) * CFG.ngram_size
        ple_slot0 = row[hp.conv_state_size:][:hist * H * E].reshape(H * E, hist).T   # a state copy: slot 0
        np.testing.assert_allclose(ple_slot0, ref.ple_conv_state(1), rtol=1e-4, atol=1e-5)
        k_rows = m.memory.read_kv(0, len(toks)).rows[3][0].view(np.float32).reshape(len(toks), -1)
        np.testing.assert_allclose(k_rows[:, -CFG.indexer_head_dim:], ref.index_keys(3), rtol=1e-4, atol=1e-5)


def test_two_sequences_in_one_ubatch_match_reference(q4_path, hf):
    with Model(q4_path, n_ctx=64, kv_type="f32", n_seq_max=2) as m:
        assert_one_ubatch_matches(m, [long_prompt(14, seed=4), long_prompt(14, seed=5)],
                                  lambda p: reference(hf_w=hf).forward(p)[-1])


@pytest.mark.parametrize("n_block,n_back", [(5, 3), (3, 3), (3, 1), (20, 3)])   # (3, 3): the whole ubatch
def test_rollback_equals_recomputation(q4_path, n_block, n_back):
    """Rolled back: the delta nets' and the PLE convolution's slots, the K rows (indexer keys) by
    masking, the n-gram context by the tokens Memory keeps."""
    with Model(q4_path, n_ctx=128, kv_type="f32", rs_slots=4) as m:
        assert_rollback_equals_recomputation(m, long_prompt(15, seed=10), prompt(n_block, seed=11),
                                             prompt(4, seed=12), n_back)


def test_a_restored_capture_continues_as_the_unbroken_sequence(q4_path):
    """The prompt cache's pieces: a capture inside a ubatch (PLE history included), the K rows, the
    tokens; the copy continues as the unbroken sequence."""
    with Model(q4_path, n_ctx=128, n_ubatch=64, kv_type="f32", capture_slots=2, n_seq_max=2) as m:
        assert_capture_resumes(m, long_prompt(50, seed=2), 40, [13, 29], 29)


def test_engine_steps_with_ngram_drafts_keep_the_reference_tokens(q4_path, hf):
    """The decode engine: two sequences in one ubatch with n-gram drafts (rejected rows rolled back
    in every state), each keeping the reference's greedy continuation."""
    def reference_greedy(p: list[int], n: int) -> list[int]:
        ref = reference(hf_w=hf)
        return greedy(lambda t: ref.forward([t])[-1], ref.forward(p)[-1], n)

    rng = np.random.default_rng(5)
    # a prompt holding its own first greedy token (prepended until it does), so that the n-gram
    # source drafts from the first step on (a random model rarely repeats itself otherwise)
    first = [int(t) for t in rng.integers(3, 2000, 4)] * 4
    for _ in range(20):
        x = reference_greedy(first, 1)[0]
        if x in first:
            break
        first = [x] + first
    assert x in first
    prompts = [first, long_prompt(12, seed=6)]
    n_new = 8
    want = [reference_greedy(p, n_new) for p in prompts]
    with Model(q4_path, n_ctx=128, kv_type="f32", n_seq_max=2, rs_slots=4) as m:
        engine = Engine(m, max_rows=64)
        running = []
        for seq, p in enumerate(prompts):
            r = Running(seq, Sampler(GREEDY), list(p), draft=NgramDraft(), length=DraftLength(3))
            engine.first(r, m.eval(p, seq))
            running.append(r)
        for _ in range(n_new):
            live = still_wanted(running, prompts, n_new)
            if not live:
                break
            assert all(o.error is None for o in engine.step(live))
        got = [r.history[len(p):len(p) + n_new] for r, p in zip(running, prompts)]
    assert got == want
    assert running[0].n_drafted > 0


def mapped_pages(address: int, size: int) -> int:
    """Pages of [address, address + size) mapped into this process: bit 63 ("present") of each
    page's /proc/self/pagemap entry (resident memory of that range, whatever the page cache holds)."""
    page = os.sysconf("SC_PAGE_SIZE")
    first, last = address // page, (address + size - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = np.frombuffer(f.read((last - first + 1) * 8), dtype=np.uint64)
    return int((entries >> np.uint64(63)).sum())


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="needs Linux's /proc/self/pagemap")
def test_the_ngram_table_stays_on_disk_but_for_the_rows_a_prompt_reads(tmp_path):
    """A 61 MiB table, cold (dropped from the page cache): after a 20-token prompt only the pages of
    the 80 rows it hashes to are resident (measured 231 of 15,629 pages with the MADV_RANDOM advice
    Weights gives gathered weights; 1,277 without: readahead and fault-around map 16 pages per row)."""
    cfg = q4.config_with(ngram_vocab_size_base=250_000)
    path = q4.write_model(tmp_path / "bigtable.gguf", cfg)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)     # cold, as a table of tens of GB is
    finally:
        os.close(fd)
    toks = prompt(20, seed=7)
    with Model(path, n_ctx=64, kv_type="f32") as m:
        table = m.weights.tensors["per_layer_token_embd.weight"]
        address, size = int(table.contents.data), int(ggml.ggml_nbytes(table))
        assert table.contents.buffer == m.weights.buffer      # the file's mapping itself: never copied
        assert mapped_pages(address, size) == 0
        m.eval(toks)
        touched = mapped_pages(address, size)
        s = m.family.extras.ple
        context = np.stack([np.array([-1] * b + toks[:len(toks) - b]) for b in range(s.ngram_size)], axis=1)
        rows = ple.ngram_rows(context, s)
    pages = size // os.sysconf("SC_PAGE_SIZE")
    print(f"n-gram table: {touched} of {pages} pages resident after {rows.size} row reads")
    assert 0 < touched <= 4 * rows.size and touched < pages // 20


GV = gguf.GGUFValueType
BAD_FILES = [
    ({"drop_keys": ("qwen4exp.hyper_connection.count",)}, "hyper_connection.count' is missing"),
    ({"set_kv": {"qwen4exp.hyper_connection.count": (1, GV.UINT32)}}, "at least 2 streams"),
    ({"set_kv": {"qwen4exp.attention.compress_ratios": ([0, 0, 0], GV.ARRAY, GV.INT32)}}, "must list 4"),
    ({"set_kv": {"qwen4exp.attention.compress_ratios": ([4, 0, 0, 4], GV.ARRAY, GV.INT32)}}, "linear-attention layer"),
    ({"set_kv": {"qwen4exp.attention.indexer.top_k": (6, GV.UINT32)}}, "not a multiple of the block length"),
    ({"set_kv": {"qwen4exp.ple.layers": ([1, 2], GV.ARRAY, GV.INT32)}}, "one PLE layer is supported"),
    ({"set_kv": {"qwen4exp.ple.layers": ([3], GV.ARRAY, GV.INT32)}}, "must be a linear-attention layer"),
    ({"set_kv": {"qwen4exp.ple.head_vocab_sizes": ([1009, 1013], GV.ARRAY, GV.UINT64)}}, "must list 4"),
    ({"set_kv": {"qwen4exp.ple.head_offsets": ([0, 1009, 2022, 4000], GV.ARRAY, GV.UINT64)}}, "fewer than the n-gram"),
    ({"set_kv": {"qwen4exp.ple.eos_token_id": (99999, GV.UINT32)}}, "outside the vocabulary"),
    ({"set_kv": {"qwen4exp.nextn_predict_layers": (1, GV.UINT32)}}, "no MTP block"),
    ({"tensors": {"blk.3.indexer.k_proj.weight": None}}, "'blk.3.indexer.k_proj.weight' is missing"),
    ({"tensors": {"per_layer_token_embd.weight": None}}, "'per_layer_token_embd.weight' is missing"),
]


@pytest.mark.parametrize("edit,message", BAD_FILES)
def test_a_bad_file_is_one_clear_error(q4_path, tmp_path, edit, message):
    from test_loader_errors import assert_one_clear_error

    assert_one_clear_error(q4_path, tmp_path, edit, message)


@needs_llamacpp
def test_llamacpp_agrees_but_for_its_partial_blocks(tmp_path, hf):
    """llama.cpp 0.3.36's qwen4exp graph on the same file (every part on, an EOS in the prompt):
    while the indexer keeps every token (a budget above the context) it equals the reference and
    deltarun (PLE, hyper-connections, sigmoid output gate, MoE all agree; measured 3.4e-7). With
    selection, it agrees only at the queries whose incomplete tail holds r - 1 tokens: its token
    top-k is B + r - 1 wide, and a shorter tail leaves slots it fills with tokens of the next-best
    block, where transformers attends to whole blocks and the tail alone (measured up to 1.8e-2)."""
    toks = prompt(40, seed=1)
    toks[13] = EOS
    dense_cfg = q4.config_with(indexer_budget=256)
    dense_path = q4.write_model(tmp_path / "dense.gguf", dense_cfg)
    theirs, chosen = llamacpp.logits_and_greedy(dense_path, toks, 8, tmp_path)
    chosen = np.asarray(chosen)          # the greedy tokens, or the logits each was chosen from
    their_greedy = (chosen.argmax(axis=-1) if chosen.ndim == 2 else chosen).tolist()
    want = reference(dense_cfg).forward(toks)
    assert rel_err(theirs, want) < F32_TOL
    with Model(dense_path, n_ctx=128, kv_type="f32", repack=False) as m:
        assert rel_err(m.logits_for(toks), theirs) < F32_TOL
        m.reset()
        assert greedy(lambda t: m.eval([t]), m.eval(toks), 8) == their_greedy

    sparse_path = q4.write_model(tmp_path / "sparse.gguf", PRESET)
    theirs, _ = llamacpp.logits_and_greedy(sparse_path, toks, 1, tmp_path)
    want = reference(hf_w=hf).forward(toks)
    err = np.abs(theirs - want).max(axis=1) / np.abs(want).max()
    r = CFG.indexer_compress_ratio
    whole = np.array([(p + 1) % r == r - 1 for p in range(len(toks))])
    print(f"llama.cpp qwen4exp: {err[whole].max():.1e} where the tail is r - 1 tokens, "
          f"{err[~whole].max():.1e} elsewhere")
    assert err[whole].max() < F32_TOL
    assert err[:2 * r + 3].max() < F32_TOL            # no selection yet: every token
    assert err[~whole].max() > 1e-3                    # the partial blocks (tell us when llama.cpp changes)


# about 4x the measured median error per position against the reference on the file's dequantised
# weights (printed by the test; 2 vCPU x86-64, loaded): f16 2.2e-4, q8_0 6.3e-3, q4_k 6.4e-3, q6_k
# 6.0e-3 (the tiny rows are mostly below the k-quants' 256-block: those files are largely Q8_0).
QUANT_BOUND = {"f16": 1e-3, "q8_0": 2.5e-2, "q4_k": 2.5e-2, "q6_k": 2.5e-2}


@pytest.mark.parametrize("wtype", list(QUANT_BOUND))
def test_quantised_weights(tmp_path, wtype):
    """The graph on a quantised file (the PLE kernel and the table fall back to F16: rows of 4 and
    16) against the reference on that file's dequantised weights: what is left is ggml's rounding of
    activations for the quantised dot products."""
    path = q4.write_model(tmp_path / f"qwen4exp-{wtype}.gguf", PRESET, wtype)
    toks = long_prompt(40, seed=5)
    expected = reference(hf_w=hf_from_gguf(path)).forward(toks)
    with Model(path, n_ctx=128, kv_type="f32") as m:
        got = m.logits_for(toks)
    assert_quantised_close(got, expected, QUANT_BOUND[wtype], f"qwen4exp {wtype}")


def test_f16_kv_cache(q4_path, hf):
    """The default F16 cache rounds the keys, values and the indexer's raw keys (pooled from it):
    measured max 1.8e-5, median 9.9e-6 relative (40 tokens); every argmax kept."""
    toks = long_prompt(40, seed=5)
    expected = reference(hf_w=hf).forward(toks)
    with Model(q4_path, n_ctx=128, kv_type="f16") as m:
        got = m.logits_for(toks)
    assert_close_everywhere(got, expected, 4e-5, 1e-4, "qwen4exp f16 KV")


def test_make_tiny_and_the_fixture_write_the_family(tmp_path, tiny_model_path):
    """`make-tiny --preset tiny-qwen4exp` writes the generator's file (the same tensors as the tests'
    fixture, same seed), and `generate` greedy on it gives the engine's tokens."""
    from click.testing import CliRunner

    from deltarun.cli.main import cli
    from deltarun.runner.generation import generate_tokens

    out = tmp_path / "q.gguf"
    r = CliRunner().invoke(cli, ["make-tiny", str(out), "--preset", PRESET])
    assert r.exit_code == 0, r.output
    fixture = tiny_model_path(PRESET)
    a, b = gguf.GGUFReader(str(out)), gguf.GGUFReader(str(fixture))
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    assert all(np.array_equal(np.asarray(x.data), np.asarray(y.data)) for x, y in zip(a.tensors, b.tensors))
    r = CliRunner().invoke(cli, ["generate", str(out), "-p", "one two three", "-n", "6", "--temp", "0"])
    assert r.exit_code == 0, r.output
    with Model(fixture, n_ctx=64) as m:
        want = m.tokenizer.decode(list(generate_tokens(m, m.tokenizer.encode("one two three"), 6, Sampler(GREEDY))))
    assert r.stdout.startswith(want)


def test_an_image_is_one_clear_error_and_the_model_goes_on(q4_path):
    """An image (rows given as embeddings) has no token ids to hash: refused, the sequence intact."""
    from deltarun.base.errors import UnsupportedModelError

    with Model(q4_path, n_ctx=64, kv_type="f32") as m:
        before = m.eval(prompt(5))
        with pytest.raises(UnsupportedModelError, match="need token ids"):
            m.eval_image(np.zeros((4, CFG.hidden_size), np.float32), (2, 2), 5)
        assert m.tokens(0) == prompt(5)
        m.reset()
        np.testing.assert_array_equal(m.eval(prompt(5)), before)


@pytest.mark.parametrize("ngram_size", [2, 3, 5])
def test_the_graphs_ngram_rows_equal_transformers_form(ngram_size):
    """The graph's host hash (graphs/blocks/ple.py: predecessors cut at the first EOS or the start,
    uint64 arithmetic) against the reference's (transformers' `_shift_right_ignore_eos` over the
    cached context, Python integers), on streams dense with EOS, in chunks of every size."""
    cfg = q4.config_with(ngram_size=ngram_size, heads_per_ngram=3, ple_embed_dim=12 * (ngram_size - 1) * 3)
    sizes, multipliers = q4.head_vocab_sizes(cfg, 2), q4.layer_multipliers(cfg, VOCAB.n_vocab, 2)
    offsets = list(np.concatenate([[0], np.cumsum(sizes)[:-1]]))
    shape = ple.PleShape(layer=1, ngram_size=ngram_size, heads_per_ngram=3, conv_kernel=4, eos=EOS, row_dim=12,
                         multipliers=tuple(multipliers), offsets=tuple(int(o) for o in offsets), sizes=tuple(sizes))
    rng = np.random.default_rng(ngram_size)
    stream = [int(t) for t in rng.integers(0, VOCAB.n_vocab, 60)]
    for i in rng.choice(60, 15, replace=False):
        stream[i] = EOS
    stream[20:23] = [EOS, EOS, EOS]
    back = ngram_size - 1
    context, start = [EOS] * back, 0
    for size in (1, 2, 7, 1, 3, 20, 26):
        chunk = stream[start:start + size]
        want = ngram_rows(context, chunk, multipliers, sizes, offsets, 3, EOS)
        history = np.array([-1] * back + stream[:start + size], dtype=np.int64)
        cols = np.stack([history[back + start - b: back + start - b + size] for b in range(ngram_size)], axis=1)
        np.testing.assert_array_equal(ple.ngram_rows(cols, shape), want)
        context = (context + chunk)[-back:]
        start += size


def test_inspect_names_the_new_parts_and_counts_their_memory(q4_path):
    """`deltarun inspect`: the hyper-connections, the indexer and the PLE layer; the KV cache with
    the indexer keys in the K rows (64 + 16 + 64 values per position, F16), the recurrent state
    with the PLE history (9 rows x 256 channels)."""
    from click.testing import CliRunner

    from deltarun.cli.main import cli

    r = CliRunner().invoke(cli, ["inspect", str(q4_path), "--ctx", "1024"])
    assert r.exit_code == 0, r.output
    assert "hyper-connections  4 streams, rank 16" in r.output
    assert "QSA indexer        layers 3: 4 heads of 16, the best 2 blocks of 4 tokens" in r.output
    assert "PLE n-grams        layer 1: orders 2..3, 4 heads of 16, 4,096 table rows" in r.output
    r = CliRunner().invoke(cli, ["inspect", str(q4_path), "--ctx", "1024", "--json"])
    memory = json.loads(r.output)["memory"]
    assert memory["kv_cache"] == (64 + 16 + 64) * 1024 * 2
    conv, ssm, ple_history = 3 * (2 * 32 + 64), 4 * 16 * 16, 9 * 256
    assert memory["recurrent_state"] == (3 * (conv + ssm) + ple_history) * 4


def test_a_checkpoint_restores_for_the_next_turn(q4_path):
    """Chat's prompt reuse: after a turn runs on past a checkpoint (more than the rollback slots
    hold), restoring it and evaluating another continuation equals evaluating from scratch (the
    stale K rows past it, indexer keys included, are masked; the PLE history and the n-gram
    context come back with the state and the tokens)."""
    turn, answer, other = long_prompt(21, seed=8), prompt(9, seed=9), prompt(6, seed=10)
    with Model(q4_path, n_ctx=128, kv_type="f32", rs_slots=2) as m:
        m.eval(turn)
        cp = m.checkpoint()
        m.eval(answer)
        m.restore(cp)
        resumed = m.eval(other, all_logits=True)
        fresh = m.logits_for(turn + other)[-len(other):]
    assert rel_err(resumed, fresh) < F32_TOL
