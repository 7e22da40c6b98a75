"""Where a shard's bytes go: straight to the disk where the file system allows it, else through
the page cache with writeback started as the file grows.

Direct I/O (O_DIRECT) leaves the page cache out: the kernel neither copies the bytes nor tracks
dirty pages, and a shard of terabytes' worth of jobs does not push everything else out of memory.
On the 2-core development VM, 235 MB written and fsynced took 0.03-0.06 CPU seconds and ran at
1.4-1.9 GB/s direct, against 0.16-0.32 CPU seconds and 0.6-1.0 GB/s through the page cache. Direct
writes need aligned buffers, offsets and lengths, so bytes gather in page-aligned buffers; a full
buffer goes to the disk on a helper thread while the next one fills, and the tail is written padded
to a whole block, then the file is cut to its true length. The buffers of a shard that ended serve
the next one.

A file system that refuses O_DIRECT (at open, or at a first aligned write) gets the buffered sink.
Either way the caller's fsync makes the file durable and reports any write error the sink did not.

Bytes already in memory are given to write(); bytes read from a file are read straight into the
sink's own buffer (room(), then advance() once they are checked), so they are copied once, by the
kernel's read, and checked and hashed there while they are still in the processor's cache.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import BinaryIO

from hsx.storage.writeback import start_writeback

BLOCK = 4096  # alignment that satisfies any device's logical block size
REFUSED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)  # how a file system says no to direct I/O
BUFFER_BYTES = 8 * 1024 * 1024
WRITEBACK_EVERY = 32 * 1024 * 1024
PIECE_BYTES = 1024 * 1024  # the most room() gives at once: read, checked and hashed while in cache


class BufferedSink:
    """Writes through the page cache; every WRITEBACK_EVERY bytes, writeback of what was written
    since starts in the background (see hsx.storage.writeback), so the closing fsync waits for
    little."""

    def __init__(self, f: BinaryIO):
        self.f = f
        self.count = 0
        self.flushed = 0
        self.scratch = memoryview(bytearray(PIECE_BYTES))

    def room(self, n: int) -> memoryview:
        """A buffer for up to `n` bytes that advance() then writes (it may be shorter than `n`)."""
        return self.scratch[: min(n, PIECE_BYTES)]

    def advance(self, n: int) -> None:
        self.write(self.scratch[:n])

    def write(self, data: bytes | memoryview) -> None:
        self.f.write(data)
        self.count += len(data)
        if self.count - self.flushed >= WRITEBACK_EVERY:
            self.f.flush()
            start_writeback(self.f.fileno(), self.flushed, self.count - self.flushed)
            self.flushed = self.count

    def finish(self) -> None:
        self.f.flush()

    def close(self) -> None:
        pass


class _BufferPool:
    """O_DIRECT buffers kept from one shard to the next. A fresh anonymous map costs its page faults
    and the kernel's zeroing when it is first written (about 5 ms for 8 MiB on the development VM,
    4-7% of the CPU a shard of one or two large samples costs), so each flusher's next shard reuses
    the buffers of one that ended."""

    def __init__(self, keep: int):
        self.keep = keep
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self) -> mmap.mmap:
        with self._lock:
            if self._free:
                return self._free.pop()
        return mmap.mmap(-1, BUFFER_BYTES)  # anonymous maps are page-aligned

    def give(self, buffer: mmap.mmap) -> None:
        with self._lock:
            if len(self._free) < self.keep:
                self._free.append(buffer)
                return
        buffer.close()


# Two buffers per sink; as many sinks as flushers at once (at most 8 by default): up to 128 MiB kept.
_POOL = _BufferPool(keep=16)


def _pwrite_all(fd: int, buffer: mmap.mmap, length: int, offset: int) -> None:
    with memoryview(buffer) as whole:
        done = 0
        while done < length:
            with whole[done:length] as rest:
                done += os.pwrite(fd, rest, offset + done)


class DirectSink:
    """Writes through an O_DIRECT descriptor of the same file, two buffers in turn."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buffers = [_POOL.take() for _ in range(2)]
        self.finished = False  # finish() wrote everything: the buffers are free for the next shard
        self.views = [memoryview(b) for b in self.buffers]
        self.writes: list[Future[None] | None] = [None, None]
        self.io = ThreadPoolExecutor(1, thread_name_prefix="hsx-direct-io")
        self.current = 0
        self.used = 0
        self.offset = 0  # file offset of the current buffer's first byte

    def probe(self) -> None:
        """Write one aligned block at the start of the (new, empty) file: a file system that takes
        O_DIRECT at open but wants another alignment says so here (EINVAL), not halfway through a
        shard. The block is overwritten by the shard's first bytes."""
        with memoryview(self.buffers[0]) as view, view[:BLOCK] as block:
            os.pwrite(self.fd, block, 0)

    def room(self, n: int) -> memoryview:
        """Where the next up to `n` bytes go: the rest of the current buffer (at most PIECE_BYTES of
        it), for advance() to take once they are there."""
        end = self.used + min(n, PIECE_BYTES, BUFFER_BYTES - self.used)
        return self.views[self.current][self.used : end]

    def advance(self, n: int) -> None:
        self.used += n
        if self.used == BUFFER_BYTES:
            self._submit(BUFFER_BYTES)

    def write(self, data: bytes | memoryview) -> None:
        with memoryview(data) as view, view.cast("B") as src:
            taken = 0
            while taken < len(src):
                room = self.room(len(src) - taken)
                room[:] = src[taken : taken + len(room)]
                taken += len(room)
                self.advance(len(room))

    def _submit(self, length: int) -> None:
        self.writes[self.current] = self.io.submit(
            _pwrite_all, self.fd, self.buffers[self.current], length, self.offset
        )
        self.offset += length
        self.current, self.used = 1 - self.current, 0
        self._wait(self.current)  # the next buffer to fill must be on disk already

    def _wait(self, index: int) -> None:
        pending, self.writes[index] = self.writes[index], None
        if pending is not None:
            pending.result()

    def finish(self) -> None:
        """Write the tail (padded to a whole block), wait for every write, cut the padding off."""
        size = self.offset + self.used
        if self.used:
            padded = -(-self.used // BLOCK) * BLOCK
            self.buffers[self.current][self.used : padded] = bytes(padded - self.used)
            self._submit(padded)
        self._wait(0)
        self._wait(1)
        os.ftruncate(self.fd, size)
        self.finished = True

    def close(self) -> None:
        for index in (0, 1):
            # An error here already reached the caller through write() or finish().
            with contextlib.suppress(OSError):
                self._wait(index)
        self.io.shutdown()
        os.close(self.fd)
        for view in self.views:
            view.release()
        for buffer in self.buffers:
            if self.finished:
                _POOL.give(buffer)
                continue
            # After a failure a piece of the buffer may still be held (by the exception's traceback):
            # not reused, freed along with that.
            with contextlib.suppress(BufferError):
                buffer.close()


def open_sink(f: BinaryIO) -> BufferedSink | DirectSink:
    """A direct sink for the file `f` was opened on when its file system takes O_DIRECT, else a
    buffered one writing to `f`. `f` must be new and empty; it stays open for the caller's fsync."""
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            sink = DirectSink(os.open(f.name, os.O_WRONLY | direct))
        except OSError as exc:
            if exc.errno not in REFUSED:
                raise
        else:
            try:
                sink.probe()
            except BaseException as exc:
                sink.close()
                if not (isinstance(exc, OSError) and exc.errno in REFUSED):
                    raise
            else:
                return sink
    return BufferedSink(f)
