"""A command whose optional extra is not installed says so in one line (exit 2), naming the extra."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hsx.cli.extras import EXTRAS, run
from tests.support.procs import hsx_command

TRAINING = 'needs PyTorch: pip install "hsx-server[training]"'
REFERENCE = 'needs PyTorch: pip install "hsx-server[reference]"'


def without(folder: Path, *packages: str) -> dict[str, str]:
    """An environment whose Python finds each of `packages` and fails to import it as a package that
    is not installed does (ModuleNotFoundError naming it), ahead of the installed one on the path."""
    for package in packages:
        (folder / package).mkdir(parents=True)
        (folder / package / "__init__.py").write_text(
            f"raise ModuleNotFoundError({f'No module named {package!r}'!r}, name={package!r})\n"
        )
    path = os.pathsep.join(filter(None, [str(folder), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path}


def one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == "", proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["export", "specforge", "job", "out"], f"hsx export {TRAINING}"),
        (
            ["reference-server", "--synthetic", "--port", "0", "--dump-root", "dumps"],
            f"hsx reference-server {REFERENCE}",
        ),
        (["demo", "--workdir", "demo"], f"hsx demo {REFERENCE}"),
    ],
    ids=["export", "reference-server", "demo"],
)
def test_a_command_without_torch_says_which_extra_to_install(tmp_path, argv, expected):
    env = without(tmp_path / "site", "torch")
    assert subprocess.run([sys.executable, "-c", "import torch"], env=env, capture_output=True).returncode != 0
    proc = subprocess.run([*hsx_command(), *argv], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert one_line(proc) == expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"], "nothing was started or written"


def test_python_m_hsx_reference_says_it_too(tmp_path):
    env = without(tmp_path / "site", "torch")
    proc = subprocess.run(
        [sys.executable, "-m", "hsx.reference", "--synthetic", "--port", "0", "--dump-root", str(tmp_path / "d")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert one_line(proc) == f"python -m hsx.reference {REFERENCE}"


def test_hsx_demo_without_transformers_names_it(tmp_path):
    env = without(tmp_path / "site", "transformers")
    proc = subprocess.run(
        [*hsx_command(), "demo", "--workdir", str(tmp_path / "demo")],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert one_line(proc) == 'hsx demo needs Hugging Face transformers: pip install "hsx-server[reference]"'
    assert not (tmp_path / "demo").exists(), "nothing was started"


def missing(name: str):
    def handler(_: argparse.Namespace) -> int:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    return handler


def test_any_other_missing_module_keeps_its_traceback():
    args = argparse.Namespace()
    with pytest.raises(ModuleNotFoundError):
        run(missing("yaml"), args, "hsx export", "training")  # not a package of the extra: a broken install
    with pytest.raises(ModuleNotFoundError):
        run(missing("torch"), args, "hsx jobs", None)  # a command that needs no extra: a bug, not a missing extra
    with pytest.raises(ModuleNotFoundError):
        run(missing("transformers"), args, "hsx export", "training")
    assert run(lambda _: None, args, "hsx jobs", None) == 0


def test_extras_name_what_pyproject_declares():
    tomllib = pytest.importorskip("tomllib")
    declared = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra, packages in EXTRAS.items():
        requirements = " ".join(declared[extra])
        assert all(p in requirements for p in packages), (extra, declared[extra])
