"""The export benchmark's own code path on a small job, so that the command docs/performance.md quotes
keeps working: a row per target and worker count, with positive figures, and its work folder gone."""

from __future__ import annotations

import json
import subprocess
import sys


def test_small_run_prints_every_row_with_positive_figures(tmp_path):
    work, figures = tmp_path / "work", tmp_path / "figures.json"
    work.mkdir()
    args = ["--mib", "24", "--shard-mib", "6", "--hidden", "512", "--workers", "2", "--repeat", "1"]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_export", *args, "--dir", str(work), "--json", str(figures)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(figures.read_text())["tables"]["exports"]
    assert [(r["target"], r["workers"]) for r in rows] == [
        (target, workers) for target in ("specforge", "speculators", "modelopt") for workers in (1, 2, "command")
    ], out.stdout
    for r in rows:
        assert r["files"] > 1 and min(r["wall_s"], r["gb_s"], r["cpu_s"], r["cpu_s_per_gb"], r["x_writer"]) > 0, r
        # every target writes its own copy: about the job's size (its four layers are all it holds)
        assert 0.9 < r["x_job"] < 1.2 and r["extra_disk_mib"] > 20, r
    printed = [line.split() for line in out.stdout.splitlines() if line.split()[:1] in (["specforge"], ["modelopt"])]
    assert [len(cells) for cells in printed] == [11] * 6, out.stdout  # cells never run together
    assert list(work.iterdir()) == []  # its work folder is gone
