"""The server's prompt cache with images (issue 31): a sequence records an image's rows as
`image_token(digest)`, so the cache's token comparisons are keyed on image content. A prompt with
the same image resumes past it; the same text with another image (whose pad tokens are the same
ids) does not; a conversation moved to host RAM and back keeps its images' rope positions."""

from __future__ import annotations

import numpy as np
import pytest

from deltarun.apps.serve.prompt_cache import PromptCache
from deltarun.model_files import qwen35_vision as qv
from deltarun.runner.model import Model, image_token
from deltarun.runner.multimodal import vision_token_ids


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):
    text, _ = qv.write_vlm(tmp_path_factory.mktemp("vlm-cache"), "tiny-qwen35")
    with Model(text, n_ctx=256, n_seq_max=3, kv_type="f32") as m:
        yield m


def _prompt(model: Model, digest: str, grid: tuple[int, int]) -> tuple[list[int], int]:
    """[text, <|vision_start|>, the image's tokens, <|vision_end|>, text] and where the image starts."""
    start, _, end = vision_token_ids(model)
    head = [100, 101, 102, start]
    return head + [image_token(digest)] * (grid[0] * grid[1]) + [end, 103, 104, 105], len(head)


def _evaluate(model: Model, prompt: list[int], at: int, grid: tuple[int, int], rows: np.ndarray, seq: int) -> np.ndarray:
    _, pad, _ = vision_token_ids(model)
    n = grid[0] * grid[1]
    model.eval(prompt[:at], seq)
    model.eval_image(rows, grid, pad, seq, token=prompt[at])
    return model.eval(prompt[at + n:], seq)


def test_the_cache_is_keyed_on_the_image(model: Model) -> None:
    model.reset()
    grid = (2, 3)
    rows = np.random.default_rng(0).normal(size=(6, model.hp.n_embd)).astype(np.float32)
    a, at = _prompt(model, "aa" * 16, grid)
    b, _ = _prompt(model, "bb" * 16, grid)
    cache = PromptCache(model, 3, budget_bytes=1 << 30)
    logits = _evaluate(model, a, at, grid, rows, 0)
    cache.checkpoint(0, logits=logits)
    cache.finished(0, answer_start=len(a))

    more = a + [106, 107]
    assert (cache.lookup(more, [0, 1, 2]).how, cache.lookup(more, [0, 1, 2]).pos) == ("live", len(a))
    other = cache.lookup(b + [106, 107], [0, 1, 2])
    assert other.pos <= at                     # the same text and pad ids, another image

    # out to host RAM and back into another sequence: the image's rope shift comes back with it
    logits_there = model.eval([106], 0)
    cache.apply(cache.lookup([9, 9, 9], [0]), 0)
    back = cache.lookup(a, [2])
    assert back.how == "host" and back.pos == len(a)
    cache.apply(back, 2)
    assert [(s.start, s.n, s.rows, s.cols) for s in model.images(2)] == [(at, 6, 2, 3)]
    np.testing.assert_allclose(model.eval([106], 2), logits_there, rtol=1e-5, atol=1e-5)
