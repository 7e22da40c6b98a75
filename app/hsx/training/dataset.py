"""A PyTorch Dataset over a job's shards for EAGLE-3 drafter training.

Each item is one sample, read with safetensors' memory-mapped `get_slice` (a shard is never
loaded whole):

    input_ids         int64 [T]
    loss_mask         int64 [T]
    aux_hidden_state  [T, n_aux * H]   the aux layers concatenated in order (EAGLE-3: 3 layers)
    hidden_state      [T, H]           the last layer (default: the highest captured, i.e. L after the norm)
    id                the sample's id

A job that captured several layer sets at once (`layers: ["eagle3", "dflash"]`) is read one set at a time,
by name (`layer_set="dflash"`: its five taps as aux_hidden_state [T, 5H], L as hidden_state); a set the job
did not capture is a ValueError naming those it did.

Opened shards are cached per process (a few at a time), so DataLoader workers each open their own.
"""

from __future__ import annotations

import os
from typing import TypedDict

import torch
from torch.utils.data import Dataset

from hsx.dtypes import DTYPES
from hsx.layers import layer_key, select_layers
from hsx.manifest import ManifestHeader
from hsx.training.reader import ShardReader, StoredJob, load_job

FLOAT_DTYPES = sorted(name for name, d in DTYPES.items() if d.is_float)


def torch_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in FLOAT_DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; one of {FLOAT_DTYPES}")
    return DTYPES[dtype].torch


class HiddenStateItem(TypedDict):
    """One item of the Dataset: see the module docstring."""

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    aux_hidden_state: torch.Tensor
    hidden_state: torch.Tensor
    id: str


class HiddenStateDataset(Dataset[HiddenStateItem]):
    """One job's stored samples, in manifest order.

    `manifest_or_job_dir`: the job folder or its manifest.json. `layer_set`: a named set the job captured
    (eagle3, dflash, ...; the manifest's `layer_sets`), its layers but L as the aux layers, L as the last.
    Or `aux_layers`: the auxiliary layers in concatenation order (default: every captured layer but the
    last; must then be 3), and `last_layer`: the target layer (default: the highest captured). `dtype`:
    cast hidden states to it (default: as stored). A ValueError names the layers when the chosen ones were
    not captured.
    """

    def __init__(
        self,
        manifest_or_job_dir: str | os.PathLike[str],
        *,
        layer_set: str | None = None,
        aux_layers: list[int] | None = None,
        last_layer: int | None = None,
        dtype: torch.dtype | str | None = None,
        max_open_shards: int = 8,
    ):
        self.job: StoredJob = load_job(manifest_or_job_dir)
        self.aux_layers, self.last_layer = pick_layers(self.job.manifest, layer_set, aux_layers, last_layer)
        self.dtype = torch_dtype(dtype)
        self.hidden_size = self.job.hidden_size
        self._entries = list(self.job.samples)
        self._keys = item_keys(self.aux_layers, self.last_layer)
        self.reader = ShardReader(self.job.job_dir, max_open=max_open_shards)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def sample_ids(self) -> list[str]:
        return [e.id for e in self._entries]

    @property
    def lengths(self) -> list[int]:
        """Token count of every sample, in order (for length-grouped batching)."""
        return [e.num_tokens for e in self._entries]

    def __getitem__(self, index: int) -> HiddenStateItem:
        n = len(self._entries)
        if not -n <= index < n:
            raise IndexError(f"index {index} out of range for {n} samples")
        entry = self._entries[index]
        return make_item(self.reader.sample(entry, self._keys), entry.id, self.aux_layers, self.last_layer, self.dtype)


def pick_layers(
    header: ManifestHeader, layer_set: str | None, aux_layers: list[int] | None, last_layer: int | None
) -> tuple[list[int], int]:
    """(aux layers, last layer) an item is made of: a named set's among the job's (ManifestHeader.layer_set),
    or the ones given (hsx.layers.select_layers, with its defaults)."""
    if layer_set is None:
        return select_layers(header.layers or [], aux_layers, last_layer)
    if aux_layers is not None or last_layer is not None:
        raise ValueError("give a layer_set, or aux_layers and last_layer, not both")
    return header.layer_set(layer_set)


def make_item(
    rows: dict[str, torch.Tensor], sample_id: str, aux_layers: list[int], last_layer: int, dtype: torch.dtype | None
) -> HiddenStateItem:
    """One sample's rows as an item: the aux layers concatenated, the last layer, ids and mask as int64."""
    hidden = rows[layer_key(last_layer)]
    aux = [rows[layer_key(i)] for i in aux_layers]
    # A set of the last layer alone (last) has no aux layers: [T, 0].
    aux_hidden = aux[0] if len(aux) == 1 else torch.cat(aux, dim=-1) if aux else hidden[:, :0]
    if dtype is not None:
        aux_hidden, hidden = aux_hidden.to(dtype), hidden.to(dtype)
    return {
        "input_ids": rows["input_ids"].to(torch.int64),
        "loss_mask": rows["loss_mask"].to(torch.int64),
        "aux_hidden_state": aux_hidden,
        "hidden_state": hidden,
        "id": sample_id,
    }


def item_keys(aux_layers: list[int], last_layer: int) -> list[str]:
    """The tensors an item is made of."""
    return ["input_ids", "loss_mask"] + [layer_key(i) for i in aux_layers] + [layer_key(last_layer)]
