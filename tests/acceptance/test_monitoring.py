"""What an operator sees of a run with bad dumps, in the multi-node layout: the API (`hsx serve
--no-writer --api-tokens`) and an `hsx worker --metrics-port` on Postgres, beside a synthetic reference
server whose fault switches make the first dumps bad. While the job runs and after, its retries by reason
show in the job (API, SDK, `hsx status`) and in the worker's /metrics; the API's /metrics needs a token
(a read token is enough) and carries the writers table; the Grafana dashboard reads only names these
real scrapes hold; and a job deleted without its files has them deleted by a later `hsx delete --files`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from hsx.sdk import Attempts, HsxClient
from hsx.states import TERMINAL_JOB_STATES
from tests.support.metrics import (
    PROMETHEUS_OWN,
    dashboard,
    dashboard_expressions,
    declared_names,
    documented_alerts,
    promql_metric_names,
    series_names,
)
from tests.support.procs import Process, free_port, hsx_command, start_synthetic

HIDDEN, NUM_LAYERS, VOCAB = 64, 8, 1000
WRITE, READ = "monitor-write-token", "monitor-read-token"
BAD_DUMPS, MAX_ATTEMPTS, SAMPLES = 8, 3, 30
KINDS = ["wrong_shape", "missing_layer"]


@dataclass
class Run:
    api: str
    metrics: str
    reference: str
    output: Path
    worker: Process


def wait_for(what, timeout: float = 60.0, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = what()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"{what} never held")


def answer(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=5)
    except httpx.TransportError:
        return None


@pytest.fixture(scope="module")
def run(tmp_path_factory, postgres_module_url) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("monitoring")
    # A slow prefill (4 ms a token) keeps the job running for seconds after its first retries.
    server, reference = start_synthetic(
        tmp,
        hidden=HIDDEN,
        num_layers=NUM_LAYERS,
        vocab=VOCAB,
        dump_root=tmp / "dumps",
        extra=["--enable-fault-injection", "--prefill-us-per-token", "4000"],
    )
    api_port, metrics_port = free_port(), free_port()
    common = ["--database-url", postgres_module_url, "--output-root", str(tmp / "output")]
    api = Process(
        hsx_command()
        + ["serve", "--no-writer", *common, "--port", str(api_port), "--input-root", str(tmp)]
        + ["--api-tokens", f"{WRITE},{READ}:read"],
        tmp / "api.log",
    )
    worker = None
    try:
        api.wait_http(f"http://127.0.0.1:{api_port}/healthz")  # migrates the database first
        worker = Process(
            hsx_command()
            + ["worker", *common, "--backend-url", reference, "--dump-root", str(tmp / "dumps")]
            + ["--metrics-port", str(metrics_port), "--max-attempts", str(MAX_ATTEMPTS), "--dump-wait-s", "3"],
            tmp / "worker.log",
        )
        metrics = f"http://127.0.0.1:{metrics_port}"
        # Ready (its probe request answered) before any fault is switched on.
        wait_for(lambda: (r := answer(metrics + "/healthz")) and r.json()["writer"]["state"] == "ready", 90)
        yield Run(f"http://127.0.0.1:{api_port}", metrics, reference, tmp / "output", worker)
    finally:
        for proc in (worker, api, server):
            if proc is not None:
                proc.stop()


def hsx(run: Run, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HSX_URL": run.api, "HSX_TOKEN": WRITE}
    return subprocess.run(hsx_command() + list(argv), capture_output=True, text=True, env=env, timeout=120)


def test_retries_show_by_reason_while_the_job_runs_and_after(run):
    # The next BAD_DUMPS dumps are bad, one of KINDS each; counter naming runs one sample at a time, so
    # they fall on the first samples in order: 2 retries and a failure each for the first two (a budget
    # of 3), 2 retries for the third, which then succeeds.
    faults = {"seed": 5, "bad_dumps": {"count": BAD_DUMPS, "probability": 0.0, "kind": KINDS}}
    assert httpx.post(run.reference + "/admin/faults", json=faults).status_code == 200
    samples = [{"id": f"m{i}", "input_ids": [(7 * i + j) % VOCAB for j in range(40)]} for i in range(SAMPLES)]
    with HsxClient(run.api, token=WRITE) as client:
        job = client.create_job(samples, name="monitored")
        # Seen while it runs, not only once it has ended.
        running = wait_for(
            lambda: (j := client.get_job(job.id)).attempts.retried >= 4 and j.state not in TERMINAL_JOB_STATES and j,
            120,
        )
        assert running.attempts.by_reason and set(running.attempts.by_reason) <= set(KINDS)
        finished = client.wait(job.id, timeout=240)
    injected = httpx.get(run.reference + "/admin/faults").json()["injected"]
    assert sum(n for kind, n in injected.items() if kind.startswith("bad_dump.")) == BAD_DUMPS
    attempts = finished.attempts
    assert isinstance(attempts, Attempts)  # the SDK's typed model
    assert (attempts.retried, attempts.failed, finished.counts.failed) == (6, 2, 2)
    assert attempts.ok == SAMPLES - 2 and attempts.total == attempts.ok + BAD_DUMPS + attempts.interrupted
    assert set(attempts.by_reason) <= set(KINDS) and sum(attempts.by_reason.values()) == BAD_DUMPS
    assert attempts.waiting_retry == 0 and finished.state == "partial"  # two failed, the others stored
    raw = httpx.get(f"{run.api}/v1/jobs/{job.id}", headers={"Authorization": f"Bearer {READ}"}).json()
    assert raw["attempts"] == attempts.model_dump()

    status = hsx(run, "status", job.id)
    assert status.returncode == 0, status.stderr
    assert "retried 6" in status.stdout
    reasons = re.search(r"^retries by reason: (.*)$", status.stdout, re.M)
    assert reasons, status.stdout
    assert {part.rsplit(" ", 1)[0] for part in reasons[1].split(", ")} == set(attempts.by_reason)
    as_json = json.loads(hsx(run, "status", job.id, "--json").stdout)
    assert as_json["attempts"]["by_reason"] == attempts.by_reason

    # The worker's own counters say the same: every bad dump a failed attempt with its reason code.
    text = httpx.get(run.metrics + "/metrics").text
    series_names(text)  # every line in the text format
    counted = {
        m[1]: float(m[2])
        for m in re.finditer(r'^hsx_attempts_total\{outcome="failed",reason="(\w+)"\} (\S+)$', text, re.M)
    }
    assert counted == {code: float(n) for code, n in attempts.by_reason.items()}


def test_the_apis_metrics_need_a_token_and_the_dashboard_reads_what_is_exported(run):
    assert httpx.get(run.api + "/metrics").status_code == 401
    scrape = httpx.get(run.api + "/metrics", headers={"Authorization": f"Bearer {READ}"})
    assert scrape.status_code == 200, "a read token is enough for a scrape"
    names = series_names(scrape.text)
    assert {"hsx_workers", "hsx_worker_tokens_per_second", "hsx_worker_heartbeat_age_seconds"} <= names
    worker = httpx.get(run.metrics + "/metrics").text
    assert re.search(r"^hsx_writer_ready\{identity=\"[^\"]+\"\} 1$", worker, re.M)
    exported = declared_names(scrape.text) | declared_names(worker)
    unknown = {(t, n) for t, expr in dashboard_expressions(dashboard()) for n in promql_metric_names(expr) - exported}
    assert unknown == set()
    alerts = {(a, n) for a, expr in documented_alerts() for n in promql_metric_names(expr) - exported - PROMETHEUS_OWN}
    assert alerts == set()
    health = httpx.get(run.metrics + "/healthz")
    assert health.status_code == 200 and health.json()["writer"]["state"] == "ready"


def test_files_kept_by_a_delete_are_deleted_by_a_later_delete_with_files(run):
    with HsxClient(run.api, token=WRITE) as client:
        job = client.wait(client.create_job([{"input_ids": [1, 2, 3]}]), timeout=120)
    folder = run.output / job.id
    kept = hsx(run, "delete", job.id)
    assert kept.returncode == 0, kept.stderr
    assert f"hsx delete {job.id} --files" in kept.stdout and folder.joinpath("manifest.json").is_file()
    gone = hsx(run, "delete", job.id, "--files")
    assert (gone.returncode, gone.stdout.strip()) == (0, f"deleted {job.id} and its files")
    assert not folder.exists()
    again = hsx(run, "delete", job.id, "--files")
    assert again.returncode == 2 and "not found" in again.stderr
