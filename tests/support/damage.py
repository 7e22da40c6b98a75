"""Shards damaged on purpose: written by hsx's own shard writer, then edited on disk as a test needs them.

`Shard` reads a shard file's tensors (bytes, dtype code, shape, in file order) and metadata, lets a test
replace tensors or bytes, and writes the file back as a valid safetensors file (the header rebuilt by
hsx's own `encode_header`). `crafted_block` is the small file that declares a huge lossless block:
zstd frames of zeros, each declaring its plane of `rows` rows.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import zstandard

from hsx.storage.safetensors_raw import encode_header, read_index, read_metadata


@dataclass
class Tensor:
    code: str
    shape: tuple[int, ...]
    data: bytes


class Shard:
    def __init__(self, path: Path):
        self.path = Path(path)
        raw = self.path.read_bytes()
        self.metadata = read_metadata(self.path)
        spans = sorted(read_index(self.path).items(), key=lambda item: item[1].start)
        self.tensors = {name: Tensor(span.dtype, span.shape, raw[span.start : span.end]) for name, span in spans}

    def save(self) -> None:
        entries = [(name, t.code, t.shape) for name, t in self.tensors.items()]
        self.path.write_bytes(encode_header(entries, self.metadata) + b"".join(t.data for t in self.tensors.values()))

    def array(self, name: str, dtype: str) -> np.ndarray:
        return np.frombuffer(self.tensors[name].data, dtype=dtype).copy()

    def put(self, name: str, values: np.ndarray, code: str) -> None:
        self.tensors[name] = Tensor(code, tuple(values.shape), values.tobytes())

    def frame(self, key: str, block: int, plane: int) -> tuple[int, int]:
        """Where frame (block, plane) of lossless layer `key` lies in the file: (start, end) offsets."""
        starts = self.array(f"{key}.frames", "<i8")
        planes = (len(starts) - 1) // (len(self.array(f"{key}.rows", "<i8")) - 1)
        base = read_index(self.path)[f"{key}.zstd"].start
        k = block * planes + plane
        return base + int(starts[k]), base + int(starts[k + 1])


def zero_frame(nbytes: int) -> bytes:
    """One zstd frame of `nbytes` zeros that declares its size (a few KB however large), made a piece at a time."""
    cctx = zstandard.ZstdCompressor(write_content_size=True)
    out = cctx.compressobj(size=nbytes)
    piece = bytes(1 << 20)
    parts, left = [], nbytes
    while left:
        parts.append(out.compress(piece[: min(left, len(piece))]))
        left -= min(left, len(piece))
    parts.append(out.flush())
    return b"".join(parts)


def crafted_block(
    shard: Shard, key: str, rows: int, hidden: int, itemsize: int, declared_rows: int | None = None
) -> None:
    """Layer `key` as one block of `rows` rows (`.rows` [0, rows]) whose byte planes are frames of zeros,
    each declaring `declared_rows` rows (default: `rows`) of its plane."""
    declared = (declared_rows or rows) * hidden
    frames = [zero_frame(declared) for _ in range(itemsize)]
    shard.put(f"{key}.rows", np.array([0, rows], dtype="<i8"), "I64")
    shard.put(f"{key}.frames", np.cumsum([0, *map(len, frames)]).astype("<i8"), "I64")
    shard.put(f"{key}.zstd", np.frombuffer(b"".join(frames), dtype=np.uint8), "U8")


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x10]))


def set_scale(path: Path, key: str, row: int, value: float) -> None:
    """Row `row`'s scale of fp8 layer `key`, in place."""
    span = read_index(path)[f"{key}.scale"]
    with open(path, "r+b") as f:
        f.seek(span.start + 4 * row)
        f.write(struct.pack("<f", value))


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
