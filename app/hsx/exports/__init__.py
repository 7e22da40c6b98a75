"""Exports of a job's hidden states into training frameworks' own offline layouts.

One module per target (specforge, speculators, modelopt, deepspec) plus `base` (refusal, resume, the record),
`rows` (a sample's rows over the mapped shard) and `writing` (chunks, worker processes). TARGETS is the
one list of targets: each one's exporter class, what it writes and the options its exporter takes, from
which `hsx export` builds its subcommands and flags. This package imports nothing heavy itself;
`exporter_class(name)` loads a target's module.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hsx.layers import layers_arg

if TYPE_CHECKING:
    from hsx.exports.base import Exporter, ExportResult


@dataclass(frozen=True)
class Option:
    """One keyword argument of an exporter, which `hsx export TARGET` takes as --<name with dashes>."""

    name: str
    help: str
    type: Callable[[str], Any] = str
    default: Any = None  # the exporter's own default; None: the exporter decides from the job
    metavar: str | None = None


@dataclass(frozen=True)
class Target:
    """A training framework's layout: the exporter class that writes it ("module.Class"), the framework
    and the dataset class that reads it, the files, and the exporter's options beyond COMMON."""

    exporter: str
    help: str
    layout: str
    options: tuple[Option, ...] = ()

    @property
    def all_options(self) -> tuple[Option, ...]:
        return (*COMMON, *self.options)


# What every target takes: the layer count where the manifest lacks it, and the aux layers.
COMMON = (
    Option(
        "num_layers",
        "the model's number of decoder layers, when the manifest lacks model.num_hidden_layers",
        int,
        metavar="L",
    ),
    Option(
        "aux_layers",
        "aux layers in hsx numbering (default: the target's convention: EAGLE-3's [2, L//2, L-3]; deepspec: "
        "the dflash set's taps)",
        layers_arg,
        metavar="I,J,K",
    ),
    Option(
        "layer_set",
        "a named layer set the job captured (the manifest's layer_sets: eagle3, dflash, ...): its layers but L "
        "as the aux layers, L as the last; a set the job did not capture is refused, nothing written",
        metavar="NAME",
    ),
)

TARGETS = {
    "specforge": Target(
        "hsx.exports.specforge.SpecForgeExporter",
        "SpecForge offline EAGLE-3 (OfflineEagle3Dataset)",
        "rows_<a>-<b>/data_<i>.ckpt  (input_ids, loss_mask, hidden_state [1,T,H], aux_hidden_state [1,T,3H])",
        (Option("group_size", "files per rows_<a>-<b> folder, as SpecForge's --file-group-size", int, 2000),),
    ),
    "speculators": Target(
        "hsx.exports.speculators.SpeculatorsExporter",
        "vLLM speculators (hs_<i>.safetensors)",
        "hidden_states/hs_<i>.safetensors  (hidden_states [T,4,H], token_ids [T]) + hsx_samples.jsonl",
        (
            Option(
                "final_norm_weight",
                "the target model's checkpoint folder (or a .safetensors file) holding its final norm weight; "
                "needed because speculators stores the last layer before the final norm",
                metavar="CHECKPOINT",
            ),
            Option(
                "final_norm_key",
                "tensor name of the final norm weight (default: model.norm.weight and common variants)",
            ),
            Option(
                "final_norm_offset",
                "the norm scales by weight + OFFSET (default: 1 when the manifest's model.model_type has a "
                "Gemma-style norm, else 0)",
                float,
            ),
            Option(
                "fp8",
                "a job stored in fp8: write its float8_e4m3fn codes and their scales (hidden_states_scales) as "
                "speculators' own FP8 backend does, for its reader to multiply in: speculators 0.9.0 or newer, "
                "trained with --hidden-states-backend fp8; its default file backend and older releases read "
                "the codes unscaled (default: decoded, in the job's dtype, which every release reads)",
                bool,
                default=False,
            ),
        ),
    ),
    "modelopt": Target(
        "hsx.exports.modelopt.ModelOptExporter",
        "NVIDIA Model Optimizer offline EAGLE (OfflineSupervisedDataset)",
        "<sample id>.pt  (input_ids, hidden_states [T,H], aux_hidden_states [T,3H], loss_mask)",
    ),
    "deepspec": Target(
        "hsx.exports.deepspec.DeepSpecExporter",
        "DeepSpec's target cache, version 2 (CacheDataset: DFlash, DSpark, EAGLE-3)",
        "shard-<k>.bin + samples.idx + manifest.json  (input_ids int32, attention_mask, loss_mask uint8, "
        "target_hidden_states [T,n*H], target_last_hidden_states [T,H], bfloat16; taps: --layer-set, default dflash)",
        (
            Option(
                "target_model",
                "the manifest's target_model_name_or_path, which DeepSpec's training checks against its config's "
                "(default: the model path the job's manifest records)",
                metavar="NAME",
            ),
        ),
    ),
}


def default_workers() -> int:
    """Worker processes of `hsx export` unless told: one per CPU this process may use, at most 4 (an
    export is mostly copying; more workers than that wait on the disk)."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def exporter_class(target: str) -> type[Exporter]:
    if target not in TARGETS:
        raise KeyError(f"unknown export target {target!r}; one of {sorted(TARGETS)}")
    module, name = TARGETS[target].exporter.rsplit(".", 1)
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
    `workers` processes (1: this one); the files are the same whatever their number. `options` are the
    target's (TARGETS[target].all_options).

    Raises `ExportRefused` when the job or the folder does not fit; returns an `ExportResult`.
    """
    from hsx.exports.base import run_export
    from hsx.training.reader import load_job

    exporter = exporter_class(target)(load_job(source), **options)
    return run_export(exporter, out_dir, progress=progress, workers=workers)
