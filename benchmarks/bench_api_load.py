"""The API under many clients at once: job reads, sample pages, one sample's tensors and event streams.

    python -m benchmarks.bench_api_load                                 # 100, 300, 1000 clients; SQLite, Postgres
    python -m benchmarks.bench_api_load --clients 20 --seconds 3 --databases sqlite --json load.json

For each database: a synthetic reference server and a service with its writer store one small job, whose
samples the tensor route then serves; both stop, and an API-only service (`hsx serve --no-writer`) starts on
the same database and output root, so that nothing but the clients loads it. A second job stays queued there
(no writer claims it), for the event streams to follow, as an open dashboard follows a running job.

Then, for each number of clients in turn, every client starts at once, each an asyncio task with a
connection of its own, on loopback. A tenth hold an event stream of the queued job for the whole run (time to
its first event counted as the stream's latency; one answered 503 opens again after its Retry-After). The
others send requests one after another for --seconds, each the next of: the stored job, a page of 5 of its
samples, one stored sample's tensors (safetensors). A request still unanswered after --timeout counts as
failed. Meanwhile a process of its own asks for /healthz four times a second.

Prints, per database and number of clients: requests answered and per second, latency p50, p99 and max
(streams' first events included), answers by status (200; 503, each with Retry-After; any other), requests
with no answer (timeout, connection error), /healthz's latency meanwhile (p50, max), and the CPU the service
and the clients used (in cores: CPU seconds per second of the run). On a machine of few cores the clients
take their share of it: their latencies include their own wait for a core.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

import httpx
import psycopg

from benchmarks.report import Column, Report, add_json_argument
from tests.support.procs import Process, free_port, hsx_command, proc_cpu_and_rss, start_synthetic

STREAM_SHARE = 10  # one client in this many holds an event stream
HEALTH_EVERY_S = 0.25
PAGE = 5


@dataclass
class Tally:
    """What the clients of one run saw."""

    latencies: list[float] = field(default_factory=list)
    statuses: Counter[str] = field(default_factory=Counter)
    by_kind: dict[str, list[float]] = field(default_factory=dict)
    no_retry_after: int = 0
    health: list[float] = field(default_factory=list)

    def answered(self, kind: str, status: int, seconds: float, retry_after: str | None) -> None:
        self.latencies.append(seconds)
        self.by_kind.setdefault(kind, []).append(seconds)
        self.statuses[str(status)] += 1
        if status == 503 and not retry_after:
            self.no_retry_after += 1

    def failed(self, why: str, times: int = 1) -> None:
        self.statuses[why] += times


@dataclass(frozen=True)
class Target:
    """The API-only service and what the clients ask it for."""

    url: str
    stored_job: str
    sample_ids: list[str]
    queued_job: str

    def requests(self, client: int) -> Iterator[tuple[str, str]]:
        """A request client's endless round of (kind, path), each client starting at its own place in it, so
        that every kind is asked for from the start, however few requests each client gets answered."""
        n = client
        while True:
            sample = self.sample_ids[n % len(self.sample_ids)]
            after = self.sample_ids[(n * 7) % len(self.sample_ids)]
            round_ = [
                ("job", f"/v1/jobs/{self.stored_job}"),
                ("samples", f"/v1/jobs/{self.stored_job}/samples?limit={PAGE}&after={after}"),
                ("tensors", f"/v1/jobs/{self.stored_job}/tensors/{sample}"),
            ]
            start = client % len(round_)
            yield from round_[start:] + round_[:start]
            n += 1


def ms(values: list[float], q: float) -> float | None:
    """The q-quantile of seconds `values`, in milliseconds (q=1: the largest); None without values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def client(target: Target, n: int, deadline: float, timeout: float, tally: Tally) -> None:
    """Client `n`, on a connection of its own: a pool shared by every client costs the clients far more
    CPU per request (its bookkeeping grows with its connections), which a machine of few cores takes from
    the service."""
    async with httpx.AsyncClient(timeout=timeout, verify=False, limits=httpx.Limits(max_connections=1)) as http:
        if n % STREAM_SHARE == STREAM_SHARE - 1:
            await stream_client(http, target, deadline, tally)
        else:
            await request_client(http, target, n, deadline, tally)


async def request_client(http: httpx.AsyncClient, target: Target, n: int, deadline: float, tally: Tally) -> None:
    for kind, path in target.requests(n):
        if time.monotonic() >= deadline:
            return
        started = time.monotonic()
        try:
            resp = await http.get(target.url + path)
        except httpx.TimeoutException:
            tally.failed("timeout")
            continue
        except httpx.TransportError as exc:
            tally.failed(type(exc).__name__)
            await asyncio.sleep(0.1)
            continue
        tally.answered(kind, resp.status_code, time.monotonic() - started, resp.headers.get("retry-after"))


async def stream_client(http: httpx.AsyncClient, target: Target, deadline: float, tally: Tally) -> None:
    """Hold the queued job's event stream until the deadline, as a dashboard does; open it again after a
    refusal's Retry-After."""
    url = f"{target.url}/v1/jobs/{target.queued_job}/events"
    while time.monotonic() < deadline:
        started = time.monotonic()
        try:
            async with http.stream("GET", url) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    retry = resp.headers.get("retry-after")
                    tally.answered("events", resp.status_code, time.monotonic() - started, retry)
                    await asyncio.sleep(min(float(retry or 1), max(0.0, deadline - time.monotonic())))
                    continue
                lines = resp.aiter_lines()
                async for line in lines:
                    if line.startswith("event: job"):
                        tally.answered("events", 200, time.monotonic() - started, None)
                        break
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(_drain(lines), timeout=max(0.0, deadline - time.monotonic()))
                return
        except httpx.TimeoutException:
            tally.failed("timeout")
        except httpx.TransportError as exc:
            tally.failed(type(exc).__name__)
            await asyncio.sleep(0.1)


async def _drain(lines: AsyncIterator[str]) -> None:
    async for _ in lines:
        pass


def probe_health(url: str, stop: EventType, out: Queue[tuple[list[float], int]], timeout: float) -> None:
    """/healthz four times a second until `stop`, from a process of its own, so that what it measures is
    the service, not this process's event loop, busy with the clients; puts (latencies, failures) in `out`."""
    took: list[float] = []
    failed = 0
    with httpx.Client(timeout=timeout) as http:
        while not stop.is_set():
            started = time.monotonic()
            try:
                ok = http.get(url + "/healthz").status_code == 200
            except httpx.HTTPError:
                ok = False
            if ok:
                took.append(time.monotonic() - started)
            else:
                failed += 1
            stop.wait(HEALTH_EVERY_S)
    out.put((took, failed))


async def load(target: Target, clients: int, seconds: float, timeout: float) -> tuple[Tally, float]:
    """One run: every client at once for `seconds`; returns the tally and the run's wall time (until the
    last request in flight at the deadline was answered or timed out)."""
    tally = Tally()
    spawn = multiprocessing.get_context("spawn")
    stop, out = spawn.Event(), spawn.Queue()
    prober = spawn.Process(target=probe_health, args=(target.url, stop, out, timeout))
    prober.start()
    started = time.monotonic()
    deadline = started + seconds
    await asyncio.gather(*(client(target, n, deadline, timeout, tally) for n in range(clients)))
    wall = time.monotonic() - started
    stop.set()
    tally.health, failed = out.get(timeout=timeout + 10)
    prober.join()
    if failed:
        tally.failed("healthz no answer", failed)
    return tally, wall


def row(database: str, clients: int, tally: Tally, wall: float) -> dict[str, Any]:
    answered = len(tally.latencies)
    statuses = tally.statuses
    other = sum(v for k, v in statuses.items() if k.isdigit() and k not in ("200", "503"))
    failed = sum(v for k, v in statuses.items() if not k.isdigit() and not k.startswith("healthz"))
    return {
        "database": database,
        "clients": clients,
        "answered": answered,
        "per_s": answered / wall,
        "p50_ms": ms(tally.latencies, 0.5),
        "p99_ms": ms(tally.latencies, 0.99),
        "max_ms": ms(tally.latencies, 1),
        "ok": statuses["200"],
        "busy": statuses["503"],
        "busy_without_retry_after": tally.no_retry_after,
        "other_status": other,
        "no_answer": failed,
        "healthz_p50_ms": ms(tally.health, 0.5),
        "healthz_max_ms": ms(tally.health, 1),
        "healthz_failed": sum(v for k, v in statuses.items() if k.startswith("healthz")),
        "statuses": dict(statuses),
        "p99_ms_by_kind": {kind: ms(v, 0.99) for kind, v in tally.by_kind.items()},
        "wall_s": wall,
    }


COLUMNS = (
    Column("database", "database", left=True),
    Column("clients", "clients", "d"),
    Column("answered", "answered", "d"),
    Column("per_s", "per s", ".0f"),
    Column("p50_ms", "p50 ms", ".0f"),
    Column("p99_ms", "p99 ms", ".0f"),
    Column("max_ms", "max ms", ".0f"),
    Column("ok", "200", "d"),
    Column("busy", "503", "d"),
    Column("other_status", "other", "d"),
    Column("no_answer", "no answer", "d"),
    Column("healthz_p50_ms", "/healthz p50 ms", ".0f"),
    Column("healthz_max_ms", "/healthz max ms", ".0f"),
    Column("healthz_failed", "/healthz no answer", "d"),
    Column("service_cores", "service CPU", ".2f"),
    Column("client_cores", "clients' CPU", ".2f"),
)


# --- the service and its data -------------------------------------------------------------------------------


def store_job(work: Path, database_url: str, output_root: Path, samples: int, tokens: int) -> str:
    """One job of `samples` samples stored by a service with its writer beside a synthetic server; its id."""
    dump_root = work / "dumps"
    server, server_url = start_synthetic(work, hidden=256, num_layers=8, vocab=1000, dump_root=dump_root)
    service = None
    try:
        service, url = start_service(
            work, database_url, output_root, ["--backend-url", server_url, "--dump-root", str(dump_root)]
        )
        with httpx.Client(base_url=url, timeout=60) as http:
            body = {
                "name": "stored",
                "samples": [{"id": f"s{i:04d}", "input_ids": ids(i, tokens)} for i in range(samples)],
            }
            job = http.post("/v1/jobs", json=body).raise_for_status().json()
            deadline = time.monotonic() + 300
            while (state := http.get(f"/v1/jobs/{job['id']}").json()["state"]) not in (
                "succeeded",
                "partial",
                "failed",
            ):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the job is still {state}")
                time.sleep(0.2)
        if state != "succeeded":
            raise RuntimeError(f"the job ended {state}:\n{service.log()[-3000:]}")
        return job["id"]
    finally:
        if service is not None:
            service.stop()
        server.stop()


def ids(i: int, tokens: int) -> list[int]:
    return [(i * 31 + t * 7) % 997 + 1 for t in range(tokens)]


def start_service(work: Path, database_url: str, output_root: Path, extra: list[str]) -> tuple[Process, str]:
    port = free_port()
    args = hsx_command() + ["serve", "--database-url", database_url, "--output-root", str(output_root)]
    args += ["--input-root", str(work / "input"), "--port", str(port), "--log-level", "warning", *extra]
    proc = Process(args, work / f"service-{port}.log")
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(url + "/healthz")
    return proc, url


def prepare(work: Path, database_url: str, args: argparse.Namespace) -> tuple[Process, Target]:
    output_root = work / "output"
    stored = store_job(work, database_url, output_root, args.samples, args.tokens)
    service, url = start_service(work, database_url, output_root, ["--no-writer", *args.serve_arg])
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            page = http.get(f"/v1/jobs/{stored}/samples", params={"limit": 1000}).raise_for_status().json()
            sample_ids = [s["id"] for s in page["data"]]
            queued = http.post("/v1/jobs", json={"name": "followed", "samples": [{"input_ids": [1, 2, 3]}]})
            queued_id = queued.raise_for_status().json()["id"]
    except BaseException:
        service.stop()
        raise
    return service, Target(url, stored, sample_ids, queued_id)


@contextlib.contextmanager
def database(kind: str, work: Path, pg_admin: str) -> Iterator[str]:
    """A fresh database of this kind: a SQLite file in `work`, or a database on the Postgres server."""
    if kind == "sqlite":
        yield f"sqlite:///{work / 'hsx.db'}"
        return
    name = f"hsx_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield pg_admin.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1) + f"/{name}"
    finally:
        with psycopg.connect(pg_admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 300, 1000], help="clients at once, per run")
    parser.add_argument("--seconds", type=float, default=15.0, help="how long each run's clients send requests")
    parser.add_argument("--timeout", type=float, default=60.0, help="a request unanswered after this has failed")
    parser.add_argument("--databases", nargs="+", choices=["sqlite", "postgres"], default=["sqlite", "postgres"])
    parser.add_argument("--pg-admin", default="postgresql://postgres@127.0.0.1:5432/test")
    parser.add_argument("--samples", type=int, default=48, help="samples of the stored job")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per stored sample")
    parser.add_argument(
        "--serve-arg", action="append", default=[], help="one more argument for the API-only service (repeatable)"
    )
    add_json_argument(parser)
    args = parser.parse_args(argv)
    report = Report("bench_api_load", args)
    print(
        f"clients at once for {args.seconds:g} s each, 1 in {STREAM_SHARE} holding an event stream, the others "
        f"reading a job, a page of {PAGE} samples, a sample's tensors ({args.tokens} tokens x 4 layers x 256, "
        "bfloat16) in turn; /healthz every 0.25 s meanwhile",
        flush=True,
    )
    table = report.table("load", *COLUMNS)
    for kind in args.databases:
        with tempfile.TemporaryDirectory(prefix="hsx-load-") as tmp, database(kind, Path(tmp), args.pg_admin) as url:
            service, target = prepare(Path(tmp), url, args)
            try:
                for clients in args.clients:
                    service_cpu, own_cpu = proc_cpu_and_rss(service.proc.pid)[0], time.process_time()
                    tally, wall = asyncio.run(load(target, clients, args.seconds, args.timeout))
                    cores = {
                        "service_cores": (proc_cpu_and_rss(service.proc.pid)[0] - service_cpu) / wall,
                        "client_cores": (time.process_time() - own_cpu) / wall,
                    }
                    table.add(**row(kind, clients, tally, wall), **cores)
                    time.sleep(1)  # what one run left in flight is not the next one's
            finally:
                service.stop()
    report.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
