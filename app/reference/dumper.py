"""Write one dump directory per forward request, as /work/shared/dump-protocol.md (v1) specifies."""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN_STATES_FILE = "hidden_states.safetensors"
INPUT_IDS_FILE = "input_ids.safetensors"
META_FILE = "meta.json"
DONE_FILE = "done"


def input_ids_sha256(input_ids: Sequence[int]) -> str:
    return hashlib.sha256(struct.pack(f"<{len(input_ids)}q", *input_ids)).hexdigest()


class DumpWriter:
    """Writes `<root>/req_<key>/`, one method per step so fault injection can override a single step."""

    def __init__(self, root: Path, *, boot_id: str, dtype_name: str, hidden_size: int):
        self.root = Path(root)
        self.boot_id = boot_id
        self.dtype_name = dtype_name
        self.hidden_size = hidden_size

    def dir_for(self, key: str) -> Path:
        return self.root / f"req_{key}"

    def write(
        self,
        key: str,
        *,
        rid: str,
        counter: int,
        input_ids: Sequence[int],
        hidden_states: dict[int, torch.Tensor],
    ) -> Path:
        directory = self.prepare_dir(key)
        self.write_hidden_states(directory, hidden_states)
        self.write_input_ids(directory, input_ids)
        self.write_meta(directory, self.build_meta(rid, counter, input_ids, sorted(hidden_states)))
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

    def write_hidden_states(self, directory: Path, hidden_states: dict[int, torch.Tensor]) -> None:
        tensors = {f"layer_{i}": t.contiguous() for i, t in hidden_states.items()}
        save_file(tensors, str(directory / HIDDEN_STATES_FILE))

    def write_input_ids(self, directory: Path, input_ids: Sequence[int]) -> None:
        save_file({"input_ids": torch.tensor(list(input_ids), dtype=torch.int64)}, str(directory / INPUT_IDS_FILE))

    def build_meta(self, rid: str, counter: int, input_ids: Sequence[int], layers: list[int]) -> dict:
        return {
            "num_tokens": len(input_ids),
            "layers": layers,
            "hidden_size": self.hidden_size,
            "dtype": self.dtype_name,
            "rid": rid,
            "counter": counter,
            "boot_id": self.boot_id,
            "cached_tokens": 0,
            "input_ids_sha256": input_ids_sha256(input_ids),
        }

    def write_meta(self, directory: Path, meta: dict) -> None:
        (directory / META_FILE).write_text(json.dumps(meta, indent=1), encoding="utf-8")

    def mark_done(self, directory: Path) -> None:
        (directory / DONE_FILE).touch()
