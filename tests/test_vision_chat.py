"""`deltarun chat --mmproj FILE` with `/image PATH`: the image attached to the next message goes
through the chat template (<|vision_start|><|image_pad|><|vision_end|>), the vision tower and the
text model; greedy answers equal the float64 references'; turn 2 of a conversation about the image
evaluates only its new tokens, and a different image with the same text is not taken from memory."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from deltarun.apps.chat import ChatSession
from deltarun.base.chat_template import ChatTemplate
from deltarun.cli.main import cli
from deltarun.model_files import qwen35, qwen35_vision as qv
from deltarun.model_files.vocab import vocab_named
from deltarun.runner import images
from deltarun.runner.model import Model
from deltarun.runner.sampling import GREEDY, Sampler
from deltarun.runner.vision import VisionEncoder

import reference_vision as rv
from reference_qwen35 import Qwen35Reference

PRESET = "tiny-qwen35"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("vlm-chat")
    text, mmproj = qv.write_vlm(folder, PRESET)
    pictures = []
    for seed, (h, w) in ((7, (50, 90)), (8, (50, 90))):   # one grid: only the pixels differ
        rng = np.random.default_rng(seed)
        arr = (rng.uniform(0, 1, (h, w, 3)) * 255).astype(np.uint8)
        pictures.append(folder / f"picture{seed}.png")
        Image.fromarray(arr).save(pictures[-1])
    return text, mmproj, pictures


def _reference_answer(text_path: Path, mmproj: Path, messages: list[dict], picture: Path, n: int) -> str:
    """The float64 references' greedy answer to `messages` (one image part) rendered by the
    model's chat template, the pad token repeated once per image token."""
    cfg = qwen35.PRESETS[PRESET]
    vcfg = qv.vision_for(cfg)
    with VisionEncoder(mmproj) as enc, Model(text_path, n_ctx=256) as m:
        prep = images.load_image(picture, enc.hp)
        tok = m.tokenizer
        rendered = ChatTemplate.from_model(m).render(messages, images=True)
    (pad,) = tok.encode("<|image_pad|>")
    tokens = []
    for t in tok.encode(rendered, parse_special=True):
        tokens += [t] * prep.n_tokens if t == pad else [t]
    emb, grid = rv.vision_forward(qv.hf_weights(vcfg, 0), vcfg, prep.pixels)
    positions, delta = rv.rope_positions(tokens, pad, [grid])
    rows = np.full((len(tokens), cfg.hidden_size), np.nan)
    first = tokens.index(pad)
    rows[first:first + prep.n_tokens] = emb
    ref = Qwen35Reference(cfg, qwen35.hf_weights(cfg, vocab_named(cfg.vocab).n_vocab, 0))
    logits = ref.forward(tokens, embeddings=rows, positions=positions)[-1]
    out = []
    for _ in range(n):
        t = int(np.argmax(logits))
        out.append(t)
        p = ref.n_past + delta
        logits = ref.forward([t], positions=[(p, p, p)])[-1]
    return tok.decode(out)


def test_chat_image_command_matches_the_reference(files) -> None:
    text, mmproj, (picture, _) = files
    r = CliRunner().invoke(cli, [str(a) for a in ("chat", text, "--mmproj", mmproj, "-n", 5, "--temp", 0,
                                                  "--kv-type", "f32", "--threads", 2)],
                           input=f"/image {picture}\nWhat is it?\n")
    assert r.exit_code == 0, r.output
    assert "attached to the next message" in r.stderr
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    assert r.stdout.strip("\n") == _reference_answer(text, mmproj, messages, picture, 5).strip("\n")


def test_chat_image_without_mmproj_is_one_line(files) -> None:
    text, _, (picture, _) = files
    r = CliRunner().invoke(cli, ["chat", str(text), "-n", "2"], input=f"/image {picture}\nhi\n")
    assert "error: images need the model's vision tower: start chat with --mmproj FILE" in r.stderr
    assert "Traceback" not in r.output


def test_turn_two_reuses_the_image_and_another_image_is_not_reused(files) -> None:
    text, mmproj, (picture, other) = files
    with VisionEncoder(mmproj) as enc, Model(text, n_ctx=512, kv_type="f32") as m:
        session = ChatSession(m, sampler=Sampler(GREEDY), n_predict=4, vision=enc)
        image = session.attach_image(picture)
        first = session.ask("What is it?")
        assert session.last_prefill_tokens > image.n_tokens
        new_message = len(session.tokenize("<|im_start|>user\nAnd now?<|im_end|>\n<|im_start|>assistant\n"))
        session.ask("And now?")
        # the image and the first turn are reused; the answer re-rendered without thinking, the new
        # message and the assistant header are evaluated (K: the template's re-rendering of turn 1)
        assert session.last_reused_tokens > image.n_tokens
        assert session.last_prefill_tokens <= new_message + len(m.tokenizer.encode(first)) + 8

        # the same conversation with another image of the same size: the pad tokens are the same
        # ids and the text is the same, but the memory must not be reused past the image's start
        held = m.tokens(0)
        start = held.index(min(held))
        other_image = session.attach_image(other)
        session.pending_images.clear()
        session.messages = [{"role": "user", "content": [{"type": "image", "digest": other_image.digest},
                                                         {"type": "text", "text": "What is it?"}]},
                            {"role": "assistant", "content": first}]
        session.ask("And now?")
        assert session.last_reused_tokens <= start
        assert session.last_prefill_tokens >= other_image.n_tokens
