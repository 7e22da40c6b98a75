"""How a job's shards store its hidden states: raw (as they came), lossless or fp8.

`input_ids` and `loss_mask` are int64 [T] in every encoding; what changes is how each captured layer
`layer_<i>` is stored (docs/api.md, "Output format", shows a reader of each in plain Python):

- raw: `layer_<i>` [T, hidden] of the job's dtype.
- lossless: the rows cut into blocks (never across two samples, at most BLOCK_BYTES of rows each),
  each block's byte planes one zstd frame apiece (hsx.storage.planes): `layer_<i>.zstd` uint8 [N] the
  frames back to back, `layer_<i>.rows` int64 [B + 1] where each block's rows begin (block k holds rows
  rows[k] .. rows[k + 1]), `layer_<i>.frames` int64 [B x P + 1] where each frame begins in
  `layer_<i>.zstd` (block k's plane p is frame k x P + p; P = the dtype's bytes per value). Decoded:
  the stored bytes, bit for bit.
- fp8: `layer_<i>.fp8` float8_e4m3fn [T, hidden] and `layer_<i>.scale` float32 [T]
  (hsx.storage.fp8); a value is its code's value x its row's scale, rounded to the job's dtype.

An encoded shard says so in its `__metadata__`: `encoding`, `dtype` (of the decoded values) and
`hidden_size`. Encoders take a layer's rows block by block as the shard writer reads them (each block
checked for NaN and Inf first); `EncodedLayers` reads an encoded shard's layers back as the raw rows
they stand for, whoever reads them (the Dataset, the exports, verify, the service's tensor route).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hsx.dtypes import DTYPES, ENCODINGS, DType
from hsx.storage import fp8, planes
from hsx.storage.floats import from_float32, to_float32

# Rows are encoded (and a lossless block decoded) this many bytes at a time: in the processor's cache
# the numpy passes of fp8 run about three times faster than over a whole sample, and a zstd frame of a
# plane of 128 KiB and more compresses as well as one of several MiB.
BLOCK_BYTES = 256 * 1024

# The disk estimate's bytes per 100 raw bytes for lossless, a little above what hidden states of a
# tiny random Llama and of a trained encoder came to (docs/performance.md, "Encodings"); fp8's is exact.
LOSSLESS_ESTIMATE_PERCENT = {"bfloat16": 75, "float16": 90, "float32": 90}


def block_rows(row_bytes: int) -> int:
    """How many rows an encoder takes at a time (at least one)."""
    return max(1, BLOCK_BYTES // row_bytes)


def stored_row_bytes(encoding: str, dtype: DType, hidden_size: int) -> int:
    """About how many bytes one row of one layer takes in a shard of this encoding."""
    raw = hidden_size * dtype.itemsize
    if encoding == "fp8":
        return hidden_size + 4
    if encoding == "lossless":
        return -(-raw * LOSSLESS_ESTIMATE_PERCENT.get(dtype.name, 100) // 100)
    return raw


def tensor_names(encoding: str, key: str) -> list[str]:
    """The tensors that hold layer `key` (`layer_<i>`) in a shard of this encoding."""
    if encoding == "lossless":
        return [f"{key}.zstd", f"{key}.rows", f"{key}.frames"]
    if encoding == "fp8":
        return [f"{key}.fp8", f"{key}.scale"]
    return [key]


@dataclass
class LayerStats:
    """What encoding one layer of a shard (or of a job, shards added up) stored: the raw bytes it
    stands for, the bytes it took, and for fp8 the values' errors relative to their rows' largest
    magnitude (the largest, their sum and count, so that shards add up to the job's mean)."""

    raw_bytes: int = 0
    bytes: int = 0
    max_error: float | None = None
    error_sum: float = 0.0
    values: int = 0

    def add(self, other: LayerStats) -> None:
        self.raw_bytes += other.raw_bytes
        self.bytes += other.bytes
        if other.max_error is not None:
            self.max_error = max(self.max_error or 0.0, other.max_error)
        self.error_sum += other.error_sum
        self.values += other.values

    @property
    def mean_error(self) -> float | None:
        return None if self.max_error is None else self.error_sum / max(1, self.values)

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> LayerStats:
        return cls(**{k: doc[k] for k in ("raw_bytes", "bytes", "max_error", "error_sum", "values") if k in doc})


Tensor = tuple[str, str, tuple[int, ...], list[Any]]  # name, safetensors code, shape, its bytes in pieces


def _bytes_of(array: np.ndarray) -> memoryview:
    """An array's bytes as a flat byte buffer (its length counts bytes, not elements)."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8).data


class LayerEncoder(ABC):
    """One layer of one shard, encoded sample by sample: `encode` a sample's blocks, then `keep` them
    once the whole sample passed its checks (a sample refused halfway leaves nothing behind)."""

    def __init__(self, key: str, dtype: DType, hidden_size: int):
        self.key, self.dtype, self.hidden_size = key, dtype, hidden_size
        self.row_bytes = hidden_size * dtype.itemsize
        self.stats = LayerStats()
        self.num_rows = 0

    @abstractmethod
    def encode(self, rows: np.ndarray) -> Any:
        """One block: raw rows, uint8 [n, row bytes]."""

    def keep(self, blocks: list[Any]) -> None:
        for block in blocks:
            self._keep(block)

    @abstractmethod
    def _keep(self, block: Any) -> None: ...

    @abstractmethod
    def tensors(self) -> list[Tensor]:
        """The layer's tensors, in file order."""


@dataclass
class _Frames:
    rows: int
    frames: list[bytes]


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
            (f"{self.key}.rows", "I64", (len(self.row_starts),), [_bytes_of(starts[0])]),
            (f"{self.key}.frames", "I64", (len(self.frame_starts),), [_bytes_of(starts[1])]),
        ]


class Fp8Encoder(LayerEncoder):
    def __init__(self, key: str, dtype: DType, hidden_size: int):
        super().__init__(key, dtype, hidden_size)
        self.codes: list[np.ndarray] = []
        self.scales: list[np.ndarray] = []
        self.stats.max_error = 0.0

    def encode(self, rows: np.ndarray) -> fp8.Quantized:
        # The errors are those of the codes' values (x scale, in float32); readers round them to the
        # job's dtype, which adds at most half an ulp of that dtype.
        return fp8.quantize(to_float32(rows, self.dtype))

    def _keep(self, block: fp8.Quantized) -> None:
        self.codes.append(block.codes)
        self.scales.append(block.scales.astype("<f4"))
        rows = block.codes.shape[0]
        self.num_rows += rows
        self.stats.raw_bytes += rows * self.row_bytes
        self.stats.bytes += rows * (self.hidden_size + 4)
        self.stats.max_error = max(self.stats.max_error or 0.0, block.max_error)
        self.stats.error_sum += block.error_sum
        self.stats.values += block.values

    def tensors(self) -> list[Tensor]:
        return [
            (f"{self.key}.fp8", "F8_E4M3", (self.num_rows, self.hidden_size), [_bytes_of(c) for c in self.codes]),
            (f"{self.key}.scale", "F32", (self.num_rows,), [_bytes_of(s) for s in self.scales]),
        ]


ENCODERS: dict[str, type[LayerEncoder]] = {"lossless": LosslessEncoder, "fp8": Fp8Encoder}


def encoder(encoding: str, key: str, dtype: DType, hidden_size: int) -> LayerEncoder:
    """The encoder of one layer of a shard (not for raw, which the shard writer copies as it is)."""
    if encoding not in ENCODERS:
        raise ValueError(f"unknown encoding {encoding!r}; one of {', '.join(ENCODINGS)}")
    return ENCODERS[encoding](key, dtype, hidden_size)


def shard_metadata(encoding: str, dtype: DType, hidden_size: int) -> dict[str, str]:
    """What an encoded shard's `__metadata__` adds to the raw one's."""
    return {"encoding": encoding, "dtype": dtype.name, "hidden_size": str(hidden_size)}


Tensors = Callable[[str], np.ndarray]  # a tensor of the shard by name: its bytes, uint8 [nbytes]


@dataclass
class EncodedLayers:
    """An encoded shard's layers as the raw rows they stand for. `tensor(name)` gives a tensor's bytes
    (a view of the mapped file, say); `shapes` every tensor's shape, as the header says."""

    encoding: str
    dtype: DType
    hidden_size: int
    tensor: Tensors
    shapes: dict[str, tuple[int, ...]]
    _index: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    @classmethod
    def from_metadata(
        cls, metadata: dict[str, str], tensor: Tensors, shapes: dict[str, tuple[int, ...]]
    ) -> EncodedLayers | None:
        """The shard's encoded layers, or None for a raw shard; ValueError when the metadata names an
        encoding or dtype this hsx does not know."""
        encoding = metadata.get("encoding", "raw")
        if encoding == "raw":
            return None
        dtype = DTYPES.get(metadata.get("dtype", ""))
        hidden = metadata.get("hidden_size", "")
        if encoding not in ENCODERS or dtype is None or not dtype.is_float or not hidden.isdigit():
            raise ValueError(
                f"the shard's metadata says encoding {encoding!r}, dtype {metadata.get('dtype')!r}, "
                f"hidden_size {hidden!r}: not an encoding this hsx reads"
            )
        return cls(encoding, dtype, int(hidden), tensor, shapes)

    def holds(self, key: str) -> bool:
        return tensor_names(self.encoding, key)[0] in self.shapes

    def num_rows(self, key: str) -> int:
        if self.encoding == "fp8":
            return self.shapes[f"{key}.fp8"][0]
        return int(self._lossless_index(key)[0][-1])

    def rows(self, key: str, start: int, stop: int) -> np.ndarray:
        """Rows start..stop of layer `key`, decoded: uint8 [stop - start, hidden x itemsize]."""
        if not 0 <= start <= stop <= self.num_rows(key):
            raise ValueError(f"{key} has no rows {start}..{stop}")
        if self.encoding == "fp8":
            return self._fp8_decoded(key, start, stop)
        return self._lossless_rows(key, start, stop)

    def _fp8_decoded(self, key: str, start: int, stop: int) -> np.ndarray:
        # A block of rows at a time: the numpy passes run in the processor's cache.
        row_bytes = self.hidden_size * self.dtype.itemsize
        out = np.empty((stop - start, row_bytes), dtype=np.uint8)
        step = block_rows(row_bytes)
        for at in range(start, stop, step):
            codes, scales = self.fp8_rows(key, at, min(at + step, stop))
            out[at - start : at - start + codes.shape[0]] = from_float32(fp8.dequantize(codes, scales), self.dtype)
        return out

    def fp8_rows(self, key: str, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """An fp8 layer's codes (uint8 [n, hidden]) and scales (float32 [n]) of rows start..stop."""
        codes = self.tensor(f"{key}.fp8").reshape(-1, self.hidden_size)[start:stop]
        scales = self.tensor(f"{key}.scale").view("<f4")[start:stop]
        return codes, scales

    def _lossless_index(self, key: str) -> tuple[np.ndarray, np.ndarray]:
        index = self._index.get(key)
        if index is None:
            row_starts = self.tensor(f"{key}.rows").view("<i8")
            frame_starts = self.tensor(f"{key}.frames").view("<i8")
            size = self.shapes[f"{key}.zstd"][0]
            planes_per_block = self.dtype.itemsize
            if (
                len(row_starts) < 1
                or row_starts[0] != 0
                or (len(row_starts) > 1 and np.any(np.diff(row_starts) <= 0))
                or len(frame_starts) != (len(row_starts) - 1) * planes_per_block + 1
                or frame_starts[0] != 0
                or frame_starts[-1] != size
                or np.any(np.diff(frame_starts) < 0)
            ):
                raise ValueError(f"{key}.rows and {key}.frames do not index {key}.zstd's blocks")
            index = self._index[key] = (row_starts, frame_starts)
        return index

    def _lossless_rows(self, key: str, start: int, stop: int) -> np.ndarray:
        row_starts, frame_starts = self._lossless_index(key)
        data = self.tensor(f"{key}.zstd")
        item, row_bytes = self.dtype.itemsize, self.hidden_size * self.dtype.itemsize
        out = np.empty((stop - start, row_bytes), dtype=np.uint8)
        first = int(np.searchsorted(row_starts, start, side="right")) - 1
        last = int(np.searchsorted(row_starts, stop, side="left"))
        for k in range(max(first, 0), last):
            r0, r1 = int(row_starts[k]), int(row_starts[k + 1])
            frames = [data[frame_starts[k * item + p] : frame_starts[k * item + p + 1]] for p in range(item)]
            block = planes.decompress(frames, item, (r1 - r0) * row_bytes).reshape(r1 - r0, row_bytes)
            lo, hi = max(r0, start), min(r1, stop)
            out[lo - start : hi - start] = block[lo - r0 : hi - r0]
        return out
