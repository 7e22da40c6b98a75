"""Read a safetensors file's header to locate each tensor's bytes without decoding them.

Shards are assembled by copying byte ranges straight from dump files, so a tensor is
never decoded and re-encoded on its way to disk; verify reads a shard's rows the same way,
so it needs no tensor library.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsx.dtypes import DTYPES_BY_CODE

MAX_HEADER_BYTES = 100 * 1024 * 1024


class SafetensorsFormatError(ValueError):
    """The file is not a well-formed safetensors file."""


@dataclass(frozen=True)
class TensorSpan:
    """Where one tensor's raw bytes lie in a file."""

    path: Path
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute file offset
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def row_bytes(self) -> int:
        """Bytes of one row along the first axis."""
        return math.prod(self.shape[1:]) * DTYPES_BY_CODE[self.dtype].itemsize

    def read_rows(self, fd: int, start: int, stop: int) -> bytes:
        """Rows start..stop along the first axis (fewer past the end), from `fd`, this file opened."""
        stop = max(start, min(stop, self.shape[0] if self.shape else 0))
        return os.pread(fd, (stop - start) * self.row_bytes, self.start + start * self.row_bytes)

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(self.start)
            data = f.read(self.nbytes)
        if len(data) != self.nbytes:
            raise SafetensorsFormatError(f"{self.path}: truncated tensor data")
        return data


def _read_header(path: Path) -> tuple[dict[str, Any], int, int]:
    """The header as parsed JSON, where the data starts, and the file's size."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) != 8:
                raise SafetensorsFormatError(f"{path.name}: shorter than a safetensors header")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
                raise SafetensorsFormatError(f"{path.name}: header length {header_len} does not fit the file")
            header = json.loads(f.read(header_len))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise SafetensorsFormatError(f"{path.name}: unreadable header ({exc})") from exc
    if not isinstance(header, dict):
        raise SafetensorsFormatError(f"{path.name}: header is not an object")
    return header, 8 + header_len, size


def read_index(path: Path) -> dict[str, TensorSpan]:
    """Map tensor name to its byte span, checking the header against the file's size."""
    path = Path(path)
    header, base, size = _read_header(path)
    spans: dict[str, TensorSpan] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError) as exc:
            raise SafetensorsFormatError(f"{path.name}: bad header entry for {name!r}") from exc
        if not isinstance(shape, list) or not all(_whole(d) for d in shape) or not (_whole(begin) and _whole(end)):
            raise SafetensorsFormatError(f"{path.name}: {name} has a malformed shape or offsets")
        shape = tuple(shape)
        if dtype not in DTYPES_BY_CODE:
            raise SafetensorsFormatError(f"{path.name}: {name} has unsupported dtype {dtype}")
        if end - begin != math.prod(shape) * DTYPES_BY_CODE[dtype].itemsize or begin < 0 or base + end > size:
            raise SafetensorsFormatError(f"{path.name}: {name} data does not fit its shape or the file")
        spans[name] = TensorSpan(path, dtype, shape, base + begin, base + end)
    return spans


def read_metadata(path: Path) -> dict[str, str]:
    """The header's `__metadata__` (string keys and values; empty when there is none)."""
    path = Path(path)
    metadata = _read_header(path)[0].get("__metadata__") or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsFormatError(f"{path.name}: __metadata__ is not a map of strings")
    return metadata


def _whole(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def encode_header(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None) -> bytes:
    """The 8-byte length plus JSON header for tensors laid out back to back in this order.

    The JSON is space-padded so the data starts 8-byte aligned, as the reference writer does; with
    `metadata` None the header has no `__metadata__`, as the reference writer leaves it when given
    none. A name given twice (or named like the metadata) is a ValueError: JSON would keep one entry
    for it, whose offsets no longer cover the data, and no reader opens such a file.
    """
    header: dict[str, object] = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in entries:
        if name in header or name == "__metadata__":
            raise ValueError(f"tensor name {name!r} is given twice; a safetensors header names each tensor once")
        nbytes = math.prod(shape) * DTYPES_BY_CODE[dtype].itemsize
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - (8 + len(raw)) % 8) % 8)
    return struct.pack("<Q", len(raw)) + raw
