"""`deltarun serve --mmproj`: images in chat requests over real HTTP with the openai client (issue 31).

A user message's `image_url` part (a data: URL) goes through the server's preprocessing, the
vision tower in the worker and the prompt prefill that evaluates each image as one step: the
greedy answer equals `deltarun generate --mmproj --image` on the same prompt (itself checked
against the float64 references in test_vision_cli.py). The prompt cache is keyed on the image's
content: turn 2 of a conversation evaluates only its new tokens (no image encoded again), and the
same text with another image resumes before the image. Bad image input is one 400 each.
"""

from __future__ import annotations

import base64
import functools
import io

import numpy as np
import openai
import pytest
from click.testing import CliRunner
from PIL import Image

from deltarun.apps.chat import common_prefix_length
from deltarun.apps.serve.server import ServeHandle, ServeSettings
from deltarun.apps.serve.worker import CAPTURE_SLOTS
from deltarun.base.chat_template import ChatTemplate
from deltarun.cli.main import cli
from deltarun.model_files import qwen35_vision as qv
from deltarun.runner import images
from deltarun.runner.model import Model, image_token
from deltarun.runner.speculative import NgramDraft, text_tokens
from deltarun.runner.vision import VisionEncoder

N_CTX = 512
PRESET = "tiny-qwen35"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def _png(seed: int, h: int = 50, w: int = 90) -> bytes:
    arr = (np.random.default_rng(seed).uniform(0, 1, (h, w, 3)) * 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(arr).save(out, format="PNG")
    return out.getvalue()


def _url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64," + base64.b64encode(data).decode()


def _user(text: str, *pictures: bytes) -> dict:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _url(p)}} for p in pictures]
            + [{"type": "text", "text": text}]}


def _opener(text, **kw):
    return lambda: Model(text, n_ctx=N_CTX, n_seq_max=2, kv_type="f32", n_threads=1, **kw)


def _open(text, mmproj=None, rs_slots: int = 1, mtp: bool = False, **settings) -> ServeHandle:
    settings.setdefault("prefill_ahead", False)
    return ServeHandle(_opener(text, capture_slots=CAPTURE_SLOTS, rs_slots=rs_slots, mtp=mtp),
                       ServeSettings(parallel=2, mmproj=mmproj, **settings))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("vlm-serve")
    text, mmproj = qv.write_vlm(folder, PRESET)
    pictures = [_png(7), _png(8)]          # one size: only the pixels differ
    return text, mmproj, pictures, folder


@pytest.fixture(scope="module")
def server(files):
    text, mmproj, _, _ = files
    with _open(text, mmproj) as h:
        yield h


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture
def encodes(server, monkeypatch):
    """How many images the worker's vision tower encodes."""
    seen: list[str] = []
    vision = server.worker.vision
    original = vision.encode
    monkeypatch.setattr(vision, "encode", lambda image: (seen.append(image.digest), original(image))[1])
    return seen


def _generate(text, mmproj, folder, messages: list[dict], picture: bytes, n: int) -> str:
    """`deltarun generate --mmproj --image` on the prompt the server renders for `messages` (its one
    image written as the <__media__> marker generate places images at)."""
    with Model(text, n_ctx=64) as m:
        tmpl = ChatTemplate.from_model(m)
    parts = [{"type": "image"} if p["type"] == "image_url" else p for p in messages[0]["content"]]
    rendered = tmpl.render([{"role": "user", "content": parts}], enable_thinking=False, images=True)
    prompt = rendered.replace("<|vision_start|><|image_pad|><|vision_end|>", "<__media__>")
    assert prompt.count("<__media__>") == 1
    path = folder / "picture.png"
    path.write_bytes(picture)
    r = CliRunner().invoke(cli, [str(a) for a in ("generate", text, "--mmproj", mmproj, "--image", path, "-p", prompt,
                                                  "-n", n, "--temp", 0, "--kv-type", "f32", "--threads", 1)])
    assert r.exit_code == 0, r.output
    return r.stdout.rstrip("\n")


def _image_tokens(mmproj, picture: bytes) -> int:
    with VisionEncoder(mmproj) as enc:
        return images.load_image(picture, enc.hp).n_tokens


@pytest.fixture(scope="module")
def generated(files) -> str:
    """generate --mmproj --image's greedy 6 tokens after [the first picture, "Say:"]."""
    text, mmproj, (picture, _), folder = files
    return _generate(text, mmproj, folder, [_user("Say:", picture)], picture, 6)


def _ask(client, messages, n: int = 6):
    return client.chat.completions.create(model="m", messages=messages, max_tokens=n, temperature=0,
                                          extra_body=NO_THINKING)


def test_an_image_answer_equals_generate(files, client, encodes, generated) -> None:
    _, mmproj, (picture, _), _ = files
    r = _ask(client, [_user("Say:", picture)])
    assert r.choices[0].message.content == generated
    assert r.usage.prompt_tokens > _image_tokens(mmproj, picture) and len(encodes) == 1


def test_turn_two_evaluates_only_the_new_tokens(server, files, client, encodes) -> None:
    _, mmproj, (picture, other), _ = files
    n_image = _image_tokens(mmproj, picture)
    first = [_user("Look at this.", picture)]
    r1 = client.chat.completions.create(model="m", messages=first, max_tokens=4, temperature=0, extra_body=NO_THINKING)
    answer = r1.choices[0].message.content
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
    model = server.worker.model
    before = model.stats.n_eval_tokens
    r2 = client.chat.completions.create(model="m", messages=second, max_tokens=4, temperature=0, extra_body=NO_THINKING)
    evaluated = r2.model_extra["timings"]["prompt_n"]
    assert r2.usage.prompt_tokens_details.cached_tokens + evaluated == r2.usage.prompt_tokens
    # resumed past the image, at the checkpoint where the template starts the earlier answer anew: the
    # new tokens are that answer (as history), the new message and the generation prompt
    t1, t2 = (_tokens(server.worker.model, m, n_image) for m in (first, second))
    assert r2.usage.prompt_tokens == len(t2)
    assert r2.usage.prompt_tokens_details.cached_tokens == common_prefix_length(t1, t2) > t1.index(-1) + n_image
    assert model.stats.n_eval_tokens - before == evaluated + r2.usage.completion_tokens - 1
    assert len(encodes) <= 1                 # turn 1's image (once); turn 2 encoded none
    # the same words with another image: the pad ids are the same, the image is not; resumed before it
    encodes.clear()
    third = [_user("Look at this.", other)]
    r3 = client.chat.completions.create(model="m", messages=third, max_tokens=1, temperature=0, extra_body=NO_THINKING)
    assert r3.usage.prompt_tokens_details.cached_tokens < r3.usage.prompt_tokens - n_image
    assert len(encodes) == 1


def _tokens(model: Model, messages: list[dict], n_image: int) -> list[int]:
    """The prompt tokens of `messages` as the template renders them, each image's pad token written as
    n_image tokens -1 (one image: the test compares lengths and common prefixes)."""
    parts = [[{"type": "image"} if p["type"] == "image_url" else p for p in m["content"]]
             if isinstance(m["content"], list) else m["content"] for m in messages]
    rendered = ChatTemplate.from_model(model).render([{**m, "content": c} for m, c in zip(messages, parts)],
                                                     enable_thinking=False, images=True)
    (pad,) = model.tokenizer.encode("<|image_pad|>")
    out: list[int] = []
    for t in model.tokenizer.encode(rendered, parse_special=True):
        out += [-1] * n_image if t == pad else [t]
    return out


def _error(client, messages, **kw) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=messages, max_tokens=1, **kw)
    return e.value


@pytest.mark.parametrize("case", ["http", "not-base64", "media-type", "corrupt", "truncated", "too-large",
                                  "too-many", "assistant"])
def test_bad_images_are_one_400_each(files, client, case: str) -> None:
    picture = files[2][0]
    expect = {"http": "only data: URLs are accepted", "not-base64": "not valid base64",
              "media-type": "not an image deltarun reads", "corrupt": "not an image deltarun can read",
              "truncated": "corrupt", "too-large": "image tokens; at most", "too-many": "images; at most 32",
              "assistant": "user messages only"}[case]
    part = {"type": "image_url", "image_url": {"url": _url(picture)}}
    messages = [{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}]
    if case == "http":
        part["image_url"]["url"] = "https://example.com/cat.png"
    elif case == "not-base64":
        part["image_url"]["url"] = "data:image/png;base64,@@@@"
    elif case == "media-type":
        part["image_url"]["url"] = _url(picture, "svg+xml")
    elif case == "corrupt":
        part["image_url"]["url"] = _url(b"not an image at all")
    elif case == "truncated":
        part["image_url"]["url"] = _url(picture[:len(picture) // 2])
    elif case == "too-large":        # more image tokens than the context holds, refused from the header
        part["image_url"]["url"] = _url(_png(1, 1200, 1200))
    elif case == "too-many":
        messages[0]["content"] = [part] * 33
    elif case == "assistant":
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [part]},
                    {"role": "user", "content": "hi"}]
    e = _error(client, messages)
    assert e.status_code == 400 and expect in e.body["message"], e.body
    assert "Traceback" not in e.body["message"] and e.body["param"].startswith("messages")


def test_a_server_without_mmproj_refuses_images(files) -> None:
    text, _, (picture, _), _ = files
    with _open(text) as h:
        client = openai.OpenAI(base_url=h.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        e = _error(client, [_user("hi", picture)])
        assert e.status_code == 400 and "no vision tower (start it with --mmproj FILE)" in e.body["message"]
        assert client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=1).choices[0].finish_reason in ("stop", "length")


def test_props_names_the_vision_modality(server) -> None:
    import httpx

    assert httpx.get(server.base_url + "/props").json()["modalities"]["vision"] is True


def test_ngram_drafts_stop_at_an_image() -> None:
    """An n-gram source never proposes an image's rows (negative ids): what followed a match is cut there."""
    image = [image_token("ab" * 16)] * 3
    assert NgramDraft().propose([5, 6, 7] + image + [8, 5, 6, 7], 4, None).tokens == []
    assert NgramDraft().propose([5, 6, 7, 8] + image + [5, 6, 7], 4, None).tokens == [8]


@pytest.mark.parametrize("draft", ["ngram", "model"])
def test_drafts_with_images_keep_the_greedy_answer(files, generated, draft: str) -> None:
    """Speculation over a prompt with an image: n-gram drafts stop at its rows; a draft model (text
    only) reads the conversation without them and still drafts. The greedy answer is unchanged."""
    text, mmproj, (picture, _), _ = files
    kw = {"draft": "ngram"} if draft == "ngram" else {"draft": str(text), "open_draft": _opener(text)}
    with _open(text, mmproj, rs_slots=5, draft_max=4, **kw) as h:
        client = openai.OpenAI(base_url=h.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
        r = _ask(client, [_user("Say:", picture)])
        assert r.choices[0].message.content == generated
        if draft == "model":           # it drafted (from the text alone: its guesses need not be kept)
            assert r.model_extra["timings"]["draft_n"] > 0


def test_a_draft_model_reads_the_text_around_images() -> None:
    image = [image_token("ab" * 16)] * 3
    assert text_tokens([1, 2] + image + [3]) == [1, 2, 3] and text_tokens([1, 2]) == [1, 2]


def test_mtp_drafts_over_an_image_keep_the_answer_and_the_mtp_rows_of_a_fresh_evaluation(files, generated) -> None:
    """--draft mtp with --mmproj: the MTP block's rows over the image take its embedding rows
    (Model.mtp_eval, checked against the float64 reference in test_mtp_rows.py), so drafting goes on
    after an image; the greedy answer is unchanged, and the MTP rows the server wrote for the prompt
    (chunk by chunk, the image one step) and the answer equal a fresh model's over the whole
    sequence (the trunk over the text and the image, then the MTP block on every row)."""
    from test_mtp_rows import fresh_mtp_kv_rows, mtp_kv_rows

    text, mmproj, (picture, _), _ = files
    with _open(text, mmproj, rs_slots=5, mtp=True, draft="mtp", draft_max=4, chunk=8) as h:
        client = openai.OpenAI(base_url=h.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
        r = _ask(client, [_user("Say:", picture)])
        assert r.choices[0].message.content == generated
        assert r.model_extra["timings"]["draft_n"] > 0
        h.wait_settled()
        m = h.worker.model
        seq = max(range(2), key=lambda s: m.n_past(s))
        held = m.tokens(seq)
        got = mtp_kv_rows(m, seq, len(held) - 1)
    with VisionEncoder(mmproj) as enc:
        image = images.load_image(picture, enc.hp)
        want = fresh_mtp_kv_rows(text, held, {image_token(image.digest): (enc.encode(image), image.merged_hw)})
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", ["missing", "text-model"])
def test_serve_mmproj_errors_are_one_line(files, case: str) -> None:
    text, _, _, folder = files
    mmproj = folder / "nothing.gguf" if case == "missing" else text
    r = CliRunner().invoke(cli, ["serve", str(text), "--mmproj", str(mmproj), "--port", "0"])
    assert r.exit_code != 0
    assert ("no such mmproj file" if case == "missing" else "not an mmproj file") in r.output
    assert "Traceback" not in r.output and len(r.output.strip().splitlines()) == 1


def test_anthropic_image_blocks(server, files, generated) -> None:
    """/v1/messages: an image block with a base64 source is the same image part as chat's image_url."""
    import anthropic

    picture = files[2][0]
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0, timeout=300)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(picture).decode()}}
    r = client.messages.create(model="m", max_tokens=6, extra_body={"temperature": 0}, thinking={"type": "disabled"},
                               messages=[{"role": "user", "content": [image, {"type": "text", "text": "Say:"}]}])
    assert "".join(b.text for b in r.content if b.type == "text") == generated
    n = client.messages.count_tokens(model="m", thinking={"type": "disabled"}, messages=[
        {"role": "user", "content": [image, {"type": "text", "text": "Say:"}]}]).input_tokens
    assert n == r.usage.input_tokens + r.usage.cache_read_input_tokens > _image_tokens(files[1], picture)
    for source, expect in (({"type": "url", "url": "https://example.com/cat.png"}, "only base64 sources"),
                           ({"type": "base64", "media_type": "image/png", "data": "@@"}, "not valid base64"),
                           ({"type": "base64", "media_type": "image/bmp", "data": "AAAA"}, "media type 'image/bmp'")):
        with pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(model="m", max_tokens=1, messages=[
                {"role": "user", "content": [{"type": "image", "source": source}, {"type": "text", "text": "hi"}]}])
        assert expect in e.value.body["error"]["message"] and "messages.0.content.0" in e.value.body["error"]["message"]


def test_responses_input_image(server, client, files, generated) -> None:
    """/v1/responses: an input_image part with a data: URL, the same path again; previous_response_id
    carries the image into the next turn, which evaluates only its new tokens."""
    picture = files[2][0]
    content = [{"type": "input_image", "image_url": _url(picture)}, {"type": "input_text", "text": "Say:"}]
    r = client.responses.create(model="m", input=[{"role": "user", "content": content}], max_output_tokens=6,
                                temperature=0, reasoning={"effort": "none"})
    assert r.output_text == generated
    again = client.responses.create(model="m", previous_response_id=r.id, input="And then?", max_output_tokens=2,
                                    temperature=0, reasoning={"effort": "none"})
    assert again.usage.input_tokens_details.cached_tokens > _image_tokens(files[1], picture)
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model="m", input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "http://example.com/cat.png"}]}], max_output_tokens=1)
    assert "only data: URLs are accepted" in e.value.body["message"]
    assert e.value.body["param"] == "input[0].content[0].image_url"


def test_a_supervised_worker_takes_images(files, generated) -> None:
    """The worker in a child process (`serve --rpc`'s supervisor): the images cross the pipe in GenParams."""
    text, mmproj, (picture, _), _ = files
    opener = functools.partial(Model, text, n_ctx=N_CTX, n_seq_max=2, kv_type="f32", n_threads=1,
                               capture_slots=CAPTURE_SLOTS)
    with ServeHandle(opener, ServeSettings(parallel=2, mmproj=mmproj, prefill_ahead=False, supervise=True)) as h:
        client = openai.OpenAI(base_url=h.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
        assert _ask(client, [_user("Say:", picture)]).choices[0].message.content == generated


def test_prefill_ahead_over_a_conversation_with_an_image(files, server, client) -> None:
    """With prefill ahead the worker evaluates the answer as the next turn renders it while idle: the
    next turn then resumes further than without it (past the answer, not at its start), its answer
    the same, the image still not encoded again."""
    text, mmproj, (picture, _), _ = files
    first = [_user("Describe it.", picture)]
    answer = _ask(client, first, 4).choices[0].message.content
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    plain = _ask(client, second, 4)
    with _open(text, mmproj, prefill_ahead=True) as h:
        c = openai.OpenAI(base_url=h.base_url + "/v1", api_key="none", max_retries=0, timeout=300)
        assert _ask(c, first, 4).choices[0].message.content == answer
        h.wait_settled()
        seen: list[str] = []
        vision = h.worker.vision
        original = vision.encode
        vision.encode = lambda image: (seen.append(image.digest), original(image))[1]
        ahead = _ask(c, second, 4)
        assert ahead.choices[0].message.content == plain.choices[0].message.content and seen == []
        cached = ahead.usage.prompt_tokens_details.cached_tokens
        assert cached > common_prefix_length(*(_tokens(h.worker.model, m, _image_tokens(mmproj, picture))
                                               for m in (first, second)))
