"""The Qwen3-VL / Qwen3.5 vision tower (mmproj `clip.projector_type = qwen3vl_merger`) as a ggml graph.

    patches (merge-window order) -> W0 p + W1 p + b (the Conv3D over two equal frames)
      -> + learned position grid resampled bilinearly (align corners) to the image's patch grid
      -> n_layer x [ LayerNorm -> attention (fused qkv, 2D rotary, all patches) -> + residual
                     -> LayerNorm -> fc1 -> GELU(tanh) -> fc2 -> + residual  (-> deepstack tap) ]
      -> LayerNorm (v.post_ln) -> 4 patches per row -> mm.0 -> GELU(erf) -> mm.2
      -> embeddings [proj_dim x (1 + n_deepstack), n_tokens]

Facts, sources and where llama.cpp's `tools/mtmd/models/qwen3vl.cpp` differs: docs/mmproj-qwen3vl.md.
What is done differently from clip.cpp, and why:
* the patches are cut on the host in merge-window order and multiplied by the two 2-D kernels
  viewed as [3 P P, hidden] matrices: the same products as `ggml_conv_2d` with stride = kernel,
  without its im2col copy and the permutes that reorder patches afterwards;
* the position grid is resampled by gathering 4 rows per patch and weighting them (indices and
  weights computed on the host, already in merge-window order), the bilinear rule of transformers'
  `get_vision_interpolation_indices_and_weights`, exact in F32;
* the blocks' tanh GELU is built from `ggml_silu` (`gelu_tanh`): ggml's CPU `ggml_gelu` reads an
  F16 table (about 1e-3 relative); the mergers use the exact erf GELU (`nn.GELU()`), where
  llama.cpp uses the tanh one.
"""

from __future__ import annotations

import math
from typing import Any

import gguf
import numpy as np

from deltarun.base.errors import ModelFileError, UnsupportedModelError
from deltarun.base.ggml_util import Tensor, c_array, ctypes, ggml, set_name
from deltarun.base.gguf_file import GGUFFile
from deltarun.base.vision import PreparedImage, VisionGraph, VisionHParams
from deltarun.graphs.inputs import GraphInput

PROJECTOR = "qwen3vl_merger"
ROPE_THETA = 10000.0
REDO = "convert the model's vision tower again (convert_hf_to_gguf.py --mmproj)"


# --------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------


class _HostInput(GraphInput):
    """A text graph's `GraphInput` (named input tensors with host arrays) for one image size: its
    values follow from the image, not from a ubatch."""

    def bind(self) -> list[tuple[Tensor, int, int]]:   # type: ignore[override]
        return super().bind(None)  # type: ignore[arg-type]

    def set_input(self, image: PreparedImage) -> None:
        raise NotImplementedError


def merge_order(grid_h: int, grid_w: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of each patch in merge-window order: merged tokens row-major, each token's
    merge x merge patches row-major (the processor's `pixel_values` order)."""
    rr, cc = np.meshgrid(np.arange(grid_h), np.arange(grid_w), indexing="ij")

    def order(a: np.ndarray) -> np.ndarray:
        return a.reshape(grid_h // merge, merge, grid_w // merge, merge).swapaxes(1, 2).reshape(-1)

    return order(rr), order(cc)


class PatchesInput(_HostInput):
    """`inp_patches` [3 P P, n_patches]: each patch flattened (channel, row, col), merge order."""

    def __init__(self, ctx: Any, hp: VisionHParams, grid_h: int, grid_w: int):
        super().__init__()
        self.hp, self.gh, self.gw = hp, grid_h, grid_w
        P = hp.patch_size
        self.patches = self.new(ctx, "inp_patches", ggml.GGML_TYPE_F32, 3 * P * P, grid_h * grid_w)

    def set_input(self, image: PreparedImage) -> None:
        P, m = self.hp.patch_size, self.hp.n_merge
        x = np.asarray(image.pixels, dtype=np.float32)
        if x.shape != (3, self.gh * P, self.gw * P):
            raise ValueError(f"image of shape {x.shape} given to the graph of {self.gh} x {self.gw} patches")
        x = x.reshape(3, self.gh // m, m, P, self.gw // m, m, P).transpose(1, 4, 2, 5, 0, 3, 6)
        self.host["inp_patches"].reshape(self.gh // m, self.gw // m, m, m, 3, P, P)[...] = x


class PositionsInput(_HostInput):
    """Shape-only inputs: the 4 rope streams (row, col, row, col) and the position-grid resampling
    (4 gathered rows per patch and their bilinear weights, align corners)."""

    def __init__(self, ctx: Any, hp: VisionHParams, grid_h: int, grid_w: int):
        super().__init__()
        self.hp, self.gh, self.gw = hp, grid_h, grid_w
        n = grid_h * grid_w
        self.pos = self.new(ctx, "positions", ggml.GGML_TYPE_I32, 4 * n)
        self.grid_idx = self.new(ctx, "pos_grid_idx", ggml.GGML_TYPE_I32, 4 * n)
        self.grid_w = self.new(ctx, "pos_grid_w", ggml.GGML_TYPE_F32, 1, 4 * n)

    def bind(self) -> list[tuple[Tensor, int, int]]:
        out = super().bind()
        rows, cols = merge_order(self.gh, self.gw, self.hp.n_merge)
        if "positions" in self.host:
            self.host["positions"][:] = np.concatenate([rows, cols, rows, cols])
        idx, wts = bilinear_taps(self.hp.n_pos_side, self.gh, self.gw)
        if "pos_grid_idx" in self.host:
            self.host["pos_grid_idx"][:] = idx[:, rows, cols].reshape(-1)
        if "pos_grid_w" in self.host:
            self.host["pos_grid_w"].reshape(-1)[:] = wts[:, rows, cols].reshape(-1)
        return out

    def set_input(self, image: PreparedImage) -> None:
        """Shape-only: filled in `bind`."""


def bilinear_taps(n: int, gh: int, gw: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of an n x n grid and weights that resample it to gh x gw, bilinear with align corners:
    (indices [4, gh, gw], weights [4, gh, gw]) for the taps (floor, floor), (floor, ceil),
    (ceil, floor), (ceil, ceil) of the source coordinates linspace(0, n-1, gh) x linspace(0, n-1, gw)."""
    hs, ws = np.linspace(0, n - 1, gh), np.linspace(0, n - 1, gw)
    h0, w0 = hs.astype(np.int64), ws.astype(np.int64)
    h1, w1 = np.minimum(h0 + 1, n - 1), np.minimum(w0 + 1, n - 1)
    dh, dw = (hs - h0)[:, None], (ws - w0)[None, :]
    idx = np.stack([h0[:, None] * n + w0[None, :], h0[:, None] * n + w1[None, :],
                    h1[:, None] * n + w0[None, :], h1[:, None] * n + w1[None, :]])
    wts = np.stack([(1 - dh) * (1 - dw), (1 - dh) * dw, dh * (1 - dw), dh * dw])
    return idx.astype(np.int32), wts.astype(np.float32)


# --------------------------------------------------------------------------------------------
# the family
# --------------------------------------------------------------------------------------------


class Qwen3VLVision:
    """The vision tower of an mmproj with projector `qwen3vl_merger` (Qwen3-VL, Qwen3.5, Qwen3.6)."""

    projector = PROJECTOR

    def __init__(self, f: GGUFFile):
        self.file = f
        self.hp = self.read_hparams(f)
        self.validate(f)

    @staticmethod
    def read_hparams(f: GGUFFile) -> VisionHParams:
        def need(key: str) -> Any:
            v = f.get(key)
            if v is None:
                raise ModelFileError(f"{f.path}: required mmproj key {key!r} is missing; {REDO}")
            return v

        def positive(key: str, default: int | None = None, limit: int = 1 << 20) -> int:
            v = f.get(key, default) if default is not None else need(key)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= limit:
                raise ModelFileError(f"{f.path}: mmproj key {key!r} = {v!r} is not a positive integer; {REDO}")
            return v

        if not f.get("clip.has_vision_encoder", False):
            raise UnsupportedModelError(f"{f.path}: this mmproj has no vision encoder (clip.has_vision_encoder)")
        n_embd = positive("clip.vision.embedding_length")
        n_head = positive("clip.vision.attention.head_count")
        n_layer = positive("clip.vision.block_count", limit=1024)
        if n_embd % n_head or (n_embd // n_head) % 4:
            raise ModelFileError(f"{f.path}: vision width {n_embd} over {n_head} heads does not give a head size "
                                 f"divisible by 4 (2D rotary); {REDO}")
        pos = f.tensors.get("v.position_embd.weight")
        if pos is None or len(pos.ne) != 2:
            raise ModelFileError(f"{f.path}: required tensor 'v.position_embd.weight' is missing; {REDO}")
        side = int(round(math.sqrt(pos.ne[1])))
        if side * side != pos.ne[1]:
            raise ModelFileError(f"{f.path}: the learned position grid has {pos.ne[1]} entries, not a square; {REDO}")
        flags = f.get("clip.vision.is_deepstack_layers", []) or []
        if not isinstance(flags, list) or (flags and len(flags) != n_layer):
            raise ModelFileError(f"{f.path}: clip.vision.is_deepstack_layers has {len(flags)} entries for "
                                 f"{n_layer} blocks; {REDO}")
        mean = f.get("clip.vision.image_mean", [0.5, 0.5, 0.5])
        std = f.get("clip.vision.image_std", [0.5, 0.5, 0.5])
        if len(mean) != 3 or len(std) != 3 or any(not s > 0 for s in std):
            raise ModelFileError(f"{f.path}: clip.vision.image_mean / image_std must be 3 values (std > 0); {REDO}")
        eps = float(f.get("clip.vision.attention.layer_norm_epsilon", 1e-6))
        if not 0 < eps < 1:
            raise ModelFileError(f"{f.path}: clip.vision.attention.layer_norm_epsilon = {eps} is out of range; {REDO}")
        return VisionHParams(
            projector=PROJECTOR, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
            n_ff=positive("clip.vision.feed_forward_length"), patch_size=positive("clip.vision.patch_size", limit=1024),
            n_merge=positive("clip.vision.spatial_merge_size", 2, limit=16), eps=eps, n_pos_side=side,
            proj_dim=positive("clip.vision.projection_dim"),
            image_mean=tuple(float(v) for v in mean), image_std=tuple(float(v) for v in std),
            deepstack_layers=tuple(i for i, on in enumerate(flags) if on))

    def expected_tensors(self) -> dict[str, tuple[int, ...]]:
        """name -> ne of every tensor the graph reads."""
        hp = self.hp
        H, F, P, M, D = hp.n_embd, hp.n_ff, hp.patch_size, hp.n_embd * hp.n_merge ** 2, hp.proj_dim
        t: dict[str, tuple[int, ...]] = {
            "v.patch_embd.weight": (P, P, 3, H), "v.patch_embd.weight.1": (P, P, 3, H), "v.patch_embd.bias": (H,),
            "v.position_embd.weight": (H, hp.n_pos_side ** 2),
            "v.post_ln.weight": (H,), "v.post_ln.bias": (H,),
            "mm.0.weight": (M, M), "mm.0.bias": (M,), "mm.2.weight": (M, D), "mm.2.bias": (D,),
        }
        for il in range(hp.n_layer):
            p = f"v.blk.{il}."
            t.update({p + "ln1.weight": (H,), p + "ln1.bias": (H,), p + "ln2.weight": (H,), p + "ln2.bias": (H,),
                      p + "attn_qkv.weight": (H, 3 * H), p + "attn_qkv.bias": (3 * H,),
                      p + "attn_out.weight": (H, H), p + "attn_out.bias": (H,),
                      p + "ffn_up.weight": (H, F), p + "ffn_up.bias": (F,),
                      p + "ffn_down.weight": (F, H), p + "ffn_down.bias": (H,)})
        for il in hp.deepstack_layers:
            p = f"v.deepstack.{il}."
            t.update({p + "norm.weight": (M,), p + "norm.bias": (M,), p + "fc1.weight": (M, M), p + "fc1.bias": (M,),
                      p + "fc2.weight": (M, D), p + "fc2.bias": (D,)})
        return t

    def validate(self, f: GGUFFile) -> None:
        T = gguf.GGMLQuantizationType
        matmul = {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q4_K, T.Q5_K, T.Q6_K}
        for name, ne in self.expected_tensors().items():
            info = f.tensors.get(name)
            if info is None:
                raise ModelFileError(f"{f.path}: required tensor {name!r} is missing (expected shape {list(ne)}); {REDO}")
            if tuple(info.ne) != ne:
                raise ModelFileError(f"{f.path}: tensor {name!r} has shape {list(info.ne)}, expected {list(ne)}; {REDO}")
            qtype = T(info.ggml_type)
            if len(ne) == 1 and qtype != T.F32:
                raise ModelFileError(f"{f.path}: tensor {name!r} has type {qtype.name}; it must be F32; {REDO}")
            if name == "v.position_embd.weight" and qtype not in (T.F32, T.F16):
                raise ModelFileError(f"{f.path}: tensor {name!r} has type {qtype.name}; it must be F32 or F16; {REDO}")
            if len(ne) > 1 and qtype not in matmul:
                raise ModelFileError(f"{f.path}: tensor {name!r} has type {qtype.name}, which deltarun's vision "
                                     f"graph cannot multiply; {REDO}")

    def tensor_names(self) -> list[str]:
        return list(self.expected_tensors())

    def graph_size(self, grid_h: int, grid_w: int) -> int:
        return 256 + 64 * self.hp.n_layer + 16 * len(self.hp.deepstack_layers)

    # --- the graph ----------------------------------------------------------------------------
    def build(self, ctx: Any, gf: Any, w: dict[str, Tensor], grid_h: int, grid_w: int) -> VisionGraph:
        hp = self.hp
        m = hp.n_merge
        if grid_h % m or grid_w % m or grid_h <= 0 or grid_w <= 0:
            raise ValueError(f"a {grid_h} x {grid_w} patch grid is not a multiple of the merge size {m}")
        c = ctx
        n = grid_h * grid_w
        H, P = hp.n_embd, hp.patch_size
        patches = PatchesInput(ctx, hp, grid_h, grid_w)
        pos = PositionsInput(ctx, hp, grid_h, grid_w)

        def mm(weight: str, x: Tensor) -> Tensor:
            return ggml.ggml_add(c, ggml.ggml_mul_mat(c, w[weight + ".weight"], x), w[weight + ".bias"])

        def layer_norm(x: Tensor, weight: str) -> Tensor:
            x = ggml.ggml_norm(c, x, hp.eps)
            return ggml.ggml_add(c, ggml.ggml_mul(c, x, w[weight + ".weight"]), w[weight + ".bias"])

        # patch embedding: the two temporal kernels as [3 P P, H] matrices on the same patches
        k0 = ggml.ggml_reshape_2d(c, w["v.patch_embd.weight"], 3 * P * P, H)
        k1 = ggml.ggml_reshape_2d(c, w["v.patch_embd.weight.1"], 3 * P * P, H)
        x = ggml.ggml_add(c, ggml.ggml_mul_mat(c, k0, patches.patches), ggml.ggml_mul_mat(c, k1, patches.patches))
        x = set_name(ggml.ggml_add(c, x, w["v.patch_embd.bias"]), "patch_bias")
        # learned positions: 4 gathered grid rows per patch, weighted, summed
        taps = ggml.ggml_mul(c, ggml.ggml_get_rows(c, w["v.position_embd.weight"], pos.grid_idx), pos.grid_w)
        row = taps.contents.nb[1]
        for k in range(4):
            x = ggml.ggml_add(c, x, ggml.ggml_view_2d(c, taps, H, n, row, k * n * row))
        x = set_name(x, "inp_pos_emb")

        sections = c_array(ctypes.c_int, [hp.head_dim // 4] * 4)
        deep: list[Tensor] = []
        for il in range(hp.n_layer):
            p = f"v.blk.{il}."
            cur = set_name(layer_norm(x, p + "ln1"), f"attn_norm-{il}")
            cur = set_name(self._attention(c, mm, cur, pos.pos, sections, n, il), f"attn_out-{il}")
            x = ggml.ggml_add(c, x, cur)
            cur = set_name(layer_norm(x, p + "ln2"), f"ffn_norm-{il}")
            cur = set_name(mm(p + "ffn_down", gelu_tanh(c, mm(p + "ffn_up", cur))), f"ffn_out-{il}")
            x = set_name(ggml.ggml_add(c, x, cur), f"layer_out-{il}")
            if il in hp.deepstack_layers:
                q = f"v.deepstack.{il}."
                feat = layer_norm(ggml.ggml_reshape_2d(c, x, H * m * m, n // (m * m)), q + "norm")
                deep.append(set_name(mm(q + "fc2", ggml.ggml_gelu_erf(c, mm(q + "fc1", feat))), f"deepstack-{il}"))

        x = set_name(layer_norm(x, "v.post_ln"), "post_ln")
        x = ggml.ggml_reshape_2d(c, x, H * m * m, n // (m * m))
        emb = set_name(mm("mm.2", ggml.ggml_gelu_erf(c, mm("mm.0", x))), "merger_out")
        for feat in deep:
            emb = ggml.ggml_concat(c, emb, feat, 0)
        emb = set_name(emb, "embeddings")
        ggml.ggml_set_output(emb)
        ggml.ggml_build_forward_expand(gf, emb)
        return VisionGraph([patches, pos], {"embeddings": emb})

    def _attention(self, c: Any, mm: Any, cur: Tensor, positions: Tensor, sections: Any, n: int, il: int) -> Tensor:
        """Fused-qkv attention over every patch with 2D rotary (ggml's vision rope: pairs (i, i +
        head_dim/2), the first quarter of the frequencies on the row, the second on the column)."""
        hp = self.hp
        H, nh, hd = hp.n_embd, hp.n_head, hp.head_dim
        p = f"v.blk.{il}."
        qkv = set_name(mm(p + "attn_qkv", cur), f"qkv-{il}")
        fs = ggml.ggml_element_size(qkv)
        row = qkv.contents.nb[1]

        def part(i: int) -> Tensor:
            return ggml.ggml_view_3d(c, qkv, hd, nh, n, hd * fs, row, i * H * fs)

        def rope(t: Tensor) -> Tensor:
            return ggml.ggml_rope_multi(c, t, positions, None, hd // 2, sections, ggml.GGML_ROPE_TYPE_VISION,
                                        32768, ROPE_THETA, 1.0, 0.0, 1.0, 32.0, 1.0)

        q = ggml.ggml_permute(c, set_name(rope(part(0)), f"Qcur-{il}"), 0, 2, 1, 3)          # [hd, n, nh]
        k = ggml.ggml_permute(c, set_name(rope(part(1)), f"Kcur-{il}"), 0, 2, 1, 3)
        v = ggml.ggml_permute(c, part(2), 0, 2, 1, 3)
        # flash attention: memory linear in the patches (an n x n score matrix per head would
        # take 17 GB at 16,384 patches); F32 K and V keep F32 dot products and accumulation
        out = ggml.ggml_flash_attn_ext(c, q, k, v, None, 1.0 / math.sqrt(hd), 0.0, 0.0)   # [hd, nh, n]
        ggml.ggml_flash_attn_ext_set_prec(out, ggml.GGML_PREC_F32)
        out = ggml.ggml_reshape_2d(c, set_name(out, f"kqv-{il}"), H, n)
        return mm(p + "attn_out", out)


def gelu_tanh(c: Any, x: Tensor) -> Tensor:
    """0.5 x (1 + tanh(z)), z = sqrt(2/pi) (x + 0.044715 x^3), from exact F32 primitives (see the
    module doc). 0.5 (1 + tanh(z)) = sigmoid(2 z), and 2 z = x s with s = 2 sqrt(2/pi) (1 +
    0.044715 x^2) > 0, so the GELU is x sigmoid(x s) = silu(x s) / s: ggml's CPU silu is
    vectorised where its tanh calls tanhf per element (1.1 of 2.7 s for a 512 x 512 image at
    Qwen3.5-0.8B's vision shapes), and s never vanishes."""
    k = 2.0 * math.sqrt(2.0 / math.pi)
    s = ggml.ggml_scale_bias(c, ggml.ggml_sqr(c, x), k * 0.044715, k)
    return ggml.ggml_div(c, ggml.ggml_silu(c, ggml.ggml_mul(c, x, s)), s)
