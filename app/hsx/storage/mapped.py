"""A shard's rows as views of the file mapped into memory: no copy until a caller makes one.

An export reads every row of a job once and writes it out once. Through this mapping a row is
copied only where its output needs it somewhere else (layers side by side); a tensor written as it
lies in the shard goes from the page cache straight to the output file. The mapping is private
(copy-on-write), so a view is writable for the libraries that want one, and nothing reaches the file.

Whatever the shard's encoding (hsx.storage.encoding), `rows` and `layout` speak of the tensors a raw
shard holds: `input_ids`, `loss_mask` and `layer_<i>` [T, hidden] of the job's dtype. A layer is read
through its encoding's decoder, which checks the layer's tensors when it is first asked for and what
it decodes as it goes; an encoded layer's rows are decoded into new memory, the rest stay views.
`place` checks a sample's recorded rows against the shard's own metadata. What fails a check is a
`ShardError` naming this file and the layer.
"""

from __future__ import annotations

import math
import mmap
import os
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from hsx.dtypes import DTYPES_BY_CODE
from hsx.storage.encoding import PLAIN, LayerDecoder, ShardTensors, shard_encoding
from hsx.storage.errors import ShardError
from hsx.storage.placement import Placement
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
            self.metadata = read_metadata(self.path)
        except (OSError, SafetensorsFormatError) as exc:
            raise ShardError(f"unreadable shard ({exc}); run hsx verify", shard=self.path) from exc
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # a file of nothing but a header holds no rows; mmap refuses a length of 0
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
        self._bytes = np.frombuffer(data, dtype=np.uint8)
        ids = self.spans.get("input_ids")
        try:
            self.encoding, dtype, hidden = shard_encoding(self.metadata)
            if ids is None or len(ids.shape) != 1:
                raise ShardError("no input_ids [T]: its rows are unknown")
        except ShardError as exc:
            raise exc.at(shard=self.path) from None
        self.num_rows = ids.shape[0]
        self._tensors = ShardTensors(
            self.tensor_bytes,
            {name: span.dtype for name, span in self.spans.items()},
            {name: span.shape for name, span in self.spans.items()},
            self.num_rows,
            dtype,
            hidden,
        )
        self._layers: dict[str, LayerDecoder] = {}

    def span(self, key: str) -> TensorSpan:
        """Where a tensor the file holds lies (for an encoded layer, one of its tensors' names)."""
        span = self.spans.get(key)
        if span is None:
            raise ShardError(f"no tensor {key!r}", shard=self.path)
        return span

    def tensor_bytes(self, name: str) -> np.ndarray:
        """A tensor the file holds as its bytes, uint8 [nbytes], a view of the mapping."""
        span = self.span(name)
        return self._bytes[span.start : span.end]

    def layer(self, key: str) -> LayerDecoder | None:
        """Layer `key`'s decoder (its tensors checked on first use), None for a tensor that is no layer
        of the shard's (input_ids, loss_mask, or a name it does not hold)."""
        found = self._layers.get(key)
        if found is None:
            names = self.encoding.tensor_names(key)
            if key in PLAIN or names[0] not in self.spans:
                return None
            try:
                found = self._layers[key] = self.encoding.decoder(key, self._tensors)
            except ShardError as exc:
                raise exc.at(shard=self.path, layer=key) from None
        return found

    def decodes(self, key: str) -> bool:
        """Whether rows of `key` come decoded into memory of their own rather than as views of the file."""
        layer = self.layer(key)
        return layer is not None and not layer.views

    def layout(self, key: str) -> Layout:
        """The tensor `key` as a raw shard would hold it (a layer in the job's dtype, decoded)."""
        layer = self.layer(key)
        if layer is None:
            span = self.span(key)
            return Layout(span.dtype, span.shape)
        return Layout(layer.dtype.code, (layer.num_rows, layer.hidden_size))

    def fp8_rows(self, key: str, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """An fp8 layer's stored codes (uint8 [rows, hidden]) and scales (float32 [rows]), rows start..stop,
        checked as decoding checks them."""
        layer = self.layer(key)
        if layer is None:
            raise ValueError(f"{self.path.name}: no layer {key!r}")
        try:
            return layer.quantized(start, stop)
        except ShardError as exc:
            raise exc.at(shard=self.path, layer=key) from None
        except ValueError as exc:
            raise ValueError(f"{self.path.name}: {exc}") from None

    def rows(self, key: str, start: int, stop: int) -> np.ndarray:
        """Rows start..stop of `key` as uint8 [stop - start, bytes per row]: a view of the mapping, or
        for an encoded layer its rows decoded (ShardError where what they are read from fails a check)."""
        layer = self.layer(key)
        if layer is not None:
            try:
                return layer.rows(start, stop)
            except ShardError as exc:
                raise exc.at(shard=self.path, layer=key) from None
            except ValueError as exc:
                raise ValueError(f"{self.path.name}: {exc}") from None
        span = self.span(key)
        if not span.shape or not 0 <= start <= stop <= span.shape[0]:
            raise ValueError(f"{self.path.name}: {key} has no rows {start}..{stop}")
        width = span.row_bytes
        return self._bytes[span.start + start * width : span.start + stop * width].reshape(stop - start, width)

    @cached_property
    def placement(self) -> Placement:
        try:
            return Placement.of(self.metadata, self.num_rows)
        except ShardError as exc:
            raise exc.at(shard=self.path) from None

    def place(self, sample_id: str, offset: int, num_tokens: int) -> tuple[int, int]:
        """The sample's rows start..stop as this shard places it; ShardError where the shard does not hold
        it at `offset` .. `offset + num_tokens` (what the manifest or the database records)."""
        try:
            return self.placement.rows_of(sample_id, offset, num_tokens)
        except ShardError as exc:
            raise exc.at(shard=self.path) from None


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
