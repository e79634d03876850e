"""Writes synthetic Qwen3.5 vision towers as mmproj GGUF files, the way llama.cpp's converter does.

As models/qwen35.py does for the text model, in two steps: `hf_weights(cfg, seed)` makes what a
`Qwen3_5ForConditionalGeneration` checkpoint holds under `model.visual.*` (torch names and shapes),
and `convert(cfg, hf)` does what `conversion/qwen3vl.py: Qwen3VLVisionModel` (llama.cpp, vendored in
llama-cpp-python 0.3.36) does to them: `model.visual.` -> `visual.`, the Conv3D patch kernel split
along its temporal axis into `v.patch_embd.weight` / `.weight.1`, the merger to `v.post_ln` /
`mm.0` / `mm.2`, deepstack mergers to `v.deepstack.{block}.*`, blocks through gguf's tensor map
(`v.blk.N.ln1`, `attn_qkv`, `attn_out`, `ln2`, `ffn_up`, `ffn_down`). Values are stored as they are.
Keys and storage types: docs/mmproj-qwen3vl.md. `write_vlm(dir, ...)` pairs an mmproj with a
tiny qwen35 text model whose hidden size matches the projector's output.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from deltarun.model_files import qwen35
from deltarun.model_files.generate import _FILE_TYPES, write_gguf_file

PROJECTOR_TYPE = "qwen3vl_merger"


@dataclass(frozen=True)
class VisionConfig:
    """`Qwen3_5VisionConfig` fields (configuration_qwen3_5.py), plus Qwen3-VL's deepstack indexes and
    the processor's mean/std."""

    depth: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 256          # = the text model's hidden size
    num_position_embeddings: int = 16   # a 4 x 4 learned grid, resampled to each image
    #: Qwen3-VL's deepstack taps (block indexes); Qwen3.5 has none
    deepstack_visual_indexes: tuple[int, ...] = ()
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    #: the text config's rms_norm_eps, which the converter writes as the vision layer-norm eps
    text_rms_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def grid_side(self) -> int:
        return int(round(self.num_position_embeddings ** 0.5))

    @property
    def image_size(self) -> int:
        """What `Qwen3VLVisionModel.__init__` computes when the config has no image_size."""
        return int(self.num_position_embeddings ** 0.5 * self.patch_size)


VISION_PRESETS: dict[str, VisionConfig] = {
    "tiny-vision": VisionConfig(),
    # Qwen3-VL-style deepstack taps after blocks 0 and 1 (graph tests; qwen35 text models refuse them)
    "tiny-vision-deepstack": VisionConfig(depth=3, deepstack_visual_indexes=(0, 1)),
    # The vision shapes of Qwen/Qwen3.5-0.8B (its config.json's vision_config, quoted verbatim in
    # public test fixtures found with the code search, e.g. find_string '"out_hidden_size": 1024'):
    # 12 blocks of 768 (12 heads of 64), FFN 3072, patch 16, merge 2, a 48 x 48 learned position
    # grid, projection to the text model's 1024, no deepstack. Random weights (bench/mtmd_encode.py).
    "bench-vision": VisionConfig(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12,
                                 out_hidden_size=1024, num_position_embeddings=2304),
}


def hf_weights(cfg: VisionConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 weights named and shaped as the `model.visual.*` part of a Qwen3.5 checkpoint."""
    rng = np.random.default_rng(seed + 1000)
    H, F, P = cfg.hidden_size, cfg.intermediate_size, cfg.patch_size
    M = H * cfg.spatial_merge_size ** 2

    def lin(n_out: int, n_in: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) * (scale / np.sqrt(n_in))).astype(np.float32)

    def vec(n: int, scale: float = 0.1, centre: float = 0.0) -> np.ndarray:
        return (centre + scale * rng.standard_normal(n)).astype(np.float32)

    p = "model.visual."
    fan_in = cfg.in_channels * cfg.temporal_patch_size * P * P
    w: dict[str, np.ndarray] = {
        p + "patch_embed.proj.weight": (rng.standard_normal((H, cfg.in_channels, cfg.temporal_patch_size, P, P))
                                        / np.sqrt(fan_in)).astype(np.float32),
        p + "patch_embed.proj.bias": vec(H),
        p + "pos_embed.weight": (0.5 * rng.standard_normal((cfg.num_position_embeddings, H))).astype(np.float32),
    }
    for i in range(cfg.depth):
        b = f"{p}blocks.{i}."
        w.update({
            b + "norm1.weight": vec(H, 0.1, 1.0), b + "norm1.bias": vec(H),
            b + "norm2.weight": vec(H, 0.1, 1.0), b + "norm2.bias": vec(H),
            b + "attn.qkv.weight": lin(3 * H, H), b + "attn.qkv.bias": vec(3 * H),
            b + "attn.proj.weight": lin(H, H, 0.5), b + "attn.proj.bias": vec(H),
            b + "mlp.linear_fc1.weight": lin(F, H), b + "mlp.linear_fc1.bias": vec(F),
            b + "mlp.linear_fc2.weight": lin(H, F, 0.5), b + "mlp.linear_fc2.bias": vec(H),
        })
    w.update({
        p + "merger.norm.weight": vec(H, 0.1, 1.0), p + "merger.norm.bias": vec(H),
        p + "merger.linear_fc1.weight": lin(M, M), p + "merger.linear_fc1.bias": vec(M),
        p + "merger.linear_fc2.weight": lin(cfg.out_hidden_size, M), p + "merger.linear_fc2.bias": vec(cfg.out_hidden_size),
    })
    for j, _ in enumerate(cfg.deepstack_visual_indexes):
        d = f"{p}deepstack_merger_list.{j}."
        w.update({
            d + "norm.weight": vec(M, 0.1, 1.0), d + "norm.bias": vec(M),
            d + "linear_fc1.weight": lin(M, M), d + "linear_fc1.bias": vec(M),
            d + "linear_fc2.weight": lin(cfg.out_hidden_size, M), d + "linear_fc2.bias": vec(cfg.out_hidden_size),
        })
    return w


_BLOCK_NAMES = {"norm1": "ln1", "norm2": "ln2", "attn.qkv": "attn_qkv", "attn.proj": "attn_out",
                "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down"}
_DEEPSTACK_NAMES = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}


def gguf_name(cfg: VisionConfig, hf_name: str) -> str:
    """The mmproj name of one `model.visual.*` tensor (the patch kernel excepted: it is split)."""
    name = hf_name.removeprefix("model.")
    if not name.startswith("visual."):
        raise ValueError(f"not a vision tensor: {hf_name!r}")
    rest = name.removeprefix("visual.")
    module, _, suffix = rest.rpartition(".")
    if rest.startswith("blocks."):
        _, bid, inner = module.split(".", 2)
        return f"v.blk.{bid}.{_BLOCK_NAMES[inner]}.{suffix}"
    if rest.startswith("deepstack_merger_list."):
        _, j, inner = module.split(".", 2)
        return f"v.deepstack.{cfg.deepstack_visual_indexes[int(j)]}.{_DEEPSTACK_NAMES[inner]}.{suffix}"
    fixed = {"merger.norm": "v.post_ln", "merger.linear_fc1": "mm.0", "merger.linear_fc2": "mm.2",
             "patch_embed.proj": "v.patch_embd", "pos_embed": "v.position_embd"}
    if module not in fixed:
        raise ValueError(f"cannot map tensor {hf_name!r}")
    return f"{fixed[module]}.{suffix}"


def convert(cfg: VisionConfig, hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """mmproj tensors (numpy order, float32) from HF tensors, as `Qwen3VLVisionModel.modify_tensors`."""
    out: dict[str, np.ndarray] = {}
    for name, x in hf.items():
        x = np.asarray(x, dtype=np.float32)
        if name.endswith("patch_embed.proj.weight"):
            if x.shape[2] != 2:
                raise ValueError("the converter supports temporal_patch_size 2 only")
            out["v.patch_embd.weight"] = np.ascontiguousarray(x[:, :, 0])
            out["v.patch_embd.weight.1"] = np.ascontiguousarray(x[:, :, 1])
            continue
        out[gguf_name(cfg, name)] = np.ascontiguousarray(x)
    return out


def storage_type(name: str, arr: np.ndarray, wtype: str) -> gguf.GGMLQuantizationType:
    """`ModelBase.prepare_tensors` + `MmprojModel.tensor_force_quant` for one tensor."""
    T = gguf.GGMLQuantizationType
    if ".patch_embd.weight" in name:
        return T.F16 if wtype == "f16" else T.F32
    if arr.ndim <= 1 or name.endswith("_norm.weight") or name.startswith("v.position_embd") \
            or name[-7:] != ".weight":
        return T.F32
    return {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0}[wtype]


MMPROJ_TYPES = ("f32", "f16", "bf16", "q8_0")


def write_mmproj(path: str | Path, cfg: VisionConfig | str = "tiny-vision", wtype: str = "f32",
                 seed: int = 0) -> Path:
    """Write a synthetic mmproj GGUF to `path` and return the path."""
    cfg = VISION_PRESETS[cfg] if isinstance(cfg, str) else cfg
    if wtype not in MMPROJ_TYPES:
        raise ValueError(f"unknown mmproj type {wtype!r}; choose from {', '.join(MMPROJ_TYPES)}")
    return write_gguf_file(path, "clip", f"deltarun synthetic mmproj {wtype}", lambda w: _add_keys(w, cfg, wtype),
                           convert(cfg, hf_weights(cfg, seed)), wtype, storage=storage_type)


def _add_keys(w: gguf.GGUFWriter, cfg: VisionConfig, wtype: str) -> None:
    """The keys of `MmprojModel` and `Qwen3VLVisionModel.set_gguf_parameters` (after general.name)."""
    w.add_string("general.type", "mmproj")
    w.add_uint32("general.file_type", int(_FILE_TYPES[wtype]))
    # MmprojModel.set_gguf_parameters
    w.add_bool("clip.has_vision_encoder", True)
    w.add_uint32("clip.vision.projection_dim", cfg.out_hidden_size)
    w.add_uint32("clip.vision.image_size", cfg.image_size)
    w.add_uint32("clip.vision.patch_size", cfg.patch_size)
    w.add_uint32("clip.vision.embedding_length", cfg.hidden_size)
    w.add_uint32("clip.vision.feed_forward_length", cfg.intermediate_size)
    w.add_uint32("clip.vision.block_count", cfg.depth)
    w.add_uint32("clip.vision.attention.head_count", cfg.num_heads)
    w.add_array("clip.vision.image_mean", [float(v) for v in cfg.image_mean])
    w.add_array("clip.vision.image_std", [float(v) for v in cfg.image_std])
    # Qwen3VLVisionModel.set_gguf_parameters
    w.add_string("clip.projector_type", PROJECTOR_TYPE)
    w.add_bool("clip.use_gelu", True)
    w.add_uint32("clip.vision.spatial_merge_size", cfg.spatial_merge_size)
    w.add_float32("clip.vision.attention.layer_norm_epsilon", cfg.text_rms_norm_eps)
    w.add_array("clip.vision.is_deepstack_layers", [i in cfg.deepstack_visual_indexes for i in range(cfg.depth)])


def vision_for(text: qwen35.Qwen35Config, preset: str = "tiny-vision", **changes: object) -> VisionConfig:
    """A vision preset whose projector output matches a text config's hidden size (and eps)."""
    return dataclasses.replace(VISION_PRESETS[preset], out_hidden_size=text.hidden_size,
                               text_rms_norm_eps=text.rms_norm_eps, **changes)


def hf_vlm_config(text: qwen35.Qwen35Config, vision: VisionConfig, n_vocab: int, token_ids: dict[str, int]) -> dict[str, object]:
    """The config.json of a `Qwen3_5ForConditionalGeneration` checkpoint with `hf_vlm_weights`: the
    text model's fields under `text_config`, the tower's under `vision_config`, and the ids of the
    vocabulary's `image_pad`, `video_pad`, `vision_start` and `vision_end` tokens."""
    text_config = {k: v for k, v in qwen35.hf_config(text, n_vocab).items() if k != "architectures"}
    vision_config = {
        "model_type": "qwen3_5_vision", "depth": vision.depth, "hidden_size": vision.hidden_size,
        "intermediate_size": vision.intermediate_size, "num_heads": vision.num_heads, "in_channels": vision.in_channels,
        "patch_size": vision.patch_size, "spatial_merge_size": vision.spatial_merge_size,
        "temporal_patch_size": vision.temporal_patch_size, "out_hidden_size": vision.out_hidden_size,
        "num_position_embeddings": vision.num_position_embeddings, "hidden_act": "gelu_pytorch_tanh",
    }
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "text_config": text_config, "vision_config": vision_config,
            "image_token_id": token_ids["image_pad"], "video_token_id": token_ids["video_pad"],
            "vision_start_token_id": token_ids["vision_start"], "vision_end_token_id": token_ids["vision_end"],
            "tie_word_embeddings": text.tie_word_embeddings}


def hf_vlm_weights(text: dict[str, np.ndarray], vision: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A `Qwen3_5ForConditionalGeneration` checkpoint's weights from the text model's
    (`qwen35.hf_weights`, whose `model.*` go under `model.language_model.*`; the MTP block, which
    transformers does not run, left out) and the tower's (`model.visual.*`)."""
    out = {("model.language_model." + k.removeprefix("model.") if k.startswith("model.") else k): v
           for k, v in text.items() if not k.startswith("mtp.")}
    out.update(vision)
    return out


def write_vlm(folder: str | Path, text_preset: str = "tiny-qwen35", vision_preset: str = "tiny-vision",
              wtype: str = "f32", mmproj_type: str = "f32", seed: int = 0) -> tuple[Path, Path]:
    """A tiny vision-language pair as Hugging Face publishes it: the text GGUF and `mmproj-*.gguf`.
    Returns (text path, mmproj path)."""
    folder = Path(folder)
    text_cfg = qwen35.PRESETS[text_preset]
    text = qwen35.write_model(folder / f"{text_preset}-{wtype}.gguf", text_cfg, wtype, seed)
    mmproj = write_mmproj(folder / f"mmproj-{text_preset}-{mmproj_type}.gguf", vision_for(text_cfg, vision_preset),
                          mmproj_type, seed)
    return text, mmproj
