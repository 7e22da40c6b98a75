"""The `hsx` command line: every command's help without torch, `hsx serve`'s flags from Settings, and the client
commands against the real service and reference server: output (plain and --json), exit codes, errors on stderr,
resumable verified downloads, progress display."""

from __future__ import annotations

import hashlib
import importlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from hsx import cli
from hsx.cli import serve
from hsx.cli.client.common import Progress
from hsx.config import FLUSHERS_PER_CORE, MAX_DEFAULT_FLUSHERS, Settings
from hsx.sdk import HsxClient
from tests.support.no_torch import env_without_torch
from tests.support.procs import hsx_command
from tests.support.samples import make_samples
from tests.support.stack import start_stack, stop_stack

WRITE, READ = "cli-writer", "cli-reader"
CLIENT_COMMANDS = ["submit", "status", "jobs", "samples", "cancel", "retry", "delete", "manifest", "download"]


EVERY_HELP = """\
import json, sys
from hsx.cli import main

for argv in json.loads(sys.argv[1]):
    try:
        main([*argv, "--help"])
    except SystemExit as exc:
        assert exc.code == 0, (argv, exc.code)
    assert "torch" not in sys.modules and "transformers" not in sys.modules
"""


def test_every_help_works_without_torch(tmp_path):
    env = env_without_torch(tmp_path / "site")
    blocked = subprocess.run(
        [sys.executable, "-c", "import torch"], capture_output=True, text=True, env=env, timeout=60
    )
    assert blocked.returncode != 0 and "refused by the test" in blocked.stderr
    for argv, usage in ((hsx_command(), "usage: hsx"), ([sys.executable, "-m", "hsx.reference"], "usage: python")):
        proc = subprocess.run([*argv, "--help"], capture_output=True, text=True, env=env, timeout=60)
        assert proc.returncode == 0 and proc.stdout.startswith(usage), proc.stderr
    # The subcommands' help in one process: `hsx` imports every command module whichever one runs.
    commands = [[importlib.import_module(module).NAME] for module in cli.COMMANDS]
    commands += [["export", target] for target in ("specforge", "speculators", "modelopt")]
    proc = subprocess.run(
        [sys.executable, "-c", EVERY_HELP, json.dumps(commands)], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("usage: hsx ") == len(commands)


def serve_help(capsys, monkeypatch, command: str = "serve") -> dict[str, str]:
    """`hsx serve --help` (or another command's): each option's help text (whitespace collapsed) by its
    first flag."""
    monkeypatch.setenv("COLUMNS", "1000")  # wide enough that no help text is wrapped
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0
    options = capsys.readouterr().out.split("\noptions:\n")[1]
    entries = [" ".join(entry.split()) for entry in re.split(r"\n(?=  -)", options)]
    return {entry.split()[0].rstrip(","): entry for entry in entries}


def test_serve_flags_and_help_come_from_settings(capsys, monkeypatch):
    help_of = serve_help(capsys, monkeypatch)
    served = {name: field for name, field in Settings.model_fields.items() if name not in serve.WORKER_SETTINGS}
    for name, field in served.items():
        text = help_of[serve.OFF_SWITCHES.get(name, f"--{name.replace('_', '-')}")]
        assert field.description and field.description in text and f"env HSX_{name.upper()}" in text
    assert help_of["--backend-url"].endswith("(env HSX_BACKEND_URL; default http://127.0.0.1:30000)")
    assert help_of["--staging-dir"].endswith("(env HSX_STAGING_DIR; default unset)")
    assert help_of["--no-writer"].endswith("(env HSX_RUN_WRITER=false)")
    assert set(help_of) == {"-h", "--log-level", "--log-format", "--access-log", "--no-writer"} | {
        f"--{name.replace('_', '-')}" for name in served if name != "run_writer"
    }
    # The metrics port is the worker's: `hsx serve` answers /metrics and /healthz on its API port.
    worker = serve_help(capsys, monkeypatch, "worker")
    assert "(env HSX_METRICS_PORT; default unset)" in worker["--metrics-port"]
    assert "(env HSX_METRICS_HOST; default 127.0.0.1)" in worker["--metrics-host"]


def test_serve_settings_flags_win_over_environment(monkeypatch):
    parser = cli.build_parser()
    for name in Settings.model_fields:
        monkeypatch.delenv(f"HSX_{name.upper()}", raising=False)
    monkeypatch.setenv("HSX_PORT", "7000")
    monkeypatch.setenv("HSX_MAX_ATTEMPTS", "5")
    settings = serve.settings_from_args(parser.parse_args(["serve", "--port", "9001", "--dump-root", "/tmp/d"]))
    assert settings.port == 9001 and settings.max_attempts == 5 and settings.dump_root == Path("/tmp/d")
    assert settings.run_writer and settings.staging_dir is None and settings.shard_max_wait_s == 10.0
    assert settings.flushers == min(FLUSHERS_PER_CORE * len(os.sched_getaffinity(0)), MAX_DEFAULT_FLUSHERS)
    assert not serve.settings_from_args(parser.parse_args(["serve", "--no-writer"])).run_writer
    monkeypatch.setenv("HSX_RUN_WRITER", "false")
    assert not serve.settings_from_args(parser.parse_args(["serve"])).run_writer
    args = parser.parse_args(["serve", "--shard-max-wait-s", "0.5", "--staging-dir", "/tmp/s", "--log-level", "debug"])
    settings = serve.settings_from_args(args)
    assert settings.shard_max_wait_s == 0.5 and settings.staging_dir == Path("/tmp/s") and args.log_level == "debug"
    monkeypatch.setenv("HSX_FLUSHERS", "3")
    assert serve.settings_from_args(parser.parse_args(["serve"])).flushers == 3
    assert serve.settings_from_args(parser.parse_args(["worker", "--flushers", "2"])).flushers == 2
    with pytest.raises(ValidationError) as refused:
        serve.settings_from_args(parser.parse_args(["worker", "--flushers", "0"]))
    assert serve.setting_errors(refused.value) == [
        "--flushers (HSX_FLUSHERS): Input should be greater than or equal to 1"
    ]
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["serve", "--port", "eighty"])
    assert exc.value.code == 2


@pytest.mark.parametrize(
    "spec,words,via",
    [
        ("viewer:Read", "unknown role 'Read'", "flag"),
        ("admin-secret,ro:readonly", "unknown role 'readonly'", "environment"),
        (" , ", "lists no token", "flag"),
        ("same-secret:read,same-secret", "listed twice", "environment"),
    ],
)
def test_serve_refuses_doubtful_tokens(tmp_path, spec, words, via):
    """A token list that would fail open (a mistyped role granting write access, a list that turns
    authentication off) stops `hsx serve` before it listens, saying why and never echoing a token."""
    argv = [*hsx_command(), "serve", "--database-url", f"sqlite:///{tmp_path / 'hsx.db'}", "--port", "9"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSX_")}
    if via == "flag":
        argv += ["--api-tokens", spec]
    else:
        env["HSX_API_TOKENS"] = spec
    done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("hsx serve: --api-tokens (HSX_API_TOKENS): ") and words in done.stderr
    assert "secret" not in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "hsx.db").exists()


@pytest.fixture(scope="module")
def servers(tmp_path_factory, checkpoint):
    svc, ref = start_stack(
        tmp_path_factory.mktemp("cli"),
        checkpoint,
        ["--shard-max-bytes", "40000", "--api-tokens", f"{WRITE},{READ}:read"],
        reference_extra=["--enable-fault-injection"],
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HSX_URL", svc.url)
        mp.setenv("HSX_TOKEN", WRITE)
        yield svc, ref
    stop_stack(svc, ref)


@pytest.fixture(scope="module")
def stack(servers):
    return servers[0]


@pytest.fixture
def run(stack, capsys):
    """Run `hsx ARGS...` in this process: (exit code, stdout, stderr)."""

    def go(*argv: str) -> tuple[int, str, str]:
        code = cli.main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err

    return go


def jsonl(path: Path, samples: list[dict]) -> Path:
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    return path


@pytest.fixture(scope="module")
def finished(stack, tmp_path_factory):
    """A job submitted through the CLI and followed to its end."""
    path = jsonl(tmp_path_factory.mktemp("in") / "in.jsonl", make_samples(6, seed=51, lo=30, hi=60))
    code = cli.main(["submit", str(path), "--name", "cli-run", "--wait", "--json", "--interval", "0.2"])
    assert code == 0
    with HsxClient() as hsx:
        job = next(hsx.iter_jobs(state="succeeded"))
        assert job.name == "cli-run"
        return job, [json.loads(line) for line in path.read_text().splitlines()]


def test_every_command_explains_itself_with_an_example(capsys):
    for name in CLIENT_COMMANDS:
        with pytest.raises(SystemExit) as exc:
            cli.main([name, "--help"])
        out = capsys.readouterr().out
        assert exc.value.code == 0
        assert "example" in out and f"hsx {name}" in out and "--url" in out and "--token" in out and "--json" in out


def test_submit_status_jobs_samples_manifest(run, finished, tmp_path):
    job, samples = finished
    path = jsonl(tmp_path / "s.jsonl", make_samples(2, seed=52))
    code, out, _ = run("submit", path, "--idempotency-key", "cli-k", "--layers", "2,4,5,8")
    assert code == 0 and out.startswith("job_") and "2 samples" in out
    first = out.split()[0]
    code, out, _ = run("submit", path, "--idempotency-key", "cli-k", "--layers", "2,4,5,8", "--json")
    assert code == 0 and json.loads(out)["id"] == first and json.loads(out)["layers"] == [2, 4, 5, 8]

    code, out, _ = run("status", first, "--watch", "--interval", "0.2")
    lines = out.splitlines()
    assert code == 0 and lines[0].startswith(first) and "\r" not in out  # not a terminal: plain lines
    assert any(x.startswith("[" + "#" * 30 + "] succeeded 2/2 samples") for x in lines)
    code, out, _ = run("status", first, "--watch", "--json")
    assert code == 0 and json.loads(out.splitlines()[-1])["state"] == "succeeded"
    code, out, _ = run("status", job.id)
    assert code == 0 and job.id in out and "6/6 samples" in out and "tok/s" in out and "ETA" in out
    code, out, _ = run("status", job.id, "--json")
    assert json.loads(out)["counts"]["succeeded"] == 6

    code, out, _ = run("jobs", "--json", "--all")
    listed = json.loads(out)
    assert code == 0 and {job.id, first} <= {j["id"] for j in listed}
    code, out, _ = run("jobs", "--limit", "1", "--state", "succeeded")
    assert (
        code == 0
        and out.splitlines()[0].split() == ["ID", "STATE", "STORED", "FAILED", "TOKENS", "CREATED", "NAME"]
        and len(out.splitlines()) == 2
    )
    code, out, _ = run("jobs", "--state", "failed")
    assert (code, out) == (0, "no failed jobs\n")

    code, out, _ = run("samples", job.id, "--json")
    assert code == 0 and [s["id"] for s in json.loads(out)] == [s["id"] for s in samples]
    code, out, _ = run("samples", job.id, "--limit", "2")
    assert len(out.splitlines()) == 3 and samples[1]["id"] in out
    code, out, _ = run("samples", job.id, samples[0]["id"])
    assert code == 0 and "attempt 1: ok" in out and "shard-" in out
    code, out, _ = run("samples", job.id, "--state", "failed", "--json")
    assert code == 0 and json.loads(out) == []

    code, out, _ = run("manifest", job.id)
    manifest = json.loads(out)
    assert code == 0 and manifest["job_id"] == job.id and len(manifest["samples"]) == 6
    code, out, _ = run("manifest", job.id, "-o", tmp_path / "m" / "manifest.json", "--json")
    assert code == 0 and json.loads(out)["shards"] == len(manifest["shards"])
    assert json.loads((tmp_path / "m" / "manifest.json").read_text()) == manifest


def test_submit_with_an_encoding_status_and_manifest_say_it(run, tmp_path):
    path = jsonl(tmp_path / "e.jsonl", make_samples(3, seed=61))
    code, out, _ = run("submit", path, "--encoding", "lossless", "--json")
    job = json.loads(out)
    assert code == 0 and job["options"]["encoding"] == "lossless"
    code, out, _ = run("status", job["id"], "--watch", "--interval", "0.2")
    assert code == 0 and "encoding lossless" in out.splitlines()[0]
    code, out, _ = run("manifest", job["id"])
    manifest = json.loads(out)
    assert manifest["encoding"] == "lossless" and len(manifest["encoded_layers"]) == len(manifest["layers"])
    with pytest.raises(SystemExit) as refused:
        run("submit", path, "--encoding", "zstd")
    assert refused.value.code == 2


def test_download_resumes_and_verifies(run, finished, tmp_path):
    job, _ = finished
    out_dir = tmp_path / "out"
    code, out, _ = run("download", job.id, out_dir, "--json")
    report = json.loads(out)
    assert code == 0 and report["state"] == "succeeded" and len(report["shards"]) >= 2
    for s in report["shards"]:
        assert hashlib.sha256((out_dir / s["name"]).read_bytes()).hexdigest() == s["sha256"]
        assert not s["skipped"] and s["resumed_from"] == 0
    assert json.loads((out_dir / "manifest.json").read_text())["job_id"] == job.id

    first, second = report["shards"][:2]
    data = (out_dir / first["name"]).read_bytes()
    (out_dir / first["name"]).unlink()
    Path(f"{out_dir / first['name']}.part").write_bytes(data[:500])  # interrupted after 500 bytes
    code, out, _ = run("download", job.id, out_dir, "--json")
    shards = {s["name"]: s for s in json.loads(out)["shards"]}
    assert code == 0 and shards[first["name"]]["resumed_from"] == 500 and shards[second["name"]]["skipped"]
    assert (out_dir / first["name"]).read_bytes() == data

    (out_dir / second["name"]).unlink()
    Path(f"{out_dir / second['name']}.part").write_bytes(b"garbage")
    code, out, err = run("download", job.id, out_dir)
    assert code == 1 and "Checksum mismatch" in err and second["name"] in err
    assert not (out_dir / second["name"]).exists() and not Path(f"{out_dir / second['name']}.part").exists()
    code, out, _ = run("download", job.id, out_dir)
    assert code == 0 and "sha256 ok" in out and "already there" in out and "downloaded" in out


def test_errors_go_to_stderr_with_exit_codes(run, finished, tmp_path, monkeypatch):
    job, _ = finished
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "x", "input_ids": [1, 2]}\n{"id": "y", "input_ids": [1, 2], "loss_mask": [1]}\n{oops\n')
    code, out, err = run("submit", bad)
    assert code == 2 and out == ""
    assert err.startswith("hsx submit: Invalid input (422): ")
    lines = err.splitlines()
    assert len(lines) == 3 and lines[1].startswith("  sample 1, ") and "line 2" in lines[1] and "loss_mask" in lines[1]
    assert lines[2].startswith("  sample 2, line 3: ") and "JSON" in lines[2]
    code, _, err = run("submit", bad, "--json")
    problem = json.loads(err)
    assert code == 2 and problem["status"] == 422 and len(problem["errors"]) == 2

    assert run("submit")[0] == 2
    code, _, err = run("submit", tmp_path / "missing.jsonl")
    assert code == 2 and "cannot read" in err
    with pytest.raises(SystemExit) as exc:
        run("submit", bad, "--layers", "two")
    assert exc.value.code == 2

    code, _, err = run("status", "job_missing")
    assert code == 2 and "Not Found (404)" in err and "job_missing" in err
    code, _, err = run("cancel", job.id)
    assert code == 2 and "Conflict (409)" in err
    code, _, err = run("retry", job.id, "--json")
    assert code == 2 and json.loads(err)["status"] == 409
    code, _, err = run("jobs", "--token", "wrong")
    assert code == 2 and "Unauthorized (401)" in err
    code, _, err = run("submit", bad, "--token", READ)
    assert code == 2 and "Forbidden (403)" in err
    code, _, err = run("jobs", "--url", "http://127.0.0.1:9")
    assert code == 1 and "cannot reach the service at http://127.0.0.1:9" in err

    # the installed console script, configured by the environment only
    env = {**os.environ}
    proc = subprocess.run(
        hsx_command() + ["status", "job_missing", "--json"], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 2 and json.loads(proc.stderr)["status"] == 404 and proc.stdout == ""
    proc = subprocess.run(
        hsx_command() + ["jobs", "--json", "--limit", "1"], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == 0 and len(json.loads(proc.stdout)) == 1


def test_failed_retry_cancel_delete(run, servers, tmp_path):
    stack, ref = servers
    jsonl(stack.input_root / "wrong.jsonl", make_samples(2, seed=53))
    # Every dump comes out a token short: the samples fail, with the reason.
    faults = f"{ref.url}/admin/faults"
    httpx.post(faults, json={"bad_dumps": {"probability": 1.0, "kind": "wrong_num_tokens"}}).raise_for_status()
    try:
        code, out, err = run("submit", "--input-path", "wrong.jsonl", "--wait", "--interval", "0.2")
        assert code == 1 and "failed" in err and "hsx samples" in err  # the job failed: exit 1, with a hint
        job_id = out.split()[0]
        code, out, _ = run("samples", job_id, "--state", "failed", "--json")
        reasons = [s["last_error"] for s in json.loads(out)]
        assert code == 0 and len(reasons) == 2 and all("num_tokens" in r for r in reasons), reasons
        code, out, _ = run("samples", job_id, "--state", "failed")
        assert "LAST ERROR" in out.splitlines()[0] and "num_tokens" in out
        code, out, _ = run("retry", job_id, "--json")
        assert code == 0 and json.loads(out)["id"] == job_id
        code, out, _ = run("status", job_id, "--watch", "--interval", "0.2")
        assert code == 1 and "] failed" in out
    finally:
        httpx.delete(faults).raise_for_status()

    big = jsonl(tmp_path / "big.jsonl", make_samples(30, seed=54, lo=60, hi=120))
    code, out, _ = run("submit", big, "--json")
    busy = json.loads(out)["id"]
    code, _, err = run("delete", busy)
    assert code == 2 and "Conflict" in err
    code, out, err = run("download", busy, tmp_path / "early", "--json")
    assert code == 0 and json.loads(out)["manifest"] is None and "run this again once it has finished" in err
    assert not (tmp_path / "early" / "manifest.json").exists()
    code, out, _ = run("cancel", busy, "--json")
    assert code == 0 and json.loads(out)["state"] == "cancelling"
    code, out, _ = run("status", busy, "--watch", "--json")
    assert code == 1 and json.loads(out.splitlines()[-1])["state"] == "cancelled"
    code, out, _ = run("delete", busy, "--files", "--json")
    assert code == 0 and json.loads(out) == {"deleted": busy, "files": True}
    assert not (stack.output_root / busy).exists()
    assert run("status", busy)[0] == 2

    code, out, _ = run("submit", big, "--json")
    other = json.loads(out)["id"]
    code, out, _ = run("cancel", other, "--wait", "--interval", "0.2")
    lines = out.splitlines()
    assert code == 0 and lines[0] == f"{other} cancelling" and lines[-1] == f"{other} cancelled", out
    code, _, err = run("cancel", other)
    assert code == 2 and "Conflict" in err
    code, out, _ = run("retry", other)  # the cancelled job goes on with what it had not stored
    assert code == 0 and out.startswith(other) and " sample(s) queued" in out, out
    code, out, _ = run("status", other, "--watch", "--interval", "0.2")
    assert code == 0 and "] succeeded" in out and "cancelled" not in out.splitlines()[-1], out
    code, _, err = run("retry", other)
    assert code == 2 and "no failed or cancelled samples" in err


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_redraws_on_a_terminal_and_prints_lines_elsewhere(finished):
    job, _ = finished
    tty = Terminal()
    progress = Progress(stream=tty)
    progress(job)
    progress(job)
    progress.close()
    text = tty.getvalue()
    assert text.count("\r\033[K") == 2 and text.endswith("\n") and text.count("\n") == 1
    assert "6/6 samples" in text and "tok/s" in text and "ETA 0s" in text

    plain = io.StringIO()
    progress = Progress(stream=plain)
    progress(job)
    progress(job)  # unchanged: not repeated
    progress.close()
    assert plain.getvalue().count("\n") == 1 and "\r" not in plain.getvalue()


PROGRESS_LINE = re.compile(r"^hsx (\w+): [\d.]+[kMG]?B/[\d.]+[kMG]?B \(\d+%\), .*/s(, ETA \S+)?")


def hsx_proc(*argv: object) -> subprocess.CompletedProcess[str]:
    """`hsx ARGS...` as its own process, stderr a pipe (never a terminal), progress lines every millisecond."""
    env = {**os.environ, "HSX_PROGRESS_INTERVAL_S": "0.001"}
    return subprocess.run(hsx_command() + [str(a) for a in argv], capture_output=True, text=True, env=env, timeout=120)


def progress_lines(stderr: str, command: str) -> list[str]:
    lines = [line for line in stderr.splitlines() if PROGRESS_LINE.match(line)]
    assert lines and all(line.startswith(f"hsx {command}: ") for line in lines), stderr
    return lines


def test_long_commands_log_progress_on_stderr_when_it_is_not_a_terminal(finished, tmp_path):
    job, _ = finished
    path = jsonl(tmp_path / "up.jsonl", make_samples(3, seed=54))
    done = hsx_proc("submit", path, "--name", "progress")
    assert done.returncode == 0 and re.fullmatch(r"job_\w+ \w+: 3 samples, \d+ tokens \(progress\)\n", done.stdout)
    size = path.stat().st_size
    last = progress_lines(done.stderr, "submit")[-1]
    assert "(100%)" in last and "\r" not in done.stderr and f"/{size}B " in last

    out_dir = tmp_path / "dl"
    done = hsx_proc("download", job.id, out_dir)
    assert done.returncode == 0 and "sha256 ok" in done.stdout and "\r" not in done.stderr + done.stdout
    assert "(100%)" in progress_lines(done.stderr, "download")[-1]
    assert "hsx download" not in done.stdout
    quiet = hsx_proc("download", job.id, tmp_path / "dl2", "--json")
    assert quiet.returncode == 0 and quiet.stderr == "" and json.loads(quiet.stdout)["job_id"] == job.id

    waited = hsx_proc("download", job.id, tmp_path / "dl3", "--wait", "-q")
    assert waited.returncode == 0 and waited.stderr == "" and waited.stdout.startswith(f"{job.id} succeeded\n")

    done = hsx_proc("verify", out_dir)
    assert done.returncode == 0 and "hsx verify" not in done.stdout
    assert "(100%)" in progress_lines(done.stderr, "verify")[-1]
    assert hsx_proc("verify", out_dir, "-q").stderr == ""


def test_quiet_submit_prints_the_job_id_alone_and_its_progress_goes_to_stderr(servers, tmp_path):
    """`hsx submit -q --wait` is for scripts: stdout is exactly the job's id, the exit status says how the job
    ended, an error is said on stderr. Without -q, --wait shows its progress on stderr, never on stdout."""
    _, ref = servers
    path = jsonl(tmp_path / "quiet.jsonl", make_samples(4, seed=57))
    quiet = hsx_proc("submit", path, "-q", "--wait", "--interval", "0.2")
    assert quiet.returncode == 0 and re.fullmatch(r"job_\w+\n", quiet.stdout), quiet.stdout
    assert quiet.stderr == ""
    with HsxClient() as hsx:
        assert hsx.get_job(quiet.stdout.strip()).state == "succeeded"

    shown = hsx_proc("submit", path, "--wait", "--interval", "0.2")
    assert shown.returncode == 0 and re.fullmatch(r"job_\w+ \w+: 4 samples, \d+ tokens\n", shown.stdout), shown.stdout
    assert "] succeeded" in shown.stderr, shown.stderr

    faults = f"{ref.url}/admin/faults"
    httpx.post(faults, json={"bad_dumps": {"probability": 1.0, "kind": "wrong_num_tokens"}}).raise_for_status()
    try:
        failed = hsx_proc("submit", path, "-q", "--wait", "--interval", "0.2")
    finally:
        httpx.delete(faults).raise_for_status()
    assert failed.returncode == 1 and re.fullmatch(r"job_\w+\n", failed.stdout), failed.stdout
    assert f"job {failed.stdout.strip()} failed" in failed.stderr and "[" not in failed.stderr, failed.stderr
