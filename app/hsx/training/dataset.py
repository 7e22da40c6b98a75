"""A PyTorch Dataset over a job's shards for EAGLE-3 drafter training.

Each item is one sample, read with safetensors' memory-mapped `get_slice` (a shard is never
loaded whole):

    input_ids         int64 [T]
    loss_mask         int64 [T]
    aux_hidden_state  [T, n_aux * H]   the aux layers concatenated in order (EAGLE-3: 3 layers)
    hidden_state      [T, H]           the last layer (default: the highest captured, i.e. L after the norm)
    id                the sample's id

Opened shards are cached per process (a few at a time), so DataLoader workers each open their own.
"""

from __future__ import annotations

import os
from typing import TypedDict

import torch
from torch.utils.data import Dataset

from hsx.dtypes import DTYPES
from hsx.layers import layer_key, select_layers
from hsx.training.reader import ShardReader, StoredJob, load_job

FLOAT_DTYPES = sorted(name for name, d in DTYPES.items() if d.is_float)


def _torch_dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
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

    `manifest_or_job_dir`: the job folder or its manifest.json. `aux_layers`: the auxiliary layers
    in concatenation order (default: every captured layer but the last; must then be 3).
    `last_layer`: the target layer (default: the highest captured). `dtype`: cast hidden states to it
    (default: as stored). A ValueError names the layers when the chosen ones were not captured.
    """

    def __init__(
        self,
        manifest_or_job_dir: str | os.PathLike[str],
        *,
        aux_layers: list[int] | None = None,
        last_layer: int | None = None,
        dtype: torch.dtype | str | None = None,
        max_open_shards: int = 8,
    ):
        self.job: StoredJob = load_job(manifest_or_job_dir)
        self.aux_layers, self.last_layer = select_layers(self.job.layers, aux_layers, last_layer)
        self.dtype = _torch_dtype(dtype)
        self.hidden_size = self.job.hidden_size
        self._entries = list(self.job.samples)
        self._keys = ["input_ids", "loss_mask"] + [layer_key(i) for i in self.aux_layers] + [layer_key(self.last_layer)]
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
        rows = self.reader.sample(entry, self._keys)
        aux = [rows[layer_key(i)] for i in self.aux_layers]
        aux_hidden = aux[0] if len(aux) == 1 else torch.cat(aux, dim=-1)
        hidden = rows[layer_key(self.last_layer)]
        if self.dtype is not None:
            aux_hidden, hidden = aux_hidden.to(self.dtype), hidden.to(self.dtype)
        return {
            "input_ids": rows["input_ids"].to(torch.int64),
            "loss_mask": rows["loss_mask"].to(torch.int64),
            "aux_hidden_state": aux_hidden,
            "hidden_state": hidden,
            "id": entry.id,
        }
