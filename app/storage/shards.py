"""Shard files: many samples concatenated along the token axis in one safetensors file.

Layout (any safetensors reader can open it): `input_ids` int64 [T], `loss_mask` int64 [T] and
`layer_<i>` [T, hidden] per captured layer, where T is the sum of the samples' token counts.
Sample k occupies rows offset_k .. offset_k + num_tokens_k of every tensor; the manifest
(and the shard's own `__metadata__`) lists the offsets.
"""

from __future__ import annotations

import hashlib
import json
import mmap
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
from hsx.dtypes import DTYPES
from hsx.storage.atomic import atomic_file
from hsx.storage.finite import FiniteCheck
from hsx.storage.safetensors_raw import TensorSpan, encode_header
from hsx.storage.sink import BufferedSink, DirectSink, open_sink

SHARD_FORMAT = "hsx-shard/1"
COPY_CHUNK = 8 * 1024 * 1024


@dataclass
class ShardSample:
    """One validated sample on its way into a shard: ids, mask and each layer's raw bytes."""

    sample_id: str
    input_ids: np.ndarray  # int64 [T]
    loss_mask: np.ndarray  # int64 [T]
    layers: dict[int, TensorSpan | bytes] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class ShardInfo:
    name: str
    bytes: int
    sha256: str
    num_samples: int
    num_tokens: int
    offsets: list[int]


class NonFiniteSamples(Exception):
    """Samples whose values hold NaN or Inf: the shard was not written; `reasons` says where, per sample id."""

    def __init__(self, reasons: dict[str, str]):
        super().__init__("; ".join(f"{k}: {v}" for k, v in reasons.items()))
        self.reasons = reasons


def shard_name(number: int) -> str:
    return f"shard-{number:06d}.safetensors"


class _HashingSink:
    """A sink in front of a sink: passes each chunk on and hashes it. The hash of a chunk runs on a
    helper thread while this thread checks and writes the same chunk (all of them release the GIL),
    so a shard costs about the longest of the three, not their sum."""

    def __init__(self, sink: BufferedSink | DirectSink, hasher: ThreadPoolExecutor):
        self.sink = sink
        self.sha = hashlib.sha256()
        self.hasher = hasher
        self.count = 0

    def write(self, data: bytes | memoryview, check: Callable[[bytes | memoryview], bool] | None = None) -> bool:
        """Write `data` unless `check` (run while the chunk is hashed) refuses it; returns whether written."""
        hashed = self.hasher.submit(self.sha.update, data)
        try:
            if check is not None and not check(data):
                return False
            self.sink.write(data)
        finally:
            hashed.result()  # in order, and `data` stays valid until both are done with it
        self.count += len(data)
        return True


def _chunks(src: TensorSpan | bytes, maps: dict[Path, mmap.mmap]):
    """A layer's bytes in COPY_CHUNK pieces; a span is read through a mapping of its file, so the
    bytes are checked, hashed and written without a copy of our own."""
    if not isinstance(src, TensorSpan):
        with memoryview(src) as view:
            for start in range(0, len(view), COPY_CHUNK):
                with view[start : start + COPY_CHUNK] as chunk:
                    yield chunk
        return
    mm = maps.get(src.path)
    if mm is None:
        with open(src.path, "rb") as f:
            mm = maps[src.path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if src.end > len(mm):
        raise OSError(f"{src.path}: ended before its tensor did")
    with memoryview(mm) as view:
        for start in range(src.start, src.end, COPY_CHUNK):
            with view[start : min(start + COPY_CHUNK, src.end)] as chunk:
                yield chunk


def write_shard(path: Path, samples: list[ShardSample], layers: list[int], dtype: str, hidden_size: int) -> ShardInfo:
    """Write `samples` as one shard at `path`, atomically; return what the manifest records.

    Every value is checked as it is copied: when any sample holds NaN or Inf, no shard is left
    and NonFiniteSamples names each such sample (the rest are only checked, not written, once
    the first is found), so the caller can write the others again without them."""
    if not samples:
        raise ValueError("a shard needs at least one sample")
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers {layers} name a layer twice: a shard holds one layer_<i> tensor per layer")
    code = DTYPES[dtype].code
    row_bytes = hidden_size * DTYPES[dtype].itemsize
    offsets, total = [], 0
    for s in samples:
        # A source that does not fit its rows would give a shard whose header lies about its data.
        if s.loss_mask.shape != s.input_ids.shape:
            raise ValueError(f"{s.sample_id}: loss_mask has {s.loss_mask.shape[0]} values for {s.num_tokens} tokens")
        for layer in layers:
            src = s.layers[layer]
            size = src.nbytes if isinstance(src, TensorSpan) else len(src)
            if size != s.num_tokens * row_bytes:
                raise ValueError(f"{s.sample_id}: layer_{layer} has {size} bytes, expected {s.num_tokens * row_bytes}")
        offsets.append(total)
        total += s.num_tokens
    entries: list[tuple[str, str, tuple[int, ...]]] = [("input_ids", "I64", (total,)), ("loss_mask", "I64", (total,))]
    entries += [(f"layer_{i}", code, (total, hidden_size)) for i in layers]
    metadata = {
        "format": SHARD_FORMAT,
        "sample_ids": json.dumps([s.sample_id for s in samples]),
        "offsets": json.dumps(offsets),
    }
    maps: dict[Path, mmap.mmap] = {}
    try:
        with (
            atomic_file(path) as f,
            ThreadPoolExecutor(1, thread_name_prefix="hsx-sha256") as hasher,
            closing(open_sink(f)) as sink,
        ):
            out = _HashingSink(sink, hasher)
            out.write(encode_header(entries, metadata))
            out.write(np.concatenate([s.input_ids for s in samples]).astype("<i8").tobytes())
            out.write(np.concatenate([s.loss_mask for s in samples]).astype("<i8").tobytes())
            finite = FiniteCheck(dtype)
            bad: dict[str, str] = {}
            for layer in layers:
                for s in samples:
                    if s.sample_id in bad:
                        continue
                    # closing(): a chunk stops being a view of the mapping before the mapping is closed
                    with closing(_chunks(s.layers[layer], maps)) as chunks:
                        for chunk in chunks:
                            if not (finite(chunk) if bad else out.write(chunk, check=finite)):
                                bad[s.sample_id] = f"layer_{layer} holds NaN or Inf"
                                break
            if bad:
                raise NonFiniteSamples(bad)
            sink.finish()
            size, digest = out.count, out.sha.hexdigest()
    finally:
        for m in maps.values():
            m.close()
    return ShardInfo(path.name, size, digest, len(samples), total, offsets)
