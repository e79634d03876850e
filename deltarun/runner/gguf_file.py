"""A GGUF file opened for running: metadata, tensor table, and the mapped tensor bytes.

`gguf.GGUFReader` memory-maps the file, so tensor data is never read into Python memory; this
module adds the checks that must hold before any byte reaches ggml (offsets inside the file,
alignment, no duplicate names, sizes that match shape and type) and turns the reader's assorted
exceptions into one `ModelFileError` that names the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from deltarun.runner.errors import ModelFileError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)


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


def _check_header(path: Path) -> None:
    try:
        with path.open("rb") as f:
            head = f.read(8)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot open: {e.strerror or e}") from e
    if len(head) < 8:
        raise ModelFileError(f"{path}: file too short to be a GGUF ({len(head)} bytes)")
    if head[:4] != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (magic {head[:4]!r}, expected {GGUF_MAGIC!r})")
    version = int.from_bytes(head[4:8], "little")
    if version not in SUPPORTED_VERSIONS:
        raise ModelFileError(f"{path}: unsupported GGUF version {version} (supported: 2, 3)")


class GGUFFile:
    """An opened, validated GGUF file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFileError(f"{self.path}: no such file")
        _check_header(self.path)
        try:
            self.reader = gguf.GGUFReader(str(self.path), "r")
        except Exception as e:  # the reader raises ValueError, KeyError, IndexError, struct errors...
            raise ModelFileError(f"{self.path}: damaged GGUF header or metadata ({type(e).__name__}: {e})") from e
        self.file_size = int(self.reader.data.shape[0])
        self.alignment = int(self.get("general.alignment", 32))
        self.tensors: dict[str, TensorInfo] = self._read_tensor_table()

    # --- metadata -------------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as a Python value (str, int, float, bool or list)."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:
            raise ModelFileError(f"{self.path}: metadata key {key!r} is unreadable ({e})") from e

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelFileError(f"{self.path}: required metadata key {key!r} is missing")
        return value

    @property
    def architecture(self) -> str:
        arch = self.require("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(f"{self.path}: general.architecture is not a string")
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

    # --- tensors --------------------------------------------------------------------------------
    def _read_tensor_table(self) -> dict[str, TensorInfo]:
        tensors: dict[str, TensorInfo] = {}
        for t in self.reader.tensors:
            name = t.name
            if name in tensors:
                raise ModelFileError(f"{self.path}: duplicate tensor name {name!r}")
            qtype = int(t.tensor_type)
            try:
                block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
            except (ValueError, KeyError) as e:
                raise ModelFileError(f"{self.path}: tensor {name!r} has unknown type {qtype}") from e
            ne = tuple(int(x) for x in t.shape)
            if any(x <= 0 for x in ne):
                raise ModelFileError(f"{self.path}: tensor {name!r} has a non-positive dimension {ne}")
            if ne[0] % block != 0:
                raise ModelFileError(
                    f"{self.path}: tensor {name!r} row length {ne[0]} is not a multiple of the "
                    f"{gguf.GGMLQuantizationType(qtype).name} block size {block}")
            n = int(np.prod(ne, dtype=np.int64))
            nbytes = n // block * type_size
            offset = int(t.data_offset)
            if offset % self.alignment != 0:
                raise ModelFileError(f"{self.path}: tensor {name!r} data offset {offset} is not "
                                     f"aligned to {self.alignment} bytes")
            if offset + nbytes > self.file_size:
                raise ModelFileError(
                    f"{self.path}: tensor {name!r} data ({nbytes} bytes at offset {offset}) runs past "
                    f"the end of the file ({self.file_size} bytes): the file is truncated")
            tensors[name] = TensorInfo(name, qtype, ne, offset, nbytes)
        return tensors

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
