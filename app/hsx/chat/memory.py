"""The template process's memory bound (hsx.chat.process), and how its caller learns that the bound ended
a render.

A template can expand its output without end, and a tokenizer given a long text holds its ids and offsets
many times over: either could take the host's memory. The child bounds itself as it starts with
RLIMIT_DATA, which counts its private writable memory (its heap, anonymous mappings and thread stacks:
what it and its libraries allocate, whenever they did), and not RLIMIT_AS, its address space, which also
counts the hundreds of megabytes that torch and the tokenizers' libraries map or reserve without using.
The bound is set once those libraries are imported (a shared object that cannot be mapped under it would
look like one not installed), and a child that already holds more says so instead of starting. An
allocation past the bound fails at once, before the memory is taken. In Python it raises MemoryError,
which the child reports in its answer. In Rust (the tokenizers library) the allocator writes
`memory allocation of N bytes failed` to stderr and aborts the process: the caller passes the child's
stderr on as it comes and watches it for that line, which says why the child is gone.
"""

from __future__ import annotations

import contextlib
import os
import resource
import threading
from pathlib import Path
from typing import IO

MiB = 1024 * 1024
# What Rust's allocation-error handler writes before it aborts the process.
ALLOCATION_FAILED = b"memory allocation of "
LINE_BYTES = 4096  # of a line of the child's stderr, kept to look for the line above
JOIN_S = 2.0  # the longest the tail waits for the last of a dead child's stderr


def bound_data(max_mb: int) -> None:
    """Bound this process's private writable memory to `max_mb` MiB (or a lower hard limit already set).
    Raises MemoryError when it holds more already: a bound it could not start under."""
    held = data_mib()
    if held is not None and held > max_mb:
        raise MemoryError(f"the process holds {held:.0f} MiB once its libraries are imported")
    want = max_mb * MiB
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        want = min(want, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (want, want))


def data_mib() -> float | None:
    """What RLIMIT_DATA counts of this process now (VmData), in MiB; None where /proc does not say."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmData:"):
            return int(line.split()[1]) / 1024
    return None


class StderrTail:
    """A child's stderr, passed on to this process's stderr as it comes (on a thread of its own, so that a
    child that writes much never blocks on a full pipe), watched for the line in which its allocator says
    an allocation failed (a backtrace may follow it, however long)."""

    def __init__(self, stream: IO[bytes]):
        self._stream = stream
        self._partial = b""  # the line being written
        self._failed: bytes | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, name="template-process-stderr", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        fd = self._stream.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            _write_all(2, chunk)
            self._watch(chunk)
        self._watch(b"\n")
        self._stream.close()

    def _watch(self, chunk: bytes) -> None:
        *lines, partial = (self._partial + chunk).split(b"\n")
        self._partial = partial[-LINE_BYTES:]
        for line in lines:
            if ALLOCATION_FAILED in line:
                with self._lock:
                    self._failed = line[line.find(ALLOCATION_FAILED) :][:LINE_BYTES]

    def allocation_failed(self) -> str | None:
        """The line in which the (dead) child's allocator said an allocation failed; None when it said none.
        Waits up to JOIN_S for the rest of its stderr."""
        self._thread.join(JOIN_S)
        with self._lock:
            failed = self._failed
        return None if failed is None else failed.decode(errors="replace").strip()


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):  # a caller without a stderr loses the child's lines, nothing else
        while data:
            data = data[os.write(fd, data) :]
