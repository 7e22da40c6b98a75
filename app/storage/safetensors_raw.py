"""Read a safetensors file's header to locate each tensor's bytes without decoding them.

Shards are assembled by copying byte ranges straight from dump files, so a tensor is
never decoded and re-encoded on its way to disk.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

# safetensors dtype codes and the names the dump protocol and torch use.
CODE_BY_NAME = {
    "bfloat16": "BF16",
    "float16": "F16",
    "float32": "F32",
    "float64": "F64",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}
NAME_BY_CODE = {code: name for name, code in CODE_BY_NAME.items()}
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
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

    def read(self) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(self.start)
            data = f.read(self.nbytes)
        if len(data) != self.nbytes:
            raise SafetensorsFormatError(f"{self.path}: truncated tensor data")
        return data


def read_index(path: Path) -> dict[str, TensorSpan]:
    """Map tensor name to its byte span, checking the header against the file's size."""
    path = Path(path)
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
    base = 8 + header_len
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
        if dtype not in ITEMSIZE:
            raise SafetensorsFormatError(f"{path.name}: {name} has unsupported dtype {dtype}")
        if end - begin != math.prod(shape) * ITEMSIZE[dtype] or begin < 0 or base + end > size:
            raise SafetensorsFormatError(f"{path.name}: {name} data does not fit its shape or the file")
        spans[name] = TensorSpan(path, dtype, shape, base + begin, base + end)
    return spans


def _whole(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def encode_header(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]) -> bytes:
    """The 8-byte length plus JSON header for tensors laid out back to back in this order.

    The JSON is space-padded so the data starts 8-byte aligned, as the reference writer does.
    """
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, dtype, shape in entries:
        nbytes = math.prod(shape) * ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - (8 + len(raw)) % 8) % 8)
    return struct.pack("<Q", len(raw)) + raw
