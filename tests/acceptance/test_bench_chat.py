"""The chat rendering benchmark's commands, run short, so that the commands docs/performance.md quotes
keep working: a row per worker count, every conversation rendered, positive figures; and with
--long-turn-mb a row per limit, the limited render giving fewer tokens and a lower peak than the whole."""

from __future__ import annotations

import json
import subprocess
import sys


def test_a_short_run_prints_a_row_per_worker_count(tmp_path):
    figures = tmp_path / "figures.json"
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_chat", "--conversations", "200", "--workers", "1", "2"]
        + ["--json", str(figures)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("200 ShareGPT conversations of 2-4 turns"), out.stdout
    rows = json.loads(figures.read_text())["tables"]["runs"]
    assert [r["workers"] for r in rows] == [1, 2], out.stdout
    for r in rows:
        assert r["conversations"] == 200 and r["tokens_per_conversation"] > 100, r
        assert min(r["seconds"], r["conversations_s"], r["mtokens_s"], r["projected_s"]) > 0, r
    assert [len(line.split()) for line in lines[2:]] == [6, 6], out.stdout  # cells never run together


def test_a_long_turn_run_prints_a_row_per_limit(tmp_path):
    figures = tmp_path / "figures.json"
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_chat", "--long-turn-mb", "0.2", "--limit", "512", "none"]
        + ["--json", str(figures)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    cut, whole = json.loads(figures.read_text())["tables"]["long_turn"]
    assert (cut["limit"], cut["whole"], whole["limit"], whole["whole"]) == (512, False, "none", True), out.stdout
    assert 512 < cut["tokens"] < whole["tokens"] and whole["tokens"] > 100_000, out.stdout
    assert 0 < cut["loaded_mib"] <= cut["peak_mib"] and cut["peak_mib"] < whole["peak_mib"], out.stdout
