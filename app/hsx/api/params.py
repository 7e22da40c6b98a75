"""Path and query parameters that name a job, a sample or a shard, under the rules of hsx.names.

Text no database can store (NUL) is a 422 naming the parameter. A path id longer than any stored id is a
404 like any other unknown id (the repository's lookups answer "none" without a query): the schema
documents the limit, but validation leaves it to the lookup. A query value longer than the limit is a 422.
"""

from __future__ import annotations

import difflib
import inspect
from collections import Counter
from typing import Annotated, Any

from fastapi import Depends, Path, Query
from pydantic import ValidationError
from starlette.datastructures import QueryParams

from hsx.names import JOB_ID_FORM, MAX_LENGTH, PATTERN, PlainText
from hsx.service.errors import FieldError, InvalidInput
from hsx.wire import (
    MAX_CONSUMERS,
    MAX_NEW_TOKENS,
    Encoding,
    InvalidPolicy,
    JobOptions,
    LengthPolicy,
    LossPolicy,
    RegenerateOptions,
    Retention,
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
ConsumerPath = Annotated[PlainText, _in_path("the consumer's name")]

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
    consumers: Annotated[
        str | None,
        Query(
            max_length=MAX_CONSUMERS * (MAX_LENGTH + 1),
            description="comma-separated consumer names (see JobCreate)",
            json_schema_extra={"pattern": PATTERN},
        ),
    ] = None,
    retention: Annotated[Retention, Query(description="keep, or acked: delete what every consumer read")] = "keep",
    max_unread_bytes: Annotated[
        int | None, Query(ge=1, le=2**62, description="back-pressure on the consumers' reading (see JobCreate)")
    ] = None,
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
        "consumers": None if consumers is None else consumers.split(","),
        "retention": retention,
        "max_unread_bytes": max_unread_bytes,
    }
    try:
        return JobOptions.model_validate(fields)
    except ValidationError as exc:
        raise InvalidInput.from_pydantic(exc.errors()) from None


OptionsQuery = Annotated[JobOptions, Depends(ndjson_options)]


# What a job creation's query string may hold, with an application/x-ndjson body only: a JSON body carries
# the job's name, layers and options itself.
NDJSON_QUERY = frozenset({"name", "layers", *inspect.signature(ndjson_options).parameters})


def exact_query(query: QueryParams, allowed: frozenset[str], unknown: str) -> None:
    """Each parameter of `allowed` at most once, and no other (422 naming each one that is not): a misspelt
    parameter would otherwise be dropped and a repeated one overridden without a word, and a job made with
    values its client never meant, as strictly as a JSON body's unknown or repeated fields are refused.
    `unknown` says why a parameter is not taken."""
    errors: list[FieldError] = []
    for name, times in Counter(key for key, _ in query.multi_items()).items():
        if name not in allowed:
            near = difflib.get_close_matches(name, allowed, n=1)
            field = name if len(name) <= MAX_LENGTH else name[:MAX_LENGTH] + "..."
            hint = f"; did you mean {near[0]}?" if near else ""
            errors.append({"field": f"query.{field}", "message": unknown + hint})
        elif times > 1:
            errors.append({"field": f"query.{name}", "message": f"given {times} times: give it once"})
    if errors:
        raise InvalidInput(errors)
