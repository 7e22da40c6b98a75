"""The lines of a JSONL stream, cut as its bytes arrive, each no longer than a limit.

Each chunk is searched for newlines once, from where the last search stopped, and a line that spans
chunks is kept as its pieces and joined once, when its newline arrives: the work is linear in the
stream's size whatever its lines' lengths (re-joining and re-splitting the unfinished rest on every
chunk made one long line quadratic). A line over the limit is refused as soon as its bytes pass it,
so no more than the limit is ever held for it. Blank lines (nothing, or only spaces, tabs and carriage
returns) are counted, not returned: a run of them is stepped over in one regular-expression match, so
a body of nothing but blank lines costs what its size costs in C, not a Python step per line.
"""

from __future__ import annotations

import re

_BLANK_LINES = re.compile(rb"[ \t\r\n]*\n")  # greedy, back to its last newline: linear


class LineTooLongError(ValueError):
    def __init__(self, lineno: int, limit: int):
        super().__init__(f"line {lineno} is longer than {limit} bytes")
        self.lineno = lineno
        self.limit = limit


class LineSplitter:
    """Feed chunks, get back the (line number, line) pairs of the lines they complete, blank lines
    left out (one that spans chunks may come back: a reader skips it); newlines are not kept."""

    def __init__(self, max_line: int):
        self.max_line = max_line
        self.lines = 0  # lines completed so far
        self._pieces: list[bytes] = []
        self._held = 0  # bytes of the unfinished line

    def feed(self, chunk: bytes) -> list[tuple[int, bytes]]:
        done: list[tuple[int, bytes]] = []
        start = 0
        while True:
            if not self._pieces:
                start = self._skip_blank(chunk, start)
            end = chunk.find(b"\n", start)
            if end < 0:
                break
            self._grow(end - start)
            piece = chunk[start:end]
            line = b"".join([*self._pieces, piece]) if self._pieces else piece
            self._pieces, self._held = [], 0
            self.lines += 1
            done.append((self.lines, line))
            start = end + 1
        if start < len(chunk):
            self._grow(len(chunk) - start)
            self._pieces.append(chunk[start:] if start else chunk)
        return done

    def _skip_blank(self, chunk: bytes, start: int) -> int:
        """Count the blank lines that begin at `start` (nothing held); where they stop."""
        found = _BLANK_LINES.match(chunk, start)
        if found is None:
            return start
        self.lines += chunk.count(b"\n", start, found.end())
        return found.end()

    def end(self) -> list[tuple[int, bytes]]:
        """The last line, when the stream does not end with a newline."""
        if not self._pieces:
            return []
        line = b"".join(self._pieces)
        self._pieces, self._held = [], 0
        self.lines += 1
        return [(self.lines, line)]

    def _grow(self, n: int) -> None:
        self._held += n
        if self._held > self.max_line:
            raise LineTooLongError(self.lines + 1, self.max_line)
