"""A prompt with images, evaluated as the Qwen3-VL / Qwen3.5 processor lays it out.

Each image becomes `<|vision_start|>`, one `<|image_pad|>` per image token, `<|vision_end|>` (what
the chat template and the processor write); the text model takes the image's embedding rows in place
of the pad tokens (`Model.eval_image`). In a raw prompt, images go where llama.cpp's marker
`<__media__>` stands, one marker per image, or before the text when there is none.
"""

from __future__ import annotations

import numpy as np

from deltarun.base.errors import DeltarunError, ImageError
from deltarun.base.vision import PreparedImage
from deltarun.runner.model import Model
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
                        seq: int = 0) -> list[int]:
    """Evaluate the prompt up to and including its last image into sequence `seq`; return the tokens
    left to evaluate (the text after the last image, starting with <|vision_end|>)."""
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
    for piece, img, emb in zip(pieces, images, rows):
        pending += model.tokenizer.encode(piece) + [start]
        model.eval(pending, seq)
        model.eval_image(np.asarray(emb), img.merged_hw, pad, seq)
        pending = [end]
    return pending + model.tokenizer.encode(pieces[-1])
