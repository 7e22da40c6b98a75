"""Python SDK for the hsx service: HsxClient (sync) and AsyncHsxClient (async), typed results and errors.

    from app.sdk import HsxClient

    with HsxClient() as hsx:                      # $HSX_URL (default http://127.0.0.1:8000), $HSX_TOKEN
        job = hsx.wait(hsx.submit_jsonl("samples.jsonl", name="run1"))
        hsx.download_job(job, "out/run1")         # shards (resumable, sha256-checked) + manifest.json
"""

from app.sdk.aio import AsyncHsxClient
from app.sdk.client import HsxClient
from app.sdk.errors import (
    ChecksumMismatch,
    Conflict,
    Forbidden,
    HsxError,
    InvalidInput,
    NotFound,
    PayloadTooLarge,
    ServerError,
    Unauthorized,
    Unavailable,
)
from app.sdk.models import (
    TERMINAL_STATES,
    Attempt,
    Counts,
    Health,
    Job,
    JobPage,
    Manifest,
    ManifestSample,
    ManifestShard,
    Sample,
    SamplePage,
    Tokens,
)

__all__ = [
    "AsyncHsxClient", "Attempt", "ChecksumMismatch", "Conflict", "Counts", "Forbidden", "Health", "HsxClient",
    "HsxError", "InvalidInput", "Job", "JobPage", "Manifest", "ManifestSample", "ManifestShard", "NotFound",
    "PayloadTooLarge", "Sample", "SamplePage", "ServerError", "TERMINAL_STATES", "Tokens", "Unauthorized",
    "Unavailable",
]
