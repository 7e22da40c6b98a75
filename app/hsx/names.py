"""Ids and names: what a client may choose (sample ids, job names) and send back (job ids, sample ids and
shard names in paths, list cursors), the same on SQLite and Postgres.

One length limit, MAX_LENGTH characters: the narrowest column that holds such a value is VARCHAR(200)
(samples.sample_id, jobs.name, shards.name; job ids are 40). Postgres counts characters there as len()
does; SQLite counts nothing, so without this limit it would store what Postgres refuses.

One character rule: no control characters (U+0000 to U+001F, U+007F) and no lone surrogates. Postgres
refuses NUL in text and no database stores a lone surrogate (it has no UTF-8 form); a sample id with a
line break could not be addressed (a path parameter never matches one); the other control characters
follow them, so that the rule is short. Values that break it are refused before any query is sent.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field, PlainValidator, WithJsonSchema
from pydantic_core import PydanticCustomError

MAX_LENGTH = 200
# The character rule as a JSON Schema (ECMA-262) pattern, for the OpenAPI document. Lone surrogates need
# no pattern: a JSON text cannot carry them (the parser refuses the body).
PATTERN = "^[^\\u0000-\\u001f\\u007f]*$"
_CONTROL = re.compile("[\x00-\x1f\x7f]")
# The form of every job id (and so of every job folder's name): "job_", the creation time in ms and 4
# random bytes, as hex (hsx.db.repository.new_job_id makes them; is_job_id checks them).
JOB_ID_FORM = "job_[0-9a-f]{20}"
# Integer sample ids are stored as their decimal text; 64 bits keep that well within MAX_LENGTH.
INT_ID_MIN, INT_ID_MAX = -(2**63), 2**63 - 1


def bad_character(text: str) -> str | None:
    """Why `text` breaks the character rule, or None when it keeps it."""
    control = _CONTROL.search(text)
    if control is not None:
        code, at = ord(control.group()), control.start()
        if code == 0:
            return f"holds a NUL character (U+0000) at position {at}, which no database stores in text; remove it"
        return (
            f"holds the control character U+{code:04X} at position {at}; ids, names and paths hold no control "
            "characters (U+0000 to U+001F, U+007F)"
        )
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return (
            f"holds a lone surrogate (U+{ord(text[exc.start]):04X}) at position {exc.start}, "
            "which is not valid Unicode; remove it"
        )
    return None


def too_long(text: str) -> str | None:
    """Why `text` is longer than an id or name may be, or None when it fits."""
    if len(text) > MAX_LENGTH:
        return f"is {len(text)} characters long; ids and names hold at most {MAX_LENGTH}"
    return None


def could_be_stored(text: str) -> bool:
    """Whether `text` could be a stored id or name: lookups answer "none" for any other without a query
    (Postgres would answer NUL with an error, not with no rows)."""
    return too_long(text) is None and bad_character(text) is None


def shown(text: str) -> str:
    """`text` quoted for a message, cut short when it is longer than any id."""
    if len(text) <= MAX_LENGTH:
        return repr(text)
    return f"{text[:40]!r}... ({len(text)} characters)"


def _plain(text: str) -> str:
    why = bad_character(text)
    if why is not None:
        raise PydanticCustomError("bad_character", why)
    return text


def _sample_id(value: object) -> str:
    """A sample id as stored: a string of 1..MAX_LENGTH characters under the rule, or a 64-bit integer's text."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise PydanticCustomError("sample_id_type", "must be a string or an integer")
    if isinstance(value, int):
        if not INT_ID_MIN <= value <= INT_ID_MAX:
            raise PydanticCustomError("sample_id_range", "an integer id must fit in 64 bits; send it as a string")
        return str(value)
    if not value:
        raise PydanticCustomError("sample_id_empty", "must not be empty")
    why = too_long(value) or bad_character(value)
    if why is not None:
        raise PydanticCustomError("sample_id_invalid", why)
    return value


# Text under the character rule, any length: query and path parameters (whose length rules differ, see
# hsx.api.params) and input paths.
PlainText = Annotated[str, AfterValidator(_plain)]

# A job name: at most MAX_LENGTH characters under the rule.
Name = Annotated[PlainText, Field(max_length=MAX_LENGTH, json_schema_extra={"pattern": PATTERN})]

# A sample id as a client writes it (string or integer), validated into the text that is stored.
SampleId = Annotated[
    str,
    PlainValidator(_sample_id),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "string", "minLength": 1, "maxLength": MAX_LENGTH, "pattern": PATTERN},
                {"type": "integer", "minimum": INT_ID_MIN, "maximum": INT_ID_MAX},
            ]
        }
    ),
]
