"""The follow benchmark's code path on a small run, so that the command docs/performance.md quotes keeps
working: every table with its figures, read from its --json report, and its work folder gone."""

from __future__ import annotations

import json
import subprocess
import sys


def test_a_small_run_reports_latency_read_rates_and_the_disk(tmp_path):
    work, figures = tmp_path / "work", tmp_path / "figures.json"
    work.mkdir()
    args = ["--samples", "12", "--tokens", "64", "--hidden", "256", "--shard-max-wait-s", "1"]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_follow", *args, "--output-dir", str(work), "--json", str(figures)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    tables = json.loads(figures.read_text())["tables"]
    (latency,) = tables["latency"]
    assert latency["shards"] == 3 and 0 < latency["p50_s"] <= latency["p99_s"] < 30, latency
    assert [r["encoding"] for r in tables["read_rate"]] == ["raw", "lossless", "fp8"]
    for r in tables["read_rate"]:
        assert r["local_tokens_s"] > 0 and r["http_tokens_s"] > 0, r
    keep, acked = tables["disk"]
    assert (keep["retention"], acked["retention"]) == ("keep", "acked")
    assert keep["high_water_mib"] > 0 and acked["high_water_mib"] <= acked["bound_mib"], tables["disk"]
    assert list(work.iterdir()) == []  # its work folder is gone
