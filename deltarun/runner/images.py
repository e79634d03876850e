"""Image files to `PreparedImage`s, as the Hugging Face Qwen2-VL / Qwen3-VL image processor does it.

Decoding (Pillow): PNG, JPEG, WebP and GIF (its first frame), converted to RGB the way
transformers' `convert_to_rgb` does (transparent pixels composited over white). Anything else, a
corrupt or truncated file, or one whose header announces more than `MAX_PIXELS` pixels (checked
before decoding, so memory stays bounded), is one `ImageError`.

Preprocessing (the slow, PIL-based `Qwen2VLImageProcessor`): `smart_resize` to sides that are
multiples of patch x merge within [min_pixels, max_pixels], bicubic resize of the uint8 image,
rescale by 1/255, normalise with the mmproj's mean and std. The pixel bounds default to Qwen3-VL's
published processor (`size`: shortest_edge 65,536, longest_edge 16,777,216); llama.cpp uses 8 to
4096 merged tokens instead (docs/mmproj-qwen3vl.md).
"""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Callable

import numpy as np
from PIL import Image, UnidentifiedImageError

from deltarun.base.errors import ImageError
from deltarun.base.vision import PreparedImage, VisionHParams

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
#: decoded pixels an image may announce (about 8,200 x 8,200); larger ones are refused undecoded
MAX_PIXELS = 1 << 26
#: bytes an image file may have
MAX_FILE_BYTES = 64 << 20
MIN_PIXELS_DEFAULT = 65_536
MAX_PIXELS_DEFAULT = 16_777_216
MAX_ASPECT = 200


def read_image_bytes(path: str | Path) -> bytes:
    """The bytes of an image file, or one clear error (missing, unreadable, too large)."""
    p = Path(path)
    try:
        size = p.stat().st_size
        if not p.is_file():
            raise ImageError(f"{p}: not a regular file (pass the path of an image)")
        if size > MAX_FILE_BYTES:
            raise ImageError(f"{p}: {size / 2**20:.0f} MiB is larger than the {MAX_FILE_BYTES >> 20} MiB an image "
                             f"may have")
        return p.read_bytes()
    except FileNotFoundError:
        raise ImageError(f"{p}: no such image file") from None
    except OSError as e:
        raise ImageError(f"{p}: cannot read the image ({e.strerror or e})") from None


def decode_image(data: bytes, name: str = "image", check_size: Callable[[int, int], None] | None = None) -> Image.Image:
    """Decode PNG / JPEG / WebP / GIF bytes to an RGB image (GIF: the first frame). `check_size(w, h)`
    sees the size the header announces before the pixels are decoded (and may refuse it)."""
    if len(data) > MAX_FILE_BYTES:
        raise ImageError(f"{name}: {len(data) / 2**20:.0f} MiB is larger than the {MAX_FILE_BYTES >> 20} MiB an "
                         f"image may have")
    try:
        img = Image.open(io.BytesIO(data), formats=list(FORMATS))
    except UnidentifiedImageError:
        raise ImageError(f"{name}: not an image deltarun can read (PNG, JPEG, WebP or GIF)") from None
    except Image.DecompressionBombError:
        raise ImageError(f"{name}: the image has more than the {MAX_PIXELS:,} pixels an image may have; "
                         f"scale it down") from None
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"{name}: corrupt image ({e})") from None
    w, h = img.size
    if w <= 0 or h <= 0:
        raise ImageError(f"{name}: the image is empty ({w} x {h})")
    if w * h > MAX_PIXELS:
        raise ImageError(f"{name}: {w} x {h} pixels is more than the {MAX_PIXELS:,} an image may have; scale it down")
    if check_size is not None:
        check_size(w, h)
    try:
        img.seek(0)
        img.load()
        return _to_rgb(img)
    except (OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError) as e:
        raise ImageError(f"{name}: corrupt or truncated {img.format} image ({e})") from None


def _to_rgb(img: Image.Image) -> Image.Image:
    """transformers' `convert_to_rgb`: RGB as it is, anything else through RGBA over white."""
    if img.mode == "RGB":
        return img
    rgba = img.convert("RGBA")
    background = Image.new("RGBA", rgba.size, (255, 255, 255))
    return Image.alpha_composite(background, rgba).convert("RGB")


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The Qwen2-VL image processor's target size: sides multiples of `factor`, area within bounds,
    aspect kept as nearly as the grid allows."""
    if max(height, width) / min(height, width) > MAX_ASPECT:
        raise ImageError(f"a {width} x {height} image has an aspect ratio above {MAX_ASPECT}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def prepare_image(img: Image.Image, hp: VisionHParams, min_pixels: int = MIN_PIXELS_DEFAULT,
                  max_pixels: int = MAX_PIXELS_DEFAULT) -> PreparedImage:
    """Resize and normalise a decoded RGB image for the tower `hp`."""
    if not 0 < min_pixels <= max_pixels:
        raise ImageError(f"image pixel bounds must satisfy 0 < min ({min_pixels}) <= max ({max_pixels})")
    w, h = img.size
    th, tw = smart_resize(h, w, hp.align, min_pixels, max_pixels)
    if (tw, th) != (w, h):
        img = img.resize((tw, th), resample=Image.Resampling.BICUBIC, reducing_gap=None)
    x = np.asarray(img, dtype=np.uint8).astype(np.float64) * (1.0 / 255.0)
    x = x.astype(np.float32)
    mean = np.asarray(hp.image_mean, dtype=np.float32)
    std = np.asarray(hp.image_std, dtype=np.float32)
    x = (x - mean) / std
    return PreparedImage(np.ascontiguousarray(x.transpose(2, 0, 1)), hp.patch_size, hp.n_merge)


def image_tokens(width: int, height: int, hp: VisionHParams, min_pixels: int = MIN_PIXELS_DEFAULT,
                 max_pixels: int = MAX_PIXELS_DEFAULT) -> int:
    """Image tokens a width x height image becomes (the merged grid of its `smart_resize` size)."""
    th, tw = smart_resize(height, width, hp.align, min_pixels, max_pixels)
    return (th // hp.align) * (tw // hp.align)


def load_image(source: str | Path | bytes, hp: VisionHParams, min_pixels: int = MIN_PIXELS_DEFAULT,
               max_pixels: int = MAX_PIXELS_DEFAULT, *, name: str | None = None,
               max_tokens: int | None = None) -> PreparedImage:
    """A file path (or the bytes of one) to a prepared image. `max_tokens`: an image that would
    become more image tokens is refused from its header, before its pixels are decoded (a server
    bounds the memory a request's images take by the context)."""
    def check_size(w: int, h: int) -> None:
        n = image_tokens(w, h, hp, min_pixels, max_pixels)
        if max_tokens is not None and n > max_tokens:
            raise ImageError(f"{label}: a {w} x {h} image is {n} image tokens; at most {max_tokens} fit")
    data = source if isinstance(source, bytes) else read_image_bytes(source)
    label = name or ("image" if isinstance(source, bytes) else str(source))
    return prepare_image(decode_image(data, label, check_size), hp, min_pixels, max_pixels)
