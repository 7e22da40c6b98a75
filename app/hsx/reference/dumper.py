"""Write one dump directory per forward request, as dump protocol v1 specifies (docs/engines.md, "The dump
directory")."""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from hsx.dtypes import DTYPES, HIDDEN_STATE_DTYPES
from hsx.reference.common import HiddenStates

if TYPE_CHECKING:  # synthetic mode's lazy tensors; the dumper never needs the module itself
    from hsx.reference.synthetic import RowGather

HIDDEN_STATES_FILE = "hidden_states.safetensors"
INPUT_IDS_FILE = "input_ids.safetensors"
META_FILE = "meta.json"
DONE_FILE = "done"


SAFETENSORS_DTYPES = {DTYPES[name].torch: DTYPES[name].code for name in HIDDEN_STATE_DTYPES}
IOV_MAX = 1024  # Linux's limit on the buffers of one writev


def input_ids_sha256(input_ids: Sequence[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(input_ids)}q", *input_ids)).hexdigest()


def _tensor_buffers(t: torch.Tensor) -> list[memoryview]:
    t = t.detach().contiguous()
    return [t.reshape(-1).view(torch.uint8).numpy().data] if t.numel() else []


def _write_all(fd: int, buffers: list[memoryview]) -> None:
    for start in range(0, len(buffers), IOV_MAX):
        chunk = buffers[start : start + IOV_MAX]
        written = os.writev(fd, chunk)
        if written == sum(len(b) for b in chunk):
            continue
        for b in chunk:  # a short write (rare on local files): finish buffer by buffer
            if written >= len(b):
                written -= len(b)
                continue
            rest = b[written:]
            written = 0
            while rest:
                rest = rest[os.write(fd, rest) :]


def save_streamed(tensors: Mapping[str, torch.Tensor | RowGather], path: Path) -> None:
    """Write a safetensors file from values that are tensors or lazy tensors with shape, dtype and
    buffers() (their bytes, row-major), without first building the data in memory."""
    header: dict[str, object] = {}
    buffers: list[memoryview] = []
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: cannot stream dtype {t.dtype}")
        nbytes = math.prod(t.shape) * t.dtype.itemsize
        header[name] = {
            "dtype": SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
        buffers.extend(_tensor_buffers(t) if isinstance(t, torch.Tensor) else t.buffers())
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - (8 + len(raw)) % 8) % 8)  # the data starts 8-byte aligned, as save_file does
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, [memoryview(struct.pack("<Q", len(raw)) + raw), *buffers])
    finally:
        os.close(fd)


class Dumper:
    """Writes `<root>/req_<key>/`, one method per step so fault injection can override a single step."""

    def __init__(self, root: Path, *, boot_id: str, dtype_name: str, hidden_size: int, anonymous: bool = False):
        self.root = Path(root)
        self.boot_id = boot_id
        self.dtype_name = dtype_name
        self.hidden_size = hidden_size
        # Like older patched servers: no input ids and no rid, so a dump says only how many tokens it holds.
        self.anonymous = anonymous

    def dir_for(self, key: str) -> Path:
        return self.root / f"req_{key}"

    def write(
        self,
        key: str,
        *,
        rid: str,
        counter: int,
        input_ids: Sequence[int],
        hidden_states: HiddenStates,
        cached_tokens: int = 0,
        done: bool = True,
    ) -> Path:
        """Write every file, then `done` (unless done=False: the caller creates it later, or never)."""
        directory = self.prepare_dir(key)
        self.write_hidden_states(directory, hidden_states)
        if not self.anonymous:
            self.write_input_ids(directory, input_ids)
        self.write_meta(directory, self.build_meta(rid, counter, input_ids, sorted(hidden_states), cached_tokens))
        if done:
            self.mark_done(directory)
        return directory

    def prepare_dir(self, key: str) -> Path:
        directory = self.dir_for(key)
        if directory.exists():
            # A leftover from an earlier process or a reused rid: drop `done` first so no reader
            # takes the half-deleted directory for a complete one.
            (directory / DONE_FILE).unlink(missing_ok=True)
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
        return directory

    def write_hidden_states(self, directory: Path, hidden_states: HiddenStates) -> None:
        tensors = {f"layer_{i}": t.contiguous() for i, t in hidden_states.items() if isinstance(t, torch.Tensor)}
        if len(tensors) == len(hidden_states):
            save_file(tensors, str(directory / HIDDEN_STATES_FILE))
        else:  # synthetic mode's lazy row gathers
            save_streamed(
                {f"layer_{i}": hidden_states[i] for i in sorted(hidden_states)}, directory / HIDDEN_STATES_FILE
            )

    def write_input_ids(self, directory: Path, input_ids: Sequence[int]) -> None:
        save_file({"input_ids": torch.tensor(list(input_ids), dtype=torch.int64)}, str(directory / INPUT_IDS_FILE))

    def build_meta(
        self, rid: str, counter: int, input_ids: Sequence[int], layers: list[int], cached_tokens: int = 0
    ) -> dict[str, Any]:
        meta = {
            "num_tokens": len(input_ids),
            "layers": layers,
            "hidden_size": self.hidden_size,
            "dtype": self.dtype_name,
            "rid": rid,
            "counter": counter,
            "boot_id": self.boot_id,
            "cached_tokens": cached_tokens,
            "input_ids_sha256": input_ids_sha256(input_ids),
        }
        if self.anonymous:
            del meta["rid"], meta["input_ids_sha256"]
        return meta

    def write_meta(self, directory: Path, meta: dict[str, Any]) -> None:
        (directory / META_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")

    def mark_done(self, directory: Path) -> None:
        (directory / DONE_FILE).touch()
