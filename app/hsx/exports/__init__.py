"""Exports of a job's hidden states into training frameworks' own offline layouts.

One module per target (specforge, speculators, modelopt) plus `base` (refusal, resume, atomic files).
This package imports nothing heavy itself; `exporter_class(name)` loads a target's module.
"""

from __future__ import annotations

import importlib

TARGETS = {
    "specforge": ("hsx.exports.specforge", "SpecForgeExporter"),
    "speculators": ("hsx.exports.speculators", "SpeculatorsExporter"),
    "modelopt": ("hsx.exports.modelopt", "ModelOptExporter"),
}


def exporter_class(target: str):
    if target not in TARGETS:
        raise KeyError(f"unknown export target {target!r}; one of {sorted(TARGETS)}")
    module, name = TARGETS[target]
    return getattr(importlib.import_module(module), name)


def export_job(target: str, source, out_dir, *, progress=None, **options):
    """Export the job at `source` (job folder or manifest.json) into `out_dir` for `target`.

    Raises `ExportRefused` when the job or the folder does not fit; returns an `ExportResult`.
    """
    from hsx.exports.base import run_export
    from hsx.training.reader import load_job

    exporter = exporter_class(target)(load_job(source), **options)
    return run_export(exporter, out_dir, progress=progress)
