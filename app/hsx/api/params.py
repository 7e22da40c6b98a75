"""Path and query parameters that name a job, a sample or a shard, under the rules of hsx.names.

Text no database can store (NUL) is a 422 naming the parameter. A path id longer than any stored id is a
404 like any other unknown id (the repository's lookups answer "none" without a query): the schema
documents the limit, but validation leaves it to the lookup. A query value longer than the limit is a 422.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path, Query

from hsx.names import MAX_LENGTH, PATTERN, PlainText


def _in_path(description: str) -> Any:
    return Path(
        description=description, json_schema_extra={"minLength": 1, "maxLength": MAX_LENGTH, "pattern": PATTERN}
    )


def _in_query(description: str) -> Any:
    return Query(max_length=MAX_LENGTH, description=description, json_schema_extra={"pattern": PATTERN})


JobId = Annotated[PlainText, _in_path("the job's id")]
SampleIdPath = Annotated[
    PlainText, _in_path("the sample's id, percent-encoded (`/` may stay as it is unless a segment is `.` or `..`)")
]
ShardName = Annotated[PlainText, _in_path("the shard's file name, as the manifest lists it")]

# `after` cursors: a page's `next_after`, which the next request always accepts back.
JobCursor = Annotated[PlainText | None, _in_query("job id the previous page ended with")]
SampleCursor = Annotated[
    PlainText | None, _in_query("sample id the previous page ended with (one of this job's; else a 422)")
]
NameQuery = Annotated[PlainText | None, _in_query("job name (NDJSON bodies only)")]
