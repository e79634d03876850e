"""A prompt with images, evaluated as the Qwen3-VL / Qwen3.5 processor lays it out.

Each image becomes `<|vision_start|>`, one `<|image_pad|>` per image token, `<|vision_end|>` (what
the chat template and the processor write); the text model takes the image's embedding rows in place
of the pad tokens (`Model.eval_image`). In a raw prompt, images go where llama.cpp's marker
`<__media__>` stands, one marker per image, or before the text when there is none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from deltarun.base.errors import DeltarunError, ImageError
from deltarun.base.vision import PreparedImage
from deltarun.runner.model import Model, image_token
from deltarun.runner.speculative import MtpFeed
from deltarun.runner.vision import VisionEncoder

MEDIA_MARKER = "<__media__>"
VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


def vision_token_ids(model: Model) -> tuple[int, int, int]:
    """The ids of <|vision_start|>, <|image_pad|> and <|vision_end|> in the model's vocabulary."""
    ids = []
    for text in VISION_TOKENS:
        got = model.tokenizer.encode(text)
        if len(got) != 1:
            raise ImageError(f"{model.path}: the vocabulary has no {text} token, so the model cannot take images")
        ids.append(got[0])
    return ids[0], ids[1], ids[2]


def split_at_markers(text: str, n_images: int) -> list[str]:
    """The text around the images: n_images + 1 pieces (images before the text when it has no marker)."""
    pieces = text.split(MEDIA_MARKER)
    if len(pieces) == 1:
        return [""] * n_images + [text]
    if len(pieces) - 1 != n_images:
        raise ImageError(f"the prompt has {len(pieces) - 1} {MEDIA_MARKER} markers for {n_images} images")
    return pieces


def prefill_with_images(model: Model, encoder: VisionEncoder, text: str, images: list[PreparedImage],
                        seq: int = 0, feed: MtpFeed | None = None) -> list[int]:
    """Evaluate the prompt up to and including its last image into sequence `seq`; return the tokens
    left to evaluate (the text after the last image, starting with <|vision_end|>). `feed`: handed
    the hidden rows of each evaluation (an MTP draft's KV rows, `speculative.MtpFeed`)."""
    if not images:
        return model.tokenizer.encode(text)
    encoder.check_text_model(model.hp.n_embd, model.family.arch)
    start, pad, end = vision_token_ids(model)
    pieces = split_at_markers(text, len(images))
    rows = [encoder.encode(img) for img in images]
    n_total = sum(len(model.tokenizer.encode(p)) for p in pieces) + sum(img.n_tokens + 2 for img in images)
    if model.n_past(seq) + n_total > model.n_ctx:
        raise DeltarunError(f"the prompt with its images has {n_total} tokens but the context holds "
                            f"{model.n_ctx - model.n_past(seq)} more; raise --ctx or use smaller images")
    pending: list[int] = []
    wants = feed is not None
    for piece, img, emb in zip(pieces, images, rows):
        pending += model.tokenizer.encode(piece) + [start]
        first = model.n_past(seq)
        model.eval(pending, seq, continued=True, all_hidden=wants)
        if feed is not None:
            feed.feed(model.tokens(seq), model.last_hidden[0][-len(pending):], first)
        first = model.n_past(seq)
        model.eval_image(np.asarray(emb), img.merged_hw, pad, seq, token=image_token(img.digest), all_hidden=wants)
        if feed is not None:
            feed.feed(model.tokens(seq), model.last_hidden[0], first)
        pending = [end]
    return pending + model.tokenizer.encode(pieces[-1])


@dataclass(frozen=True)
class PlacedImage:
    """An image in a prompt's token list: its `n` image tokens (`token`, see `image_token`) from
    position `start`, where the chat template wrote one <|image_pad|>."""

    start: int
    image: PreparedImage
    token: int

    @property
    def end(self) -> int:
        return self.start + self.image.n_tokens


def place_images(tokens: Sequence[int], pad: int, images: Sequence[PreparedImage]) -> tuple[list[int], list[PlacedImage]]:
    """`tokens` (a rendered prompt, one `pad` per image) with each pad replaced by its image's
    tokens, and where they are. The images are taken in order; a prefix of a prompt may hold fewer
    pads than there are images, never more."""
    out: list[int] = []
    placed: list[PlacedImage] = []
    for t in tokens:
        if t != pad:
            out.append(int(t))
            continue
        if len(placed) == len(images):
            raise ImageError(f"the prompt has more {VISION_TOKENS[1]} tokens than the {len(images)} images attached")
        img = images[len(placed)]
        placed.append(PlacedImage(len(out), img, image_token(img.digest)))
        out += [placed[-1].token] * img.n_tokens
    return out, placed


def placed_position(q: int, placed: Sequence[PlacedImage]) -> int:
    """Position `q` of a rendered prompt (one pad token per image) in the prompt `place_images`
    made of it (each pad replaced by its image's tokens): a cut after a pad lands after its image."""
    shift = 0
    for img in sorted(placed, key=lambda p: p.start):
        if img.start - shift < q:          # the image's pad stood before q
            shift += img.image.n_tokens - 1
    return q + shift


def outside_images(q: int, placed: Sequence[PlacedImage]) -> int:
    """Position `q`, or the end of the image it falls inside (a prompt chunk never ends inside one)."""
    return next((img.end for img in placed if img.start < q < img.end), q)


def prompt_steps(begin: int, end: int, placed: Sequence[PlacedImage],
                 split: Callable[[int], list[int]]) -> list[tuple[int, int, PlacedImage | None]]:
    """How to evaluate prompt positions begin..end: (from, to, image) steps, each image (or the
    rest of one, when `begin` lies inside it) one step, the text between in the ubatches
    `split(n)` gives."""
    steps: list[tuple[int, int, PlacedImage | None]] = []
    pos = begin
    for img in sorted(placed, key=lambda p: p.start):
        if img.end <= pos or img.start >= end:
            continue
        if img.end > end:
            raise ImageError(f"prompt positions {begin}..{end} end inside an image ({img.start}..{img.end})")
        for size in split(img.start - pos) if img.start > pos else []:
            steps.append((pos, pos + size, None))
            pos += size
        steps.append((pos, img.end, img))
        pos = img.end
    for size in split(end - pos) if end > pos else []:
        steps.append((pos, pos + size, None))
        pos += size
    return steps


def eval_step(model: Model, tokens: Sequence[int], step: tuple[int, int, PlacedImage | None], seq: int,
              rows_of: Callable[[PreparedImage], np.ndarray], pad: int, all_hidden: bool = False,
              **text_opts: object) -> np.ndarray:
    """Evaluate one of `prompt_steps` into sequence `seq` (which holds the prompt up to its start);
    the logits of its last row. `rows_of` gives an image's embedding rows (the vision tower's).
    `all_hidden`: `model.last_hidden` holds every row's hidden state (an MTP block's KV rows)."""
    begin, end, img = step
    if img is None:
        return model.eval(list(tokens[begin:end]), seq, all_hidden=all_hidden, **text_opts)
    return model.eval_image(np.asarray(rows_of(img.image)), img.image.merged_hw, pad, seq, token=img.token,
                            skip=begin - img.start, all_hidden=all_hidden)


def find_images(tokens: Sequence[int], images: dict[int, PreparedImage]) -> list[PlacedImage]:
    """Where the images of `images` (by their `image_token`) lie in a token list made by
    `place_images`: each run of an image's token, n_tokens at a time."""
    arr = np.asarray(tokens, dtype=np.int64)
    idx = np.flatnonzero(arr < 0)
    placed: list[PlacedImage] = []
    i = 0
    while i < idx.size:
        start = int(idx[i])
        img = images.get(int(arr[start]))
        if img is None:
            raise ImageError(f"position {start} of the prompt holds an image that is not attached")
        placed.append(PlacedImage(start, img, int(arr[start])))
        i = int(np.searchsorted(idx, start + img.n_tokens))
    return placed
