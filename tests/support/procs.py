"""Start real subprocesses (servers on loopback) for tests and wait until they answer."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def hsx_command() -> list[str]:
    """The installed `hsx` console script, or the module when it is not on PATH."""
    exe = shutil.which("hsx", path=str(Path(sys.executable).parent)) or shutil.which("hsx")
    return [exe] if exe else [sys.executable, "-m", "hsx.cli"]


def synthetic_server_args(
    *, hidden: int, num_layers: int, vocab: int, dump_root: Path, port: int, extra: Sequence[str] = ()
) -> list[str]:
    """`hsx reference-server --synthetic` of this shape, dumping to `dump_root`, listening on `port`."""
    shape = ["--hidden-size", str(hidden), "--num-layers", str(num_layers), "--vocab-size", str(vocab)]
    where = ["--dump-root", str(dump_root), "--port", str(port)]
    return hsx_command() + ["reference-server", "--synthetic", *shape, *where, *extra]


def start_synthetic(
    tmp: Path, *, hidden: int, num_layers: int, vocab: int, dump_root: Path, extra: Sequence[str] = ()
) -> tuple[Process, str]:
    """A synthetic reference server of this shape on a free port, ready: (its process, its URL)."""
    port = free_port()
    args = synthetic_server_args(
        hidden=hidden, num_layers=num_layers, vocab=vocab, dump_root=dump_root, port=port, extra=extra
    )
    proc = Process(args, tmp / f"reference-{port}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_http(url + "/health")
    except BaseException:
        proc.stop()
        raise
    return proc, url


class Process:
    """A child process whose output goes to a log file, stopped on exit."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None, cwd: Path | None = None):
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - the child writes to it until stop() closes it
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            args, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, cwd=cwd, start_new_session=True
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_http(self, url: str, timeout: float = 90.0, ok=lambda r: r.status_code == 200) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{self.args[:3]} exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if ok(httpx.get(url, timeout=2.0)):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        # A process that never answered is of no use to the caller, who holds no handle to stop
        # it yet: stop it here, or it outlives the test on its port.
        self.stop()
        raise TimeoutError(f"{url} not ready after {timeout}s:\n{self.log()[-4000:]}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()
        self._log.close()


def _stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (fields[0] is the state, [1] the parent)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def proc_cpu_and_rss(pid: int) -> tuple[float, int]:
    """CPU seconds (user + system) and peak RSS bytes of a running process, from /proc."""
    fields = _stat(pid)
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                rss = int(line.split()[1]) * 1024
    return cpu, rss


def proc_tree_cpu(pid: int) -> float:
    """CPU seconds (user + system) of a running process and of every process below it: those alive
    now, and those that exited and were waited for (the kernel adds theirs to their parent's)."""
    parents: dict[int, int] = {}
    stats: dict[int, list[str]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stats[int(entry)] = fields = _stat(int(entry))
            except (FileNotFoundError, ProcessLookupError):
                continue  # exited while we looked
            parents[int(entry)] = int(fields[1])
    tree, grown = {pid}, True
    while grown:
        below = {p for p, parent in parents.items() if parent in tree and p not in tree}
        tree |= below
        grown = bool(below)
    ticks = os.sysconf("SC_CLK_TCK")
    # utime, stime, and the cutime, cstime of children already reaped
    return sum(sum(int(x) for x in stats[p][11:15]) for p in tree if p in stats) / ticks
