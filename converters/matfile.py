"""A bounded reader for the subset of MATLAB v5 (``save -v7``) files that dataset devkits use.

Only what ILSVRC2012's ``meta.mat`` needs: top-level variables (plain or zlib-compressed), a
struct array whose fields hold char arrays or numbers (a field holding a struct or a cell is
None: nothing is read recursively, so no nesting is too deep). Every length is checked against
the bytes that are there, every dimension against MATLAB's limit (at most 8 of them, each below
2**31), a struct's elements and fields against the bytes that must hold them, and what the
file's compressed variables inflate to is capped in all, so a crafted file is one
`SourceError` naming it, never an allocation larger than a small multiple of that cap (scipy's
``loadmat`` allocates what a header claims).
"""

from __future__ import annotations

import math
import struct
import zlib
from typing import Any

import numpy as np

from dlpipe.converters.source import SourceError

__all__ = ["read_struct_rows"]

_MAT_NUMBERS = {1: "i1", 2: "u1", 3: "i2", 4: "u2", 5: "i4", 6: "u4", 7: "f4", 9: "f8",
                12: "i8", 13: "u8"}  # fmt: skip
_MAT_TEXT = {16: "utf-8", 4: "utf-16", 17: "utf-16", 2: "latin-1", 1: "latin-1"}
_MI_MATRIX, _MI_COMPRESSED, _MX_STRUCT, _MX_CHAR = 14, 15, 2, 4
_MAX_DIMS, _MAX_DIM = 8, 2**31 - 1  # MATLAB's own limits on an array's shape
_MAX_FIELDS = 4096  # a struct's field names (meta.mat's synsets has 8)
_ELEMENT_BYTES = 8  # the smallest element: its tag


class _Reader:
    """The subset of MATLAB v5 data elements meta.mat uses, every length checked."""

    def __init__(self, path: str, endian: str, fields: tuple[str, ...]) -> None:
        self.path, self.endian, self.fields = path, endian, fields

    def fail(self, what: str) -> SourceError:
        return SourceError(f"{self.path}: not a readable MATLAB file ({what}); re-extract it")

    def element(self, buf: bytes, pos: int) -> tuple[int, bytes, int]:
        """(type, payload, position of the next element) of the element at `pos`."""
        if pos + 8 > len(buf):
            raise self.fail(f"an element at byte {pos} is cut short")
        kind, size = struct.unpack_from(self.endian + "II", buf, pos)
        if kind >> 16:  # small element: size and type share a word, the data the next
            size, kind = kind >> 16, kind & 0xFFFF
            if size > 4:
                raise self.fail(f"a small element of {size} bytes")
            return kind, buf[pos + 4 : pos + 4 + size], pos + 8
        end = pos + 8 + size
        if end > len(buf):
            raise self.fail(f"an element at byte {pos} runs {end - len(buf)} bytes past its end")
        padded = end if kind == _MI_COMPRESSED else pos + 8 + (size + 7) // 8 * 8
        return kind, buf[pos + 8 : end], min(padded, len(buf))

    def numbers(self, kind: int, data: bytes) -> np.ndarray:
        code = _MAT_NUMBERS.get(kind)
        if code is None or len(data) % np.dtype(code).itemsize:
            raise self.fail(f"{len(data)} bytes of type {kind} where numbers belong")
        return np.frombuffer(data, dtype=self.endian + code)

    def matrix(self, body: bytes, variable: str | None = None) -> tuple[str, Any]:
        """(name, value) of a miMATRIX: the struct `variable` (top level only) → rows, char →
        str, a number; None for anything else (another struct, a cell, a sparse array)."""
        if not body:
            return "", None
        kind, flags, pos = self.element(body, 0)
        kind_dims, dims_data, pos = self.element(body, pos)
        _, name, pos = self.element(body, pos)
        matlab_class = int(self.numbers(kind, flags)[:1].sum()) & 0xFF
        if kind_dims not in (5, 6):
            raise self.fail(f"array dimensions of type {kind_dims}, not 32-bit integers")
        dims = self.numbers(kind_dims, dims_data).tolist()
        if not 0 < len(dims) <= _MAX_DIMS or not all(0 <= d <= _MAX_DIM for d in dims):
            shown = ", ".join(map(str, dims[: _MAX_DIMS + 1]))
            raise self.fail(
                f"an array of dimensions [{shown}]; MATLAB allows at most {_MAX_DIMS}, "
                f"each 0..{_MAX_DIM}"
            )
        text = name.decode("latin-1")
        if matlab_class == _MX_STRUCT and variable is not None and text == variable:
            return text, self.struct_rows(body, pos, math.prod(dims))
        if matlab_class == _MX_CHAR or 6 <= matlab_class <= 15:
            kind, data, _ = self.element(body, pos)
            if matlab_class == _MX_CHAR:
                codec = _MAT_TEXT.get(kind, "")
                if codec == "utf-16":
                    codec += "-le" if self.endian == "<" else "-be"
                return "", data.decode(codec or "?", "replace") if codec else None
            values = self.numbers(kind, data)
            return "", float(values[0]) if values.size else None
        return text, None

    def struct_rows(self, body: bytes, pos: int, count: int) -> list[tuple[Any, ...]]:
        kind, length_data, pos = self.element(body, pos)
        _, names, pos = self.element(body, pos)
        length = int(self.numbers(kind, length_data)[:1].sum())
        if not 0 < length <= 64 or len(names) % length:
            raise self.fail(f"struct field names of {len(names)} bytes in {length}-byte slots")
        if not 0 < len(names) // length <= _MAX_FIELDS:
            raise self.fail(f"a struct of {len(names) // length} fields (1..{_MAX_FIELDS})")
        if count * (len(names) // length) * _ELEMENT_BYTES > len(body) - pos:
            raise self.fail(f"{count} struct elements cannot fit in {len(body) - pos} bytes")
        fields = [names[i : i + length].split(b"\0")[0].decode("latin-1")
                  for i in range(0, len(names), length)]  # fmt: skip
        wanted = [fields.index(f) if f in fields else -1 for f in self.fields]
        rows = []
        for _ in range(count):
            values = []
            for _field in fields:
                kind, value, pos = self.element(body, pos)
                if kind != _MI_MATRIX:
                    raise self.fail(f"a struct field of type {kind}, expected a matrix")
                values.append(self.matrix(value)[1])
            rows.append(tuple(values[i] if i >= 0 else None for i in wanted))
        return rows


def read_struct_rows(
    data: bytes, shown: str, variable: str, fields: tuple[str, ...], max_bytes: int
) -> list[tuple[Any, ...]]:
    """The rows of the struct array `variable` in a MATLAB v5 file's bytes, as tuples of `fields`
    (None for a field the struct lacks); char arrays are str, numbers float.

    Raises:
        SourceError: naming `shown`: not a MATLAB v5/v7 file, malformed (an element past the
            end, dimensions over MATLAB's limits, a struct whose elements cannot fit in its
            bytes), compressed variables that inflate past `max_bytes` in all, or no such
            struct.
    """
    endian = {b"IM": "<", b"MI": ">"}.get(data[126:128], "")
    reader = _Reader(shown, endian, fields)
    if len(data) < 128 or not endian or data[124:126] not in (b"\x00\x01", b"\x01\x00"):
        raise reader.fail("no MATLAB 5 header; a v7.3 file must be re-saved with save -v7")
    pos, budget = 128, max_bytes  # what every compressed variable may inflate to, in all
    while pos < len(data):
        kind, body, pos = reader.element(data, pos)
        if kind == _MI_COMPRESSED:
            try:
                inflated = zlib.decompressobj().decompress(body, budget + 1)
            except zlib.error as exc:
                raise reader.fail(f"damaged compressed data: {exc}") from exc
            if len(inflated) > budget:
                raise reader.fail(f"what it holds decompresses past {max_bytes >> 20} MiB")
            budget -= len(inflated)
            kind, body, _ = reader.element(inflated, 0)
        if kind == _MI_MATRIX:
            name, rows = reader.matrix(body, variable)
            if name == variable and isinstance(rows, list):
                return rows
    raise reader.fail(f"no {variable!r} struct")
