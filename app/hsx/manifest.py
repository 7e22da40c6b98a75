"""A job's manifest: everything a tool needs to find and read the job's samples without hsx.

`Manifest` is its one description. The service builds it from the database (`build_manifest`),
returns it from `GET /v1/jobs/{id}/manifest` and writes it as manifest.json next to the shards when
the job ends (`write_manifest`); the SDK, the Dataset, the exports and verify read it back. Fields a
model does not know are kept, so a manifest written by an older or newer hsx still loads.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from safetensors import safe_open

from hsx.dtypes import DTYPES, DType, Encoding
from hsx.identity import Identity, weakest
from hsx.layers import LAYER_SETS, sets_within
from hsx.states import JobState
from hsx.storage.atomic import write_json_atomic
from hsx.storage.encoding import LayerStats, encoding_of

if TYPE_CHECKING:
    import torch
    from sqlalchemy.orm import Session

    from hsx.db.models import JobRow

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "hsx-manifest/1"
SHARD_LAYOUT = {
    "input_ids": "int64 [T]",
    "loss_mask": "int64 [T]",
    "layer_<i>": "dtype [T, hidden_size]",
    "sample_rows": "offset .. offset + num_tokens",
}


def shard_layout(encoding: str) -> dict[str, str]:
    """The manifest's `shard_layout` for a job of this encoding: its layers' tensors as the encoding
    names them (hsx.storage.encoding; docs/api.md, "Output format")."""
    plain = {k: v for k, v in SHARD_LAYOUT.items() if k != "layer_<i>"}
    return {**plain, **encoding_of(encoding).layout}


# What `model` records, each null where unknown: the server's model_path and what its /get_model_info
# or the checkpoint's config.json say (hsx.backends.model.describe_model).
MODEL_KEYS = ("model_path", "model_type", "num_hidden_layers", "hidden_size", "rms_norm_eps", "vocab_size")

# Strict: a count that arrives as true, 3.0 or "3" is a damaged manifest, not a number.
Count = Annotated[int, Field(ge=0, strict=True)]
PositiveCount = Annotated[int, Field(ge=1, strict=True)]


class ManifestShard(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    bytes: Count
    sha256: str
    num_samples: Count
    num_tokens: Count
    # Its number in the job's commit feed (1, 2, ... in the order shards were recorded; the manifest
    # lists them in that order). None: written by an hsx without the feed.
    seq: PositiveCount | None = None
    # Retention deleted its file once every consumer had read it; its record (and its samples') stays.
    deleted: bool = False

    @field_validator("name")
    @classmethod
    def _file_name(cls, name: str) -> str:
        # a shard is opened (and downloaded) as <job folder>/<name>: a path could reach outside it
        if not name or name in (".", "..") or os.path.basename(name) != name:
            raise ValueError("is not a file name")
        return name


class ManifestSample(BaseModel):
    """Where a sample lies: rows offset .. offset + num_tokens of every tensor in its shard."""

    model_config = ConfigDict(extra="allow")

    id: str
    shard: str
    offset: Count
    num_tokens: PositiveCount
    # What proved the stored dump this sample's (hsx.identity); None: not recorded (stored by an older hsx).
    identity: Identity | None = None
    # Its token count before the job's length policy cut it to num_tokens (truncate; a conversation tokenized
    # only as far as its limit needs: the tokens counted, more than the limit); absent: not cut.
    truncated_from: PositiveCount | None = None


class EncodedLayer(BaseModel):
    """What a job's encoding stored for one captured layer, its shards added up."""

    model_config = ConfigDict(extra="allow")

    layer: Count
    raw_bytes: Count = Field(description="the bytes its rows take raw")
    bytes: Count = Field(description="the bytes its tensors take in the shards")
    max_error: float | None = Field(
        None, description="fp8: the largest error of a value, relative to the largest magnitude of its row"
    )
    mean_error: float | None = Field(None, description="fp8: the mean of those errors")


@dataclass(frozen=True)
class HiddenStates:
    """What every shard of a job holds per token: a row of `hidden_size` values of `dtype` per layer."""

    layers: list[int]
    hidden_size: int
    dtype: DType


class ManifestHeader(BaseModel):
    """Everything in a manifest but its shard and sample lists."""

    model_config = ConfigDict(extra="allow")

    format: str = MANIFEST_FORMAT
    job_id: str
    name: str | None = None
    state: JobState
    model: dict[str, Any] | None = None
    layers: list[Count] | None = None
    # Which of `layers` hold the model's output after its final norm: layer L (model.num_hidden_layers)
    # in hsx's numbering, when captured. None: not recorded (an older manifest, or L unknown).
    post_norm_layers: list[Count] | None = None
    # Where the source took layer L: post_norm (after the final norm: SGLang, the reference server) or
    # pre_norm (the residual stream before it: vLLM's extract_hidden_states). None: an older manifest.
    final_layer: Literal["pre_norm", "post_norm"] | None = None
    # Where layer L after the norm was computed by hsx from a server's pre-norm L (hsx.backends.final_norm):
    # {"applied_by": "hsx", "checkpoint", "file", "tensor", "sha256" (of the weight's stored bytes), "eps"}.
    # None: L as the server gave it.
    final_norm: dict[str, Any] | None = None
    # Each named layer set (hsx.layers.LAYER_SETS) the stored layers make, with its layers: a reader
    # selects one by name. None: not recorded (an older manifest; `sets()` works it out).
    layer_sets: dict[str, list[Count]] | None = None
    hidden_size: PositiveCount | None = None
    # The dtype of the stored values (of what an encoded layer decodes to).
    dtype: str | None = None
    # How the shards store each layer (hsx.storage.encoding): raw, lossless or fp8. A manifest written
    # before encodings existed has none, and its shards are raw.
    encoding: Encoding = "raw"
    # Per captured layer, what the encoding stored (bytes; errors for fp8). None: a raw job.
    encoded_layers: list[EncodedLayer] | None = None
    shard_layout: dict[str, Any] | None = Field(default_factory=lambda: dict(SHARD_LAYOUT))
    num_samples: Count
    num_stored: Count
    # Samples cut to fit max_length or the server's limit (each says its length before: truncated_from).
    num_truncated: Count = 0
    # The weakest proof among the stored samples (hsx.identity): ids or rid or response prove every
    # tensor its sample's; count means the dumps carried neither, and rest on hsx having had the
    # model server to itself. None: nothing stored, or a sample stored without a recorded proof.
    identity: Identity | None = None
    # What the job ran with that its trainer should know, as the job's own `warning` says (a sampling
    # seed the model server ignored); None: nothing.
    warning: str | None = None

    @field_validator("layers")
    @classmethod
    def _distinct(cls, layers: list[int] | None) -> list[int] | None:
        if layers is not None and (not layers or len(set(layers)) != len(layers)):
            raise ValueError("must be distinct layer numbers, at least one")
        return layers

    def post_norm(self, layer: int) -> bool | None:
        """Whether `layer` holds values after the model's final norm, as `post_norm_layers` records;
        None where the manifest does not record it (then hsx's numbering says: layer L only)."""
        return None if self.post_norm_layers is None else layer in self.post_norm_layers

    def sets(self) -> dict[str, list[int]]:
        """The named layer sets the job's stored layers make: as recorded, or for an older manifest worked
        out from its layers, model depth and side of the final norm."""
        if self.layer_sets is not None:
            return {name: list(layers) for name, layers in self.layer_sets.items()}
        num_layers = (self.model or {}).get("num_hidden_layers")
        side = self.final_layer
        if side is None and isinstance(num_layers, int):
            side = "pre_norm" if self.post_norm(num_layers) is False else "post_norm"
        return sets_within(self.layers, num_layers if isinstance(num_layers, int) else None, side)

    def layer_set(self, name: str) -> tuple[list[int], int]:
        """(the layers a named set reads before the last, in order; its last layer, L) among the job's stored
        layers; ValueError naming the sets the job has when it did not capture this one."""
        have = self.sets()
        if name in have:
            num_layers = int((self.model or {})["num_hidden_layers"])
            return [i for i in have[name] if i != num_layers], num_layers
        known = f"{name} is no layer set (the sets are {', '.join(LAYER_SETS)})" if name not in LAYER_SETS else ""
        held = ", ".join(have) or "none of them"
        side = f", L {self.final_layer.replace('_', '-')}" if self.final_layer else ""
        why = known or f"the job did not capture layer set {name}"
        raise ValueError(f"{why}: its layers {self.layers}{side} make {held}")

    def hidden_states(self) -> HiddenStates:
        """The layers, hidden size and dtype the shards hold; ValueError when the manifest does not say
        (a job that ended before the model server described them), or names a dtype that is not a float."""
        dtype = DTYPES.get(self.dtype or "")
        if self.layers is None or self.hidden_size is None or dtype is None or not dtype.is_float:
            raise ValueError("the manifest does not describe the hidden states: layers, hidden_size, float dtype")
        return HiddenStates(self.layers, self.hidden_size, dtype)


class Manifest(ManifestHeader):
    """A job's manifest (`GET /v1/jobs/{id}/manifest`, also written as manifest.json next to the shards)."""

    shards: list[ManifestShard]
    samples: list[ManifestSample]

    def shard(self, name: str) -> ManifestShard:
        for s in self.shards:
            if s.name == name:
                return s
        raise KeyError(name)

    def sample(self, sample_id: str) -> ManifestSample:
        for s in self.samples:
            if s.id == sample_id:
                return s
        raise KeyError(sample_id)


def job_dir(output_root: Path, job_id: str) -> Path:
    return Path(output_root) / job_id


def locate(source: str | os.PathLike[str]) -> tuple[Path, Path]:
    """(job folder, manifest path) for a job folder or the path of its manifest.json."""
    path = Path(source)
    if path.is_file() or path.name == MANIFEST_NAME:
        return path.parent, path
    return path, path / MANIFEST_NAME


def post_norm_layers(layers: list[int] | None, num_layers: int | None, final_layer: str | None) -> list[int] | None:
    """Which of the layers hold values after the final norm: layer L, unless the source took it
    before the norm (vLLM: `final_layer` pre_norm); None when the layer count is not known."""
    if layers is None or num_layers is None:
        return None
    return [] if final_layer == "pre_norm" else [i for i in layers if i == num_layers]


def manifest_header(job: JobRow, state: JobState | str | None = None) -> dict[str, Any]:
    """The job's manifest header as the database has it now (`state` in place of the job's own), without
    what its shards add up to (`encoded_layers`)."""
    info = job.model_info or {}
    layers, num_layers = info.get("layers", job.layers), info.get("num_hidden_layers")
    encoding = (job.options or {}).get("encoding", "raw")
    return {
        "format": MANIFEST_FORMAT,
        "job_id": job.id,
        "name": job.name,
        "state": state or job.state,
        "model": {k: info.get(k) for k in MODEL_KEYS},
        "layers": layers,
        "post_norm_layers": post_norm_layers(layers, num_layers, info.get("final_layer")),
        "final_layer": info.get("final_layer") or "post_norm",
        "final_norm": info.get("final_norm"),
        "layer_sets": sets_within(layers, num_layers, info.get("final_layer")) if num_layers is not None else None,
        "hidden_size": info.get("hidden_size"),
        "dtype": info.get("dtype"),
        "encoding": encoding,
        "shard_layout": shard_layout(encoding),
        "num_samples": job.num_samples,
        "num_stored": job.n_succeeded,
        "num_truncated": job.n_truncated,
        "warning": job.warning,
    }


def build_manifest(session: Session, job: JobRow, state: JobState | str | None = None) -> Manifest:
    """The job's manifest as the database has it now (`state` in place of the job's own, if given)."""
    from hsx.db import repository as repo  # here, not above: the SDK imports this module without a database

    header = manifest_header(job, state)
    samples = list(repo.iter_stored_samples(session, job.id))
    shards = repo.job_shards(session, job.id)
    # One document validated at once: a model per sample built here would cost several times more.
    return Manifest.model_validate(
        {
            **header,
            "encoded_layers": encoded_layers(header["layers"] or [], [s.layer_stats for s in shards])
            if encoding_of(header["encoding"]).encoded
            else None,
            "shards": [
                {
                    "name": s.name,
                    "bytes": s.bytes,
                    "sha256": s.sha256,
                    "num_samples": s.num_samples,
                    "num_tokens": s.num_tokens,
                    "seq": s.seq,
                    "deleted": s.deleted_at is not None,
                }
                for s in shards
            ],
            "identity": weakest(r.identity for r in samples),
            "samples": [
                {
                    "id": r.sample_id,
                    "shard": r.shard,
                    "offset": r.shard_offset,
                    "num_tokens": r.num_tokens,
                    "identity": r.identity,
                    **({"truncated_from": r.truncated_from} if r.truncated_from is not None else {}),
                }
                for r in samples
            ],
        }
    )


def encoded_layers(layers: list[int], per_shard: list[dict[str, Any] | None]) -> list[dict[str, Any]]:
    """Each layer's stats (hsx.storage.encoding.LayerStats, as shards record them) added up."""
    totals = {layer: LayerStats() for layer in layers}
    for stats in per_shard:
        for key, doc in (stats or {}).items():
            if int(key) in totals:
                totals[int(key)].add(LayerStats.from_json(doc))
    return [
        {
            "layer": layer,
            "raw_bytes": t.raw_bytes,
            "bytes": t.bytes,
            "max_error": t.max_error,
            "mean_error": t.mean_error,
        }
        for layer, t in totals.items()
    ]


def write_manifest(folder: Path, manifest: Manifest) -> Path:
    """Write `folder`/manifest.json whole or not at all; returns its path."""
    path = Path(folder) / MANIFEST_NAME
    write_json_atomic(path, manifest.model_dump(mode="json"))
    return path


def manifest_problems(doc: object) -> list[str]:
    """What keeps a manifest document from describing shards that can be read, one line each: its
    format, layers, hidden_size (present and valid) and dtype (a float format), the rest of its
    header as `ManifestHeader` checks it, and `shards` and `samples` being lists of objects (their
    entries are `ManifestShard` and `ManifestSample`, checked one by one where it matters)."""
    if not isinstance(doc, dict):
        return ["manifest.json is not a JSON object"]
    invalid: dict[str, str] = {}
    try:
        ManifestHeader.model_validate(doc)
    except ValidationError as exc:
        for error in exc.errors():
            invalid.setdefault(str(error["loc"][0]) if error["loc"] else "", error["msg"])
    problems = []
    if doc.get("format") != MANIFEST_FORMAT:
        problems.append(f"format is {doc.get('format')!r}, expected {MANIFEST_FORMAT!r}")
    if "layers" in invalid or doc.get("layers") is None:
        problems.append(f"layers {doc.get('layers')!r} is not a list of distinct layer numbers")
    if "hidden_size" in invalid or doc.get("hidden_size") is None:
        problems.append(f"hidden_size {doc.get('hidden_size')!r} is not a positive integer")
    dtype = doc.get("dtype")
    if not (isinstance(dtype, str) and dtype in DTYPES and DTYPES[dtype].is_float):
        problems.append(f"dtype {dtype!r} is not a floating-point dtype")
    for key in ("shards", "samples"):
        entries = doc.get(key)
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            problems.append(f"{key} is not a list of objects")
    named = ("format", "layers", "hidden_size", "dtype")
    problems += [f"{field}: {message}" for field, message in invalid.items() if field not in named]
    return problems


def load_manifest(source: str | os.PathLike[str], *, readable: bool = False) -> Manifest:
    """The manifest of a job folder (or at the path of its manifest.json); a ValueError says what is
    wrong with it. With `readable`, a manifest that does not describe shards that can be read (a job
    that ended before the model server described its layers; see `manifest_problems`) is one too."""
    path = locate(source)[1]
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no manifest.json (is the job finished?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: unreadable manifest ({exc})") from exc
    problems = manifest_problems(doc) if readable else []
    if problems:
        raise ValueError(f"{path}: {'; '.join(problems)}")
    try:
        return Manifest.model_validate(doc)
    except ValidationError as exc:
        where = ", ".join(".".join(map(str, e["loc"])) for e in exc.errors()[:5])
        raise ValueError(f"{path}: not a valid manifest ({exc.error_count()} errors: {where})") from None


def read_rows(shard: Path, offset: int, num_tokens: int, layers: list[int]) -> dict[str, torch.Tensor]:
    """One sample's rows of every tensor in a shard (the shard is never loaded whole; needs torch)."""
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(shard), framework="pt") as f:
        for key in ["input_ids", "loss_mask"] + [f"layer_{i}" for i in layers]:
            out[key] = f.get_slice(key)[offset : offset + num_tokens]
    return out


def read_sample(folder: Path, manifest: Manifest, sample_id: str) -> dict[str, torch.Tensor]:
    """Load one sample's tensors by the manifest's placement (KeyError for an unknown id)."""
    entry = manifest.sample(sample_id)
    return read_rows(Path(folder) / entry.shard, entry.offset, entry.num_tokens, manifest.layers or [])
