"""A `gguf.GGUFReader` that opens files with big metadata arrays in milliseconds.

The stock reader parses every item of a metadata array into its own numpy views: a real
Qwen3-Next file carries 151,643 tokens, as many token types and 151,387 merges, which is about
a million small arrays and 5-10 s per open. `FastGGUFReader` is a subclass that overrides the
field parsing only: arrays are walked once (string lengths with `struct`, scalar arrays by
arithmetic) and their `ReaderField.parts` become a lazy sequence (`ArrayParts`) that builds each
part, with the reader's own `_get`, only when it is read. Everything else (header, tensor infos,
tensors, `ReaderField.contents()`, `get_field`, ...) is the stock code, so the result is a
`GGUFReader` with the same fields, parts, data indices, types and tensors.

`array_values(field)` reads a whole array field as Python values straight from the mapping
(no per-item numpy arrays); the tokenizer uses it for the vocabulary.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import gguf
import numpy as np
from gguf.gguf_reader import ReaderField

V = gguf.GGUFValueType
_U64 = struct.Struct("<Q")


class ArrayParts(Sequence):
    """The `parts` of an array field, built on demand.

    Layout (as the stock reader's list): the `prefix` parts (key length, key bytes, value type,
    item type, item count), then per item either [length, bytes] (strings) or [value] (scalars).
    """

    __slots__ = ("reader", "prefix", "itype", "nptype", "starts", "lengths", "base", "count")

    def __init__(self, reader: gguf.GGUFReader, prefix: list[np.ndarray], itype: int, count: int,
                 starts: list[int] | None = None, lengths: list[int] | None = None, base: int = 0):
        self.reader = reader
        self.prefix = prefix
        self.itype = itype
        self.nptype = None if itype == V.STRING else reader.gguf_scalar_to_np[V(itype)]
        self.starts = starts      # strings: offset of each item's length field
        self.lengths = lengths    # strings: byte length of each item
        self.base = base          # scalars: offset of item 0
        self.count = count

    @property
    def per_item(self) -> int:
        return 2 if self.itype == V.STRING else 1

    def __len__(self) -> int:
        return len(self.prefix) + self.per_item * self.count

    def _item(self, j: int) -> np.ndarray:
        p = len(self.prefix)
        if j < p:
            return self.prefix[j]
        k = j - p
        r = self.reader
        if self.itype == V.STRING:
            i, which = divmod(k, 2)
            if which == 0:
                return r._get(self.starts[i], np.uint64)
            return r._get(self.starts[i] + 8, np.uint8, self.lengths[i])
        return r._get(self.base + k * np.dtype(self.nptype).itemsize, self.nptype)

    def __getitem__(self, index: int | slice) -> Any:
        if isinstance(index, slice):
            return [self._item(j) for j in range(*index.indices(len(self)))]
        n = len(self)
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("ArrayParts index out of range")
        return self._item(index)

    def __iter__(self):
        for j in range(len(self)):
            yield self._item(j)

    def __repr__(self) -> str:
        return f"ArrayParts({len(self)} parts, {self.count} items of {V(self.itype).name})"

    # --- fast whole-array reads ----------------------------------------------------------------
    def strings(self) -> list[str]:
        mv = self.reader._mv
        return [str(mv[s + 8:s + 8 + n], "utf-8") for s, n in zip(self.starts, self.lengths)]

    def values(self) -> np.ndarray:
        dt = np.dtype(self.nptype).newbyteorder(self.reader.byte_order)
        return self.reader.data[self.base:self.base + self.count * dt.itemsize].view(dt)


class FastGGUFReader(gguf.GGUFReader):
    """`gguf.GGUFReader` with lazily materialised metadata arrays (see the module docstring)."""

    def __init__(self, path: Any, mode: str = "r"):
        self._mv: memoryview | None = None
        super().__init__(path, mode)  # type: ignore[arg-type]

    def _build_fields(self, offs: int, count: int) -> int:
        if self.byte_order != "I":               # byte-swapped files: the stock code
            return super()._build_fields(offs, count)
        self._mv = memoryview(self.data).cast("B") if self.data.ndim == 1 else memoryview(self.data.tobytes())
        for _ in range(count):
            orig_offs = offs
            kv_klen, kv_kdata = self._get_str(offs)
            offs += int(kv_klen.nbytes + kv_kdata.nbytes)
            raw_kv_type = self._get(offs, np.uint32)
            offs += int(raw_kv_type.nbytes)
            parts: Any = [kv_klen, kv_kdata, raw_kv_type]
            fast = self._array_parts(offs, parts) if raw_kv_type[0] == V.ARRAY else None
            if fast is not None:
                field_size, parts, idxs, field_types = fast
            else:
                field_size, field_parts, field_idxs, field_types = self._get_field_parts(offs, raw_kv_type[0])
                idxs = [idx + len(parts) for idx in field_idxs]
                parts += field_parts
            self._push_field(ReaderField(orig_offs, str(bytes(kv_kdata), encoding="utf-8"), parts, idxs,
                                         field_types), skip_sum=True)
            offs += field_size
        return offs

    def _array_parts(self, offs: int, prefix: list[np.ndarray]) -> tuple[int, ArrayParts, list[int], list[Any]] | None:
        """An array of strings or scalars as lazy parts; None for what the stock code should do."""
        raw_itype = self._get(offs, np.uint32)
        alen = self._get(offs + 4, np.uint64)
        itype, count = int(raw_itype[0]), int(alen[0])
        start = offs + 12
        pre = prefix + [raw_itype, alen]
        types: list[Any] = [V.ARRAY]
        if itype == V.STRING:
            mv, size = self._mv, len(self._mv)
            unpack = _U64.unpack_from
            starts, lengths = [0] * count, [0] * count
            pos = start
            for i in range(count):
                if pos + 8 > size:
                    raise ValueError("GGUF string array runs past the end of the file")
                (n,) = unpack(mv, pos)
                if n > size - pos - 8:
                    raise ValueError("GGUF string array item runs past the end of the file")
                starts[i] = pos
                lengths[i] = n
                pos += 8 + n
            parts = ArrayParts(self, pre, itype, count, starts=starts, lengths=lengths)
            first = len(pre) + 1
            idxs = list(range(first, first + 2 * count, 2))
            end = pos
        elif itype in self.gguf_scalar_to_np.keys():
            nptype = self.gguf_scalar_to_np[V(itype)]
            end = start + count * np.dtype(nptype).itemsize
            if end > len(self._mv):
                raise ValueError("GGUF array runs past the end of the file")
            parts = ArrayParts(self, pre, itype, count, base=start)
            idxs = list(range(len(pre), len(pre) + count))
        else:
            return None                                   # arrays of arrays, unknown types
        if count:
            types.append(V(itype))
        return end - offs, parts, idxs, types


def open_reader(path: Any) -> gguf.GGUFReader:
    """The reader deltarun uses: `FastGGUFReader` (a `gguf.GGUFReader`)."""
    return FastGGUFReader(str(path), "r")


def array_values(field: ReaderField) -> Any:
    """`field.contents()` for any field, without per-item arrays for the arrays of a FastGGUFReader."""
    parts = getattr(field, "parts", None)   # duck-typed fields (tests) have contents() only
    if isinstance(parts, ArrayParts):
        if parts.itype == V.STRING:
            return parts.strings()
        return parts.values().tolist()
    return field.contents()
