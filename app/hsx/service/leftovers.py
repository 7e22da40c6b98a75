"""The folder a job leaves under the output root once its records are deleted without its files: found
by the job's id alone and removed on request, only when it is plainly hsx's (a job folder's name, and
nothing in it but what the writer puts there)."""

from __future__ import annotations

import json
import re
import shutil
import stat
from pathlib import Path

from hsx.db import repository as repo
from hsx.manifest import MANIFEST_NAME, job_dir
from hsx.service.errors import ForeignFiles

# What the writer leaves in a job folder: its shards, the manifest, and the temporary files they are
# written through (hidden, ".tmp-" and the writing process's numbers: what a crash may leave behind).
_OURS = re.compile(r"shard-\d{6}\.safetensors|manifest\.json|\.[\w.-]+\.tmp-[\d-]+")


def remove_leftover_folder(output_root: Path, job_id: str) -> bool:
    """Remove the folder of the job `job_id`, whose records are gone; False when there is none. Refused
    (ForeignFiles, nothing removed) when the folder holds anything else than a job folder holds, or a
    manifest of another job: a folder a person put there, or one hsx did not write."""
    if not repo.is_job_id(job_id):
        return False
    folder = job_dir(output_root, job_id)
    try:
        if not stat.S_ISDIR(folder.lstat().st_mode):  # a link or a file of that name is not a job folder
            return False
        entries = list(folder.iterdir())
    except FileNotFoundError:
        return False
    foreign = sorted(p.name for p in entries if not (_OURS.fullmatch(p.name) and _plain_file(p)))
    if not foreign and not _manifest_is_of(folder / MANIFEST_NAME, job_id):
        foreign = [MANIFEST_NAME]
    if foreign:
        raise ForeignFiles(job_id, foreign)
    shutil.rmtree(folder)
    return True


def _plain_file(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except FileNotFoundError:
        return True  # removed meanwhile: nothing of it is left to judge


def _manifest_is_of(path: Path, job_id: str) -> bool:
    """Whether the folder's manifest, when it has one, is the job's."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return True
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(doc, dict) and doc.get("job_id") == job_id
