"""Check a job folder against its manifest: every shard's bytes, and every sample's rows.

`verify_job(job_dir)` is a pure function of the folder: it reads, never writes, and returns a
`VerifyReport` whose `to_dict()` is JSON-serialisable. It checks

- the manifest: readable, `hsx-manifest/1`, layers / hidden_size / dtype / shards / samples well formed;
- each shard: present, byte size and sha256 as recorded, a safetensors header with `input_ids` and
  `loss_mask` int64 [T] and `layer_<i>` [T, hidden_size] of the manifest's dtype for every layer,
  T equal to the recorded num_tokens, its own `sample_ids` / `offsets` metadata agreeing with the manifest;
- each sample: a known shard, rows `offset .. offset + num_tokens` inside it and overlapping no other
  sample's, ids unique, per-shard counts as recorded; then its rows themselves, read with safetensors'
  `get_slice` a chunk at a time (never a shard whole): shapes, dtype, token ids in range, loss_mask 0/1,
  and every hidden-state value finite.

Faults are listed per shard and per sample (at most `max_faults`; `summary` counts them all).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from hsx.storage.manifest import MANIFEST_FORMAT, MANIFEST_NAME
from hsx.storage.safetensors_raw import CODE_BY_NAME, SafetensorsFormatError, read_index
from hsx.training.reader import TORCH_DTYPES
from safetensors import safe_open

HASH_CHUNK = 8 * 1024 * 1024
FLOAT_DTYPES = ("bfloat16", "float16", "float32", "float64")
_TEMP_NAME = re.compile(r"^\..+\.tmp-\d+$")


@dataclass
class Fault:
    kind: str
    message: str
    shard: str | None = None
    sample: str | None = None

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass
class VerifyReport:
    job_dir: str
    job_faults: list[Fault] = field(default_factory=list)
    shard_faults: list[Fault] = field(default_factory=list)
    sample_faults: list[Fault] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    summary: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.summary.get("faults", 0)

    def to_dict(self) -> dict:
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


def _is_int(v: object, minimum: int = 0) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= minimum


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _check_manifest(m: object, faults: _Faults) -> bool:
    """Whether the manifest's structure allows the shards and samples to be checked at all."""
    if not isinstance(m, dict):
        faults.job("manifest_invalid", "manifest.json is not a JSON object")
        return False
    problems = []
    if m.get("format") != MANIFEST_FORMAT:
        problems.append(f"format is {m.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    layers = m.get("layers")
    if not (
        isinstance(layers, list) and layers and all(_is_int(i) for i in layers) and len(set(layers)) == len(layers)
    ):
        problems.append(f"layers {layers!r} is not a list of distinct layer numbers")
    if not _is_int(m.get("hidden_size"), 1):
        problems.append(f"hidden_size {m.get('hidden_size')!r} is not a positive integer")
    dtype = m.get("dtype")
    if not isinstance(dtype, str) or dtype not in FLOAT_DTYPES:
        problems.append(f"dtype {m.get('dtype')!r} is not a floating-point dtype")
    for key in ("shards", "samples"):
        if not isinstance(m.get(key), list) or not all(isinstance(e, dict) for e in m.get(key) or []):
            problems.append(f"{key} is not a list of objects")
    for p in problems:
        faults.job("manifest_invalid", p)
    return not problems


def _shard_tensors(path: Path, entry: dict, m: dict, faults: _Faults) -> bool:
    """Check a shard's header against the manifest; whether its rows can be read."""
    name = entry["name"]
    try:
        spans = read_index(path)
    except (SafetensorsFormatError, OSError) as exc:
        faults.shard(name, "header_invalid", str(exc))
        return False
    total = entry.get("num_tokens")
    ok = True
    want = {"input_ids": ("I64", (total,)), "loss_mask": ("I64", (total,))}
    want.update({f"layer_{i}": (CODE_BY_NAME[m["dtype"]], (total, m["hidden_size"])) for i in m["layers"]})
    for key, (code, shape) in want.items():
        span = spans.get(key)
        if span is None:
            faults.shard(name, "tensor_missing", f"no tensor {key}")
            ok = False
        elif span.dtype != code:
            faults.shard(name, "tensor_dtype", f"{key} is {span.dtype}, the manifest says {code}")
            ok = False
        elif span.shape != shape:
            faults.shard(name, "tensor_shape", f"{key} has shape {list(span.shape)}, expected {list(shape)}")
            ok = False
    return ok


def _shard_metadata(path: Path, name: str, placed: list[dict], faults: _Faults) -> None:
    """The shard's own __metadata__ (sample_ids, offsets) must agree with the manifest."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        ids, offsets = meta.get("sample_ids"), meta.get("offsets")
        if ids is None or offsets is None:
            return
        ids, offsets = json.loads(ids), json.loads(offsets)
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata is a fault, not a crash
        faults.shard(name, "metadata_invalid", f"unreadable __metadata__: {exc}")
        return
    in_shard = dict(zip(ids, offsets))
    for s in placed:
        if in_shard.get(s["id"]) != s["offset"]:
            faults.sample(
                str(s["id"]),
                name,
                "metadata_mismatch",
                f"the manifest places it at offset {s['offset']}, the shard's metadata at {in_shard.get(s['id'])}",
            )


def _check_rows(handle, name: str, s: dict, m: dict, vocab: int | None, chunk_rows: int, faults: _Faults) -> None:
    sid, start, n = str(s["id"]), s["offset"], s["num_tokens"]
    for key in ("input_ids", "loss_mask"):
        t = handle.get_slice(key)[start : start + n]
        if tuple(t.shape) != (n,) or t.dtype != torch.int64:
            faults.sample(sid, name, "sample_shape", f"{key} rows are {t.dtype} {list(t.shape)}, expected int64 [{n}]")
            continue
        if key == "input_ids":
            bad = (t < 0) if vocab is None else ((t < 0) | (t >= vocab))
            if bool(bad.any()):
                row = int(bad.nonzero()[0, 0])
                faults.sample(
                    sid,
                    name,
                    "bad_token_id",
                    f"input_ids[{row}] = {int(t[row])} is outside [0, {vocab if vocab is not None else 'inf'})",
                )
        elif bool(((t != 0) & (t != 1)).any()):
            faults.sample(sid, name, "bad_loss_mask", "loss_mask holds values other than 0 and 1")
    dtype = TORCH_DTYPES[m["dtype"]]
    for layer in m["layers"]:
        sl = handle.get_slice(f"layer_{layer}")
        for lo in range(0, n, chunk_rows):
            rows = min(chunk_rows, n - lo)
            t = sl[start + lo : start + lo + rows]
            if tuple(t.shape) != (rows, m["hidden_size"]) or t.dtype != dtype:
                faults.sample(
                    sid,
                    name,
                    "sample_shape",
                    f"layer_{layer} rows are {t.dtype} {list(t.shape)}, "
                    f"expected {m['dtype']} [{rows}, {m['hidden_size']}]",
                )
                break
            finite = torch.isfinite(t)
            if not bool(finite.all()):
                bad_rows = (~finite).any(dim=1).nonzero()[:, 0]
                nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
                faults.sample(
                    sid,
                    name,
                    "non_finite",
                    f"layer_{layer} has {nan} NaN and {inf} inf values, first in token {lo + int(bad_rows[0])}",
                )
                break


def verify_job(
    job_dir: Path,
    *,
    check_hashes: bool = True,
    check_values: bool = True,
    chunk_rows: int = 4096,
    max_faults: int = 1000,
) -> VerifyReport:
    """Check the job folder (or its manifest.json) against its manifest; see the module docstring."""
    job_dir = Path(job_dir)
    manifest_path = job_dir / MANIFEST_NAME
    if job_dir.is_file():
        job_dir, manifest_path = job_dir.parent, job_dir
    report = VerifyReport(str(job_dir))
    faults = _Faults(report, max_faults)
    summary = {
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
    try:
        m = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        faults.job("manifest_missing", f"{manifest_path} does not exist")
        m = None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        faults.job("manifest_unreadable", f"{manifest_path}: {exc}")
        m = None
    placement: dict[str, str | None] = {}
    if m is not None and _check_manifest(m, faults):
        placement = _verify_contents(job_dir, m, faults, summary, check_hashes, check_values, max(1, chunk_rows))
    summary["faults"] = sum(faults.kinds.values())
    summary["faults_by_kind"] = dict(sorted(faults.kinds.items()))
    summary["faults_listed"] = len(report.job_faults) + len(report.shard_faults) + len(report.sample_faults)
    summary["shards_ok"] = summary["shards"] - len(faults.bad_shards)
    # a sample is ok when nothing is wrong with it nor with the shard it lives in
    summary["samples_ok"] = sum(
        1 for sid, shard in placement.items() if sid not in faults.bad_samples and shard not in faults.bad_shards
    )
    return report


def _verify_contents(
    job_dir: Path, m: dict, faults: _Faults, summary: dict, check_hashes: bool, check_values: bool, chunk_rows: int
) -> dict[str, str | None]:
    """Check shards and samples; return each sample id's shard (for counting the sound ones)."""
    shards: dict[str, dict] = {}
    readable: set[str] = set()
    summary["shards"] = len(m["shards"])
    for entry in m["shards"]:
        name = entry.get("name")
        if not isinstance(name, str) or not name or os.path.basename(name) != name or name in (".", ".."):
            faults.job("manifest_invalid", f"shard name {name!r} is not a file name")
            continue
        if name in shards:
            faults.shard(name, "duplicate_shard", "listed twice in the manifest")
            continue
        shards[name] = entry
        bad = [k for k in ("bytes", "num_tokens", "num_samples") if not _is_int(entry.get(k))]
        if bad or not isinstance(entry.get("sha256"), str):
            faults.shard(name, "manifest_invalid", f"entry lacks a valid {', '.join(bad) or 'sha256'}")
            continue
        path = job_dir / name
        if not path.is_file():
            faults.shard(name, "shard_missing", f"{path} does not exist")
            continue
        size = path.stat().st_size
        summary["bytes"] += size
        if size != entry["bytes"]:
            faults.shard(name, "size_mismatch", f"{size} bytes on disk, the manifest records {entry['bytes']}")
        if check_hashes:
            digest = _sha256(path)
            if digest != entry["sha256"]:
                faults.shard(name, "sha256_mismatch", f"sha256 {digest}, the manifest records {entry['sha256']}")
        if _shard_tensors(path, entry, m, faults):
            readable.add(name)

    samples = m["samples"]
    summary["samples"] = len(samples)
    by_shard: dict[str, list[dict]] = {}
    seen: set = set()
    placement: dict[str, str | None] = {}
    for s in samples:
        sid = s.get("id")
        label = str(sid)
        shard = s.get("shard")
        placement.setdefault(label, shard if isinstance(shard, str) else None)
        if not isinstance(sid, (str, int)) or isinstance(sid, bool):
            faults.sample(label, None, "manifest_invalid", f"sample id {sid!r} is not a string")
            continue
        if sid in seen:
            faults.sample(label, shard, "duplicate_sample_id", "sample id listed twice")
            continue
        seen.add(sid)
        if not isinstance(shard, str) or shard not in shards:
            faults.sample(
                label,
                shard if isinstance(shard, str) else None,
                "unknown_shard",
                f"its shard {shard!r} is not among the manifest's shards",
            )
            continue
        if not (_is_int(s.get("offset")) and _is_int(s.get("num_tokens"), 1)):
            faults.sample(
                label,
                shard,
                "manifest_invalid",
                f"offset {s.get('offset')!r} / num_tokens {s.get('num_tokens')!r} are not valid",
            )
            continue
        summary["tokens"] += s["num_tokens"]
        total = shards[shard]["num_tokens"]
        if _is_int(total) and s["offset"] + s["num_tokens"] > total:
            faults.sample(
                label,
                shard,
                "out_of_range",
                f"rows {s['offset']}..{s['offset'] + s['num_tokens']} end past the shard's {total} rows",
            )
            continue
        by_shard.setdefault(shard, []).append(s)

    for name, placed in by_shard.items():
        placed.sort(key=lambda s: (s["offset"], s["num_tokens"]))
        for a, b in zip(placed, placed[1:]):
            if b["offset"] < a["offset"] + a["num_tokens"]:
                faults.sample(
                    str(b["id"]),
                    name,
                    "overlap",
                    f"rows {b['offset']}..{b['offset'] + b['num_tokens']} "
                    f"overlap sample {a['id']!r} ({a['offset']}..{a['offset'] + a['num_tokens']})",
                )
    for name, entry in shards.items():
        placed = by_shard.get(name, [])
        n_tokens = sum(s["num_tokens"] for s in placed)
        if _is_int(entry.get("num_samples")) and len(placed) != entry["num_samples"]:
            faults.shard(
                name,
                "count_mismatch",
                f"the manifest places {len(placed)} samples in it, its entry records {entry['num_samples']}",
            )
        if _is_int(entry.get("num_tokens")) and n_tokens != entry["num_tokens"]:
            faults.shard(
                name, "count_mismatch", f"its samples cover {n_tokens} rows, its entry records {entry['num_tokens']}"
            )
    if _is_int(m.get("num_stored")) and m["num_stored"] != len(samples):
        faults.job("count_mismatch", f"num_stored is {m['num_stored']} but {len(samples)} samples are listed")

    vocab = (m.get("model") or {}).get("vocab_size")
    vocab = vocab if _is_int(vocab, 1) else None
    _warn_unlisted(job_dir, set(shards), faults.report)
    if not check_values:
        return placement
    for name in sorted(readable):
        path = job_dir / name
        _shard_metadata(path, name, by_shard.get(name, []), faults)
        with safe_open(str(path), framework="pt") as handle:
            for s in by_shard.get(name, []):
                try:
                    _check_rows(handle, name, s, m, vocab, chunk_rows, faults)
                except Exception as exc:  # noqa: BLE001 - a read that fails is this sample's fault, not a crash
                    faults.sample(str(s["id"]), name, "unreadable", f"reading its rows failed: {exc}")
                    continue
                summary["samples_read"] += 1
    return placement


def _warn_unlisted(job_dir: Path, listed: set[str], report: VerifyReport) -> None:
    for p in sorted(job_dir.iterdir()):
        if p.name.startswith("shard-") and p.name.endswith(".safetensors") and p.name not in listed:
            report.warnings.append(f"{p.name} is not in the manifest")
        elif _TEMP_NAME.match(p.name):
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
