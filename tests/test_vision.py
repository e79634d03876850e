"""The Qwen3.5 vision tower (mmproj `qwen3vl_merger`): the ggml graph against a float64 reference
computed from Hugging Face-order weights (tests/reference_vision.py), the mmproj checks, and image
preprocessing (decoding, smart_resize, normalisation, bad files)."""

from __future__ import annotations

import io
import zlib
from pathlib import Path

import gguf
import numpy as np
import pytest
from PIL import Image

from deltarun.base.errors import DeltarunError, ImageError, ModelFileError, UnsupportedModelError
from deltarun.base.vision import PreparedImage
from deltarun.model_files import qwen35_vision as qv
from deltarun.runner import images
from deltarun.runner.vision import VisionEncoder

import reference_vision as rv

#: relative error bounds (Frobenius) of quantized mmproj embeddings, about 4x the median measured
#: on the tiny tower (f16 5.4e-4, bf16 3.9e-3, q8_0 1.4e-2; 6 random 64 x 96 images)
QUANT_BOUNDS = {"f16": 2.5e-3, "bf16": 1.6e-2, "q8_0": 6e-2}


@pytest.fixture(scope="module")
def mmproj_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mmproj")


def _mmproj(folder: Path, preset: str = "tiny-vision", wtype: str = "f32") -> Path:
    path = folder / f"{preset}-{wtype}.gguf"
    if not path.exists():
        qv.write_mmproj(path, preset, wtype)
    return path


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_gelu_tanh_matches_float64() -> None:
    """The blocks' GELU (silu(x s) / s, graphs/vision.py) against 0.5 x (1 + tanh(z)) in float64,
    over [-12, 12] and near 0: within 1.2e-6 of |x| and 2e-6 relative wherever the value is not
    tiny. The form 0.5 x (1 + tanh z) in float32 loses up to 5e-5 relative for negative x (1 + tanh
    cancels), and an F16 table (ggml_gelu) about 1e-3: either fails here."""
    import ctypes
    import math

    import ggml

    from deltarun.graphs.vision import gelu_tanh

    rng = np.random.default_rng(0)
    x = np.concatenate([3 * rng.standard_normal(20000), np.linspace(-12, 12, 10001),
                        1e-3 * rng.standard_normal(1000)]).astype(np.float32)
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=16 << 20, mem_buffer=None))
    try:
        t = ggml.ggml_new_tensor_1d(ctx, ggml.GGML_TYPE_F32, len(x))
        ctypes.memmove(ggml.ggml_get_data(t), x.ctypes.data, x.nbytes)
        out = gelu_tanh(ctx, t)
        gf = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(gf, out)
        ggml.ggml_graph_compute_with_ctx(ctx, gf, 2)
        got = np.ctypeslib.as_array(ctypes.cast(ggml.ggml_get_data(out), ctypes.POINTER(ctypes.c_float)),
                                    shape=(len(x),)).astype(np.float64)
    finally:
        ggml.ggml_free(ctx)
    x64 = x.astype(np.float64)
    want = 0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3)))
    err = np.abs(got - want)
    assert np.all(err <= 1.2e-6 * np.maximum(np.abs(x64), 1e-3)), float(np.max(err))
    big = np.abs(want) > 1e-3
    assert np.max(err[big] / np.abs(want[big])) < 2e-6


@pytest.mark.parametrize("preset", ["tiny-vision", "tiny-vision-deepstack"])
def test_embeddings_match_reference(mmproj_dir: Path, preset: str) -> None:
    """F32 embeddings within 1e-5 of the reference: the learned grid itself (4 x 4 patches), resampled
    up and down, non-square grids; with deepstack taps, their features after the merger's."""
    cfg = qv.VISION_PRESETS[preset]
    hf = qv.hf_weights(cfg)
    rng = np.random.default_rng(1)
    with VisionEncoder(_mmproj(mmproj_dir, preset), n_threads=2) as enc:
        assert enc.hp.out_dim == cfg.out_hidden_size * (1 + len(cfg.deepstack_visual_indexes))
        for h, w in [(64, 64), (64, 128), (160, 32), (32, 32)]:
            img = rng.uniform(-1, 1, (3, h, w)).astype(np.float32)
            ref, grid = rv.vision_forward(hf, cfg, img)
            out = enc.encode(PreparedImage(img, cfg.patch_size, cfg.spatial_merge_size))
            assert out.shape == ref.shape == ((h // 32) * (w // 32), enc.hp.out_dim)
            assert _rel(out, ref) < 1e-5, (h, w)


def test_embeddings_follow_the_image(mmproj_dir: Path) -> None:
    """A transposed image is another input, not the same embeddings re-ordered: rows and columns
    (rotary streams, patch order, position grid) are told apart."""
    cfg = qv.VISION_PRESETS["tiny-vision"]
    hf = qv.hf_weights(cfg)
    img = np.random.default_rng(2).uniform(-1, 1, (3, 64, 64)).astype(np.float32)
    flipped = np.ascontiguousarray(img.transpose(0, 2, 1))
    with VisionEncoder(_mmproj(mmproj_dir), n_threads=2) as enc:
        out = enc.encode(PreparedImage(flipped, 16, 2))
    assert _rel(out, rv.vision_forward(hf, cfg, flipped)[0]) < 1e-5
    assert _rel(out, rv.vision_forward(hf, cfg, img)[0]) > 1e-2


@pytest.mark.parametrize("wtype", sorted(QUANT_BOUNDS))
def test_quantized_mmproj_within_bounds(mmproj_dir: Path, wtype: str) -> None:
    cfg = qv.VISION_PRESETS["tiny-vision"]
    hf = qv.hf_weights(cfg)
    img = np.random.default_rng(3).uniform(-1, 1, (3, 64, 96)).astype(np.float32)
    ref = rv.vision_forward(hf, cfg, img)[0]
    with VisionEncoder(_mmproj(mmproj_dir, wtype=wtype), n_threads=2) as enc:
        out = enc.encode(PreparedImage(img, 16, 2))
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert 0 < err < QUANT_BOUNDS[wtype]


def test_mmproj_as_the_converter_writes_it(mmproj_dir: Path) -> None:
    """Names, shapes and types of converter-written files (conversion/qwen3vl.py, base.py)."""
    r = gguf.GGUFReader(str(_mmproj(mmproj_dir, wtype="f16")))
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["v.patch_embd.weight"] == types["v.patch_embd.weight.1"] == "F16"
    assert types["v.position_embd.weight"] == "F32" and types["v.blk.0.ln1.weight"] == "F32"
    assert types["v.blk.1.attn_qkv.weight"] == types["mm.2.weight"] == "F16"
    assert types["mm.0.bias"] == "F32"
    q8 = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(_mmproj(mmproj_dir, wtype="q8_0"))).tensors}
    assert q8["v.patch_embd.weight"] == "F32" and q8["mm.0.weight"] == "Q8_0"
    proj = r.fields["clip.projector_type"]
    assert bytes(proj.parts[proj.data[0]]).decode() == "qwen3vl_merger"


def _rewrite(src: Path, dst: Path, drop: str | None = None, key: tuple[str, str] | None = None) -> Path:
    """A copy of an mmproj without one tensor, or with one string key changed."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), "clip")
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name == "general.architecture":
            continue
        if key and f.name == key[0]:
            w.add_string(f.name, key[1])
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(f.name, f.contents())
        else:
            w.add_key_value(f.name, f.contents(), vt)
    for t in r.tensors:
        if t.name != drop:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_bad_mmproj_files(mmproj_dir: Path, tiny_model_path) -> None:
    good = _mmproj(mmproj_dir)
    with pytest.raises(ModelFileError, match="v.blk.1.ffn_up.weight"):
        VisionEncoder(_rewrite(good, mmproj_dir / "missing.gguf", drop="v.blk.1.ffn_up.weight"))
    with pytest.raises(UnsupportedModelError, match="projector type 'ldp'"):
        VisionEncoder(_rewrite(good, mmproj_dir / "other.gguf", key=("clip.projector_type", "ldp")))
    with pytest.raises(UnsupportedModelError, match="not an mmproj"):
        VisionEncoder(tiny_model_path("tiny-qwen35"))
    with VisionEncoder(good) as enc:
        enc.check_text_model(256, "qwen35")
        with pytest.raises(UnsupportedModelError, match="projects to 256 dimensions"):
            enc.check_text_model(128, "qwen35")
    with VisionEncoder(_mmproj(mmproj_dir, "tiny-vision-deepstack")) as enc:
        with pytest.raises(UnsupportedModelError, match="deepstack"):
            enc.check_text_model(256, "qwen35")


# --------------------------------------------------------------------------------------------
# preprocessing
# --------------------------------------------------------------------------------------------


def test_smart_resize_as_the_processor() -> None:
    """Values worked out by hand from Qwen2VLImageProcessor's smart_resize (factor 32)."""
    bounds = dict(factor=32, min_pixels=65_536, max_pixels=16_777_216)
    assert images.smart_resize(480, 640, **bounds) == (480, 640)
    assert images.smart_resize(500, 700, **bounds) == (512, 704)          # round to the grid
    assert images.smart_resize(100, 100, **bounds) == (256, 256)          # up to min_pixels: ceil(100*2.56/32)*32
    assert images.smart_resize(10_000, 3_000, factor=32, min_pixels=1024, max_pixels=1_000_000) == (1824, 544)
    with pytest.raises(ImageError, match="aspect ratio"):
        images.smart_resize(10, 3000, **bounds)


def _encoded(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


@pytest.fixture(scope="module")
def vision_hp(mmproj_dir: Path):
    with VisionEncoder(_mmproj(mmproj_dir)) as enc:
        return enc.hp


def test_normalised_pixels(vision_hp) -> None:
    """An image already on the grid is not resized: (v / 255 - mean) / std, channels first."""
    rng = np.random.default_rng(4)
    arr = rng.integers(0, 256, (256, 288, 3), dtype=np.uint8)
    prep = images.load_image(_encoded(Image.fromarray(arr), "PNG"), vision_hp)
    assert prep.pixels.shape == (3, 256, 288) and prep.grid == (1, 16, 18) and prep.n_tokens == 8 * 9
    np.testing.assert_allclose(prep.pixels, (arr.transpose(2, 0, 1) / 255.0 - 0.5) / 0.5, atol=1e-6)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_formats(vision_hp, fmt: str) -> None:
    rng = np.random.default_rng(5)
    arr = rng.integers(0, 256, (120, 200, 3), dtype=np.uint8)
    prep = images.load_image(_encoded(Image.fromarray(arr), fmt), vision_hp)
    h, w = images.smart_resize(120, 200, 32, images.MIN_PIXELS_DEFAULT, images.MAX_PIXELS_DEFAULT)
    assert prep.pixels.shape == (3, h, w) and prep.pixels.dtype == np.float32
    assert np.isfinite(prep.pixels).all() and -1.0 <= prep.pixels.min() and prep.pixels.max() <= 1.0


def test_gif_first_frame_and_transparency(vision_hp) -> None:
    red, blue = Image.new("RGB", (64, 64), (255, 0, 0)), Image.new("RGB", (64, 64), (0, 0, 255))
    buf = io.BytesIO()
    red.save(buf, format="GIF", save_all=True, append_images=[blue])
    prep = images.load_image(buf.getvalue(), vision_hp, min_pixels=64 * 64)
    assert np.allclose(prep.pixels[:, 10, 10], [1.0, -1.0, -1.0])
    clear = Image.new("RGBA", (64, 64), (0, 0, 0, 0))   # transparent: white, as convert_to_rgb
    prep = images.load_image(_encoded(clear, "PNG"), vision_hp, min_pixels=64 * 64)
    assert np.allclose(prep.pixels, 1.0)


def test_digest_follows_the_pixels(vision_hp) -> None:
    a = Image.new("RGB", (64, 64), (10, 20, 30))
    b = Image.new("RGB", (64, 64), (10, 20, 31))
    pa = images.load_image(_encoded(a, "PNG"), vision_hp, min_pixels=4096)
    assert pa.digest == images.load_image(_encoded(a, "WEBP", lossless=True), vision_hp, min_pixels=4096).digest
    assert pa.digest != images.load_image(_encoded(b, "PNG"), vision_hp, min_pixels=4096).digest


def test_bad_images(vision_hp, tmp_path: Path) -> None:
    png = _encoded(Image.new("RGB", (300, 200), (1, 2, 3)), "PNG")
    jpeg = _encoded(Image.fromarray(np.random.default_rng(6).integers(0, 256, (300, 200, 3), dtype=np.uint8)), "JPEG")
    with pytest.raises(ImageError, match="not an image"):
        images.load_image(b"this is text, not pixels", vision_hp)
    with pytest.raises(ImageError, match="corrupt|truncated"):
        images.load_image(png[: len(png) // 2], vision_hp)
    with pytest.raises(ImageError, match="corrupt|truncated"):
        images.load_image(jpeg[: len(jpeg) // 3], vision_hp)
    with pytest.raises(ImageError, match="not an image"):
        images.load_image(_encoded(Image.new("RGB", (8, 8)), "BMP"), vision_hp)
    # a header announcing 100,000 x 100,000 pixels is refused before any decoding
    huge = bytearray(png)
    huge[16:24] = (100_000).to_bytes(4, "big") + (100_000).to_bytes(4, "big")
    huge[29:33] = zlib.crc32(bytes(huge[12:29])).to_bytes(4, "big")   # the IHDR chunk's CRC
    with pytest.raises(ImageError, match="more than"):
        images.load_image(bytes(huge), vision_hp)
    with pytest.raises(ImageError, match="no such image"):
        images.load_image(tmp_path / "missing.png", vision_hp)
    assert issubclass(ImageError, DeltarunError) and ImageError.exit_code == 2
