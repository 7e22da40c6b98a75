"""Python SDK for the hsx service: HsxClient (sync) and AsyncHsxClient (async), typed results and errors.

from hsx.sdk import HsxClient

with HsxClient() as hsx:                      # $HSX_URL (default http://127.0.0.1:8000), $HSX_TOKEN
    job = hsx.wait(hsx.submit_jsonl("samples.jsonl", name="run1"))
    hsx.download_job(job, "out/run1")         # shards (resumable, sha256-checked) + manifest.json
"""

from hsx.sdk.aio import AsyncHsxClient
from hsx.sdk.client import HsxClient
from hsx.sdk.errors import (
    ChecksumMismatch,
    Conflict,
    Forbidden,
    Gone,
    HsxError,
    InvalidInput,
    NotFound,
    PayloadTooLarge,
    ServerError,
    Unauthorized,
    Unavailable,
)
from hsx.sdk.models import (
    TERMINAL_STATES,
    Attempt,
    Attempts,
    Counts,
    Health,
    Job,
    JobPage,
    Manifest,
    ManifestSample,
    ManifestShard,
    Sample,
    SamplePage,
    Shard,
    ShardList,
    Throughput,
    ThroughputPoint,
    TokenInfo,
    Tokens,
    Worker,
    Writer,
)

__all__ = [
    "TERMINAL_STATES",
    "AsyncHsxClient",
    "Attempt",
    "Attempts",
    "ChecksumMismatch",
    "Conflict",
    "Counts",
    "Forbidden",
    "Gone",
    "Health",
    "HsxClient",
    "HsxError",
    "InvalidInput",
    "Job",
    "JobPage",
    "Manifest",
    "ManifestSample",
    "ManifestShard",
    "NotFound",
    "PayloadTooLarge",
    "Sample",
    "SamplePage",
    "ServerError",
    "Shard",
    "ShardList",
    "Throughput",
    "ThroughputPoint",
    "TokenInfo",
    "Tokens",
    "Unauthorized",
    "Unavailable",
    "Worker",
    "Writer",
]
