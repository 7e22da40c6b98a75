"""Start the disk writing a file's bytes while the rest is still being written.

Without it the page cache collects a whole shard and the closing fsync waits for all of it while
nothing new is written; the disk idles during the copy and the copy idles during the fsync. Asking
the kernel to begin writeback of each range as soon as it is written keeps the disk busy all along,
and the final fsync only waits for the tail. Linux's sync_file_range(SYNC_FILE_RANGE_WRITE) does
exactly that (it does not wait for the writes and does not replace the fsync that makes the file
durable); where it is missing this is a no-op and the fsync does all the work.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable

SYNC_FILE_RANGE_WRITE = 2


def _load() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range, on Linux where libc has it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load()


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing [offset, offset + nbytes) of `fd` to disk; returns at once.

    Only a hint: a file system that refuses it (EINVAL, ESPIPE) changes nothing, and a real write
    error (EIO, ENOSPC) is reported by the fsync that makes the file durable, so the result is ignored."""
    if _sync_file_range is not None and nbytes > 0:
        _sync_file_range(fd, offset, nbytes, SYNC_FILE_RANGE_WRITE)
