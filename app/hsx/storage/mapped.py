"""A shard's rows as views of the file mapped into memory: no copy until a caller makes one.

An export reads every row of a job once and writes it out once. Through this mapping a row is
copied only where its output needs it somewhere else (layers side by side); a tensor written as it
lies in the shard goes from the page cache straight to the output file. The mapping is private
(copy-on-write), so a view is writable for the libraries that want one, and nothing reaches the file.
"""

from __future__ import annotations

import mmap
import os
from collections import OrderedDict
from pathlib import Path

import numpy as np

from hsx.storage.safetensors_raw import SafetensorsFormatError, TensorSpan, read_index


class MappedShard:
    """One shard file, mapped; `rows` gives a tensor's rows as a view of the mapping."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            self.spans: dict[str, TensorSpan] = read_index(self.path)
        except (OSError, SafetensorsFormatError) as exc:
            raise ValueError(f"{self.path}: unreadable shard ({exc}); run hsx verify") from exc
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            # a file of nothing but a header holds no rows; mmap refuses a length of 0
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else b""
        self._bytes = np.frombuffer(data, dtype=np.uint8)

    def span(self, key: str) -> TensorSpan:
        span = self.spans.get(key)
        if span is None:
            raise ValueError(f"{self.path.name}: no tensor {key!r}")
        return span

    def rows(self, key: str, start: int, stop: int) -> np.ndarray:
        """Rows start..stop of `key` as uint8 [stop - start, bytes per row], a view of the mapping."""
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
