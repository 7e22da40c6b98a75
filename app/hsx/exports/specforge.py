"""SpecForge offline EAGLE-3 data (sgl-project/SpecForge).

Layout, as `scripts/prepare_hidden_states.py` writes it and `OfflineEagle3Dataset`
(`specforge/data/preprocessing.py`) reads it:

    <out>/rows_<g>-<g + group>/data_<idx>.ckpt      g = idx // group * group, group 2000 by default

Each file is one `torch.save`d dict of plain tensors (the reader walks the folder for `*.ckpt`,
sorts the paths and `torch.load`s each with mmap):

    input_ids         int64 [T]
    loss_mask         int64 [T]
    aux_hidden_state  [1, T, 3H]   the three aux layers concatenated (batch dim kept, the reader squeezes it)
    hidden_state      [1, T, H]    the last layer after the final norm (SGLang's logits-processor input)

SpecForge's aux layers are decoder layers [1, L//2 - 1, L - 4] taken at their output, i.e. hsx layers
[2, L//2, L - 3]; its hidden_state is hsx layer L.
"""

from __future__ import annotations

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
from hsx.layers import eagle3_aux_layers, layer_key
from hsx.manifest import ManifestSample
from hsx.training.reader import StoredJob

DEFAULT_GROUP_SIZE = 2000


class SpecForgeExporter(Exporter):
    target = "specforge"

    def __init__(
        self,
        job: StoredJob,
        *,
        num_layers: int | None = None,
        aux_layers: list[int] | None = None,
        layer_set: str | None = None,
        group_size: int = DEFAULT_GROUP_SIZE,
    ):
        super().__init__(job)
        if group_size < 1:
            raise ExportRefused(f"group size must be positive, got {group_size}")
        self.num_layers = require_num_layers(job, num_layers)
        aux_layers = layer_set_aux(job, self.target, layer_set, aux_layers, self.num_layers)
        self.aux_layers = list(aux_layers) if aux_layers is not None else eagle3_aux_layers(self.num_layers)
        if len(self.aux_layers) != 3 or len(set(self.aux_layers)) != 3:
            raise ExportRefused(f"SpecForge's EAGLE-3 takes exactly three distinct aux layers, got {self.aux_layers}")
        if self.num_layers in self.aux_layers or any(not 0 <= i < self.num_layers for i in self.aux_layers):
            raise ExportRefused(f"aux layers {self.aux_layers} must lie in 0..{self.num_layers - 1}")
        self.group_size = group_size
        require_layers(
            job,
            self.target,
            [*self.aux_layers, self.num_layers],
            f"aux {self.aux_layers} = SpecForge aux_hidden_state_layer_ids "
            f"{[i - 1 for i in self.aux_layers]}, plus {self.num_layers} = the final layer after the norm",
        )
        require_post_norm_last(job, self.target, self.num_layers)

    def plan(self) -> list[PlannedFile]:
        g = self.group_size
        return [
            PlannedFile(f"rows_{i // g * g}-{i // g * g + g}/data_{i}.ckpt", i, s.id)
            for i, s in enumerate(self.job.samples)
        ]

    def settings(self) -> dict[str, Any]:
        return {"aux_layers": self.aux_layers, "last_layer": self.num_layers, "group_size": self.group_size}

    def notes(self) -> list[str]:
        ids = [i - 1 for i in self.aux_layers]
        default = [1, self.num_layers // 2 - 1, self.num_layers - 4]
        line = f"aux_hidden_state = hsx layers {self.aux_layers} (SpecForge aux_hidden_state_layer_ids {ids}"
        line += ", its default)" if ids == default else "; set model.aux_hidden_state_layer_ids to this)"
        return [line, f"hidden_state = hsx layer {self.num_layers} (after the final norm)"]

    def encode(self, f: BinaryIO, rows: SampleRows, entry: ManifestSample, planned: PlannedFile) -> None:
        # torch.save writes each tensor's whole storage: the ids, the mask and the last layer are the
        # shard's own rows (no copy), the aux layers the one copy that puts them side by side
        torch.save(
            {
                "input_ids": rows.tensor("input_ids", torch.int64),
                "loss_mask": rows.tensor("loss_mask", torch.int64),
                "aux_hidden_state": rows.side_by_side([layer_key(i) for i in self.aux_layers]).unsqueeze(0),
                "hidden_state": rows.tensor(layer_key(self.num_layers)).unsqueeze(0),
            },
            f,
        )
