"""The kimi-linear graph (KDA + MLA + MoE) against the float64 reference built from HF-order weights.

The reference (tests/reference_kimi.py) never sees the GGUF layout: it runs on
`kimi_linear.hf_weights()` with uncompressed MLA, the per-token KDA recurrence and per-expert
weights, so the converter's kv_b split and transpose, `-exp(A_log)`, the stacked experts and the
graph's absorbed MLA over latent cache rows are all checked by comparing logits.

Tolerances (tiny preset, 2 vCPU x86-64 shared with other sessions): F32 weights and KV cache bound
1e-5 on max |ggml - ref| / max |ref| (measured: printed by the test, 2.8e-7 on 40 tokens).
"""

from __future__ import annotations

import numpy as np
import pytest

from deltarun.base.errors import UnsupportedModelError
from deltarun.model_files import kimi_linear as kl
from deltarun.model_files.vocab import vocab_named
from deltarun.runner.model import Model
from reference_kimi import KimiReference

F32_TOL = 1e-5
PRESET = "tiny-kimi-linear"
CFG = kl.PRESETS[PRESET]


def rel_err(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def prompt(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 2300, n)]


@pytest.fixture(scope="module")
def kimi_path(tmp_path_factory):
    return kl.write_model(tmp_path_factory.mktemp("kimi") / "tiny-kimi-linear-f32.gguf", PRESET)


@pytest.fixture()
def reference() -> KimiReference:
    return KimiReference(CFG, kl.hf_weights(CFG, vocab_named(CFG.vocab).n_vocab, 0))


def greedy(step, first_logits, n: int) -> list[int]:
    out, logits = [], first_logits
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = step(out[-1])
    return out


def test_the_file_has_llama_cpp_layout(kimi_path):
    """The loader's shapes (src/models/kimi-linear.cpp) and the layer pattern from head_count_kv."""
    with Model(kimi_path, n_ctx=64, kv_type="f32") as m:
        hp, f = m.hp, m.family.file
        assert hp.recurrent == (True, False, True, False)
        H, d = CFG.num_attention_heads, CFG.kda_head_dim
        assert f.tensors["blk.0.ssm_conv1d_q.weight"].ne[:3] == (CFG.short_conv_kernel_size, 1, H * d)
        assert f.tensors["blk.1.attn_k_b.weight"].ne == (CFG.qk_nope_head_dim, CFG.kv_lora_rank, H)
        assert f.tensors["blk.1.attn_v_b.weight"].ne == (CFG.kv_lora_rank, CFG.v_head_dim, H)
        assert f.tensors["blk.3.ffn_gate_exps.weight"].ne == (CFG.hidden_size, CFG.moe_intermediate_size,
                                                             CFG.num_experts)
        # the MLA cache row is the latent [c | k_pe], one KV head: what llama.cpp caches per token
        assert m.memory.k[1].contents.ne[0] == CFG.kv_lora_rank + CFG.qk_rope_head_dim


def test_f32_logits_and_greedy_match_reference(kimi_path, reference):
    toks = prompt(80, seed=1)
    expected = reference.forward(toks)
    with Model(kimi_path, n_ctx=256, kv_type="f32", n_batch=32) as m:   # three ubatches: the caches carry over
        got = m.logits_for(toks)
        print(f"kimi-linear f32: {rel_err(got, expected):.2e}")
        assert rel_err(got, expected) < F32_TOL
        assert (got.argmax(1) == expected.argmax(1)).all()
        m.reset()
        mine = greedy(lambda t: m.eval([t]), m.eval(toks[:20]), 12)
    reference.reset()
    theirs = greedy(lambda t: reference.forward([t])[-1], reference.forward(toks[:20])[-1], 12)
    assert mine == theirs


def test_recurrent_states_match_reference(kimi_path, reference):
    """Conv windows (channels q|k|v) and KDA states [H, d_k, d_v] are the reference's."""
    toks = prompt(9, seed=3)
    reference.forward(toks)
    with Model(kimi_path, n_ctx=64, kv_type="f32", rs_slots=1) as m:
        m.eval(toks)
        for il in m.hp.linear_layers:
            conv = np.concatenate([reference.conv[il][x] for x in "qkv"], axis=1)
            np.testing.assert_allclose(m.memory.conv_slots(il)[0], conv, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(m.memory.ssm_slots(il)[0], reference.ssm[il], rtol=1e-4, atol=1e-5)


def test_two_sequences_in_one_ubatch_match_reference(kimi_path, reference):
    a, b = prompt(6, seed=4), prompt(6, seed=5)
    want_a = reference.forward(a)[-1]
    reference.reset()
    want_b = reference.forward(b)[-1]
    with Model(kimi_path, n_ctx=64, kv_type="f32", n_seq_max=2) as m:
        got = m.eval_batch({0: a, 1: b})
    assert rel_err(got[0], want_a) < F32_TOL
    assert rel_err(got[1], want_b) < F32_TOL


@pytest.mark.parametrize("n_block,n_back", [(5, 3), (3, 3), (3, 1)])   # (3, 3): the whole ubatch
def test_rollback_equals_recomputation(kimi_path, n_block, n_back):
    first, block, cont = prompt(7, seed=10), prompt(n_block, seed=11), prompt(4, seed=12)
    with Model(kimi_path, n_ctx=128, kv_type="f32", rs_slots=4) as m:
        m.eval(first)
        m.eval(block)
        m.rollback(n_back)
        after = m.eval(cont, all_logits=True)
        fresh = m.logits_for(first + block[:n_block - n_back] + cont)[-len(cont):]
    assert rel_err(after, fresh) < F32_TOL


def test_a_restored_capture_continues_as_the_unbroken_sequence(kimi_path):
    toks = prompt(60, seed=2)
    with Model(kimi_path, n_ctx=128, n_batch=64, kv_type="f32", capture_slots=2, n_seq_max=2) as m:
        m.eval(toks[:40], seq=0, captures=[13, 29])
        m.memory.write_recurrent(1, m.last_captures[29])
        m.memory.write_kv(1, m.memory.read_kv(0, 29), 29)
        m.memory.set_tokens(1, toks[:29])
        resumed = m.eval(toks[29:60], seq=1, all_logits=True)
        m.reset()
        unbroken = m.eval(toks[:60], seq=0, all_logits=True)[29:]
    assert rel_err(resumed, unbroken) < F32_TOL


def test_the_primitive_delta_rule_says_it_has_no_per_channel_gate(kimi_path):
    with pytest.raises(UnsupportedModelError, match="per-channel gate"):
        Model(kimi_path, n_ctx=64, delta_net="primitive")
