"""The pinned SGLang wheels the release check reads, fetched once with pip (no dependencies, about
39 MB for 0.5.23) into .cache/sglang-wheels/ and reused."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

WHEEL_CACHE = Path(__file__).resolve().parents[3] / ".cache" / "sglang-wheels"

SUPPORTED_SGLANG = "0.5.23"
# The wheels' sha256, as the package index served them: a re-uploaded file is a different release.
# pip fetches the CPython 3.11 Linux build whatever Python runs the tests (there is no 3.10 build);
# the check reads only the Python sources.
WHEELS = {
    "0.5.23": ("cp311-cp311-manylinux_2_34_x86_64", "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"),
    "0.5.14": ("cp311-cp311-manylinux_2_34_x86_64", "4fe16056b45c8aca00f5f90ceb174dc3a62a3f5dccf159c791370795cd00fc99"),
}


def sglang_wheel(version: str) -> Path:
    """The cached wheel of `version`, downloaded first if need be. Without a reachable package index
    the test fails under CI and is skipped elsewhere."""
    tags, sha256 = WHEELS[version]
    path = WHEEL_CACHE / f"sglang-{version}-{tags}.whl"
    if not path.exists():
        _download(version)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    assert digest == sha256, f"{path.name}: sha256 {digest}, pinned {sha256}"
    return path


def _download(version: str) -> None:
    WHEEL_CACHE.mkdir(parents=True, exist_ok=True)
    command = [
        *(sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"),
        *("--python-version", "3.11", "--platform", "manylinux_2_34_x86_64"),
        *(f"sglang=={version}", "-d", str(WHEEL_CACHE)),
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        done = None
    if done is None or done.returncode != 0:
        reason = f"cannot download sglang=={version}: " + ("timed out" if done is None else done.stderr[-2000:])
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
