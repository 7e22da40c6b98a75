"""Typed results. Jobs, samples and pages are the API's own schema classes (hsx.api.schemas); the manifest,
which the API returns as a plain document, is described here."""

from __future__ import annotations

from typing import Any

from hsx.api.schemas import AttemptOut as Attempt
from hsx.api.schemas import Counts, Health, JobPage, JobState, SamplePage, SampleState, Tokens
from hsx.api.schemas import JobOut as Job
from hsx.api.schemas import SampleOut as Sample
from pydantic import BaseModel, ConfigDict

TERMINAL_STATES: tuple[str, ...] = ("succeeded", "failed", "cancelled")


class ManifestShard(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    bytes: int
    sha256: str
    num_samples: int
    num_tokens: int


class ManifestSample(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    shard: str
    offset: int
    num_tokens: int


class Manifest(BaseModel):
    """A job's manifest (`GET /v1/jobs/{id}/manifest`, also written as manifest.json next to the shards)."""

    model_config = ConfigDict(extra="allow")

    format: str
    job_id: str
    name: str | None = None
    state: JobState
    model: dict[str, Any] | None = None
    layers: list[int] | None = None
    hidden_size: int | None = None
    dtype: str | None = None
    shard_layout: dict[str, Any] | None = None
    num_samples: int
    num_stored: int
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


__all__ = [
    "Attempt",
    "Counts",
    "Health",
    "Job",
    "JobPage",
    "JobState",
    "Manifest",
    "ManifestSample",
    "ManifestShard",
    "Sample",
    "SamplePage",
    "SampleState",
    "TERMINAL_STATES",
    "Tokens",
]
