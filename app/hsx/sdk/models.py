"""Typed results. Jobs, samples and pages are the API's own schema classes (hsx.api.schemas), the
manifest is hsx.manifest's, and the states are hsx.states'."""

from __future__ import annotations

from hsx.api.schemas import AttemptOut as Attempt
from hsx.api.schemas import (
    Counts,
    Health,
    JobPage,
    SamplePage,
    ShardList,
    Throughput,
    ThroughputPoint,
    TokenInfo,
    Tokens,
    WorkerList,
)
from hsx.api.schemas import JobOut as Job
from hsx.api.schemas import SampleOut as Sample
from hsx.api.schemas import ShardOut as Shard
from hsx.api.schemas import WorkerOut as Worker
from hsx.api.schemas import WriterOut as Writer
from hsx.manifest import Manifest, ManifestSample, ManifestShard
from hsx.states import TERMINAL_JOB_STATES, JobState, SampleState

# The states in which a job changes no more (what `wait` waits for).
TERMINAL_STATES = TERMINAL_JOB_STATES

__all__ = [
    "Attempt",
    "Counts",
    "Health",
    "Worker",
    "WorkerList",
    "Job",
    "JobPage",
    "JobState",
    "Manifest",
    "ManifestSample",
    "ManifestShard",
    "Sample",
    "SamplePage",
    "SampleState",
    "Shard",
    "ShardList",
    "TERMINAL_STATES",
    "Throughput",
    "ThroughputPoint",
    "TokenInfo",
    "Tokens",
    "Writer",
]
