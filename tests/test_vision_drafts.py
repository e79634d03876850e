"""Speculative decoding over prompts with images, in `generate` and `chat` (issue 31).

An image's rows are recorded as negative ids (`image_token`): an n-gram source must never propose
them, a draft model (text only) reads the history without them (`speculative.text_tokens`), and the
MTP block drafts from the text after the last image (its rows over the image are not filled). Each
way the greedy text equals plain decoding's, and drafts were made.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from deltarun.cli.main import cli
from deltarun.model_files import qwen35_vision as qv


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("vlm-drafts")
    text, mmproj = qv.write_vlm(folder, "tiny-qwen35")
    arr = (np.random.default_rng(7).uniform(0, 1, (50, 90, 3)) * 255).astype(np.uint8)
    Image.fromarray(arr).save(folder / "picture.png")
    return text, mmproj, folder / "picture.png"


def _run(*args: object, stdin: str | None = None):
    r = CliRunner().invoke(cli, [str(a) for a in args], input=stdin)
    assert r.exit_code == 0, r.output
    return r


def _drafted(stderr: str) -> int:
    return int(re.search(r"(\d+)/(\d+) drafts accepted", stderr).group(2))


@pytest.mark.parametrize("draft", ["ngram", "mtp", "model"])
def test_generate_drafts_with_an_image(files, draft: str) -> None:
    text, mmproj, picture = files
    args = ("generate", text, "--mmproj", mmproj, "--image", picture, "-p", "<__media__> Say: Say: Say:", "-n", 12,
            "--temp", 0, "--kv-type", "f32", "--threads", 1)
    plain = _run(*args)
    spec = _run(*args, "--draft", text if draft == "model" else draft, "--draft-max", 3)
    assert spec.stdout == plain.stdout
    assert draft == "ngram" or _drafted(spec.stderr) > 0     # (the random model's text repeats no n-gram)


def test_chat_with_a_draft_model_and_an_image(files) -> None:
    """Two turns about an image: the draft model drafts in both (it reads the text around the image)."""
    text, mmproj, picture = files
    args = ("chat", text, "--mmproj", mmproj, "-n", 12, "--temp", 0, "--kv-type", "f32", "--threads", 1)
    stdin = f"/image {picture}\nSay: Say:\nAnd again?\n/stats\n"
    plain = _run(*args, stdin=stdin)
    spec = _run(*args, "--draft", text, "--draft-max", 3, stdin=stdin)
    assert spec.stdout == plain.stdout and "error" not in spec.stderr
    assert _drafted(spec.stderr) > 0
