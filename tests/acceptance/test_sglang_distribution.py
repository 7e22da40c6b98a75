"""deploy/sglang builds into the distribution that SGLang's plugin loader finds."""

from __future__ import annotations

import configparser
import email.parser
import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from hsx_sglang import __version__

PLUGIN_SOURCE = Path(__file__).resolve().parents[2] / "deploy" / "sglang"


def test_the_wheel_registers_the_plugin_and_requires_nothing(tmp_path: Path) -> None:
    source = tmp_path / "source"  # a copy: building leaves build/ and *.egg-info/ behind
    shutil.copytree(PLUGIN_SOURCE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", str(tmp_path), str(source)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (wheel,) = tmp_path.glob("hsx_sglang-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.parser.Parser().parsestr(zf.read(f"{dist_info}/METADATA").decode())
        entry_points = configparser.ConfigParser()
        entry_points.read_string(zf.read(f"{dist_info}/entry_points.txt").decode())

    assert metadata["Name"] == "hsx-sglang" and metadata["Version"] == __version__
    assert metadata.get_all("Requires-Dist") is None  # torch, numpy, safetensors come with SGLang
    assert dict(entry_points["sglang.srt.plugins"]) == {"hsx_dump": "hsx_sglang.plugin:register"}
    modules = {n for n in names if n.endswith(".py")}
    assert modules == {f"hsx_sglang/{p.name}" for p in (PLUGIN_SOURCE / "hsx_sglang").glob("*.py")}
