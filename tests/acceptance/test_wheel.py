"""The wheel as a user installs it: no extras, a fresh virtual environment outside the checkout, no torch.

The wheel is built from the repository's sources and installed with pip from whatever indexes this
machine's pip is configured with; then `hsx serve` runs from an unrelated folder against SQLite: it
migrates with the migrations shipped inside the wheel, /healthz answers, the dashboard's page and files
are served from the wheel, and a job created with the installed SDK is queued.
"""

from __future__ import annotations

import email.parser
import os
import shutil
import sqlite3
import subprocess
import sys
import zipfile
from contextlib import closing
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement

from hsx.states import JobState
from tests.support.procs import Process, free_port

REPO = Path(__file__).resolve().parents[2]
# What setuptools reads to build the wheel (pyproject.toml names README.md as the long description).
BUILD_INPUTS = ["pyproject.toml", "README.md", "app"]
# Children must not see the checkout's packages (an empty PYTHONPATH counts as unset).
ENV = {**os.environ, "PYTHONPATH": ""}


def run(args: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)


def output(result: subprocess.CompletedProcess) -> str:
    return (result.stdout + result.stderr)[-4000:]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    probe = run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(tmp / "probe"), "setuptools"], tmp)
    if probe.returncode != 0:
        message = f"pip can reach no package index here:\n{output(probe)}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    # Built from a copy, so that the build's scratch folders never land in the checkout.
    src = tmp / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, src / name)
    built = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp / "dist"), str(src)], tmp)
    assert built.returncode == 0, output(built)
    (path,) = (tmp / "dist").glob("hsx_server-*.whl")
    return path


def test_the_wheel_holds_hsx_its_migrations_and_dashboard_only(wheel):
    with zipfile.ZipFile(wheel) as whl:
        names = whl.namelist()
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        assert whl.read(top_level).decode().split() == ["hsx"]
    assert {"hsx/migrations/env.py", "hsx/migrations/script.py.mako"} <= set(names)
    assert [n for n in names if n.startswith("hsx/migrations/versions/") and n.endswith(".py")], names
    # Every file of the dashboard ships: the page loads nothing from anywhere else.
    dashboard = {f"hsx/dashboard/{p.name}" for p in (REPO / "app" / "hsx" / "dashboard").iterdir()}
    assert "hsx/dashboard/index.html" in dashboard and dashboard <= set(names), sorted(dashboard - set(names))
    assert not [n for n in names if n.split("/")[0] in ("app", "migrations", "tests", "benchmarks", "docs")]
    # Every module of the source tree ships: a new subpackage is found, never left out of the wheel.
    source = {p.relative_to(REPO / "app").as_posix() for p in (REPO / "app" / "hsx").rglob("*.py")}
    assert source <= set(names), sorted(source - set(names))


# transformers releases the model servers hsx runs beside pin: SGLang 0.5.23 requires transformers==5.19.0;
# the last 4.x release is 4.57.6.
SERVER_TRANSFORMERS = ["4.57.6", "5.19.0"]


def test_the_extras_admit_the_model_servers_transformers_and_any_torch(wheel):
    with zipfile.ZipFile(wheel) as whl:
        (metadata,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        requires = email.parser.Parser().parsestr(whl.read(metadata).decode()).get_all("Requires-Dist")
    by_extra: dict[str, list[Requirement]] = {}
    for line in requires:
        req = Requirement(line)
        extras = [e for e in ("reference", "training") if req.marker and req.marker.evaluate({"extra": e})]
        for extra in extras:
            by_extra.setdefault(extra, []).append(req)
    (transformers,) = [r for r in by_extra["reference"] if r.name == "transformers"]
    assert all(transformers.specifier.contains(v) for v in SERVER_TRANSFORMERS), transformers
    # Which torch build a machine gets is the install command's business, never the package's.
    for extra in ("reference", "training"):
        (torch,) = [r for r in by_extra[extra] if r.name == "torch"]
        assert not torch.specifier, torch
    # Without extras, neither comes along.
    assert not [r for r in map(Requirement, requires) if r.name in ("torch", "transformers") and not r.marker]


def test_installed_without_extras_it_serves_from_any_folder(wheel, tmp_path):
    venv, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    made = run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    assert made.returncode == 0, output(made)
    python = str(venv / "bin" / "python")
    # --no-compile: what the test runs compiles on import, which is far less than all of the dependencies.
    installed = run([python, "-m", "pip", "install", "-q", "--no-compile", str(wheel)], work)
    assert installed.returncode == 0, output(installed)

    no_torch = run([python, "-c", "import torch"], work)
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr, output(no_torch)
    migrations = run([python, "-c", "import hsx.migrations; print(hsx.migrations.__file__)"], work)
    assert Path(migrations.stdout.strip()).is_relative_to(venv), output(migrations)

    database, port = work / "hsx.db", free_port()
    service = Process(
        [
            str(venv / "bin" / "hsx"),
            "serve",
            "--database-url",
            f"sqlite:///{database}",
            # Nothing listens there: the writer waits for its model server, the API serves meanwhile.
            "--backend-url",
            "http://127.0.0.1:9",
            "--dump-root",
            str(work / "dumps"),
            "--output-root",
            str(work / "output"),
            "--input-root",
            str(work),
            "--port",
            str(port),
        ],
        tmp_path / "service.log",
        env=ENV,
        cwd=work,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        service.wait_http(url + "/healthz", timeout=60)
        page, js = httpx.get(url + "/"), httpx.get(url + "/dashboard/dashboard.js")
        assert page.status_code == 200 and 'src="dashboard/dashboard.js"' in page.text
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        with closing(sqlite3.connect(database)) as conn:
            assert conn.execute("SELECT version_num FROM alembic_version").fetchone() is not None
        script = (
            "import sys\n"
            "from hsx import HsxClient\n"
            "with HsxClient(sys.argv[1]) as client:\n"
            "    job = client.create_job([{'id': 'a', 'input_ids': [1, 2, 3]}], name='wheel')\n"
            "    print(job.state, job.counts.total)\n"
        )
        created = run([python, "-c", script, url], work, timeout=60)
        assert created.returncode == 0, output(created)
        assert created.stdout.split() == [JobState.QUEUED, "1"]
    finally:
        service.stop()
