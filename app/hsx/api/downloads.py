"""Conditional and partial downloads of a file with a known entity tag, as RFC 9110 has them.

- If-None-Match holds `*` or a list of entity tags, weak (`W/"..."`) or strong; it matches by the weak
  comparison (the opaque tags are equal), and a match answers 304.
- Range: a header that cannot be parsed, or is in a unit other than bytes, is ignored and the whole
  file is sent (RFC 9110 14.2); one whose ranges all lie outside the file is a 416 problem with
  `Content-Range: bytes */<size>`; otherwise the ranges that lie inside it are sent.
- If-Range with another (or a weak) entity tag, or a date, sends the whole file: dates are not kept
  for shards, and a full answer is always a correct one.

The route decides; the file is then sent by Starlette's FileResponse with the ranges decided on,
written out canonically, in place of the client's header.
"""

from __future__ import annotations

import re
from typing import Any

from starlette.responses import FileResponse
from starlette.types import Receive, Scope, Send

from hsx.service.errors import RangeNotSatisfiable

# One list member and the comma after it; empty members (",,") are allowed, as in every list header.
_ENTITY_TAG = re.compile(r'[\s,]*(W/)?("[^"]*")\s*(?:,|$)')
_LIST_END = re.compile(r"[\s,]*$")
_RANGE_SPEC = re.compile(r"^\s*(\d*)\s*-\s*(\d*)\s*$")
# More ranges than this in one request are not worth a multipart answer: the whole file is sent.
MAX_RANGES = 16


def none_match(header: str | None, etag: str) -> bool:
    """Whether If-None-Match `header` matches the strong entity tag `etag` (weak comparison)."""
    if header is None:
        return False
    if header.strip() == "*":
        return True
    pos = 0
    while not _LIST_END.match(header, pos):
        m = _ENTITY_TAG.match(header, pos)
        if m is None:  # not a list of entity tags: a condition that cannot match
            return False
        if m.group(2) == etag:
            return True
        pos = m.end()
    return False


def wanted_ranges(header: str | None, if_range: str | None, etag: str, size: int) -> list[tuple[int, int]] | None:
    """The byte ranges to send as (first, last) inclusive, or None for the whole file; raises
    RangeNotSatisfiable when every range lies outside the file."""
    if header is None or (if_range is not None and if_range.strip() != etag):
        return None
    unit, sep, specs = header.partition("=")
    if not sep or unit.strip().lower() != "bytes":
        return None
    parts = [p for p in specs.split(",") if p.strip()]
    if not parts or len(parts) > MAX_RANGES:
        return None
    try:
        found = [_byte_range(part, size) for part in parts]
    except _InvalidSpec:
        return None
    ranges = [r for r in found if r is not None]
    if not ranges:
        raise RangeNotSatisfiable(size)
    return ranges


class _InvalidSpec(Exception):
    """A range-spec that is not one: it makes the whole Range header invalid, and the header is ignored."""


def _byte_range(part: str, size: int) -> tuple[int, int] | None:
    """One range-spec's (first, last) inside the file, None when it lies outside."""
    m = _RANGE_SPEC.match(part)
    if m is None or m.group(1) == m.group(2) == "":
        raise _InvalidSpec
    first, last = (_position(g) for g in m.groups())
    if first is None:  # the last `last` bytes
        return (max(size - last, 0), size - 1) if last and size > 0 else None
    if last is not None and last < first:
        raise _InvalidSpec
    if first < size:
        return (first, size - 1 if last is None else min(last, size - 1))
    return None


def _position(digits: str) -> int | None:
    # Past 18 digits a position is beyond any file; int() would refuse a few thousand digits anyway.
    return None if digits == "" else int(digits) if len(digits) <= 18 else 10**18


class FileDownload(FileResponse):
    """A FileResponse that sends `ranges` (None: the whole file) rather than what the request's
    Range and If-Range headers say."""

    def __init__(self, *args: Any, ranges: list[tuple[int, int]] | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ranges = ranges

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = [(k, v) for k, v in scope["headers"] if k not in (b"range", b"if-range")]
        if self.ranges:
            spec = ",".join(f"{first}-{last}" for first, last in self.ranges)
            headers.append((b"range", f"bytes={spec}".encode()))
        await super().__call__({**scope, "headers": headers}, receive, send)
