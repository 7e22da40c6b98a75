"""NVIDIA Model Optimizer offline EAGLE data (NVIDIA/Model-Optimizer, formerly TensorRT-Model-Optimizer).

Layout, as `examples/speculative_decoding/collect_hidden_states/compute_hidden_states_hf.py` writes it
and `OfflineSupervisedDataset` (`modelopt/torch/speculative/eagle/utils.py`) reads it (the training
script collects `<offline_data_path>/**/*.pt` and loads each with `torch.load(weights_only=True)`):

    <out>/<conversation id>.pt

one `torch.save`d dict per sample:

    input_ids            int64 [T]
    hidden_states        [T, H]        the last layer after the final norm (HF hidden_states[-1])
    aux_hidden_states    [T, n * H]    HF hidden_states[lid + 1] for lid in the aux layer ids, ascending
    loss_mask            int64 [T]
    conversation_id      the sample id (a string)
    hidden_states_prenorm  False       (the reader's flag: hidden_states is already normed)

Model Optimizer's default aux layer ids are sorted({1, L//2 - 1, L - 4}) (decoder layers, 0-based),
read as hidden_states[lid + 1]: hsx layers [2, L//2, L - 3] for any model with 8 or more layers.
A sample id that is not a plain file name is stored as `<sanitised>-<sha256 prefix>.pt`.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, BinaryIO

import torch

from hsx.exports.base import (
    Exporter,
    ExportRefused,
    PlannedFile,
    layer_set_aux,
    require_layers,
    require_num_layers,
    require_post_norm_last,
)
from hsx.exports.rows import SampleRows
from hsx.layers import layer_key
from hsx.manifest import ManifestSample
from hsx.training.reader import StoredJob

_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,150}$")


def modelopt_default_aux_ids(num_layers: int) -> list[int]:
    """Model Optimizer's default EAGLE-3 aux layer ids (0-based decoder layers)."""
    return sorted({1, max(0, num_layers // 2 - 1), max(0, num_layers - 4)})


def file_stem(sample_id: object) -> str:
    text = str(sample_id)
    if _PLAIN_NAME.match(text) and not text.endswith(".pt"):
        return text
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._-")[:80] or "sample"
    return f"{cleaned}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


class ModelOptExporter(Exporter):
    target = "modelopt"

    def __init__(
        self,
        job: StoredJob,
        *,
        num_layers: int | None = None,
        aux_layers: list[int] | None = None,
        layer_set: str | None = None,
    ):
        super().__init__(job)
        self.num_layers = require_num_layers(job, num_layers)
        aux_layers = layer_set_aux(job, self.target, layer_set, aux_layers, self.num_layers)
        if aux_layers is None:
            self.aux_layers = [i + 1 for i in modelopt_default_aux_ids(self.num_layers)]
        else:
            self.aux_layers = sorted(set(int(i) for i in aux_layers))  # Model Optimizer sorts its aux ids
        if not self.aux_layers or any(not 1 <= i <= self.num_layers - 1 for i in self.aux_layers):
            raise ExportRefused(
                f"aux layers {self.aux_layers} must lie in 1..{self.num_layers - 1} (outputs of decoder layers 0..L-2)"
            )
        require_layers(
            job,
            self.target,
            [*self.aux_layers, self.num_layers],
            f"aux {self.aux_layers} = hidden_states[lid + 1] for Model Optimizer aux layer ids "
            f"{[i - 1 for i in self.aux_layers]}, plus {self.num_layers} = the final layer after the norm",
        )
        require_post_norm_last(job, self.target, self.num_layers)
        self._names = self._file_names()

    def _file_names(self) -> list[str]:
        names = [f"{file_stem(s.id)}.pt" for s in self.job.samples]
        seen: dict[str, str] = {}
        for name, s in zip(names, self.job.samples):
            other = seen.setdefault(name, s.id)
            if other != s.id:
                raise ExportRefused(f"samples {other!r} and {s.id!r} would share the file name {name}")
        return names

    def plan(self) -> list[PlannedFile]:
        return [PlannedFile(name, i, s.id) for i, (name, s) in enumerate(zip(self._names, self.job.samples))]

    def settings(self) -> dict[str, Any]:
        return {"aux_layers": self.aux_layers, "last_layer": self.num_layers}

    def notes(self) -> list[str]:
        ids = [i - 1 for i in self.aux_layers]
        line = f"aux_hidden_states = hsx layers {self.aux_layers} (Model Optimizer aux layer ids {ids}"
        line += ", its default)" if ids == modelopt_default_aux_ids(self.num_layers) else "; configure these)"
        return [
            line,
            f"hidden_states = hsx layer {self.num_layers} (after the final norm; hidden_states_prenorm = False)",
            "train with answer_only_loss to use the stored loss_mask (otherwise Model Optimizer uses all ones)",
        ]

    def encode(self, f: BinaryIO, rows: SampleRows, entry: ManifestSample, planned: PlannedFile) -> None:
        # the shard's own rows where a tensor is one (no copy), one copy for the aux layers side by side
        torch.save(
            {
                "input_ids": rows.tensor("input_ids", torch.int64),
                "hidden_states": rows.tensor(layer_key(self.num_layers)),
                "aux_hidden_states": rows.side_by_side([layer_key(i) for i in self.aux_layers]),
                "loss_mask": rows.tensor("loss_mask", torch.int64),
                "conversation_id": str(entry.id),
                "hidden_states_prenorm": False,
            },
            f,
        )
