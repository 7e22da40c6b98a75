"""A job's samples read straight from its shards: one sample's rows at a time, never a shard whole.

`load_job` reads manifest.json (given a job folder or the manifest's own path); `ShardReader`
slices sample rows out of the shards with safetensors' memory-mapped `get_slice`, keeping a few
opened shards in a small cache. The cache belongs to one process: after a fork (DataLoader
workers) or a pickle (spawned workers) it starts empty, so no worker shares another's handles.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from hsx.storage.manifest import MANIFEST_FORMAT, MANIFEST_NAME
from safetensors import safe_open

TORCH_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}


def layer_key(layer: int) -> str:
    return f"layer_{layer}"


def resolve_source(source: str | os.PathLike) -> tuple[Path, Path]:
    """(job folder, manifest path) for a job folder or the path of its manifest.json."""
    path = Path(source)
    if path.is_dir():
        return path, path / MANIFEST_NAME
    return path.parent, path


@dataclass
class Job:
    """A finished (or partly finished) job as its manifest describes it."""

    job_dir: Path
    manifest_path: Path
    manifest: dict

    @property
    def job_id(self) -> str:
        return str(self.manifest.get("job_id") or self.job_dir.name)

    @property
    def layers(self) -> list[int]:
        return [int(i) for i in self.manifest["layers"]]

    @property
    def hidden_size(self) -> int:
        return int(self.manifest["hidden_size"])

    @property
    def dtype_name(self) -> str:
        return str(self.manifest["dtype"])

    @property
    def samples(self) -> list[dict]:
        return self.manifest["samples"]

    @property
    def num_hidden_layers(self) -> int | None:
        value = (self.manifest.get("model") or {}).get("num_hidden_layers")
        return int(value) if value is not None else None


def load_job(source: str | os.PathLike) -> Job:
    """Read and sanity-check a job's manifest; ValueError says what is wrong with it."""
    job_dir, manifest_path = resolve_source(source)
    if not manifest_path.is_file():
        raise ValueError(f"{manifest_path}: no manifest.json (is the job finished?)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{manifest_path}: unreadable manifest ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{manifest_path}: not an {MANIFEST_FORMAT} manifest")
    missing = [k for k in ("layers", "hidden_size", "dtype", "shards", "samples") if manifest.get(k) is None]
    if missing:
        raise ValueError(f"{manifest_path}: manifest lacks {', '.join(missing)}")
    if manifest["dtype"] not in TORCH_DTYPES:
        raise ValueError(f"{manifest_path}: unsupported hidden-state dtype {manifest['dtype']!r}")
    return Job(job_dir, manifest_path, manifest)


class ShardReader:
    """Slices sample rows out of a job's shards through a small per-process cache of open shards."""

    def __init__(self, job_dir: Path, max_open: int = 8):
        if max_open < 1:
            raise ValueError("max_open must be at least 1")
        self.job_dir = Path(job_dir)
        self.max_open = max_open
        self._pid = os.getpid()
        self._handles: OrderedDict[str, object] = OrderedDict()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_handles"] = OrderedDict()
        state["_pid"] = None
        return state

    def open_shards(self) -> list[str]:
        """The shards this process holds open now (oldest first)."""
        return list(self._handles) if self._pid == os.getpid() else []

    def handle(self, shard: str):
        if self._pid != os.getpid():  # a forked worker: the parent's handles are not ours
            self._handles = OrderedDict()
            self._pid = os.getpid()
        f = self._handles.get(shard)
        if f is None:
            try:
                f = safe_open(str(self.job_dir / shard), framework="pt")
            except Exception as exc:  # safetensors raises its own error type for a damaged file
                raise ValueError(f"{self.job_dir / shard}: unreadable shard ({exc}); run hsx verify") from exc
            self._handles[shard] = f
            while len(self._handles) > self.max_open:
                self._handles.popitem(last=False)
        else:
            self._handles.move_to_end(shard)
        return f

    def rows(self, shard: str, key: str, start: int, stop: int) -> torch.Tensor:
        return self.handle(shard).get_slice(key)[start:stop]

    def sample(self, entry: dict, keys: list[str]) -> dict[str, torch.Tensor]:
        """The rows of `keys` that belong to one manifest sample entry."""
        start = int(entry["offset"])
        stop = start + int(entry["num_tokens"])
        f = self.handle(entry["shard"])
        out = {}
        for key in keys:
            t = f.get_slice(key)[start:stop]
            if t.shape[0] != stop - start:
                raise ValueError(f"{entry['shard']}: {key} ends before sample {entry['id']!r} does")
            out[key] = t
        return out

    def close(self) -> None:
        self._handles.clear()
