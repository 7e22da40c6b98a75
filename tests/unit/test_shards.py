"""Shard files on disk: write_shard's layout and atomicity, read_sample, and read_index's header checks."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from safetensors.torch import save as safetensors_save

from hsx.dtypes import DTYPES
from hsx.manifest import Manifest, ManifestSample, ManifestShard, read_sample
from hsx.states import JobState
from hsx.storage import shards, sink
from hsx.storage.mapped import MappedShard, MappedShards
from hsx.storage.safetensors_raw import SafetensorsFormatError, TensorSpan, encode_header, read_index
from hsx.storage.shards import SHARD_FORMAT, NonFiniteSamples, ShardSample, shard_name, write_shard

LAYERS = [3, 1]  # deliberately not sorted: the shard follows the order it is given
HIDDEN = 6


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def span_from_file(path: Path, tensors: dict[str, torch.Tensor], name: str) -> TensorSpan:
    """Write `tensors` with the real safetensors writer and locate one of them by its header."""
    if not path.exists():
        save_file(tensors, str(path))
    return read_index(path)[name]


class Fixture:
    """Three samples of different lengths whose layers come from files (spans) and from bytes."""

    def __init__(self, src: Path, dtype: str, seed: int = 0, ids: tuple[str, ...] = ("s-a", "s-b", "s-c")):
        g = torch.Generator().manual_seed(seed)
        tdtype = DTYPES[dtype].torch
        lengths = [3, 5, 2]
        self.ids = list(ids)
        self.tensors = {i: [torch.randn(n, HIDDEN, generator=g).to(tdtype) for n in lengths] for i in LAYERS}
        self.input_ids = [np.arange(n, dtype=np.int64) + 1000 * k + seed for k, n in enumerate(lengths)]
        self.masks = [np.array([(k + j) % 2 for j in range(n)], dtype=np.int64) for k, n in enumerate(lengths)]
        src.mkdir(parents=True, exist_ok=True)
        # sample 0: one dump file per sample holding both layers plus an unrelated tensor before them
        f0 = src / f"a-{seed}.safetensors"
        t0 = {"aaa_pad": torch.ones(7, dtype=torch.int8), **{f"layer_{i}": self.tensors[i][0] for i in LAYERS}}
        # sample 1: raw bytes (a legacy .pt dump)
        # sample 2: each layer in its own file
        self.samples = [
            ShardSample(
                self.ids[0], self.input_ids[0], self.masks[0], {i: span_from_file(f0, t0, f"layer_{i}") for i in LAYERS}
            ),
            ShardSample(self.ids[1], self.input_ids[1], self.masks[1], {i: raw(self.tensors[i][1]) for i in LAYERS}),
            ShardSample(
                self.ids[2],
                self.input_ids[2],
                self.masks[2],
                {
                    i: span_from_file(
                        src / f"c{i}-{seed}.safetensors", {f"layer_{i}": self.tensors[i][2]}, f"layer_{i}"
                    )
                    for i in LAYERS
                },
            ),
        ]
        assert all(isinstance(sp, TensorSpan) for k in (0, 2) for sp in self.samples[k].layers.values())

    def expected(self) -> dict[str, torch.Tensor]:
        out = {
            "input_ids": torch.from_numpy(np.concatenate(self.input_ids)),
            "loss_mask": torch.from_numpy(np.concatenate(self.masks)),
        }
        for i in LAYERS:
            out[f"layer_{i}"] = torch.cat(self.tensors[i])
        return out


def dir_listing(d: Path) -> list[str]:
    return sorted(os.listdir(d)) if d.exists() else []


def header_of(path: Path) -> tuple[int, dict]:
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return n, json.loads(blob[8 : 8 + n])


# --- write_shard ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_write_shard_layout(tmp_path, dtype):
    fx = Fixture(tmp_path / "src", dtype)
    path = tmp_path / "out" / shard_name(1)
    info = write_shard(path, fx.samples, LAYERS, dtype, HIDDEN)

    assert path.name == "shard-000001.safetensors" == info.name
    blob = path.read_bytes()
    assert info.bytes == len(blob) == path.stat().st_size
    assert info.sha256 == hashlib.sha256(blob).hexdigest()
    assert info.num_samples == 3 and info.num_tokens == 10
    assert info.offsets == [0, 3, 8]

    loaded = load_file(str(path))
    expected = fx.expected()
    assert set(loaded) == set(expected)
    for k, t in expected.items():
        assert loaded[k].dtype == t.dtype, k
        assert torch.equal(loaded[k], t), k
    for i in LAYERS:
        assert loaded[f"layer_{i}"].shape == (10, HIDDEN)
    assert loaded["input_ids"].dtype == torch.int64 and loaded["loss_mask"].dtype == torch.int64

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == SHARD_FORMAT
    assert json.loads(meta["sample_ids"]) == ["s-a", "s-b", "s-c"]
    assert json.loads(meta["offsets"]) == [0, 3, 8]
    assert dir_listing(path.parent) == [path.name]


@pytest.mark.parametrize("id_len", range(1, 9))
def test_write_shard_data_is_8_byte_aligned(tmp_path, id_len):
    # Sample ids of every length mod 8 move the JSON's length through every padding case.
    fx = Fixture(tmp_path / "src", "bfloat16", ids=("x" * id_len, "y", "z"))
    path = tmp_path / "out" / shard_name(0)
    write_shard(path, fx.samples, LAYERS, "bfloat16", HIDDEN)
    n, header = header_of(path)
    assert (8 + n) % 8 == 0
    assert path.read_bytes()[8 : 8 + n].decode().rstrip(" ") == json.dumps(header, separators=(",", ":"))
    assert json.loads(header["__metadata__"]["sample_ids"])[0] == "x" * id_len
    for name, e in header.items():
        if name != "__metadata__":
            assert (8 + n + e["data_offsets"][0]) % 8 == 0, name
    assert torch.equal(load_file(str(path))["layer_1"], fx.expected()["layer_1"])


def test_write_shard_single_sample_and_empty(tmp_path):
    fx = Fixture(tmp_path / "src", "float32")
    path = tmp_path / "out" / shard_name(2)
    info = write_shard(path, fx.samples[1:2], LAYERS, "float32", HIDDEN)
    assert info.offsets == [0] and info.num_tokens == 5
    assert torch.equal(load_file(str(path))["layer_3"], fx.tensors[3][1])
    with pytest.raises(ValueError):
        write_shard(tmp_path / "out" / shard_name(3), [], LAYERS, "float32", HIDDEN)
    assert not (tmp_path / "out" / shard_name(3)).exists()


def _break_source(fx: Fixture, how: str) -> None:
    # The last sample's last layer: the failure comes after most of the shard was written.
    span = fx.samples[2].layers[LAYERS[-1]]
    if how == "missing":
        span.path.unlink()
    else:
        with open(span.path, "r+b") as f:
            f.truncate(span.start + span.nbytes // 2)


@pytest.mark.parametrize("how", ["missing", "truncated"])
def test_write_shard_failure_leaves_nothing(tmp_path, how):
    fx = Fixture(tmp_path / "src", "bfloat16")
    out = tmp_path / "out"
    out.mkdir()
    (out / "other-file").write_text("unrelated")
    path = out / shard_name(4)
    _break_source(fx, how)
    with pytest.raises(OSError):
        write_shard(path, fx.samples, LAYERS, "bfloat16", HIDDEN)
    assert not path.exists()
    assert list(out.glob(".*.tmp-*")) == []
    assert dir_listing(out) == ["other-file"]


@pytest.mark.parametrize("how", ["missing", "truncated"])
def test_existing_shard_is_replaced_only_whole(tmp_path, how):
    out = tmp_path / "out"
    path = out / shard_name(5)
    old = Fixture(tmp_path / "src-old", "bfloat16", seed=1)
    write_shard(path, old.samples, LAYERS, "bfloat16", HIDDEN)
    before = path.read_bytes()

    broken = Fixture(tmp_path / "src-new", "bfloat16", seed=2)
    _break_source(broken, how)
    with pytest.raises(OSError):
        write_shard(path, broken.samples, LAYERS, "bfloat16", HIDDEN)
    assert path.read_bytes() == before
    assert dir_listing(out) == [path.name]

    new = Fixture(tmp_path / "src-new2", "bfloat16", seed=3, ids=("n1", "n2", "n3"))
    info = write_shard(path, new.samples, LAYERS, "bfloat16", HIDDEN)
    after = path.read_bytes()
    assert after != before and info.sha256 == hashlib.sha256(after).hexdigest()
    loaded = load_file(str(path))
    for k, t in new.expected().items():
        assert torch.equal(loaded[k], t), k
    assert dir_listing(out) == [path.name]


@pytest.mark.parametrize("what", ["short_layer", "short_mask"])
def test_write_shard_refuses_sources_that_do_not_fit(tmp_path, what):
    fx = Fixture(tmp_path / "src", "bfloat16")
    s = fx.samples[1]
    if what == "short_layer":
        s.layers[LAYERS[0]] = s.layers[LAYERS[0]][:-2]
    else:
        s.loss_mask = s.loss_mask[:-1]
    path = tmp_path / "out" / shard_name(6)
    try:
        write_shard(path, fx.samples, LAYERS, "bfloat16", HIDDEN)
    except (ValueError, OSError):
        assert not path.exists()
        return
    load_file(str(path))  # what a consumer does with the shard: fails
    pytest.fail("an unreadable shard was written")


def test_write_shard_refuses_a_layer_listed_twice(tmp_path):
    """Two tensors of one name would make a header no reader opens: nothing is written."""
    fx = Fixture(tmp_path / "src", "bfloat16")
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="twice"):
        write_shard(out / shard_name(7), fx.samples, [*LAYERS, LAYERS[0]], "bfloat16", HIDDEN)
    assert dir_listing(out) == []


@pytest.mark.parametrize("metadata", [{}, None])
@pytest.mark.parametrize("name", ["layer_1", "__metadata__"])
def test_encode_header_refuses_a_name_given_twice(name, metadata):
    entries = [("layer_1", "BF16", (2, 3)), (name, "BF16", (2, 3))]
    with pytest.raises(ValueError, match="twice"):
        encode_header(entries, metadata)
    assert len(encode_header(entries[:1], metadata)) % 8 == 0


@pytest.mark.parametrize("rows", [0, 1, 5])
def test_encode_header_without_metadata_is_the_reference_writers(rows):
    """What safetensors writes for tensors given no metadata, in its order (the widest dtype first)."""
    tensors = {"token_ids": torch.arange(rows), "hidden_states": torch.ones(rows, 4, 3, dtype=torch.bfloat16)}
    reference = safetensors_save(tensors)
    header = encode_header([("token_ids", "I64", (rows,)), ("hidden_states", "BF16", (rows, 4, 3))], None)
    assert reference == header + raw(tensors["token_ids"]) + raw(tensors["hidden_states"])


# --- mapped rows ----------------------------------------------------------------------------------


def test_mapped_rows_are_views_of_the_shard(tmp_path):
    fx = Fixture(tmp_path / "src", "float32")
    info = write_shard(tmp_path / shard_name(0), fx.samples, LAYERS, "float32", HIDDEN)
    shard = MappedShard(tmp_path / shard_name(0))
    expected = fx.expected()
    for s, offset in zip(fx.samples, info.offsets):
        stop = offset + s.num_tokens
        layer = shard.rows(f"layer_{LAYERS[0]}", offset, stop)
        assert layer.shape == (s.num_tokens, HIDDEN * 4) and layer.dtype == np.uint8
        assert layer.tobytes() == raw(expected[f"layer_{LAYERS[0]}"][offset:stop])
        assert shard.rows("input_ids", offset, stop).view("<i8").ravel().tolist() == s.input_ids.tolist()
    total = info.num_tokens
    assert shard.rows("loss_mask", total, total).shape == (0, 8)
    with pytest.raises(ValueError, match="has no rows"):
        shard.rows("loss_mask", 1, total + 1)
    with pytest.raises(ValueError, match="no tensor 'layer_9'"):
        shard.rows("layer_9", 0, 1)


def test_a_damaged_shard_is_named_when_mapped(tmp_path):
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 16)
    with pytest.raises(ValueError, match=r"bad\.safetensors: unreadable shard .* run hsx verify"):
        MappedShard(tmp_path / "bad.safetensors")
    shards = MappedShards(tmp_path, max_open=1)
    with pytest.raises(ValueError, match="unreadable shard"):
        shards.get("missing.safetensors")


# --- read_sample ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_read_sample_returns_its_rows(tmp_path, dtype):
    fx = Fixture(tmp_path / "src", dtype)
    job = tmp_path / "job-1"
    info = write_shard(job / shard_name(0), fx.samples, LAYERS, dtype, HIDDEN)
    manifest = Manifest(
        job_id=job.name,
        state=JobState.SUCCEEDED,
        layers=LAYERS,
        hidden_size=HIDDEN,
        dtype=dtype,
        num_samples=len(fx.samples),
        num_stored=len(fx.samples),
        shards=[
            ManifestShard(
                name=info.name,
                bytes=info.bytes,
                sha256=info.sha256,
                num_samples=info.num_samples,
                num_tokens=info.num_tokens,
            )
        ],
        samples=[
            ManifestSample(id=s.sample_id, shard=info.name, offset=off, num_tokens=s.num_tokens)
            for s, off in zip(fx.samples, info.offsets)
        ],
    )
    for k, s in enumerate(fx.samples):
        got = read_sample(job, manifest, s.sample_id)
        assert set(got) == {"input_ids", "loss_mask"} | {f"layer_{i}" for i in LAYERS}
        assert torch.equal(got["input_ids"], torch.from_numpy(fx.input_ids[k]))
        assert torch.equal(got["loss_mask"], torch.from_numpy(fx.masks[k]))
        for i in LAYERS:
            assert got[f"layer_{i}"].dtype == DTYPES[dtype].torch
            assert torch.equal(got[f"layer_{i}"], fx.tensors[i][k]), (k, i)
    with pytest.raises(KeyError):
        read_sample(job, manifest, "no-such-sample")


# --- read_index -----------------------------------------------------------------------------------


def write_raw(path: Path, header: bytes, data: bytes = b"", *, length: int | None = None) -> Path:
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


def entry(dtype: str, shape: list[int], begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def test_read_index_locates_every_tensor(tmp_path):
    tensors = {
        "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.arange(5, dtype=torch.int64),
        "c": torch.randn(2, 3).to(torch.bfloat16),
    }
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path), metadata={"k": "v"})
    index = read_index(path)
    assert set(index) == set(tensors)  # __metadata__ is not a tensor
    for name, t in tensors.items():
        assert index[name].shape == tuple(t.shape)
        assert index[name].read() == raw(t)
    assert index["c"].dtype == "BF16" and index["b"].dtype == "I64"


def test_read_index_header_longer_than_file(tmp_path):
    h = json.dumps({"x": entry("F32", [2], 0, 8)}).encode()
    ok = write_raw(tmp_path / "ok", h, b"\0" * 8)
    assert read_index(ok)["x"].shape == (2,)  # the same file with an honest length is fine
    for length in (len(h) + 9, len(h) + 100, 2**40, 2**64 - 1):
        with pytest.raises(SafetensorsFormatError):
            read_index(write_raw(tmp_path / f"long{length}", h, b"\0" * 8, length=length))
    # The whole rest of the file is valid JSON, so only the length check itself can catch this one.
    h = b'{"__metadata__":{"k":"v"}}'
    assert read_index(write_raw(tmp_path / "meta-only", h)) == {}
    with pytest.raises(SafetensorsFormatError):
        read_index(write_raw(tmp_path / "meta-only-long", h, length=len(h) + 16))


@pytest.mark.parametrize("blob", [b"", b"\x01\x00\x00", b"\x00" * 7])
def test_read_index_shorter_than_prefix(tmp_path, blob):
    path = tmp_path / "short"
    path.write_bytes(blob)
    with pytest.raises(SafetensorsFormatError):
        read_index(path)


@pytest.mark.parametrize(
    "header",
    [b"{not json}", b'{"x": {"dtype": "F32"', b"\xff\xfe\xfd\xfc", b"[1, 2]", b'"text"', b"        "],
    ids=["garbage", "cut", "not-utf8", "list", "string", "blank"],
)
def test_read_index_non_json_or_non_object_header(tmp_path, header):
    with pytest.raises(SafetensorsFormatError):
        read_index(write_raw(tmp_path / "h", header, b"\0" * 16))


@pytest.mark.parametrize(
    "e",
    [
        entry("F32", [2, 4], 0, 28),  # one element short
        entry("F32", [2, 4], 0, 36),  # one element long
        entry("BF16", [2, 4], 0, 32),  # the byte count of F32, not BF16
        entry("F32", [2, 4], 8, 32),  # begin moved, end kept
        entry("F32", [2, 4], -4, 28),  # starts before the data
        entry("F32", [2, 4], 8, 40),  # runs past the end of the file
        entry("F32", [2, 4], 32, 0),  # reversed
    ],
    ids=["short", "long", "dtype-size", "begin", "negative", "past-eof", "reversed"],
)
def test_read_index_byte_range_must_match_shape_and_file(tmp_path, e):
    with pytest.raises(SafetensorsFormatError):
        read_index(write_raw(tmp_path / "r", json.dumps({"x": e}).encode(), b"\0" * 32))


@pytest.mark.parametrize(
    "e",
    [
        {"dtype": "F32", "shape": [8]},
        {"shape": [8], "data_offsets": [0, 32]},
        {"dtype": "F32", "data_offsets": [0, 32]},
        {"dtype": "F32", "shape": 8, "data_offsets": [0, 32]},
        {"dtype": "F32", "shape": [8], "data_offsets": [0]},
        {"dtype": "C64", "shape": [4], "data_offsets": [0, 32]},
        [1, 2, 3],
        "x",
    ],
    ids=["no-offsets", "no-dtype", "no-shape", "shape-int", "one-offset", "unknown-dtype", "list", "str"],
)
def test_read_index_malformed_entry(tmp_path, e):
    with pytest.raises(SafetensorsFormatError):
        read_index(write_raw(tmp_path / "m", json.dumps({"x": e}).encode(), b"\0" * 32))


def test_span_read_of_a_file_truncated_later(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"x": torch.ones(4, 4)}, str(path))
    span = read_index(path)["x"]
    with open(path, "r+b") as f:
        f.truncate(span.end - 1)
    with pytest.raises(SafetensorsFormatError):
        span.read()


def test_read_index_deeply_nested_header(tmp_path):
    with pytest.raises(SafetensorsFormatError):
        read_index(write_raw(tmp_path / "deep", b"[" * 100_000))


@pytest.mark.parametrize("shape", [[-2, -4], "8", "24"], ids=["negative", "str", "str-digits"])
def test_read_index_malformed_shape(tmp_path, shape):
    with pytest.raises(SafetensorsFormatError):
        read_index(write_raw(tmp_path / "neg", json.dumps({"x": entry("F32", shape, 0, 32)}).encode(), b"\0" * 32))


def test_non_finite_samples_are_named_and_no_shard_is_left(tmp_path):
    """Each sample holding NaN or Inf is named, whatever its source; the others are not, and a
    shard of those alone can be written next."""
    fx = Fixture(tmp_path / "src", "bfloat16")
    out = tmp_path / "out"
    path = out / shard_name(0)
    with_nan = fx.tensors[LAYERS[1]][1].clone()
    with_nan[4, 5] = float("nan")
    fx.samples[1].layers[LAYERS[1]] = raw(with_nan)  # raw bytes, second layer
    with_inf = fx.tensors[LAYERS[0]][2].clone()
    with_inf[0, 0] = float("-inf")
    span = fx.samples[2].layers[LAYERS[0]]
    with open(span.path, "r+b") as f:  # in its dump file, first layer
        f.seek(span.start)
        f.write(raw(with_inf))
    with pytest.raises(NonFiniteSamples) as ei:
        write_shard(path, fx.samples, LAYERS, "bfloat16", HIDDEN)
    assert ei.value.reasons == {
        "s-b": f"layer_{LAYERS[1]} holds NaN or Inf",
        "s-c": f"layer_{LAYERS[0]} holds NaN or Inf",
    }
    assert dir_listing(out) == []
    info = write_shard(path, fx.samples[:1], LAYERS, "bfloat16", HIDDEN)
    loaded = load_file(str(path))
    assert info.num_samples == 1 and torch.equal(loaded[f"layer_{LAYERS[0]}"], fx.tensors[LAYERS[0]][0])


def test_direct_and_buffered_writes_give_the_same_shard(tmp_path, monkeypatch):
    """Where the file system takes O_DIRECT a shard goes straight to disk through two aligned buffers
    in turn, its tail padded to a block and cut back; elsewhere it goes through the page cache. A shard
    of several buffers and an unaligned length comes out byte for byte the same either way, its
    layers from memory and from files (read piece by piece into the sink's buffer, across buffers)."""
    rng = np.random.default_rng(0)
    layers, hidden = [1, 2], 4096
    samples, tensors = [], []
    for k, n in enumerate([900, 1201, 7]):
        ids = np.arange(n, dtype=np.int64) + 10_000 * k
        values = {i: torch.from_numpy(rng.standard_normal((n, hidden)).astype(np.float16)) for i in layers}
        tensors.append(values)
        if k == 1:  # from a dump file: spans larger than a piece, starting at an unaligned offset
            path = tmp_path / "dump.safetensors"
            save_file({"aaa_pad": torch.ones(3, dtype=torch.int8), **{f"layer_{i}": values[i] for i in layers}}, path)
            index = read_index(path)
            sources = {i: index[f"layer_{i}"] for i in layers}
            assert all(sp.nbytes > sink.PIECE_BYTES and sp.start % sink.BLOCK for sp in sources.values())
        else:
            sources = {i: raw(values[i]) for i in layers}
        samples.append(ShardSample(f"s{k}", ids, np.ones(n, dtype=np.int64), sources))
    direct = write_shard(tmp_path / "direct" / shard_name(0), samples, layers, "float16", hidden)
    assert direct.bytes > 2 * sink.BUFFER_BYTES and direct.bytes % sink.BLOCK
    monkeypatch.setattr(shards, "open_sink", sink.BufferedSink)
    buffered = write_shard(tmp_path / "buffered" / shard_name(0), samples, layers, "float16", hidden)
    a = (tmp_path / "direct" / shard_name(0)).read_bytes()
    b = (tmp_path / "buffered" / shard_name(0)).read_bytes()
    assert a == b and len(a) == direct.bytes == buffered.bytes
    assert direct.sha256 == buffered.sha256 == hashlib.sha256(a).hexdigest()
    loaded = load_file(str(tmp_path / "direct" / shard_name(0)))
    assert np.array_equal(loaded["input_ids"].numpy(), np.concatenate([s.input_ids for s in samples]))
    for i in layers:
        assert torch.equal(loaded[f"layer_{i}"], torch.cat([t[i] for t in tensors]))


def test_a_file_system_that_refuses_direct_writes_gets_buffered_ones(tmp_path, monkeypatch):
    """Some file systems take O_DIRECT at open and refuse the writes (EINVAL): the probe write finds
    out before any of the shard is written, and the shard goes through the page cache instead."""
    fx = Fixture(tmp_path / "src", "float32")
    expected = write_shard(tmp_path / "a" / shard_name(0), fx.samples, LAYERS, "float32", HIDDEN)
    real_pwrite, refused = os.pwrite, []

    def pwrite(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(offset)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    info = write_shard(tmp_path / "b" / shard_name(0), fx.samples, LAYERS, "float32", HIDDEN)
    assert refused == [0]
    assert (tmp_path / "b" / shard_name(0)).read_bytes() == (tmp_path / "a" / shard_name(0)).read_bytes()
    assert info.sha256 == expected.sha256


@pytest.mark.parametrize("after_bad", [False, True])
def test_a_dump_cut_short_after_it_was_indexed_fails_the_shard(tmp_path, after_bad):
    """A staged file shorter than its header says (cut after validation) is an error, not a shard with
    bytes missing; also when it is only being checked because an earlier sample was not finite."""
    fx = Fixture(tmp_path / "src", "float32")
    if after_bad:
        nan = torch.full((5, HIDDEN), float("nan"))
        fx.samples[1].layers[LAYERS[0]] = raw(nan)
    span = fx.samples[2].layers[LAYERS[0]]
    os.truncate(span.path, span.end - 3)
    out = tmp_path / "out"
    with pytest.raises(OSError, match="ended before its tensor did"):
        write_shard(out / shard_name(0), fx.samples, LAYERS, "float32", HIDDEN)
    assert dir_listing(out) == []


def test_a_shard_reuses_the_direct_buffers_of_one_that_ended_but_not_of_one_that_failed(tmp_path, monkeypatch):
    """A fresh O_DIRECT buffer costs its page faults and zeroing, so a shard that ended hands its two
    buffers to the next. The next shard comes out byte for byte as it would through the page cache
    (nothing of the earlier shard's bytes in it, its padded tail included); a shard that failed keeps
    its buffers out of the pool."""
    pool = sink._BufferPool(keep=4)
    monkeypatch.setattr(sink, "_POOL", pool)
    rng = np.random.default_rng(1)
    hidden, n = 4096, 2500  # more than two buffers' worth, so both buffers are written
    big = {1: raw(torch.from_numpy(rng.standard_normal((n, hidden)).astype(np.float16)))}
    first = [ShardSample("big", np.arange(n, dtype=np.int64), np.ones(n, dtype=np.int64), big)]
    assert write_shard(tmp_path / "a" / shard_name(0), first, [1], "float16", hidden).bytes > 2 * sink.BUFFER_BYTES
    kept = list(pool._free)
    assert len(kept) == 2, "the ended shard's buffers wait for the next"

    fx = Fixture(tmp_path / "src", "bfloat16")
    info = write_shard(tmp_path / "b" / shard_name(1), fx.samples, LAYERS, "bfloat16", HIDDEN)
    assert sorted(map(id, pool._free)) == sorted(map(id, kept)), "the next shard wrote through the same buffers"
    monkeypatch.setattr(shards, "open_sink", sink.BufferedSink)
    expected = write_shard(tmp_path / "c" / shard_name(1), fx.samples, LAYERS, "bfloat16", HIDDEN)
    monkeypatch.undo()
    monkeypatch.setattr(sink, "_POOL", pool)
    assert (tmp_path / "b" / shard_name(1)).read_bytes() == (tmp_path / "c" / shard_name(1)).read_bytes()
    assert info.sha256 == expected.sha256

    _break_source(fx, "truncated")
    with pytest.raises(OSError):
        write_shard(tmp_path / "d" / shard_name(2), fx.samples, LAYERS, "bfloat16", HIDDEN)
    assert pool._free == [], "a failed shard's buffers are not reused"
