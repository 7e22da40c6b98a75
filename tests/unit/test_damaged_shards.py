"""Shards that fail a check, written by hsx's own shard writer and then edited on disk, read by the Dataset,
the exports (and `hsx export`) and verify: a lossless block that claims millions of rows, a byte changed
inside a zstd frame, an fp8 scale or code no writer makes, a manifest that moves a sample or misstates its
per-layer stats. Every reader refuses with a ShardError naming the shard, the layer and the sample, in
memory bounded by what it was asked for; verify fails them. Frames from before frames carried a checksum
still read, and verify says so as a warning. (The service's tensor route and shard downloads:
tests/integration/test_damaged_shards_api.py.)"""

from __future__ import annotations

import json
import math
import re
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import zstandard

from hsx.cli import main as hsx
from hsx.exports import export_job
from hsx.manifest import EncodedLayer
from hsx.storage import planes
from hsx.storage.encoding import base
from hsx.storage.errors import ShardError
from hsx.storage.mapped import MappedShard
from hsx.training import HiddenStateDataset
from hsx.verify import verify_job
from tests.support.damage import Shard, crafted_block, flip_byte, set_scale, sha256
from tests.support.jobs import JobFixture, make_job

LAYERS = [2, 4, 5, 8]
HIDDEN = 64  # bfloat16 rows of 128 bytes: 4M of them would decode to 512 MiB
CLAIM = 4 * 2**20
BOUND = 50 * 2**20  # what any refused read may take at its peak


def job_of(tmp_path: Path, encoding: str) -> JobFixture:
    """s-0 (40 rows) and s-1 (50) in shard 0, s-2 (30) in shard 1."""
    return make_job(
        tmp_path,
        layers=LAYERS,
        hidden=HIDDEN,
        encoding=encoding,
        num_samples=3,
        lengths=[40, 50, 30],
        samples_per_shard=2,
    )


def rehash(job: JobFixture, name: str) -> None:
    """The manifest records the edited shard's size and sha256: only the contents are wrong."""
    path = job.job_dir / name
    job.manifest.shard(name).sha256 = sha256(path)
    job.manifest.shard(name).bytes = path.stat().st_size
    job.rewrite_manifest()


def refused(read: Callable[[], object]) -> tuple[ShardError, int]:
    """The ShardError `read` raises, and the most memory it took meanwhile."""
    tracemalloc.start()
    try:
        with pytest.raises(ShardError) as error:
            read()
        return error.value, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def exported(job: JobFixture, out: Path) -> ShardError:
    """An export's refusal: the error, and a record that does not say the export is complete."""
    error, peak = refused(lambda: export_job("specforge", job.job_dir, out))
    assert peak < BOUND, f"the export took {peak / 2**20:.0f} MiB"
    assert json.loads((out / "hsx-export.json").read_text())["complete"] is False
    return error


def item(job: JobFixture, sample_id: str) -> dict:
    ds = HiddenStateDataset(job.job_dir)
    return ds[ds.sample_ids.index(sample_id)]


# --- a lossless block that claims more than its shard ---------------------------------------------------


@pytest.mark.parametrize(
    ("craft", "problem"),
    [
        # the file: one block of 4M rows, two frames of zeros, in a shard of 90 rows
        ("beyond_rows", r"layer_5\.rows covers rows 0\.\.4194304, the shard holds 90"),
        # a block within the shard's rows but longer than any block the writer makes (8 rows here)
        ("over_block", r"declares block 0 of 90 rows; a block holds 1 to 8 rows of 128 bytes"),
        # a sound index whose frames declare 4M rows of their plane
        ("over_frame", r"block 0 \(rows 0\.\.90\): byte plane 0 declares 268435456 bytes, expected 5760"),
    ],
)
def test_a_crafted_lossless_block_is_refused_in_bounded_memory(tmp_path, monkeypatch, capsys, craft, problem):
    if craft == "over_block":
        monkeypatch.setattr(base, "BLOCK_BYTES", 1024)  # written, and read, in blocks of at most 8 rows
    job = job_of(tmp_path, "lossless")
    path = job.job_dir / job.manifest.sample("s-1").shard
    shard = Shard(path)
    if craft == "beyond_rows":
        crafted_block(shard, "layer_5", CLAIM, HIDDEN, 2)
    else:
        crafted_block(shard, "layer_5", 90, HIDDEN, 2, declared_rows=CLAIM if craft == "over_frame" else None)
    shard.save()
    assert path.stat().st_size < 200_000, "a small file"
    rehash(job, path.name)

    error, peak = refused(lambda: item(job, "s-1"))
    assert peak < BOUND, f"the Dataset took {peak / 2**20:.0f} MiB"
    assert (error.shard, error.layer, error.sample) == (str(path), "layer_5", "s-1")
    assert str(error).startswith(f"{path}, layer_5, sample 's-1': ")
    assert re.search(problem, error.problem), error.problem

    error = exported(job, tmp_path / "specforge")
    assert (error.shard, error.layer, error.sample) == (str(path), "layer_5", "s-0"), "the shard's first sample"
    assert hsx(["export", "specforge", str(job.job_dir), str(tmp_path / "again"), "-q"]) == 1
    assert f"{path}, layer_5, sample 's-0': " in capsys.readouterr().err

    tracemalloc.start()
    report = verify_job(job.job_dir)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < BOUND, f"verify took {peak / 2**20:.0f} MiB"
    faults = report.shard_faults + report.sample_faults
    assert not report.ok and [f.shard for f in faults] == [path.name] * len(faults)
    assert any(f.message.startswith("layer_5: ") and re.search(problem, f.message) for f in faults)


# --- a byte changed inside a frame, and frames without a checksum ---------------------------------------


def test_a_byte_changed_inside_a_frame_fails_its_checksum_in_every_reader(tmp_path):
    job = job_of(tmp_path, "lossless")
    path = job.job_dir / job.manifest.sample("s-2").shard
    start, end = Shard(path).frame("layer_8", 0, 0)  # the low bytes: literals, where a change decodes
    flip_byte(path, (start + end) // 2)
    rehash(job, path.name)
    error, _ = refused(lambda: item(job, "s-2"))
    assert (error.shard, error.layer, error.sample) == (str(path), "layer_8", "s-2")
    assert "block 0 (rows 0..30): byte plane 0" in error.problem and "checksum" in error.problem
    assert "checksum" in exported(job, tmp_path / "out").problem
    report = verify_job(job.job_dir)
    assert report.summary["faults_by_kind"] == {"damaged": 1}
    fault = report.sample_faults[0]
    assert (fault.sample, fault.shard) == ("s-2", path.name) and "checksum" in fault.message


def test_frames_written_without_a_checksum_still_read_and_verify_says_so(tmp_path, monkeypatch):
    """Shards from before frames carried a checksum: the same frames, but for zstd's checksum flag."""
    bare = zstandard.ZstdCompressionParameters(**{**_parameters(), "write_checksum": 0})
    monkeypatch.setattr(planes, "PARAMETERS", bare)
    monkeypatch.setattr(planes, "_local", threading.local())  # compressors built from those parameters
    job = job_of(tmp_path, "lossless")
    monkeypatch.undo()
    shard = Shard(job.job_dir / job.manifest.shards[0].name)
    start, end = shard.frame("layer_2", 0, 1)
    assert not planes.has_checksum(np.frombuffer(shard.path.read_bytes()[start:end], dtype=np.uint8))
    for s, got in zip(job.samples, HiddenStateDataset(job.job_dir)):
        assert torch.equal(got["hidden_state"].view(torch.uint8), s.layers[8].view(torch.uint8))
    report = verify_job(job.job_dir)
    assert report.ok, report.to_dict()
    # 4 layers x 2 planes x one block per sample: 16 frames in shard 0, 8 in shard 1
    assert report.warnings == [
        "24 zstd frames without a checksum (written by an hsx from before frames carried one) in 2 shard(s): "
        "damage inside them is found by the shards' sha256 alone"
    ]


def _parameters() -> dict:
    p = planes.PARAMETERS
    names = ("window_log", "hash_log", "chain_log", "search_log", "min_match", "target_length", "strategy")
    return {name: getattr(p, name) for name in names}


def test_frames_are_written_with_their_checksum(tmp_path):
    job = job_of(tmp_path, "lossless")
    assert verify_job(job.job_dir).warnings == []
    shard = Shard(job.job_dir / job.manifest.shards[1].name)
    start, end = shard.frame("layer_4", 0, 0)
    header = zstandard.get_frame_parameters(shard.path.read_bytes()[start:end])
    assert header.has_checksum and header.content_size == 30 * HIDDEN


# --- fp8: scales and codes no writer makes --------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (math.inf, "row 41's scale is inf"),
        (-0.5, "row 41's scale is -0.5"),
        (math.nan, "row 41's scale is nan"),
        (-0.0, "row 41's scale is -0.0"),
        (3e38, "row 41's scale is 3"),  # finite, but 448 x it is not a bfloat16
        (0xFF, "row 41 holds a NaN code"),
        (0x7F, "row 41 holds a NaN code"),
    ],
)
def test_an_fp8_scale_or_code_no_writer_makes_is_refused(tmp_path, value, problem):
    job = job_of(tmp_path, "fp8")
    path = job.job_dir / job.manifest.sample("s-1").shard
    if isinstance(value, int):  # e4m3fn's two NaN codes
        flip = Shard(path)
        codes = flip.array("layer_4.fp8", np.uint8).reshape(-1, HIDDEN)
        codes[41, 7] = value
        flip.put("layer_4.fp8", codes, "F8_E4M3")
        flip.save()
    else:
        set_scale(path, "layer_4", 41, value)  # row 1 of s-1
    rehash(job, path.name)
    error, _ = refused(lambda: item(job, "s-1"))
    assert (error.shard, error.layer, error.sample) == (str(path), "layer_4", "s-1")
    assert error.problem.startswith(problem), error.problem
    with pytest.raises(ShardError, match=problem.replace(".", r"\.")):
        MappedShard(path).fp8_rows("layer_4", 40, 90)  # what speculators --fp8 carries, checked alike
    assert exported(job, tmp_path / "out").problem.startswith(problem)
    assert item(job, "s-0")["input_ids"].shape == (40,), "the other samples still read"
    report = verify_job(job.job_dir)
    assert report.summary["faults_by_kind"] == {"damaged": 1}
    assert report.sample_faults[0].sample == "s-1" and problem in report.sample_faults[0].message


# --- the manifest against the shards -------------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["raw", "lossless", "fp8"])
def test_a_manifest_that_moves_a_sample_is_refused(tmp_path, encoding):
    """Its offset edited to 0 would give s-0's rows as s-1's; the shard's own metadata says 40..90."""
    job = job_of(tmp_path, encoding)
    job.manifest.sample("s-1").offset = 0
    job.rewrite_manifest()
    path = job.job_dir / job.manifest.sample("s-1").shard
    error, _ = refused(lambda: item(job, "s-1"))
    assert (error.shard, error.sample) == (str(path), "s-1")
    assert error.problem == "recorded at rows 0..50, but the shard places it at 40..90"
    assert exported(job, tmp_path / "out").sample == "s-1"
    kinds = verify_job(job.job_dir).summary["faults_by_kind"]
    assert kinds["metadata_mismatch"] == 1


def test_a_shard_that_does_not_place_its_samples_is_refused(tmp_path):
    job = job_of(tmp_path, "raw")
    shard = Shard(job.job_dir / job.manifest.shards[1].name)
    del shard.metadata["offsets"]
    shard.save()
    rehash(job, shard.path.name)
    error, _ = refused(lambda: item(job, "s-2"))
    assert error.problem == "its __metadata__ does not place its samples (sample_ids, offsets)"
    report = verify_job(job.job_dir)
    assert report.summary["faults_by_kind"] == {"metadata_invalid": 1}


def edit_layer(field: str, value: object) -> Callable[[list[EncodedLayer]], None]:
    def edit(layers: list[EncodedLayer]) -> None:
        setattr(layers[1], field, value)

    return edit


@pytest.mark.parametrize(
    ("encoding", "edit", "problem"),
    [
        ("fp8", edit_layer("max_error", 99.0), "layer 4: max_error 99.0 is not an fp8 error: 0 to 1/28"),
        ("fp8", edit_layer("mean_error", -0.01), "layer 4: mean_error -0.01 is not an fp8 error"),
        ("fp8", edit_layer("raw_bytes", 1), "layer 4: raw_bytes is 1, its shards' 120 rows take 15360"),
        ("fp8", edit_layer("bytes", 1), "layer 4: bytes is 1, its shards' tensors hold 8160"),
        ("lossless", edit_layer("raw_bytes", 1), "layer 4: raw_bytes is 1, its shards' 120 rows take 15360"),
        ("lossless", edit_layer("bytes", 2), "layer 4: bytes is 2, its shards' tensors hold"),
        ("lossless", edit_layer("max_error", 0.01), "layer 4: records errors (max 0.01, mean None) for a lossless"),
        (
            "fp8",
            lambda layers: layers.append(EncodedLayer(layer=99, raw_bytes=1, bytes=1)),
            "encoded_layers names layer 99, which the job did not capture",
        ),
        ("fp8", lambda layers: layers.pop(), "encoded_layers lists layer 8 0 times, not once"),
    ],
)
def test_verify_checks_the_manifests_per_layer_stats(tmp_path, encoding, edit, problem):
    job = job_of(tmp_path, encoding)
    assert verify_job(job.job_dir).ok
    edit(job.manifest.encoded_layers)
    job.rewrite_manifest()
    report = verify_job(job.job_dir)
    assert report.summary["faults_by_kind"] == {"encoded_layers_invalid": 1}, report.to_dict()
    assert report.job_faults[0].message.startswith(problem), report.job_faults[0].message


def test_verify_refuses_stats_in_a_raw_jobs_manifest(tmp_path):
    job = job_of(tmp_path, "raw")
    job.manifest.encoded_layers = [EncodedLayer(layer=2, raw_bytes=1, bytes=1)]
    job.rewrite_manifest()
    report = verify_job(job.job_dir)
    assert [f.message for f in report.job_faults] == ["a raw job records encoded_layers"]
