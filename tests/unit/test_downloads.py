"""If-None-Match and Range as RFC 9110 reads them (hsx.api.downloads); the service's answers to them
are tested against a running service in tests/acceptance/test_api_lifecycle.py."""

from __future__ import annotations

import pytest

from hsx.api.downloads import none_match, wanted_ranges
from hsx.service.errors import RangeNotSatisfiable

ETAG = '"abc123"'


@pytest.mark.parametrize(
    "header,matches",
    [
        (None, False),
        ('"abc123"', True),
        ('W/"abc123"', True),  # If-None-Match compares weakly
        ('"other", "abc123"', True),
        ('"other",W/"abc123"', True),
        (' , "other" ,, "abc123" ', True),
        ("*", True),
        (" * ", True),
        ('"other"', False),
        ('"other", W/"nope"', False),
        ('"abc"', False),
        ("abc123", False),  # not an entity tag
        ('"other", abc123', False),
        ('W/"abc123', False),
        ("", False),
    ],
)
def test_if_none_match(header, matches):
    assert none_match(header, ETAG) is matches


SIZE = 1000


@pytest.mark.parametrize(
    "header,ranges",
    [
        (None, None),
        ("bytes=0-99", [(0, 99)]),
        ("bytes=100-", [(100, 999)]),
        ("bytes=-100", [(900, 999)]),
        ("bytes=-5000", [(0, 999)]),
        ("bytes=990-5000", [(990, 999)]),
        ("Bytes = 0-0", [(0, 0)]),
        ("bytes=0-1, 10-19", [(0, 1), (10, 19)]),
        ("bytes=0-1,,10-19", [(0, 1), (10, 19)]),
        ("bytes=0-1,5000-6000", [(0, 1)]),  # satisfiable if any range is
        ("bytes=0-99999999999999999999999999", [(0, 999)]),
        # unparseable or another unit: ignored, the whole file is sent (RFC 9110 14.2)
        ("bytes=abc", None),
        ("bytes=5-1", None),
        ("bytes=-", None),
        ("bytes=", None),
        ("bytes", None),
        ("bytes=1-2-3", None),
        ("bytes=0-1,x", None),
        ("items=0-1", None),
        ("=0-1", None),
        ("bytes=" + ",".join(["0-0"] * 17), None),
        ("bytes=0x10-20", None),
    ],
)
def test_range(header, ranges):
    assert wanted_ranges(header, None, ETAG, SIZE) == ranges


@pytest.mark.parametrize(
    "header,size",
    [("bytes=1000-", 1000), ("bytes=1000-1001, 2000-", 1000), ("bytes=-0", 1000), ("bytes=0-", 0), ("bytes=-1", 0)],
)
def test_unsatisfiable_range(header, size):
    with pytest.raises(RangeNotSatisfiable) as exc:
        wanted_ranges(header, None, ETAG, size)
    assert exc.value.status == 416 and exc.value.headers == {"Content-Range": f"bytes */{size}"}


def test_if_range_sends_the_range_only_for_the_same_strong_tag():
    assert wanted_ranges("bytes=0-9", ETAG, ETAG, SIZE) == [(0, 9)]
    for other in ('"other"', f"W/{ETAG}", "Tue, 01 Dec 2026 10:00:00 GMT"):
        assert wanted_ranges("bytes=0-9", other, ETAG, SIZE) is None
    assert wanted_ranges("bytes=5000-", '"other"', ETAG, SIZE) is None  # whole file, not a 416
