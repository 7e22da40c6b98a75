"""lossless: the rows in blocks, each block's byte planes one zstd frame apiece (hsx.storage.planes).

A layer is three tensors: `layer_<i>.zstd` uint8 [N] the frames back to back, `layer_<i>.rows` int64
[B + 1] where each block's rows begin (block k holds rows rows[k] .. rows[k + 1]; blocks never cross
two samples and hold at most BLOCK_BYTES of rows), `layer_<i>.frames` int64 [B x P + 1] where each frame
begins in `layer_<i>.zstd` (block k's plane p is frame k x P + p; P = the dtype's bytes per value).
Decoded: the stored bytes, bit for bit.

What a file says is checked before it is believed: the index must cover the shard's rows exactly, in
blocks no larger than the writer makes, over frames that lie within the data; a frame must declare the
size its plane needs before it is decompressed, and match its checksum. So a read takes memory for
the rows it asks for, whatever the file claims, and only the blocks holding them are decompressed.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

from hsx.dtypes import DType
from hsx.storage import planes
from hsx.storage.encoding.base import (
    Encoding,
    LayerDecoder,
    LayerEncoder,
    ShardTensors,
    Tensor,
    TensorSpec,
    block_rows,
    bytes_of,
)
from hsx.storage.errors import ShardError

# The disk estimate's bytes per 100 raw bytes, a little above what hidden states of a tiny random
# Llama and of a trained encoder came to (docs/performance.md, "Encodings").
ESTIMATE_PERCENT = {"bfloat16": 75, "float16": 90, "float32": 90}


class _Frames:
    def __init__(self, rows: int, frames: list[bytes]):
        self.rows, self.frames = rows, frames


class LosslessEncoder(LayerEncoder):
    def __init__(self, key: str, dtype: DType, hidden_size: int):
        super().__init__(key, dtype, hidden_size)
        self.frames: list[bytes] = []
        self.row_starts = [0]
        self.frame_starts = [0]

    def encode(self, rows: np.ndarray) -> _Frames:
        return _Frames(rows.shape[0], planes.compress(rows, self.dtype.itemsize))

    def _keep(self, block: _Frames) -> None:
        for frame in block.frames:
            self.frames.append(frame)
            self.frame_starts.append(self.frame_starts[-1] + len(frame))
        self.num_rows += block.rows
        self.row_starts.append(self.num_rows)
        self.stats.raw_bytes += block.rows * self.row_bytes
        self.stats.bytes += sum(map(len, block.frames)) + 8 * (1 + len(block.frames))

    def tensors(self) -> list[Tensor]:
        starts = np.asarray(self.row_starts, dtype="<i8"), np.asarray(self.frame_starts, dtype="<i8")
        return [
            (f"{self.key}.zstd", "U8", (self.frame_starts[-1],), self.frames),
            (f"{self.key}.rows", "I64", (len(self.row_starts),), [bytes_of(starts[0])]),
            (f"{self.key}.frames", "I64", (len(self.frame_starts),), [bytes_of(starts[1])]),
        ]


class LosslessDecoder(LayerDecoder):
    def __init__(self, key: str, tensors: ShardTensors, dtype: DType, hidden_size: int):
        super().__init__(key, dtype, hidden_size, tensors.rows)
        for suffix, code in (("zstd", "U8"), ("rows", "I64"), ("frames", "I64")):
            tensors.expect(f"{key}.{suffix}", code, None)
        self.data = tensors.tensor(f"{key}.zstd")
        self.row_starts = tensors.tensor(f"{key}.rows").view("<i8")
        self.frame_starts = tensors.tensor(f"{key}.frames").view("<i8")
        self._check_index(tensors.rows)

    def _check_index(self, total: int) -> None:
        """The index must cover the shard's rows in blocks the writer could have made, over frames in the data."""
        rows, frames, key = self.row_starts, self.frame_starts, self.key
        blocks, limit = len(rows) - 1, block_rows(self.row_bytes)
        if blocks < 0 or rows[0] != 0 or rows[-1] != total:
            shown = f"{rows[0]}..{rows[-1]}" if blocks >= 0 else "nothing"
            raise ShardError(f"{key}.rows covers rows {shown}, the shard holds {total}")
        sizes = np.diff(rows)
        if blocks and (sizes.min() <= 0 or sizes.max() > limit):
            k = int(np.flatnonzero((sizes <= 0) | (sizes > limit))[0])
            raise ShardError(
                f"{key}.rows declares block {k} of {int(sizes[k])} rows; a block holds 1 to {limit} rows "
                f"of {self.row_bytes} bytes"
            )
        if len(frames) != blocks * self.dtype.itemsize + 1:
            raise ShardError(
                f"{key}.frames has {len(frames)} entries for {blocks} blocks of {self.dtype.itemsize} planes"
            )
        if frames[0] != 0 or frames[-1] != len(self.data) or (blocks and np.diff(frames).min() < 0):
            raise ShardError(f"{key}.frames does not cut {key}.zstd ({len(self.data)} bytes) into frames in order")

    def _block(self, k: int) -> np.ndarray:
        """Block k decoded: uint8 [rows, row bytes]."""
        r0, r1 = int(self.row_starts[k]), int(self.row_starts[k + 1])
        item, starts = self.dtype.itemsize, self.frame_starts
        frames = [self.data[starts[k * item + p] : starts[k * item + p + 1]] for p in range(item)]
        try:
            block = planes.decompress(frames, item, (r1 - r0) * self.row_bytes)
        except ValueError as exc:
            raise ShardError(f"block {k} (rows {r0}..{r1}): {exc}") from None
        return block.reshape(r1 - r0, self.row_bytes)

    def _rows(self, start: int, stop: int) -> np.ndarray:
        out = np.empty((stop - start, self.row_bytes), dtype=np.uint8)
        first = int(np.searchsorted(self.row_starts, start, side="right")) - 1
        last = int(np.searchsorted(self.row_starts, stop, side="left"))
        for k in range(max(first, 0), last):
            r0, r1 = int(self.row_starts[k]), int(self.row_starts[k + 1])
            block = self._block(k)
            lo, hi = max(r0, start), min(r1, stop)
            out[lo - start : hi - start] = block[lo - r0 : hi - r0]
        return out

    def unchecked(self) -> int:
        starts = self.frame_starts
        return sum(not planes.has_checksum(self.data[starts[i] : starts[i + 1]]) for i in range(len(starts) - 1))


class Lossless(Encoding):
    name = "lossless"
    unchecked_note = "zstd frames without a checksum (written by an hsx from before frames carried one)"
    layout: ClassVar[dict[str, str]] = {
        "layer_<i>.zstd": "uint8 [N]: zstd frames (content size and checksum), one per byte plane (least "
        "significant first) of each block",
        "layer_<i>.rows": "int64 [B + 1]: block k holds rows rows[k] .. rows[k + 1]",
        "layer_<i>.frames": "int64 [B x bytes per value + 1]: where each frame begins in layer_<i>.zstd",
    }

    def tensor_names(self, key: str) -> list[str]:
        return [f"{key}.zstd", f"{key}.rows", f"{key}.frames"]

    def specs(self, key: str, rows: int, dtype: DType, hidden_size: int) -> dict[str, TensorSpec]:
        return {
            f"{key}.zstd": TensorSpec("U8", None),
            f"{key}.rows": TensorSpec("I64", None),
            f"{key}.frames": TensorSpec("I64", None),
        }

    def stored_row_bytes(self, dtype: DType, hidden_size: int) -> int:
        return -(-hidden_size * dtype.itemsize * ESTIMATE_PERCENT.get(dtype.name, 100) // 100)

    def encoder(self, key: str, dtype: DType, hidden_size: int) -> LayerEncoder:
        return LosslessEncoder(key, dtype, hidden_size)

    def decoder(self, key: str, tensors: ShardTensors) -> LayerDecoder:
        assert tensors.dtype is not None and tensors.hidden_size is not None, "an encoded shard's metadata says them"
        return LosslessDecoder(key, tensors, tensors.dtype, tensors.hidden_size)

    def stats_bytes(self, key: str, shapes: dict[str, tuple[int, ...]], dtype: DType) -> int:
        # the frames, and per block its row index entry and one frame index entry per plane
        blocks = shapes[f"{key}.rows"][0] - 1
        return shapes[f"{key}.zstd"][0] + 8 * blocks * (1 + dtype.itemsize)

    def error_problems(self, max_error: float | None, mean_error: float | None) -> list[str]:
        if max_error is None and mean_error is None:
            return []
        return [f"records errors (max {max_error}, mean {mean_error}) for a lossless layer, which has none"]
