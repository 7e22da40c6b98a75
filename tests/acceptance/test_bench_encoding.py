"""The encoding benchmark's own code path on a small run, so that the command docs/performance.md quotes
keeps working: every codec row and every job row, with figures that hold together, and its work folder
gone."""

from __future__ import annotations

import subprocess
import sys


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def test_small_run_prints_every_row(tmp_path):
    args = ["--codec-tokens", "1500", "--samples", "2", "--tokens", "300", "--hidden", "512", "--rounds", "1"]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_encoding",
            *args,
            "--servers",
            "instant",
            "--output-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [cells(line) for line in out.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    codecs = [r for r in rows if r[0] in ("bfloat16", "float16", "float32")]
    assert [(r[0], r[1]) for r in codecs] == [
        (dtype, enc) for dtype in ("bfloat16", "float16", "float32") for enc in ("raw", "lossless", "fp8")
    ], out.stdout
    for dtype, enc, _, ratio, encode, decode, max_error, _ in codecs:
        if enc == "raw":
            assert ratio == "1.000"
            continue
        assert 0 < float(ratio) < (0.75 if dtype == "bfloat16" else 0.95) and float(encode) > 0 and float(decode) > 0
        assert (max_error == "-") == (enc == "lossless") and (enc == "lossless" or 0 < float(max_error) <= 1 / 28)
    jobs = [r for r in rows if r[0] == "instant"]
    assert [r[1] for r in jobs] == ["raw", "lossless", "fp8"], out.stdout
    for _, enc, extracted, _, finished, _, shard_bytes, *dataset in jobs:
        assert float(extracted.replace(",", "")) > 0 and float(finished.replace(",", "")) > 0
        assert float(shard_bytes) <= 1 and all(float(x.replace(",", "")) > 0 for x in dataset), enc
    assert "lzma, byte planes" in out.stdout
    assert list(tmp_path.iterdir()) == []  # its work folder is gone
