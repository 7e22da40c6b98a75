"""A full output disk pauses extraction: no sample is claimed while a shard or a manifest waits for
room, and what is staged is written again once there is some. An output root that is not the
database's (a network file system gone from under its mount point) pauses it the same way."""

from __future__ import annotations

import errno
from dataclasses import dataclass

from hsx.storage.output_root import OutputRootMismatch

# How soon a write that found the disk full is tried again, and how long the request loop waits meanwhile.
DISK_RETRY_S = 2.0


def disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def output_blocked(exc: BaseException) -> str | None:
    """What keeps shards and manifests from the output root when it is something to wait out: a
    full disk, or a root that is not the database's; None for any other failure."""
    if disk_full(exc):
        return "output disk full"
    if isinstance(exc, OutputRootMismatch):
        return "output root unavailable"
    return None


@dataclass
class DiskPause:
    """Why extraction waits for the output disk (room, or the root itself); None while it does not.
    The flusher sets and clears it, finishing a job sets it, the request loop obeys it."""

    reason: str | None = None
