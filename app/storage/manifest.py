"""manifest.json: everything a tool needs to find and read a job's samples without hsx."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "hsx-manifest/1"


def read_sample(job_dir: Path, manifest: dict, sample_id: str) -> dict[str, torch.Tensor]:
    """Load one sample's tensors by slicing its shard (the shard is never loaded whole)."""
    entry = next((s for s in manifest["samples"] if s["id"] == sample_id), None)
    if entry is None:
        raise KeyError(sample_id)
    start, stop = entry["offset"], entry["offset"] + entry["num_tokens"]
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(Path(job_dir) / entry["shard"]), framework="pt") as f:
        for key in ["input_ids", "loss_mask"] + [f"layer_{i}" for i in manifest["layers"]]:
            out[key] = f.get_slice(key)[start:stop]
    return out


def load_manifest(job_dir: Path) -> dict:
    return json.loads((Path(job_dir) / MANIFEST_NAME).read_text())
