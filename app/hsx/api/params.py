"""Path and query parameters that name a job, a sample or a shard, under the rules of hsx.names.

Text no database can store (NUL) is a 422 naming the parameter. A path id longer than any stored id is a
404 like any other unknown id (the repository's lookups answer "none" without a query): the schema
documents the limit, but validation leaves it to the lookup. A query value longer than the limit is a 422.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Path, Query
from pydantic import ValidationError

from hsx.names import JOB_ID_FORM, MAX_LENGTH, PATTERN, PlainText
from hsx.service.errors import InvalidInput
from hsx.wire import (
    MAX_NEW_TOKENS,
    Encoding,
    InvalidPolicy,
    JobOptions,
    LengthPolicy,
    LossPolicy,
    RegenerateOptions,
    SeedIgnored,
)


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

# `after` cursors: a page's `next_after`, which the next request always accepts back; anything a route
# never hands out is a 422 on both (hsx.service.queries), an empty one the first page.
JobCursor = Annotated[
    PlainText | None,
    Query(
        max_length=MAX_LENGTH,
        description="job id the previous page ended with (empty: the first page; anything but a job id is a 422). "
        "Ids sort by creation: the id of a job deleted since still continues after it",
        json_schema_extra={"pattern": f"^({JOB_ID_FORM})?$"},
    ),
]
SampleCursor = Annotated[
    PlainText | None,
    _in_query("sample id the previous page ended with (empty: the first page; one of this job's, else a 422)"),
]
NameQuery = Annotated[PlainText | None, _in_query("job name (NDJSON bodies only)")]


_REGENERATE = RegenerateOptions(max_new_tokens=1)  # the defaults the query's regenerate_<field> take


def ndjson_options(
    *,
    max_length: Annotated[
        int | None, Query(ge=1, le=2**31 - 1, description="the most tokens a sample may have")
    ] = None,
    length_policy: Annotated[
        LengthPolicy, Query(description="a sample over max_length: truncate, skip or reject (see JobCreate)")
    ] = "reject",
    on_invalid: Annotated[
        InvalidPolicy, Query(description="an invalid sample: reject the request, or skip it")
    ] = "reject",
    loss: Annotated[LossPolicy, Query(description="a conversation's loss mask (see JobCreate)")] = "assistant",
    tokenizer: Annotated[
        str | None,
        Query(
            max_length=4096,
            description="tokenizer folder for conversations: under the service's --tokenizer-roots, or the model "
            "path a worker's server reports (see JobCreate)",
        ),
    ] = None,
    regenerate_max_new_tokens: Annotated[
        int | None,
        Query(ge=1, le=MAX_NEW_TOKENS, description="regenerate every assistant turn, at most this many tokens each"),
    ] = None,
    regenerate_temperature: Annotated[
        float | None,
        Query(ge=0, le=10, description=f"with regenerate_max_new_tokens; default {_REGENERATE.temperature}"),
    ] = None,
    regenerate_top_p: Annotated[
        float | None, Query(gt=0, le=1, description=f"with regenerate_max_new_tokens; default {_REGENERATE.top_p}")
    ] = None,
    regenerate_seed: Annotated[
        int | None, Query(ge=0, le=2**63 - 1, description="with regenerate_max_new_tokens; default none")
    ] = None,
    regenerate_seed_ignored: Annotated[
        SeedIgnored | None,
        Query(description=f"with regenerate_max_new_tokens; default {_REGENERATE.seed_ignored} (see JobCreate)"),
    ] = None,
    regenerate_concurrency: Annotated[
        int | None,
        Query(ge=1, le=256, description=f"with regenerate_max_new_tokens; default {_REGENERATE.concurrency}"),
    ] = None,
    encoding: Annotated[Encoding, Query(description="how the shards store hidden states (see JobCreate)")] = "raw",
) -> JobOptions:
    """An NDJSON body's job options, from the query string: the fields of JobCreate (NDJSON bodies only;
    `regenerate` flattened as regenerate_<field>). A regenerate_<field> without regenerate_max_new_tokens
    is a 422: it would otherwise be dropped without a word."""
    given = {
        "temperature": regenerate_temperature,
        "top_p": regenerate_top_p,
        "seed": regenerate_seed,
        "seed_ignored": regenerate_seed_ignored,
        "concurrency": regenerate_concurrency,
    }
    given = {k: v for k, v in given.items() if v is not None}
    regenerate = None
    if regenerate_max_new_tokens is not None:
        regenerate = {"max_new_tokens": regenerate_max_new_tokens, **given}
    elif given:
        raise InvalidInput(
            [
                {"field": f"query.regenerate_{k}", "message": "goes with regenerate_max_new_tokens, which is not given"}
                for k in given
            ]
        )
    fields = {
        "max_length": max_length,
        "length_policy": length_policy,
        "on_invalid": on_invalid,
        "loss": loss,
        "tokenizer": tokenizer,
        "regenerate": regenerate,
        "encoding": encoding,
    }
    try:
        return JobOptions.model_validate(fields)
    except ValidationError as exc:
        raise InvalidInput.from_pydantic(exc.errors()) from None


OptionsQuery = Annotated[JobOptions, Depends(ndjson_options)]
