"""The training script (models/train) and the built-in model against a live torch model.

Needs the optional `train` extra (torch, tokenizers): skipped without it (CI does not install it).
The smoke run trains a small config for a few steps on two works; it needs the corpus archive
(fetched with pip into ~/.cache/deltarun/corpus once) and is skipped when that cannot be had.
Bounds: deltarun F32 against torch in float64 uses test_forward.py's F32 bound (1e-5 of the logit
range); the shipped Q8_0 file against torch on its dequantised weights the quantised bounds.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is in the optional `train` extra (pip install -e .[train])")
pytest.importorskip("tokenizers", reason="HF tokenizers is in the optional `train` extra (pip install -e .[train])")

from deltarun.base.gguf_file import GGUFFile  # noqa: E402
from deltarun.model_files import generate as gen  # noqa: E402
from deltarun.model_files.generate import ModelConfig, write_gguf  # noqa: E402
from deltarun.model_files.vocab import TinyVocab  # noqa: E402
from deltarun.runner.model import Model  # noqa: E402

from reference import load_gguf_weights  # noqa: E402
from test_trained_model import DATA, quantised_close  # noqa: E402

F32_TOL = 1e-5
SMOKE_CFG = ModelConfig(n_embd=64, n_layer=4, n_head=2, n_head_kv=1, head_dim=32, n_rot=16, ssm_d_state=16,
                        ssm_n_k_heads=2, ssm_n_v_heads=4, n_expert=4, n_expert_used=2, n_ff_exp=32, n_ff_shexp=64,
                        n_ctx_train=64, rope_freq_base=10_000.0, n_mtp=1)


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def torch_model(cfg: ModelConfig, tensors: dict[str, np.ndarray], n_vocab: int):
    """A float64 torch model holding `tensors` (GGUF names)."""
    from deltarun.model_files.train.net import Qwen3NextLM

    m = Qwen3NextLM(cfg, n_vocab)
    m.load_gguf_tensors({k: np.asarray(v, np.float32) for k, v in tensors.items()})
    return m.double().eval()


def vocab_of(path: Path) -> TinyVocab:
    f = GGUFFile(path)
    eos = int(f.get("tokenizer.ggml.eos_token_id"))
    return TinyVocab(tokens=tuple(f.get("tokenizer.ggml.tokens")), token_types=tuple(f.get("tokenizer.ggml.token_type")),
                     merges=tuple(f.get("tokenizer.ggml.merges")), bos_id=eos, eos_id=eos, pad_id=eos)


@torch.no_grad()
def torch_logits(model, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Trunk logits and MTP logits (rows (hidden_i, token_{i+1})) in float64."""
    x = torch.tensor([tokens])
    logits, hidden, _ = model(x)
    mtp, _ = model.mtp(hidden[:, :-1], x[:, 1:])
    return logits[0].numpy(), mtp[0].numpy()


def deltarun_logits(path: Path, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    with Model(path, n_ctx=256, n_threads=1, kv_type="f32", mtp=True) as m:
        logits = m.eval(tokens, all_logits=True)
        mtp, _ = m.mtp_eval(tokens[1:], m.last_hidden[0][:-1], 0)
    return logits, mtp


def test_chunked_delta_rule_equals_the_recurrence():
    from deltarun.model_files.train.net import chunk_gated_delta_rule, l2_norm, recurrent_gated_delta_rule

    g = torch.Generator().manual_seed(0)
    B, T, H, S = 2, 75, 4, 16      # 75: a partial last chunk
    q = l2_norm(torch.randn(B, T, H, S, generator=g, dtype=torch.float64), 1e-6) / S ** 0.5
    k = l2_norm(torch.randn(B, T, H, S, generator=g, dtype=torch.float64), 1e-6)
    v = torch.randn(B, T, H, S, generator=g, dtype=torch.float64)
    decay = -torch.rand(B, T, H, generator=g, dtype=torch.float64)
    beta = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    a = recurrent_gated_delta_rule(q, k, v, decay, beta)
    b = chunk_gated_delta_rule(q, k, v, decay, beta)
    assert float((a - b).abs().max()) < 1e-12


@pytest.fixture(scope="module")
def corpus_cache() -> Path:
    from deltarun.model_files.train.corpus import fetch_archive

    cache = Path.home() / ".cache" / "deltarun" / "corpus"
    try:
        fetch_archive(cache)
    except Exception as e:  # no registry reachable: nothing to train on
        pytest.skip(f"the corpus archive cannot be fetched: {e}")
    return cache


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory, corpus_cache) -> tuple[Path, dict]:
    from deltarun.model_files.train.run import Recipe, train

    out = tmp_path_factory.mktemp("smoke")
    summary = train(Recipe(steps=4, batch=2, seq=64, warmup=1), out, corpus_cache, checkpoint_every=2, log_every=1,
                    eval_ctx=64, name="smoke", max_works=2, cfg=SMOKE_CFG, n_vocab=400, max_eval_tokens=640)
    return out, summary


def test_smoke_training_runs_every_stage(smoke_run):
    out, summary = smoke_run
    assert [row["step"] for row in summary["log"]] == [1, 2, 3, 4]
    assert all(np.isfinite(row["ce"]) and np.isfinite(row["mtp_ce"]) for row in summary["log"])
    assert summary["n_vocab"] == 400 and 1 < summary["held_out"]["ppl"] < 400
    for wtype in ("f32", "q8_0"):
        assert GGUFFile(out / f"smoke-{wtype}.gguf").get("qwen3next.nextn_predict_layers") == 1


def test_smoke_training_is_deterministic_and_resumable(smoke_run, corpus_cache, tmp_path):
    """Resuming from the step-2 checkpoint ends on exactly the weights of the unbroken run."""
    from deltarun.model_files.train.run import Recipe, train

    out, _ = smoke_run
    shutil.copy(out / "checkpoint.pt", tmp_path / "checkpoint.pt")
    train(Recipe(steps=4, batch=2, seq=64, warmup=1), tmp_path, corpus_cache, resume=True, checkpoint_every=2,
          eval_ctx=64, name="smoke", max_works=2, cfg=SMOKE_CFG, n_vocab=400, max_eval_tokens=640)
    a, b = torch.load(out / "model.pt"), torch.load(tmp_path / "model.pt")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_smoke_export_matches_torch_at_f32(smoke_run, corpus_cache):
    from deltarun.model_files.train.corpus import HELD_OUT, load_corpus

    out, _ = smoke_run
    path = out / "smoke-f32.gguf"
    weights, _ = load_gguf_weights(path)
    model = torch_model(SMOKE_CFG, weights, len(vocab_of(path).tokens))
    text = load_corpus(corpus_cache).held_out[HELD_OUT[1]][:2000]
    with Model(path, n_ctx=64, n_threads=1) as m:
        toks = m.tokenizer.encode(text)[:48]
    want, want_mtp = torch_logits(model, toks)
    got, got_mtp = deltarun_logits(path, toks)
    assert rel_err(got, want) < F32_TOL
    assert rel_err(got_mtp, want_mtp) < F32_TOL


def test_builtin_model_matches_torch_at_f32_and_q8_0(tmp_path):
    """Torch on the shipped file's dequantised weights; deltarun on an F32 export of those weights
    (F32 bound) and on the shipped Q8_0 file itself (quantised bounds)."""
    from deltarun.model_files.train.run import MODEL

    shipped = gen.ensure_default_model()
    weights, _ = load_gguf_weights(shipped)
    vocab = vocab_of(shipped)
    model = torch_model(MODEL, weights, len(vocab.tokens))
    f32 = write_gguf(tmp_path / "builtin-f32.gguf", MODEL, {k: v.astype(np.float32) for k, v in weights.items()},
                     vocab, "f32", "builtin f32")
    with np.load(DATA / "torch_reference.npz") as z:
        toks = z["tokens"][:64].tolist()
    want, want_mtp = torch_logits(model, toks)
    got, got_mtp = deltarun_logits(f32, toks)
    assert rel_err(got, want) < F32_TOL and rel_err(got_mtp, want_mtp) < F32_TOL
    got_q, got_q_mtp = deltarun_logits(shipped, toks)
    quantised_close(got_q, want)
    quantised_close(got_q_mtp, want_mtp)


def test_hf_tokenizer_of_the_builtin_vocab_encodes_like_deltarun():
    """An HF tokenizer rebuilt from the shipped vocabulary and merges (qwen2 regex, byte level)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    from deltarun.base.tokenizer import PRE_TOKENIZER_PATTERNS

    shipped = gen.ensure_default_model()
    vocab = vocab_of(shipped)
    normal = {t: i for i, (t, ty) in enumerate(zip(vocab.tokens, vocab.token_types)) if ty == 1}
    hf = Tokenizer(models.BPE(normal, [tuple(m.split(" ")) for m in vocab.merges]))
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRE_TOKENIZER_PATTERNS["qwen2"]), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    hf.decoder = decoders.ByteLevel()
    hf.add_tokens([AddedToken(t, special=ty == 3, normalized=False)
                   for t, ty in zip(vocab.tokens, vocab.token_types) if ty != 1])
    texts = [(DATA / "heldout.txt").read_text(),
             "Numbers 1234567 and 3.14; tabs\tand   spaces  \n\n\n end",
             "Unicode: naïve café — “quoted” ünïcödé 日本語 😀",
             "<|im_start|>user\nWhat's the hour?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nThou'rt late.",
             "I'LL SAY IT'S they've we'd YOU'RE"]
    with Model(shipped, n_ctx=64, n_threads=1) as m:
        for text in texts:
            assert m.tokenizer.encode(text) == hf.encode(text).ids, text
