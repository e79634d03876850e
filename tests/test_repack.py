"""Weights in ggml's CPU_REPACK buffer type (`Model(repack=True)`, the default; `--no-repack`).

On x86 ggml lays Q4_0, Q4_K and IQ4_NL matrices out for its interleaved AVX2 kernels (on ARM also
Q8_0 and more): the products then run different kernels, so they are checked against the numpy
reference like every quantised type (test_forward's tolerances) and against the same file read as
it is. The token embeddings (read by get_rows) and types without such kernels stay mapped. By
default Q4_K stays mapped too where ggml 0.25's tiled K-quant product runs (it takes only weights
that are not repacked); `repack="all"` repacks it, as llama.cpp does.
"""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from deltarun.cli.main import cli
from deltarun.runner.model import Model
from deltarun.base.errors import DeltarunError
from deltarun.runner.repack import cpu_repack_buffer_type, tiled_kquant_product

from test_forward import MEASURED_MEDIAN, greedy_continuation, prompt, reference_greedy, reference_of  # noqa: F401

if cpu_repack_buffer_type() is None:   # pragma: no cover - every ggml-python build here has it
    pytest.skip("this ggml build has no CPU_REPACK buffer type", allow_module_level=True)


def _matrices(m: Model) -> set[str]:
    """The 2-D and 3-D weights the graphs multiply by (what repacking may take)."""
    return {n for n, t in m.weights.tensors.items()
            if t.contents.ne[1] > 1 and n not in m.family.gathered_weights()
            and not n.endswith(("ssm_conv1d.weight", "ffn_gate_inp.weight"))}


@pytest.mark.parametrize("wtype", ["q4_0", "q4_k"])
def test_repacked_weights_against_the_reference(tiny_model_path, reference_of, wtype):
    """The bounds of test_forward.test_quantized_weights, with every matrix repacked."""
    toks = prompt(40, seed=5)
    ref = reference_of("tiny", wtype)
    ref.reset()
    expected = ref.forward(toks)
    with Model(tiny_model_path("tiny", wtype), n_ctx=256, kv_type="f32", repack="all") as m:
        # all but the LM head, whose 2,330 rows are not a whole number of 8-row interleaves
        assert set(m.weights.repacked) == _matrices(m) - {"output.weight"}
        got = m.logits_for(toks)
        greedy = greedy_continuation(m, toks[:16], 10)
    scale = np.abs(expected).max()
    per_pos = np.abs(got - expected).max(axis=1) / scale
    assert np.median(per_pos) < 2 * MEASURED_MEDIAN[wtype]
    assert (per_pos < 3 * MEASURED_MEDIAN[wtype]).mean() >= 0.95
    assert greedy == reference_greedy(ref, toks[:16], 10)


@pytest.mark.parametrize("wtype", ["q4_0", "q4_k"])
def test_repacked_and_mapped_weights_agree(tiny_model_path, wtype):
    """The same file with and without repacking. The interleaved kernels quantise the activations
    in their own blocks and sum in another order: measured per-position differences (max over the
    vocabulary / max |logit|, 70-token prompts, seeds 8-10) median 0-5.1e-3, 95th percentile
    4e-7-1.1e-2, the size of the activations' rounding itself (test_forward's MEASURED_MEDIAN).
    Bounds: each type's measured median vs the reference for the median position, twice it for
    95 % of positions, the same argmax wherever the top-2 margin is clear; a batch of sequences
    alike."""
    path = tiny_model_path("tiny", wtype)
    toks = prompt(70, seed=8)
    out = {}
    for repack in ("all", False):
        with Model(path, n_ctx=256, kv_type="f32", n_seq_max=3, repack=repack) as m:
            assert bool(m.weights.repacked) == bool(repack)
            batch = m.eval_batch({s: toks[10 * s:10 * s + 20] for s in range(3)}, all_logits=True)
            m.reset()
            out[repack] = (m.logits_for(toks), np.concatenate([batch[s] for s in range(3)]))
    for a, b in zip(out["all"], out[False]):
        scale = np.abs(b).max()
        per_pos = np.abs(a - b).max(axis=1) / scale
        assert np.median(per_pos) < MEASURED_MEDIAN[wtype]
        assert (per_pos < 2 * MEASURED_MEDIAN[wtype]).mean() >= 0.95
        top2 = np.sort(b, axis=1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) / scale > 0.1
        assert clear.sum() >= 5 and (a.argmax(1) == b.argmax(1))[clear].all()


def test_gathered_and_unsupported_weights_stay_mapped(tiny_model_path):
    """A tied LM head is the token embedding: read by get_rows, so never repacked; F32 and Q8_0
    (no x86 interleaved kernel in this ggml) stay mapped whatever is asked."""
    with Model(tiny_model_path("tiny-tied", "q4_k"), n_ctx=64, repack="all") as m:
        assert "token_embd.weight" not in m.weights.repacked and m.weights.repacked
        assert "output.weight" not in m.weights.tensors
    with Model(tiny_model_path("tiny", "f32"), n_ctx=64) as m:
        assert m.weights.repacked == []


def test_q4_k_stays_mapped_where_the_tiled_product_runs(tiny_model_path, monkeypatch):
    """The default repacks Q4_0 but not Q4_K where ggml's tiled K-quant product takes it (prompts
    1.41x the repacked GEMM's speed on Q4_K_M, decoding the same: bench/RESULTS.md); with the
    tiled product switched off (GGML_CPU_TILED_MM=0, ggml's own switch) Q4_K is repacked again."""
    if not tiled_kquant_product():   # pragma: no cover - ggml 0.15.3, or a CPU without AVX2
        pytest.skip("this ggml build has no tiled K-quant product")
    with Model(tiny_model_path("tiny", "q4_k"), n_ctx=64) as m:
        assert m.weights.repacked == []
    with Model(tiny_model_path("tiny", "q4_0"), n_ctx=64) as m:
        assert m.weights.repacked
    monkeypatch.setenv("GGML_CPU_TILED_MM", "0")
    with Model(tiny_model_path("tiny", "q4_k"), n_ctx=64) as m:
        assert set(m.weights.repacked) == _matrices(m) - {"output.weight"}


def test_unknown_repack_mode(tiny_model_path):
    with pytest.raises(DeltarunError, match="unknown repack mode 'some'"):
        Model(tiny_model_path("tiny", "q4_0"), n_ctx=64, repack="some")


def test_no_repack_option(tiny_model_path):
    """`--no-repack` reads the file as it is; both give the same greedy text."""
    path = str(tiny_model_path("tiny", "q4_0"))
    runs = [CliRunner().invoke(cli, ["generate", path, "-p", "Hello", "-n", "8", "--temp", "0", *flag])
            for flag in ([], ["--no-repack"])]
    assert all(r.exit_code == 0 for r in runs), [r.output for r in runs]
    assert runs[0].stdout == runs[1].stdout


def test_batched_head_matrices_stay_mapped(tiny_model_path):
    """MLA's per-head `attn_k_b` / `attn_v_b` (kimi-linear) are 3-D weights of a batched MUL_MAT,
    which the repack kernels do not take: probed as experts (MUL_MAT_ID) they were repacked, and
    ggml aborted at the first graph (no backend for the node). Stacked experts are still repacked.
    kv_lora_rank 256 makes `attn_v_b`'s rows whole Q4_0 blocks (the tiny preset's 32 fall back to
    Q8_0, which has no x86 repack kernel). Repacked against mapped: median per-position difference
    measured 9.8e-3 (the interleaved kernels' own activation rounding, as above, on a model whose
    MoE layers amplify it); bound twice qwen3next's measured Q4_0 median."""
    path = tiny_model_path("tiny-kimi-linear", "q4_0", kv_lora_rank=256)
    toks = prompt(20, seed=3)
    out = {}
    for repack in (True, False):
        with Model(path, n_ctx=64, kv_type="f32", repack=repack) as m:
            if repack:
                assert "blk.1.attn_v_b.weight" in m.weights.tensors
                assert not [n for n in m.weights.repacked if n.endswith(("attn_k_b.weight", "attn_v_b.weight"))]
                assert "blk.1.ffn_up_exps.weight" in m.weights.repacked
            out[repack] = m.logits_for(toks)
    scale = np.abs(out[False]).max()
    per_pos = np.abs(out[True] - out[False]).max(axis=1) / scale
    assert np.median(per_pos) < 2 * MEASURED_MEDIAN["q4_0"]
