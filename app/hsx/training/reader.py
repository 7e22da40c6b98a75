"""A job's samples read straight from its shards: one sample's rows at a time, never a shard whole.

`load_job` reads manifest.json (given a job folder or the manifest's own path) into a `StoredJob`;
`ShardReader` slices sample rows out of the shards with safetensors' memory-mapped `get_slice`, keeping
a few opened shards in a small cache. The cache belongs to one process: after a fork (DataLoader
workers) or a pickle (spawned workers) it starts empty, so no worker shares another's handles.

Every shard is also mapped (hsx.storage.mapped): a sample's rows are where the shard's own metadata
places it, and a manifest that says otherwise is refused; a shard whose `__metadata__` names an
encoding (hsx.storage.encoding) has its layers decoded from the mapping, checked as they are read, and
the tensors come out as a raw shard would give them, a lossless layer bit for bit, an fp8 one in the
job's dtype. What fails a check is a ShardError naming the shard, the layer and the sample.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from hsx.dtypes import DTYPES_BY_CODE
from hsx.manifest import HiddenStates, Manifest, ManifestSample, load_manifest, locate
from hsx.storage.errors import ShardError
from hsx.storage.mapped import MappedShard


@dataclass(frozen=True)
class StoredJob:
    """A job's files on disk: its folder, its manifest, and the hidden states its shards hold."""

    job_dir: Path
    manifest_path: Path
    manifest: Manifest
    hidden_states: HiddenStates

    @property
    def job_id(self) -> str:
        return self.manifest.job_id

    @property
    def layers(self) -> list[int]:
        return self.hidden_states.layers

    @property
    def hidden_size(self) -> int:
        return self.hidden_states.hidden_size

    @property
    def samples(self) -> list[ManifestSample]:
        return self.manifest.samples

    @property
    def num_hidden_layers(self) -> int | None:
        value = (self.manifest.model or {}).get("num_hidden_layers")
        return int(value) if value is not None else None

    @property
    def model_type(self) -> str | None:
        """transformers' model_type ("llama", "gemma2", ...), where the manifest records it."""
        value = (self.manifest.model or {}).get("model_type")
        return str(value) if value is not None else None


def load_job(source: str | os.PathLike[str]) -> StoredJob:
    """Read and check a job's manifest; ValueError says what is wrong with it."""
    job_dir, manifest_path = locate(source)
    manifest = load_manifest(manifest_path, readable=True)
    return StoredJob(job_dir, manifest_path, manifest, manifest.hidden_states())


@dataclass
class _OpenShard:
    handle: safe_open
    mapped: MappedShard  # its placement of samples, and its layers where they are decoded


class ShardReader:
    """Slices sample rows out of a job's shards through a small per-process cache of open shards."""

    def __init__(self, job_dir: Path, max_open: int = 8):
        if max_open < 1:
            raise ValueError("max_open must be at least 1")
        self.job_dir = Path(job_dir)
        self.max_open = max_open
        self._pid: int | None = os.getpid()
        self._handles: OrderedDict[str, _OpenShard] = OrderedDict()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handles"] = OrderedDict()
        state["_pid"] = None
        return state

    def open_shards(self) -> list[str]:
        """The shards this process holds open now (oldest first)."""
        return list(self._handles) if self._pid == os.getpid() else []

    def _open(self, shard: str) -> _OpenShard:
        if self._pid != os.getpid():  # a forked worker: the parent's handles are not ours
            self._handles = OrderedDict()
            self._pid = os.getpid()
        f = self._handles.get(shard)
        if f is None:
            path = self.job_dir / shard
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as exc:  # safetensors raises its own error type for a damaged file
                raise ShardError(f"unreadable shard ({exc}); run hsx verify", shard=path) from exc
            f = self._handles[shard] = _OpenShard(handle, MappedShard(path))
            while len(self._handles) > self.max_open:
                self._handles.popitem(last=False)
        else:
            self._handles.move_to_end(shard)
        return f

    def handle(self, shard: str) -> safe_open:
        return self._open(shard).handle

    def sample(self, entry: ManifestSample, keys: list[str]) -> dict[str, torch.Tensor]:
        """The rows of `keys` that belong to one sample of the manifest (encoded layers decoded); a
        ShardError names the shard, the layer and the sample where its shard fails a check."""
        opened = self._open(entry.shard)
        try:
            start, stop = opened.mapped.place(entry.id, entry.offset, entry.num_tokens)
            return {key: self._rows(opened, key, start, stop, entry) for key in keys}
        except ShardError as exc:
            raise exc.at(sample=entry.id) from None

    def _rows(self, opened: _OpenShard, key: str, start: int, stop: int, entry: ManifestSample) -> torch.Tensor:
        if opened.mapped.decodes(key):
            return _decoded(opened.mapped, key, start, stop)
        t = self.handle(entry.shard).get_slice(key)[start:stop]
        if t.shape[0] != stop - start:
            raise ValueError(f"{entry.shard}: {key} ends before sample {entry.id!r} does")
        return t

    def forget(self, shard: str) -> None:
        """Close one shard (its file is about to go)."""
        if self._pid == os.getpid():
            self._handles.pop(shard, None)

    def close(self) -> None:
        self._handles.clear()


def _decoded(shard: MappedShard, key: str, start: int, stop: int) -> torch.Tensor:
    """An encoded layer's rows start..stop as a tensor of the job's dtype [rows, hidden]."""
    layout = shard.layout(key)
    rows = shard.rows(key, start, stop)
    return torch.from_numpy(rows).view(DTYPES_BY_CODE[layout.dtype].torch).reshape(stop - start, *layout.shape[1:])
