"""Writes small synthetic Qwen3-Next GGUF files that look exactly like converted real ones.

Tests need models that exercise every code path (both head layouts, legacy `ssm_in`, tied output,
MTP, every weight type) without downloading weights, and benchmarks need a bigger one of the same
shape. Keys, tensor names, shapes and stored conventions (norms saved as 1 + w, `ssm_a` saved as
-exp(A_log), routers and small tensors kept F32) follow `shared/docs/qwen3next-gguf.md`, so the
same loader and graph serve real files.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Callable, Protocol, TypeVar

import gguf
import numpy as np

from deltarun.model_files.vocab import TinyVocab, vocab_named

ARCH = "qwen3next"

#: Weight types the generator writes, by their command-line name.
WEIGHT_TYPES: dict[str, gguf.GGMLQuantizationType] = {
    "f32": gguf.GGMLQuantizationType.F32,
    "f16": gguf.GGMLQuantizationType.F16,
    "bf16": gguf.GGMLQuantizationType.BF16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q4_k": gguf.GGMLQuantizationType.Q4_K,
    "q5_k": gguf.GGMLQuantizationType.Q5_K,
    "q6_k": gguf.GGMLQuantizationType.Q6_K,
}

# general.file_type values (llama_ftype) for the types above.
_FILE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7, "q4_k": 15, "q5_k": 17, "q6_k": 18, "bf16": 32}


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a synthetic model; names follow llama.cpp's hparams."""

    n_embd: int = 256
    n_layer: int = 4
    full_attention_interval: int = 4
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_rot: int = 16
    ssm_d_state: int = 32
    ssm_n_k_heads: int = 4
    ssm_n_v_heads: int = 8
    ssm_d_conv: int = 4
    n_expert: int = 8
    n_expert_used: int = 2
    n_ff_exp: int = 256
    n_ff_shexp: int = 256
    n_ctx_train: int = 4096
    rope_freq_base: float = 10_000_000.0
    rms_eps: float = 1e-6
    legacy_ssm_in: bool = False
    tied_output: bool = False
    merged_gate_up: bool = False
    n_mtp: int = 0
    write_recurrent_layers: bool = True
    #: Scales what each block adds to the residual stream. Near 0 the model "echoes": the final
    #: hidden state stays close to the current token's embedding, so with a tied LM head greedy
    #: decoding repeats the last token and n-gram / MTP drafts are accepted (speed-up measurements).
    residual_scale: float = 1.0
    #: Vocabulary the file carries (models/vocab.py VOCABS): "tiny" (2,330 tokens) or "qwen2" (the
    #: real 151,936-token vocabulary, read from llama.cpp's vocabulary file).
    vocab: str = "tiny"

    @property
    def recurrent(self) -> list[bool]:
        return [(i + 1) % self.full_attention_interval != 0 for i in range(self.n_layer)]

    @property
    def key_dim(self) -> int:
        return self.ssm_d_state * self.ssm_n_k_heads

    @property
    def value_dim(self) -> int:
        return self.ssm_d_state * self.ssm_n_v_heads


PRESETS: dict[str, ModelConfig] = {
    # Unit-test model: n_v_heads == 2 * n_k_heads, split attn_qkv/attn_gate, 3 linear + 1 full layer.
    "tiny": ModelConfig(),
    "tiny-eqheads": ModelConfig(ssm_n_k_heads=8, ssm_n_v_heads=8),
    "tiny-legacy": ModelConfig(legacy_ssm_in=True),
    "tiny-tied": ModelConfig(tied_output=True, merged_gate_up=True),
    "tiny-mtp": ModelConfig(n_mtp=1),
    # Drafts are mostly accepted on this one: it repeats its input (see residual_scale).
    "tiny-echo": ModelConfig(n_mtp=1, tied_output=True, residual_scale=0.02),
    # The graph page's benchmark: as many layers as Qwen3-Next-80B (48: 36 linear + 12 full attention),
    # narrow so the file stays small (the graph has the same nodes at any width).
    "tiny-48": ModelConfig(
        n_layer=48, n_embd=64, n_head=2, n_head_kv=1, head_dim=32, n_rot=8, ssm_d_state=16, ssm_n_k_heads=2,
        ssm_n_v_heads=4, n_expert=4, n_expert_used=2, n_ff_exp=64, n_ff_shexp=64,
    ),
    # Speed measurements: hidden 1024, 8 layers, 16 experts top-4.
    "bench": ModelConfig(
        n_embd=1024, n_layer=8, n_head=8, n_head_kv=2, head_dim=128, n_rot=32,
        ssm_d_state=128, ssm_n_k_heads=8, ssm_n_v_heads=16, n_expert=16, n_expert_used=4,
        n_ff_exp=512, n_ff_shexp=512,
    ),
}
# The bench shape with the real Qwen2/Qwen3-Next vocabulary (151,936 tokens): the embedding and
# LM head cost of a real small model (issue 16). Needs models/vocab.py's qwen2_vocab file.
PRESETS["bench-vocab151k"] = dataclasses.replace(PRESETS["bench"], vocab="qwen2")


def _block_tensors(cfg: ModelConfig, il: int, rng: np.random.Generator, recurrent: bool) -> dict[str, np.ndarray]:
    """Float32 weights of one block, numpy shapes (reverse of GGUF ne)."""
    E = cfg.n_embd
    depth_scale = cfg.residual_scale / np.sqrt(2.0 * max(cfg.n_layer, 1))

    def lin(n_out: int, n_in: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n_out, n_in)) * (scale / np.sqrt(n_in))).astype(np.float32)

    def norm(n: int) -> np.ndarray:  # stored as 1 + w
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    p = f"blk.{il}."
    t: dict[str, np.ndarray] = {p + "attn_norm.weight": norm(E), p + "post_attention_norm.weight": norm(E)}
    if recurrent:
        S, nk, nv = cfg.ssm_d_state, cfg.ssm_n_k_heads, cfg.ssm_n_v_heads
        r = nv // nk
        q, k, v, z = lin(cfg.key_dim, E), lin(cfg.key_dim, E), lin(cfg.value_dim, E), lin(cfg.value_dim, E)
        if cfg.legacy_ssm_in:
            groups = []
            for g in range(nk):
                groups += [q[g * S:(g + 1) * S], k[g * S:(g + 1) * S],
                           v[g * r * S:(g + 1) * r * S], z[g * r * S:(g + 1) * r * S]]
            t[p + "ssm_in.weight"] = np.concatenate(groups, axis=0)
        else:
            t[p + "attn_qkv.weight"] = np.concatenate([q, k, v], axis=0)
            t[p + "attn_gate.weight"] = z
        t[p + "ssm_ba.weight"] = lin(2 * nv, E)
        conv_dim = 2 * cfg.key_dim + cfg.value_dim
        t[p + "ssm_conv1d.weight"] = (rng.standard_normal((conv_dim, cfg.ssm_d_conv)) * 0.5).astype(np.float32)
        t[p + "ssm_dt.bias"] = (rng.uniform(-1.0, 1.0, nv)).astype(np.float32)
        a_log = np.log(rng.uniform(1.0, 16.0, nv))
        t[p + "ssm_a"] = (-np.exp(a_log) * 0.1).astype(np.float32)
        t[p + "ssm_norm.weight"] = (1.0 + 0.1 * rng.standard_normal(S)).astype(np.float32)
        t[p + "ssm_out.weight"] = lin(E, cfg.value_dim, depth_scale)
    else:
        hd, nh, nkv = cfg.head_dim, cfg.n_head, cfg.n_head_kv
        t[p + "attn_q.weight"] = lin(2 * hd * nh, E)
        t[p + "attn_k.weight"] = lin(hd * nkv, E)
        t[p + "attn_v.weight"] = lin(hd * nkv, E)
        t[p + "attn_output.weight"] = lin(E, hd * nh, depth_scale)
        t[p + "attn_q_norm.weight"] = norm(hd)
        t[p + "attn_k_norm.weight"] = norm(hd)
    ne, ff, fs = cfg.n_expert, cfg.n_ff_exp, cfg.n_ff_shexp
    # A wide router keeps top-k margins clear, so tiny numeric noise does not swap experts.
    t[p + "ffn_gate_inp.weight"] = lin(ne, E, 4.0)
    gate = np.stack([lin(ff, E) for _ in range(ne)])
    up = np.stack([lin(ff, E) for _ in range(ne)])
    if cfg.merged_gate_up:
        t[p + "ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)
    else:
        t[p + "ffn_gate_exps.weight"] = gate
        t[p + "ffn_up_exps.weight"] = up
    t[p + "ffn_down_exps.weight"] = np.stack([lin(E, ff, depth_scale) for _ in range(ne)])
    t[p + "ffn_gate_inp_shexp.weight"] = lin(1, E, 2.0)[0]
    t[p + "ffn_gate_shexp.weight"] = lin(fs, E)
    t[p + "ffn_up_shexp.weight"] = lin(fs, E)
    t[p + "ffn_down_shexp.weight"] = lin(E, fs, depth_scale)
    return t


def model_tensors(cfg: ModelConfig, n_vocab: int, seed: int = 0) -> dict[str, np.ndarray]:
    """All float32 weights in file order; deterministic for a given config, vocabulary size and seed."""
    rng = np.random.default_rng(seed)
    E = cfg.n_embd
    t: dict[str, np.ndarray] = {
        "token_embd.weight": rng.standard_normal((n_vocab, E)).astype(np.float32),
        "output_norm.weight": (1.0 + 0.1 * rng.standard_normal(E)).astype(np.float32),
    }
    if not cfg.tied_output:
        # A large LM-head scale gives peaked distributions, so greedy choices have clear margins.
        t["output.weight"] = (rng.standard_normal((n_vocab, E)) * (4.0 / np.sqrt(E))).astype(np.float32)
    for il, rec in enumerate(cfg.recurrent):
        t.update(_block_tensors(cfg, il, rng, rec))
    for j in range(cfg.n_mtp):
        il = cfg.n_layer + j
        t.update(_block_tensors(cfg, il, rng, recurrent=False))
        p = f"blk.{il}.nextn."
        eh_proj = (rng.standard_normal((E, 2 * E)) / np.sqrt(2 * E)).astype(np.float32)
        if cfg.residual_scale < 1.0:  # echo models: the MTP block passes the token embedding through
            eh_proj = np.concatenate([np.eye(E, dtype=np.float32), eh_proj[:, E:] * cfg.residual_scale], axis=1)
        t[p + "eh_proj.weight"] = eh_proj
        t[p + "enorm.weight"] = (1.0 + 0.1 * rng.standard_normal(E)).astype(np.float32)
        t[p + "hnorm.weight"] = (1.0 + 0.1 * rng.standard_normal(E)).astype(np.float32)
        t[p + "shared_head_norm.weight"] = (1.0 + 0.1 * rng.standard_normal(E)).astype(np.float32)
    return t


def _keeps_f32(name: str, arr: np.ndarray) -> bool:
    """Tensors a converter leaves in F32 whatever the file type: 1-D ones, conv and routers."""
    return arr.ndim == 1 or "ssm_conv1d" in name or "ffn_gate_inp" in name or name.endswith(".ssm_a")


def quantize(arr: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Quantize rows with ggml's own `ggml_quantize_chunk`, so files match what ggml would write."""
    from deltarun.base.ggml_compat import ggml

    src = np.ascontiguousarray(arr, dtype=np.float32)
    n_per_row = src.shape[-1]
    nrows = src.size // n_per_row
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    row_bytes = n_per_row // block * type_size
    out = np.empty(nrows * row_bytes, dtype=np.uint8)
    src_p = src.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    written = ggml.ggml_quantize_chunk(int(qtype), src_p, out.ctypes.data, 0, nrows, n_per_row, None)
    assert written == out.size, (written, out.size)
    return out.reshape(*src.shape[:-1], row_bytes)


def storage_type(name: str, arr: np.ndarray, wtype: str) -> gguf.GGMLQuantizationType:
    """The type a tensor is stored in: the requested one, or the fallback a converter would use.

    Like llama.cpp's quantizer, a row length that is not a multiple of the type's block size
    falls back to Q8_0, then F16.
    """
    if _keeps_f32(name, arr):
        return gguf.GGMLQuantizationType.F32
    for qtype in (WEIGHT_TYPES[wtype], gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.F16):
        if arr.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
            return qtype
    return gguf.GGMLQuantizationType.F32


def chat_template() -> str:
    return resources.files("deltarun.model_files").joinpath("data/qwen3-chat-template.jinja").read_text()


def write_model(path: str | Path, config: ModelConfig | str = "tiny", wtype: str = "f32", seed: int = 0,
                name: str | None = None) -> Path:
    """Write a synthetic Qwen3-Next GGUF to `path` and return the path."""
    cfg, vocab = config_and_vocab(config, PRESETS, wtype)
    tensors = model_tensors(cfg, len(vocab.tokens), seed)
    return write_gguf(path, cfg, tensors, vocab, wtype, name or f"deltarun synthetic {ARCH} {wtype}")


def write_gguf(path: str | Path, cfg: ModelConfig, tensors: dict[str, np.ndarray], vocab: TinyVocab, wtype: str,
               name: str, extra: dict[str, str] | None = None) -> Path:
    """Write float32 `tensors` (GGUF names, numpy order) with `cfg`'s metadata and `vocab` as a
    converted Qwen3-Next file of weight type `wtype`; `extra` adds string keys (general.*)."""
    return write_gguf_file(path, ARCH, name, lambda w: _add_metadata(w, cfg, wtype, extra), tensors, wtype,
                           (vocab, "qwen2", chat_template()))


def _add_metadata(w: gguf.GGUFWriter, cfg: ModelConfig, wtype: str, extra: dict[str, str] | None) -> None:
    """The keys llama.cpp's converter writes for a Qwen3-Next config, after the file type and `extra`."""
    w.add_file_type(_FILE_TYPES[wtype])
    for key, value in (extra or {}).items():
        w.add_string(key, value)
    w.add_block_count(cfg.n_layer + cfg.n_mtp)
    w.add_context_length(cfg.n_ctx_train)
    w.add_embedding_length(cfg.n_embd)
    w.add_feed_forward_length(cfg.n_ff_exp * cfg.n_expert_used)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_eps)
    w.add_rope_freq_base(cfg.rope_freq_base)
    w.add_rope_dimension_count(cfg.n_rot)
    w.add_expert_count(cfg.n_expert)
    w.add_expert_used_count(cfg.n_expert_used)
    w.add_expert_feed_forward_length(cfg.n_ff_exp)
    w.add_expert_shared_feed_forward_length(cfg.n_ff_shexp)
    w.add_ssm_conv_kernel(cfg.ssm_d_conv)
    w.add_ssm_inner_size(cfg.value_dim)
    w.add_ssm_state_size(cfg.ssm_d_state)
    w.add_ssm_time_step_rank(cfg.ssm_n_v_heads)
    w.add_ssm_group_count(cfg.ssm_n_k_heads)
    w.add_full_attention_interval(cfg.full_attention_interval)
    if cfg.write_recurrent_layers:
        w.add_array(f"{ARCH}.attention.recurrent_layers", cfg.recurrent + [False] * cfg.n_mtp)
    if cfg.n_mtp:
        w.add_nextn_predict_layers(cfg.n_mtp)


def gguf_tensor_name(name: str, global_names: dict[str, str], block_names: dict[str, str]) -> str:
    """gguf-py's tensor map for one Hugging Face tensor name, as the converters use it: a whole-model
    tensor by `global_names`, a block's (`model.layers.N.X`) as `blk.N.` + `block_names[X]`;
    ValueError for a name the map does not know (the converter would stop there too)."""
    if name in global_names:
        return global_names[name]
    parts = name.split(".", 3)
    if parts[:2] != ["model", "layers"] or parts[3] not in block_names:
        raise ValueError(f"cannot map tensor {name!r}")
    return f"blk.{parts[2]}.{block_names[parts[3]]}"


class _HasVocab(Protocol):
    """A family's config: it names its vocabulary (models/vocab.py VOCABS)."""

    @property
    def vocab(self) -> str: ...


Config = TypeVar("Config", bound=_HasVocab)


def config_and_vocab(config: Config | str, presets: dict[str, Config], wtype: str) -> tuple[Config, TinyVocab]:
    """A family's config (given, or a preset's name) and the vocabulary it names, after checking
    that `wtype` is a weight type the generators write (before the vocabulary is read: the large
    ones come from files)."""
    cfg = presets[config] if isinstance(config, str) else config
    if wtype not in WEIGHT_TYPES:
        raise ValueError(f"unknown weight type {wtype!r}; choose from {', '.join(WEIGHT_TYPES)}")
    return cfg, vocab_named(cfg.vocab)


def write_gguf_file(path: str | Path, arch: str, name: str | None, add_keys: Callable[[gguf.GGUFWriter], None],
                    tensors: dict[str, np.ndarray], wtype: str,
                    tokenizer: tuple[TinyVocab, str, str] | None = None,
                    storage: Callable[[str, np.ndarray, str], gguf.GGMLQuantizationType] | None = None) -> Path:
    """What every synthetic writer does once its tensors and keys are known, in the converter's
    order: general.name (`name`, by default "deltarun synthetic {arch} {wtype}"), the family's keys
    (`add_keys`), the vocabulary under llama.cpp's tokenizer keys with the chat template
    (`tokenizer`: vocabulary, pre-tokenizer name, template; None for a file without one, such as an
    mmproj), then the float32 `tensors` at their storage types (`storage`, by default
    `storage_type`) quantised by ggml. Written to a temporary file that then replaces `path`, so a
    file at `path` is never half-written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    storage = storage or storage_type

    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(name or f"deltarun synthetic {arch} {wtype}")
    add_keys(w)
    if tokenizer is not None:
        vocab, pre, template = tokenizer
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(pre)
        w.add_token_list(vocab.tokens)
        w.add_token_types(vocab.token_types)
        w.add_token_merges(vocab.merges)
        w.add_bos_token_id(vocab.bos_id)
        w.add_eos_token_id(vocab.eos_id)
        w.add_pad_token_id(vocab.pad_id)
        w.add_add_bos_token(False)
        w.add_chat_template(template)

    for tname, arr in tensors.items():
        qtype = storage(tname, arr, wtype)
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(tname, arr)
        else:
            w.add_tensor(tname, quantize(arr, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path


#: The built-in model: a small Qwen3-Next with an MTP block trained on Shakespeare by
#: `models/train` (see `models/shakespeare-qwen3next.md`), shipped beside this module.
BUILTIN_MODEL = "shakespeare-qwen3next-q8_0.gguf"


def default_model_path() -> Path:
    """The built-in trained model that commands use when given no model."""
    return Path(__file__).resolve().parent / BUILTIN_MODEL


def ensure_default_model() -> Path:
    """The built-in trained model (shipped, never generated); FileNotFoundError if it is missing."""
    path = default_model_path()
    if not path.is_file():
        raise FileNotFoundError(f"the built-in model {path} is missing from this installation")
    return path


def tiny_model_path() -> Path:
    """Where the random tiny Q8_0 model lives: beside this module if writable, else the user cache."""
    here = Path(__file__).resolve().parent
    import os

    if os.access(here, os.W_OK):
        return here / "tiny-q8_0.gguf"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deltarun"
    return cache / "tiny-q8_0.gguf"


def ensure_tiny_model() -> Path:
    """The random tiny Q8_0 model (preset `tiny`), generated on first use: exact shapes for tests
    and overhead benchmarks."""
    path = tiny_model_path()
    if not path.exists():
        write_model(path, "tiny", "q8_0")
    return path


def config_with(**changes: object) -> ModelConfig:
    """A tiny config with some fields changed (handy in tests)."""
    return dataclasses.replace(PRESETS["tiny"], **changes)
