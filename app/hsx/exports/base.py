"""What every export shares: layer checks, refusal, atomic files, resume, the record file.

An export turns a job (manifest + shards) into one file per sample in a training framework's own
offline layout. It refuses (ExportRefused, nothing written) a job whose captured layers do not fit the
target's convention. Each file is written under a temporary name in its own folder, fsynced and
renamed (`hsx.storage.atomic.FileBatch`, see `hsx.exports.writing` for who writes which), so a file
that exists under its final name is complete; a rerun skips those and writes only the missing ones.
`hsx-export.json` in the output folder records the job, the settings and which sample each file
holds; a rerun with other settings, or into a folder that holds something else, is refused instead
of mixing two exports.
"""

from __future__ import annotations

import fcntl
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, ClassVar

from hsx.exports.rows import SampleRows
from hsx.exports.writing import write_files
from hsx.manifest import ManifestSample
from hsx.storage.atomic import TEMP_NAME, atomic_file
from hsx.training.reader import ShardReader, StoredJob

RECORD_NAME = "hsx-export.json"
RECORD_FORMAT = "hsx-export/1"
LOCK_NAME = ".hsx-export.lock"


class ExportRefused(Exception):
    """The job, or the output folder, does not fit the export; the message says why."""


@dataclass(frozen=True)
class PlannedFile:
    rel_path: str  # relative to the output folder, "/"-separated
    index: int  # the sample's position in the manifest
    sample_id: str


@dataclass
class ExportResult:
    target: str
    out_dir: Path
    total: int
    written: int
    skipped: int
    extra_files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def require_num_layers(job: StoredJob, num_layers: int | None) -> int:
    """L, the model's number of decoder layers: from the manifest, or --num-layers when it lacks it."""
    declared = job.num_hidden_layers
    if num_layers is not None and declared is not None and int(num_layers) != declared:
        raise ExportRefused(f"--num-layers {num_layers} contradicts the manifest's model.num_hidden_layers {declared}")
    value = declared if declared is not None else num_layers
    if value is None:
        raise ExportRefused(
            "the manifest does not record model.num_hidden_layers, so which captured layer is "
            "the final (post-norm) one is unknown; pass --num-layers"
        )
    if int(value) < 1:
        raise ExportRefused(f"number of layers must be positive, got {value}")
    return int(value)


def require_post_norm_last(job: StoredJob, target: str, last: int) -> None:
    """Refuse a last layer that the manifest records as taken before the final norm (a manifest that
    does not say follows hsx's numbering, where layer L is after it)."""
    if job.manifest.post_norm(last) is False:
        raise ExportRefused(
            f"{target} takes layer {last} as the final hidden state after the model's final norm, but the "
            f"manifest's post_norm_layers {job.manifest.post_norm_layers} say it is not"
        )


def layer_set_aux(
    job: StoredJob, target: str, layer_set: str | None, aux_layers: list[int] | None, num_layers: int
) -> list[int] | None:
    """The aux layers of the named set asked for (its layers but the last, L), or `aux_layers` as given;
    ExportRefused, before anything is written, for a set the job did not capture, naming those it did."""
    if layer_set is None:
        return aux_layers
    if aux_layers is not None:
        raise ExportRefused("give --layer-set or --aux-layers, not both")
    try:
        aux, last = job.manifest.layer_set(layer_set)
    except ValueError as exc:
        raise ExportRefused(f"{target}: {exc}") from None
    if last != num_layers:
        raise ExportRefused(f"layer set {layer_set} ends at layer {last}, and the model has {num_layers} layers")
    return aux


def require_layers(job: StoredJob, target: str, wanted: list[int], what: str) -> None:
    missing = [i for i in wanted if i not in job.layers]
    if missing:
        raise ExportRefused(
            f"{target} needs layers {wanted} ({what}); the job captured {job.layers}, without {missing}"
        )


class Exporter(ABC):
    """One target's file layout. Subclasses fill in plan, encode and the settings a rerun must match."""

    target: ClassVar[str] = ""

    def __init__(self, job: StoredJob):
        self.job = job

    @abstractmethod
    def plan(self) -> list[PlannedFile]:
        """Every file the export writes, in order, with the sample it holds."""

    @abstractmethod
    def settings(self) -> dict[str, Any]:
        """Everything that shapes the files; a rerun into the same folder must match it."""

    def notes(self) -> list[str]:
        """What a user needs to know to point the target's trainer at the result."""
        return []

    def preflight(self, reader: ShardReader) -> None:  # noqa: B027 - optional hook, a no-op by default
        """A check on real data before anything is written (optional)."""

    @abstractmethod
    def encode(self, f: BinaryIO, rows: SampleRows, entry: ManifestSample, planned: PlannedFile) -> None:
        """Write one file's content for one sample's rows. It runs in a worker process when the export
        has several: it must depend on the sample alone, and leave the exporter as it found it."""

    def finalize(self, out_dir: Path, reader: ShardReader, changed: bool) -> list[str]:
        """Write files that describe the whole export (after every per-sample file); return their names."""
        return []


def _read_record(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def _check_folder(out_dir: Path, record: dict[str, Any], plan: list[PlannedFile]) -> bool:
    """Refuse an output folder that holds anything but an earlier run of this same export.

    Returns whether the earlier run finished with exactly this record (nothing to do but check files).
    """
    record_path = out_dir / RECORD_NAME
    others = [p.name for p in out_dir.iterdir() if p.name not in (LOCK_NAME, RECORD_NAME)]
    if not record_path.exists():
        if others:
            raise ExportRefused(f"{out_dir} is not empty and holds no {RECORD_NAME}; export into an empty folder")
        return False
    old = _read_record(record_path)
    if old is None or old.get("format") != RECORD_FORMAT:
        raise ExportRefused(f"{record_path} is unreadable; export into an empty folder")
    for key in ("target", "job_id", "settings"):
        if old.get(key) != record[key]:
            raise ExportRefused(
                f"{out_dir} holds a {old.get('target')} export of job {old.get('job_id')} with "
                f"other settings ({key}: {old.get(key)!r}, now {record[key]!r}); "
                "export into an empty folder"
            )
    new_files = {p.rel_path: p.sample_id for p in plan}
    for rel, sid in old.get("files", []):
        if new_files.get(rel) != sid:
            raise ExportRefused(
                f"{out_dir}/{rel} holds sample {sid!r} but the job now maps it to "
                f"{new_files.get(rel)!r}; export into an empty folder"
            )
    return bool(old.get("complete")) and old == {**record, "complete": True}


def _remove_stale_temps(folders: set[Path]) -> None:
    for d in folders:
        if d.is_dir():
            for p in d.iterdir():
                if TEMP_NAME.match(p.name) and p.is_file():
                    p.unlink(missing_ok=True)


def _write_record(path: Path, record: dict[str, Any]) -> None:
    with atomic_file(path) as f:
        f.write(json.dumps(record, indent=1).encode() + b"\n")


def run_export(
    exporter: Exporter,
    out_dir: str | os.PathLike[str],
    progress: Callable[[int, int], None] | None = None,
    workers: int = 1,
) -> ExportResult:
    """Write every planned file not yet complete in `out_dir`, with `workers` processes; see the module
    docstring. `progress(done, total)` is called (in this process) as files become complete."""
    out_dir = Path(out_dir)
    job = exporter.job
    plan = exporter.plan()
    record = {
        "format": RECORD_FORMAT,
        "target": exporter.target,
        "job_id": job.job_id,
        "source": str(job.manifest_path.resolve()),
        "settings": exporter.settings(),
        "files": [[p.rel_path, p.sample_id] for p in plan],
        "complete": False,
    }
    if out_dir.resolve() == job.job_dir.resolve():
        raise ExportRefused("the output folder is the job folder; choose another")
    reader = ShardReader(job.job_dir)
    if any(not (out_dir / p.rel_path).exists() for p in plan):
        exporter.preflight(reader)  # a refusal on real data leaves the folder as it was
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / LOCK_NAME, "a+b") as lock:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ExportRefused(f"another export is writing into {out_dir}") from None
        finished_before = _check_folder(out_dir, record, plan)
        if not finished_before:
            _write_record(out_dir / RECORD_NAME, record)
        folders = {out_dir} | {(out_dir / p.rel_path).parent for p in plan}
        _remove_stale_temps(folders)
        todo = [p for p in plan if not (out_dir / p.rel_path).exists()]
        skipped = len(plan) - len(todo)

        def done(written: int) -> None:
            if progress is not None:
                progress(skipped + written, len(plan))

        try:
            written = write_files(exporter, out_dir, todo, workers, done)
        except BaseException:
            _remove_stale_temps(folders)  # what a worker stopped mid-file left
            raise
        extra = exporter.finalize(out_dir, reader, changed=written > 0 or not finished_before)
        if not finished_before:
            _write_record(out_dir / RECORD_NAME, {**record, "complete": True})
        reader.close()
    return ExportResult(exporter.target, out_dir, len(plan), written, len(plan) - written, extra, exporter.notes())
