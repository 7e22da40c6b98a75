"""A job's folder under the output root, removed on request only when it is plainly hsx's (a folder, not a
link, of a job folder's name, with nothing in it but what the writer puts there): with the job's records,
or once they are deleted without its files, found by the job's id alone."""

from __future__ import annotations

import json
import os
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
    """Remove the folder of the job `job_id`, whose records are gone; False when there is none (nor a
    job folder's name: a link or a file of that name is not a job folder). Refused (ForeignFiles,
    nothing removed) as job_folder refuses."""
    if not repo.is_job_id(job_id):
        return False
    folder = job_dir(output_root, job_id)
    try:
        if not stat.S_ISDIR(folder.lstat().st_mode):
            return False
    except FileNotFoundError:
        return False
    checked = job_folder(output_root, job_id)
    if checked is None:
        return False
    remove_folder(checked)
    return True


def remove_folder(folder: Path) -> None:
    """Remove a checked job folder that another request may be removing at the same moment (deletes of
    one job at once, each finding its records gone): an entry gone before this one reached it is what
    both wanted, so the walk starts again over what is left until the folder itself is gone."""
    while True:
        try:
            shutil.rmtree(folder)
            return
        except FileNotFoundError:
            if not os.path.lexists(folder):
                return


def job_folder(output_root: Path, job_id: str) -> Path | None:
    """The job's folder, checked before its files are deleted; None when there is none. Refused
    (ForeignFiles) when it is not a folder hsx made (a symbolic link, which hsx never makes, or a file),
    when it holds anything else than a job folder holds, or a manifest of another job: a folder a
    person put there, or one hsx did not write, is left for that person to look at."""
    folder = job_dir(output_root, job_id)
    try:
        mode = folder.lstat().st_mode
        if stat.S_ISLNK(mode):
            raise ForeignFiles(folder.name, [folder.name], why="is a symbolic link, which hsx never makes")
        if not stat.S_ISDIR(mode):
            raise ForeignFiles(folder.name, [folder.name], why="is not a folder")
        entries = list(folder.iterdir())
    except FileNotFoundError:
        return None
    foreign = sorted(p.name for p in entries if not (_OURS.fullmatch(p.name) and _plain_file(p)))
    if not foreign and not _manifest_is_of(folder / MANIFEST_NAME, job_id):
        foreign = [MANIFEST_NAME]
    if foreign:
        raise ForeignFiles(folder.name, foreign)
    return folder


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
