"""Typed results. Jobs, samples and pages are the wire models the service answers with (hsx.wire),
the manifest is hsx.manifest's, and the states are hsx.states'."""

from __future__ import annotations

from hsx.manifest import Manifest, ManifestSample, ManifestShard
from hsx.states import TERMINAL_JOB_STATES, JobState, SampleState
from hsx.wire import AttemptOut as Attempt
from hsx.wire import (
    Attempts,
    ConsumerList,
    Counts,
    FeedSample,
    Health,
    JobPage,
    RankOut,
    SamplePage,
    ShardList,
    Throughput,
    ThroughputPoint,
    TokenInfo,
    Tokens,
    WorkerList,
)
from hsx.wire import ConsumerOut as Consumer
from hsx.wire import JobOut as Job
from hsx.wire import SampleOut as Sample
from hsx.wire import ShardOut as Shard
from hsx.wire import WorkerOut as Worker
from hsx.wire import WriterOut as Writer

# The states in which a job changes no more (what `wait` waits for).
TERMINAL_STATES = TERMINAL_JOB_STATES

__all__ = [
    "TERMINAL_STATES",
    "Attempt",
    "Attempts",
    "Consumer",
    "ConsumerList",
    "Counts",
    "FeedSample",
    "Health",
    "Job",
    "JobPage",
    "JobState",
    "Manifest",
    "ManifestSample",
    "ManifestShard",
    "RankOut",
    "Sample",
    "SamplePage",
    "SampleState",
    "Shard",
    "ShardList",
    "Throughput",
    "ThroughputPoint",
    "TokenInfo",
    "Tokens",
    "Worker",
    "WorkerList",
    "Writer",
]
