"""A chat request's images: the image parts `protocol` checked (data: URL bytes) made into the
`PreparedImage`s the worker evaluates, each part then naming its image by digest.

Runs in the handlers' thread pool (decoding and resizing are CPU work). Memory stays bounded: the
request body is (--max-body), the number of images is (MAX_IMAGES), and each image's size in image
tokens is checked from its header against the room the context has left, before its pixels are
decoded (`runner.images.load_image(max_tokens=...)`), so the pixels a request holds are at most
about a context's worth of image tokens.
"""

from __future__ import annotations

from typing import Any

from deltarun.apps.serve.protocol import ApiError, ChatRequest
from deltarun.base.errors import ImageError
from deltarun.base.vision import PreparedImage, VisionHParams
from deltarun.runner.images import load_image

#: images one request may carry (each is decoded and resized for every request that sends it)
MAX_IMAGES = 32


def image_parts(req: ChatRequest) -> list[dict[str, Any]]:
    """The image parts of a request's messages, in the order the template renders them."""
    return [p for m in req.messages if isinstance(m.get("content"), list)
            for p in m["content"] if p.get("type") == "image"]


def prepare_images(req: ChatRequest, hp: VisionHParams | None, max_tokens: int) -> list[PreparedImage]:
    """The request's images in prompt order, prepared for the tower `hp` (None: the server has no
    vision tower, and an image is a 400); each part is left as {"type": "image", "digest": ...}
    (what the template renders, and what keys its conversation's renderings). `max_tokens`: the
    image tokens all of them may take together. Preparing a request twice reuses its images."""
    parts = image_parts(req)
    if parts and hp is None:
        where = parts[0].get("param", "messages")
        raise ApiError(f"{where} is an image, but this server has no vision tower (start it with --mmproj FILE)",
                       param=where, code="unsupported_content")
    if len(parts) > MAX_IMAGES:
        raise ApiError(f"the request has {len(parts)} images; at most {MAX_IMAGES}", param="messages",
                       code="too_many_images")
    out: list[PreparedImage] = []
    left = max_tokens
    for part in parts:
        if "data" in part:
            where = part.pop("param", "messages")
            try:
                image = load_image(part.pop("data"), hp, name=where, max_tokens=max(left, 0))
            except ImageError as e:
                raise ApiError(str(e), param=where, code="invalid_image") from None
            part["digest"] = image.digest
            req.images[image.digest] = image
        image = req.images[part["digest"]]
        out.append(image)
        left -= image.n_tokens
    return out

