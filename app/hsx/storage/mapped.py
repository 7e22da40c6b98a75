"""A shard's rows as views of the file mapped into memory: no copy until a caller makes one.

An export reads every row of a job once and writes it out once. Through this mapping a row is
copied only where its output needs it somewhere else (layers side by side); a tensor written as it
lies in the shard goes from the page cache straight to the output file. The mapping is private
(copy-on-write), so a view is writable for the libraries that want one, and nothing reaches the file.

Whatever the shard's encoding (hsx.storage.encoding), `rows` and `layout` speak of the tensors a raw
shard holds: `input_ids`, `loss_mask` and `layer_<i>` [T, hidden] of the job's dtype. An encoded
layer's rows are decoded into new memory; the rest stay views.
"""

from __future__ import annotations

import math
import mmap
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hsx.dtypes import DTYPES_BY_CODE
from hsx.storage.encoding import EncodedLayers
from hsx.storage.safetensors_raw import SafetensorsFormatError, TensorSpan, read_index, read_metadata


@dataclass(frozen=True)
class Layout:
    """A tensor as a raw shard holds it: its safetensors dtype code and shape."""

    dtype: str
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * DTYPES_BY_CODE[self.dtype].itemsize


class MappedShard:
    """One shard file, mapped; `rows` gives a tensor's rows (a view of the mapping where not decoded)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.spans: dict[str, TensorSpan] = read_index(self.path)
            metadata = read_metadata(self.path)
        except (OSError, SafetensorsFormatError) as exc:
            raise ValueError(f"{self.path}: unreadable shard ({exc}); run hsx verify") from exc
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # a file of nothing but a header holds no rows; mmap refuses a length of 0
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
        self._bytes = np.frombuffer(data, dtype=np.uint8)
        shapes = {name: span.shape for name, span in self.spans.items()}
        try:
            self.encoded = EncodedLayers.from_metadata(metadata, self.tensor_bytes, shapes)
        except ValueError as exc:
            raise ValueError(f"{self.path}: {exc}") from None

    @property
    def encoding(self) -> str:
        return "raw" if self.encoded is None else self.encoded.encoding

    def span(self, key: str) -> TensorSpan:
        """Where a tensor the file holds lies (for an encoded layer, one of its tensors' names)."""
        span = self.spans.get(key)
        if span is None:
            raise ValueError(f"{self.path.name}: no tensor {key!r}")
        return span

    def tensor_bytes(self, name: str) -> np.ndarray:
        """A tensor the file holds as its bytes, uint8 [nbytes], a view of the mapping."""
        span = self.span(name)
        return self._bytes[span.start : span.end]

    def _decoded(self, key: str) -> EncodedLayers | None:
        return self.encoded if self.encoded is not None and self.encoded.holds(key) else None

    def layout(self, key: str) -> Layout:
        """The tensor `key` as a raw shard would hold it (a layer in the job's dtype, decoded)."""
        encoded = self._decoded(key)
        if encoded is None:
            span = self.span(key)
            return Layout(span.dtype, span.shape)
        return Layout(encoded.dtype.code, (encoded.num_rows(key), encoded.hidden_size))

    def fp8_rows(self, key: str, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """An fp8 layer's stored codes (uint8 [rows, hidden]) and scales (float32 [rows]), rows start..stop."""
        encoded = self._decoded(key)
        if encoded is None or encoded.encoding != "fp8":
            raise ValueError(f"{self.path.name}: {key} is not stored in fp8")
        if not 0 <= start <= stop <= encoded.num_rows(key):
            raise ValueError(f"{self.path.name}: {key} has no rows {start}..{stop}")
        return encoded.fp8_rows(key, start, stop)

    def rows(self, key: str, start: int, stop: int) -> np.ndarray:
        """Rows start..stop of `key` as uint8 [stop - start, bytes per row]: a view of the mapping, or
        for an encoded layer its rows decoded (ValueError where they cannot be)."""
        encoded = self._decoded(key)
        if encoded is not None:
            try:
                return encoded.rows(key, start, stop)
            except ValueError as exc:
                raise ValueError(f"{self.path.name}: {exc}") from None
        span = self.span(key)
        if not span.shape or not 0 <= start <= stop <= span.shape[0]:
            raise ValueError(f"{self.path.name}: {key} has no rows {start}..{stop}")
        width = span.row_bytes
        return self._bytes[span.start + start * width : span.start + stop * width].reshape(stop - start, width)


class MappedShards:
    """A job folder's shards, mapped on first use; the last `max_open` stay mapped (one process's)."""

    def __init__(self, job_dir: Path, max_open: int = 8):
        self.job_dir = Path(job_dir)
        self.max_open = max_open
        self._open: OrderedDict[str, MappedShard] = OrderedDict()

    def get(self, name: str) -> MappedShard:
        shard = self._open.get(name)
        if shard is None:
            shard = self._open[name] = MappedShard(self.job_dir / name)
            while len(self._open) > self.max_open:
                # a view still in use keeps its mapping alive; the mapping goes with the last view
                self._open.popitem(last=False)
        else:
            self._open.move_to_end(name)
        return shard
