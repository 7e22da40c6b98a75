"""One output root for every service on a database.

Any writer may write any job's next shard, and any service may serve or finish any job, so a job's
shards and its manifest are only together when every service sharing the database writes to the
same folder. The first service records its output root's id (hsx.storage.output_root) in the
database; a service whose output root holds another id, or none, refuses to start, and a writer
checks again before each shard and manifest (a network file system that dropped away leaves its
mount point, a local folder, in its place).
"""

from __future__ import annotations

import socket
from pathlib import Path

from sqlalchemy.orm import Session

from hsx.db import repository as repo
from hsx.storage.output_root import MARKER_NAME, OutputRootMismatch, create_marker, read_marker

ADVICE = (
    "services that share a database must share one output root (the same folder, e.g. one network file "
    "system mounted on every host)"
)


def shared_output_root(session: Session, root: Path, *, mark: bool = False) -> str:
    """The id of `root` when it is the output root of the database's jobs; else OutputRootMismatch
    saying why. With `mark` (at a service's start), a database that has no output root yet gets
    this one, marked first if it has no marker."""
    found = read_marker(root)
    recorded = repo.recorded_output_root(session)
    if found is None and recorded is None and mark:
        found = create_marker(root)
    if found is not None and recorded is None:
        recorded = repo.record_output_root(session, found, f"{socket.gethostname()}:{Path(root).resolve()}")
    if recorded is not None and found == recorded.root_id:
        return found
    if recorded is None:
        raise OutputRootMismatch(f"output root {root} holds no {MARKER_NAME}: is the file system it lives on missing?")
    holds = f"is marked {found}" if found is not None else f"holds no {MARKER_NAME}"
    raise OutputRootMismatch(
        f"output root {root} is not this database's: it {holds}, while the database's jobs write to the folder "
        f"marked {recorded.root_id} (first used as {recorded.location}); {ADVICE}"
    )
