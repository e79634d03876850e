"""The MTP block's KV rows: every position a draft attends over holds the row a fresh evaluation
writes there, (hidden_i, token_{i+1}) at position i, in chat as in the server (test_serve_draft).

A draft's attention reads the MTP rows of every earlier position, so a prompt position without its
row (or with one left from another conversation) changes the drafts, never the output (the target
verifies them): only the rows themselves show it. Tiny F32 models with an F32 KV cache.
"""

from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner
from PIL import Image

import reference_vision as rv
from deltarun.apps.chat import ChatSession
from deltarun.cli.main import cli
from deltarun.model_files import qwen35 as q35
from deltarun.model_files import qwen35_vision as qv
from deltarun.runner.generation import GenerationStats, generate_tokens
from deltarun.runner.images import load_image
from deltarun.runner.model import Model, image_token
from deltarun.runner.multimodal import prefill_with_images, vision_token_ids
from deltarun.runner.sampling import GREEDY, Sampler
from deltarun.runner.speculative import MtpDraft, MtpFeed
from deltarun.runner.vision import VisionEncoder
from reference_compare import F32_TOL, prompt, rel_err
from reference_qwen35 import Qwen35Reference
from test_qwen35_files import N_VOCAB

N_CTX = 512


def mtp_kv_rows(m: Model, seq: int, n: int) -> list[np.ndarray]:
    """The K rows of the MTP layers for positions 0..n-1 of `seq`."""
    kv = m.memory.read_kv(seq, n)
    return [np.frombuffer(kv.rows[il][0], dtype=np.float32).reshape(n, -1) for il in m.memory.mtp_layers]


def fresh_mtp_kv_rows(path, held: list[int], images: dict[int, tuple[np.ndarray, tuple[int, int]]] | None = None
                      ) -> list[np.ndarray]:
    """What a fresh model writes for positions 0..len-2 of `held`: the trunk over the text and whole
    images (`images`: image token -> (embedding rows, merged grid)), then the MTP block on every
    (hidden_i, token_{i+1})."""
    with Model(path, n_ctx=N_CTX, kv_type="f32", mtp=True) as m:
        hidden, pos = [], 0
        while pos < len(held):
            end = pos + 1
            is_image = held[pos] < 0          # a run of one image's token, or of text tokens
            while end < len(held) and (held[end] == held[pos] if is_image else held[end] >= 0):
                end += 1
            if is_image:
                rows, grid = images[held[pos]]
                m.eval_image(rows, grid, vision_token_ids(m)[1], token=held[pos], all_hidden=True)
            else:
                m.eval(held[pos:end], all_hidden=True)
            hidden.append(m.last_hidden[0])
            pos = end
        m.mtp_eval(held[1:], np.concatenate(hidden)[:-1], 0)
        return mtp_kv_rows(m, 0, len(held) - 1)


def test_chat_with_mtp_drafts_writes_the_mtp_rows_of_every_prompt_position(tiny_model_path):
    """Three turns with --draft mtp, the next turn's start evaluated ahead before the last: the MTP
    rows of the prompts (the template re-renders earlier answers, so turns resume from the
    checkpoint or roll back), of the answers and of the work done ahead are a fresh evaluation's."""
    path = tiny_model_path("tiny-mtp")
    with Model(path, n_ctx=N_CTX, kv_type="f32", mtp=True, rs_slots=4) as m:
        draft = MtpDraft(m, defer=True)
        chat = ChatSession(m, draft=draft, draft_max=3, n_predict=24, system="Repeat after me.")
        for turn in range(3):
            if turn == 2:
                assert chat.prefill_next_turn() > 0
            chat.ask(f"turn {turn}: " + "one two three " * (turn + 2))
            assert chat.draft_stats.n_drafted > 0
        if draft.deferred:                   # rows kept aside until the next draft: written now
            draft.evaluate_deferred()
        tokens = m.tokens(0)
        got = mtp_kv_rows(m, 0, len(tokens) - 1)
    for a, b in zip(got, fresh_mtp_kv_rows(path, tokens)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def _image_prompt():
    """A prompt of text, one image (a 2 x 3 merged grid of rows, at a pad token's place), text."""
    rng = np.random.default_rng(3)
    before, after = prompt(6, seed=21), prompt(5, seed=22)
    rows = rng.normal(0.0, 0.05, (6, q35.PRESETS["tiny-qwen35"].hidden_size)).astype(np.float32)
    return before, rows, after


def test_mtp_rows_over_an_image_match_the_reference(tiny_model_path):
    """Text, an image, text: the MTP rows whose next position is an image row take that row's
    embedding (as the trunk took it in place of the pad token) and every row the rope position the
    trunk gave it (the image's grid streams, later text shifted); against the float64 reference,
    in one call and in calls split inside the image (the runs of image rows and the outputs kept)."""
    cfg = q35.PRESETS["tiny-qwen35"]
    before, rows, after = _image_prompt()
    pad, grid, n_img = 5, (2, 3), len(rows)
    tokens = before + [pad] * n_img + after
    embeddings = np.full((len(tokens), cfg.hidden_size), np.nan)
    embeddings[len(before):len(before) + n_img] = rows
    positions, _ = rv.rope_positions(tokens, pad, [(1, 2 * grid[0], 2 * grid[1])])
    ref = Qwen35Reference(cfg, q35.hf_weights(cfg, N_VOCAB, 0))
    ref.forward(tokens, embeddings=embeddings, positions=positions)
    hidden = ref.final_norm(ref.hidden())
    follow = tokens[1:] + [17]
    next_rows = np.concatenate([embeddings[1:], np.full((1, cfg.hidden_size), np.nan)])
    exp, exp_out = ref.mtp_forward(follow, hidden, embeddings=next_rows, positions=positions)

    path = tiny_model_path("tiny-qwen35")
    for cuts in ([], [4, 9]):             # one call; three calls, the second and third inside the image
        with Model(path, n_ctx=64, kv_type="f32", mtp=True) as m:
            parts = []
            m.eval(before, all_hidden=True)
            parts.append(m.last_hidden[0])
            m.eval_image(rows, grid, pad, all_hidden=True)
            parts.append(m.last_hidden[0])
            m.eval(after, all_hidden=True)
            parts.append(m.last_hidden[0])
            h = np.concatenate(parts)
            np.testing.assert_allclose(h, hidden, rtol=1e-4, atol=1e-4)
            recorded = m.tokens(0)[1:] + [17]          # image rows as the image's token
            assert recorded[len(before) - 1] < 0 and recorded[len(before) + n_img - 1] >= 0
            got, outs = [], []
            for a, b in zip([0, *cuts], [*cuts, len(tokens)]):
                logits, out = m.mtp_eval(recorded[a:b], h[a:b], a, n_outputs=None if a == 0 else b - a - 1)
                got.append(logits)
                outs.append(out)
                if a:                                   # the first row of a later call: not asked for
                    exp_rows = slice(a + 1, b)
                    assert rel_err(logits, exp[exp_rows]) < F32_TOL
            if not cuts:
                assert rel_err(got[0], exp) < F32_TOL
                np.testing.assert_allclose(outs[0], exp_out, rtol=1e-4, atol=1e-4)
            else:                                   # the rows each call wrote: those of one call
                assert rel_err(got[0], exp[:cuts[0]]) < F32_TOL


@pytest.fixture(scope="module")
def vlm(tmp_path_factory: pytest.TempPathFactory):
    """The tiny Qwen3.5 pair (text GGUF with its MTP block, mmproj) and a picture."""
    folder = tmp_path_factory.mktemp("mtp-vlm")
    text, mmproj = qv.write_vlm(folder, "tiny-qwen35")
    picture = folder / "picture.png"
    Image.fromarray((np.random.default_rng(7).uniform(0, 1, (50, 90, 3)) * 255).astype(np.uint8)).save(picture)
    return text, mmproj, picture


def test_generate_with_an_image_and_mtp_drafts_writes_the_mtp_rows_of_every_position(vlm):
    """`generate --image --draft mtp`'s path: the text before the image and the image evaluated
    with their hidden rows handed to the draft (`prefill_with_images(feed=)`), then the rest of the
    prompt and the answer (`generate_tokens(feed=)`); the rows equal a fresh whole evaluation's, and
    the greedy answer the one without drafts."""
    text, mmproj, picture = vlm
    prompt_text = "Look: <__media__> What is it? Say one two three one two three"
    answers, rows_seen = [], []
    for with_draft in (False, True):
        with Model(text, n_ctx=N_CTX, kv_type="f32", mtp=with_draft, rs_slots=4) as m, \
                VisionEncoder(mmproj) as enc:
            image = load_image(picture, enc.hp)
            draft = MtpDraft(m, defer=True) if with_draft else None
            feed = MtpFeed(draft) if with_draft else None
            rest = prefill_with_images(m, enc, prompt_text, [image], feed=feed)
            stats = GenerationStats()
            answers.append(list(generate_tokens(m, rest, 12, Sampler(GREEDY), stats=stats, draft=draft, draft_max=3,
                                                stop_at_eog=False, feed=feed)))
            if with_draft:
                assert stats.n_drafted > 0
                if draft.deferred:
                    draft.evaluate_deferred()
                held = m.tokens(0)
                rows_seen = mtp_kv_rows(m, 0, len(held) - 1)
                image_rows, grid = enc.encode(image), image.merged_hw
    assert answers[0] == answers[1]
    for a, b in zip(rows_seen, fresh_mtp_kv_rows(text, held, {image_token(image.digest): (image_rows, grid)})):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_cli_generate_with_an_image_and_mtp_drafts_answers_as_without(vlm):
    text, mmproj, picture = vlm
    outs = []
    for extra in ([], ["--draft", "mtp", "--draft-max", "3"]):
        r = CliRunner().invoke(cli, [str(a) for a in ("generate", text, "--mmproj", mmproj, "--image", picture, "-p",
                                                      "Look: <__media__> Say one two three", "-n", 10, "--temp", 0,
                                                      "--kv-type", "f32", "--threads", 1, *extra)])
        assert r.exit_code == 0, r.output
        outs.append(r.stdout)
    assert outs[0] == outs[1] and outs[0].strip()


def test_chat_with_an_image_and_mtp_drafts_writes_the_mtp_rows_of_every_position(vlm):
    """chat's /image with --draft mtp: two turns about an image; the MTP rows (prompt, image rows,
    answers) are a fresh whole evaluation's."""
    text, mmproj, picture = vlm
    with Model(text, n_ctx=N_CTX, kv_type="f32", mtp=True, rs_slots=4) as m, VisionEncoder(mmproj) as enc:
        draft = MtpDraft(m, defer=True)
        chat = ChatSession(m, draft=draft, draft_max=3, n_predict=24, vision=enc, enable_thinking=False)
        image = chat.attach_image(picture)
        chat.ask("What is it? Say one two three one two three")
        assert chat.draft_stats.n_drafted > 0
        chat.ask("And then? one two three")
        if draft.deferred:
            draft.evaluate_deferred()
        held = m.tokens(0)
        got = mtp_kv_rows(m, 0, len(held) - 1)
        image_rows = enc.encode(image)
    for a, b in zip(got, fresh_mtp_kv_rows(text, held, {image_token(image.digest): (image_rows, image.merged_hw)})):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_more_images_than_the_model_keeps_rows_of(vlm, tmp_path, monkeypatch):
    """The MTP rows over each image are handed over as the image is evaluated, while the model still
    holds its embedding rows (it keeps the last MTP_IMAGES images', here 1): a prompt with three
    images, one of them twice, drafts on, and its rows are a fresh evaluation's."""
    import deltarun.runner.model as model_module

    monkeypatch.setattr(model_module, "MTP_IMAGES", 1)
    text, mmproj, picture = vlm
    files = [picture]
    for seed in (8, 9):
        files.append(tmp_path / f"p{seed}.png")
        Image.fromarray((np.random.default_rng(seed).uniform(0, 1, (50, 90, 3)) * 255).astype(np.uint8)).save(files[-1])
    with Model(text, n_ctx=N_CTX, kv_type="f32", mtp=True, rs_slots=4) as m, VisionEncoder(mmproj) as enc:
        prepared = [load_image(f, enc.hp) for f in files]
        order = [prepared[0], prepared[1], prepared[0], prepared[2]]
        draft = MtpDraft(m, defer=True)
        feed = MtpFeed(draft)
        rest = prefill_with_images(m, enc, "A <__media__> B <__media__> C <__media__> D <__media__> say one two",
                                   order, feed=feed)
        stats = GenerationStats()
        list(generate_tokens(m, rest, 8, Sampler(GREEDY), stats=stats, draft=draft, draft_max=3, stop_at_eog=False,
                             feed=feed))
        assert stats.n_drafted > 0 and len(m._mtp_image_rows) == 1
        if draft.deferred:
            draft.evaluate_deferred()
        held = m.tokens(0)
        got = mtp_kv_rows(m, 0, len(held) - 1)
        rows_of = {image_token(p.digest): (enc.encode(p), p.merged_hw) for p in prepared}
    monkeypatch.undo()                      # the reference keeps every image's rows
    want = fresh_mtp_kv_rows(text, held, rows_of)   # the same prompt, images whole
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
