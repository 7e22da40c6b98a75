"""Parsing benchmark: SGLang's /generate answer with hidden states, through hsx.backends.hidden_json.

    python -m benchmarks.bench_hidden_json                    # the defaults below: a real answer's size
    python -m benchmarks.bench_hidden_json --rows 4710 --width 21504 --chunk-size 16384
    python -m benchmarks.bench_hidden_json --rows 200 --width 4096 --baseline

The answer is made on the fly by a generator and never exists as one bytes object, as when it
streams from the server: `--distinct` rows of bf16 values (random normal, made with numpy), written
as orjson writes them (compact; `--spaced` for json.dumps's default ", "), cycled to `--rows` rows,
cut into `--chunk-size` chunks. Prints MB/s of JSON text, floats/s, wall and CPU seconds, the peak
traced memory (tracemalloc) next to the size of the output array and the peak RSS of the process,
and checks that every value came out exact. `--baseline` also times what the parser replaces:
json.loads of the whole answer, then numpy.array of the lists (it holds the text and a Python float
per value: keep it small).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
import tracemalloc
from collections.abc import Iterator

import numpy as np

from hsx.backends.hidden_json import parse_hidden_states_answer

MiB = 1024 * 1024


def bf16_rows(count: int, width: int, seed: int = 0) -> np.ndarray:
    """Random normal values cut to bf16 (the top 16 bits of a float32), as float32."""
    values = np.random.default_rng(seed).standard_normal((count, width), dtype=np.float32)
    return (values.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


class Answer:
    """A /generate answer of `rows` x `width` hidden states, served in chunks by `chunks()`."""

    def __init__(self, args):
        self.rows, self.width, self.chunk_size = args.rows, args.width, args.chunk_size
        self.values = bf16_rows(args.distinct, args.width)
        separators = (", ", ": ") if args.spaced else (",", ":")
        self.row_texts = [json.dumps(row, separators=separators).encode() for row in self.values.tolist()]
        meta = {"id": "hsx-bench", "prompt_tokens": args.rows, "cached_tokens": 0, "hidden_states": None}
        skeleton = json.dumps({"text": "x", "output_ids": [17], "meta_info": meta}, separators=separators).encode()
        self.head, self.tail = skeleton.split(b"null")
        self.head += b"[["
        self.tail = b"]]" + self.tail
        self.gap = separators[0].encode()
        self.size = len(self.head) + len(self.tail) + sum(self.row_size(i) for i in range(args.rows))

    def row_size(self, i: int) -> int:
        return len(self.row_texts[i % len(self.row_texts)]) + (len(self.gap) if i else 0)

    def chunks(self) -> Iterator[bytes]:
        yield self.head
        step = self.chunk_size
        for i in range(self.rows):
            row = self.row_texts[i % len(self.row_texts)]
            if i:
                row = self.gap + row
            for j in range(0, len(row), step):
                yield row[j : j + step]
        yield self.tail

    def exact(self, array: np.ndarray) -> bool:
        want = self.values.view(np.uint32)
        got = array.view(np.uint32)
        return all(np.array_equal(got[i], want[i % len(want)]) for i in range(self.rows))


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4710, help="prompt tokens")
    parser.add_argument("--width", type=int, default=21504, help="floats per token (hidden size x layers)")
    parser.add_argument("--chunk-size", type=int, default=65536, help="bytes per chunk of the body")
    parser.add_argument("--distinct", type=int, default=64, help="different rows, cycled")
    parser.add_argument("--spaced", action="store_true", help="json.dumps's default separators (', ')")
    parser.add_argument("--no-trace", action="store_true", help="run without tracemalloc")
    parser.add_argument("--repeat", type=int, default=1, help="parse N times, report the fastest")
    parser.add_argument("--baseline", action="store_true", help="also time json.loads of the whole answer")
    args = parser.parse_args(argv)

    answer = Answer(args)
    floats = args.rows * args.width
    print(
        f"answer: {args.rows} rows x {args.width} floats = {floats / 1e6:.1f} M floats, "
        f"{answer.size / 1e6:.1f} MB of JSON ({answer.size / floats:.1f} bytes per float), "
        f"{args.chunk_size}-byte chunks; output array {floats * 4 / MiB:.0f} MiB float32"
    )

    start = time.perf_counter()
    for _ in answer.chunks():
        pass
    generating = time.perf_counter() - start

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if not args.no_trace:
        tracemalloc.start()  # numpy reports its buffers to tracemalloc too; few allocations, little cost
    runs = []
    array = None
    for _ in range(args.repeat):
        array = None  # one output array at a time, as in the service
        cpu0, start = cpu_seconds(), time.perf_counter()
        _, array = parse_hidden_states_answer(answer.chunks(), rows=args.rows, width=args.width)
        runs.append((time.perf_counter() - start, cpu_seconds() - cpu0))
    traced = tracemalloc.get_traced_memory()[1] if tracemalloc.is_tracing() else None
    tracemalloc.stop()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert array is not None

    wall, cpu = min(runs)
    print(
        f"parse: {wall:.2f} s wall, {cpu:.2f} s CPU: {answer.size / wall / 1e6:.1f} MB/s, "
        f"{floats / wall / 1e6:.2f} M floats/s (the generator alone: {generating:.2f} s)"
    )
    if len(runs) > 1:
        print(f"  fastest of {len(runs)}; all runs: " + ", ".join(f"{w:.2f} s" for w, _ in runs))
    if traced is not None:
        print(
            f"memory: peak traced {traced / MiB:.1f} MiB, of which the array {array.nbytes / MiB:.1f} MiB "
            f"and {(traced - array.nbytes) / MiB:.2f} MiB besides"
        )
    print(f"memory: peak RSS {rss / MiB:.0f} MiB (before parsing {rss_before / MiB:.0f} MiB)")
    print(f"exact: {'yes' if answer.exact(array) else 'NO'}")

    if args.baseline:
        body = b"".join(answer.chunks())
        start = time.perf_counter()
        lists = json.loads(body)["meta_info"]["hidden_states"][0]
        baseline = np.array(lists, dtype=np.float32)
        wall = time.perf_counter() - start
        assert np.array_equal(baseline.view(np.uint32), array.view(np.uint32))
        print(f"baseline json.loads + np.array: {wall:.2f} s, {answer.size / wall / 1e6:.1f} MB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
