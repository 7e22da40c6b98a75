"""Cutting a streamed JSONL body into lines (hsx.service.lines): any chunking gives the same lines, a
line over the limit is refused with its number as soon as it passes the limit, and the work to take
in a chunk does not grow with the line it belongs to."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from hsx.service.lines import LineSplitter, LineTooLongError

KiB = 1024


def split(data: bytes, sizes: list[int], max_line: int = 1 << 30) -> list[tuple[int, bytes]]:
    splitter = LineSplitter(max_line)
    out: list[tuple[int, bytes]] = []
    pos, i = 0, 0
    while pos < len(data):
        n = sizes[i % len(sizes)]
        out += splitter.feed(data[pos : pos + n])
        pos, i = pos + n, i + 1
    return out + splitter.end()


@pytest.mark.parametrize("sizes", [[1], [2, 3], [7], [4096], [1 << 20], [5, 1, 300]])
def test_any_chunking_gives_the_same_numbered_lines(sizes):
    rng = random.Random(1)
    lines = [bytes(rng.choice(b"ab{}[]1,") for _ in range(rng.choice([0, 1, 5, 80, 3000]))) for _ in range(200)]
    data = b"\n".join(lines)
    got = [(n, line) for n, line in split(data, sizes) if line.strip()]  # a blank line across chunks may come
    assert got == [(i + 1, line) for i, line in enumerate(lines) if line]


def test_a_final_newline_ends_the_last_line_and_empty_lines_are_counted_not_returned():
    assert split(b"a\n\nb\n", [2]) == [(1, b"a"), (3, b"b")]
    assert split(b"\n\n\na\n\n", [1]) == [(4, b"a")]
    assert split(b"\n" * 10 + b"x", [3, 4]) == [(11, b"x")]
    assert split(b" \r\n\t\n\r\nx\n", [100]) == [(4, b"x")]
    assert split(b"a\r\nb", [1]) == [(1, b"a\r"), (2, b"b")]


def test_a_line_over_the_limit_is_refused_with_its_number_before_it_ends():
    splitter = LineSplitter(max_line=10)
    assert splitter.feed(b"0123456789\nshort\n") == [(1, b"0123456789"), (2, b"short")]
    splitter.feed(b"01234")
    with pytest.raises(LineTooLongError) as exc:
        splitter.feed(b"567890")  # 11 bytes so far, no newline yet
    assert exc.value.lineno == 3 and exc.value.limit == 10


def test_a_last_line_without_newline_is_held_to_the_same_limit():
    splitter = LineSplitter(max_line=4)
    with pytest.raises(LineTooLongError) as exc:
        splitter.feed(b"ok\n12345")
    assert exc.value.lineno == 2


def test_taking_in_a_chunk_costs_the_same_early_and_late_in_a_long_line():
    """Linear work: memory allocated to take in each 64 KiB chunk of a 32 MiB line stays about one
    chunk (re-joining the unfinished line on every chunk allocated the whole line each time, which is
    what made a 100 MB line take a minute), and the line is joined once, at its newline."""
    chunk = b"1," * (32 * KiB)
    n = 512
    splitter = LineSplitter(max_line=len(chunk) * n + 10)
    tracemalloc.start()
    try:
        worst = 0
        for _ in range(n):
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            assert splitter.feed(chunk) == []
            worst = max(worst, tracemalloc.get_traced_memory()[1] - before)
        tracemalloc.reset_peak()
        before = tracemalloc.get_traced_memory()[0]
        (lineno, line), *rest = splitter.feed(b"1\n")
        joined = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert worst < 4 * KiB  # the chunk itself is kept, not copied
    assert lineno == 1 and rest == [] and len(line) == len(chunk) * n + 1
    assert joined < len(line) + 64 * KiB  # one copy of the line


def test_a_body_of_empty_lines_is_stepped_over_without_a_step_per_line():
    """50 MB of blank lines (a hostile NDJSON body): every line counted, nothing returned, and the
    splitter's Python loop runs once per chunk, not once per line (counted with a tracing hook)."""
    import sys

    splitter, chunk = LineSplitter(1 << 20), b"\r\n" * (1 << 19)
    calls = 0

    def count(frame, event, _arg):
        nonlocal calls
        if event == "call" and frame.f_code.co_name == "_skip_blank":
            calls += 1

    sys.setprofile(count)
    try:
        got = [line for _ in range(50) for line in splitter.feed(chunk)]
    finally:
        sys.setprofile(None)
    assert got == [] and splitter.lines == 50 << 19
    assert calls == 50
