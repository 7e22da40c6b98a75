"""`hsx submit --wait` and `hsx status` say why a job waits, in words a person can act on, when no writer can
run it: here an API with no writer at all (`hsx serve --no-writer`, nothing else on its database). `submit
--wait` says it on stderr with its progress; its stdout holds what scripts read."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from typing import IO

from tests.support.procs import hsx_command
from tests.support.stack import start_service

NO_WRITER = "waiting: no writer is running (start `hsx serve` or `hsx worker` with a dump root against this database)"


def read_until(stream: IO[str] | None, wanted: str, timeout: float = 60.0) -> str:
    """What a process printed on `stream` until a line holding `wanted` (or the timeout)."""
    assert stream is not None
    selector = selectors.DefaultSelector()
    selector.register(stream, selectors.EVENT_READ)
    seen, deadline = "", time.monotonic() + timeout
    while wanted not in seen and time.monotonic() < deadline:
        if selector.select(timeout=0.5):
            line = stream.readline()
            if not line:
                break
            seen += line
    return seen


def test_submit_and_status_say_why_the_job_waits(tmp_path):
    svc = start_service(tmp_path, f"sqlite:///{tmp_path / 'hsx.db'}", extra=["--no-writer"])
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps({"id": f"s{i}", "input_ids": [1, 2, 3]}) + "\n" for i in range(3)))
    env = {**os.environ, "HSX_URL": svc.url}
    submit = subprocess.Popen(
        [*hsx_command(), "submit", str(path), "--wait"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        job_id = read_until(submit.stdout, "job_").split()[0]  # the job's id first, on stdout
        printed = read_until(submit.stderr, NO_WRITER)  # the progress and why it waits, on stderr
        assert NO_WRITER in printed, printed
        assert printed.count(NO_WRITER) == 1
        status = subprocess.run(
            [*hsx_command(), "status", job_id], capture_output=True, text=True, env=env, timeout=60, check=True
        )
        assert status.stdout.splitlines()[-1] == NO_WRITER
        assert "queued" in status.stdout.splitlines()[-2]
    finally:
        submit.kill()
        submit.communicate()
        svc.stop()
