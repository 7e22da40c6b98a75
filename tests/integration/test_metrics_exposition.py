"""What a writer shows monitoring, in this process on a SQLite file: an `hsx worker`'s --metrics-port
(the real HTTP server on loopback) with /metrics and /healthz by its writer's state, the API's /metrics
with the database's lines and the writer's, one tokens-per-second figure for this process's writer in
/healthz and /metrics, and the Grafana dashboard reading only names these scrapes hold."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from hsx.api.app import create_app
from hsx.config import Settings
from hsx.db.engine import make_engine, session_factory
from hsx.extraction.exposition import MetricsServer
from hsx.extraction.writer import Writer
from tests.support.api import migrated
from tests.support.metrics import (
    PROMETHEUS_OWN,
    dashboard,
    dashboard_expressions,
    declared_names,
    documented_alerts,
    promql_metric_names,
    series_names,
)


def settings_for(tmp: Path, dump_root: str) -> Settings:
    return Settings(
        database_url=f"sqlite:///{tmp / 'hsx.db'}",
        output_root=tmp / "output",
        input_root=tmp / "input",
        dump_root=tmp / dump_root,
        backend_url="http://127.0.0.1:9",  # nothing answers: the writer waits for its model server
        lease_s=30,
    )


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("exposition")
    migrated(settings_for(tmp, "dumps"))
    return tmp


@pytest.fixture(scope="module")
def writer(tmp) -> Iterator[Writer]:
    """A writer running as `hsx serve` runs it: registered, heartbeating, waiting for its model server."""
    settings = settings_for(tmp, "dumps")
    engine = make_engine(settings.database_url)
    writer = Writer(settings, session_factory(engine))
    writer.acquire()
    writer.start_thread()
    deadline = time.monotonic() + 30
    while writer.status.state != "waiting":
        assert time.monotonic() < deadline, writer.status
        time.sleep(0.05)
    yield writer
    writer.stop()
    engine.dispose()


@pytest.fixture(scope="module")
def api(tmp, writer) -> TestClient:
    # No lifespan: the writer is the fixture's, started already.
    return TestClient(create_app(settings_for(tmp, "dumps"), writer))


@pytest.fixture(scope="module")
def port(writer) -> Iterator[str]:
    server = MetricsServer(writer, "127.0.0.1", 0)
    server.start()
    host, number = server.address
    yield f"http://{host}:{number}"
    server.stop()


def sample(text: str, name: str, labels: str = "") -> float:
    found = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert found, f"no {name}{labels} in\n{text}"
    return float(found[1])


def test_the_worker_port_serves_its_writers_metrics_and_health(writer, port):
    writer.metrics.attempt("failed", "no_dump: nothing appeared")
    writer.metrics.backend_latency(0.3)
    writer.metrics.shard_written(0.8, 4096)
    scrape = httpx.get(port + "/metrics")
    assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain; version=0.0.4")
    text = scrape.text
    names = series_names(text)  # every line in the text format
    identity = writer.identity.replace('"', '\\"')
    assert sample(text, "hsx_writer_ready", f'{{identity="{identity}"}}') == 0
    assert sample(text, "hsx_writer_state", f'{{identity="{identity}",state="waiting"}}') == 1
    assert sample(text, "hsx_writer_state", f'{{identity="{identity}",state="ready"}}') == 0
    assert sample(text, "hsx_attempts_total", '{outcome="failed",reason="no_dump"}') >= 1
    assert sample(text, "hsx_shard_write_seconds_bucket", '{le="1"}') >= 1
    assert {"hsx_backend_request_seconds_bucket", "hsx_tokens_per_second", "hsx_shards_written_total"} <= names
    assert "hsx_jobs" not in names, "the database's lines are the API's"
    health = httpx.get(port + "/healthz")
    assert health.status_code == 200, "waiting for its model server is working as it should"
    body = health.json()
    assert body["status"] == "ok" and body["writer"]["identity"] == writer.identity
    assert body["writer"]["state"] == "waiting" and "model server not ready" in body["writer"]["reason"]
    head = httpx.head(port + "/metrics")
    assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 0
    missing = httpx.get(port + "/v1/jobs")
    assert missing.status_code == 404 and missing.headers["content-type"] == "application/problem+json"


@pytest.mark.parametrize("state, status", [("ready", 200), ("waiting", 200), ("refusing", 503), ("starting", 503)])
def test_the_worker_health_answers_by_its_writers_state(tmp, state, status):
    writer = Writer(settings_for(tmp, f"dumps-{state}"), session_factory(make_engine(f"sqlite:///{tmp / 'hsx.db'}")))
    writer.status.set(state, None if state == "ready" else "why")
    server = MetricsServer(writer, "127.0.0.1", 0)
    server.start()
    try:
        host, number = server.address
        health = httpx.get(f"http://{host}:{number}/healthz")
        assert (health.status_code, health.json()["writer"]["state"]) == (status, state)
        assert health.json()["status"] == ("ok" if status == 200 else "unavailable")
        ready = re.search(r"^hsx_writer_ready\{[^}]*\} (\d)$", httpx.get(f"http://{host}:{number}/metrics").text, re.M)
        assert ready and ready[1] == str(int(state == "ready"))
    finally:
        server.stop()


def test_the_worker_health_says_the_layer_sets_it_gives_and_is_healthy_without_the_default(tmp):
    """A worker beside vLLM (L before the final norm) takes no job of the default set; that is no failed probe."""
    writer = Writer(settings_for(tmp, "dumps-vllm"), session_factory(make_engine(f"sqlite:///{tmp / 'hsx.db'}")))
    writer.status.set("ready", None)
    writer.status.server = {"source": "vllm", "layers": [2, 4, 5, 8], "layer_sets": ["eagle3_pre_norm"]}
    server = MetricsServer(writer, "127.0.0.1", 0)
    server.start()
    try:
        host, number = server.address
        health = httpx.get(f"http://{host}:{number}/healthz")
        said = health.json()["writer"]
        assert health.status_code == 200 and (said["layer_sets"], said["serves_default"]) == (
            ["eagle3_pre_norm"],
            False,
        )
    finally:
        server.stop()


def test_a_port_in_use_is_refused_at_once(writer, port):
    with pytest.raises(OSError):
        MetricsServer(writer, "127.0.0.1", int(port.rsplit(":", 1)[1]))


def test_healthz_and_metrics_show_one_rate_for_this_processs_writer(api, writer):
    # Extracted since the writer's last heartbeat: its row still says 0.0 (what /healthz's list once showed
    # next to the writer's own 2.4).
    writer.metrics.extracted(240, 10_000)
    health = api.get("/healthz").json()
    (row,) = [w for w in health["writers"] if w["identity"] == writer.identity]
    assert health["writer"]["tokens_per_s"] > 0
    assert row["tokens_per_s"] == health["writer"]["tokens_per_s"]
    text = api.get("/metrics").text
    identity = writer.identity.replace('"', '\\"')
    own = sample(text, "hsx_tokens_per_second")
    assert own > 0 and sample(text, "hsx_worker_tokens_per_second", f'{{identity="{identity}"}}') == own


def test_the_apis_metrics_hold_the_databases_lines_and_the_writers(api, writer):
    created = api.post("/v1/jobs", json={"samples": [{"input_ids": [1, 2, 3]}]})
    assert created.status_code == 202, created.text
    text = api.get("/metrics").text
    names = series_names(text)
    assert {"hsx_jobs", "hsx_samples", "hsx_samples_waiting_retry", "hsx_workers"} <= names
    assert {"hsx_worker_tokens_per_second", "hsx_worker_heartbeat_age_seconds", "hsx_writer_ready"} <= names
    assert sample(text, "hsx_workers", '{state="waiting"}') >= 1
    assert "hsx_job_attempts" in declared_names(text)


def test_every_dashboard_expression_reads_names_hsx_exports(api, port):
    """A panel whose query names a metric hsx does not export shows nothing, silently: every name in
    deploy/grafana/hsx.json must be one a scrape of the API or a worker's port declares."""
    exported = declared_names(api.get("/metrics").text) | declared_names(httpx.get(port + "/metrics").text)
    doc = dashboard()
    queries = dashboard_expressions(doc)
    assert len(queries) >= 10
    unknown = {(title, name) for title, expr in queries for name in promql_metric_names(expr) - exported}
    assert unknown == set()
    read = {name for _, expr in queries for name in promql_metric_names(expr)}
    wanted = {
        "hsx_worker_tokens_per_second",  # tokens/s per writer
        "hsx_attempts_total",  # attempts by outcome and reason
        "hsx_backend_request_seconds_bucket",  # latency p50/p95
        "hsx_samples",  # samples by state
        "hsx_writer_ready",  # readiness
    }
    assert wanted <= read
    titles = [p["title"] for p in doc["panels"]]
    assert len(set(titles)) == len(titles) and all(p.get("datasource") for p in doc["panels"])


def test_every_documented_alert_reads_names_hsx_exports(api, port):
    exported = declared_names(api.get("/metrics").text) | declared_names(httpx.get(port + "/metrics").text)
    alerts = documented_alerts()
    assert len(alerts) >= 5
    unknown = {(alert, n) for alert, expr in alerts for n in promql_metric_names(expr) - exported - PROMETHEUS_OWN}
    assert unknown == set()


def test_the_promql_reader_finds_metric_names_and_nothing_else():
    expr = (
        'histogram_quantile(0.95, sum by (le, instance) (rate(hsx_backend_request_seconds_bucket{job="w"}[5m]))) '
        "/ on (instance) group_left sum(hsx_samples offset 1h) and hsx_workers > bool 0"
    )
    assert promql_metric_names(expr) == {"hsx_backend_request_seconds_bucket", "hsx_samples", "hsx_workers"}
