"""The lossless and fp8 encodings: their codecs against torch, shards written by hsx's own shard writer
and read back by every reader (the Dataset, the exports, verify, the service's tensor route, and the
plain-Python reader of docs/api.md), round trips on every dtype and on the edge cases: odd hidden
sizes, one-token samples, rows of zeros, the largest finite values, NaN and Inf refused."""

from __future__ import annotations

import hashlib
import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from hsx.dtypes import DTYPES, HIDDEN_STATE_DTYPES
from hsx.exports import export_job
from hsx.exports.base import ExportRefused
from hsx.manifest import load_manifest
from hsx.service.tensors import SampleCut
from hsx.storage import fp8, planes
from hsx.storage.encoding import base, encoding_of
from hsx.storage.floats import from_float32, to_float32
from hsx.storage.mapped import MappedShard
from hsx.storage.safetensors_raw import read_index
from hsx.storage.shards import NonFiniteSamples, ShardSample, write_shard
from hsx.training import HiddenStateDataset
from hsx.verify import verify_job
from tests.support.jobs import LLAMA_HIDDEN, Sample, llama_job, make_job, raw_bytes, tiny_llama

REPO = Path(__file__).resolve().parents[2]
LAYERS = [2, 4, 5, 8]
ENCODED = ["lossless", "fp8"]
# How far a decoded fp8 value may be from the stored one, relative to its row's largest magnitude: half
# a step of e4m3fn's top binade (16 / 448), plus the rounding to the job's dtype (half an ulp of it).
FP8_BOUND = {"bfloat16": 1 / 28 + 2**-8 * 29 / 28, "float16": 1 / 28 + 2**-11 * 29 / 28, "float32": 1 / 28 + 1e-6}


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy().reshape(t.shape[0], -1)


def relative_errors(stored: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
    """Each row's largest error relative to its largest magnitude (0 for a row of zeros)."""
    x, y = stored.to(torch.float64), decoded.to(torch.float64)
    largest = x.abs().amax(dim=1)
    return (y - x).abs().amax(dim=1) / torch.where(largest > 0, largest, torch.ones_like(largest))


# --- the codecs ----------------------------------------------------------------------------------------


def sweep(n: int = 200_000, seed: int = 0) -> np.ndarray:
    """float32 rows with values from 2**-14 to 448 of either sign, zeros, ties of the e4m3fn grid."""
    rng = np.random.default_rng(seed)
    values = rng.choice([-1.0, 1.0], n) * np.exp2(rng.uniform(-14, np.log2(448), n))
    grid = fp8.CODE_VALUES[np.isfinite(fp8.CODE_VALUES)]
    ties = (grid[:-1] + grid[1:]) / 2  # exactly between two codes: ties go to the even one
    values[: len(ties)] = ties[np.argsort(np.abs(ties))] * np.sign(ties[np.argsort(np.abs(ties))])
    values[len(ties) : len(ties) + 100] = 0.0
    rows = values.astype(np.float32).reshape(-1, 100)
    rows[:, 0] = 448.0  # every row's scale 1: the values themselves are rounded
    return rows


def test_fp8_codes_are_torch_float8_e4m3fn_bit_for_bit():
    rows = sweep()
    quantized = fp8.quantize(rows)
    codes, scales = quantized.codes, quantized.scales
    assert np.all(scales == 1)
    ours = codes.reshape(-1)
    theirs = torch.from_numpy(rows).to(torch.float8_e4m3fn).view(torch.uint8).numpy().reshape(-1)
    assert np.array_equal(ours, theirs)
    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float32).numpy()
    assert np.array_equal(fp8.CODE_VALUES, table, equal_nan=True)


def test_fp8_scales_make_what_torch_makes_of_value_over_scale():
    rng = np.random.default_rng(1)
    rows = (rng.standard_normal((64, 96)) * np.exp2(rng.uniform(-20, 20, (64, 1)))).astype(np.float32)
    quantized = fp8.quantize(rows)
    codes, scales = quantized.codes, quantized.scales
    theirs = (torch.from_numpy(rows) / torch.from_numpy(scales)[:, None]).to(torch.float8_e4m3fn)
    assert np.array_equal(codes, theirs.view(torch.uint8).numpy())
    assert np.allclose(scales, np.abs(rows).max(axis=1) / 448, rtol=2**-23)


@pytest.mark.parametrize("dtype", HIDDEN_STATE_DTYPES)
def test_floats_round_to_nearest_even_as_torch_does(dtype):
    rng = np.random.default_rng(2)
    reach = 14 if dtype == "float16" else 30  # within the dtype's range: no value rounds to infinity
    values = (rng.standard_normal((50, 77)) * np.exp2(rng.uniform(-reach, reach, (50, 1)))).astype(np.float32)
    ours = from_float32(values, DTYPES[dtype])
    theirs = as_numpy(torch.from_numpy(values).to(DTYPES[dtype].torch))
    assert np.array_equal(ours, theirs)
    back = to_float32(ours, DTYPES[dtype])
    assert torch.equal(torch.from_numpy(back), torch.from_numpy(values).to(DTYPES[dtype].torch).float())


def test_planes_round_trip_and_refuse_damaged_frames():
    rows = np.random.default_rng(3).integers(0, 256, (10, 12), dtype=np.uint8)
    frames = planes.compress(rows, 4)
    assert len(frames) == 4
    as_arrays = [np.frombuffer(f, dtype=np.uint8) for f in frames]
    assert np.array_equal(planes.decompress(as_arrays, 4, rows.size).reshape(10, 12), rows)
    with pytest.raises(ValueError, match="byte plane 1"):
        planes.decompress([as_arrays[0], as_arrays[1][:-2], *as_arrays[2:]], 4, rows.size)
    with pytest.raises(ValueError, match="declares"):
        planes.decompress(as_arrays, 4, rows.size * 2)


# --- shards: round trips -------------------------------------------------------------------------------


def shard_samples(lengths: list[int], hidden: int, dtype: str, seed: int = 0, scale: float = 1.0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    return [
        Sample(
            f"s{k}",
            torch.randint(0, 1000, (n,), generator=g),
            torch.ones(n, dtype=torch.int64),
            {i: (torch.randn(n, hidden, generator=g) * scale + i).to(DTYPES[dtype].torch) for i in LAYERS},
        )
        for k, n in enumerate(lengths)
    ]


def write(path: Path, samples: list[Sample], dtype: str, hidden: int, enc: str):
    shard_samples_ = [
        ShardSample(s.id, s.input_ids.numpy(), s.loss_mask.numpy(), {i: raw_bytes(s.layers[i]) for i in LAYERS})
        for s in samples
    ]
    return write_shard(path, shard_samples_, LAYERS, dtype, hidden, enc)


def stored_layers(path: Path, samples: list[Sample], dtype: str) -> dict[int, torch.Tensor]:
    shard = MappedShard(path)
    total = sum(s.input_ids.shape[0] for s in samples)
    return {
        i: torch.from_numpy(shard.rows(f"layer_{i}", 0, total).copy()).view(DTYPES[dtype].torch).reshape(total, -1)
        for i in LAYERS
    }


@pytest.mark.parametrize("dtype", HIDDEN_STATE_DTYPES)
@pytest.mark.parametrize(("lengths", "hidden"), [([1], 7), ([1, 1, 3], 33), ([5, 400, 2], 1), ([70, 1], 64)])
def test_lossless_round_trips_bit_for_bit(tmp_path, monkeypatch, dtype, lengths, hidden):
    monkeypatch.setattr(base, "BLOCK_BYTES", 512)  # many blocks per sample, and a row wider than one
    samples = shard_samples(lengths, hidden, dtype)
    info = write(tmp_path / "s", samples, dtype, hidden, "lossless")
    got = stored_layers(tmp_path / "s", samples, dtype)
    for i in LAYERS:
        assert torch.equal(got[i].view(torch.uint8), torch.cat([s.layers[i] for s in samples]).view(torch.uint8))
    assert info.layer_stats[2].raw_bytes == sum(lengths) * hidden * DTYPES[dtype].itemsize
    assert info.layer_stats[2].max_error is None
    assert hashlib.sha256((tmp_path / "s").read_bytes()).hexdigest() == info.sha256
    assert (tmp_path / "s").stat().st_size == info.bytes


@pytest.mark.parametrize("dtype", HIDDEN_STATE_DTYPES)
@pytest.mark.parametrize(("lengths", "hidden"), [([1], 7), ([3, 1, 300], 33), ([64], 5)])
def test_fp8_every_row_within_its_bound(tmp_path, dtype, lengths, hidden):
    samples = shard_samples(lengths, hidden, dtype, scale=1e3)
    info = write(tmp_path / "s", samples, dtype, hidden, "fp8")
    got = stored_layers(tmp_path / "s", samples, dtype)
    shard = MappedShard(tmp_path / "s")
    for i in LAYERS:
        stored = torch.cat([s.layers[i] for s in samples])
        errors = relative_errors(stored, got[i])
        assert float(errors.max()) <= FP8_BOUND[dtype]
        # what the manifest records: the codes' values x scales (float32), before the job's dtype
        dequantized = torch.from_numpy(fp8.dequantize(*shard.fp8_rows(f"layer_{i}", 0, sum(lengths))))
        x, y = stored.double(), dequantized.double()
        largest = x.abs().amax(dim=1, keepdim=True)
        each = (y - x).abs() / largest
        stats = info.layer_stats[i]
        assert stats.max_error == pytest.approx(float(each.max()), rel=1e-4) and stats.max_error <= 1 / 28
        assert stats.mean_error == pytest.approx(float(each.mean()), rel=1e-4)
        assert 0 < stats.mean_error < stats.max_error
        assert (
            stats.bytes == sum(lengths) * (hidden + 4)
            and stats.raw_bytes == sum(lengths) * hidden * DTYPES[dtype].itemsize
        )


def test_fp8_real_hidden_states_within_the_bound(tmp_path):
    job, _ = llama_job(tmp_path, tiny_llama(), encoding="fp8", lengths=(1, 9, 40))
    raw, _ = llama_job(tmp_path / "raw", tiny_llama(), lengths=(1, 9, 40))
    for a, b in zip(HiddenStateDataset(raw.job_dir), HiddenStateDataset(job.job_dir)):
        for key in ("aux_hidden_state", "hidden_state"):
            assert b[key].dtype == a[key].dtype == torch.float32
            assert (
                float(relative_errors(a[key].reshape(-1, LLAMA_HIDDEN), b[key].reshape(-1, LLAMA_HIDDEN)).max())
                <= (FP8_BOUND["float32"])
            )


@pytest.mark.parametrize("dtype", HIDDEN_STATE_DTYPES)
@pytest.mark.parametrize("enc", ENCODED)
def test_rows_of_zeros_and_the_largest_finite_values(tmp_path, dtype, enc):
    largest = float(torch.finfo(torch.bfloat16).max) if dtype != "float16" else float(torch.finfo(torch.float16).max)
    if dtype == "float32":
        largest = float(torch.finfo(torch.float32).max)
    rows = torch.zeros(4, 9, dtype=DTYPES[dtype].torch)
    rows[1] = largest
    rows[2, ::2] = -largest
    rows[3] = (torch.linspace(-1, 1, 9, dtype=torch.float64) * largest).to(rows.dtype)
    sample = Sample("edge", torch.arange(4), torch.ones(4, dtype=torch.int64), dict.fromkeys(LAYERS, rows))
    write(tmp_path / "s", [sample], dtype, 9, enc)
    shard = MappedShard(tmp_path / "s")
    got = stored_layers(tmp_path / "s", [sample], dtype)[2]
    assert torch.isfinite(got.float()).all()
    if enc == "lossless":
        assert torch.equal(got.view(torch.uint8), rows.view(torch.uint8))
        return
    codes, scales = shard.fp8_rows("layer_2", 0, 4)
    assert scales[0] == 0 and not codes[0].any(), "a row of zeros: scale 0, codes 0"
    assert torch.equal(got[0], rows[0])
    assert float(relative_errors(rows, got).max()) <= FP8_BOUND[dtype]


@pytest.mark.parametrize("enc", ENCODED)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_refused_as_in_raw_shards(tmp_path, enc, bad):
    samples = shard_samples([3, 4, 5], 8, "bfloat16")
    samples[1].layers[5][2, 3] = bad
    samples[2].layers[8][0, 0] = bad
    with pytest.raises(NonFiniteSamples) as refused:
        write(tmp_path / "s", samples, "bfloat16", 8, enc)
    assert refused.value.reasons == {"s1": "layer_5 holds NaN or Inf", "s2": "layer_8 holds NaN or Inf"}
    assert not list(tmp_path.iterdir()), "no shard, no temporary file"


@pytest.mark.parametrize("enc", ENCODED)
def test_an_encoded_shard_is_a_plain_safetensors_file(tmp_path, enc):
    samples = shard_samples([3, 2], 8, "bfloat16")
    write(tmp_path / "s", samples, "bfloat16", 8, enc)
    with safe_open(str(tmp_path / "s"), framework="pt") as f:
        names = set(f.keys())
        metadata = f.metadata()
        assert torch.equal(f.get_tensor("input_ids"), torch.cat([s.input_ids for s in samples]))
        if enc == "fp8":
            assert f.get_tensor("layer_2.fp8").dtype == torch.float8_e4m3fn
    assert names == {"input_ids", "loss_mask"} | {
        n for i in LAYERS for n in encoding_of(enc).tensor_names(f"layer_{i}")
    }
    assert metadata["encoding"] == enc and metadata["dtype"] == "bfloat16" and metadata["hidden_size"] == "8"
    assert json.loads(metadata["sample_ids"]) == ["s0", "s1"]


@pytest.mark.parametrize("enc", ENCODED)
def test_encoding_threads_write_the_same_shard_byte_for_byte(tmp_path, monkeypatch, enc):
    """The flushers hand blocks to encoding threads (hsx.extraction.encoders): more blocks than may wait
    at once, taken back in order, give the shard this thread alone gives; a refusal is found the same."""
    monkeypatch.setattr(base, "BLOCK_BYTES", 256)
    samples = shard_samples([40, 1, 90, 7], 16, "bfloat16")
    write_shard_ = [
        ShardSample(s.id, s.input_ids.numpy(), s.loss_mask.numpy(), {i: raw_bytes(s.layers[i]) for i in LAYERS})
        for s in samples
    ]
    alone = write_shard(tmp_path / "alone", write_shard_, LAYERS, "bfloat16", 16, enc)
    with ThreadPoolExecutor(3) as pool:
        threads = write_shard(tmp_path / "threads", write_shard_, LAYERS, "bfloat16", 16, enc, encoders=pool)
        assert (tmp_path / "alone").read_bytes() == (tmp_path / "threads").read_bytes()
        assert alone.layer_stats == threads.layer_stats
        samples[2].layers[4][50, 3] = float("nan")
        write_shard_[2].layers[4] = raw_bytes(samples[2].layers[4])
        with pytest.raises(NonFiniteSamples, match="s2: layer_4"):
            write_shard(tmp_path / "refused", write_shard_, LAYERS, "bfloat16", 16, enc, encoders=pool)
    assert not (tmp_path / "refused").exists()


def plain_reader():
    """The reader docs/api.md shows for people without hsx, run as it is written there."""
    text = (REPO / "docs" / "api.md").read_text()
    found = re.findall(r"<!-- tested: plain-reader [^>]*-->\s*\n```python\n(.*?)\n```", text, re.S)
    assert len(found) == 1, "docs/api.md holds the plain reader once"
    namespace: dict = {}
    exec(compile(found[0], "docs/api.md", "exec"), namespace)
    return namespace["read_layer"]


@pytest.mark.parametrize("dtype", HIDDEN_STATE_DTYPES)
@pytest.mark.parametrize("enc", ["raw", *ENCODED])
def test_the_documented_plain_reader_reads_every_encoding(tmp_path, monkeypatch, dtype, enc):
    monkeypatch.setattr(base, "BLOCK_BYTES", 256)
    samples = shard_samples([1, 30, 7], 12, dtype)
    write(tmp_path / "s", samples, dtype, 12, enc)
    read_layer = plain_reader()
    hsx = stored_layers(tmp_path / "s", samples, dtype)
    for start, stop in [(0, 38), (1, 31), (5, 6), (31, 38)]:
        got = read_layer(tmp_path / "s", 4, start, stop)
        want = hsx[4][start:stop]
        if enc == "fp8":  # float32, before hsx rounds it to the job's dtype
            assert torch.equal(torch.from_numpy(got).to(want.dtype), want)
        else:
            assert np.array_equal(got.view(np.uint8).reshape(stop - start, -1), as_numpy(want))


# --- every reader ----------------------------------------------------------------------------------


@pytest.fixture(params=HIDDEN_STATE_DTYPES)
def jobs(request, tmp_path):
    """The same samples stored raw, lossless and fp8."""
    made = {}
    for enc in ["raw", *ENCODED]:
        made[enc] = make_job(
            tmp_path / enc,
            layers=LAYERS,
            hidden=24,
            dtype=request.param,
            num_samples=5,
            samples_per_shard=2,
            lengths=[1, 7, 3, 40, 1],
            encoding=enc,
        )
    return made


def test_the_manifest_records_the_encoding_per_job_and_per_layer(jobs):
    raw = load_manifest(jobs["raw"].job_dir)
    assert raw.encoding == "raw" and raw.encoded_layers is None
    for enc in ENCODED:
        manifest = load_manifest(jobs[enc].job_dir)
        assert manifest.encoding == enc
        assert [e.layer for e in manifest.encoded_layers] == LAYERS
        for e in manifest.encoded_layers:
            assert e.raw_bytes == 52 * 24 * DTYPES[manifest.dtype].itemsize
            assert (e.max_error is None) == (enc == "lossless")
        assert set(manifest.shard_layout) >= set(encoding_of(enc).tensor_names("layer_<i>"))


def test_the_dataset_decodes(jobs):
    raw = HiddenStateDataset(jobs["raw"].job_dir)
    for enc in ENCODED:
        ds = HiddenStateDataset(jobs[enc].job_dir)
        assert len(ds) == len(raw) and ds.lengths == raw.lengths
        for a, b in zip(raw, ds):
            for key in ("input_ids", "loss_mask"):
                assert torch.equal(a[key], b[key])
            for key in ("aux_hidden_state", "hidden_state"):
                assert b[key].dtype == a[key].dtype and b[key].shape == a[key].shape
                if enc == "lossless":
                    assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8))
                else:
                    errors = relative_errors(a[key].reshape(-1, 24), b[key].reshape(-1, 24))
                    assert float(errors.max()) <= FP8_BOUND[str(jobs[enc].manifest.dtype)]


def test_the_tensor_route_decodes(jobs):
    def cut(enc: str) -> dict[str, torch.Tensor]:
        manifest = jobs[enc].manifest
        entry = manifest.sample("s-3")
        data = SampleCut(
            jobs[enc].job_dir / entry.shard,
            ["input_ids", "loss_mask"] + [f"layer_{i}" for i in LAYERS],
            entry.id,
            entry.offset,
            entry.num_tokens,
            metadata={},
        ).body()
        from safetensors.torch import load

        return load(data)

    raw, lossless, fp8_ = cut("raw"), cut("lossless"), cut("fp8")
    assert raw.keys() == lossless.keys() == fp8_.keys()
    for key in raw:
        assert torch.equal(raw[key].view(torch.uint8), lossless[key].view(torch.uint8)), key
        assert raw[key].dtype == fp8_[key].dtype and raw[key].shape == fp8_[key].shape


@pytest.mark.parametrize("enc", ENCODED)
def test_verify_decodes_and_finds_damage(jobs, enc):
    job = jobs[enc]
    report = verify_job(job.job_dir)
    assert report.ok, report.to_dict()
    assert report.summary["samples_read"] == 5
    shard = job.job_dir / job.manifest.shards[1].name
    span = read_index(shard)[f"layer_5.{'zstd' if enc == 'lossless' else 'fp8'}"]
    data = bytearray(shard.read_bytes())
    if enc == "lossless":
        data[span.start + 4 : span.start + 12] = bytes(8)  # inside the first frame's header and block
    else:
        data[span.start + 3] = 0x7F  # a NaN code
    shard.write_bytes(bytes(data))
    job.manifest.shard(shard.name).sha256 = hashlib.sha256(bytes(data)).hexdigest()
    job.rewrite_manifest()
    report = verify_job(job.job_dir)
    kinds = report.summary["faults_by_kind"]
    assert kinds == {"damaged": 1}, report.to_dict()
    message = report.sample_faults[0].message
    assert message.startswith("layer_5: ") and ("byte plane 0" if enc == "lossless" else "NaN code") in message


def test_verify_finds_a_shard_of_another_encoding(jobs):
    job = jobs["lossless"]
    other = jobs["fp8"].job_dir / jobs["fp8"].manifest.shards[0].name
    target = job.job_dir / job.manifest.shards[0].name
    target.write_bytes(other.read_bytes())
    job.manifest.shard(target.name).sha256 = hashlib.sha256(target.read_bytes()).hexdigest()
    job.manifest.shard(target.name).bytes = target.stat().st_size
    job.rewrite_manifest()
    kinds = verify_job(job.job_dir).summary["faults_by_kind"]
    assert kinds == {"encoding_mismatch": 1}


@pytest.mark.parametrize("target", ["specforge", "modelopt"])
def test_exports_of_a_lossless_job_are_those_of_the_raw_job_byte_for_byte(jobs, tmp_path, target):
    out = tmp_path / "exports"
    export_job(target, jobs["raw"].job_dir, out / "raw")
    export_job(target, jobs["lossless"].job_dir, out / "lossless")
    files = sorted(p.relative_to(out / "raw") for p in (out / "raw").rglob("*") if p.suffix in (".ckpt", ".pt"))
    assert len(files) == 5
    for rel in files:
        assert (out / "raw" / rel).read_bytes() == (out / "lossless" / rel).read_bytes(), rel


def test_exports_of_an_fp8_job_are_decoded_or_fp8_as_speculators_writes_it(tmp_path):
    llama = tiny_llama()
    llama.save_pretrained(tmp_path / "checkpoint")
    job, _ = llama_job(tmp_path / "fp8", llama, encoding="fp8", lengths=(5, 1, 30))
    raw, _ = llama_job(tmp_path / "raw", llama, lengths=(5, 1, 30))
    norm = {"final_norm_weight": tmp_path / "checkpoint"}
    export_job("speculators", job.job_dir, tmp_path / "decoded", **norm)
    carried_export = export_job("speculators", job.job_dir, tmp_path / "fp8-out", fp8=True, **norm)
    export_job("speculators", raw.job_dir, tmp_path / "raw-out", **norm)
    with pytest.raises(ExportRefused, match="encoding is raw"):
        export_job("speculators", raw.job_dir, tmp_path / "refused", fp8=True, **norm)
    largest = 0.0
    for idx in range(3):
        name = f"hidden_states/hs_{idx}.safetensors"
        truth = load_file(tmp_path / "raw-out" / name)["hidden_states"]
        decoded = load_file(tmp_path / "decoded" / name)
        carried = load_file(tmp_path / "fp8-out" / name)
        assert set(carried) == {"hidden_states", "hidden_states_scales", "token_ids"}
        assert carried["hidden_states"].dtype == torch.float8_e4m3fn
        assert carried["hidden_states_scales"].shape == (truth.shape[0], 4, 1)
        # speculators' FP8 reader: codes times scales, broadcast
        dequantized = carried["hidden_states"].to(torch.float32) * carried["hidden_states_scales"]
        for got in (decoded["hidden_states"], dequantized):
            assert got.shape == truth.shape
            aux = relative_errors(truth[:, :3].reshape(-1, LLAMA_HIDDEN), got[:, :3].reshape(-1, LLAMA_HIDDEN))
            assert float(aux.max()) <= FP8_BOUND["float32"]
            # the last layer divided by the norm's weight (0.5 to 1.5 here): its errors grow by at most 3x
            # relative to the new rows, and --fp8 quantizes those rows once more
            last = relative_errors(truth[:, -1], got[:, -1])
            assert float(last.max()) <= 4 / 28
        # the aux layers carry the stored codes: decoded by hand they are the decoded export
        assert torch.equal(dequantized[:, :3], decoded["hidden_states"][:, :3])
        # the last layer, quantized anew from the decoded export's rows: the file says what that added
        with safe_open(str(tmp_path / "fp8-out" / name), framework="pt") as f:
            metadata = f.metadata()
        assert "--hidden-states-backend fp8" in metadata["hsx_fp8_layout"]
        added = relative_errors(decoded["hidden_states"][:, -1], dequantized[:, -1])
        said = float(metadata["hsx_last_layer_requantized_max_error"])
        assert said == pytest.approx(float(added.max()), rel=1e-4, abs=1e-7)
        largest = max(largest, said)
    (note,) = [n for n in carried_export.notes if "quantized anew" in n]
    assert f"up to {largest:.4g} of each row's largest magnitude" in note
