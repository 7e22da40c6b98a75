"""Every JSON answer of the API, documents and problems alike, ends with a newline that Content-Length
counts; the answers that are not JSON are as they were."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from hsx.api.app import create_app
from hsx.api.dashboard import FILES
from hsx.config import Settings
from hsx.db.engine import make_engine, upgrade


@pytest.fixture
def client(tmp_path):
    url = f"sqlite:///{tmp_path / 'hsx.db'}"
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    settings = Settings(database_url=url, output_root=tmp_path / "output", input_root=tmp_path / "input")
    with TestClient(create_app(settings)) as c:  # no writer: nothing reaches for a model server
        yield c


def assert_json_line(resp, media_type: str = "application/json") -> dict:
    assert resp.headers["content-type"].startswith(media_type), resp.headers
    assert resp.content.endswith(b"}\n") and resp.content.count(b"\n") == 1, resp.content
    assert int(resp.headers["content-length"]) == len(resp.content)
    return json.loads(resp.content)


@pytest.mark.parametrize("path", ["/healthz", "/v1/jobs", "/v1/workers"])
def test_json_documents_end_with_a_newline(client, path):
    resp = client.get(path)
    assert resp.status_code == 200
    assert_json_line(resp)
    head = client.head(path)
    assert head.content == b"" and head.headers["content-length"] == resp.headers["content-length"]


@pytest.mark.parametrize(
    "method, path, body, status",
    [
        ("GET", "/v1/jobs/job_0123456789abcdef", None, 404),
        ("GET", "/no/such/route", None, 404),
        ("POST", "/v1/jobs", b'{"samples": 1}', 422),
        ("DELETE", "/healthz", None, 405),
    ],
)
def test_problems_end_with_a_newline(client, method, path, body, status):
    resp = client.request(method, path, content=body, headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    assert assert_json_line(resp, "application/problem+json")["status"] == status


def test_answers_that_are_not_json_are_unchanged(client):
    metrics = client.get("/metrics")
    assert metrics.headers["content-type"].startswith("text/plain") and metrics.text.endswith("\n")
    assert not metrics.text.endswith("\n\n")
    page = client.get("/")
    assert page.content == (FILES / "index.html").read_bytes()
