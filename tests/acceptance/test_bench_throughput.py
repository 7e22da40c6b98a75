"""The throughput benchmark's whole code path at a tiny shape, so that the tables of docs/performance.md
can be reproduced with the command it gives: every row is there with its figures, the shard writer's
table too, and the benchmark leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys

SCENARIOS = ("instant server", "prefill ~ persist", "prefill ~ 4x persist")
RUNS = (
    "bare loop, in page cache",
    "bare loop, until on disk",
    "bare loop, fsync each file",
    "service, clear-and-scan",
    "service, rid mode, 2 in flight",
)


def _bench_folders() -> set[str]:
    return {p for p in os.listdir("/dev/shm") if p.startswith("hsx-bench-")}


def test_a_small_run_prints_every_row_and_leaves_nothing_behind(tmp_path):
    shm_before = _bench_folders()
    args = ["--samples", "2", "--tokens", "64", "--hidden", "256", "--layers", "2", "--in-flight", "2"]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_throughput",
            *args,
            "--writer-gb",
            "0.01",
            "--output-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()

    rows = [line for line in lines if line.startswith(SCENARIOS)]
    expected = [(scenario, run) for scenario in SCENARIOS for run in RUNS]
    assert [(line[:21].strip(), line[21:57].strip()) for line in rows] == expected, out.stdout
    for line in rows:
        samples_s, tokens_s, gb_s, cpu_sample, cpu_gb, minimum, x_min, rss, x_bare, x_serial = line[57:].split()[:10]
        assert float(samples_s) > 0 and float(tokens_s) > 0 and float(rss) > 0, line
        assert float(cpu_sample) > 0 and float(cpu_gb) > 0 and float(minimum) > 0, line
        # "x min" is the row's CPU per GB against the minimum measured around its own run.
        assert abs(float(x_min) - float(cpu_gb) / float(minimum)) <= 0.02 * float(x_min) + 0.01, line
        assert float(x_bare) > 0 and float(x_serial) > 0, line
    assert any("measured before and after every run" in line for line in lines), out.stdout

    head = lines.index(next(line for line in lines if line.startswith("flushers")))
    writer = [line.split() for line in lines[head + 1 : head + 3]]
    assert [w[0] for w in writer] == ["1", "2"], out.stdout
    for _, gb_s, cpu_gb, x_min, of_direct, x_one in writer:
        assert float(gb_s) > 0 and float(cpu_gb) > 0 and float(x_min) > 0, writer
        assert of_direct.endswith("%") and float(x_one) > 0, writer

    assert list(tmp_path.iterdir()) == []  # its work folder is gone
    assert _bench_folders() <= shm_before  # and its dumps in /dev/shm
