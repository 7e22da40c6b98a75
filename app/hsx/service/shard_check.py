"""A shard is served as what its record says it is, or not at all.

Its download's ETag is the sha256 the database records, which clients take for the bytes they get (the
SDK resumes with it in If-Range). So before a file is served its size is compared with the record (a
stat), and its sha256 computed and compared once per version of the file: the digest is remembered by
the file's device, inode, size and change times, which any write changes, so later answers, HEAD
included, cost nothing until the file changes. A file that differs is ShardDamaged, never served.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from pathlib import Path

from hsx.db.models import ShardRow
from hsx.service.errors import ShardDamaged
from hsx.storage.errors import ShardError

HASH_CHUNK = 8 * 1024 * 1024
# Digests remembered (a few hundred bytes each): far more shards than one service serves at a time.
REMEMBERED = 4096

_digests: OrderedDict[tuple[int, ...], str] = OrderedDict()
_lock = threading.Lock()


def _version(stat: os.stat_result) -> tuple[int, ...]:
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def digest(path: Path, stat: os.stat_result) -> str:
    """The file's sha256, computed once per version of it (as `stat` describes it)."""
    version = _version(stat)
    with _lock:
        known = _digests.get(version)
        if known is not None:
            _digests.move_to_end(version)
            return known
    computed = _sha256(path)  # outside the lock: other files' answers do not wait for this one
    with _lock:
        _digests[version] = computed
        while len(_digests) > REMEMBERED:
            _digests.popitem(last=False)
    return computed


def check_served(job_id: str, shard: ShardRow, path: Path, stat: os.stat_result) -> None:
    """ShardDamaged unless the file is the one the record describes: its size, then its sha256."""
    if stat.st_size != shard.bytes:
        problem = f"the file holds {stat.st_size} bytes, its record {shard.bytes}: it changed since it was written"
        raise ShardDamaged(job_id, shard.name, ShardError(problem))
    found = digest(path, stat)
    if found != shard.sha256:
        problem = f"the file's sha256 is {found}, its record's {shard.sha256}: it changed since it was written"
        raise ShardDamaged(job_id, shard.name, ShardError(problem))
