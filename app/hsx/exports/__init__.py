"""Exports of a job's hidden states into training frameworks' own offline layouts.

One module per target (specforge, speculators, modelopt) plus `base` (refusal, resume, the record),
`rows` (a sample's rows over the mapped shard) and `writing` (chunks, worker processes). This package
imports nothing heavy itself; `exporter_class(name)` loads a target's module.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hsx.exports.base import Exporter, ExportResult

TARGETS = {
    "specforge": ("hsx.exports.specforge", "SpecForgeExporter"),
    "speculators": ("hsx.exports.speculators", "SpeculatorsExporter"),
    "modelopt": ("hsx.exports.modelopt", "ModelOptExporter"),
}


def default_workers() -> int:
    """Worker processes of `hsx export` unless told: one per CPU this process may use, at most 4 (an
    export is mostly copying; more workers than that wait on the disk)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def exporter_class(target: str) -> type[Exporter]:
    if target not in TARGETS:
        raise KeyError(f"unknown export target {target!r}; one of {sorted(TARGETS)}")
    module, name = TARGETS[target]
    cls: type[Exporter] = getattr(importlib.import_module(module), name)
    return cls


def export_job(
    target: str,
    source: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    progress: Callable[[int, int], None] | None = None,
    workers: int = 1,
    **options: Any,
) -> ExportResult:
    """Export the job at `source` (job folder or manifest.json) into `out_dir` for `target`, with
    `workers` processes (1: this one); the files are the same whatever their number.

    Raises `ExportRefused` when the job or the folder does not fit; returns an `ExportResult`.
    """
    from hsx.exports.base import run_export
    from hsx.training.reader import load_job

    exporter = exporter_class(target)(load_job(source), **options)
    return run_export(exporter, out_dir, progress=progress, workers=workers)
