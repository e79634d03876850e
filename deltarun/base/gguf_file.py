"""A GGUF file opened for running: metadata, tensor table, and the mapped tensor bytes.

`gguf.GGUFReader` memory-maps the file, so tensor data is never read into Python memory. The
reader trusts the file, though: counts and lengths it reads drive its loops, so a damaged count
can make it loop for minutes or build millions of small arrays. This module therefore walks the
file's layout first (`scan_layout`): every count, length and type is checked against the bytes
that are really there before the reader runs. It then adds the checks that must hold before any
byte reaches ggml (offsets inside the file, alignment, no duplicate names, sizes that match shape
and type) and turns every failure into one `ModelFileError` that names the file, says what is
wrong, and what to do about it.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from deltarun.base.errors import ModelFileError, TokenizerError
from deltarun.base.fast_gguf import open_reader

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
GGML_MAX_DIMS = 4
GGML_MAX_NAME = 64          # ggml tensor names hold at most 63 bytes plus the terminating NUL
MAX_KEY_LENGTH = 1 << 16    # far above any real metadata key
HEADER_SIZE = 24            # magic, version u32, n_tensors u64, n_kv u64
MIN_KV_SIZE = 8 + 4 + 1     # key length, value type, a 1-byte value (keys are unique, so at most one is empty)
MIN_TENSOR_INFO_SIZE = 8 + 4 + 4 + 8  # name length, n_dims, type, offset

REDO = "re-download the file or convert the model again"

V = gguf.GGUFValueType
_SCALAR_SIZES: dict[int, int] = {
    V.UINT8: 1, V.INT8: 1, V.BOOL: 1, V.UINT16: 2, V.INT16: 2, V.UINT32: 4, V.INT32: 4, V.FLOAT32: 4,
    V.UINT64: 8, V.INT64: 8, V.FLOAT64: 8,
}
_INT_TYPES = {V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64}


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are and what they hold (ne in ggml order, fastest first)."""

    name: str
    ggml_type: int
    ne: tuple[int, ...]
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return gguf.GGMLQuantizationType(self.ggml_type).name

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.ne, dtype=np.int64)) if self.ne else 1


@dataclass(frozen=True)
class Layout:
    """What `scan_layout` found: the checked structure of a GGUF file."""

    version: int
    kv_types: dict[str, tuple[int, ...]]  # key -> (value type,) or (ARRAY, item type)
    alignment: int
    data_offset: int                      # absolute offset of the tensor data section
    tensors: list[TensorInfo]


class _Cursor:
    """Bounds-checked little-endian reads from the mapped file; every overrun is a ModelFileError."""

    def __init__(self, buf: Any, path: Path, size: int):
        self.buf, self.path, self.size, self.pos = buf, path, size, 0

    def fail(self, msg: str) -> ModelFileError:
        return ModelFileError(f"{self.path}: damaged GGUF file: {msg}; {REDO}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise ModelFileError(
                f"{self.path}: damaged GGUF file: it ends inside {what} (needs {n} bytes at offset {self.pos}, "
                f"the file has {self.size} bytes): it is truncated; {REDO}")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = struct.unpack_from("<I", self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = struct.unpack_from("<Q", self.buf, self.pos)
        self.pos += 8
        return v

    def skip_string(self, what: str) -> None:
        n = self.u64(f"the length of {what}")
        if n > self.size - self.pos:
            raise self.fail(f"{what} at offset {self.pos - 8} claims {n} bytes, past the end of the file")
        self.pos += n

    def text(self, what: str, limit: int) -> str:
        n = self.u64(f"the length of {what}")
        if n > limit or n > self.size - self.pos:
            raise self.fail(f"{what} at offset {self.pos - 8} claims an implausible length of {n} bytes")
        raw = self.buf[self.pos:self.pos + n]
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at offset {self.pos - n} is not valid UTF-8 ({raw[:40]!r})") from None


def _value_type(cur: _Cursor, raw: int, what: str) -> int:
    if raw not in V._value2member_map_:
        raise cur.fail(f"{what} has unknown value type {raw}")
    return raw


def _skip_value(cur: _Cursor, vtype: int, key: str) -> tuple[int, ...]:
    """Step over one metadata value; returns its type signature."""
    if vtype == V.STRING:
        cur.skip_string(f"the string value of {key!r}")
        return (vtype,)
    if vtype in _SCALAR_SIZES:
        cur.need(_SCALAR_SIZES[vtype], f"the value of {key!r}")
        cur.pos += _SCALAR_SIZES[vtype]
        return (vtype,)
    # an array: item type, count, items
    itype = _value_type(cur, cur.u32(f"the array type of {key!r}"), f"the array {key!r}")
    count = cur.u64(f"the array length of {key!r}")
    if itype == V.ARRAY:
        raise cur.fail(f"metadata key {key!r} is an array of arrays, which GGUF readers do not support")
    item_min = 8 if itype == V.STRING else _SCALAR_SIZES[itype]
    if count > (cur.size - cur.pos) // item_min:
        raise cur.fail(f"metadata array {key!r} claims {count} items, more than the rest of the file can hold")
    if itype == V.STRING:
        buf, size, pos = cur.buf, cur.size, cur.pos
        unpack = struct.Struct("<Q").unpack_from
        for i in range(count):
            if pos + 8 > size:
                cur.pos = pos
                cur.need(8, f"item {i} of the array {key!r}")
            (n,) = unpack(buf, pos)
            pos += 8
            if n > size - pos:
                cur.pos = pos
                raise cur.fail(f"item {i} of the array {key!r} at offset {pos - 8} claims {n} bytes, "
                               f"past the end of the file")
            pos += n
        cur.pos = pos
    else:
        cur.pos += count * item_min
    return (V.ARRAY, itype)


def scan_layout(buf: Any, path: Path, size: int) -> Layout:
    """Walk header, metadata and tensor infos with every count and length checked against `size`.

    Runs in time linear in the bytes actually present (a damaged count cannot make it loop
    beyond the end of the file) and allocates nothing proportional to a declared count.
    """
    cur = _Cursor(buf, path, size)
    if size < 4 or bytes(buf[:4]) != GGUF_MAGIC:
        magic = bytes(buf[:4])
        raise ModelFileError(f"{path}: not a GGUF file (starts with {magic!r}, expected {GGUF_MAGIC!r}); "
                             f"deltarun runs GGUF model files such as those written by llama.cpp's "
                             f"convert_hf_to_gguf.py")
    cur.pos = 4
    version = cur.u32("the GGUF header (version)")
    if version not in SUPPORTED_VERSIONS:
        if version & 0xFFFF == 0 and int.from_bytes(version.to_bytes(4, "little"), "big") in SUPPORTED_VERSIONS:
            raise ModelFileError(f"{path}: this is a big-endian GGUF file; deltarun reads little-endian files "
                                 f"only: convert the model again without --bigendian")
        raise ModelFileError(f"{path}: unsupported GGUF version {version} (deltarun reads versions "
                             f"{', '.join(map(str, SUPPORTED_VERSIONS))}); convert the model again with a "
                             f"current llama.cpp")
    n_tensors = cur.u64("the GGUF header (tensor count)")
    n_kv = cur.u64("the GGUF header (metadata count)")
    room = size - HEADER_SIZE
    if n_kv > room // MIN_KV_SIZE:
        raise cur.fail(f"the header declares {n_kv} metadata entries, more than a {size}-byte file can hold")
    if n_tensors > room // MIN_TENSOR_INFO_SIZE or n_kv * MIN_KV_SIZE + n_tensors * MIN_TENSOR_INFO_SIZE > room:
        raise cur.fail(f"the header declares {n_tensors} tensors and {n_kv} metadata entries, more than a "
                       f"{size}-byte file can hold")

    kv_types: dict[str, tuple[int, ...]] = {}
    alignment = DEFAULT_ALIGNMENT
    for i in range(n_kv):
        start = cur.pos
        key = cur.text(f"the name of metadata entry {i}", MAX_KEY_LENGTH)
        if key in kv_types:
            raise cur.fail(f"metadata key {key!r} appears twice (second time at offset {start})")
        vtype = _value_type(cur, cur.u32(f"the type of metadata key {key!r}"), f"metadata key {key!r}")
        value_pos = cur.pos
        kv_types[key] = _skip_value(cur, vtype, key)
        if key == "general.alignment":
            if vtype != V.UINT32:
                raise cur.fail(f"general.alignment has type {V(vtype).name}, expected UINT32")
            (alignment,) = struct.unpack_from("<I", buf, value_pos)
            if alignment == 0 or alignment & (alignment - 1):
                raise cur.fail(f"general.alignment = {alignment} is not a power of two")

    tensors: list[tuple[str, int, tuple[int, ...], int, int]] = []
    names: set[str] = set()
    for i in range(n_tensors):
        start = cur.pos
        name = cur.text(f"the name of tensor {i}", MAX_KEY_LENGTH)
        if len(name.encode("utf-8")) >= GGML_MAX_NAME:
            raise cur.fail(f"tensor {i} has a name of {len(name.encode())} bytes ({name[:40]!r}...); ggml "
                           f"allows at most {GGML_MAX_NAME - 1}")
        if name in names:
            raise cur.fail(f"duplicate tensor name {name!r} (tensor {i}, offset {start})")
        names.add(name)
        n_dims = cur.u32(f"the dimension count of tensor {name!r}")
        if n_dims > GGML_MAX_DIMS:
            raise cur.fail(f"tensor {name!r} has {n_dims} dimensions; ggml supports at most {GGML_MAX_DIMS}")
        ne = tuple(cur.u64(f"the shape of tensor {name!r}") for _ in range(n_dims))
        qtype = cur.u32(f"the type of tensor {name!r}")
        offset = cur.u64(f"the data offset of tensor {name!r}")
        tensors.append((name, qtype, ne, offset, start))

    data_offset = -(-cur.pos // alignment) * alignment
    if tensors and data_offset > size:
        raise ModelFileError(f"{path}: the file ends before its tensor data starts (offset {data_offset}, file "
                             f"size {size}): it is truncated; {REDO}")
    data_size = size - data_offset
    infos: list[TensorInfo] = []
    for name, qtype, ne, offset, start in tensors:
        try:
            gtype = gguf.GGMLQuantizationType(qtype)
            block, type_size = gguf.GGML_QUANT_SIZES[gtype]
        except (ValueError, KeyError):
            raise cur.fail(f"tensor {name!r} has unknown ggml type {qtype}") from None
        if any(x == 0 for x in ne):
            raise cur.fail(f"tensor {name!r} has an empty dimension (shape {list(ne)})")
        n = math.prod(ne)
        if n >= 1 << 62:
            raise cur.fail(f"tensor {name!r} has an impossible shape {list(ne)}")
        row = ne[0] if ne else 1
        if row % block:
            raise cur.fail(f"tensor {name!r} row length {row} is not a multiple of the {gtype.name} "
                           f"block size {block}")
        nbytes = n // block * type_size
        if offset % alignment:
            raise cur.fail(f"tensor {name!r} data offset {offset} is not aligned to {alignment} bytes")
        if offset > data_size or nbytes > data_size - offset:
            raise ModelFileError(
                f"{path}: tensor {name!r} data ({nbytes} bytes at offset {data_offset + offset}) runs past "
                f"the end of the file ({size} bytes): the file is truncated or its tensor table is "
                f"damaged; {REDO}")
        infos.append(TensorInfo(name, int(qtype), tuple(int(x) for x in ne), data_offset + offset, nbytes))
    return Layout(version, kv_types, alignment, data_offset, infos)


def read_layout(path: Path) -> tuple[Layout, int]:
    """Open `path` and scan it; returns the layout and the file size."""
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            if size < 8:
                raise ModelFileError(f"{path}: file too short to be a GGUF ({size} bytes); pass a GGUF model "
                                     f"file")
            if size < HEADER_SIZE:
                f.seek(0)
                head = f.read()
                scan_layout(head, path, len(head))  # wrong magic or version, else the header is cut short
                raise ModelFileError(f"{path}: damaged GGUF file: the header is cut short ({size} bytes); {REDO}")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return scan_layout(buf, path, size), size
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read the file: {e.strerror or e}") from e


class GGUFFile:
    """An opened, validated GGUF file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.exists():
            raise ModelFileError(f"{self.path}: no such file")
        if self.path.is_dir():
            raise ModelFileError(f"{self.path}: is a directory, not a GGUF model file")
        if not self.path.is_file():
            raise ModelFileError(f"{self.path}: not a regular file (pass the path of a GGUF model file)")
        self.layout, size = read_layout(self.path)
        try:
            self.reader = open_reader(self.path)   # a gguf.GGUFReader with fast metadata arrays
        except Exception as e:  # the layout scan should have caught this; keep the promise anyway
            raise ModelFileError(f"{self.path}: damaged GGUF header or metadata ({type(e).__name__}: {e}); "
                                 f"{REDO}") from e
        self.file_size = int(self.reader.data.shape[0])
        if self.file_size != size or len(self.reader.tensors) != len(self.layout.tensors) or (
                self.layout.tensors and self.reader.data_offset != self.layout.data_offset):
            raise ModelFileError(f"{self.path}: the file changed while it was being opened, or its layout is "
                                 f"ambiguous; {REDO}")
        self.alignment = self.layout.alignment
        self.tensors: dict[str, TensorInfo] = {t.name: t for t in self.layout.tensors}
        self._tokenizer: Any = None

    # --- metadata -------------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as a Python value (str, int, float, bool or list)."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:
            raise ModelFileError(f"{self.path}: metadata key {key!r} is unreadable ({type(e).__name__}: {e}); "
                                 f"{REDO}") from e

    def value_type(self, key: str) -> tuple[int, ...] | None:
        """The key's GGUF type signature: (type,) or (ARRAY, item type); None when absent."""
        return self.layout.kv_types.get(key)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelFileError(f"{self.path}: required metadata key {key!r} is missing; the file was not "
                                 f"written by a converter for this model type: {REDO}")
        return value

    @property
    def architecture(self) -> str:
        arch = self.require("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(f"{self.path}: general.architecture is not a string ({arch!r}); {REDO}")
        return arch

    def metadata(self) -> dict[str, Any]:
        """All metadata except the big tokenizer arrays (shown as their length)."""
        out: dict[str, Any] = {}
        for key, field in self.reader.fields.items():
            if key.startswith("GGUF."):
                continue
            if field.types and field.types[0] == gguf.GGUFValueType.ARRAY and len(field.data) > 16:
                out[key] = f"[{len(field.data)} items]"
            else:
                out[key] = self.get(key)
        return out

    # --- vocabulary and chat template -----------------------------------------------------------
    def tokenizer(self) -> Any:
        """The file's vocabulary as a `Tokenizer`, built (and so fully checked) once.

        Raises `TokenizerError` naming the file for anything the tokenizer would refuse, and also
        for metadata of the wrong type, which the tokenizer itself would trip over.
        """
        if self._tokenizer is None:
            from deltarun.base.tokenizer import Tokenizer

            self._check_tokenizer_types()
            try:
                self._tokenizer = Tokenizer.from_gguf(self.reader)
            except TokenizerError as e:
                raise TokenizerError(f"{self.path}: unusable vocabulary: {e}; {REDO}") from e
            except Exception as e:  # a vocabulary the tokenizer did not expect at all
                raise TokenizerError(f"{self.path}: unusable vocabulary ({type(e).__name__}: {e}); "
                                     f"{REDO}") from e
        return self._tokenizer

    def _check_tokenizer_types(self) -> None:
        S, A = V.STRING, V.ARRAY
        want: dict[str, tuple[str, Any]] = {
            "tokenizer.ggml.model": ("a string", lambda t: t == (S,)),
            "tokenizer.ggml.pre": ("a string", lambda t: t == (S,)),
            "tokenizer.ggml.tokens": ("an array of strings", lambda t: t == (A, S)),
            "tokenizer.ggml.merges": ("an array of strings", lambda t: t == (A, S)),
            "tokenizer.ggml.token_type": ("an array of integers", lambda t: t[0] == A and t[1] in _INT_TYPES),
            "tokenizer.ggml.add_bos_token": ("a boolean", lambda t: t[0] == V.BOOL or t[0] in _INT_TYPES),
        }
        for what in ("bos", "eos", "eot", "padding", "unknown", "seperator", "eom"):
            want[f"tokenizer.ggml.{what}_token_id"] = ("an integer", lambda t: t[0] in _INT_TYPES)
        for key, (desc, ok) in want.items():
            t = self.value_type(key)
            if t is not None and not ok(t):
                raise TokenizerError(f"{self.path}: metadata key {key!r} must be {desc}, found "
                                     f"{'/'.join(V(x).name for x in t)}; {REDO}")

    def chat_templates(self) -> dict[str, str]:
        """Every chat template in the file (`tokenizer.chat_template` and named variants), checked to
        parse as Jinja; raises `TokenizerError` naming the file and the template otherwise."""
        from deltarun.base.template_check import validate_chat_template

        out: dict[str, str] = {}
        for key in self.layout.kv_types:
            if key != "tokenizer.chat_template" and not key.startswith("tokenizer.chat_template."):
                continue
            if self.value_type(key) != (V.STRING,):
                raise TokenizerError(f"{self.path}: metadata key {key!r} must be a string holding a Jinja "
                                     f"chat template; {REDO}")
            try:
                text = self.reader.fields[key].contents()
            except Exception as e:
                raise TokenizerError(f"{self.path}: chat template {key!r} is unreadable "
                                     f"({type(e).__name__}: {e}); {REDO}") from e
            try:
                validate_chat_template(text)
            except TokenizerError as e:
                raise TokenizerError(f"{self.path}: {key}: {e}") from e
            out[key] = text
        return out

    # --- tensors --------------------------------------------------------------------------------
    def tensor_bytes(self, info: TensorInfo) -> np.ndarray:
        """The tensor's raw bytes as a read-only view of the mapping (no copy)."""
        return self.reader.data[info.offset:info.offset + info.nbytes]

    def tensor_array(self, name: str) -> np.ndarray:
        """A tensor dequantized to float32, numpy shape (reverse of ne); for tests and tools."""
        info = self.tensors[name]
        raw = self.tensor_bytes(info)
        qtype = gguf.GGMLQuantizationType(info.ggml_type)
        arr = gguf.quants.dequantize(raw, qtype) if qtype != gguf.GGMLQuantizationType.F32 \
            else raw.view(np.float32)
        return np.asarray(arr, dtype=np.float32).reshape(tuple(reversed(info.ne)))

    @property
    def data_base_address(self) -> int:
        """Address of the file's first byte in the mapping."""
        return int(self.reader.data.ctypes.data)
