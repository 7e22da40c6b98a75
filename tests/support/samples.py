"""Samples sent to a live service, and the check that each was stored exactly once with its own tensors."""

from __future__ import annotations

import hashlib
import random

import torch
from safetensors import safe_open

from hsx.manifest import Manifest, load_manifest, read_sample
from hsx.states import JobState
from tests.support.stack import NUM_LAYERS, VOCAB

DEFAULT_LAYERS = [2, NUM_LAYERS // 2, NUM_LAYERS - 3, NUM_LAYERS]


def make_samples(n: int, seed: int, lo: int = 3, hi: int = 90) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.randint(lo, hi)
        sample = {"id": f"sample-{seed}-{i}", "input_ids": [rng.randrange(VOCAB) for _ in range(length)]}
        if i % 2:
            sample["loss_mask"] = [rng.randint(0, 1) for _ in range(length)]
        out.append(sample)
    return out


def assert_stored_exactly(
    service, job: dict, samples: list[dict], recompute, layers: list[int] | None = None
) -> Manifest:
    """Every sample stored once, in a shard whose sha256 matches, with exactly its own tensors."""
    assert job["state"] == JobState.SUCCEEDED, job
    assert job["counts"]["succeeded"] == len(samples)
    assert job["tokens"]["done"] == job["tokens"]["total"] == sum(len(s["input_ids"]) for s in samples)
    job_dir = service.output_root / job["id"]
    manifest = load_manifest(job_dir)
    assert manifest.model_dump(mode="json") == service.get(f"/v1/jobs/{job['id']}/manifest").json()
    assert manifest.layers == (layers or DEFAULT_LAYERS) and manifest.dtype == "bfloat16"
    for shard in manifest.shards:
        data = (job_dir / shard.name).read_bytes()
        assert len(data) == shard.bytes
        assert hashlib.sha256(data).hexdigest() == shard.sha256
        with safe_open(str(job_dir / shard.name), framework="pt") as f:
            assert f.get_slice("input_ids").get_shape() == [shard.num_tokens]
    assert [s.id for s in manifest.samples] == [s["id"] for s in samples]
    for sample in samples:
        stored = read_sample(job_dir, manifest, sample["id"])
        ids = sample["input_ids"]
        assert stored["input_ids"].tolist() == ids
        assert stored["loss_mask"].tolist() == sample.get("loss_mask", [1] * len(ids))
        truth = recompute(ids)
        for layer in manifest.layers or []:
            got = stored[f"layer_{layer}"]
            assert got.dtype == truth[layer].dtype
            assert torch.equal(got, truth[layer]), f"{sample['id']} layer {layer} differs"
    return manifest
