"""The threads that encode lossless and fp8 shards, one pool per process, at a lower CPU priority.

A flusher reads and checks a shard's blocks and hands them to these threads, which encode them while it
reads the next (hsx.storage.shards). Encoding is the one heavy work an encoded job adds, and none of it
is on the request path; at a lower priority (nice +ENCODER_NICE, Linux's per-thread nice) it also takes
no CPU the request loops, the flushers' own reads and hashes or a model server on the same host want:
it runs on what they leave, which a job the model bounds leaves plenty of. Where the encoders fall
behind, the staged samples waiting for them fill staging's bound and the request loops wait, as they do
for a slow disk.
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor

log = logging.getLogger("hsx.writer")

ENCODER_NICE = 5

_pools: list[ThreadPoolExecutor] = []  # at most one
_lock = threading.Lock()


def encoder_pool() -> ThreadPoolExecutor:
    """This process's encoding threads (one per CPU it may use), started on first use."""
    with _lock:
        if not _pools:
            _pools.append(
                ThreadPoolExecutor(
                    max_workers=len(os.sched_getaffinity(0)),
                    thread_name_prefix="hsx-encoder",
                    initializer=_lower_priority,
                )
            )
        return _pools[0]


def _lower_priority() -> None:
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + ENCODER_NICE)
    except (OSError, AttributeError) as exc:  # not Linux, or not allowed: the encoders run at the same priority
        log.debug("encoder threads keep their priority: %s", exc)
