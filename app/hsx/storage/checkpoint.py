"""One tensor of a model checkpoint, read from its safetensors files and nothing else of them.

A transformers checkpoint folder holds its weights in `model.safetensors`, or sharded, with
`model.safetensors.index.json` mapping each tensor's name to its file. Only the one file that holds the
tensor is opened, only its header and that tensor's bytes are read (a few KB of a checkpoint of many GB),
and no tensor library is needed: the bytes come back as the checkpoint stores them, with their dtype
code and shape.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hsx.storage.safetensors_raw import SafetensorsFormatError, read_index

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
# Where architectures keep the final norm's weight: decoder-only models under model., multimodal ones
# under their language model.
NORM_KEYS = (
    "model.norm.weight",
    "model.language_model.norm.weight",
    "language_model.model.norm.weight",
    "model.model.norm.weight",
    "norm.weight",
)


class CheckpointUnreadable(Exception):
    """The checkpoint does not give the tensor; the message says what is missing or unreadable, and where."""


@dataclass(frozen=True)
class CheckpointTensor:
    """A tensor as the checkpoint stores it: its file, name, safetensors dtype code, shape and bytes."""

    file: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def read_tensor(folder: str | Path, names: Sequence[str] = NORM_KEYS) -> CheckpointTensor:
    """The first of `names` that the checkpoint in `folder` holds; CheckpointUnreadable otherwise."""
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointUnreadable(f"{index} is unreadable: {exc}") from exc
        found = [(name, folder / weight_map[name]) for name in names if name in weight_map]
        if not found:
            raise CheckpointUnreadable(f"{index} maps none of {', '.join(names)}")
        name, file = found[0]
        return _read(file, [name])
    single = folder / SINGLE_NAME
    if not single.is_file():
        raise CheckpointUnreadable(f"{folder} has neither {SINGLE_NAME} nor {INDEX_NAME} readable here")
    return _read(single, names)


def _read(file: Path, names: Sequence[str]) -> CheckpointTensor:
    try:
        spans = read_index(file)
    except (OSError, SafetensorsFormatError) as exc:
        raise CheckpointUnreadable(f"{file} is unreadable: {exc}") from exc
    name = next((n for n in names if n in spans), None)
    if name is None:
        raise CheckpointUnreadable(f"{file} holds none of {', '.join(names)}")
    span = spans[name]
    try:
        data = span.read()
    except OSError as exc:
        raise CheckpointUnreadable(f"{file} is unreadable: {exc}") from exc
    return CheckpointTensor(file, name, span.dtype, tuple(span.shape), data)
