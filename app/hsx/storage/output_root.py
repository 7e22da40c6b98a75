"""The output root's identity: a small marker file in the folder, holding an id made when the folder
was first used.

A path says nothing about which folder it reaches (two hosts may mount one network file system at
different paths, or a path may lead to a local folder where a mount has dropped), so services that
share a database compare this id, not paths, to know that they write to one folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from pathlib import Path

from hsx.storage.atomic import fsync_path

MARKER_NAME = ".hsx-output-root.json"
MARKER_FORMAT = "hsx-output-root/1"


class OutputRootMismatch(Exception):
    """The output root is not the folder the database's jobs write to (or its marker is unreadable)."""


def marker_path(root: Path) -> Path:
    return Path(root) / MARKER_NAME


def read_marker(root: Path) -> str | None:
    """The id the root's marker holds; None when the root has no marker."""
    path = marker_path(root)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise OutputRootMismatch(f"{path} is unreadable: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != MARKER_FORMAT or not isinstance(doc.get("id"), str):
        raise OutputRootMismatch(f"{path} is not an {MARKER_FORMAT} marker")
    return doc["id"]


def create_marker(root: Path) -> str:
    """Mark the root with a new id, unless it is marked already; returns the id it holds.

    The marker appears whole or not at all, and only once: it is written under a temp name and
    hard-linked into place, which fails when another process marked the root first."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{MARKER_NAME}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"format": MARKER_FORMAT, "id": secrets.token_hex(16)}, f)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        # Another process's marker got there first: the one read below is the root's.
        with contextlib.suppress(FileExistsError):
            os.link(tmp, marker_path(root))
    finally:
        tmp.unlink(missing_ok=True)
    fsync_path(root)
    found = read_marker(root)
    assert found is not None  # linked here or by the process that came first
    return found
