"""Every way a GGUF file can be broken ends in deltarun's own error, never a crash.

Each fault is built from a generated tiny model (F32, or Q8_0 where tensor types matter), either by
editing bytes at positions found by walking the good file, or by rewriting it with
`gguf.GGUFWriter`. For each one, opening the model with `Model(path)` must raise the expected
`DeltarunError` subclass with a message that names the file and the problem, quickly and without
allocating much; and the `generate` command must exit with that error's exit code and no traceback
(in-process for all faults, in a real subprocess for a representative few).
"""

from __future__ import annotations

import math
import struct
import subprocess
import sys
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import pytest

from deltarun.base.errors import DeltarunError, ModelFileError, TokenizerError, UnsupportedModelError
from deltarun.model_files.generate import write_model
from deltarun.runner.model import Model

GV = gguf.GGUFValueType
QT = gguf.GGMLQuantizationType
SCALAR_SIZES = {GV.UINT8: 1, GV.INT8: 1, GV.BOOL: 1, GV.UINT16: 2, GV.INT16: 2, GV.UINT32: 4, GV.INT32: 4,
                GV.FLOAT32: 4, GV.UINT64: 8, GV.INT64: 8, GV.FLOAT64: 8}
ARCH = "qwen3next"


# --- where things are in a good file ------------------------------------------------------------
@dataclass
class KV:
    pos: int          # start of the entry (key length)
    type_pos: int     # the value type u32
    value_pos: int    # the value (for arrays: the item type u32, then the count u64)
    vtype: int


@dataclass
class TI:
    pos: int          # start of the tensor info (name length)
    ndims_pos: int
    dims_pos: int
    type_pos: int
    offset_pos: int
    ne: tuple[int, ...]
    offset: int       # the stored data offset (relative to the data section)


@dataclass
class Positions:
    size: int
    kv: dict[str, KV] = field(default_factory=dict)
    tensors: dict[str, TI] = field(default_factory=dict)
    infos_end: int = 0
    data_offset: int = 0


def walk(path: Path) -> Positions:
    """Byte positions of every field of a well-formed GGUF file (the test's own, independent parser)."""
    buf = path.read_bytes()
    pos = 24
    u32 = lambda p: struct.unpack_from("<I", buf, p)[0]  # noqa: E731
    u64 = lambda p: struct.unpack_from("<Q", buf, p)[0]  # noqa: E731
    n_tensors, n_kv = u64(8), u64(16)
    out = Positions(len(buf))

    def skip(p: int, t: int) -> int:
        if t == GV.STRING:
            return p + 8 + u64(p)
        if t == GV.ARRAY:
            it, n = u32(p), u64(p + 4)
            p += 12
            if it == GV.STRING:
                for _ in range(n):
                    p += 8 + u64(p)
                return p
            return p + n * SCALAR_SIZES[GV(it)]
        return p + SCALAR_SIZES[GV(t)]

    for _ in range(n_kv):
        start = pos
        klen = u64(pos)
        key = buf[pos + 8:pos + 8 + klen].decode()
        pos += 8 + klen
        t = u32(pos)
        out.kv[key] = KV(start, pos, pos + 4, t)
        pos = skip(pos + 4, t)
    for _ in range(n_tensors):
        start = pos
        nlen = u64(pos)
        name = buf[pos + 8:pos + 8 + nlen].decode()
        pos += 8 + nlen
        nd = u32(pos)
        ne = tuple(u64(pos + 4 + 8 * i) for i in range(nd))
        ti = TI(start, pos, pos + 4, pos + 4 + 8 * nd, pos + 8 + 8 * nd, ne, u64(pos + 8 + 8 * nd))
        out.tensors[name] = ti
        pos = ti.offset_pos + 8
    out.infos_end = pos
    out.data_offset = -(-pos // 32) * 32
    return out


# --- building faulty files ----------------------------------------------------------------------
def patch(src: Path, dst: Path, *edits: tuple[int, bytes]) -> None:
    data = bytearray(src.read_bytes())
    for at, raw in edits:
        data[at:at + len(raw)] = raw
    dst.write_bytes(bytes(data))


def truncate(src: Path, dst: Path, size: int) -> None:
    with src.open("rb") as f:
        dst.write_bytes(f.read(size))


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def rewrite(src: Path, dst: Path, *, arch: str | None = None, drop_keys: tuple[str, ...] = (),
            set_kv: dict[str, tuple[Any, ...]] | None = None,
            tensors: dict[str, Any] | None = None, extra_tensors: dict[str, Any] | None = None) -> None:
    """Copy `src` with gguf.GGUFWriter, changing metadata (key -> (value, type[, item type])) or tensors
    (name -> None to drop, an array, or (array, raw_dtype))."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), arch or r.fields["general.architecture"].contents())
    set_kv = set_kv or {}
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys or key in set_kv:
            continue
        sub = f.types[-1] if f.types[0] == GV.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for key, (value, vtype, *sub) in set_kv.items():
        w.add_key_value(key, value, vtype, sub_type=sub[0] if sub else None)
    tensors = tensors or {}
    for t in r.tensors:
        if t.name in tensors:
            new = tensors[t.name]
            if new is None:
                continue
            arr, qtype = new if isinstance(new, tuple) else (new, None)
            w.add_tensor(t.name, arr, raw_dtype=qtype)
        elif t.tensor_type in (QT.F32, QT.F16):
            w.add_tensor(t.name, np.asarray(t.data))
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    for name, arr in (extra_tensors or {}).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_one_clear_error(src: Path, tmp_path: Path, edit: dict[str, Any], message: str) -> None:
    """`src` rewritten with `edit` (rewrite's keywords) opens as one ModelFileError matching `message`."""
    bad = tmp_path / "bad.gguf"
    rewrite(src, bad, **edit)
    with pytest.raises(ModelFileError, match=message):
        Model(bad, n_ctx=64)


def tensor(src: Path, name: str) -> np.ndarray:
    r = gguf.GGUFReader(str(src))
    return np.array(next(t.data for t in r.tensors if t.name == name))


def metadata(src: Path, key: str) -> Any:
    return gguf.GGUFReader(str(src)).fields[key].contents()


def quantized(arr: np.ndarray, qtype: QT) -> tuple[np.ndarray, QT]:
    return gguf.quants.quantize(arr.astype(np.float32), qtype), qtype


# --- the faults ---------------------------------------------------------------------------------
Build = Callable[[Path, Positions, Path], None]


@dataclass(frozen=True)
class Fault:
    id: str
    build: Build
    error: type[DeltarunError]
    fragments: tuple[str, ...]
    base: str = "f32"            # which generated model the fault starts from: f32 or q8_0
    check_memory: bool = False   # also check that refusing the file allocates little


def kv_set(key: str, value: Any, vtype: GV, sub: GV | None = None) -> Build:
    spec = (value, vtype) if sub is None else (value, vtype, sub)
    return lambda src, pos, dst: rewrite(src, dst, set_kv={key: spec})


def hp(key: str, value: Any, vtype: GV = GV.UINT32) -> Build:
    return kv_set(f"{ARCH}.{key}", value, vtype)


def byte_edit(fn: Callable[[Positions], list[tuple[int, bytes]]]) -> Build:
    return lambda src, pos, dst: patch(src, dst, *fn(pos))


def whole_file(content: bytes) -> Build:
    return lambda src, pos, dst: dst.write_bytes(content)


def _drop_tensor(name: str) -> Build:
    return lambda src, pos, dst: rewrite(src, dst, tensors={name: None})


def _replace_tensor(name: str, make: Callable[[np.ndarray], Any]) -> Build:
    return lambda src, pos, dst: rewrite(src, dst, tensors={name: make(tensor(src, name))})


def _merges_plus(extra: list[str]) -> Build:
    return lambda src, pos, dst: rewrite(src, dst, set_kv={
        "tokenizer.ggml.merges": (metadata(src, "tokenizer.ggml.merges") + extra, GV.ARRAY, GV.STRING)})


def _rename_key(old: str, new: str) -> Build:
    assert len(old) == len(new)
    return byte_edit(lambda p: [(p.kv[old].pos + 8, new.encode())])


def _string_first_byte(key: str, byte: bytes, array: bool = False) -> Build:
    # a string value: u64 length then bytes; an array of strings: item type u32, count u64, then strings
    return byte_edit(lambda p: [(p.kv[key].value_pos + (12 + 8 if array else 8), byte)])


M, U, T = ModelFileError, UnsupportedModelError, TokenizerError
REDO = "re-download"

FAULTS: list[Fault] = [
    # -- not a GGUF / header --
    Fault("wrong-magic", byte_edit(lambda p: [(0, b"GGML")]), M, ("not a GGUF file", "b'GGML'")),
    Fault("text-file", whole_file(b"this is a README, not a model\n" * 40), M, ("not a GGUF file",)),
    Fault("empty-file", whole_file(b""), M, ("too short",)),
    Fault("version-1", byte_edit(lambda p: [(4, u32(1))]), M, ("unsupported GGUF version 1", "versions 2, 3")),
    Fault("version-4", byte_edit(lambda p: [(4, u32(4))]), M, ("unsupported GGUF version 4",)),
    Fault("big-endian", byte_edit(lambda p: [(4, struct.pack(">I", 3))]), M, ("big-endian",)),
    Fault("truncated-header", lambda s, p, d: truncate(s, d, 20), M, ("ends inside the GGUF header", "truncated")),
    Fault("truncated-in-metadata",
          lambda s, p, d: truncate(s, d, p.kv["tokenizer.ggml.merges"].value_pos + 1001), M,
          ("tokenizer.ggml.merges", REDO)),
    Fault("truncated-in-tensor-infos", lambda s, p, d: truncate(s, d, p.tensors["blk.2.ssm_a"].pos + 5), M,
          ("ends inside", "truncated")),
    Fault("truncated-after-tensor-infos", lambda s, p, d: truncate(s, d, p.infos_end), M,
          ("truncated",)),
    Fault("truncated-tensor-data", lambda s, p, d: truncate(s, d, p.size - 1000), M,
          ("runs past the end of the file", "truncated", REDO)),
    Fault("offset-past-end", byte_edit(lambda p: [(p.tensors["output.weight"].offset_pos, u64(1 << 40))]), M,
          ("'output.weight'", "runs past the end")),
    Fault("offset-near-u64-max", byte_edit(lambda p: [(p.tensors["blk.0.ssm_a"].offset_pos, u64(2**64 - 32))]), M,
          ("'blk.0.ssm_a'", "runs past the end")),
    Fault("misaligned-offset",
          byte_edit(lambda p: [(p.tensors["blk.1.ssm_out.weight"].offset_pos,
                                u64(p.tensors["blk.1.ssm_out.weight"].offset + 4))]), M,
          ("'blk.1.ssm_out.weight'", "not aligned to 32 bytes")),
    Fault("duplicate-tensor-name",
          byte_edit(lambda p: [(p.tensors["blk.1.attn_norm.weight"].pos + 8, b"blk.0.attn_norm.weight")]), M,
          ("duplicate tensor name 'blk.0.attn_norm.weight'",)),
    Fault("duplicate-key", _rename_key("tokenizer.ggml.eos_token_id", "tokenizer.ggml.bos_token_id"), M,
          ("'tokenizer.ggml.bos_token_id' appears twice",)),
    Fault("huge-kv-count", byte_edit(lambda p: [(16, u64(2**63))]), M, ("metadata entries",), check_memory=True),
    Fault("huge-tensor-count", byte_edit(lambda p: [(8, u64(2**64 - 1))]), M, ("tensors",), check_memory=True),
    Fault("kv-count-plus-one", byte_edit(lambda p: [(16, u64(len(p.kv) + 1))]), M, ("damaged GGUF file",),
          check_memory=True),
    Fault("tensor-count-minus-one", byte_edit(lambda p: [(8, u64(len(p.tensors) - 1))]), M,
          ("required tensor", "missing")),
    Fault("huge-key-length", byte_edit(lambda p: [(p.kv["general.name"].pos, u64(2**62))]), M,
          ("implausible length",), check_memory=True),
    Fault("huge-string-value", byte_edit(lambda p: [(p.kv["general.name"].value_pos, u64(2**62))]), M,
          ("'general.name'", "past the end"), check_memory=True),
    Fault("huge-array-count",
          byte_edit(lambda p: [(p.kv["tokenizer.ggml.token_type"].value_pos + 4, u64(2**60))]), M,
          ("'tokenizer.ggml.token_type'", "items"), check_memory=True),
    # counts that fit in the file: the reader would loop over them, building millions of arrays
    Fault("array-count-fills-file",
          byte_edit(lambda p: [(p.kv["tokenizer.ggml.token_type"].value_pos + 4,
                                u64((p.size - p.kv["tokenizer.ggml.token_type"].value_pos - 12) // 4))]),
          M, ("damaged GGUF file",), check_memory=True),
    Fault("string-array-count-fills-file",
          byte_edit(lambda p: [(p.kv["tokenizer.ggml.merges"].value_pos + 4,
                                u64((p.size - p.kv["tokenizer.ggml.merges"].value_pos - 12) // 8))]),
          M, ("damaged GGUF file",), check_memory=True),
    Fault("unknown-value-type", byte_edit(lambda p: [(p.kv["general.name"].type_pos, u32(99))]), M,
          ("unknown value type 99",)),
    Fault("array-of-arrays",
          byte_edit(lambda p: [(p.kv[f"{ARCH}.attention.recurrent_layers"].value_pos, u32(GV.ARRAY))]), M,
          ("array of arrays",)),
    Fault("unknown-tensor-type", byte_edit(lambda p: [(p.tensors["blk.0.ssm_a"].type_pos, u32(99))]), M,
          ("'blk.0.ssm_a'", "unknown ggml type 99")),
    Fault("removed-tensor-type", byte_edit(lambda p: [(p.tensors["blk.0.ssm_a"].type_pos, u32(4))]), M,
          ("unknown ggml type 4",)),
    Fault("five-dims", byte_edit(lambda p: [(p.tensors["output_norm.weight"].ndims_pos, u32(5))]), M,
          ("'output_norm.weight' has 5 dimensions",)),
    Fault("zero-dim", byte_edit(lambda p: [(p.tensors["output_norm.weight"].dims_pos, u64(0))]), M,
          ("'output_norm.weight' has an empty dimension",)),
    Fault("huge-dims", byte_edit(lambda p: [(p.tensors["token_embd.weight"].dims_pos + 8, u64(2**62))]), M,
          ("'token_embd.weight'",), check_memory=True),
    Fault("tensor-name-too-long",
          lambda s, p, d: rewrite(s, d, extra_tensors={"x" * 80: np.zeros(4, np.float32)}), M,
          ("at most 63",)),
    Fault("key-not-utf8", byte_edit(lambda p: [(p.kv["general.name"].pos + 8, b"\xff")]), M, ("not valid UTF-8",)),
    Fault("alignment-not-uint32", kv_set("general.alignment", "32", GV.STRING), M,
          ("general.alignment has type STRING",)),
    Fault("alignment-not-power-of-two", kv_set("general.alignment", 48, GV.UINT32), M, ("not a power of two",)),
    Fault("row-not-block-multiple", byte_edit(lambda p: [(p.tensors["blk.0.attn_qkv.weight"].dims_pos, u64(250))]),
          M, ("'blk.0.attn_qkv.weight' row length 250", "Q8_0 block size 32"), base="q8_0"),
    # -- architecture --
    Fault("unknown-architecture", lambda s, p, d: rewrite(s, d, arch="llama"), U,
          ("no graph for architecture 'llama'", "deltarun runs: kimi-linear, qwen35, qwen35moe, qwen3next, qwen4exp")),
    Fault("architecture-not-string", kv_set("general.architecture", 7, GV.UINT32), M,
          ("general.architecture is not a string",)),
    Fault("architecture-missing", _rename_key("general.architecture", "general.architecturX"), M,
          ("required metadata key 'general.architecture' is missing",)),
    Fault("architecture-not-utf8", _string_first_byte("general.architecture", b"\xff"), M,
          ("'general.architecture' is unreadable",)),
    # -- tensors --
    Fault("missing-tensor", _drop_tensor("blk.1.ssm_a"), M, ("required tensor 'blk.1.ssm_a' is missing",)),
    Fault("misshaped-tensor", _replace_tensor("blk.0.ssm_out.weight", lambda a: a[:, :128].copy()), M,
          ("tensor 'blk.0.ssm_out.weight' has shape [128, 256], expected [256, 256]",)),
    Fault("misshaped-norm", _replace_tensor("output_norm.weight", lambda a: a[:255].copy()), M,
          ("tensor 'output_norm.weight' has shape [255], expected [256]",)),
    Fault("i32-weight", _replace_tensor("blk.0.attn_qkv.weight", lambda a: a.astype(np.int32)), M,
          ("'blk.0.attn_qkv.weight' has type I32, which ggml cannot multiply",)),
    Fault("i8-weight", _replace_tensor("blk.3.attn_q.weight", lambda a: a.astype(np.int8)), M,
          ("'blk.3.attn_q.weight' has type I8, which ggml cannot multiply",)),
    Fault("f16-norm", _replace_tensor("blk.0.attn_norm.weight", lambda a: a.astype(np.float16)), M,
          ("'blk.0.attn_norm.weight' has type F16; it must be F32",)),
    Fault("q8-norm", _replace_tensor("output_norm.weight", lambda a: quantized(a, QT.Q8_0)), M,
          ("'output_norm.weight' has type Q8_0; it must be F32",), base="q8_0"),
    Fault("q8-shared-expert-gate", _replace_tensor("blk.0.ffn_gate_inp_shexp.weight",
                                                   lambda a: quantized(a, QT.Q8_0)), M,
          ("'blk.0.ffn_gate_inp_shexp.weight' has type Q8_0; it must be F32 or F16",), base="q8_0"),
    Fault("q8-type-edited-to-i8",
          byte_edit(lambda p: [(p.tensors["blk.0.attn_qkv.weight"].type_pos, u32(QT.I8))]), M,
          ("'blk.0.attn_qkv.weight' has type I8, which ggml cannot multiply",), base="q8_0"),
    Fault("q8-type-edited-to-q8_k",
          byte_edit(lambda p: [(p.tensors["blk.0.ffn_gate_exps.weight"].type_pos, u32(QT.Q8_K))]), M,
          ("has type Q8_K, which ggml cannot multiply",), base="q8_0"),
    # -- hyper-parameters --
    Fault("embedding-zero", hp("embedding_length", 0), M, ("embedding_length = 0 is out of range",)),
    Fault("heads-negative", hp("attention.head_count", -4, GV.INT32), M,
          ("attention.head_count = -4 is out of range",)),
    Fault("embedding-huge", hp("embedding_length", 2**40, GV.UINT64), M, ("embedding_length = 1099511627776",)),
    Fault("embedding-string", hp("embedding_length", "256", GV.STRING), M,
          ("embedding_length must be an integer, found '256'",)),
    Fault("embedding-float", hp("embedding_length", 256.0, GV.FLOAT32), M, ("must be an integer, found 256.0",)),
    Fault("kv-heads-not-dividing", hp("attention.head_count_kv", 3), M, ("not a multiple of head_count_kv 3",)),
    Fault("inner-size-not-divisible", hp("ssm.inner_size", 250), M, ("ssm.inner_size 250 must equal",)),
    Fault("v-heads-not-multiple-of-k-heads", hp("ssm.time_step_rank", 6), M,
          ("(value heads) 6 is not a multiple of ssm.group_count (key heads) 4",)),
    Fault("context-zero", hp("context_length", 0), M, ("context_length = 0 is out of range",)),
    Fault("block-count-zero", hp("block_count", 0), M, ("block_count = 0 is out of range",)),
    Fault("block-count-huge",
          lambda s, p, d: rewrite(s, d, drop_keys=(f"{ARCH}.attention.recurrent_layers",),
                                  set_kv={f"{ARCH}.block_count": (1_000_000, GV.UINT32)}), M,
          ("block_count = 1000000 but the file holds only",), check_memory=True),
    Fault("block-count-mismatch", hp("block_count", 5), M, ("recurrent_layers must hold 5 booleans",)),
    Fault("rms-eps-nan", hp("attention.layer_norm_rms_epsilon", math.nan, GV.FLOAT32), M,
          ("layer_norm_rms_epsilon must be a positive finite number",)),
    Fault("rms-eps-string", hp("attention.layer_norm_rms_epsilon", "1e-6", GV.STRING), M,
          ("must be a positive finite number, found '1e-6'",)),
    Fault("rope-dims-odd", hp("rope.dimension_count", 15), M, ("rope.dimension_count 15 must be even",)),
    Fault("experts-used-exceed-experts", hp("expert_used_count", 9), M, ("expert_used_count 9 exceeds",)),
    Fault("mtp-layers-out-of-range", hp("nextn_predict_layers", 4), M, ("nextn_predict_layers = 4",)),
    Fault("recurrent-layers-strings", kv_set(f"{ARCH}.attention.recurrent_layers", ["yes"] * 4, GV.ARRAY, GV.STRING),
          M, ("recurrent_layers must hold 4 booleans",)),
    Fault("expert-ff-string", hp("expert_feed_forward_length", "x", GV.STRING), M,
          ("expert_feed_forward_length must be an integer",)),
    Fault("value-length-differs", hp("attention.value_length", 128), M,
          ("attention.value_length = 128 differs from key_length 64",)),
    Fault("missing-hparam", lambda s, p, d: rewrite(s, d, drop_keys=(f"{ARCH}.ssm.state_size",)), M,
          ("required metadata key 'qwen3next.ssm.state_size' is missing",)),
    # -- vocabulary --
    Fault("merge-names-missing-token", _merges_plus(["foo bar"]), T,
          ("unusable vocabulary", "refers to token 'foo', which is not in the vocabulary")),
    Fault("merges-not-strings", kv_set("tokenizer.ggml.merges", [1, 2, 3], GV.ARRAY, GV.INT32), T,
          ("'tokenizer.ggml.merges' must be an array of strings",)),
    Fault("tokens-not-strings", kv_set("tokenizer.ggml.tokens", [1, 2, 3], GV.ARRAY, GV.INT32), T,
          ("'tokenizer.ggml.tokens' must be an array of strings",)),
    Fault("bos-id-string", kv_set("tokenizer.ggml.bos_token_id", "1", GV.STRING), T,
          ("'tokenizer.ggml.bos_token_id' must be an integer",)),
    Fault("bos-id-outside-vocab", kv_set("tokenizer.ggml.bos_token_id", 99999, GV.UINT32), T,
          ("bos token id 99999 is outside the vocabulary",)),
    Fault("tokenizer-model-llama", kv_set("tokenizer.ggml.model", "llama", GV.STRING), T, ("only 'gpt2'",)),
    Fault("no-merges", lambda s, p, d: rewrite(s, d, drop_keys=("tokenizer.ggml.merges",)), T,
          ("tokenizer.ggml.merges",)),
    Fault("token-types-short", kv_set("tokenizer.ggml.token_type", [1] * 10, GV.ARRAY, GV.INT32), T,
          ("but 10 token types",)),
    Fault("token-not-utf8", _string_first_byte("tokenizer.ggml.tokens", b"\xff", array=True), T,
          ("'tokenizer.ggml.tokens'",)),
    Fault("extra-token-no-embedding",
          lambda s, p, d: rewrite(s, d, set_kv={
              "tokenizer.ggml.tokens": (metadata(s, "tokenizer.ggml.tokens") + ["zzzz"], GV.ARRAY, GV.STRING),
              "tokenizer.ggml.token_type": (metadata(s, "tokenizer.ggml.token_type") + [1], GV.ARRAY, GV.INT32)}),
          M, ("tensor 'token_embd.weight' has shape [256, 2330], expected [256, 2331]",)),
    # -- chat template --
    Fault("template-syntax-error",
          kv_set("tokenizer.chat_template", "{% for m in messages %}{{ m.content }", GV.STRING), T, ("tokenizer.chat_template", "not valid Jinja (line 1")),
    Fault("template-unclosed-if", kv_set("tokenizer.chat_template", "hello\n{% if x %}\nworld", GV.STRING), T,
          ("not valid Jinja (line 3",)),
    Fault("template-not-string", kv_set("tokenizer.chat_template", 42, GV.UINT32), T,
          ("'tokenizer.chat_template' must be a string",)),
    Fault("template-not-utf8", _string_first_byte("tokenizer.chat_template", b"\xfe"), T,
          ("chat template 'tokenizer.chat_template' is unreadable",)),
    Fault("named-template-syntax-error", kv_set("tokenizer.chat_template.tool_use", "{{ x ", GV.STRING), T,
          ("tokenizer.chat_template.tool_use",)),
]


# --- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Positions]]:
    """The two generated good models, written once for this module, and their field positions."""
    d = tmp_path_factory.mktemp("loader-errors")
    out = {}
    for wtype in ("f32", "q8_0"):
        path = write_model(d / f"tiny-{wtype}.gguf", "tiny", wtype)
        out[wtype] = (path, walk(path))
    return out


@pytest.fixture
def fault_file(request: pytest.FixtureRequest, bases, tmp_path: Path):
    """Build the fault named by the test's `fault` parameter; delete it afterwards (files are big)."""
    fault: Fault = request.getfixturevalue("fault")
    src, pos = bases[fault.base]
    dst = tmp_path / f"{fault.id}.gguf"
    fault.build(src, pos, dst)
    yield dst
    dst.unlink(missing_ok=True)


def open_model(path: Path) -> Model:
    return Model(path, n_ctx=64, n_threads=1)


# --- the good files load (so every failure below is the fault's doing) ----------------------------
@pytest.mark.parametrize("wtype", ["f32", "q8_0"])
def test_unmodified_models_load_and_run(bases, wtype):
    path, pos = bases[wtype]
    with open_model(path) as m:
        assert m.eval([1]).shape == (m.hp.n_vocab,)
    assert pos.data_offset == m.file.layout.data_offset
    assert {n: t.ne for n, t in pos.tensors.items()} == {n: t.ne for n, t in m.file.tensors.items()}


def test_rewrite_without_changes_still_loads(bases, tmp_path):
    src, _ = bases["q8_0"]
    dst = tmp_path / "copy.gguf"
    rewrite(src, dst)
    with open_model(dst) as m:
        assert m.eval([1]).shape == (m.hp.n_vocab,)


# --- every fault is refused with deltarun's error -----------------------------------------------
@pytest.mark.parametrize("fault", FAULTS, ids=[f.id for f in FAULTS])
def test_fault_is_refused_with_a_clear_error(fault: Fault, fault_file: Path):
    """Model(path) raises the expected class, naming the file and the problem, fast and small."""
    if fault.check_memory:
        tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(DeltarunError) as info:
            open_model(fault_file)
    finally:
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1] if fault.check_memory else 0
        if fault.check_memory:
            tracemalloc.stop()
    err = info.value
    msg = str(err)
    assert type(err) is fault.error, f"{type(err).__name__}: {msg}"
    assert str(fault_file) in msg, msg
    for fragment in fault.fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    assert elapsed < 10, f"refusing the file took {elapsed:.1f} s"
    assert peak < 64 << 20, f"refusing the file allocated {peak >> 20} MiB"

    # the same file through the command line (in-process): the error's exit code, one line, no traceback
    from click.testing import CliRunner

    from deltarun.cli.main import cli

    r = CliRunner().invoke(cli, ["generate", str(fault_file), "-p", "hi", "-n", "1", "--ctx", "64", "--threads", "1"])
    assert r.exit_code == fault.error.exit_code, (r.output, r.exception)
    assert isinstance(r.exception, SystemExit)
    assert "Traceback" not in r.output
    assert r.stderr.startswith("error: ") and str(fault_file) in r.stderr


# one fault per error class and layer (header, metadata walk, hyper-parameters, tensors, vocab, template)
SUBPROCESS_FAULTS = ["wrong-magic", "truncated-tensor-data", "array-count-fills-file", "unknown-architecture",
                     "block-count-zero", "i32-weight", "merge-names-missing-token", "template-syntax-error"]


@pytest.mark.parametrize("fault", [f for f in FAULTS if f.id in SUBPROCESS_FAULTS], ids=SUBPROCESS_FAULTS)
def test_fault_exit_code_of_the_real_command(fault: Fault, fault_file: Path):
    r = subprocess.run([sys.executable, "-m", "deltarun", "generate", str(fault_file), "-p", "hi", "-n", "1",
                        "--ctx", "64", "--threads", "1"], capture_output=True, text=True, timeout=60)
    assert r.returncode == fault.error.exit_code, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith("error: ") and str(fault_file) in r.stderr
    for fragment in fault.fragments:
        assert fragment in r.stderr


def test_inspect_refuses_an_unreadable_file_in_a_subprocess(bases, tmp_path):
    src, pos = bases["f32"]
    dst = tmp_path / "bad.gguf"
    patch(src, dst, (16, u64(2**63)))
    r = subprocess.run([sys.executable, "-m", "deltarun", "inspect", str(dst)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == ModelFileError.exit_code, r.stderr
    assert "Traceback" not in r.stderr and "metadata entries" in r.stderr


# --- paths that are not files -------------------------------------------------------------------
def test_missing_file_and_directory(tmp_path):
    with pytest.raises(ModelFileError, match="no such file"):
        open_model(tmp_path / "nope.gguf")
    with pytest.raises(ModelFileError, match="is a directory"):
        open_model(tmp_path)


def test_every_error_class_is_exercised():
    assert {f.error for f in FAULTS} == {ModelFileError, UnsupportedModelError, TokenizerError}


# --- the chat-template check on its own ---------------------------------------------------------
def test_validate_chat_template():
    from deltarun.base.template_check import validate_chat_template
    from deltarun.model_files.generate import chat_template

    validate_chat_template(chat_template())
    validate_chat_template("{% for m in messages %}{% generation %}{{ m }}{% endgeneration %}"
                           "{% if loop.last %}{% break %}{% endif %}{% endfor %}")
    for bad in ("{% if %}", "{{ x ", "{% endfor %}", "{{ " + "(" * 5000 + " }}"):
        with pytest.raises(TokenizerError):
            validate_chat_template(bad)
    with pytest.raises(TokenizerError, match="must be a string"):
        validate_chat_template(42)  # type: ignore[arg-type]


def test_positions_walker_matches_the_file(bases):
    path, pos = bases["f32"]
    data = path.read_bytes()
    ti = pos.tensors["output_norm.weight"]
    assert struct.unpack_from("<I", data, ti.ndims_pos)[0] == 1
    assert struct.unpack_from("<Q", data, ti.dims_pos)[0] == 256
    assert struct.unpack_from("<I", data, ti.type_pos)[0] == QT.F32
    kv = pos.kv["general.architecture"]
    assert data[kv.value_pos + 8:kv.value_pos + 8 + len(ARCH)] == ARCH.encode()
    assert pos.tensors["token_embd.weight"].offset == 0
