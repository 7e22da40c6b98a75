"""The chat rendering benchmark's command, run short, so that the command docs/performance.md quotes
keeps working: a row per worker count, every conversation rendered, positive figures."""

from __future__ import annotations

import subprocess
import sys


def test_a_short_run_prints_a_row_per_worker_count():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_chat", "--conversations", "200", "--workers", "1", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("200 ShareGPT conversations of 2-4 turns"), out.stdout
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == ["1", "2"], out.stdout
    for _, seconds, per_s, tokens, mtokens_s, projected in rows:
        assert float(seconds) > 0 and float(per_s) > 0 and float(mtokens_s) > 0
        assert int(tokens) > 100 and projected.endswith("s")
