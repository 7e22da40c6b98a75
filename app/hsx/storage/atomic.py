"""Files appear whole or not at all: temp name in the same folder, fsync, rename, fsync folder."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO


def fsync_path(path: Path) -> None:
    """fsync a file or a folder, by its path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: Path) -> Iterator[BinaryIO]:
    """Yield a file to write; on success it replaces `path` whole, on error it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Unique per process and thread: two threads of one service (a writer's flusher and the API's
    # cancel task) may write the same job's manifest at once; each renames a whole file of its own.
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


def write_json_atomic(path: Path, obj: object) -> None:
    with atomic_file(path) as f:
        f.write(json.dumps(obj, indent=1).encode())
        f.write(b"\n")
