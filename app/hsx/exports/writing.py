"""Who writes an export's files: this process, or a pool of worker processes, a chunk at a time.

The files still to write are cut into chunks: consecutive files whose samples lie in one shard, up to
CHUNK_BYTES of rows or CHUNK_FILES files. A chunk is one `FileBatch`: each file's data is fsynced
before its rename, and each folder once per chunk. With several workers the chunks go to forked
processes (forked, so that they start with the exporter and torch already loaded: a worker costs no
imports), one chunk at a time each. A file depends on its sample alone, so the files are byte for byte
the same whatever the number of workers. Progress counts the files complete under their names, in
this process, as each chunk ends.

Torch runs one thread per process here: the copies are numpy's, the rest is elementwise work on one
sample at a time, and idle pool threads spin for CPU time on a busy machine.
"""

from __future__ import annotations

import gc
import multiprocessing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from hsx.dtypes import DTYPES
from hsx.exports.rows import SampleRows
from hsx.storage.atomic import FileBatch
from hsx.storage.errors import ShardError
from hsx.storage.mapped import MappedShards

if TYPE_CHECKING:
    from hsx.exports.base import Exporter, PlannedFile

CHUNK_BYTES = 64 * 1024 * 1024
CHUNK_FILES = 256

Chunk = list["PlannedFile"]


def plan_chunks(exporter: Exporter, todo: list[PlannedFile]) -> list[Chunk]:
    """`todo` cut into chunks of one shard's samples, in order."""
    job = exporter.job
    row_bytes = 16 + len(job.layers) * job.hidden_size * DTYPES[str(job.manifest.dtype)].itemsize
    chunks: list[Chunk] = []
    current: Chunk = []
    size, shard = 0, ""
    for p in todo:
        entry = job.samples[p.index]
        nbytes = entry.num_tokens * row_bytes
        if current and (entry.shard != shard or size + nbytes > CHUNK_BYTES or len(current) >= CHUNK_FILES):
            chunks.append(current)
            current, size = [], 0
        current.append(p)
        size += nbytes
        shard = entry.shard
    if current:
        chunks.append(current)
    return chunks


def write_chunk(exporter: Exporter, out_dir: Path, chunk: Chunk, shards: MappedShards) -> int:
    """Write a chunk's files, all or none; returns how many."""
    batch = FileBatch()
    try:
        for p in chunk:
            entry = exporter.job.samples[p.index]
            try:
                rows = SampleRows(shards.get(entry.shard), entry)
                with batch.file(out_dir / p.rel_path) as f:
                    exporter.encode(f, rows, entry, p)
            except ShardError as exc:
                raise exc.at(shard=shards.job_dir / entry.shard, sample=entry.id) from None
    except BaseException:
        batch.discard()
        raise
    return batch.commit()


@contextmanager
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class _Worker:
    """A worker process's exporter, output folder and mapped shards, set once as it starts."""

    state: tuple[Exporter, Path, MappedShards] | None = None


def _start_worker(exporter: Exporter, out_dir: Path) -> None:
    torch.set_num_threads(1)
    _Worker.state = (exporter, out_dir, MappedShards(exporter.job.job_dir))


def _worker_chunk(chunk: Chunk) -> int:
    assert _Worker.state is not None, "not a worker process"
    exporter, out_dir, shards = _Worker.state
    return write_chunk(exporter, out_dir, chunk, shards)


def write_files(
    exporter: Exporter, out_dir: Path, todo: list[PlannedFile], workers: int, done: Callable[[int], None]
) -> int:
    """Write the files of `todo` with up to `workers` processes; `done(files written so far)` after each
    chunk. Returns how many were written. The first error stops the export (the other workers are
    stopped) and is raised here; the chunks finished before it stay written."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    chunks = plan_chunks(exporter, todo)
    written = 0
    if min(workers, len(chunks)) <= 1:
        shards = MappedShards(exporter.job.job_dir)
        with one_torch_thread():
            for chunk in chunks:
                written += write_chunk(exporter, out_dir, chunk, shards)
                done(written)
        return written
    # fork: a worker starts with what this process has loaded (the exporter, torch); `initargs` are
    # handed over in memory, not pickled
    context = multiprocessing.get_context("fork")
    gc.freeze()
    with context.Pool(min(workers, len(chunks)), initializer=_start_worker, initargs=(exporter, out_dir)) as pool:
        for n in pool.imap_unordered(_worker_chunk, chunks):
            written += n
            done(written)
        pool.close()
        pool.join()
    gc.unfreeze()
    return written
