"""The load benchmark's own code path on a small run (SQLite), so that the command docs/performance.md
quotes keeps working: every client kind answered, no 5xx, /healthz answered meanwhile."""

from __future__ import annotations

import json
import subprocess
import sys


def test_small_run_answers_every_kind_of_request(tmp_path):
    figures = tmp_path / "figures.json"
    args = ["--clients", "20", "--seconds", "3", "--databases", "sqlite", "--samples", "8", "--tokens", "16"]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_api_load", *args, "--json", str(figures)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    [run] = json.loads(figures.read_text())["tables"]["load"]
    assert (run["database"], run["clients"]) == ("sqlite", 20)
    assert run["answered"] > 20 and run["ok"] + run["busy"] == run["answered"], run
    assert run["other_status"] == 0 and run["busy_without_retry_after"] == 0, run
    assert set(run["p99_ms_by_kind"]) == {"job", "samples", "tensors", "events"}, run
    assert run["healthz_p50_ms"] is not None and run["healthz_failed"] == 0, run
    assert run["service_cores"] > 0 and run["client_cores"] > 0, run
    assert "sqlite" in out.stdout and "/healthz p50 ms" in out.stdout
