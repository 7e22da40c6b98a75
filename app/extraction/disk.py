"""A full output disk pauses extraction: no sample is claimed while a shard or a manifest waits for
room, and what is staged is written again once there is some."""

from __future__ import annotations

import errno
from dataclasses import dataclass

# How soon a write that found the disk full is tried again, and how long the request loop waits meanwhile.
DISK_RETRY_S = 2.0


def disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


@dataclass
class DiskPause:
    """Why extraction waits for room on the output disk; None while it does not. The flusher sets and
    clears it, finishing a job sets it, the request loop obeys it."""

    reason: str | None = None
