"""The throughput benchmark's whole code path at a tiny shape, so that the tables of docs/performance.md
can be reproduced with the command it gives: every row is there with its figures, the shard writer's
table too, and the benchmark leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

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
    work, figures = tmp_path / "work", tmp_path / "figures.json"
    work.mkdir()
    args = ["--samples", "2", "--tokens", "64", "--hidden", "256", "--layers", "2", "--in-flight", "2"]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_throughput", *args, "--writer-gb", "0.01"]
        + ["--output-dir", str(work), "--json", str(figures)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(figures.read_text())
    rows = report["tables"]["runs"]
    assert [(r["scenario"], r["run"]) for r in rows] == [(s, r) for s in SCENARIOS for r in RUNS], out.stdout
    for r in rows:
        assert min(r["samples_s"], r["tokens_s"], r["peak_rss_mib"], r["cpu_s_per_sample"]) > 0, r
        assert min(r["cpu_s_per_gb"], r["min_cpu_s_per_gb"], r["vs_bare"], r["vs_serial"]) > 0, r
        # "x min" is the row's CPU per GB against the minimum measured around its own run.
        assert r["x_min"] == pytest.approx(r["cpu_s_per_gb"] / r["min_cpu_s_per_gb"]), r
    assert any("measured before and after every run" in line for line in out.stdout.splitlines()), out.stdout

    writer = report["tables"]["shard_writer"]
    assert [w["flushers"] for w in writer] == [1, 2], out.stdout
    for w in writer:
        assert min(w["gb_s"], w["cpu_s_per_gb"], w["x_min"], w["of_direct"], w["x_one"]) > 0, w

    # every printed row keeps its cells apart, whatever their width
    assert_cells_apart(out.stdout, rows, writer)
    assert list(work.iterdir()) == []  # its work folder is gone
    assert _bench_folders() <= shm_before  # and its dumps in /dev/shm


def assert_cells_apart(stdout: str, rows: list[dict], writer: list[dict]) -> None:
    lines = stdout.splitlines()
    for r in rows:
        line = next(line for line in lines if line.startswith(r["scenario"]) and r["run"] in line)
        cells = line.split(r["run"], 1)[1].split()
        assert len(cells) == 11, line
    head = lines.index(next(line for line in lines if line.startswith("flushers")))
    assert [len(line.split()) for line in lines[head + 1 : head + 1 + len(writer)]] == [6] * len(writer), stdout
