"""The dump reader against real dump directories on disk (dump protocol v1, "What a reader must check").

Well-formed dumps come from the reference server's `Dumper`; every corruption is then made on
disk, and each rejection is checked by its DumpRejected code.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from hsx.backends.dumps import (
    Dump,
    DumpRejected,
    DumpRoot,
    DumpRootBusy,
    identify,
    ids_sha256,
    keep_layers,
    load_staged,
    move_out,
    read_meta,
    validate,
)
from hsx.identity import Identity
from hsx.reference.dumper import Dumper, input_ids_sha256
from hsx.storage.safetensors_raw import TensorSpan
from hsx.storage.shards import NonFiniteSamples, ShardSample, write_shard

IDS = [101, 7, 9, 2048, 3, 77]
N = len(IDS)
HIDDEN = 8
LAYERS = [2, 4, 7]
DELETE = object()


def raw(t: torch.Tensor) -> bytes:
    """The bytes a tensor occupies in row-major order, as written to disk."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def hidden_states(dtype: torch.dtype = torch.bfloat16, n: int = N, hidden: int = HIDDEN, layers=LAYERS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {i: torch.randn(n, hidden, generator=g).to(dtype) for i in layers}


def make_dump(root: Path, key: str = "0", *, ids=IDS, dtype: str = "bfloat16", hs=None, hidden: int = HIDDEN):
    """A well-formed dump written by the reference writer; returns (directory, tensors written)."""
    if hs is None:
        hs = hidden_states(getattr(torch, dtype), n=len(ids), hidden=hidden)
    w = Dumper(root, boot_id="boot-1", dtype_name=dtype, hidden_size=hidden)
    d = w.write(key, rid=f"rid-{key}", counter=0, input_ids=ids, hidden_states=hs)
    return d, hs


def edit_meta(d: Path, **changes) -> dict:
    meta = json.loads((d / "meta.json").read_text())
    for k, v in changes.items():
        if v is DELETE:
            meta.pop(k, None)
        else:
            meta[k] = v
    (d / "meta.json").write_text(json.dumps(meta))
    return meta


def split_safetensors(path: Path) -> tuple[dict, bytes]:
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def join_safetensors(path: Path, header: dict, data: bytes) -> None:
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def make_legacy_dump(root: Path, key: str, tensors: dict[int, object], *, dtype: str = "bfloat16") -> Path:
    """An older server's dump: meta.json plus one torch.save'd `layer_<i>.pt` per layer."""
    w = Dumper(root, boot_id="boot-0", dtype_name=dtype, hidden_size=HIDDEN)
    d = w.prepare_dir(key)
    for i, t in tensors.items():
        torch.save(t, d / f"layer_{i}.pt")
    w.write_meta(d, w.build_meta(f"rid-{key}", 0, IDS, sorted(tensors)))
    w.mark_done(d)
    return d


def reject_code(fn, *args, **kwargs) -> str:
    with pytest.raises(DumpRejected) as ei:
        fn(*args, **kwargs)
    assert ei.value.reason and ei.value.code in str(ei.value)
    return ei.value.code


def validate_code(d: Path, **kwargs) -> str:
    return reject_code(validate, d, read_meta(d), **kwargs)


# --- read_meta --------------------------------------------------------------------------------


def test_read_meta_returns_what_the_writer_wrote(tmp_path):
    d, _ = make_dump(tmp_path)
    meta = read_meta(d)
    assert meta == json.loads((d / "meta.json").read_text())
    assert meta["num_tokens"] == N and meta["layers"] == LAYERS and meta["hidden_size"] == HIDDEN
    assert meta["dtype"] == "bfloat16"


def test_read_meta_without_done_is_incomplete(tmp_path):
    d, _ = make_dump(tmp_path)
    (d / "done").unlink()
    assert reject_code(read_meta, d) == "incomplete"


@pytest.mark.parametrize(
    "content",
    [b'{"num_tokens": 6, "layers": [2', b"", b"not json at all", b'{"num_tokens": "\xff\xfe"}'],
    ids=["truncated", "empty", "garbage", "not-utf8"],
)
def test_read_meta_unparsable(tmp_path, content):
    d, _ = make_dump(tmp_path)
    (d / "meta.json").write_bytes(content)
    assert reject_code(read_meta, d) == "bad_meta"


def test_read_meta_missing_file(tmp_path):
    d, _ = make_dump(tmp_path)
    (d / "meta.json").unlink()
    assert reject_code(read_meta, d) == "bad_meta"


@pytest.mark.parametrize("doc", ["[1, 2, 3]", '"meta"', "42", "null"])
def test_read_meta_not_an_object(tmp_path, doc):
    d, _ = make_dump(tmp_path)
    (d / "meta.json").write_text(doc)
    assert reject_code(read_meta, d) == "bad_meta"


@pytest.mark.parametrize("field", ["num_tokens", "layers", "hidden_size", "dtype"])
def test_read_meta_missing_required_field(tmp_path, field):
    d, _ = make_dump(tmp_path)
    edit_meta(d, **{field: DELETE})
    with pytest.raises(DumpRejected) as ei:
        read_meta(d)
    assert ei.value.code == "bad_meta"
    assert field in ei.value.reason


def test_read_meta_optional_fields_may_be_absent(tmp_path):
    d, _ = make_dump(tmp_path)
    meta = edit_meta(d, rid=DELETE, counter=DELETE, boot_id=DELETE, cached_tokens=DELETE, input_ids_sha256=DELETE)
    assert read_meta(d) == meta


# --- identify ---------------------------------------------------------------------------------


def test_writer_and_reader_agree_on_the_ids_hash():
    assert ids_sha256(IDS) == input_ids_sha256(IDS)
    assert ids_sha256(IDS) != ids_sha256(IDS[::-1])


def not_ours(d, meta, ids, rid="rid-0") -> str:
    with pytest.raises(DumpRejected) as exc:
        identify(d, meta, ids, rid)
    assert exc.value.code == "not_ours"
    return exc.value.reason


def test_our_dump_is_proven_by_its_ids(tmp_path):
    d, _ = make_dump(tmp_path)
    assert identify(d, read_meta(d), list(IDS), "rid-0") == Identity.IDS


def test_identity_num_tokens_mismatch(tmp_path):
    d, _ = make_dump(tmp_path)
    assert "num_tokens" in not_ours(d, read_meta(d), IDS + [5])


def test_a_dump_without_ids_or_rid_proves_only_its_token_count(tmp_path):
    d, _ = make_dump(tmp_path)
    (d / "input_ids.safetensors").unlink()
    meta = edit_meta(d, input_ids_sha256=DELETE, rid=DELETE)
    assert identify(d, meta, IDS, "rid-0") == Identity.COUNT
    assert identify(d, meta, IDS[::-1], "any rid") == Identity.COUNT, "the same length is all it can show"
    assert "num_tokens" in not_ours(d, meta, IDS[:-1])


def test_a_dump_without_ids_is_proven_by_our_rid_and_refused_by_another(tmp_path):
    d, _ = make_dump(tmp_path)
    (d / "input_ids.safetensors").unlink()
    meta = edit_meta(d, input_ids_sha256=DELETE)
    assert identify(d, meta, IDS, "rid-0") == Identity.RID
    assert "rid 'rid-0' is not this request's 'hsx-j-1-t1'" in not_ours(d, meta, IDS, "hsx-j-1-t1")


def test_equal_ids_under_another_rid_are_another_request(tmp_path):
    # Another client sending the same prompt: its dump is not ours, whatever its ids.
    d, _ = make_dump(tmp_path)
    assert "is not this request's" in not_ours(d, read_meta(d), IDS, "hsx-j-1-t1")


def test_identity_sha_mismatch(tmp_path):
    # Another request of the same length: only the hash tells them apart.
    other = [IDS[0] + 1] + IDS[1:]
    d, _ = make_dump(tmp_path, ids=other)
    (d / "input_ids.safetensors").unlink()
    meta = read_meta(d)
    assert "sha256" in not_ours(d, meta, IDS)
    assert identify(d, meta, other, "rid-0") == Identity.IDS


def test_identity_ids_file_mismatch(tmp_path):
    other = IDS[:-1] + [IDS[-1] + 1]
    d, _ = make_dump(tmp_path, ids=other)
    meta = edit_meta(d, input_ids_sha256=DELETE)
    assert "input_ids differ" in not_ours(d, meta, IDS)
    assert identify(d, meta, other, "rid-0") == Identity.IDS


def test_identity_ids_file_checked_even_when_sha_matches(tmp_path):
    # meta's hash says "ours" but the ids file says otherwise: still not ours.
    d, _ = make_dump(tmp_path)
    save_file({"input_ids": torch.tensor(IDS[::-1], dtype=torch.int64)}, str(d / "input_ids.safetensors"))
    meta = read_meta(d)
    assert meta["input_ids_sha256"] == ids_sha256(IDS)
    assert "input_ids differ" in not_ours(d, meta, IDS)


def test_identity_accepts_int32_ids_file(tmp_path):
    d, _ = make_dump(tmp_path)
    save_file({"input_ids": torch.tensor(IDS, dtype=torch.int32)}, str(d / "input_ids.safetensors"))
    assert identify(d, read_meta(d), IDS, "rid-0") == Identity.IDS


@pytest.mark.parametrize("damage", ["garbage", "wrong_key"])
def test_identity_unreadable_ids_file(tmp_path, damage):
    d, _ = make_dump(tmp_path)
    f = d / "input_ids.safetensors"
    if damage == "garbage":
        f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    else:
        save_file({"ids": torch.tensor(IDS, dtype=torch.int64)}, str(f))
    assert reject_code(identify, d, read_meta(d), IDS, "rid-0") == "bad_input_ids"


# --- validate: accepted dumps -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_valid_dump_gives_exactly_the_written_bytes(tmp_path, dtype):
    d, hs = make_dump(tmp_path, dtype=dtype)
    dump = validate(d, read_meta(d), expect_layers=LAYERS, expect_hidden=HIDDEN, expect_dtype=dtype)
    assert isinstance(dump, Dump)
    assert dump.path == d and dump.num_tokens == N
    assert sorted(dump.layers) == LAYERS
    itemsize = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    for i, t in hs.items():
        src = dump.layers[i]
        assert isinstance(src, TensorSpan)
        assert src.shape == (N, HIDDEN) and src.path == d / "hidden_states.safetensors"
        assert src.read() == raw(t)
        assert src.nbytes == N * HIDDEN * itemsize
    assert dump.nbytes == len(LAYERS) * N * HIDDEN * itemsize


def test_valid_dump_without_expectations_or_optional_fields(tmp_path):
    d, hs = make_dump(tmp_path)
    (d / "input_ids.safetensors").unlink()
    meta = edit_meta(d, cached_tokens=DELETE, input_ids_sha256=DELETE, rid=DELETE)
    dump = validate(d, meta)
    assert {i: s.read() for i, s in dump.layers.items()} == {i: raw(t) for i, t in hs.items()}


def test_valid_dump_may_carry_extra_layers(tmp_path):
    d, hs = make_dump(tmp_path)
    meta = edit_meta(d, layers=[4])
    dump = validate(d, meta, expect_layers=[4])
    assert list(dump.layers) == [4]
    assert dump.layers[4].read() == raw(hs[4])


# --- validate: rejections ---------------------------------------------------------------------


@pytest.mark.parametrize("cached", [1, N])
def test_cached_tokens_rejected(tmp_path, cached):
    d, _ = make_dump(tmp_path)
    edit_meta(d, cached_tokens=cached)
    assert validate_code(d) == "cached_tokens"


def test_missing_layer_in_safetensors(tmp_path):
    d, _ = make_dump(tmp_path)
    edit_meta(d, layers=LAYERS + [8])
    assert validate_code(d) == "missing_layer"


def test_missing_layer_file_altogether(tmp_path):
    d, _ = make_dump(tmp_path)
    (d / "hidden_states.safetensors").unlink()
    assert validate_code(d) == "missing_layer"


@pytest.mark.parametrize(
    "keep", [-1, -N * HIDDEN, 100, 7, 0], ids=["1-byte", "1-layer", "mid-header", "prefix", "empty"]
)
def test_truncated_hidden_states(tmp_path, keep):
    d, _ = make_dump(tmp_path)
    f = d / "hidden_states.safetensors"
    blob = f.read_bytes()
    f.write_bytes(blob[:keep] if keep else b"")
    assert len(f.read_bytes()) < len(blob)
    assert validate_code(d) == "bad_tensor_file"


def _lie(header: dict, how: str, size: int) -> None:
    e = header["layer_4"]
    begin, end = e["data_offsets"]
    if how == "shape_bigger":
        e["shape"] = [N, HIDDEN + 1]
    elif how == "shape_smaller":
        e["shape"] = [N - 1, HIDDEN]
    elif how == "past_end":
        e["data_offsets"] = [size - (end - begin) + 2, size + 2]
    elif how == "negative_begin":
        e["data_offsets"] = [-2, end - begin - 2]
    elif how == "unknown_dtype":
        e["dtype"] = "F8_E4M3"
    elif how == "no_offsets":
        del e["data_offsets"]


@pytest.mark.parametrize(
    "how", ["shape_bigger", "shape_smaller", "past_end", "negative_begin", "unknown_dtype", "no_offsets"]
)
def test_header_that_lies_about_sizes(tmp_path, how):
    d, _ = make_dump(tmp_path)
    f = d / "hidden_states.safetensors"
    header, data = split_safetensors(f)
    _lie(header, how, len(data))
    join_safetensors(f, header, data)
    assert validate_code(d) == "bad_tensor_file"


def test_header_length_larger_than_file(tmp_path):
    d, _ = make_dump(tmp_path)
    f = d / "hidden_states.safetensors"
    blob = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(blob)) + blob[8:])
    assert validate_code(d) == "bad_tensor_file"


def test_header_not_json(tmp_path):
    d, _ = make_dump(tmp_path)
    f = d / "hidden_states.safetensors"
    blob = f.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    f.write_bytes(blob[:8] + b"!" * n + blob[8 + n :])
    assert validate_code(d) == "bad_tensor_file"


@pytest.mark.parametrize(
    "shape", [(N, HIDDEN - 2), (N - 1, HIDDEN), (N + 1, HIDDEN), (HIDDEN, N), (N * HIDDEN,), (1, N, HIDDEN)]
)
def test_wrong_shape(tmp_path, shape):
    hs = hidden_states()
    hs[4] = torch.randn(*shape).to(torch.bfloat16)
    d, _ = make_dump(tmp_path, hs=hs)
    assert validate_code(d) == "wrong_shape"


def test_hidden_size_differs_from_expected(tmp_path):
    d, _ = make_dump(tmp_path)
    assert validate_code(d, expect_hidden=HIDDEN * 2) == "wrong_shape"


@pytest.mark.parametrize(
    ("meta_dtype", "tensor_dtype"),
    [
        ("bfloat16", torch.float16),
        ("bfloat16", torch.float32),
        ("float32", torch.bfloat16),
        ("float16", torch.bfloat16),
    ],
)
def test_tensor_dtype_differs_from_meta(tmp_path, meta_dtype, tensor_dtype):
    hs = hidden_states(getattr(torch, meta_dtype))
    hs[7] = hs[7].to(tensor_dtype)
    d, _ = make_dump(tmp_path, dtype=meta_dtype, hs=hs)
    assert validate_code(d) == "wrong_dtype"


@pytest.mark.parametrize("name", ["float64", "int8", "bf16", "fp8"])
def test_meta_dtype_not_allowed(tmp_path, name):
    d, _ = make_dump(tmp_path)
    edit_meta(d, dtype=name)
    assert validate_code(d) == "wrong_dtype"


def test_dtype_differs_from_expected(tmp_path):
    d, _ = make_dump(tmp_path)
    assert validate_code(d, expect_dtype="float16") == "wrong_dtype"


def write_as_shard(d: Path, out: Path, sample_id: str = "s"):
    """Validate a dump and write it as a one-sample shard, as the service does."""
    dump = validate(d, read_meta(d))
    ids = np.arange(dump.num_tokens, dtype=np.int64)  # the ids play no part in what is checked here
    layers = [int(i) for i in dump.meta["layers"]]
    return write_shard(
        out,
        [ShardSample(sample_id, ids, np.ones_like(ids), dump.layers)],
        layers,
        dump.meta["dtype"],
        int(dump.meta["hidden_size"]),
    )


def non_finite_reasons(d: Path, out: Path) -> dict[str, str]:
    with pytest.raises(NonFiniteSamples) as ei:
        write_as_shard(d, out)
    assert not out.exists() and not list(out.parent.glob(".*.tmp-*"))
    return ei.value.reasons


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_values_pass_validation_and_are_refused_by_the_shard_writer(tmp_path, dtype, bad):
    """Validation does not read the values (that would read every dump twice, once on the request
    path); the shard writer reads each value as it copies it and refuses the sample."""
    hs = hidden_states(getattr(torch, dtype))
    hs[LAYERS[-1]][N - 1, HIDDEN - 1] = bad  # the very last value of the last layer
    d, _ = make_dump(tmp_path, dtype=dtype, hs=hs)
    assert validate(d, read_meta(d)).num_tokens == N
    reasons = non_finite_reasons(d, tmp_path / "out" / "shard.safetensors")
    assert reasons == {"s": f"layer_{LAYERS[-1]} holds NaN or Inf"}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("last", ["finite", "inf"])
def test_extreme_finite_values_pass_and_a_late_inf_is_found(tmp_path, dtype, last):
    """The largest finite values of either sign are finite; an inf past the first reduction (more
    than a million values per layer) and, for float32, past the first 8 MiB copy chunk is found."""
    n = 600  # 600 x 4096 values per layer
    big = torch.finfo(getattr(torch, dtype)).max
    signs = torch.where(torch.arange(n * 4096) % 2 == 0, 1.0, -1.0).reshape(n, 4096)
    hs = {i: (signs * big).to(getattr(torch, dtype)) for i in LAYERS}
    if last == "inf":
        hs[LAYERS[-1]][n - 1, 4095] = float("inf")
    d, _ = make_dump(tmp_path, ids=list(range(1, n + 1)), dtype=dtype, hs=hs, hidden=4096)
    out = tmp_path / "out" / "shard.safetensors"
    if last == "inf":
        assert non_finite_reasons(d, out) == {"s": f"layer_{LAYERS[-1]} holds NaN or Inf"}
    else:
        assert write_as_shard(d, out).num_tokens == n
        assert load_file(str(out))[f"layer_{LAYERS[-1]}"].abs().max().item() == big


@pytest.mark.parametrize("expect", [[2, 4, 7, 8], [2, 4, 6], [3]])
def test_layers_missing_from_expected(tmp_path, expect):
    d, _ = make_dump(tmp_path)
    assert validate_code(d, expect_layers=expect) == "wrong_layers"


def test_a_dump_of_more_layers_than_expected_keeps_those_expected(tmp_path):
    """A server may capture more than a job asks for: the staged dump keeps the job's layers only, for the
    flusher and for a restart's load_staged alike."""
    d, _ = make_dump(tmp_path)
    dump = validate(d, read_meta(d), expect_layers=[2, 7])
    kept = keep_layers(dump, [2, 7])
    assert list(kept.layers) == [2, 7] and kept.meta["layers"] == [2, 7]
    again = load_staged(d)
    assert again.meta["layers"] == [2, 7] and list(again.layers) == [2, 7]
    assert keep_layers(kept, [2, 7]) is kept


@pytest.mark.parametrize(
    "layers", [[2, 4, 7, 7], [2, 2, 4, 7], [7, 4, 2], [2, 7, 4]], ids=["last-twice", "first-twice", "desc", "unsorted"]
)
def test_meta_listing_a_layer_twice_or_out_of_order_is_a_bad_dump(tmp_path, layers):
    """Each listed layer would be a tensor of the shard: twice is a file no reader opens."""
    d, _ = make_dump(tmp_path)
    edit_meta(d, layers=layers)
    with pytest.raises(DumpRejected) as ei:
        read_meta(d)
    assert ei.value.code == "bad_meta" and str(layers) in ei.value.reason
    # validate checks a meta it is handed too, and so does reopening a staged dump
    assert reject_code(validate, d, json.loads((d / "meta.json").read_text())) == "bad_meta"
    assert reject_code(load_staged, d) == "bad_meta"


@pytest.mark.parametrize(
    "changes",
    [{"layers": None}, {"layers": [2, "four"]}, {"hidden_size": "wide"}, {"cached_tokens": "some"}],
    ids=["layers-null", "layers-str", "hidden-str", "cached-str"],
)
def test_malformed_meta_values_are_rejected_not_crashed(tmp_path, changes):
    d, _ = make_dump(tmp_path)
    meta = edit_meta(d, **changes)
    try:
        validate(d, meta)
    except DumpRejected:
        return
    pytest.fail("a dump with malformed meta values was accepted")


# --- legacy layer_<i>.pt ----------------------------------------------------------------------


def test_legacy_pt_dump_accepted_with_exact_bytes(tmp_path):
    hs = hidden_states()
    hs[4] = torch.randn(HIDDEN, N).to(torch.bfloat16).t()  # a non-contiguous view: rows must come out in order
    d = make_legacy_dump(tmp_path, "old", hs)
    assert not (d / "hidden_states.safetensors").exists()
    dump = validate(d, read_meta(d), expect_layers=LAYERS, expect_hidden=HIDDEN, expect_dtype="bfloat16")
    assert sorted(dump.layers) == LAYERS
    for i, t in hs.items():
        assert isinstance(dump.layers[i], bytes)
        assert dump.layers[i] == raw(t)
    assert dump.nbytes == len(LAYERS) * N * HIDDEN * 2


def test_legacy_pt_missing_layer(tmp_path):
    hs = hidden_states()
    d = make_legacy_dump(tmp_path, "old", hs)
    (d / "layer_7.pt").unlink()
    assert validate_code(d) == "missing_layer"


@pytest.mark.parametrize(
    "obj",
    [lambda t: {"hidden": t}, lambda t: [t], lambda t: 3.5, lambda t: "layer"],
    ids=["dict", "list", "float", "str"],
)
def test_legacy_pt_holding_a_non_tensor(tmp_path, obj):
    hs = hidden_states()
    d = make_legacy_dump(tmp_path, "old", hs)
    torch.save(obj(hs[4]), d / "layer_4.pt")
    assert validate_code(d) == "bad_tensor_file"


def test_legacy_pt_truncated(tmp_path):
    d = make_legacy_dump(tmp_path, "old", hidden_states())
    f = d / "layer_2.pt"
    f.write_bytes(f.read_bytes()[:-40])
    assert validate_code(d) == "bad_tensor_file"


def test_legacy_pt_wrong_shape_and_dtype(tmp_path):
    hs = hidden_states()
    hs[2] = hs[2][:, :-1]
    d = make_legacy_dump(tmp_path, "a", hs)
    assert validate_code(d) == "wrong_shape"
    hs = hidden_states()
    hs[2] = hs[2].float()
    d = make_legacy_dump(tmp_path, "b", hs)
    assert validate_code(d) == "wrong_dtype"


def test_legacy_pt_non_finite(tmp_path):
    hs = hidden_states()
    hs[7][0, 0] = float("nan")
    d = make_legacy_dump(tmp_path, "old", hs)
    assert non_finite_reasons(d, tmp_path / "out" / "shard.safetensors") == {"s": "layer_7 holds NaN or Inf"}


class _Payload:
    """Unpickling this creates `marker`: a stand-in for a pickle that runs code."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_legacy_pt_hostile_pickle_is_never_executed(tmp_path):
    d = make_legacy_dump(tmp_path, "old", hidden_states())
    marker = tmp_path / "pwned"
    torch.save(_Payload(marker), d / "layer_4.pt")
    assert validate_code(d) == "bad_tensor_file"
    assert not marker.exists()
    assert reject_code(load_staged, d) == "bad_tensor_file"
    assert not marker.exists()
    # The payload is live: an unrestricted load does run it, so the checks above can fail.
    f = torch.load(d / "layer_4.pt", weights_only=False)
    f.close()
    assert marker.exists()


def test_safetensors_preferred_over_legacy_files(tmp_path):
    d, hs = make_dump(tmp_path)
    torch.save({"not": "a tensor"}, d / "layer_2.pt")
    dump = validate(d, read_meta(d))
    assert dump.layers[2].read() == raw(hs[2])


# --- load_staged and move_out ------------------------------------------------------------------


def test_load_staged_after_move_out(tmp_path):
    root = tmp_path / "root"
    d, hs = make_dump(root, "17")
    dest = move_out(d, tmp_path / "staging" / "job" / "000000001-a1")
    assert not d.exists() and dest.is_dir()
    dump = load_staged(dest)
    assert dump.path == dest and dump.num_tokens == N
    assert dump.meta == json.loads((dest / "meta.json").read_text())
    assert {i: s.read() for i, s in dump.layers.items()} == {i: raw(t) for i, t in hs.items()}


def test_move_out_replaces_a_leftover_destination(tmp_path):
    d, hs = make_dump(tmp_path / "root")
    dest = tmp_path / "staging" / "x"
    dest.mkdir(parents=True)
    (dest / "stale").write_text("old attempt")
    move_out(d, dest)
    assert not (dest / "stale").exists()
    assert load_staged(dest).layers[2].read() == raw(hs[2])


def test_load_staged_legacy_gives_bytes(tmp_path):
    hs = hidden_states()
    d = make_legacy_dump(tmp_path, "old", hs)
    dump = load_staged(d)
    assert dump.layers == {i: raw(t) for i, t in hs.items()}


def test_load_staged_rejections(tmp_path):
    d, _ = make_dump(tmp_path, "a")
    (d / "done").unlink()
    assert reject_code(load_staged, d) == "incomplete"
    d, _ = make_dump(tmp_path, "b")
    edit_meta(d, layers=DELETE)
    assert reject_code(load_staged, d) == "bad_meta"
    d, _ = make_dump(tmp_path, "c")
    edit_meta(d, layers=[2, 3])
    assert reject_code(load_staged, d) == "missing_layer"
    d, _ = make_dump(tmp_path, "d")
    f = d / "hidden_states.safetensors"
    f.write_bytes(f.read_bytes()[:-3])
    assert reject_code(load_staged, d) == "bad_tensor_file"


# --- DumpRoot -----------------------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import sys
    from hsx.backends.dumps import DumpRoot, DumpRootBusy

    def attempt():
        r = DumpRoot(sys.argv[1])
        try:
            r.acquire()
        except DumpRootBusy:
            return "busy"
        r.release()
        return "acquired"

    print(attempt(), flush=True)
    sys.stdin.readline()  # the parent releases its lock, then says go
    print(attempt(), flush=True)
    """
)


def test_dump_root_lock_excludes_another_process(tmp_path):
    root_path = tmp_path / "hs"
    root = DumpRoot(root_path)
    root.acquire()
    assert root_path.is_dir()
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(root_path)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = child.stdout.readline().strip()
        root.release()
        rest, err = child.communicate("go\n", timeout=60)
    finally:
        root.release()
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == 0, err
    assert first == "busy", err
    assert rest.strip() == "acquired"


def test_dump_root_lock_is_per_open_file(tmp_path):
    a, b = DumpRoot(tmp_path / "hs"), DumpRoot(tmp_path / "hs")
    a.acquire()
    try:
        with pytest.raises(DumpRootBusy):
            b.acquire()
    finally:
        a.release()
    b.acquire()
    b.release()
    b.release()  # releasing twice is harmless


def test_clear_removes_only_req_dirs(tmp_path):
    root = DumpRoot(tmp_path / "hs")
    make_dump(root.path, "0")
    make_dump(root.path, "abc")
    (root.path / "req_partial").mkdir()
    (root.path / "req_partial" / "meta.json").write_text("{")
    (root.path / "req_file").write_text("a file, not a dump")
    (root.path / "keep").mkdir()
    (root.path / "keep" / "done").touch()
    (root.path / "notes.txt").write_text("x")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious").write_text("y")
    os.symlink(outside, root.path / "req_link")
    root.clear()
    for name in ("req_0", "req_abc", "req_partial"):
        assert not (root.path / name).exists()
    assert (root.path / "req_file").read_text() == "a file, not a dump"
    assert (root.path / "keep" / "done").exists()
    assert (root.path / "notes.txt").read_text() == "x"
    assert (outside / "precious").read_text() == "y"  # never deletes through a link
    assert root.completed() == []


def test_completed_lists_only_dirs_with_done(tmp_path):
    root = DumpRoot(tmp_path / "hs")
    assert root.entries() == [] and root.completed() == []  # the root does not exist yet
    make_dump(root.path, "1")
    make_dump(root.path, "rid-x")
    d, _ = make_dump(root.path, "2")
    (d / "done").unlink()
    (root.path / "other").mkdir()
    (root.path / "other" / "done").touch()
    (root.path / "req_9").write_text("")
    assert sorted(p.name for p in root.completed()) == ["req_1", "req_rid-x"]
    assert sorted(p.name for p in root.entries()) == ["req_1", "req_2", "req_rid-x"]
    assert root.rid_dir("rid-x") == root.path / "req_rid-x"
