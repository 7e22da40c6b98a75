"""Files appear whole or not at all: temp name in the same folder, fsync, rename, fsync folder.

`atomic_file` does it for one file. `FileBatch` does it for many files written one after the other
(an export's files): each file's data is fsynced before its rename, as one file's would be, but each
folder is fsynced once for the whole batch instead of once per file.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

# The temporary names used here: `.<name>.tmp-<pid>-<thread>`; `.<name>.tmp-<pid>` is what earlier
# versions left. A process that finds one it did not start after a crash may remove it.
TEMP_NAME = re.compile(r"^\..+\.tmp-\d+(-\d+)?$")


def temp_path(path: Path) -> Path:
    """Where `path` is written before its rename: unique per process and thread, in the same folder."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")


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
    tmp = temp_path(path)
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


class FileBatch:
    """Files written one after the other that appear whole or not at all, committed together.

    `file(path)` writes one under its temporary name; `commit()` fsyncs each written file, renames it
    to its name, then fsyncs each folder involved once (and the parent of any folder it created), so a
    crash leaves every file either complete under its name or absent (a rename that was not yet
    durable is undone, never a file's data). `discard()` removes what was not committed. Not for
    files that other threads or processes write at the same time.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[Path, Path]] = []  # (temporary, final)
        self._folders: set[Path] = set()

    @contextmanager
    def file(self, path: Path) -> Iterator[BinaryIO]:
        path = Path(path)
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
            self._folders.add(path.parent.parent)  # the new folder's own entry
        tmp = temp_path(path)
        try:
            with open(tmp, "wb") as f:
                yield f
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self._pending.append((tmp, path))
        self._folders.add(path.parent)

    def commit(self) -> int:
        """Make every file written so far durable under its name; returns how many."""
        try:
            # every file's data first, then the names: no name appears before its data is on disk
            for tmp, _ in self._pending:
                fsync_path(tmp)
            for tmp, path in self._pending:
                os.replace(tmp, path)
        except BaseException:
            self.discard()
            raise
        done = len(self._pending)
        self._pending.clear()
        for folder in sorted(self._folders, key=lambda p: len(p.parts), reverse=True):
            fsync_path(folder)
        self._folders.clear()
        return done

    def discard(self) -> None:
        """Remove the files written since the last commit (those already renamed stay)."""
        for tmp, _ in self._pending:
            tmp.unlink(missing_ok=True)
        self._pending.clear()
