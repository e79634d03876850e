"""`deltarun generate --mmproj FILE --image FILE`: a real image file through the whole path (decode,
processor resize, vision tower, placement, IMRoPE streams, decoding), greedy text equal to the
float64 references', and one clear error for each bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from deltarun.cli.main import cli
from deltarun.model_files import qwen35, qwen35_vision as qv
from deltarun.model_files.vocab import vocab_named
from deltarun.runner import images
from deltarun.runner.model import Model
from deltarun.runner.vision import VisionEncoder

import reference_vision as rv
from reference_qwen35 import Qwen35Reference


def run(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("vlm-cli")
    text, mmproj = qv.write_vlm(folder, "tiny-qwen35")
    rng = np.random.default_rng(7)
    arr = (rng.uniform(0, 1, (50, 90, 3)) * np.linspace(0, 255, 90)[None, :, None]).astype(np.uint8)
    picture = folder / "picture.webp"
    Image.fromarray(arr).save(picture, format="WEBP", quality=90)
    return text, mmproj, picture, folder


def _reference_greedy(text_path: Path, mmproj: Path, picture: Path, prompt_after: str, n: int) -> list[int]:
    """Greedy tokens of the references for [image] + prompt_after (the image before the text)."""
    cfg = qwen35.PRESETS["tiny-qwen35"]
    vcfg = qv.vision_for(cfg)
    with VisionEncoder(mmproj) as enc, Model(text_path, n_ctx=64) as m:
        prep = images.load_image(picture, enc.hp)
        tok = m.tokenizer
    (vs,), (pad,), (ve,) = (tok.encode(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>"))
    emb, grid = rv.vision_forward(qv.hf_weights(vcfg, 0), vcfg, prep.pixels)
    tokens = [vs] + [pad] * prep.n_tokens + [ve] + tok.encode(prompt_after)
    positions, delta = rv.rope_positions(tokens, pad, [grid])
    rows = np.full((len(tokens), cfg.hidden_size), np.nan)
    rows[1:1 + prep.n_tokens] = emb
    ref = Qwen35Reference(cfg, qwen35.hf_weights(cfg, vocab_named(cfg.vocab).n_vocab, 0))
    logits = ref.forward(tokens, embeddings=rows, positions=positions)[-1]
    out = []
    for _ in range(n):
        t = int(np.argmax(logits))
        out.append(t)
        p = ref.n_past + delta
        logits = ref.forward([t], positions=[(p, p, p)])[-1]
    return out, tok


def test_generate_with_an_image_matches_the_reference(files) -> None:
    text, mmproj, picture, _ = files
    r = run("generate", text, "--mmproj", mmproj, "--image", picture, "-p", "<__media__> Say:", "-n", 6,
            "--temp", 0, "--kv-type", "f32", "--threads", 2)
    assert r.exit_code == 0, r.output
    want, tok = _reference_greedy(text, mmproj, picture, " Say:", 6)
    assert r.stdout.rstrip("\n") == tok.decode(want)
    assert "prompt eval" in r.stderr


@pytest.mark.parametrize("case", ["no-mmproj", "corrupt", "missing", "mismatch", "markers", "text-model"])
def test_bad_image_input(files, case: str, tiny_model_path) -> None:
    text, mmproj, picture, folder = files
    args = ["generate", text, "--mmproj", mmproj, "--image", picture, "-p", "hi", "-n", 1]
    expect, code = {
        "no-mmproj": ("needs the model's vision tower", 2),
        "corrupt": ("corrupt", 2),
        "missing": ("no such image", 2),
        "mismatch": ("projects to 256 dimensions", 3),
        "markers": ("2 <__media__> markers for 1 images", 2),
        "text-model": ("not an mmproj", 3),
    }[case]
    if case == "no-mmproj":
        args = ["generate", text, "--image", picture, "-p", "hi", "-n", 1]
    elif case == "corrupt":
        bad = folder / "cut.webp"
        bad.write_bytes(picture.read_bytes()[:60])
        args[5] = bad
    elif case == "missing":
        args[5] = folder / "nothing.png"
    elif case == "mismatch":
        args[1] = tiny_model_path("tiny-qwen35", hidden_size=128)
    elif case == "markers":
        args[7] = "<__media__> and <__media__>"
    elif case == "text-model":
        args[3] = text
    r = run(*args)
    assert r.exit_code == code, r.output
    assert expect in r.output and "Traceback" not in r.output
    assert r.output.strip().count("\n") == 0 or "error:" in r.output.splitlines()[-1]
