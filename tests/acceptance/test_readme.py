"""The documentation's examples work: README.md's quick start, run as it stands (its servers on free
ports); README.md's short API example and its trainer that follows a running job, and docs/api.md's curl
session and Python SDK snippet, run against a live service; every `hsx` line of the command-line examples
parses; and the SGLang launch commands of docs/engines.md fit the supported release."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hsx.cli import build_parser
from hsx.sdk import HsxClient
from tests.support.procs import free_port
from tests.support.sglang import release_check
from tests.support.stack import start_stack, stop_stack

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
API = REPO / "docs" / "api.md"
ENGINES = REPO / "docs" / "engines.md"
MARKED = re.compile(r"<!-- tested: ([\w-]+)[^>]*-->\s*\n```(\w+)\n(.*?)\n```", re.S)


def section(heading: str, doc: Path) -> str:
    """The text of `doc` under `heading`, up to the next heading of the same or a higher level (lines inside
    code blocks are not headings)."""
    level = len(heading.split(" ", maxsplit=1)[0])
    out, inside, fenced = [], False, False
    for line in doc.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#+ ", line):
            if inside and len(line.split(" ")[0]) <= level:
                break
            inside = inside or line == heading
            if line == heading:
                continue
        if inside:
            out.append(line)
    assert out, f"{doc.name} has no section {heading!r}"
    return "\n".join(out)


def marked_block(heading: str, doc: Path, name: str, lang: str) -> str:
    found = [m for m in MARKED.finditer(section(heading, doc)) if m.group(1) == name]
    assert len(found) == 1, f"{doc.name}: one block marked <!-- tested: {name} --> under {heading!r}"
    assert found[0].group(2) == lang
    return found[0].group(3) + "\n"


@pytest.fixture(scope="module")
def service(tmp_path_factory, checkpoint):
    svc, ref = start_stack(tmp_path_factory.mktemp("readme"), checkpoint)
    yield svc
    stop_stack(svc, ref)


def run_bash(block: str, service, tmp_path: Path) -> subprocess.CompletedProcess:
    script = tmp_path / "session.sh"
    script.write_text(block)
    env = {**os.environ, "HSX": service.url, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run(
        ["bash", "-euo", "pipefail", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def test_readme_quick_start(tmp_path):
    """The quick start as a newcomer runs it: the reference server and the service in the background, a job
    submitted, followed and downloaded. Only its ports change, to free ones."""
    block = marked_block("## Quick start", README, "quick-start", "bash")
    ports = {"30000": str(free_port()), "8000": str(free_port())}
    assert all(f"127.0.0.1:{p}" in block for p in ports), "the block's servers are on ports 30000 and 8000"
    script = tmp_path / "quick-start.sh"
    script.write_text(re.sub(r"\b(30000|8000)\b", lambda m: ports[m.group(1)], block))
    env = {
        **os.environ,
        "HSX_URL": f"http://127.0.0.1:{ports['8000']}",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    env.pop("HSX_TOKEN", None)
    # Its own session, so that the servers it starts in the background go with it whatever happens.
    proc = subprocess.Popen(
        ["bash", "-euo", "pipefail", str(script)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    logs = "".join(f"\n--- {p.name}\n{p.read_text()[-3000:]}" for p in tmp_path.glob("*.log"))
    assert proc.returncode == 0, out + logs
    manifest = json.loads((tmp_path / "data" / "quick" / "manifest.json").read_text())
    assert manifest["name"] == "quick" and manifest["state"] == "succeeded" and manifest["num_stored"] == 2
    assert all((tmp_path / "data" / "quick" / s["name"]).is_file() for s in manifest["shards"])


def test_readme_api_example(service, tmp_path):
    proc = run_bash(marked_block("## The API in short", README, "quick-api", "bash"), service, tmp_path)
    manifest = json.loads(proc.stdout)  # the example's only output is the manifest
    assert manifest["name"] == "quick" and manifest["state"] == "succeeded" and manifest["num_stored"] == 2
    with HsxClient(service.url) as hsx:
        assert hsx.get_job(manifest["job_id"]).state == "succeeded"


def test_curl_session(service, tmp_path):
    proc = run_bash(marked_block("## HTTP API", API, "curl-session", "bash"), service, tmp_path)
    job_id, state = re.search(r"^job (job_\w+) (\w+)$", proc.stdout, re.M).groups()
    assert state == "succeeded"
    with HsxClient(service.url) as hsx:
        job = hsx.get_job(job_id)
        manifest = hsx.manifest(job)
    assert job.state == "succeeded" and job.name == "demo" and job.counts.succeeded == 2
    for shard in manifest.shards:
        assert f"{shard.name}: OK" in proc.stdout and (tmp_path / shard.name).stat().st_size == shard.bytes
    assert json.loads((tmp_path / "manifest.json").read_text())["job_id"] == job_id


def test_python_sdk_snippet(service, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(marked_block("## Python SDK", API, "python-sdk", "python"))
    env = {**os.environ, "HSX_URL": service.url}
    env.pop("HSX_TOKEN", None)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id, state = re.search(r"^job (job_\w+) (\w+)$", proc.stdout, re.M).groups()
    assert state == "succeeded" and "Invalid input" in proc.stdout
    manifest = json.loads((tmp_path / "out" / job_id / "manifest.json").read_text())
    assert manifest["state"] == "succeeded" and manifest["num_stored"] == 2
    assert all((tmp_path / "out" / job_id / s["name"]).is_file() for s in manifest["shards"])


def test_readme_follow_example(service, tmp_path):
    """The trainer that follows a job as it runs: every sample read, everything acknowledged, and with
    retention acked every shard deleted once read."""
    script = tmp_path / "follow.py"
    script.write_text(marked_block("## Train while it extracts", README, "follow", "python"))
    env = {**os.environ, "HSX_URL": service.url}
    env.pop("HSX_TOKEN", None)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    read, acked, committed = map(
        int, re.search(r"^read (\d+) items; (\d+) of (\d+) shards$", proc.stdout, re.M).groups()
    )
    assert read == 12 and acked == committed > 0
    with HsxClient(service.url) as hsx:
        job = next(j for j in hsx.iter_jobs() if j.name == "follow")
        assert job.state == "succeeded" and all(s.deleted for s in hsx.list_shards(job).data)


def test_command_line_examples_parse():
    text = section("## Command line", API)
    lines = [ln for ln in re.findall(r"```bash\n(.*?)\n```", text, re.S)[0].splitlines() if ln.startswith("hsx ")]
    assert len(lines) >= 8
    parser = build_parser()
    for line in lines:
        argv = shlex.split(line.split("#")[0].split("|")[0])[1:]
        args = parser.parse_args(argv)
        assert args.command == argv[0]


def test_running_with_sglang_commands_fit_the_release_and_hsx(supported_wheel):
    """Both launch commands: every SGLang flag exists in the supported release, the plugin's entry
    point and dump root are the ones hsx is told about, and every `hsx serve` line parses."""
    blocks = [
        b.replace("\\\n", " ")
        for b in re.findall(r"```bash\n(.*?)\n```", section("## Running with SGLang", ENGINES), re.S)
    ]
    assert len(blocks) == 2, "one block with the plugin, one without"
    have = release_check.cli_flags_of(supported_wheel)
    parser = build_parser()
    for block in blocks:
        sglang = [ln for ln in block.splitlines() if "sglang.launch_server" in ln]
        served = [ln for ln in block.splitlines() if ln.startswith("hsx serve ")]
        assert len(sglang) == 1 and len(served) == 1, block
        flags = re.findall(r"(?<!\S)(--[a-z0-9][a-z0-9-]*)", sglang[0])
        assert flags and not [f for f in flags if f not in have], flags
        args = parser.parse_args(shlex.split(served[0].split("&")[0])[1:])
        assert args.command == "serve"
        env = dict(re.findall(r"(?<!\S)([A-Z_]+)=(\S+)", sglang[0]))
        if env:
            assert env["SGLANG_PLUGINS"] == "hsx_dump" and env["HSX_DUMP_ROOT"] == args.dump_root
        else:
            assert args.dump_root is None, "without the plugin no dump root is needed"


def test_readme_launches_sglang_as_the_checked_command():
    """README.md's one-process example repeats the plugin launch of docs/engines.md, which the test above checks
    against the release: the two stay the same text."""
    (readme,) = [
        b
        for b in re.findall(r"```bash\n(.*?)\n```", section("## Two ways to run it", README), re.S)
        if "sglang.launch_server" in b
    ]
    checked = re.findall(r"```bash\n(.*?)\n```", section("## Running with SGLang", ENGINES), re.S)
    assert readme in checked
