"""`hsx serve` as an operator runs it: the folders it makes for itself."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

from tests.support.procs import Process, free_port, hsx_command


def serve_args(tmp: Path, *extra: str, port: int | None = None) -> list[str]:
    """`hsx serve` on SQLite in `tmp`, API only (no model server is needed to answer)."""
    return hsx_command() + [
        "serve",
        "--no-writer",
        "--database-url",
        f"sqlite:///{tmp / 'hsx.db'}",
        "--output-root",
        str(tmp / "output"),
        "--port",
        str(port or free_port()),
        *extra,
    ]


def test_serve_creates_its_input_root_and_names_it_when_a_file_is_missing(tmp_path):
    root = tmp_path / "srv" / "hsx" / "input"
    port = free_port()
    proc = Process(serve_args(tmp_path, "--input-root", str(root), port=port), tmp_path / "serve.log")
    try:
        url = f"http://127.0.0.1:{port}"
        proc.wait_http(url + "/healthz")
        assert root.is_dir()
        resp = httpx.post(url + "/v1/jobs", json={"input_path": "x.jsonl"}, timeout=30)
        assert resp.status_code == 422, resp.text
        assert resp.json()["errors"][0]["message"] == f"no file 'x.jsonl' under the input root {root}"
    finally:
        proc.stop()


def test_serve_says_in_one_line_when_it_cannot_create_its_input_root(tmp_path):
    (tmp_path / "file").write_text("")
    root = tmp_path / "file" / "input"
    proc = subprocess.run(serve_args(tmp_path, "--input-root", str(root)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    # The last line, after the migration's log: the database is brought up to date first.
    assert proc.stderr.splitlines()[-1] == f"hsx serve: cannot create the input root {root}: Not a directory"
