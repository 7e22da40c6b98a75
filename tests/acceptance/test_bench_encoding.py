"""The encoding benchmark's own code path on a small run, so that the command docs/performance.md quotes
keeps working: every codec row and every job row, with figures that hold together, and its work folder
gone."""

from __future__ import annotations

import json
import subprocess
import sys


def test_small_run_prints_every_row(tmp_path):
    work, figures = tmp_path / "work", tmp_path / "figures.json"
    work.mkdir()
    args = ["--codec-tokens", "1500", "--samples", "2", "--tokens", "300", "--hidden", "512", "--rounds", "1"]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_encoding", *args, "--servers", "instant"]
        + ["--output-dir", str(work), "--json", str(figures)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    tables = json.loads(figures.read_text())["tables"]
    codecs = tables["codecs: tiny Llama (tests)"]
    assert [(r["dtype"], r["encoding"]) for r in codecs] == [
        (dtype, enc) for dtype in ("bfloat16", "float16", "float32") for enc in ("raw", "lossless", "fp8")
    ], out.stdout
    for r in codecs:
        if r["encoding"] == "raw":
            assert r["ratio"] == 1
            continue
        assert 0 < r["ratio"] < (0.75 if r["dtype"] == "bfloat16" else 0.95), r
        assert r["encode_mb_s"] > 0 and r["decode_mb_s"] > 0, r
        assert (r["max_error"] is None) == (r["encoding"] == "lossless"), r
        assert r["encoding"] == "lossless" or 0 < r["max_error"] <= 1 / 28, r
    jobs = tables["jobs"]
    assert [(r["server"], r["encoding"]) for r in jobs] == [("instant", e) for e in ("raw", "lossless", "fp8")]
    for r in jobs:
        assert r["extracted_tokens_s"] > 0 and r["finished_tokens_s"] > 0 and r["bytes_x_raw"] <= 1, r
        assert min(r["dataset_samples_s"], r["dataset_tokens_s"], r["dataset_mb_s"]) > 0, r
    printed = [line for line in out.stdout.splitlines() if line.startswith(("| bfloat16", "| instant"))]
    assert len(printed) == 6 and all(line.count(" | ") in (7, 9) for line in printed), out.stdout
    assert "lzma, byte planes" in out.stdout
    assert list(work.iterdir()) == []  # its work folder is gone
