"""`chat --mmproj`: a saved conversation with images loads again (issue 31). The image parts name
their file and digest; `/load` reads each image again and the conversation goes on as if it had
never been saved (greedy answers equal). A missing or changed image file, or a conversation with
images in a chat without the vision tower, is one clear error and leaves the conversation as it was."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

from deltarun.apps.chat import ChatFileError, ChatSession
from deltarun.cli.main import cli
from deltarun.model_files import qwen35_vision as qv
from deltarun.runner.model import Model
from deltarun.runner.sampling import GREEDY, Sampler
from deltarun.runner.vision import VisionEncoder


def _picture(path, seed: int) -> None:
    arr = (np.random.default_rng(seed).uniform(0, 1, (50, 90, 3)) * 255).astype(np.uint8)
    Image.fromarray(arr).save(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("vlm-load")
    text, mmproj = qv.write_vlm(folder, "tiny-qwen35")
    _picture(folder / "picture.png", 7)
    return text, mmproj, folder


def test_a_saved_conversation_with_an_image_goes_on_after_load(files) -> None:
    text, mmproj, folder = files
    saved = folder / "talk.json"
    with VisionEncoder(mmproj) as enc, Model(text, n_ctx=512, kv_type="f32") as m:
        session = ChatSession(m, sampler=Sampler(GREEDY), n_predict=4, vision=enc)
        session.attach_image(folder / "picture.png")
        session.ask("What is it?")
        session.save(saved)
        want = session.ask("And now?")
    parts = json.loads(saved.read_text())["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["image", "text"]
    with VisionEncoder(mmproj) as enc, Model(text, n_ctx=512, kv_type="f32") as m:
        session = ChatSession(m, sampler=Sampler(GREEDY), n_predict=4, vision=enc)
        session.load(saved)
        assert session.ask("And now?") == want


def test_the_chat_command_loads_it(files) -> None:
    text, mmproj, folder = files
    args = ["chat", str(text), "--mmproj", str(mmproj), "-n", "3", "--temp", "0", "--kv-type", "f32"]
    first = CliRunner().invoke(cli, args, input=f"/image {folder / 'picture.png'}\nWhat?\n/save {folder / 'c.json'}\n")
    assert first.exit_code == 0, first.output
    again = CliRunner().invoke(cli, args, input=f"/load {folder / 'c.json'}\nMore?\n")
    assert again.exit_code == 0 and "error" not in again.stderr, again.output


@pytest.mark.parametrize("case", ["no-mmproj", "missing", "changed", "bad-part"])
def test_loading_fails_cleanly(files, tmp_path, case: str) -> None:
    text, mmproj, folder = files
    picture = tmp_path / "p.png"
    _picture(picture, 7)
    with VisionEncoder(mmproj) as enc, Model(text, n_ctx=256, kv_type="f32") as m:
        session = ChatSession(m, sampler=Sampler(GREEDY), n_predict=2, vision=enc)
        session.attach_image(picture)
        session.ask("What is it?")
        session.save(tmp_path / "talk.json")
        expect = {"no-mmproj": "the conversation has images; start chat with --mmproj FILE",
                  "missing": "no such image file", "changed": "has changed since the conversation was saved",
                  "bad-part": "neither text nor an image"}[case]
        if case == "no-mmproj":
            session = ChatSession(m, sampler=Sampler(GREEDY), n_predict=2)
        elif case == "missing":
            picture.unlink()
        elif case == "changed":
            _picture(picture, 8)
        elif case == "bad-part":
            data = json.loads((tmp_path / "talk.json").read_text())
            data["messages"][0]["content"][0] = {"type": "image_url", "image_url": "x"}
            (tmp_path / "talk.json").write_text(json.dumps(data))
        before = list(session.messages)
        with pytest.raises(ChatFileError, match=expect):
            session.load(tmp_path / "talk.json")
        assert session.messages == before
