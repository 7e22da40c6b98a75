"""Shard files: many samples concatenated along the token axis in one safetensors file.

Layout (any safetensors reader can open it): `input_ids` int64 [T], `loss_mask` int64 [T] and
`layer_<i>` [T, hidden] per captured layer, where T is the sum of the samples' token counts.
Sample k occupies rows offset_k .. offset_k + num_tokens_k of every tensor; the manifest
(and the shard's own `__metadata__`) lists the offsets. A job that chose the lossless or fp8
encoding stores each layer as hsx.storage.encoding describes instead; its rows are the same.

A raw shard streams: each layer's bytes go from the staged dump to the disk piece by piece. An encoded
shard's sizes are known only once its layers are encoded, and the header that comes first names them,
so its layers are encoded into memory first (at most about what the shard's raw rows would take) and
written after the header.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Executor
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hsx.dtypes import DTYPES
from hsx.storage.atomic import atomic_file
from hsx.storage.encoding import LayerEncoder, LayerStats, block_rows, encoding_of
from hsx.storage.finite import FiniteCheck
from hsx.storage.safetensors_raw import TensorSpan, encode_header
from hsx.storage.sink import PIECE_BYTES, BufferedSink, DirectSink, open_sink

SHARD_FORMAT = "hsx-shard/1"


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
    # Per layer, what encoding it stored (None for a raw shard).
    layer_stats: dict[int, LayerStats] | None = None


class NonFiniteSamples(Exception):
    """Samples whose values hold NaN or Inf: the shard was not written; `reasons` says where, per sample id."""

    def __init__(self, reasons: dict[str, str]):
        super().__init__("; ".join(f"{k}: {v}" for k, v in reasons.items()))
        self.reasons = reasons


def shard_name(number: int) -> str:
    return f"shard-{number:06d}.safetensors"


class _Out:
    """The shard's bytes on their way to the sink, hashed (one sha256 stream) and counted. A layer's
    bytes go in pieces of at most PIECE_BYTES: read from their file straight into the sink's buffer,
    then checked and hashed while the piece is still in the processor's cache, then handed on. The
    flusher's own thread does all of it (several flushers use several cores); only the disk writes
    run on the sink's helper thread, so the disk stays busy meanwhile."""

    def __init__(self, sink: BufferedSink | DirectSink):
        self.sink = sink
        self.sha = hashlib.sha256()
        self.count = 0

    def write(self, data: bytes | memoryview) -> None:
        self.sha.update(data)
        self.sink.write(data)
        self.count += len(data)

    def layer(self, src: TensorSpan | bytes, files: dict[Path, int], check: Callable[[memoryview], bool]) -> bool:
        """Write a layer's bytes unless `check` refuses a piece of them; returns whether written."""
        if not isinstance(src, TensorSpan):
            with memoryview(src) as view:
                for at in range(0, len(view), PIECE_BYTES):
                    with view[at : at + PIECE_BYTES] as piece:
                        if not check(piece):
                            return False
                        self.write(piece)
            return True
        with closing(_read(src, files, self.sink.room)) as pieces:
            for piece in pieces:
                if not check(piece):
                    return False
                self.sha.update(piece)
                self.sink.advance(len(piece))
                self.count += len(piece)
        return True


Room = Callable[[int], memoryview]  # a buffer for up to that many bytes (it may be shorter)


def _read(src: TensorSpan, files: dict[Path, int], room: Room) -> Generator[memoryview, None, None]:
    """A span's bytes, read piece by piece into what `room(bytes still to read)` gives."""
    fd = files.get(src.path)
    if fd is None:
        fd = files[src.path] = os.open(src.path, os.O_RDONLY)
    at = src.start
    while at < src.end:
        piece = room(src.end - at)
        if os.preadv(fd, [piece], at) < len(piece):  # a file reads short only where it ends
            raise OSError(f"{src.path}: ended before its tensor did")
        yield piece
        at += len(piece)


def _blocks(src: TensorSpan | bytes, files: dict[Path, int], scratch: memoryview) -> Generator[memoryview, None, None]:
    """A layer's bytes a block at a time, each as long as `scratch` (a whole number of rows) or the rest."""
    if not isinstance(src, TensorSpan):
        with memoryview(src) as view:
            for at in range(0, len(view), len(scratch)):
                yield view[at : at + len(scratch)]
        return
    with closing(_read(src, files, lambda n: scratch[: min(n, len(scratch))])) as pieces:
        yield from pieces


def _check_only(src: TensorSpan | bytes, files: dict[Path, int], check: Callable[[memoryview], bool]) -> bool:
    """Whether every value of a layer is finite, reading without writing (the shard is not written)."""
    if not isinstance(src, TensorSpan):
        with memoryview(src) as view:
            return check(view)
    scratch = memoryview(bytearray(PIECE_BYTES))
    with closing(_read(src, files, lambda n: scratch[: min(n, PIECE_BYTES)])) as pieces:
        return all(check(piece) for piece in pieces)


def _offsets(samples: list[ShardSample], layers: list[int], row_bytes: int) -> tuple[list[int], int]:
    """Each sample's first row in the shard, and the rows of all of them."""
    offsets, total = [], 0
    for s in samples:
        _check_fits(s, layers, row_bytes)
        offsets.append(total)
        total += s.num_tokens
    return offsets, total


def _check_fits(s: ShardSample, layers: list[int], row_bytes: int) -> None:
    """ValueError unless the sample's mask and layers have its rows: a source that does not fit them
    would give a shard whose header lies about its data."""
    if s.loss_mask.shape != s.input_ids.shape:
        raise ValueError(f"{s.sample_id}: loss_mask has {s.loss_mask.shape[0]} values for {s.num_tokens} tokens")
    for layer in layers:
        src = s.layers[layer]
        size = src.nbytes if isinstance(src, TensorSpan) else len(src)
        if size != s.num_tokens * row_bytes:
            raise ValueError(f"{s.sample_id}: layer_{layer} has {size} bytes, expected {s.num_tokens * row_bytes}")


def _write_layers(
    out: _Out, samples: list[ShardSample], layers: list[int], files: dict[Path, int], finite: FiniteCheck
) -> dict[str, str]:
    """Copy every layer of every sample, in the shard's order, checking each value; returns why, per
    sample id, samples were refused. After the first refusal nothing more is written: the other
    samples are only checked, so that the caller learns every bad one at once."""
    bad: dict[str, str] = {}
    for layer in layers:
        for s in samples:
            if s.sample_id in bad:
                continue
            if not (_check_only if bad else out.layer)(s.layers[layer], files, finite):
                bad[s.sample_id] = f"layer_{layer} holds NaN or Inf"
    return bad


class _Inline:
    """What `Executor.submit` gives, for work done at once in this thread."""

    def __init__(self, fn: Callable[[np.ndarray], object], arg: np.ndarray):
        self.value = fn(arg)

    def result(self) -> object:
        return self.value


# Blocks handed to the encoding threads and not yet taken back: bounds the copies waiting (4 MiB).
PENDING_BLOCKS = 16


class _Encoding:
    """Blocks on their way through a pool's threads (or encoded at once without one), each sample's
    kept by its layer's encoder in the shard's order, once the whole sample passed its checks."""

    def __init__(self, pool: Executor | None):
        self.pool = pool
        self.waiting: deque[tuple[LayerEncoder, list[Any]]] = deque()
        self.pending = 0

    def encode(self, enc: LayerEncoder, rows: np.ndarray) -> Any:
        if self.pool is None:
            return _Inline(enc.encode, rows)
        self.pending += 1
        return self.pool.submit(enc.encode, rows.copy())  # the rows' buffer is read into again

    def keep(self, enc: LayerEncoder, blocks: list[Any]) -> None:
        self.waiting.append((enc, blocks))
        while self.waiting and (self.pool is None or self.pending > PENDING_BLOCKS):
            self._take_oldest()

    def finish(self) -> None:
        while self.waiting:
            self._take_oldest()

    def _take_oldest(self) -> None:
        enc, blocks = self.waiting.popleft()
        enc.keep([b.result() for b in blocks])
        self.pending -= len(blocks) if self.pool is not None else 0


def _encode_layers(
    samples: list[ShardSample],
    layers: list[int],
    dtype: str,
    hidden_size: int,
    *,
    encoding: str,
    files: dict[Path, int],
    pool: Executor | None,
) -> tuple[list[LayerEncoder], dict[str, str]]:
    """Every layer of every sample encoded, block by block, each block checked for NaN and Inf first
    (here, as it is read); also why, per sample id, samples were refused (once one is, the others are
    only checked). With a `pool`, its threads encode while the next blocks are read and checked here."""
    row_bytes = hidden_size * DTYPES[dtype].itemsize
    scratch = memoryview(bytearray(block_rows(row_bytes) * row_bytes))
    finite = FiniteCheck(dtype)
    encoders = [encoding_of(encoding).encoder(f"layer_{i}", DTYPES[dtype], hidden_size) for i in layers]
    work = _Encoding(pool)
    bad: dict[str, str] = {}
    for layer, enc in zip(layers, encoders):
        for s in samples:
            if s.sample_id in bad:
                continue
            blocks = []
            with closing(_blocks(s.layers[layer], files, scratch)) as pieces:
                for piece in pieces:
                    if not finite(piece):
                        bad[s.sample_id] = f"layer_{layer} holds NaN or Inf"
                        break
                    if not bad:
                        blocks.append(work.encode(enc, np.frombuffer(piece, dtype=np.uint8).reshape(-1, row_bytes)))
            if not bad:
                work.keep(enc, blocks)
    if not bad:
        work.finish()
    return encoders, bad


def write_shard(
    path: Path,
    samples: list[ShardSample],
    layers: list[int],
    dtype: str,
    hidden_size: int,
    encoding: str = "raw",
    *,
    encoders: Executor | None = None,
) -> ShardInfo:
    """Write `samples` as one shard at `path`, atomically, its layers stored in `encoding`
    (hsx.storage.encoding), encoded on the threads of `encoders` if given (else in this thread);
    return what the manifest records.

    Every value is checked as it is copied: when any sample holds NaN or Inf, no shard is left
    and NonFiniteSamples names each such sample (the rest are only checked, not written, once
    the first is found), so the caller can write the others again without them."""
    if not samples:
        raise ValueError("a shard needs at least one sample")
    if len(set(layers)) != len(layers):
        raise ValueError(f"layers {layers} name a layer twice: a shard holds one layer_<i> tensor per layer")
    if encoding_of(encoding).encoded:
        return _write_encoded(path, samples, layers, dtype, hidden_size, encoding=encoding, pool=encoders)
    code = DTYPES[dtype].code
    offsets, total = _offsets(samples, layers, hidden_size * DTYPES[dtype].itemsize)
    entries: list[tuple[str, str, tuple[int, ...]]] = [("input_ids", "I64", (total,)), ("loss_mask", "I64", (total,))]
    entries += [(f"layer_{i}", code, (total, hidden_size)) for i in layers]
    metadata = {
        "format": SHARD_FORMAT,
        "sample_ids": json.dumps([s.sample_id for s in samples]),
        "offsets": json.dumps(offsets),
    }
    files: dict[Path, int] = {}
    try:
        with atomic_file(path) as f, closing(open_sink(f)) as sink:
            out = _Out(sink)
            out.write(encode_header(entries, metadata))
            out.write(np.concatenate([s.input_ids for s in samples]).astype("<i8").tobytes())
            out.write(np.concatenate([s.loss_mask for s in samples]).astype("<i8").tobytes())
            bad = _write_layers(out, samples, layers, files, FiniteCheck(dtype))
            if bad:
                raise NonFiniteSamples(bad)
            sink.finish()
            size, digest = out.count, out.sha.hexdigest()
    finally:
        for fd in files.values():
            os.close(fd)
    return ShardInfo(path.name, size, digest, len(samples), total, offsets)


def _write_encoded(
    path: Path,
    samples: list[ShardSample],
    layers: list[int],
    dtype: str,
    hidden_size: int,
    *,
    encoding: str,
    pool: Executor | None,
) -> ShardInfo:
    offsets, total = _offsets(samples, layers, hidden_size * DTYPES[dtype].itemsize)
    files: dict[Path, int] = {}
    try:
        encoders, bad = _encode_layers(samples, layers, dtype, hidden_size, encoding=encoding, files=files, pool=pool)
    finally:
        for fd in files.values():
            os.close(fd)
    if bad:
        raise NonFiniteSamples(bad)
    tensors = [t for enc in encoders for t in enc.tensors()]
    entries: list[tuple[str, str, tuple[int, ...]]] = [("input_ids", "I64", (total,)), ("loss_mask", "I64", (total,))]
    entries += [(name, code, shape) for name, code, shape, _ in tensors]
    metadata = {
        "format": SHARD_FORMAT,
        "sample_ids": json.dumps([s.sample_id for s in samples]),
        "offsets": json.dumps(offsets),
        **encoding_of(encoding).metadata(DTYPES[dtype], hidden_size),
    }
    with atomic_file(path) as f, closing(open_sink(f)) as sink:
        out = _Out(sink)
        out.write(encode_header(entries, metadata))
        out.write(np.concatenate([s.input_ids for s in samples]).astype("<i8").tobytes())
        out.write(np.concatenate([s.loss_mask for s in samples]).astype("<i8").tobytes())
        for _, _, _, pieces in tensors:
            for piece in pieces:
                out.write(piece)
        sink.finish()
        size, digest = out.count, out.sha.hexdigest()
    stats = {layer: enc.stats for layer, enc in zip(layers, encoders)}
    return ShardInfo(path.name, size, digest, len(samples), total, offsets, stats)
