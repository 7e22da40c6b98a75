"""The GPU benchmark's own code path, run on the CPU with a tiny model (`--smoke`), so that it works
the day a GPU is at hand: every row of its table is there with positive figures."""

from __future__ import annotations

import json
import re
import subprocess
import sys

ROWS = ("model alone", "server alone", "service, clear-and-scan", "service, rid mode")


def test_smoke_run_prints_every_row_with_positive_figures(tmp_path):
    work, figures = tmp_path / "work", tmp_path / "figures.json"
    work.mkdir()
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_gpu", "--smoke", "--output-dir", str(work), "--json", str(figures)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = json.loads(figures.read_text())["tables"]["runs"]
    assert [r["run"] for r in rows] == list(ROWS), out.stdout
    for r in rows:
        assert r["tokens_s"] > 0 and r["samples_s"] > 0 and r["of_model"] > 0, r
        if r["run"].startswith("service"):
            assert r["gb_s"] > 0 and r["gpu_waits"] < 1, r
        else:
            assert r["gb_s"] is None and r["gpu_waits"] is None, r
    page = [line for line in out.stdout.splitlines() if line.startswith("| ") and not line.startswith("| run ")]
    assert [line.split(" | ")[0].removeprefix("| ") for line in page] == list(ROWS), out.stdout
    assert all(len(line.split(" | ")) == 5 for line in page), out.stdout
    assert re.search(r"measured \d{4}-\d{2}-\d{2}", out.stdout)
    assert "target: rid mode keeps the GPU >= 90% as busy" in out.stdout
    assert list(work.iterdir()) == []  # its work folder is gone
