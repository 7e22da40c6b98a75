"""verify_job: a sound job passes; each kind of damage is found and named, shard by shard and sample by sample."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hsx.cli import main as hsx
from hsx.storage.safetensors_raw import read_index
from hsx.verify import ShardRows, verify_job
from tests.support.jobs import make_job, random_samples
from tests.support.no_torch import env_without_torch


@pytest.fixture
def job(tmp_path):
    return make_job(tmp_path, layers=[2, 4, 5, 8], hidden=16, dtype="bfloat16", num_samples=5, samples_per_shard=2)


def kinds(report) -> dict[str, int]:
    return report.summary["faults_by_kind"]


def test_a_sound_job_passes(job):
    report = verify_job(job.job_dir)
    assert report.ok, report.to_dict()
    s = report.summary
    assert (s["shards"], s["shards_ok"], s["samples"], s["samples_ok"], s["samples_read"]) == (3, 3, 5, 5, 5)
    assert s["tokens"] == sum(x.input_ids.shape[0] for x in job.samples)
    assert s["bytes"] == sum(x.bytes for x in job.manifest.shards)
    assert s["faults"] == 0 and report.warnings == []
    assert json.loads(json.dumps(report.to_dict()))["ok"] is True
    assert verify_job(job.manifest_path).ok


def test_a_changed_byte_fails_the_sha256(job):
    path = job.job_dir / "shard-000001.safetensors"
    span = read_index(path)["layer_8"]
    with open(path, "r+b") as f:  # flip the low mantissa bit of one bf16 value: still finite, size unchanged
        f.seek(span.start)
        b = f.read(1)
        f.seek(span.start)
        f.write(bytes([b[0] ^ 1]))
    report = verify_job(job.job_dir)
    assert not report.ok
    assert kinds(report) == {"sha256_mismatch": 1}
    assert report.shard_faults[0].shard == "shard-000001.safetensors"
    assert report.summary["shards_ok"] == 2 and report.summary["samples_ok"] == 3
    assert verify_job(job.job_dir, check_hashes=False).ok


def test_a_truncated_shard_and_a_missing_one(job):
    path = job.job_dir / "shard-000000.safetensors"
    os.truncate(path, path.stat().st_size - 10)
    (job.job_dir / "shard-000002.safetensors").unlink()
    report = verify_job(job.job_dir)
    k = kinds(report)
    assert k["size_mismatch"] == 1 and k["sha256_mismatch"] == 1 and k["header_invalid"] == 1
    assert k["shard_missing"] == 1
    assert {f.shard for f in report.shard_faults} == {"shard-000000.safetensors", "shard-000002.safetensors"}
    # the two samples of shard 1 were read and are sound; the other three live in broken shards
    assert report.summary["samples_read"] == 2 and report.summary["samples_ok"] == 2


def test_non_finite_values_are_found_per_sample_across_chunks(tmp_path):
    samples = random_samples(3, [2, 4, 5, 8], 16, "bfloat16", lengths=[4, 11, 6])
    job = make_job(tmp_path, samples=samples, samples_per_shard=3)
    job.set_value("s-1", 4, 10, 3, float("nan"))  # the last row of an 11-row sample: the third chunk of 4
    job.set_value("s-2", 8, 0, 0, float("inf"))
    report = verify_job(job.job_dir, chunk_rows=4)
    assert kinds(report) == {"non_finite": 2}
    by_sample = {f.sample: f for f in report.sample_faults}
    assert set(by_sample) == {"s-1", "s-2"}
    assert "layer_4 has 1 NaN and 0 inf values, first in token 10" in by_sample["s-1"].message
    assert "layer_8 has 0 NaN and 1 inf values, first in token 0" in by_sample["s-2"].message
    assert report.summary["samples_ok"] == 1 and report.summary["shards_ok"] == 1  # the shard's bytes are as recorded


def test_bad_token_ids_and_loss_mask(tmp_path):
    samples = random_samples(2, [2, 4, 5, 8], 16, "bfloat16", lengths=[5, 5])
    samples[0].input_ids[2] = 5000  # the manifest's vocab is 1000
    samples[1].loss_mask[1] = 2
    job = make_job(tmp_path, samples=samples)
    report = verify_job(job.job_dir)
    assert kinds(report) == {"bad_loss_mask": 1, "bad_token_id": 1}
    assert {(f.kind, f.sample) for f in report.sample_faults} == {("bad_token_id", "s-0"), ("bad_loss_mask", "s-1")}
    assert "input_ids[2] = 5000" in report.sample_faults[0].message


def test_overlapping_and_out_of_range_samples(job):
    entries = job.manifest.samples
    entries[1].offset = entries[0].offset + 1  # same shard as sample 0, now overlapping it
    entries[3].num_tokens += 100  # past the end of its shard
    job.rewrite_manifest()
    report = verify_job(job.job_dir)
    k = kinds(report)
    assert k["overlap"] == 1 and k["out_of_range"] == 1
    overlap = next(f for f in report.sample_faults if f.kind == "overlap")
    assert overlap.sample == "s-1" and "overlap sample 's-0'" in overlap.message
    assert next(f for f in report.sample_faults if f.kind == "out_of_range").sample == "s-3"
    # the shard's own metadata disagrees with the moved offset; the shard's counts no longer add up
    assert k["metadata_mismatch"] == 1 and k["count_mismatch"] >= 1


def test_manifest_dtype_and_layers_must_match_the_shards(job):
    job.manifest.dtype = "float16"
    job.rewrite_manifest()
    report = verify_job(job.job_dir)
    assert kinds(report) == {"tensor_dtype": 3 * 4}
    assert report.summary["samples_read"] == 0 and report.summary["samples_ok"] == 0
    job.manifest.dtype = "bfloat16"
    job.manifest.layers = [2, 4, 5, 8, 9]
    job.rewrite_manifest()
    assert kinds(verify_job(job.job_dir)) == {"tensor_missing": 3}


def test_duplicate_ids_unknown_shards_and_counts(job):
    entries = job.manifest.samples
    entries[2].id = entries[0].id
    entries[4].shard = "shard-000009.safetensors"
    job.manifest.num_stored = 7
    job.rewrite_manifest()
    k = kinds(verify_job(job.job_dir))
    assert k["duplicate_sample_id"] == 1 and k["unknown_shard"] == 1
    assert k["count_mismatch"] >= 2  # num_stored, and the shards that lost a sample


def test_missing_or_broken_manifest(tmp_path):
    report = verify_job(tmp_path)
    assert not report.ok and report.job_faults[0].kind == "manifest_missing"
    (tmp_path / "manifest.json").write_text("{not json")
    assert verify_job(tmp_path).job_faults[0].kind == "manifest_unreadable"
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other", "layers": []}))
    report = verify_job(tmp_path)
    assert {f.kind for f in report.job_faults} == {"manifest_invalid"} and len(report.job_faults) >= 4
    json.dumps(report.to_dict())


def test_unlisted_files_are_warnings(job):
    (job.job_dir / "shard-000099.safetensors").write_bytes(b"x")
    (job.job_dir / ".shard-000003.safetensors.tmp-4242").write_bytes(b"x")
    report = verify_job(job.job_dir)
    assert report.ok and len(report.warnings) == 2


def test_fault_list_is_capped_but_counted(job):
    job.manifest.dtype = "float16"
    job.rewrite_manifest()
    report = verify_job(job.job_dir, max_faults=5)
    d = report.to_dict()
    assert len(d["shard_faults"]) == 5 and d["summary"]["faults"] == 12 and d["summary"]["faults_listed"] == 5


def test_cli(job, capsys):
    assert hsx(["verify", str(job.job_dir)]) == 0
    assert "OK" in capsys.readouterr().out
    assert hsx(["verify", str(job.manifest_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["samples_ok"] == 5
    (job.job_dir / "shard-000001.safetensors").unlink()
    assert hsx(["verify", str(job.job_dir)]) == 1
    out = capsys.readouterr().out
    assert "FAULTY" in out and "shard_missing" in out


def test_reads_rows_a_chunk_at_a_time(job, monkeypatch):
    """The value checks read at most chunk_rows rows at a time out of the shards; nothing is read whole."""
    import safetensors.torch

    real_rows, reads = ShardRows.rows, []

    def rows(self, key, start, stop):
        t = real_rows(self, key, start, stop)
        reads.append((key, t.shape[0]))
        return t

    monkeypatch.setattr(ShardRows, "rows", rows)
    monkeypatch.setattr(safetensors.torch, "load_file", lambda *a, **k: pytest.fail("a shard was loaded whole"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load used"))
    assert verify_job(job.job_dir, chunk_rows=3).summary["samples_read"] == 5
    layer_reads = [n for key, n in reads if key.startswith("layer_")]
    assert layer_reads and max(layer_reads) <= 3
    assert sum(n for key, n in reads if key == "layer_8") == sum(s.input_ids.shape[0] for s in job.samples)


VERIFY = (
    "import sys; from hsx.cli import main; code = main(sys.argv[1:]); assert 'torch' not in sys.modules; sys.exit(code)"
)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_verify_runs_without_torch(tmp_path, dtype):
    good = make_job(tmp_path / "good", dtype=dtype, num_samples=3)
    bad = make_job(tmp_path / "bad", dtype=dtype, num_samples=3)
    bad.set_value("s-1", 5, 1, 2, float("nan"))
    env = env_without_torch(tmp_path / "site")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", *args], env=env, capture_output=True, text=True, timeout=120)

    assert run("import torch").returncode != 0, "torch must be unimportable in the subprocess"
    ok = run(VERIFY, "verify", str(good.job_dir))
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "OK" in ok.stdout
    faulty = run(VERIFY, "verify", str(bad.job_dir), "--json")
    assert faulty.returncode == 1, faulty.stdout + faulty.stderr
    report = json.loads(faulty.stdout)
    assert report["summary"]["faults_by_kind"] == {"non_finite": 1}
    assert report["sample_faults"][0]["sample"] == "s-1"
    assert "layer_5 has 1 NaN and 0 inf values, first in token 1" in report["sample_faults"][0]["message"]
