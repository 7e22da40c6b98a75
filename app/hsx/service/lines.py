"""The lines of a JSONL stream, cut as its bytes arrive, each no longer than a limit.

Each chunk is searched for newlines once, from where the last search stopped, and a line that spans
chunks is kept as its pieces and joined once, when its newline arrives: the work is linear in the
stream's size whatever its lines' lengths (re-joining and re-splitting the unfinished rest on every
chunk made one long line quadratic). A line over the limit is refused as soon as its bytes pass it,
so no more than the limit is ever held for it.
"""

from __future__ import annotations


class LineTooLongError(ValueError):
    def __init__(self, lineno: int, limit: int):
        super().__init__(f"line {lineno} is longer than {limit} bytes")
        self.lineno = lineno
        self.limit = limit


class LineSplitter:
    """Feed chunks, get back the (line number, line) pairs they complete; newlines are not kept."""

    def __init__(self, max_line: int):
        self.max_line = max_line
        self.lines = 0  # lines completed so far
        self._pieces: list[bytes] = []
        self._held = 0  # bytes of the unfinished line

    def feed(self, chunk: bytes) -> list[tuple[int, bytes]]:
        done: list[tuple[int, bytes]] = []
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
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
