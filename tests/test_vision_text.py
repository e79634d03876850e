"""The text model after an image: image rows in place of the pad tokens, IMRoPE streams for image
tokens and text continuing as transformers' `get_rope_index` does, against the float64 references
(tests/reference_qwen35.py with tests/reference_vision.py), from real image files to greedy tokens."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from deltarun.model_files import qwen35, qwen35_vision as qv
from deltarun.model_files.vocab import vocab_named
from deltarun.runner import images
from deltarun.runner.model import Model
from deltarun.runner.vision import VisionEncoder

import reference_vision as rv
from reference_qwen35 import Qwen35Reference

TEXT = "tiny-qwen35"
#: the F32 text-forward bound of tests/test_qwen35_forward.py
BOUND = 1e-5


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("vlm")
    text, mmproj = qv.write_vlm(folder, TEXT)
    cfg = qwen35.PRESETS[TEXT]
    vcfg = qv.vision_for(cfg)
    hf_text = qwen35.hf_weights(cfg, vocab_named(cfg.vocab).n_vocab, 0)
    return text, mmproj, cfg, vcfg, hf_text, qv.hf_weights(vcfg, 0), folder


def _image_file(folder: Path, w: int = 96, h: int = 40) -> Path:
    """A real JPEG: a gradient with a square, wider than tall (a merged grid that is not square)."""
    y, x = np.mgrid[0:h, 0:w]
    arr = np.stack([x * 255 // w, y * 255 // h, (x + y) % 256], axis=-1).astype(np.uint8)
    arr[h // 4: h // 2, w // 4: w // 2] = (250, 10, 10)
    path = folder / "picture.jpg"
    Image.fromarray(arr).save(path, format="JPEG", quality=92)
    return path


def _prompt(tok, n_image: int) -> tuple[list[int], list[int], int]:
    """Tokens before the image rows (ending with <|vision_start|>), after them, and the pad id."""
    (vs,), (ve,), (pad,) = (tok.encode(t) for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>"))
    before = tok.encode("Look at this:") + [vs]
    after = [ve] + tok.encode(" what is it?")
    return before, after, pad


def test_logits_and_greedy_tokens_after_an_image(vlm) -> None:
    text, mmproj, cfg, vcfg, hf_text, hf_vision, folder = vlm
    MIN = 64 * 64   # small bounds keep the tiny test fast; the resize path still runs (96 x 40 -> 96 x 64)
    with Model(text, n_ctx=256, n_ubatch=16, kv_type="f32") as model, \
            VisionEncoder(mmproj, backend=model.backend) as enc:
        enc.check_text_model(model.hp.n_embd, model.family.arch)
        prep = images.load_image(_image_file(folder), enc.hp, min_pixels=MIN, max_pixels=64 * 128)
        rows_hw = prep.merged_hw
        assert rows_hw[0] != rows_hw[1]             # text after it moves by max(h, w), not by n
        emb = enc.encode(prep)
        ref_emb, grid = rv.vision_forward(hf_vision, vcfg, prep.pixels)
        assert np.abs(emb - ref_emb).max() / np.abs(ref_emb).max() < 1e-5

        tok = model.tokenizer
        before, after, pad = _prompt(tok, prep.n_tokens)
        model.eval(before)
        model.eval_image(emb, rows_hw, pad)
        logits = model.eval(after, all_logits=True)
        tokens = before + [pad] * prep.n_tokens + after

        ref = Qwen35Reference(cfg, hf_text)
        positions, delta = rv.rope_positions(tokens, pad, [grid])
        assert delta == max(rows_hw) - prep.n_tokens
        rows = np.full((len(tokens), cfg.hidden_size), np.nan)
        rows[len(before): len(before) + prep.n_tokens] = ref_emb
        ref_logits = ref.forward(tokens, embeddings=rows, positions=positions)[-len(after):]
        err = np.abs(logits - ref_logits).max() / np.abs(ref_logits).max()
        assert err < BOUND, err

        # greedy continuation, each new token at cache position + delta on all three streams
        ours, theirs = [], []
        nxt = int(np.argmax(logits[-1]))
        ref_nxt = int(np.argmax(ref_logits[-1]))
        for _ in range(8):
            ours.append(nxt)
            theirs.append(ref_nxt)
            nxt = int(np.argmax(model.eval([nxt])))
            pos = ref.n_past + delta
            ref_nxt = int(np.argmax(ref.forward([ref_nxt], positions=[(pos, pos, pos)])[-1]))
        assert ours == theirs

        # the positions matter: continuing the text at +n (not +max(h, w)) gives other logits
        other = Qwen35Reference(cfg, hf_text)
        plain = positions[:len(before) + prep.n_tokens] + [
            (p, p, p) for p in range(len(before) + prep.n_tokens, len(tokens))]
        off = other.forward(tokens, embeddings=rows, positions=plain)[-len(after):]
        assert np.abs(off - ref_logits).max() / np.abs(ref_logits).max() > 100 * BOUND


def test_image_rows_split_over_ubatches_and_rollback(vlm) -> None:
    """An image longer than a ubatch; after rolling back into the image, its shift is gone."""
    text, mmproj, cfg, vcfg, hf_text, hf_vision, folder = vlm
    with Model(text, n_ctx=256, n_ubatch=4, kv_type="f32", rs_slots=4) as model, \
            VisionEncoder(mmproj, backend=model.backend) as enc:
        prep = images.load_image(_image_file(folder), enc.hp, min_pixels=64 * 64, max_pixels=64 * 128)
        emb = enc.encode(prep)
        before, after, pad = _prompt(model.tokenizer, prep.n_tokens)
        model.eval(before)
        model.eval_image(emb, prep.merged_hw, pad)
        assert [s.n for s in model.images()] == [prep.n_tokens]
        logits = model.eval(after)
        tokens = before + [pad] * prep.n_tokens + after
        ref = Qwen35Reference(cfg, hf_text)
        positions, _ = rv.rope_positions(tokens, pad, [(1,) + tuple(2 * v for v in prep.merged_hw)])
        rows = np.full((len(tokens), cfg.hidden_size), np.nan)
        rows[len(before): len(before) + prep.n_tokens] = rv.vision_forward(hf_vision, vcfg, prep.pixels)[0]
        ref_logits = ref.forward(tokens, embeddings=rows, positions=positions)[-1]
        assert np.abs(logits - ref_logits).max() / np.abs(ref_logits).max() < BOUND
        model.reset()
        assert model.images() == []


def test_image_refused_by_a_model_without_multisection_rope(tiny_model_path) -> None:
    from deltarun.base.errors import DeltarunError
    with Model(tiny_model_path("tiny", "f32"), n_ctx=64) as model:
        with pytest.raises(DeltarunError, match="multi-section rope"):
            model.eval_image(np.zeros((4, model.hp.n_embd), dtype=np.float32), (2, 2), 0)
