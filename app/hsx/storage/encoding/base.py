"""What every encoding is: its tensor names and specs, its bytes per row, its encoder and its decoder.

An `Encoding` is one way a shard stores each captured layer `layer_<i>`. It owns everything that
differs between encodings, so that nothing else tells them apart: the tensors a layer takes and what
`verify` expects of them, the manifest's `shard_layout` lines, the bytes a row takes, the encoder the
shard writer feeds, the decoder every reader reads through, and what the manifest's per-layer stats
may say. The registry (hsx.storage.encoding) holds one of each.

A `LayerDecoder` is one layer of one shard, checked before anything is decoded: its tensors' dtypes
and shapes against the shard's rows and, for an index, the block limit. It decodes only the rows asked
for and checks what it reads (a frame's size and checksum, a scale), raising `ShardError`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from hsx.dtypes import DType
from hsx.storage.errors import ShardError

# Rows are encoded (and a lossless block decoded) this many bytes at a time: in the processor's cache
# the numpy passes of fp8 run about three times faster than over a whole sample, and a zstd frame of a
# plane of 128 KiB and more compresses as well as one of several MiB. Readers hold a lossless index to
# it: no block may declare more rows than the writer puts in one.
BLOCK_BYTES = 256 * 1024

# The tensors every shard holds as they are, whatever its encoding: one int64 per row.
PLAIN = ("input_ids", "loss_mask")


def block_rows(row_bytes: int) -> int:
    """How many rows an encoder takes at a time, and a lossless block holds at most (at least one)."""
    return max(1, BLOCK_BYTES // row_bytes)


@dataclass(frozen=True)
class TensorSpec:
    """What a shard's header must say of one tensor: its safetensors dtype code and shape (None: one
    axis of any length, which the decoder checks)."""

    code: str
    shape: tuple[int, ...] | None


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


def bytes_of(array: np.ndarray) -> memoryview:
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


@dataclass(frozen=True)
class ShardTensors:
    """A shard as its decoders see it: each tensor's bytes (`tensor(name)`, uint8 [nbytes], a view of
    the mapped file, say), each one's dtype code and shape as the header says, the shard's rows (T, the
    length of `input_ids`), and the dtype and hidden size its metadata records (None for a raw shard,
    whose layers say them themselves)."""

    tensor: Callable[[str], np.ndarray]
    codes: dict[str, str]
    shapes: dict[str, tuple[int, ...]]
    rows: int
    dtype: DType | None = None
    hidden_size: int | None = None

    def expect(self, name: str, code: str, shape: tuple[int, ...] | None) -> None:
        """ShardError unless the header holds tensor `name` of this code and shape (None: one axis)."""
        if name not in self.shapes:
            raise ShardError(f"no tensor {name}")
        got_code, got_shape = self.codes[name], self.shapes[name]
        if got_code != code or (got_shape != shape if shape is not None else len(got_shape) != 1):
            want = list(shape) if shape is not None else ["N"]
            raise ShardError(f"{name} is {got_code} {list(got_shape)}, expected {code} {want}")


class LayerDecoder(ABC):
    """One layer of one shard as the raw rows it stands for: uint8 [rows, hidden x itemsize] of `dtype`.
    Its constructor checks the layer's tensors (ShardError); `rows` reads only what it is asked for."""

    # Whether `rows` gives views of the shard's own bytes (raw) rather than memory of its own.
    views: ClassVar[bool] = False

    def __init__(self, key: str, dtype: DType, hidden_size: int, num_rows: int):
        self.key, self.dtype, self.hidden_size, self.num_rows = key, dtype, hidden_size, num_rows
        self.row_bytes = hidden_size * dtype.itemsize

    def rows(self, start: int, stop: int) -> np.ndarray:
        """Rows start..stop, decoded and checked; ShardError where what they are read from fails a check."""
        if not 0 <= start <= stop <= self.num_rows:
            raise ValueError(f"{self.key} has no rows {start}..{stop}")
        return self._rows(start, stop)

    @abstractmethod
    def _rows(self, start: int, stop: int) -> np.ndarray: ...

    def quantized(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """An fp8 layer's codes (uint8 [n, hidden]) and scales (float32 [n]) of rows start..stop, checked."""
        raise ValueError(f"{self.key} is not stored in fp8")

    def unchecked(self) -> int:
        """How many of the pieces it decodes carry no checksum of their own, which is no fault: such
        pieces are checked by the shard's sha256 alone (verify says so as a warning)."""
        return 0


class Encoding(ABC):
    """One way a shard stores its layers; the registry (hsx.storage.encoding.ENCODINGS) holds one of each."""

    name: ClassVar[str]
    # Whether layers are stored other than as they came: an encoder writes them, the shard's metadata
    # says how, and the manifest records per layer what was stored (`encoded_layers`).
    encoded: ClassVar[bool] = True
    # Whether the layers are float8_e4m3fn codes with a float32 scale per row, which an export may carry
    # as they are (speculators --fp8).
    fp8_codes: ClassVar[bool] = False
    # The manifest's `shard_layout` lines for a layer (hsx.manifest.shard_layout).
    layout: ClassVar[dict[str, str]]
    # What a decoder's `unchecked` counts, in verify's warning ("12 <note> in 3 shard(s)").
    unchecked_note: ClassVar[str] = "pieces without a checksum"

    @abstractmethod
    def tensor_names(self, key: str) -> list[str]:
        """The tensors that hold layer `key` (`layer_<i>`); the first one's presence says the layer is there."""

    @abstractmethod
    def specs(self, key: str, rows: int, dtype: DType, hidden_size: int) -> dict[str, TensorSpec]:
        """What a shard of `rows` rows must hold for layer `key`, tensor by tensor (verify checks it)."""

    @abstractmethod
    def stored_row_bytes(self, dtype: DType, hidden_size: int) -> int:
        """About how many bytes one row of one layer takes in a shard (the disk estimate)."""

    def encoder(self, key: str, dtype: DType, hidden_size: int) -> LayerEncoder:
        """The encoder of one layer of a shard (the shard writer's)."""
        raise ValueError(f"{self.name} layers are written as they came, through no encoder")

    @abstractmethod
    def decoder(self, key: str, tensors: ShardTensors) -> LayerDecoder:
        """Layer `key` of a shard, once its tensors hold together (ShardError otherwise)."""

    def metadata(self, dtype: DType, hidden_size: int) -> dict[str, str]:
        """What a shard of this encoding's `__metadata__` adds to a raw one's."""
        return {"encoding": self.name, "dtype": dtype.name, "hidden_size": str(hidden_size)}

    def stats_bytes(self, key: str, shapes: dict[str, tuple[int, ...]], dtype: DType) -> int:
        """The bytes one shard's layer `key` counts in its stats (`LayerStats.bytes`), from its tensors' shapes."""
        raise ValueError(f"{self.name} layers keep no stats")

    def error_problems(self, max_error: float | None, mean_error: float | None) -> list[str]:
        """What is wrong with a layer's recorded errors (the manifest's `encoded_layers`), one line each."""
        return []
