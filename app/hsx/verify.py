"""Check a job folder against its manifest: every shard's bytes, and every sample's rows.

`verify_job(job_dir)` is a pure function of the folder: it reads, never writes, and returns a
`VerifyReport` whose `to_dict()` is JSON-serialisable. It checks

- the manifest: readable, `hsx-manifest/1`, its header as `hsx.manifest` describes it, with layers,
  hidden_size and a float dtype, and its shard and sample entries one by one;
- each shard: present, byte size and sha256 as recorded, a safetensors header with `input_ids` and
  `loss_mask` int64 [T] and `layer_<i>` [T, hidden_size] of the manifest's dtype for every layer,
  T equal to the recorded num_tokens, its own `sample_ids` / `offsets` metadata agreeing with the manifest;
- each sample: a known shard, rows `offset .. offset + num_tokens` inside it and overlapping no other
  sample's, ids unique, per-shard counts as recorded; then its rows themselves, read straight from the
  shard file a chunk at a time (never a shard whole): shapes, token ids in range, loss_mask 0/1, and
  every hidden-state value finite.

A job stored lossless or in fp8 (the manifest's `encoding`, hsx.storage.encoding) has shards that say
the same encoding, with each layer's tensors as the encoding specifies them and, for lossless, an index
that covers the shard's rows in blocks no larger than the writer makes; the sha256 is of the stored
bytes as for any shard, and each sample's layers are decoded through the readers' own decoders (every
zstd frame of its blocks with its declared size and checksum, every code and scale) and their values
checked as a raw sample's are. Frames written before they carried a checksum are a warning, not a
fault. The manifest's `encoded_layers` must name each of the job's layers once, with the raw bytes its
rows take, the bytes its shards' tensors hold, and for fp8 errors within the encoding's bound.

It needs no torch: rows are read as numpy arrays (bfloat16 as its bit patterns, tested for NaN and Inf
by integer arithmetic), so the service and `hsx verify` run it on the base install.
Faults are listed per shard and per sample (at most `max_faults`; `summary` counts them all).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, TypedDict, TypeVar, cast

import numpy as np
from pydantic import BaseModel, ValidationError

from hsx.dtypes import DTYPES_BY_CODE
from hsx.layers import layer_key
from hsx.manifest import (
    EncodedLayer,
    HiddenStates,
    ManifestHeader,
    ManifestSample,
    ManifestShard,
    locate,
    manifest_problems,
)
from hsx.storage.atomic import TEMP_NAME
from hsx.storage.encoding import Encoding, encoding_of, same_encoding
from hsx.storage.errors import ShardError
from hsx.storage.finite import FloatBits
from hsx.storage.mapped import Layout, MappedShard
from hsx.storage.placement import Placement
from hsx.storage.safetensors_raw import SafetensorsFormatError, TensorSpan, read_index, read_metadata

HASH_CHUNK = 8 * 1024 * 1024

_Entry = TypeVar("_Entry", bound=BaseModel)


@dataclass
class Fault:
    kind: str
    message: str
    shard: str | None = None
    sample: str | None = None

    def to_dict(self) -> dict[str, str]:
        return {k: v for k, v in asdict(self).items() if v is not None}


class Summary(TypedDict, total=False):
    """What a verification counted; every fault is counted, though at most max_faults are listed."""

    shards: int
    shards_ok: int
    samples: int
    samples_ok: int
    samples_read: int
    tokens: int
    bytes: int
    checked_hashes: bool
    checked_values: bool
    faults: int
    faults_by_kind: dict[str, int]
    faults_listed: int


@dataclass
class VerifyReport:
    job_dir: str
    job_faults: list[Fault] = field(default_factory=list)
    shard_faults: list[Fault] = field(default_factory=list)
    sample_faults: list[Fault] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    summary: Summary = field(default_factory=Summary)

    @property
    def ok(self) -> bool:
        return not self.summary.get("faults", 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "job_dir": self.job_dir,
            "ok": self.ok,
            "summary": self.summary,
            "job_faults": [f.to_dict() for f in self.job_faults],
            "shard_faults": [f.to_dict() for f in self.shard_faults],
            "sample_faults": [f.to_dict() for f in self.sample_faults],
            "warnings": list(self.warnings),
        }


class _Faults:
    def __init__(self, report: VerifyReport, limit: int):
        self.report, self.limit = report, limit
        self.kinds: Counter[str] = Counter()
        self.bad_shards: set[str] = set()
        self.bad_samples: set[str] = set()

    def _add(self, bucket: list[Fault], fault: Fault) -> None:
        self.kinds[fault.kind] += 1
        if sum(self.kinds.values()) <= self.limit:
            bucket.append(fault)

    def job(self, kind: str, message: str) -> None:
        self._add(self.report.job_faults, Fault(kind, message))

    def shard(self, shard: str, kind: str, message: str) -> None:
        self.bad_shards.add(shard)
        self._add(self.report.shard_faults, Fault(kind, message, shard=shard))

    def sample(self, sample: str, shard: str | None, kind: str, message: str) -> None:
        self.bad_samples.add(sample)
        self._add(self.report.sample_faults, Fault(kind, message, shard=shard, sample=sample))


def _sha256(path: Path, work: _Work | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
            if work is not None:
                work.advance(len(chunk))
    return h.hexdigest()


class _Work:
    """The check's progress in bytes read: each listed shard file once for its sha256 and once for its rows,
    reported to `report(done, total)`."""

    def __init__(self, report: Callable[[int, int], None] | None) -> None:
        self.report = report
        self.done = self.total = 0

    def plan(self, job_dir: Path, shard_docs: list[dict[str, Any]], passes: int) -> None:
        names = {d.get("name") for d in shard_docs if isinstance(d.get("name"), str)}
        sizes = (job_dir / str(n) for n in names)
        self.total = passes * sum(p.stat().st_size for p in sizes if p.is_file())
        self.moveto(0)

    def advance(self, n: int) -> None:
        self.moveto(self.done + n)

    def moveto(self, done: int) -> None:
        self.done = min(done, self.total)
        if self.report is not None:
            self.report(self.done, self.total)


def _parse(model: type[_Entry], doc: dict[str, Any]) -> tuple[_Entry | None, list[str]]:
    """A manifest entry as `model`, or the fields that keep it from being one."""
    try:
        return model.model_validate(doc), []
    except ValidationError as exc:
        return None, list(dict.fromkeys(str(e["loc"][0]) for e in exc.errors() if e["loc"]))


class ShardRows:
    """A shard's tensors read by row range straight from its file, where its header places them; an
    encoded shard's layers decoded from a mapping of it (`decoded`)."""

    def __init__(self, path: Path, spans: dict[str, TensorSpan], decoded: MappedShard | None = None):
        self.spans = spans
        self.decoded = decoded
        self._fd = os.open(path, os.O_RDONLY)

    def __enter__(self) -> ShardRows:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)

    def _layer(self, key: str) -> bool:
        return self.decoded is not None and self.decoded.decodes(key)

    def dtype(self, key: str) -> str:
        code = (
            self.decoded.layout(key).dtype if self.decoded is not None and self._layer(key) else self.spans[key].dtype
        )
        return DTYPES_BY_CODE[code].name

    def rows(self, key: str, start: int, stop: int) -> np.ndarray:
        """Rows start..stop of tensor `key` (fewer past its end); bfloat16 as uint16 bit patterns."""
        if self.decoded is not None and self._layer(key):
            layout = self.decoded.layout(key)
            decoded = self.decoded.rows(key, min(start, layout.shape[0]), min(stop, layout.shape[0]))
            return decoded.view(DTYPES_BY_CODE[layout.dtype].numpy).reshape(-1, *layout.shape[1:])
        span = self.spans[key]
        data = span.read_rows(self._fd, start, stop)
        return np.frombuffer(data, dtype=DTYPES_BY_CODE[span.dtype].numpy).reshape(-1, *span.shape[1:])


def _wanted(encoding: Encoding, total: int, hs: HiddenStates) -> dict[str, tuple[str, tuple[int, ...] | None]]:
    """The tensors a shard of `total` rows holds in this encoding: dtype code and shape (None: one axis,
    any length, which decoding checks)."""
    want: dict[str, tuple[str, tuple[int, ...] | None]] = {
        "input_ids": ("I64", (total,)),
        "loss_mask": ("I64", (total,)),
    }
    for i in hs.layers:
        for name, spec in encoding.specs(layer_key(i), total, hs.dtype, hs.hidden_size).items():
            want[name] = (spec.code, spec.shape)
    return want


def _shard_tensors(
    path: Path, entry: ManifestShard, check: _Check
) -> tuple[dict[str, TensorSpan], MappedShard | None] | None:
    """Check a shard's header against the manifest; its tensors (and, encoded, its decoder), if their
    rows can be read."""
    name, faults, hs, encoding = entry.name, check.faults, check.hidden_states, check.encoding
    try:
        spans = read_index(path)
        metadata = read_metadata(path)
    except (SafetensorsFormatError, OSError) as exc:
        faults.shard(name, "header_invalid", str(exc))
        return None
    try:
        same_encoding(metadata, encoding.name)
    except ShardError as exc:
        faults.shard(name, "encoding_mismatch", exc.problem)
        return None
    ok = True
    for key, (dtype, shape) in _wanted(encoding, entry.num_tokens, hs).items():
        span = spans.get(key)
        if span is None:
            faults.shard(name, "tensor_missing", f"no tensor {key}")
            ok = False
        elif span.dtype != dtype:
            faults.shard(name, "tensor_dtype", f"{key} is {span.dtype}, the manifest says {dtype}")
            ok = False
        elif span.shape != shape and (shape is not None or len(span.shape) != 1):
            faults.shard(name, "tensor_shape", f"{key} has shape {list(span.shape)}, expected {list(shape or ['N'])}")
            ok = False
    if not ok:
        return None
    if encoding.encoded:
        check.stats_shapes.append({n: span.shape for n, span in spans.items()})
        return _decoder(path, entry, check)
    return spans, None


def _decoder(path: Path, entry: ManifestShard, check: _Check) -> tuple[dict[str, TensorSpan], MappedShard] | None:
    """An encoded shard mapped for decoding, once its metadata and its layers' indexes hold together
    (the checks every reader makes before it decodes)."""
    hs = check.hidden_states
    try:
        shard = MappedShard(path)
        for i in hs.layers:
            layout = shard.layout(layer_key(i))
            if layout != Layout(hs.dtype.code, (entry.num_tokens, hs.hidden_size)):
                raise ShardError(
                    f"{layer_key(i)} decodes to {layout.dtype} {list(layout.shape)}, the manifest says "
                    f"{hs.dtype.code} {[entry.num_tokens, hs.hidden_size]}"
                )
            layer = shard.layer(layer_key(i))
            if layer is not None and layer.unchecked():
                check.unchecked[entry.name] = check.unchecked.get(entry.name, 0) + layer.unchecked()
    except ShardError as exc:
        where = "" if exc.layer is None else f"{exc.layer}: "
        check.faults.shard(entry.name, "encoding_invalid", where + exc.problem)
        return None
    return shard.spans, shard


def _shard_metadata(path: Path, name: str, placed: list[ManifestSample], faults: _Faults) -> None:
    """The shard's own __metadata__ (sample_ids, offsets) must place each sample where the manifest does:
    the readers take a sample's rows from there, and refuse a manifest that disagrees."""
    try:
        total = read_index(path)["input_ids"].shape[0]
        placement = Placement.of(read_metadata(path), total)
    except ShardError as exc:
        faults.shard(name, "metadata_invalid", exc.problem)
        return
    except Exception as exc:  # any unreadable metadata is a fault, not a crash
        faults.shard(name, "metadata_invalid", f"unreadable __metadata__: {exc}")
        return
    for s in placed:
        found = placement.rows.get(s.id)
        if found != (s.offset, s.offset + s.num_tokens):
            where = "does not hold it" if found is None else f"at rows {found[0]}..{found[1]}"
            faults.sample(
                s.id,
                name,
                "metadata_mismatch",
                f"the manifest places it at rows {s.offset}..{s.offset + s.num_tokens}, the shard's metadata {where}",
            )


def _check_rows(
    rows: ShardRows,
    name: str,
    s: ManifestSample,
    *,
    hs: HiddenStates,
    vocab: int | None,
    chunk_rows: int,
    faults: _Faults,
) -> None:
    sid, start, n = s.id, s.offset, s.num_tokens
    for key in ("input_ids", "loss_mask"):
        t = rows.rows(key, start, start + n)
        if t.shape != (n,) or rows.dtype(key) != "int64":
            faults.sample(
                sid, name, "sample_shape", f"{key} rows are {rows.dtype(key)} {list(t.shape)}, expected int64 [{n}]"
            )
            continue
        if key == "input_ids":
            bad = (t < 0) if vocab is None else ((t < 0) | (t >= vocab))
            if bad.any():
                row = int(np.flatnonzero(bad)[0])
                faults.sample(
                    sid,
                    name,
                    "bad_token_id",
                    f"input_ids[{row}] = {int(t[row])} is outside [0, {vocab if vocab is not None else 'inf'})",
                )
        elif ((t != 0) & (t != 1)).any():
            faults.sample(sid, name, "bad_loss_mask", "loss_mask holds values other than 0 and 1")
    bits = FloatBits.of(hs.dtype)
    for layer in hs.layers:
        key = layer_key(layer)
        for lo in range(0, n, chunk_rows):
            count = min(chunk_rows, n - lo)
            t = rows.rows(key, start + lo, start + lo + count)
            if t.shape != (count, hs.hidden_size):
                faults.sample(
                    sid,
                    name,
                    "sample_shape",
                    f"{key} rows are {rows.dtype(key)} {list(t.shape)}, "
                    f"expected {hs.dtype.name} [{count}, {hs.hidden_size}]",
                )
                break
            nan, inf = bits.nan_and_inf(t)
            if nan.any() or inf.any():
                first = int(np.flatnonzero((nan | inf).any(axis=1))[0])
                faults.sample(
                    sid,
                    name,
                    "non_finite",
                    f"{key} has {int(nan.sum())} NaN and {int(inf.sum())} inf values, first in token {lo + first}",
                )
                break


def verify_job(
    job_dir: Path,
    *,
    check_hashes: bool = True,
    check_values: bool = True,
    chunk_rows: int = 4096,
    max_faults: int = 1000,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Check the job folder (or its manifest.json) against its manifest; see the module docstring.
    `progress(done, total)` follows the bytes read (each shard once per check that reads it)."""
    job_dir, manifest_path = locate(job_dir)
    report = VerifyReport(str(job_dir))
    faults = _Faults(report, max_faults)
    summary: Summary = {
        "shards": 0,
        "shards_ok": 0,
        "samples": 0,
        "samples_ok": 0,
        "samples_read": 0,
        "tokens": 0,
        "bytes": 0,
        "checked_hashes": check_hashes,
        "checked_values": check_values,
    }
    report.summary = summary
    doc = _read_manifest(manifest_path, faults)
    placement: dict[str, str | None] = {}
    problems = manifest_problems(doc) if doc is not None else []
    for problem in problems:
        faults.job("manifest_invalid", problem)
    if doc is not None and not problems:
        check = _Check(
            job_dir,
            ManifestHeader.model_validate(doc),
            faults,
            summary,
            check_hashes=check_hashes,
            check_values=check_values,
            chunk_rows=max(1, chunk_rows),
            work=_Work(progress),
        )
        _verify_contents(check, doc["shards"], doc["samples"])
        placement = check.placement
    summary["faults"] = sum(faults.kinds.values())
    summary["faults_by_kind"] = dict(sorted(faults.kinds.items()))
    summary["faults_listed"] = len(report.job_faults) + len(report.shard_faults) + len(report.sample_faults)
    summary["shards_ok"] = summary["shards"] - len(faults.bad_shards)
    # a sample is ok when nothing is wrong with it nor with the shard it lives in
    summary["samples_ok"] = sum(
        1 for sid, shard in placement.items() if sid not in faults.bad_samples and shard not in faults.bad_shards
    )
    return report


def _read_manifest(manifest_path: Path, faults: _Faults) -> dict[str, Any] | None:
    """The manifest's JSON document, or None (a job fault says why)."""
    try:
        doc = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        faults.job("manifest_missing", f"{manifest_path} does not exist")
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        faults.job("manifest_unreadable", f"{manifest_path}: {exc}")
        return None
    return cast("dict[str, Any]", doc)  # manifest_problems says what a document that is not an object lacks


@dataclass
class _Check:
    """One folder's check against its manifest: what it is asked to do, and what it has found so far."""

    job_dir: Path
    manifest: ManifestHeader
    faults: _Faults
    summary: Summary
    check_hashes: bool
    check_values: bool
    chunk_rows: int
    work: _Work
    shards: dict[str, ManifestShard | None] = field(default_factory=dict)  # None: listed, but its entry is not valid
    # shards whose rows can be read: their tensors, and an encoded one's decoder
    readable: dict[str, tuple[dict[str, TensorSpan], MappedShard | None]] = field(default_factory=dict)
    by_shard: dict[str, list[ManifestSample]] = field(default_factory=dict)  # the samples placed in each shard
    placement: dict[str, str | None] = field(default_factory=dict)  # each sample id's shard, to count sound ones
    seen: set[str] = field(default_factory=set)  # sample ids met so far
    # every encoded shard's tensors' shapes (to add up what its layers' stats count), while all are readable
    stats_shapes: list[dict[str, tuple[int, ...]]] = field(default_factory=list)
    unchecked: dict[str, int] = field(default_factory=dict)  # per shard, its pieces that carry no checksum

    @cached_property
    def hidden_states(self) -> HiddenStates:
        return self.manifest.hidden_states()

    @cached_property
    def encoding(self) -> Encoding:
        return encoding_of(self.manifest.encoding)


def _verify_contents(check: _Check, shard_docs: list[dict[str, Any]], sample_docs: list[dict[str, Any]]) -> None:
    """Check shards and samples; `check.placement` is each sample id's shard afterwards."""
    check.summary["shards"] = len(shard_docs)
    check.work.plan(check.job_dir, shard_docs, int(check.check_hashes) + int(check.check_values))
    for doc in shard_docs:
        _check_shard_entry(check, doc)
    check.summary["samples"] = len(sample_docs)
    for doc in sample_docs:
        _place_sample(check, doc)
    _check_overlaps(check)
    _check_shard_counts(check)
    _check_encoded_layers(check)
    if check.unchecked:
        check.faults.report.warnings.append(
            f"{sum(check.unchecked.values())} {check.encoding.unchecked_note} in {len(check.unchecked)} shard(s): "
            "damage inside them is found by the shards' sha256 alone"
        )
    if check.manifest.num_stored != len(sample_docs):
        check.faults.job(
            "count_mismatch", f"num_stored is {check.manifest.num_stored} but {len(sample_docs)} samples are listed"
        )
    _warn_unlisted(check.job_dir, set(check.shards), check.faults.report)
    if check.check_values:
        _check_values(check)


def _check_shard_entry(check: _Check, doc: dict[str, Any]) -> None:
    """One entry of the manifest's shards, and its file if the entry is valid."""
    faults = check.faults
    entry, bad = _parse(ManifestShard, doc)
    name = doc.get("name")
    if "name" in bad or not isinstance(name, str):
        faults.job("manifest_invalid", f"shard name {name!r} is not a file name")
        return
    if name in check.shards:
        faults.shard(name, "duplicate_shard", "listed twice in the manifest")
        return
    check.shards[name] = entry
    if entry is None:
        faults.shard(name, "manifest_invalid", f"entry lacks a valid {', '.join(bad)}")
        return
    _check_shard_file(check, name, entry)


def _check_shard_file(check: _Check, name: str, entry: ManifestShard) -> None:
    """The shard's file: there, of the recorded size and sha256, with the tensors the manifest implies."""
    faults = check.faults
    path = check.job_dir / name
    if not path.is_file():
        faults.shard(name, "shard_missing", f"{path} does not exist")
        return
    size = path.stat().st_size
    check.summary["bytes"] += size
    if size != entry.bytes:
        faults.shard(name, "size_mismatch", f"{size} bytes on disk, the manifest records {entry.bytes}")
    if check.check_hashes:
        digest = _sha256(path, check.work)
        if digest != entry.sha256:
            faults.shard(name, "sha256_mismatch", f"sha256 {digest}, the manifest records {entry.sha256}")
    readable = _shard_tensors(path, entry, check)
    if readable is not None:
        check.readable[name] = readable


def _place_sample(check: _Check, doc: dict[str, Any]) -> None:
    """One entry of the manifest's samples: valid, unique, in a listed shard and inside its rows."""
    faults = check.faults
    sample, bad = _parse(ManifestSample, doc)
    sid, shard = doc.get("id"), doc.get("shard")
    label = str(sid)
    check.placement.setdefault(label, shard if isinstance(shard, str) else None)
    if "id" in bad or not isinstance(sid, str):
        faults.sample(label, None, "manifest_invalid", f"sample id {sid!r} is not a string")
        return
    if sid in check.seen:
        faults.sample(label, shard, "duplicate_sample_id", "sample id listed twice")
        return
    check.seen.add(sid)
    if not isinstance(shard, str) or shard not in check.shards:
        faults.sample(
            label,
            shard if isinstance(shard, str) else None,
            "unknown_shard",
            f"its shard {shard!r} is not among the manifest's shards",
        )
        return
    if sample is None:
        faults.sample(
            label,
            shard,
            "manifest_invalid",
            f"offset {doc.get('offset')!r} / num_tokens {doc.get('num_tokens')!r} are not valid",
        )
        return
    check.summary["tokens"] += sample.num_tokens
    entry = check.shards[shard]
    if entry is not None and sample.offset + sample.num_tokens > entry.num_tokens:
        faults.sample(
            label,
            shard,
            "out_of_range",
            f"rows {sample.offset}..{sample.offset + sample.num_tokens} end past the shard's {entry.num_tokens} rows",
        )
        return
    check.by_shard.setdefault(shard, []).append(sample)


def _check_overlaps(check: _Check) -> None:
    """No two samples of a shard share a row."""
    for name, placed in check.by_shard.items():
        placed.sort(key=lambda s: (s.offset, s.num_tokens))
        for a, b in itertools.pairwise(placed):
            if b.offset < a.offset + a.num_tokens:
                check.faults.sample(
                    b.id,
                    name,
                    "overlap",
                    f"rows {b.offset}..{b.offset + b.num_tokens} "
                    f"overlap sample {a.id!r} ({a.offset}..{a.offset + a.num_tokens})",
                )


def _check_shard_counts(check: _Check) -> None:
    """Each valid shard entry's num_samples and num_tokens are what the samples placed in it add up to."""
    for name, listed in check.shards.items():
        if listed is None:
            continue
        placed = check.by_shard.get(name, [])
        n_tokens = sum(s.num_tokens for s in placed)
        if len(placed) != listed.num_samples:
            check.faults.shard(
                name,
                "count_mismatch",
                f"the manifest places {len(placed)} samples in it, its entry records {listed.num_samples}",
            )
        if n_tokens != listed.num_tokens:
            check.faults.shard(
                name, "count_mismatch", f"its samples cover {n_tokens} rows, its entry records {listed.num_tokens}"
            )


def _check_encoded_layers(check: _Check) -> None:
    """The manifest's `encoded_layers`: for an encoded job each of its layers once, each as
    `_layer_stats_problems` checks it; none for a raw job."""
    recorded, encoding, layers = check.manifest.encoded_layers, check.encoding, check.hidden_states.layers
    if not encoding.encoded:
        if recorded:
            check.faults.job("encoded_layers_invalid", f"a {encoding.name} job records encoded_layers")
        return
    if recorded is None:
        check.faults.job("encoded_layers_invalid", f"a {encoding.name} job records no encoded_layers")
        return
    seen = Counter(e.layer for e in recorded)
    for layer in sorted(set(seen) - set(layers)):
        check.faults.job("encoded_layers_invalid", f"encoded_layers names layer {layer}, which the job did not capture")
    for layer in layers:
        if seen[layer] != 1:
            check.faults.job(
                "encoded_layers_invalid", f"encoded_layers lists layer {layer} {seen[layer]} times, not once"
            )
    for e in recorded:
        if e.layer in layers:
            for problem in _layer_stats_problems(check, e):
                check.faults.job("encoded_layers_invalid", f"layer {e.layer}: {problem}")


def _layer_stats_problems(check: _Check, e: EncodedLayer) -> list[str]:
    """One layer's stats: its raw bytes those of the rows the shards list, its bytes what its shards'
    tensors hold (where every shard could be read: the stats add up all of them), its errors what the
    encoding allows."""
    hs, encoding = check.hidden_states, check.encoding
    problems = encoding.error_problems(e.max_error, e.mean_error)
    rows = sum(entry.num_tokens for entry in check.shards.values() if entry is not None)
    raw_bytes = rows * hs.hidden_size * hs.dtype.itemsize
    if e.raw_bytes != raw_bytes:
        problems.append(f"raw_bytes is {e.raw_bytes}, its shards' {rows} rows take {raw_bytes}")
    if len(check.stats_shapes) == len(check.shards):
        stored = sum(encoding.stats_bytes(layer_key(e.layer), shapes, hs.dtype) for shapes in check.stats_shapes)
        if e.bytes != stored:
            problems.append(f"bytes is {e.bytes}, its shards' tensors hold {stored}")
    return problems


def _declared_vocab(manifest: ManifestHeader) -> int | None:
    """The model's vocabulary size, where the manifest records a usable one."""
    declared = (manifest.model or {}).get("vocab_size")
    return declared if isinstance(declared, int) and not isinstance(declared, bool) and declared >= 1 else None


def _check_values(check: _Check) -> None:
    """Every placed sample's rows, read from each readable shard."""
    vocab = _declared_vocab(check.manifest)
    # the rows pass counts each shard's bytes as its samples are read; shards it cannot read count as done
    sizes = {name: (check.job_dir / name).stat().st_size for name in check.readable}
    check.work.moveto(check.work.total - sum(sizes.values()))
    for name in sorted(check.readable):
        path = check.job_dir / name
        placed = check.by_shard.get(name, [])
        _shard_metadata(path, name, placed, check.faults)
        base, tokens, read = check.work.done, max(1, sum(s.num_tokens for s in placed)), 0
        with ShardRows(path, *check.readable[name]) as rows:
            for s in placed:
                read += s.num_tokens
                check.work.moveto(base + sizes[name] * read // tokens)
                try:
                    _check_rows(
                        rows,
                        name,
                        s,
                        hs=check.hidden_states,
                        vocab=vocab,
                        chunk_rows=check.chunk_rows,
                        faults=check.faults,
                    )
                except ShardError as exc:  # what the readers refuse: a frame, a scale, an index
                    where = "" if exc.layer is None else f"{exc.layer}: "
                    check.faults.sample(s.id, name, "damaged", where + exc.problem)
                    continue
                except Exception as exc:  # a read that fails is this sample's fault, not a crash
                    check.faults.sample(s.id, name, "unreadable", f"reading its rows failed: {exc}")
                    continue
                check.summary["samples_read"] += 1
        check.work.moveto(base + sizes[name])


def _warn_unlisted(job_dir: Path, listed: set[str], report: VerifyReport) -> None:
    for p in sorted(job_dir.iterdir()):
        if p.name.startswith("shard-") and p.name.endswith(".safetensors") and p.name not in listed:
            report.warnings.append(f"{p.name} is not in the manifest")
        elif TEMP_NAME.match(p.name):
            report.warnings.append(f"{p.name} looks like a temporary file left by an interrupted write")


def summary_lines(report: VerifyReport) -> list[str]:
    s = report.summary
    lines = [
        f"{report.job_dir}: {'OK' if report.ok else 'FAULTY'}",
        f"  shards {s.get('shards_ok', 0)}/{s.get('shards', 0)} ok, samples {s.get('samples_ok', 0)}/"
        f"{s.get('samples', 0)} ok ({s.get('samples_read', 0)} read), {s.get('tokens', 0)} tokens, "
        f"{_size(s.get('bytes', 0))}",
    ]
    if s.get("faults"):
        kinds = ", ".join(f"{k} {v}" for k, v in s["faults_by_kind"].items())
        lines.append(f"  {s['faults']} faults: {kinds}")
    for f in report.job_faults + report.shard_faults + report.sample_faults:
        where = " ".join(
            x for x in (f"shard {f.shard}" if f.shard else "", f"sample {f.sample!r}" if f.sample else "") if x
        )
        lines.append(f"  - {f.kind}{' (' + where + ')' if where else ''}: {f.message}")
    if s.get("faults", 0) > s.get("faults_listed", 0):
        lines.append(f"  ... {s['faults'] - s['faults_listed']} more faults not listed")
    lines += [f"  warning: {w}" for w in report.warnings]
    return lines


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    e = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**e:.1f} {'BKMGT'[e]}iB"
