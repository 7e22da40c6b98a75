"""`schemathesis run` over the service's OpenAPI document with every check and every phase (examples,
coverage, fuzzing, and stateful sequences that follow the document's links from a created job), on
SQLite and Postgres: the document and the service agree on everything schemathesis can test.

The rules JSON Schema cannot state are applied to positive cases by tests.support.openapi_rules."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support import openapi_rules
from tests.support.stack import start_service

REPO = Path(__file__).resolve().parents[2]
# Bounded so that one database's run takes about a minute.
EXAMPLES_PER_OPERATION = 20
SEED = 20240611
# An event stream of a job that never finishes (no writer runs here) is read for this long, then cut.
CONFIG = """
[[operations]]
include-name = "GET /v1/jobs/{job_id}/events"
request-timeout = 1.0
"""


def test_every_check_passes_on_every_operation(database_url, tmp_path):
    svc = start_service(tmp_path, database_url, extra=["--no-writer"])
    try:
        (svc.input_root / openapi_rules.INPUT_FILE).write_text('{"id": "a", "input_ids": [1, 2, 3]}\n')
        config = tmp_path / "schemathesis.toml"
        config.write_text(CONFIG)
        report = tmp_path / "report.json"
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "schemathesis.cli",
                "--config-file",
                str(config),
                "run",
                f"{svc.url}/openapi.json",
                "--checks",
                "all",
                "--max-examples",
                str(EXAMPLES_PER_OPERATION),
                "--seed",
                str(SEED),
                "--workers",
                "1",
                "--generation-database",
                "none",
                "--report",
                "json",
                "--report-json-path",
                str(report),
                "--no-color",
            ],
            env={
                **os.environ,
                "SCHEMATHESIS_HOOKS": openapi_rules.__name__,
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            },
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=600,
        )
        out = run.stdout + run.stderr
        assert run.returncode == 0, out[-12000:]
        result = json.loads(report.read_text())
        assert result["failures"] == [] and result["errors"] == [], out[-12000:]
        assert result["operations"]["tested"] == result["operations"]["total"] >= 15
        assert {name: p["status"] for name, p in result["phases"].items()} == dict.fromkeys(
            ("examples", "coverage", "fuzzing", "stateful"), "success"
        ), out[-4000:]
        # The stateful phase went from created jobs to their operations through the document's links.
        links = svc.get("/openapi.json").json()["paths"]["/v1/jobs"]["post"]["responses"]["202"]["links"]
        covered = re.search(r"API Links:\s+(\d+) covered", out)
        assert covered and int(covered.group(1)) >= len(links), out[-4000:]
    finally:
        svc.stop()
