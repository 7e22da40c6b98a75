"""The chat rendering benchmark's command, run short, so that the command docs/performance.md quotes
keeps working: a row per worker count, every conversation rendered, positive figures."""

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
