"""manifest.json: everything a tool needs to find and read a job's samples without hsx."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

if TYPE_CHECKING:  # torch is only needed by the caller of read_rows, not to import this module
    import torch

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "hsx-manifest/1"


def read_rows(shard: Path, offset: int, num_tokens: int, layers: list[int]) -> dict[str, torch.Tensor]:
    """One sample's rows of every tensor in a shard (the shard is never loaded whole)."""
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(shard), framework="pt") as f:
        for key in ["input_ids", "loss_mask"] + [f"layer_{i}" for i in layers]:
            out[key] = f.get_slice(key)[offset : offset + num_tokens]
    return out


def read_sample(job_dir: Path, manifest: dict, sample_id: str) -> dict[str, torch.Tensor]:
    """Load one sample's tensors by the manifest's placement."""
    entry = next((s for s in manifest["samples"] if s["id"] == sample_id), None)
    if entry is None:
        raise KeyError(sample_id)
    return read_rows(Path(job_dir) / entry["shard"], entry["offset"], entry["num_tokens"], manifest["layers"])


def load_manifest(job_dir: Path) -> dict:
    return json.loads((Path(job_dir) / MANIFEST_NAME).read_text())
