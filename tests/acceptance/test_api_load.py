"""Many clients at once on a real service: every answer is a 200 or a 503 with Retry-After (never a
500 or a stall), and /healthz is answered meanwhile, on both databases. The speeds themselves are
benchmarks/bench_api_load.py's to measure."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.support.api import problem
from tests.support.stack import start_service

READS = 150
STREAMS = 20


@pytest.fixture(scope="module")
def service(api_only):
    """The module's API-only service (tests/acceptance/conftest.py), one per database."""
    return api_only


async def follow(http: httpx.AsyncClient, path: str) -> str:
    """Open a job's event stream: "followed" once its first event came, "busy" for a 503 with Retry-After."""
    async with http.stream("GET", path) as resp:
        if resp.status_code != 200:
            await resp.aread()
            assert resp.status_code == 503 and resp.headers["retry-after"], resp.text
            return "busy"
        async for line in resp.aiter_lines():
            if line.startswith("event: job"):
                return "followed"
    return "ended"


async def healthz_meanwhile(url: str, times: int) -> list[float]:
    """/healthz's latency, asked `times` times on a connection of its own."""
    took = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as own:
        for _ in range(times):
            await asyncio.sleep(0.2)
            started = time.monotonic()
            assert (await own.get("/healthz")).status_code == 200
            took.append(time.monotonic() - started)
    return took


async def burst(url: str, job_id: str) -> tuple[list[httpx.Response], list[float], list[str]]:
    """READS sample pages and STREAMS event streams of the job at once, /healthz meanwhile."""
    limits = httpx.Limits(max_connections=READS + STREAMS)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as http:
        # The job stays queued (no writer): each stream sends the job, then waits.
        streams = [asyncio.create_task(follow(http, f"/v1/jobs/{job_id}/events")) for _ in range(STREAMS)]
        reads = [asyncio.create_task(http.get(f"/v1/jobs/{job_id}/samples", params={"limit": 5})) for _ in range(READS)]
        healthz = await healthz_meanwhile(url, 5)
        return await asyncio.gather(*reads), healthz, await asyncio.gather(*streams)


def test_a_burst_of_reads_is_answered_or_refused_and_healthz_meanwhile(service):
    job = service.post_job({"name": "read", "samples": [{"id": f"s{i}", "input_ids": [1, 2, 3]} for i in range(20)]})
    job_id = job.json()["id"]
    answers, healthz, followed = asyncio.run(burst(service.url, job_id))
    statuses = sorted({a.status_code for a in answers})
    assert set(statuses) <= {200, 503}, statuses
    for answer in answers:
        if answer.status_code == 503:
            assert problem(answer, 503)["type"] == "/problems/busy" and int(answer.headers["retry-after"]) >= 1
        else:
            assert [s["id"] for s in answer.json()["data"]] == ["s0", "s1", "s2", "s3", "s4"]
    assert 200 in statuses
    assert max(healthz) < 5, healthz
    assert set(followed) <= {"followed", "busy"} and "followed" in followed, followed
    assert service.get(f"/v1/jobs/{job_id}").status_code == 200  # nothing left stuck
    assert "Traceback" not in service.proc.log()


def test_with_no_wait_every_answer_is_a_200_or_a_503_at_once(tmp_path, database_url):
    """--connection-wait-s 0: a request that finds every slot taken is refused at once, with Retry-After;
    the others are answered, and none fails."""
    svc = start_service(tmp_path, database_url, extra=["--no-writer", "--connection-wait-s", "0"])
    try:
        job_id = svc.post_job({"samples": [{"input_ids": [1, 2, 3]}] * 50}).json()["id"]

        async def burst() -> list[httpx.Response]:
            limits = httpx.Limits(max_connections=200)
            async with httpx.AsyncClient(base_url=svc.url, timeout=60, limits=limits) as http:
                return await asyncio.gather(
                    *(http.get(f"/v1/jobs/{job_id}/samples", params={"limit": 50}) for _ in range(200))
                )

        answers = asyncio.run(burst())
        busy = [a for a in answers if a.status_code == 503]
        assert {a.status_code for a in answers} <= {200, 503}
        assert len(busy) < len(answers)
        for answer in busy:
            assert problem(answer, 503)["type"] == "/problems/busy" and answer.headers["retry-after"] == "1"
    finally:
        svc.stop()
