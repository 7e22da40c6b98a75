"""Shared by the client commands: the common flags, the SDK client, JSON output, progress display, and how
errors become messages on stderr and exit codes (2: the service refused the input (4xx), 1: anything else)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING, Any, TextIO

from hsx.states import TERMINAL_JOB_STATES, JobState
from hsx.wire import CLOCK_FIELDS

if TYPE_CHECKING:
    from hsx.sdk import HsxClient, HsxError, Job

ENV_NOTE = "Service: $HSX_URL (default http://127.0.0.1:8000); bearer token: $HSX_TOKEN."


class UsageError(Exception):
    """A bad argument found by the command itself (exit 2)."""


def add_common(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("service and output")
    g.add_argument("--url", default=None, help="the service's base URL (env HSX_URL; default http://127.0.0.1:8000)")
    g.add_argument("--token", default=None, help="bearer token (env HSX_TOKEN)")
    g.add_argument(
        "--json", action="store_true", help="print machine-readable JSON on stdout (errors as JSON on stderr)"
    )


def add_quiet(parser: argparse.ArgumentParser, help: str = "show no progress on stderr") -> None:
    parser.add_argument("-q", "--quiet", action="store_true", help=help)


def run(args: argparse.Namespace, body: Callable[[HsxClient], int | None]) -> int:
    """Open the client, run the command's body, and turn failures into stderr messages and exit codes."""
    import httpx

    from hsx.sdk import HsxClient, HsxError

    prog = f"hsx {getattr(args, 'command', '') or ''}".strip()
    # The SDK logs why a job waits; the commands print it with their progress instead (Progress).
    logging.getLogger("hsx.sdk").setLevel(logging.ERROR)
    client = None
    try:
        client = HsxClient(args.url, token=args.token)
        return int(body(client) or 0)
    except HsxError as exc:
        report(prog, exc, as_json=args.json)
        return 2 if 400 <= exc.status < 500 else 1
    except UsageError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    except httpx.TransportError as exc:
        where = client.base_url if client is not None else args.url
        print(f"{prog}: cannot reach the service at {where}: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    except TimeoutError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130
    finally:
        if client is not None:
            client.close()


def report(
    prog: str, exc: HsxError, *, as_json: bool = False, stream: TextIO | None = None, max_errors: int = 20
) -> None:
    """The problem's title and detail, then one line per invalid sample or field."""
    stream = stream or sys.stderr
    if as_json:
        print(json.dumps({"status": exc.status, **exc.problem}), file=stream)
        return
    status = f" ({exc.status})" if exc.status else ""
    print(f"{prog}: {exc.title or 'error'}{status}: {exc.detail}", file=stream)
    for err in exc.errors[:max_errors]:
        print(f"  {describe_error(err)}", file=stream)
    if len(exc.errors) > max_errors:
        print(f"  ... and {len(exc.errors) - max_errors} more", file=stream)


def describe_error(err: dict[str, Any]) -> str:
    where = []
    if err.get("sample_index") is not None:
        where.append(f"sample {err['sample_index']}")
    if err.get("sample_id") is not None:
        where.append(f"id {err['sample_id']!r}")
    if err.get("line") is not None:
        where.append(f"line {err['line']}")
    head = ", ".join(where)
    field = err.get("field") or ""
    label = f"{head}: {field}" if head and field else head or field
    return f"{label}: {err.get('message', '')}" if label else str(err.get("message", err))


def plain(obj: Any) -> Any:
    """Models and lists of them as JSON-ready data."""
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if isinstance(obj, (list, tuple)):
        return [plain(x) for x in obj]
    return obj


def print_json(obj: Any, stream: TextIO | None = None) -> None:
    print(json.dumps(plain(obj)), file=stream or sys.stdout, flush=True)


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def progress_line(job: Job, width: int = 30) -> str:
    """One line: bar, state, samples and tokens extracted, rate, ETA, failures, retried attempts (and
    cancelled samples)."""
    c, t, a = job.counts, job.tokens, job.attempts
    extracted = t.done + t.staged
    filled = min(width, int(width * extracted / max(t.total, 1)))
    rate = f"{job.rate_tokens_per_s:.0f} tok/s" if job.rate_tokens_per_s else "- tok/s"
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] {job.state:<9} "
        f"{c.succeeded + c.staged}/{c.total} samples  {extracted}/{t.total} tokens  {rate}  "
        f"ETA {duration(job.eta_s)}  failed {c.failed}"
        + (f"  retried {a.retried}" if a.retried else "")
        + (f"  cancelled {c.cancelled}" if c.cancelled else "")
        + (f"  preparing {c.preparing}" if c.preparing else "")
        + (f"  skipped {c.skipped}" if c.skipped else "")
        + (f"  truncated {c.truncated}" if c.truncated else "")
    )


def waiting_line(job: Job) -> str | None:
    """Why an active job makes no progress, as a line of its own; None while it does."""
    return f"waiting: {job.waiting_reason}" if job.waiting_reason else None


class Progress:
    """Follows a job: on a terminal one line redrawn in place; elsewhere a plain line when something changed (at
    most one per `every` seconds, and always the last); with --json one JSON line per change."""

    def __init__(self, *, as_json: bool = False, stream: TextIO | None = None, every: float = 1.0, indent: str = ""):
        self.stream = stream or sys.stdout
        self.as_json, self.every, self.indent = as_json, every, indent
        self.tty = not as_json and self.stream.isatty()
        self.last, self.last_t, self.drawn = "", 0.0, False
        self.waiting: str | None = None

    def __call__(self, job: Job) -> None:
        if self.as_json:
            key = job.model_dump_json(exclude=set(CLOCK_FIELDS))
            if key != self.last:
                print_json(job, self.stream)
                self.last = key
            return
        waiting = waiting_line(job)
        if waiting != self.waiting:
            # Said once each time it changes, above the progress: the counts alone look like a hang.
            self.waiting = waiting
            if waiting is not None:
                prefix = "\r\033[K" if self.drawn else ""
                print(prefix + self.indent + waiting, file=self.stream, flush=True)
                self.drawn = False
        line = self.indent + progress_line(job)
        if self.tty:
            self.stream.write("\r\033[K" + line)
            self.stream.flush()
            self.drawn = True
        elif line != self.last and (time.monotonic() - self.last_t >= self.every or job.state in TERMINAL_JOB_STATES):
            print(line, file=self.stream, flush=True)
            self.last, self.last_t = line, time.monotonic()

    def close(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.stream.flush()
            self.drawn = False


def follow(
    hsx: HsxClient, job: Job | str, *, as_json: bool, interval: float = 1.0, stream: TextIO | None = None
) -> Job:
    """Show the job's progress on `stream` (stdout by default) until it is finished; returns the finished job."""
    progress = Progress(as_json=as_json, stream=stream)
    try:
        return hsx.wait(job, poll_s=min(0.5, interval), max_poll_s=interval, on_progress=progress)
    finally:
        progress.close()


# `hsx submit --wait` and `hsx wait`: what the job's end says, as an exit status.
EXIT_FAILED = 1  # failed (nothing stored, or the job could not run) or cancelled
EXIT_PARTIAL = 3  # finished with some samples stored and some failed


def outcome(job: Job, *, as_json: bool) -> int:
    """After following a job: a hint about failures on stderr; exit 0 when it succeeded, EXIT_PARTIAL
    when some samples failed, EXIT_FAILED otherwise."""
    if job.state != JobState.SUCCEEDED and not as_json:
        why = f" ({job.error})" if job.error else ""
        stored = f"{job.counts.succeeded} of {job.counts.total} stored, " if job.state == JobState.PARTIAL else ""
        print(
            f"job {job.id} {job.state}{why}; {stored}{job.counts.failed} failed, {job.counts.cancelled} cancelled"
            + (f", {job.counts.skipped} skipped" if job.counts.skipped else "")
            + (f"; see: hsx samples {job.id} --state failed" if job.counts.failed else ""),
            file=sys.stderr,
        )
    if job.warning and not as_json:
        print(f"job {job.id}: warning: {job.warning}", file=sys.stderr)
    if job.state == JobState.SUCCEEDED:
        return 0
    return EXIT_PARTIAL if job.state == JobState.PARTIAL else EXIT_FAILED


def when(dt: datetime | None, fmt: str = "%Y-%m-%d %H:%M:%S") -> str:
    """A service time (UTC) in this machine's time zone."""
    return dt.astimezone().strftime(fmt) if dt is not None else "-"


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def table(rows: list[list[str]], header: list[str], stream: TextIO | None = None) -> None:
    """Columns padded to their widest cell; the last column is not padded."""
    stream = stream or sys.stdout
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        cells = [c.ljust(w) for c, w in zip(row[:-1], widths)] + [row[-1]]
        print("  ".join(cells).rstrip(), file=stream)
