"""An application/json job body, read without building its samples array as Python objects.

Parsed whole, a 57 MB body of samples became about 600 MB of Python lists and ints, held until the
last sample was checked and, being many small objects, not given back to the system afterwards.
Here the body is walked once to find the top-level `samples` array and the extent of each element;
the rest of the object (name, layers, input_path) is validated by the JobCreate model with `samples`
replaced by `[]`, and each element is parsed and checked on its own, so no more than one sample's
objects exist at a time.

The walk jumps between structural bytes with regular expressions (never a Python step per byte of
a long list of token ids) and checks only what locating the elements needs: the top-level object's
members, the array's commas and brackets, strings and their escapes. Everything it hands on is then
parsed by pydantic's JSON parser, so nothing malformed gets through.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

from pydantic import ValidationError

from hsx.service.errors import InvalidInput
from hsx.wire import MAX_TURNS, JobCreate, parse_body

Body = bytes | bytearray

_WS = re.compile(rb"[ \t\n\r]*")
_STRING_STOP = re.compile(rb'["\\]')
_BRACKET = re.compile(rb"[\[\]{}]")
# Deeper than pydantic's JSON parser reads (about 200): a body nested deeper is refused by the walk
# after MAX_DEPTH steps, not after one step per bracket of it.
MAX_DEPTH = 256
_SCALAR_END = re.compile(rb"[ \t\n\r,\]}]")
_QUOTE, _OPEN_OBJECT, _OPEN_LIST, _CLOSE_LIST = ord('"'), ord("{"), ord("["), ord("]")


class _Malformed(ValueError):
    def __init__(self, pos: int, message: str):
        super().__init__(f"invalid JSON at byte {pos}: {message}")


def job_request(body: Body) -> tuple[JobCreate, Iterator[tuple[int, Body]]]:
    """The request with `samples` empty (or None when the body has none), and the samples array's
    elements as (index, JSON text). Raises InvalidInput for malformed JSON or an invalid request."""
    try:
        members = _members(body)
        spans = [span for key, span in members if key == "samples"]
        if len(spans) > 1:
            raise InvalidInput([{"field": "samples", "message": "appears more than once"}])
        array = spans[0] if spans and body[spans[0][0]] == _OPEN_LIST else None
        skeleton = body if array is None else bytes(body[: array[0]]) + b"[]" + bytes(body[array[1] :])
        try:
            request = parse_body(JobCreate, skeleton)
        except ValidationError as exc:
            raise InvalidInput.from_pydantic(exc.errors()) from None
        elements = _elements(body, *array) if array is not None else iter(())
        return request, _reporting(elements)
    except _Malformed as exc:
        raise InvalidInput([{"field": "body", "message": str(exc)}]) from None


# The members of a sample that hold a conversation's turns (hsx.wire.SampleIn.messages, .conversations).
_TURN_KEYS = ("messages", "conversations")


def cut_turns(text: Body) -> Body:
    """One sample's JSON text with its conversation cut where the model stops reading it (the first turn
    that is not an object, or the turn past MAX_TURNS: hsx.wire's `_turns`), so that a list of millions
    is never built as Python objects only to be refused with one error. Anything this walk cannot read
    is left as it is, for the parser to refuse; a text without either member name is not walked. A
    member name written with escapes is not seen here: the model still cuts that list once parsed."""
    if not any(key.encode() in text for key in _TURN_KEYS):
        return text
    try:
        members = _members(text)
    except (_Malformed, InvalidInput):
        return text
    for key, (start, end) in members:
        if key in _TURN_KEYS and text[start] == _OPEN_LIST:
            cut = _turns_cut(text, start, end)
            if cut is not None:
                return bytes(text[:start]) + b"[" + bytes(text[start + 1 : cut]) + b"]" + bytes(text[end:])
    return text


def _turns_cut(text: Body, start: int, end: int) -> int | None:
    """Where the turns of the array text[start:end] are cut (just past the last one kept), or None to
    keep them all."""
    try:
        for index, (first, stop) in enumerate(_spans(text, start, end, "messages")):
            if index >= MAX_TURNS or text[first] != _OPEN_OBJECT:
                return stop
    except _Malformed:
        return None
    return None


def _reporting(elements: Iterator[tuple[int, Body]]) -> Iterator[tuple[int, Body]]:
    try:
        yield from elements
    except _Malformed as exc:
        raise InvalidInput([{"field": "samples", "message": str(exc)}]) from None


def _members(body: Body) -> list[tuple[str, tuple[int, int]]]:
    """The top-level object's (key, value span) pairs, in order."""
    pos = _skip_ws(body, 0)
    if pos >= len(body) or body[pos] != _OPEN_OBJECT:
        raise InvalidInput([{"field": "body", "message": "the body must be a JSON object"}])
    members: list[tuple[str, tuple[int, int]]] = []
    pos = _skip_ws(body, pos + 1)
    if body[pos : pos + 1] == b"}":
        return _at_end(body, pos + 1, members)
    while True:
        if body[pos : pos + 1] != b'"':
            raise _Malformed(pos, "expected a member name in quotes")
        key_end = _string_end(body, pos)
        try:
            key = json.loads(body[pos:key_end])
        except ValueError:
            raise _Malformed(pos, "invalid member name") from None
        pos = _skip_ws(body, key_end)
        if body[pos : pos + 1] != b":":
            raise _Malformed(pos, "expected ':'")
        start = _skip_ws(body, pos + 1)
        end = _value_end(body, start)
        members.append((key, (start, end)))
        pos = _skip_ws(body, end)
        sep = body[pos : pos + 1]
        if sep == b"}":
            return _at_end(body, pos + 1, members)
        if sep != b",":
            raise _Malformed(pos, "expected ',' or '}'")
        pos = _skip_ws(body, pos + 1)


def _at_end(body: Body, pos: int, members: list[tuple[str, tuple[int, int]]]) -> list[tuple[str, tuple[int, int]]]:
    pos = _skip_ws(body, pos)
    if pos != len(body):
        raise _Malformed(pos, "unexpected data after the object")
    return members


def _elements(body: Body, start: int, end: int) -> Iterator[tuple[int, Body]]:
    """The elements of the array body[start:end], a value span that opens with '['."""
    for index, (first, stop) in enumerate(_spans(body, start, end, "samples")):
        yield index, body[first:stop]


def _spans(body: Body, start: int, end: int, what: str) -> Iterator[tuple[int, int]]:
    """The (start, end) of each element of the array body[start:end], a value span that opens with '['
    and holds `what`."""
    if body[end - 1] != _CLOSE_LIST:
        raise _Malformed(end - 1, f"expected ']' to close the {what} array")
    pos = _skip_ws(body, start + 1)
    if pos == end - 1:
        return
    index = 0
    while True:
        stop = _value_end(body, pos)
        yield pos, stop
        index += 1
        pos = _skip_ws(body, stop)
        if pos == end - 1:
            return
        if body[pos : pos + 1] != b",":
            raise _Malformed(pos, f"expected ',' or ']' after element {index - 1} of the {what} array")
        pos = _skip_ws(body, pos + 1)


def _skip_ws(body: Body, pos: int) -> int:
    match = _WS.match(body, pos)
    return match.end() if match else pos


def _string_end(body: Body, pos: int) -> int:
    """Just past the string that opens at pos."""
    i = pos + 1
    while (m := _STRING_STOP.search(body, i)) is not None:
        if body[m.start()] == _QUOTE:
            return m.start() + 1
        i = m.start() + 2  # a backslash and the character it escapes
    raise _Malformed(pos, "unterminated string")


def _flat_list_end(body: Body, pos: int) -> int | None:
    """Just past the list that opens at pos if it holds no string, list or object, else None. Finding
    bytes is memchr's work, several times faster than a regular expression's walk over the digits.
    The next '[' is found first and bounds the other searches, so however deep lists nest, each byte
    between two of them is searched a few times in all, never once per list that encloses it."""
    stop = len(body)
    for c in (b"[", b"{", b'"', b"}", b"]"):
        found = body.find(c, pos + 1, stop)
        if found >= 0:
            stop = found
    return stop + 1 if stop < len(body) and body[stop] == _CLOSE_LIST else None


def _container_end(body: Body, pos: int) -> int:
    """Just past the array or object that opens at pos. From bracket to bracket: the quotes between
    two are counted (in C, as bytes.count does), and only a bracket or backslash inside a string costs
    a step to close that string, so a list of many strings (a conversation's turns) costs no Python
    step per string, and no memory."""
    depth, i, j = 0, pos, -1
    while True:
        if j < i:
            found = _BRACKET.search(body, i)
            if found is None:
                raise _Malformed(pos, "unclosed array or object")
            j = found.start()
        stop = body.find(b"\\", i, j)
        if stop < 0:
            stop = j
        if body.count(b'"', i, stop) % 2:  # a string is open at `stop`: step past it, escapes and all
            i = _string_end(body, body.rfind(b'"', i, stop))
            continue
        if stop < j:  # a backslash outside any string: not JSON, which the parser will say; step on
            i = stop + 1
            continue
        if body[j] == _OPEN_LIST and (flat := _flat_list_end(body, j)) is not None:
            i = flat  # a list of numbers (token ids): skipped whole, depth unchanged
        else:
            depth += 1 if body[j] in b"[{" else -1
            if depth > MAX_DEPTH:
                raise _Malformed(j, f"arrays and objects nested more than {MAX_DEPTH} deep")
            i = j + 1
        if depth == 0:
            return i


def _value_end(body: Body, pos: int) -> int:
    """Just past the value that starts at pos. Bracket kinds are not matched here: the value is
    parsed afterwards, which refuses a mismatch."""
    if pos >= len(body):
        raise _Malformed(pos, "expected a value")
    first = body[pos]
    if first == _QUOTE:
        return _string_end(body, pos)
    if first in b"[{":
        return _container_end(body, pos)
    m = _SCALAR_END.search(body, pos)
    stop = m.start() if m else len(body)
    if stop == pos:
        raise _Malformed(pos, "expected a value")
    return stop
