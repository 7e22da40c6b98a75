"""The files of the dump protocol, v1: one `req_<rid>/` per request, and `hsx-plugin.json` in the root.

A dump is written into a temporary directory and renamed into place with `done` already in it,
so a reader sees either nothing or a complete dump.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import numpy as np
import torch
from safetensors.torch import save_file

HIDDEN_STATES_FILE = "hidden_states.safetensors"
INPUT_IDS_FILE = "input_ids.safetensors"
META_FILE = "meta.json"
DONE_FILE = "done"
PLUGIN_INFO_FILE = "hsx-plugin.json"
TEMP_PREFIX = ".hsx-tmp-"  # never `req_`: readers and clearers of the root only look at req_*

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class DumpMeta(TypedDict):
    """A dump's `meta.json`."""

    num_tokens: int
    layers: list[int]
    hidden_size: int
    dtype: str
    rid: str
    boot_id: str
    cached_tokens: int
    input_ids_sha256: str


class PluginInfo(TypedDict):
    """`hsx-plugin.json`: what the service needs to know about this server's dumps (README.md)."""

    format: str
    plugin: str
    plugin_version: str
    sglang_version: str
    protocol: int
    dump_root: str
    name_by: str
    rid_prefix: str
    layers: list[int]
    hidden_size: int
    dtype: str
    boot_id: str


def input_ids_sha256(ids: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(ids, dtype="<i8").tobytes()).hexdigest()


@dataclass(frozen=True)
class HostDump:
    """One request's dump, in host memory."""

    rid: str
    layers: dict[int, torch.Tensor]  # each [num_tokens, hidden_size], contiguous, on the CPU
    prompt_ids: np.ndarray  # int64, the whole prompt
    cached_tokens: int  # prompt tokens the prefix cache served: the rows cover prompt_ids[cached_tokens:]

    def meta(self, boot_id: str) -> DumpMeta:
        first = next(iter(self.layers.values()))
        return {
            "num_tokens": int(first.shape[0]),
            "layers": sorted(self.layers),
            "hidden_size": int(first.shape[1]),
            "dtype": DTYPE_NAMES[first.dtype],
            "rid": self.rid,
            "boot_id": boot_id,
            "cached_tokens": self.cached_tokens,
            "input_ids_sha256": input_ids_sha256(self.prompt_ids),
        }


class DumpDirWriter:
    def __init__(self, root: Path, boot_id: str):
        self.root = Path(root)
        self.boot_id = boot_id

    def dir_for(self, rid: str) -> Path:
        return self.root / f"req_{rid}"

    def write(self, dump: HostDump) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        temp = self.root / f"{TEMP_PREFIX}{self.boot_id}-{uuid.uuid4().hex[:8]}"
        temp.mkdir()
        try:
            save_file({f"layer_{i}": t for i, t in sorted(dump.layers.items())}, str(temp / HIDDEN_STATES_FILE))
            covered = np.ascontiguousarray(dump.prompt_ids[dump.cached_tokens :], dtype=np.int64)
            save_file({"input_ids": torch.from_numpy(covered)}, str(temp / INPUT_IDS_FILE))
            (temp / META_FILE).write_text(json.dumps(dump.meta(self.boot_id), indent=1), encoding="utf-8")
            (temp / DONE_FILE).touch()
            return self._move_into_place(temp, self.dir_for(dump.rid))
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise

    def _move_into_place(self, temp: Path, final: Path) -> Path:
        try:
            os.rename(temp, final)
        except OSError:
            if not final.exists():
                raise
            # A dump of the same rid from before (a reused rid): drop its `done` first so no
            # reader takes the half-deleted directory for a complete one.
            (final / DONE_FILE).unlink(missing_ok=True)
            shutil.rmtree(final)
            os.rename(temp, final)
        return final

    def remove_stale_temp_dirs(self) -> None:
        """Temporary directories that earlier server launches left behind when they died mid-write."""
        if not self.root.is_dir():
            return
        for p in self.root.glob(f"{TEMP_PREFIX}*"):
            if not p.name.startswith(f"{TEMP_PREFIX}{self.boot_id}-") and p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)

    def write_plugin_info(self, info: PluginInfo) -> Path:
        """Replace `hsx-plugin.json` atomically (several scheduler processes may write the same content)."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / PLUGIN_INFO_FILE
        temp = self.root / f"{TEMP_PREFIX}{PLUGIN_INFO_FILE}-{uuid.uuid4().hex[:8]}"
        temp.write_text(json.dumps(info, indent=1), encoding="utf-8")
        os.replace(temp, path)
        return path

    def remove_plugin_info(self) -> None:
        (self.root / PLUGIN_INFO_FILE).unlink(missing_ok=True)
