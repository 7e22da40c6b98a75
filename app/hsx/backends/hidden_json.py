"""Streaming parser for SGLang's `/generate` answer when it carries hidden states in JSON.

Asked for `return_hidden_states: true`, a stock SGLang server writes the prompt's hidden states into
`meta_info.hidden_states` as nested JSON lists of floats: element 0 is the prompt's rows, a 2-D list
`[rows][width]`; any further elements are 1-D rows of decode steps. For a long prompt and a wide
model that is more than a gigabyte of text (4,710 tokens x 21,504 floats), so the answer is never
held whole, nor as Python floats:

- everything outside `meta_info.hidden_states` (the "skeleton") is copied as it streams by, with
  that one value replaced by `null`, and decoded with `json.loads` at the end;
- element 0's rows are parsed one row at a time, as soon as a row's closing bracket has arrived,
  straight into a preallocated float32 array; the decode rows after it are skipped.

Memory stays at the output array plus about one chunk and one row of text. The skeleton is walked
by a small tokenizer (strings and escapes, the container stack, the current key) that jumps between
interesting bytes with regular expressions, never a Python step per byte of the big array.

A row's numbers are converted by `np.fromstring(row, sep=",")`: C code around Python's own
correctly rounded decimal-to-double conversion, so every value is exactly the float64 nearest its
text, then rounded once to float32. Measured against `float()`, `json.loads`, `np.loadtxt` and
casts of byte-string arrays, it was the fastest exact converter that numpy and the standard library
offer; the conversion itself is most of the time spent. Like `float()`, it accepts a few spellings
that JSON does not (`+1`, `.5`, `1.`, `01`): their values are unambiguous and neither `json` nor
`orjson` writes them, so they are not looked for (that would add a quarter to a third to the time).
Everything else that is not a number (an empty field, `1.2.3`, `"x"`, `null`) is an error, and so
are `NaN`, `Infinity` and values beyond float32's range.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

__all__ = ["HiddenStatesAnswerParser", "HiddenStatesJSONError", "parse_hidden_states_answer"]


class HiddenStatesJSONError(ValueError):
    """The answer is not JSON, is cut short, or its hidden states are missing or of another shape.
    The message says what, and at which byte of the answer."""


def parse_hidden_states_answer(chunks: Iterable[bytes], *, rows: int, width: int) -> tuple[dict[str, Any], np.ndarray]:
    """Consume the answer body chunk by chunk (any chunk boundaries, even 1 byte). Return (answer, array):
    `answer` is the whole JSON answer (the single object) with meta_info.hidden_states replaced by None
    (so it is small), and `array` is a float32 numpy array of shape (rows, width) holding element 0 of
    meta_info.hidden_states. Raise HiddenStatesJSONError when: the JSON is malformed; there is no
    meta_info.hidden_states or it is empty (SGLang answers `[]` for max_new_tokens 0); element 0 is not a
    2-D list; its row count != rows or any row's length != width; a value is not a finite number."""
    parser = HiddenStatesAnswerParser(rows=rows, width=width)
    for chunk in chunks:
        parser.feed(chunk)
    return parser.finish()


# JSON's whitespace: four bytes only (bytes.strip() would take \x0b and \x0c too).
_WS = b" \t\n\r"
_NON_WS = re.compile(rb"[^ \t\n\r]")
_STRUCTURAL = re.compile(rb'["{}\[\],:]')
_STRING_STOP = re.compile(rb'["\\]')
_BRACKET = re.compile(rb"[\[\]]")
# Between two rows of element 0: a comma, whitespace either side; before the first row, only whitespace.
_ROW_GAP = re.compile(rb"[ \t\n\r]*(,?)[ \t\n\r]*")
_JSON_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
# What the decode rows after element 0 may hold; they are skipped, not converted, so a NaN there
# (a decode step gone wrong) is no reason to refuse the prompt's states.
_SKIPPABLE = b"0123456789.eE+-,[] \t\n\rNaInfity"
# A row's text longer than this (per value) cannot be a row of numbers; it bounds what is buffered.
_MAX_BYTES_PER_VALUE = 64
_MAX_GAP_BYTES = 4096

_QUOTE, _BACKSLASH = ord('"'), ord("\\")
_OPEN_OBJECT, _CLOSE_OBJECT, _OPEN_LIST, _CLOSE_LIST = ord("{"), ord("}"), ord("["), ord("]")
_COMMA = ord(",")

_SKELETON, _PRELUDE, _ROWS, _SKIP = "skeleton", "prelude", "rows", "skip"


def _fromstring_raises_on_garbage() -> bool:
    """Whether this numpy's `fromstring` raises on text it cannot convert. Older releases warn
    (DeprecationWarning) and return what they read so far, which must not pass for a whole row."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            np.fromstring(b"1,x", dtype=np.float64, sep=",")
        except ValueError:
            return True
    return False


_FROMSTRING_RAISES = _fromstring_raises_on_garbage()


def _parse_floats(text: bytes) -> np.ndarray:
    """The comma-separated numbers in `text`, as float64; ValueError when one is not a number."""
    if _FROMSTRING_RAISES:
        return np.fromstring(text, dtype=np.float64, sep=",")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        try:
            return np.fromstring(text, dtype=np.float64, sep=",")
        except DeprecationWarning as exc:
            raise ValueError(str(exc)) from None


class _Frame:
    """One open container of the skeleton: an object (with the key whose value comes next) or a list."""

    __slots__ = ("expect_key", "is_object", "key")

    def __init__(self, is_object: bool):
        self.is_object = is_object
        self.key: str | None = None
        self.expect_key = is_object


class HiddenStatesAnswerParser:
    """The incremental form of `parse_hidden_states_answer`: `feed` each chunk, then `finish`.
    For callers that receive the body in a loop of their own (an async client, say)."""

    def __init__(self, *, rows: int, width: int):
        if rows < 0 or width < 0:
            raise ValueError(f"rows and width must not be negative (got {rows} x {width})")
        self.rows = rows
        self.width = width
        self._array = np.empty((rows, width), dtype=np.float32)
        self._received = 0  # bytes fed so far: the stream offset of the next chunk
        self._mode = _SKELETON
        # skeleton tokenizer
        self._skeleton = bytearray()
        self._stack: list[_Frame] = []
        self._root_seen = False
        self._in_string = False
        self._escape = False
        self._string_is_key = False
        self._string_start = 0
        # meta_info.hidden_states: where its value is in the stream, and where `null` stands for it
        self._captured = False
        self._null_at = 0  # index in the skeleton
        self._value_start = 0  # stream offsets
        self._value_end = 0
        self._prelude_seen_list = False
        # element 0's rows
        self._row_index = 0
        self._pending: list[bytes] = []  # text of an unfinished row (and the gap before it)
        self._pending_base = 0
        self._pending_size = 0
        self._max_pending = width * _MAX_BYTES_PER_VALUE + _MAX_GAP_BYTES
        # the decode rows
        self._skip_depth = 0

    # -- feeding ------------------------------------------------------------------------------

    def feed(self, chunk: bytes) -> None:
        """Take the next piece of the body, of any size."""
        data = chunk if type(chunk) is bytes else bytes(chunk)
        base = self._received
        self._received += len(data)
        pos = 0
        while pos < len(data):
            pos = _STEPS[self._mode](self, data, pos, base)

    def finish(self) -> tuple[dict[str, Any], np.ndarray]:
        """The answer (meta_info.hidden_states set to None) and element 0 as a (rows, width) float32
        array, once the whole body has been fed."""
        if self._mode != _SKELETON or self._stack or not self._root_seen:
            raise HiddenStatesJSONError(f"the answer ends early, at byte {self._received}: {self._where()}")
        try:
            decoded = json.loads(bytes(self._skeleton))
        except json.JSONDecodeError as exc:
            raise HiddenStatesJSONError(
                f"the answer is not valid JSON: {exc.msg} at byte {self._stream_offset(exc)}"
            ) from None
        except ValueError as exc:  # not UTF-8
            raise HiddenStatesJSONError(f"the answer is not valid JSON: {exc}") from None
        answer = self._single_answer(decoded)
        if not self._captured:
            raise HiddenStatesJSONError(
                f"the answer has no meta_info.hidden_states (was return_hidden_states set?): {_preview(answer)}"
            )
        return answer, self._array

    # -- the skeleton -------------------------------------------------------------------------

    def _skeleton_step(self, data: bytes, pos: int, base: int) -> int:
        """Copy skeleton bytes from `pos`, tracking strings and containers; return where it stopped
        (the end of `data`, or where the hidden states' value begins)."""
        out = self._skeleton
        end = len(data)
        while pos < end:
            if not self._stack:
                pos = self._outside_root(data, pos, base)
                continue
            if self._in_string:
                pos = self._string_step(data, pos)
                continue
            found = _STRUCTURAL.search(data, pos)
            if found is None:
                out += data[pos:]
                return end
            at = found.start()
            out += data[pos : at + 1]
            pos = at + 1
            if self._structural(data[at], base + at):
                return pos
        return pos

    def _structural(self, byte: int, offset: int) -> bool:
        """Follow one structural byte (already copied to the skeleton, at `offset` in the answer);
        True when it is the colon the hidden states' value comes after."""
        if byte == _QUOTE:
            self._in_string = True
            self._string_is_key = self._stack[-1].expect_key
            self._string_start = len(self._skeleton) - 1
        elif byte in (_OPEN_OBJECT, _OPEN_LIST):
            self._stack.append(_Frame(byte == _OPEN_OBJECT))
        elif byte in (_CLOSE_OBJECT, _CLOSE_LIST):
            self._close_container(byte == _CLOSE_OBJECT, offset)
        elif byte == _COMMA:
            self._next_item(offset)
        elif self._at_hidden_states():  # a colon, after the key meta_info.hidden_states
            self._capture_value(offset)
            return True
        return False

    def _capture_value(self, colon: int) -> None:
        """The hidden states' value starts after the colon at `colon`: the skeleton holds null in its
        place, and the value is read in its own mode."""
        if self._captured:
            raise HiddenStatesJSONError(f"meta_info.hidden_states appears twice (byte {colon})")
        self._captured = True
        self._null_at = len(self._skeleton)
        self._skeleton += b"null"
        self._value_start = colon + 1
        self._mode = _PRELUDE

    def _outside_root(self, data: bytes, pos: int, base: int) -> int:
        """Before the answer's opening bracket only whitespace may come, and after its closing one too."""
        found = _NON_WS.search(data, pos)
        if found is None:
            return len(data)
        at = found.start()
        byte = data[at]
        if self._root_seen:
            raise HiddenStatesJSONError(f"data after the end of the answer at byte {base + at}: {_describe(data, at)}")
        if byte not in (_OPEN_OBJECT, _OPEN_LIST):
            raise HiddenStatesJSONError(
                f"the answer is not a JSON object or list: it is {_describe(data, at)} at byte {base + at}"
            )
        self._root_seen = True
        self._skeleton.append(byte)
        self._stack.append(_Frame(byte == _OPEN_OBJECT))
        return at + 1

    def _string_step(self, data: bytes, pos: int) -> int:
        out = self._skeleton
        if self._escape:  # the byte after a backslash never ends the string
            out.append(data[pos])
            self._escape = False
            return pos + 1
        found = _STRING_STOP.search(data, pos)
        if found is None:
            out += data[pos:]
            return len(data)
        at = found.start()
        out += data[pos : at + 1]
        if data[at] == _BACKSLASH:
            self._escape = True
            return at + 1
        self._in_string = False
        if self._string_is_key:
            frame = self._stack[-1]
            frame.key = self._decode_key(bytes(out[self._string_start :]))
            frame.expect_key = False
        return at + 1

    def _decode_key(self, raw: bytes) -> str:
        try:
            key = json.loads(raw)
        except ValueError:
            raise HiddenStatesJSONError(f"malformed key {_preview(raw)} near byte {self._received}") from None
        return key if isinstance(key, str) else ""

    def _close_container(self, is_object: bool, offset: int) -> None:
        frame = self._stack.pop()
        if frame.is_object != is_object:
            closer = "}" if is_object else "]"
            opened = "an object" if frame.is_object else "a list"
            raise HiddenStatesJSONError(f"'{closer}' at byte {offset} closes {opened}")

    def _next_item(self, offset: int) -> None:
        frame = self._stack[-1]
        if frame.is_object:
            frame.expect_key = True
            frame.key = None
            return
        if len(self._stack) == 1:
            raise HiddenStatesJSONError(
                f"the answer is a list of more than one answer (second one at byte {offset}); expected one"
            )

    def _at_hidden_states(self) -> bool:
        """Whether the colon just read follows the key `hidden_states` of the answer's meta_info
        (the answer being the root object, or the one element of a root list)."""
        stack = self._stack
        if not stack[-1].is_object or stack[-1].key != "hidden_states":
            return False
        if len(stack) == 2:
            parent = stack[0]
        elif len(stack) == 3 and not stack[0].is_object:
            parent = stack[1]
        else:
            return False
        return parent.is_object and parent.key == "meta_info"

    # -- meta_info.hidden_states: up to element 0's first row -----------------------------------

    def _prelude_step(self, data: bytes, pos: int, base: int) -> int:
        found = _NON_WS.search(data, pos)
        if found is None:
            return len(data)
        at = found.start()
        byte = data[at]
        if not self._prelude_seen_list:
            if byte != _OPEN_LIST:
                raise HiddenStatesJSONError(
                    f"meta_info.hidden_states is not a list: it is {_describe(data, at)} at byte {base + at}"
                )
            self._prelude_seen_list = True
            return at + 1
        if byte == _CLOSE_LIST:
            raise HiddenStatesJSONError(
                f"meta_info.hidden_states is empty (byte {base + at}): the server returned no hidden states "
                "(max_new_tokens 0?)"
            )
        if byte != _OPEN_LIST:
            raise HiddenStatesJSONError(
                f"element 0 of meta_info.hidden_states is not a 2-D list: it is {_describe(data, at)} "
                f"at byte {base + at}"
            )
        self._mode = _ROWS
        return at + 1

    # -- element 0: the rows ------------------------------------------------------------------

    def _rows_step(self, data: bytes, pos: int, base: int) -> int:
        """Parse every row of element 0 that is complete once `data` is added; keep the rest."""
        if data.find(b"]", pos) < 0:  # no row ends in this chunk: just keep it
            self._keep(data, pos, base)
            return len(data)
        if self._pending:
            kept = self._pending_size
            buf = b"".join([*self._pending, memoryview(data)[pos:]])
            buf_base = self._pending_base
            self._pending, self._pending_size = [], 0
        else:
            kept = 0
            buf, buf_base = (data, base) if pos == 0 else (data[pos:], base + pos)
        i = 0
        while True:
            gap = _ROW_GAP.match(buf, i)
            assert gap is not None  # the pattern matches the empty string
            at = gap.end()
            if at == len(buf):
                break
            if buf[at] == _CLOSE_LIST:
                self._end_rows(bool(gap.group(1)), buf_base + at)
                return pos + (at + 1 - kept)  # the closing bracket came with `data`, not before it
            self._check_row_start(buf, at, bool(gap.group(1)), buf_base)
            close = buf.find(b"]", at + 1)
            if close < 0:
                break
            self._store_row(buf[at + 1 : close], buf_base + at)
            i = close + 1
        self._keep(buf, i, buf_base)
        return len(data)

    def _keep(self, data: bytes, pos: int, base: int) -> None:
        """Hold the text of an unfinished row (never more than one row's worth) for the next chunk."""
        if pos == len(data):
            return
        if not self._pending:
            self._pending_base = base + pos
        self._pending.append(data if pos == 0 else data[pos:])
        self._pending_size += len(data) - pos
        if self._pending_size > self._max_pending:
            raise HiddenStatesJSONError(
                f"row {self._row_index} of meta_info.hidden_states[0] (byte {self._pending_base}) runs past "
                f"{self._max_pending} bytes without closing: not a row of {self.width} numbers"
            )

    def _check_row_start(self, buf: bytes, at: int, comma: bool, buf_base: int) -> None:
        offset = buf_base + at
        if buf[at] != _OPEN_LIST:
            raise HiddenStatesJSONError(
                f"element 0 of meta_info.hidden_states is not a 2-D list: found {_describe(buf, at)} where row "
                f"{self._row_index} should start, at byte {offset}"
            )
        if comma != (self._row_index > 0):
            what = "a comma before the first row" if comma else "no comma before this row"
            raise HiddenStatesJSONError(f"meta_info.hidden_states[0]: {what} (byte {offset})")
        if self._row_index == self.rows:
            raise HiddenStatesJSONError(
                f"meta_info.hidden_states[0] has more than the {self.rows} rows expected (row {self.rows} at "
                f"byte {offset})"
            )

    def _store_row(self, text: bytes, offset: int) -> None:
        """Convert one row's text (between its brackets; it starts at byte `offset`) into the array."""
        index = self._row_index
        try:
            values = _parse_floats(text)
        except ValueError:
            raise self._row_error(text, offset) from None
        if values.size != self.width or _ends_with_comma(text):  # fromstring takes "1,2," for [1, 2]
            raise self._row_error(text, offset)
        row = self._array[index]
        with np.errstate(over="ignore", invalid="ignore"):
            row[...] = values
        if not np.isfinite(row).all():
            column = int(np.flatnonzero(~np.isfinite(row))[0])
            value = text.split(b",")[column].strip(_WS)
            reason = "out of float32's range" if np.isfinite(values[column]) else "not a finite number"
            raise HiddenStatesJSONError(
                f"meta_info.hidden_states[0][{index}][{column}] is {_preview(value)}, {reason} "
                f"(row starts at byte {offset})"
            )
        self._row_index = index + 1

    def _row_error(self, text: bytes, offset: int) -> HiddenStatesJSONError:
        """Say what is wrong with a row that did not convert to `width` numbers: a nested list, a
        value that is not a number, or a count other than `width`."""
        where = f"meta_info.hidden_states[0][{self._row_index}] (row starts at byte {offset})"
        if b"[" in text:
            return HiddenStatesJSONError(f"{where} holds a list: element 0 is deeper than 2-D")
        fields = text.split(b",")
        field_offset = offset + 1
        for column, field in enumerate(fields):
            value = field.strip(_WS)
            if (value or len(fields) > 1) and not _JSON_NUMBER.fullmatch(value) and not _parses(value):
                shown = _preview(value) if value else "empty"
                at = field_offset + len(field) - len(field.lstrip(_WS))
                return HiddenStatesJSONError(f"{where}: value {column} is {shown}, not a number (byte {at})")
            field_offset += len(field) + 1
        count = len(fields) if text.strip(_WS) else 0
        return HiddenStatesJSONError(f"{where} has {count} values, expected {self.width}")

    def _end_rows(self, comma: bool, offset: int) -> None:
        """Element 0 closed at `offset`: it must have had exactly `rows` rows; skip what follows."""
        if comma:
            raise HiddenStatesJSONError(f"meta_info.hidden_states[0] ends with a comma (byte {offset})")
        if self._row_index != self.rows:
            raise HiddenStatesJSONError(
                f"meta_info.hidden_states[0] has {self._row_index} rows, expected {self.rows} (ends at byte {offset})"
            )
        self._mode = _SKIP
        self._skip_depth = 1

    # -- the decode rows after element 0 -------------------------------------------------------

    def _skip_step(self, data: bytes, pos: int, base: int) -> int:
        """Pass over the rest of meta_info.hidden_states (decode steps' rows), counting brackets."""
        while True:
            found = _BRACKET.search(data, pos)
            stop = len(data) if found is None else found.start()
            stray = data[pos:stop].translate(None, _SKIPPABLE)
            if stray:
                at = data.index(stray[:1], pos)
                raise HiddenStatesJSONError(
                    f"meta_info.hidden_states holds {_describe(data, at)} at byte {base + at}: only lists of numbers "
                    "belong there"
                )
            if found is None:
                return len(data)
            self._skip_depth += 1 if data[stop] == _OPEN_LIST else -1
            pos = stop + 1
            if self._skip_depth == 0:
                self._value_end = base + pos
                self._mode = _SKELETON
                return pos

    # -- reporting ----------------------------------------------------------------------------

    def _where(self) -> str:
        if self._mode == _ROWS:
            return f"inside meta_info.hidden_states[0], at row {self._row_index} of {self.rows}"
        if self._mode in (_PRELUDE, _SKIP):
            return "inside meta_info.hidden_states"
        if not self._root_seen:
            return "no JSON value at all"
        return "inside a string" if self._in_string else f"{len(self._stack)} container(s) still open"

    def _stream_offset(self, exc: json.JSONDecodeError) -> int:
        """Where in the answer the skeleton's decoding failed: the skeleton is the answer with the
        hidden states' value replaced by `null`."""
        at = len(exc.doc[: exc.pos].encode()) if isinstance(exc.doc, str) else exc.pos
        if not self._captured or at < self._null_at:
            return at
        if at < self._null_at + 4:
            return self._value_start
        return at - (self._null_at + 4) + self._value_end

    def _single_answer(self, decoded: Any) -> dict[str, Any]:
        if isinstance(decoded, list):
            if len(decoded) != 1:
                raise HiddenStatesJSONError(f"the answer is a list of {len(decoded)} answers; expected one")
            decoded = decoded[0]
        if not isinstance(decoded, dict):
            raise HiddenStatesJSONError(f"the answer is not a JSON object: {_preview(decoded)}")
        return decoded


# What reads the body in each mode. Kept out of the instances: bound methods stored on the parser
# would make it a reference cycle, and the output array would then outlive its last user until the
# garbage collector's next pass.
_STEPS: dict[str, Callable[[HiddenStatesAnswerParser, bytes, int, int], int]] = {
    _SKELETON: HiddenStatesAnswerParser._skeleton_step,
    _PRELUDE: HiddenStatesAnswerParser._prelude_step,
    _ROWS: HiddenStatesAnswerParser._rows_step,
    _SKIP: HiddenStatesAnswerParser._skip_step,
}


def _ends_with_comma(text: bytes) -> bool:
    last = text[-1:]
    if last in _WS:  # rarely: only indented JSON has whitespace before a row's closing bracket
        last = text.rstrip(_WS)[-1:]
    return last == b","


def _parses(value: bytes) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True


_KINDS = {
    ord('"'): "a string",
    ord("{"): "an object",
    ord("["): "a list",
    ord("n"): "null",
    ord("t"): "true",
    ord("f"): "false",
}


def _describe(data: bytes, at: int) -> str:
    """What the JSON value starting at data[at] is, judged from that byte alone (what follows may
    not have arrived yet, and a message must not depend on where the chunks were cut)."""
    byte = data[at]
    if byte in _KINDS:
        return _KINDS[byte]
    if byte == ord("-") or ord("0") <= byte <= ord("9"):
        return "a number"
    return repr(chr(byte)) if 32 <= byte < 127 else f"byte 0x{byte:02x}"


def _preview(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
