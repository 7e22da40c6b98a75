"""`hsx export deepspec`: DeepSpec's target cache (version 2) read back as its CacheDataset reads it, its
manifest held to the checks its loader makes, and every tensor compared with hsx's Dataset.

DeepSpec is not a package on PyPI, so its reader cannot be installed here: `read_target_cache` reads the
files by the format its `deepspec/data/target_cache_dataset.py` defines (the little-endian `<QIIQQQQQ`
index record, the five tensors' dtypes and shapes at the record's offsets) and applies the checks of its
`validate_target_cache_manifest`."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from hsx.exports import export_job
from hsx.exports.base import ExportRefused
from hsx.training.dataset import HiddenStateDataset
from tests.support.jobs import make_job

RECORD = struct.Struct("<QIIQQQQQ")
REQUIRED = {
    "version",
    "num_samples",
    "num_shards",
    "target_layer_ids",
    "hidden_dtype",
    "token_dtype",
    "mask_dtype",
    "index_record_size",
    "hidden_size",
    "shards",
}


def validate(cache: Path, manifest: dict) -> None:
    """What DeepSpec's loader asserts of a target cache before it reads a sample."""
    assert not REQUIRED - set(manifest), sorted(REQUIRED - set(manifest))
    assert manifest["version"] == 2 and manifest["hidden_dtype"] in ("bfloat16", "float8_e4m3fn", "float8_e5m2")
    assert manifest["token_dtype"] == "int32" and manifest["mask_dtype"] == "uint8"
    assert manifest["index_record_size"] == RECORD.size == 56 and manifest["hidden_size"] > 0
    ids = [int(i) for i in manifest["target_layer_ids"]]
    assert ids and ids == sorted(ids)
    assert manifest["num_shards"] == len(manifest["shards"])
    for k, shard in enumerate(manifest["shards"]):
        assert shard["shard_id"] == k and (cache / shard["file_name"]).exists()
    size = (cache / "samples.idx").stat().st_size
    assert size % RECORD.size == 0 and size == manifest["num_samples"] * RECORD.size


def read_target_cache(cache: Path) -> tuple[dict, list[dict[str, torch.Tensor]]]:
    manifest = json.loads((cache / "manifest.json").read_text())
    validate(cache, manifest)
    hidden, n = manifest["hidden_size"], len(manifest["target_layer_ids"])
    index = (cache / "samples.idx").read_bytes()
    shards = {s["shard_id"]: (cache / s["file_name"]).read_bytes() for s in manifest["shards"]}
    items = []
    for k in range(manifest["num_samples"]):
        sample_id, shard_id, t, ids_at, attention_at, loss_at, taps_at, last_at = RECORD.unpack_from(index, k * 56)
        assert sample_id == k and t > 0
        data = shards[shard_id]

        def read(at: int, dtype: str, count: int, data: bytes = data) -> np.ndarray:
            assert at + count * np.dtype(dtype).itemsize <= len(data), "a tensor beyond its shard"
            return np.frombuffer(data, dtype=dtype, count=count, offset=at).copy()

        items.append(
            {
                "input_ids": torch.from_numpy(read(ids_at, "<i4", t)),
                "attention_mask": torch.from_numpy(read(attention_at, "u1", t)),
                "loss_mask": torch.from_numpy(read(loss_at, "u1", t)),
                "target_hidden_states": torch.from_numpy(read(taps_at, "<u2", t * n * hidden))
                .view(torch.bfloat16)
                .view(t, n * hidden),
                "target_last_hidden_states": torch.from_numpy(read(last_at, "<u2", t * hidden))
                .view(torch.bfloat16)
                .view(t, hidden),
            }
        )
    return manifest, items


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("encoding", ["raw", "lossless", "fp8"])
def test_a_deepspec_export_is_the_jobs_dflash_set(tmp_path, dtype, encoding):
    """A job of eagle3 and dflash on an 8-layer model, in every encoding: DeepSpec's reader gets dflash's taps
    [2, 3, 4, 5, 6] (its target_layer_ids [1, 2, 3, 4, 5]) and L, each tensor what hsx's Dataset reads
    (bfloat16: float32 jobs rounded to nearest, as .to(torch.bfloat16))."""
    job = make_job(
        tmp_path,
        layers=[2, 3, 4, 5, 6, 8],
        dtype=dtype,
        encoding=encoding,
        model={"model_type": "llama", "model_path": "/models/tiny"},
        post_norm_layers=[8],
        num_samples=7,
        samples_per_shard=3,
    )
    result = export_job("deepspec", job.job_dir, tmp_path / "ds", workers=2)
    assert result.written == 3 and set(result.extra_files) == {"samples.idx", "manifest.json", "hsx_samples.jsonl"}
    manifest, items = read_target_cache(tmp_path / "ds")
    assert manifest["target_layer_ids"] == [1, 2, 3, 4, 5] and manifest["num_shards"] == 3
    assert manifest["target_model_name_or_path"] == "/models/tiny" and manifest["hidden_size"] == 16
    order = [json.loads(line)["id"] for line in (tmp_path / "ds" / "hsx_samples.jsonl").read_text().splitlines()]
    ds = HiddenStateDataset(job.job_dir, layer_set="dflash")
    for item, sample_id in zip(items, order, strict=True):
        want = ds[ds.sample_ids.index(sample_id)]
        assert torch.equal(item["input_ids"], want["input_ids"].to(torch.int32))
        assert torch.equal(item["loss_mask"], want["loss_mask"].to(torch.uint8))
        assert bool((item["attention_mask"] == 1).all())
        assert torch.equal(item["target_hidden_states"], want["aux_hidden_state"].to(torch.bfloat16))
        assert torch.equal(item["target_last_hidden_states"], want["hidden_state"].to(torch.bfloat16))
    again = export_job("deepspec", job.job_dir, tmp_path / "ds")
    assert (again.written, again.skipped) == (0, 3), "a rerun skips the shards already complete"


def test_the_taps_can_be_another_set_and_the_target_model_named(tmp_path):
    job = make_job(tmp_path, layers=[2, 4, 5, 8], model={"model_type": "llama"}, post_norm_layers=[8])
    export_job("deepspec", job.job_dir, tmp_path / "ds", layer_set="eagle3", target_model="Qwen/Qwen3-8B")
    manifest, items = read_target_cache(tmp_path / "ds")
    assert manifest["target_layer_ids"] == [1, 3, 4] and manifest["target_model_name_or_path"] == "Qwen/Qwen3-8B"
    assert items[0]["target_hidden_states"].shape == (job.samples[0].input_ids.shape[0], 3 * 16)


def test_a_set_the_job_did_not_capture_is_refused_and_nothing_written(tmp_path):
    eagle3_only = make_job(tmp_path, layers=[2, 4, 5, 8], model={"model_type": "llama"}, post_norm_layers=[8])
    with pytest.raises(ExportRefused, match=r"deepspec: the job did not capture layer set dflash: its layers"):
        export_job("deepspec", eagle3_only.job_dir, tmp_path / "ds")
    pre = make_job(tmp_path / "pre", layers=[2, 3, 4, 5, 6, 8], post_norm_layers=[], model={"model_type": "llama"})
    with pytest.raises(ExportRefused, match="did not capture layer set dflash"):
        export_job("deepspec", pre.job_dir, tmp_path / "ds")
    assert not (tmp_path / "ds").exists()
