"""`--api-tokens`: what each list means, and the lists refused because they would fail open."""

from __future__ import annotations

import re

import pytest
from pydantic import ValidationError

from hsx.config import Settings, parse_tokens


def test_token_lists_and_their_roles():
    assert parse_tokens("") == {}
    assert parse_tokens("w1, r1:read ,w2:write,") == {"w1": "write", "r1": "read", "w2": "write"}
    assert parse_tokens(" spaced token : read ") == {"spaced token": "read"}


@pytest.mark.parametrize(
    "spec,words",
    [
        ("viewer:Read", "unknown role 'Read'"),
        ("ro:readonly", "unknown role 'readonly'"),
        ("a:read:write", "unknown role 'read:write'"),
        ("ok,bad:", "unknown role ''"),
        (" , ", "lists no token"),
        (" ", "lists no token"),
        (":read", "no token before the colon"),
        ("t:read,t", "listed twice"),
    ],
)
def test_doubtful_token_lists_are_refused(spec, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        parse_tokens(spec)
    with pytest.raises(ValidationError):
        Settings(api_tokens=spec)
