"""One sample's rows for an export's file, as tensors over the mapped shard: copied only where needed.

`tensor(key)` is a tensor over the shard's own bytes whose storage is exactly the sample's rows, so
`torch.save` writes just those rows, straight from the page cache (an encoded layer's rows are decoded
into memory of their own first: hsx.storage.mapped). `side_by_side(keys)` is the one
copy an export cannot avoid: layers concatenated along the hidden axis (what `torch.cat(dim=-1)`
gives), written by numpy in this thread rather than by torch's thread pool, whose idle threads spin
for CPU time on a busy machine.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hsx.dtypes import DTYPES_BY_CODE
from hsx.manifest import ManifestSample
from hsx.storage.mapped import MappedShard


class SampleRows:
    """The rows of one manifest sample in its (mapped) shard."""

    def __init__(self, shard: MappedShard, entry: ManifestSample):
        self.shard = shard
        self.entry = entry
        # where the shard itself places the sample (a ShardError where the manifest says otherwise)
        self.start, self.stop = shard.place(entry.id, entry.offset, entry.num_tokens)

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start

    def raw(self, key: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows start..stop of the sample (default: all) as uint8 [rows, bytes per row]: the shard's bytes."""
        stop = self.num_tokens if stop is None else stop
        return self.shard.rows(key, self.start + start, self.start + stop)

    def fp8(self, key: str, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """An fp8 layer's codes (uint8 [rows, hidden]) and scales (float32 [rows]) of the sample's rows
        start..stop, as the shard stores them."""
        return self.shard.fp8_rows(key, self.start + start, self.start + stop)

    def dtype(self, key: str) -> torch.dtype:
        return DTYPES_BY_CODE[self.shard.layout(key).dtype].torch

    def as_tensor(self, key: str, raw: np.ndarray) -> torch.Tensor:
        """`raw` (rows of `key`) as a tensor of the key's dtype and shape, sharing its bytes."""
        shape = self.shard.layout(key).shape[1:]
        return torch.from_numpy(raw).view(self.dtype(key)).reshape(raw.shape[0], *shape)

    def tensor(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The sample's rows of `key`, over the shard's bytes (a copy only to change the dtype)."""
        t = self.as_tensor(key, self.raw(key))
        return t if dtype is None or t.dtype == dtype else t.to(dtype)

    def side_by_side(self, keys: list[str]) -> torch.Tensor:
        """The rows of `keys` (one dtype) concatenated along their last axis: [T, sum of widths] (new
        memory, or for one key its `tensor`)."""
        if len(keys) == 1:
            return self.tensor(keys[0])
        parts = [self.raw(key) for key in keys]
        dtypes = {self.dtype(key) for key in keys}
        if len(dtypes) != 1:
            raise ValueError(f"{keys} hold different dtypes {sorted(map(str, dtypes))}")
        out = np.empty((self.num_tokens, sum(p.shape[1] for p in parts)), dtype=np.uint8)
        fill_side_by_side(out, parts)
        return torch.from_numpy(out).view(dtypes.pop())


def fill_side_by_side(out: np.ndarray, parts: list[np.ndarray[Any, Any]]) -> None:
    """Copy byte rows `parts` (each [rows, width]) side by side into `out` [rows, sum of widths]."""
    at = 0
    for part in parts:
        out[:, at : at + part.shape[1]] = part
        at += part.shape[1]
