"""The GPU benchmark's own code path, run on the CPU with a tiny model (`--smoke`), so that it works
the day a GPU is at hand: every row of its table is there with positive figures."""

from __future__ import annotations

import re
import subprocess
import sys

ROWS = ("model alone", "server alone", "service, clear-and-scan", "service, rid mode")


def test_smoke_run_prints_every_row_with_positive_figures(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_gpu", "--smoke", "--output-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    table = [line for line in out.stdout.splitlines() if line.startswith("| ") and not line.startswith("| run ")]
    assert [line.split(" | ")[0].removeprefix("| ") for line in table] == list(ROWS), out.stdout
    for line in table:
        run, tokens_s, gb_s, of_model, waits = (cell.strip() for cell in line.strip("| ").split(" | "))
        assert float(tokens_s) > 0, line
        assert float(of_model.rstrip("%")) > 0, line
        if run.startswith("service"):
            assert float(gb_s) > 0, line
            assert re.fullmatch(r"-?\d+%", waits), line
        else:
            assert gb_s == waits == "-", line
    assert re.search(r"measured \d{4}-\d{2}-\d{2}", out.stdout)
    assert "target: rid mode keeps the GPU >= 90% as busy" in out.stdout
    assert list(tmp_path.iterdir()) == []  # its work folder is gone
