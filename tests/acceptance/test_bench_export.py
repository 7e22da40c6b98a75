"""The export benchmark's own code path on a small job, so that the command docs/performance.md quotes
keeps working: a row per target and worker count, with positive figures, and its work folder gone."""

from __future__ import annotations

import subprocess
import sys


def test_small_run_prints_every_row_with_positive_figures(tmp_path):
    args = ["--mib", "24", "--shard-mib", "6", "--hidden", "512", "--workers", "2", "--repeat", "1"]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_export", *args, "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [
        line.split()
        for line in out.stdout.splitlines()
        if line.split()[:1] in (["specforge"], ["speculators"], ["modelopt"])
    ]
    assert [(r[0], r[1]) for r in rows] == [
        (target, workers) for target in ("specforge", "speculators", "modelopt") for workers in ("1", "2", "command")
    ], out.stdout
    for target, _, files, wall, gb_s, cpu, cpu_gb, _, x_writer, extra_mib, x_job in rows:
        assert int(files) > 1 and min(float(wall), float(gb_s), float(cpu), float(cpu_gb), float(x_writer)) > 0, target
        # every target writes its own copy: about the job's size (its four layers are all it holds)
        assert 0.9 < float(x_job) < 1.2 and float(extra_mib) > 20, target
    assert list(tmp_path.iterdir()) == []  # its work folder is gone
