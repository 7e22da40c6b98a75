"""Large request bodies: time, memory and how the rest of the API answers meanwhile.

    python -m benchmarks.bench_bodies                     # SQLite, lines of 1, 10 and 100 MB
    python -m benchmarks.bench_bodies --database-url postgresql://postgres@127.0.0.1/test --sizes 1,10

Starts an API-only service (no writer, no model server: no vocabulary check) that takes lines and JSON
bodies of up to 128 MiB, then:

- creates a job of one NDJSON line of each size (token ids), timing the create, and /healthz polled
  every 20 ms from another connection while it runs;
- creates a job from an inline JSON body (`--json-mb`, 2,000-token samples), timing it and sampling
  the service's RSS: before, the most during, and after;
- sends three such JSON bodies at once (the service takes `--max-large-bodies` of them, the others are
  answered 503 at once) while small creates are timed;
- sends three bodies at once whose token ids, or layers, are all of the wrong type (each must be a 422
  with one error, whatever the number of elements), sampling the service's RSS;
- sends, one at a time, conversations of millions of mistyped turns and of 100,000 turns, inline, as
  an NDJSON line (and three of the largest at once) and as a Parquet row (and a Parquet row of ten
  million token ids), each a 422 with one error, measuring the service's peak RSS, against a service
  with the default limits (`--conversations-only` runs these alone).

Prints one line per measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.support.procs import Process, free_port, hsx_command

MiB = 1024 * 1024


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def high_water_mark(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_high_water_mark(pid: int) -> bool:
    """Start the kernel's record of the process's peak RSS afresh (Linux; the process must be ours)."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


class Watch:
    """While running: the service's RSS sampled, and /healthz (and a small create, if asked) timed. The
    peak is the kernel's high-water mark over the run where it can be reset, so that a request shorter
    than the sampling interval is measured too; else the most sampled."""

    def __init__(self, base: str, pid: int, *, creates: bool = False):
        self.base, self.pid, self.creates = base, pid, creates
        self.health: list[float] = []
        self.create_times: list[float] = []
        self.peak = 0
        self._exact = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def __enter__(self) -> Watch:
        self._exact = reset_high_water_mark(self.pid)
        self.peak = rss(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        if self._exact:
            self.peak = max(self.peak, high_water_mark(self.pid))

    def _run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=120) as c:
            while not self._stop.is_set():
                self.peak = max(self.peak, rss(self.pid))
                t = time.perf_counter()
                c.get("/healthz").raise_for_status()
                self.health.append(time.perf_counter() - t)
                if self.creates:
                    t = time.perf_counter()
                    c.post("/v1/jobs", json={"samples": [{"input_ids": [1, 2, 3]}]}).raise_for_status()
                    self.create_times.append(time.perf_counter() - t)
                self._stop.wait(0.02)


def ms(values: list[float]) -> str:
    if not values:
        return "no requests"
    return f"p50 {statistics.median(values) * 1000:.0f} ms, max {max(values) * 1000:.0f} ms ({len(values)} requests)"


def one_line(mb: float, rng: random.Random) -> bytes:
    """One NDJSON sample line of about `mb` MB: 5-digit token ids."""
    n = int(mb * 1_000_000 / 6)
    return b'{"input_ids": [' + ",".join(str(rng.randrange(10000, 32000)) for _ in range(n)).encode() + b"]}\n"


def json_body(mb: float, rng: random.Random, tokens: int = 2000) -> bytes:
    sample = ",".join(str(rng.randrange(10000, 32000)) for _ in range(tokens))
    n = int(mb * 1_000_000 / (len(sample) + 20))
    return ("{" + '"samples": [' + ",".join(f'{{"input_ids": [{sample}]}}' for _ in range(n)) + "]}").encode()


def three_at_once(base: str, pid: int, body: bytes) -> None:
    def post(_):
        with httpx.Client(base_url=base, timeout=3600) as one:
            t = time.perf_counter()
            r = one.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
            return r.status_code, time.perf_counter() - t

    before = rss(pid)
    with Watch(base, pid, creates=True) as watch, ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(post, range(3)))
    print(
        f"three such bodies at once: answers {sorted(s for s, _ in answers)} in "
        f"{', '.join(f'{t:.1f}' for _, t in answers)} s; RSS {before / MiB:.0f} -> peak "
        f"{watch.peak / MiB:.0f} -> {rss(pid) / MiB:.0f} MiB; small creates meanwhile "
        f"{ms(watch.create_times)}; /healthz {ms(watch.health)}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1,10,100", help="NDJSON line sizes in MB")
    parser.add_argument("--json-mb", type=float, default=57.0, help="size of the inline JSON bodies")
    parser.add_argument("--max-large-bodies", type=int, default=2)
    parser.add_argument("--database-url", default=None, help="default: a SQLite file in a temporary folder")
    parser.add_argument("--conversations-only", action="store_true", help="only the conversation bodies")
    args = parser.parse_args(argv)
    rng = random.Random(0)
    with tempfile.TemporaryDirectory(prefix="hsx-bodies-") as tmp:
        work = Path(tmp)
        url = args.database_url or f"sqlite:///{work / 'bodies.db'}"
        if not args.conversations_only:
            raised = ["--max-json-bytes", str(128 * MiB), "--max-sample-bytes", str(128 * MiB)]
            with service(work, url, raised + ["--max-large-bodies", str(args.max_large_bodies)]) as (base, pid):
                large_bodies(base, pid, args, rng)
        # The conversation bodies against the limits a service starts with: each fits --max-sample-bytes.
        with service(work, url, []) as (base, pid):
            conversation_bodies(base, pid, work)
    return 0


@contextlib.contextmanager
def service(work: Path, url: str, flags: list[str]) -> Iterator[tuple[str, int]]:
    """An API-only service on `url` (no writer, no model server: no vocabulary check) with `flags`; its
    base URL and pid, once it answers."""
    port = free_port()
    svc = Process(
        hsx_command()
        + ["serve", "--no-writer", "--backend-url", "http://127.0.0.1:9", "--database-url", url]
        + ["--output-root", str(work / "out"), "--input-root", str(work), "--port", str(port)]
        + [*flags, "--log-level", "warning"],
        work / f"service-{port}.log",
    )
    base = f"http://127.0.0.1:{port}"
    pid = svc.proc.pid
    try:
        svc.wait_http(base + "/healthz")
        with Watch(base, pid) as idle:
            time.sleep(2)
        database = url.split(":", maxsplit=1)[0]
        print(
            f"service on {database} ({' '.join(flags) or 'default limits'}), RSS at start {rss(pid) / MiB:.0f} MiB, "
            f"idle /healthz {ms(idle.health)}"
        )
        yield base, pid
    finally:
        svc.stop()


def large_bodies(base: str, pid: int, args: argparse.Namespace, rng: random.Random) -> None:
    with httpx.Client(base_url=base, timeout=3600) as c:
        for mb in (float(s) for s in args.sizes.split(",")):
            line = one_line(mb, rng)
            before = rss(pid)
            with Watch(base, pid) as watch:
                t = time.perf_counter()
                resp = c.post("/v1/jobs", content=line, headers={"content-type": "application/x-ndjson"})
                took = time.perf_counter() - t
            assert resp.status_code == 202, resp.text
            size = len(line) / 1e6
            print(
                f"NDJSON line of {size:6.1f} MB: {took:6.2f} s ({size / took:5.1f} MB/s); "
                f"RSS {before / MiB:.0f} -> peak {watch.peak / MiB:.0f} -> {rss(pid) / MiB:.0f} MiB; "
                f"/healthz meanwhile {ms(watch.health)}"
            )
        body = json_body(args.json_mb, rng)
        before = rss(pid)
        with Watch(base, pid) as watch:
            t = time.perf_counter()
            resp = c.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
            took = time.perf_counter() - t
        assert resp.status_code == 202, resp.text
        time.sleep(1)
        count = resp.json()["counts"]["total"]
        print(
            f"inline JSON of {len(body) / 1e6:.1f} MB ({count} samples): {took:.2f} s; "
            f"RSS {before / MiB:.0f} -> peak {watch.peak / MiB:.0f} -> {rss(pid) / MiB:.0f} MiB one second "
            f"after; /healthz meanwhile {ms(watch.health)}"
        )
    three_at_once(base, pid, body)
    mistyped_bodies(base, pid)


MISTYPED = {
    "1M mistyped token ids": {"samples": [{"input_ids": ["a"] * 1_000_000}]},
    "4M mistyped layers": {"layers": [1.5] * 4_000_000, "samples": [{"input_ids": [1]}]},
}


def mistyped_bodies(base: str, pid: int) -> None:
    """Three bodies at once whose lists hold the wrong type in every element: each must cost one error."""
    for label, doc in MISTYPED.items():
        body = json.dumps(doc).encode()

        def post(_, body=body):
            with httpx.Client(base_url=base, timeout=3600) as one:
                t = time.perf_counter()
                r = one.post("/v1/jobs", content=body, headers={"content-type": "application/json"})
                return r.status_code, len(r.json().get("errors") or []), time.perf_counter() - t

        before = rss(pid)
        with Watch(base, pid) as watch, ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(post, range(3)))
        print(
            f"three bodies of {label} ({len(body) / 1e6:.0f} MB) at once: answers {sorted(a[0] for a in answers)} "
            f"with {sorted(a[1] for a in answers)} errors in {', '.join(f'{a[2]:.1f}' for a in answers)} s; "
            f"RSS {before / MiB:.0f} -> peak {watch.peak / MiB:.0f} -> {rss(pid) / MiB:.0f} MiB"
        )


def turns(n: int) -> list[dict[str, str]]:
    return [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i} of the conversation"} for i in range(n)
    ]


CONVERSATIONS = {
    "messages: [1] * 2.7M": {"id": "t", "messages": [1] * 2_700_000},
    "messages: [1] * 400k": {"id": "t", "messages": [1] * 400_000},
    'conversations: ["x"] * 400k': {"id": "t", "conversations": ["x"] * 400_000},
    "a conversation of 100,000 turns": {"id": "t", "messages": turns(100_000)},
}


def conversation_bodies(base: str, pid: int, input_root: Path) -> None:
    """Each conversation body alone, inline and as an NDJSON line, then three of the largest at once;
    then each as a Parquet row, with a row of ten million token ids: a 422 with one error, and the RSS."""
    with httpx.Client(base_url=base, timeout=3600) as c:
        for label, sample in CONVERSATIONS.items():
            for how, body, media in (
                ("json", json.dumps({"samples": [sample]}).encode(), "application/json"),
                ("ndjson", json.dumps(sample).encode() + b"\n", "application/x-ndjson"),
            ):
                one_body(c, pid, f"{label} ({how}, {len(body) / 1e6:.1f} MB)", body, media)
        largest = json.dumps({"samples": [CONVERSATIONS["messages: [1] * 2.7M"]]}).encode()
        before = rss(pid)
        with Watch(base, pid) as watch, ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda _: c.post("/v1/jobs", content=largest, headers=JSON_BODY), range(3)))
        print(
            f"three of messages: [1] * 2.7M (json) at once: {sorted(r.status_code for r in answers)} with "
            f"{sorted(len(r.json()['errors']) for r in answers)} errors; RSS {before / MiB:.0f} -> peak "
            f"{watch.peak / MiB:.0f} -> {rss(pid) / MiB:.0f} MiB"
        )
        parquet_rows(c, pid, input_root)


JSON_BODY = {"content-type": "application/json"}


def one_body(c: httpx.Client, pid: int, label: str, body: bytes, media: str) -> None:
    before = rss(pid)
    with Watch(str(c.base_url), pid) as watch:
        t = time.perf_counter()
        r = c.post("/v1/jobs", content=body, headers={"content-type": media})
        took = time.perf_counter() - t
    print(
        f"{label}: {r.status_code} with {len(r.json().get('errors') or [])} error(s) in {took:.2f} s; "
        f"RSS {before / MiB:.0f} -> peak {watch.peak / MiB:.0f} -> {rss(pid) / MiB:.0f} MiB",
        flush=True,
    )


def parquet_rows(c: httpx.Client, pid: int, input_root: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    # The service loads pyarrow with its first Parquet file: a small job first, so that the rows below
    # are measured without that one-time cost.
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]]}), input_root / "small.parquet")
    before = rss(pid)
    c.post("/v1/jobs", json={"input_path": "small.parquet"}).raise_for_status()
    print(f"pyarrow loaded by a first Parquet job: RSS {before / MiB:.0f} -> {rss(pid) / MiB:.0f} MiB")
    rows = {**CONVERSATIONS, "input_ids: [1] * 10M": {"id": "t", "input_ids": [1] * 10_000_000}}
    for label, sample in rows.items():
        pq.write_table(pa.table({k: [v] for k, v in sample.items()}), input_root / "row.parquet")
        size = (input_root / "row.parquet").stat().st_size
        one_body(c, pid, f"{label} (Parquet row, {size:,} bytes)", b'{"input_path": "row.parquet"}', "application/json")


if __name__ == "__main__":
    sys.exit(main())
