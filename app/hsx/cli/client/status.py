"""`hsx status`: a job's state and progress, once or followed until it finishes."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from hsx.cli.client.common import (
    ENV_NOTE,
    Progress,
    add_common,
    duration,
    human_bytes,
    outcome,
    print_json,
    progress_line,
    run,
    waiting_line,
    when,
)

if TYPE_CHECKING:
    from hsx.sdk import HsxClient, Job
    from hsx.sdk.models import Consumer

NAME = "status"
HELP = "show a job's progress (bar, rate, ETA); --watch follows it until it finishes"
DESCRIPTION = f"""Show a job's state and progress: samples and tokens extracted, rate, ETA, failures, its time
since it was created (with the time its conversations took to be prepared and the time spent extracting apart),
and its attempts: how many ended ok, were retried or failed, the retries by reason code, and the samples waiting for
another attempt; and for a job that trainers follow, its retention and each consumer's position and lag.

On a terminal, --watch redraws one progress line in place until the job is succeeded, partial, failed or
cancelled (exit 0 when it succeeded, 3 when partial: some samples failed, 1 otherwise); when the output
is not a terminal it prints a plain line whenever the progress changes. With --json the job is printed as
JSON (with --watch: one JSON line per change, the last one final).
{ENV_NOTE}

examples:
  hsx status job_0123abcd
  hsx status job_0123abcd --watch
  hsx status job_0123abcd --json | python3 -c 'import json, sys; print(json.load(sys.stdin)["state"])'
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id")
    parser.add_argument("--watch", action="store_true", help="follow the job until it finishes")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between updates (default: %(default)s)")
    add_common(parser)


def describe(job: Job) -> list[str]:
    lines = [
        f"{job.id}  {job.name or '-'}  created {when(job.created_at)}"
        + (f"  layers {job.layers}" if job.layers else "")
        + f"  encoding {job.options.encoding}"
    ]
    if job.finished_at:
        lines.append(f"finished {when(job.finished_at)} after {time_spent(job)}, {job.shards_written} shard(s)")
    else:
        lines.append(f"elapsed {time_spent(job)}")
    if job.error:
        lines.append(f"error: {job.error}")
    if job.warning:
        lines.append(f"warning: {job.warning}")
    return lines + attempt_lines(job)


def time_spent(job: Job) -> str:
    """Its time since it was created, with the time its conversations took to be prepared and the time since
    its first sample was claimed apart (the two overlap: extraction starts with the first conversation
    prepared)."""
    parts = [
        f"{what} {duration(seconds)}"
        for what, seconds in (("preparing", job.preparing_s), ("extracting", job.extracting_s))
        if seconds is not None
    ]
    return duration(job.elapsed_s) + (f" ({', '.join(parts)})" if parts else "")


def attempt_lines(job: Job) -> list[str]:
    """The job's attempts by outcome, its retries by reason code, and what waits for another attempt."""
    a = job.attempts
    if not a.total and not a.waiting_retry:
        return []
    outcomes = [f"{n} {what}" for n, what in ((a.ok, "ok"), (a.retried, "retried"), (a.failed, "failed")) if n]
    if a.interrupted:
        outcomes.append(f"{a.interrupted} interrupted")
    lines = [f"attempts {a.total}: {', '.join(outcomes) or 'none ended'}"]
    if a.by_reason:
        lines.append("retries by reason: " + ", ".join(f"{code or '-'} {n}" for code, n in a.by_reason.items()))
    if a.waiting_retry:
        lines.append(f"waiting for another attempt: {a.waiting_retry} sample(s)")
    return lines


def consumer_lines(job: Job, consumers: list[Consumer]) -> list[str]:
    """The job's retention and back-pressure, and each consumer: how far its ranks have read, its lag."""
    options = job.options
    lines = []
    if options.retention != "keep" or options.max_unread_bytes is not None:
        limit = f", at most {human_bytes(options.max_unread_bytes)} unread" if options.max_unread_bytes else ""
        lines.append(f"retention {options.retention}{limit}")
    for c in consumers:
        ranks = f"{len(c.ranks)} of {c.world_size} rank(s) acknowledged" if c.world_size else "nothing acknowledged"
        lag = f"lag {c.lag_shards} shard(s), {human_bytes(c.lag_bytes)}"
        lines.append(f"consumer {c.name}: read to seq {c.read_seq}, {ranks}; {lag}")
    return lines


def main(args: argparse.Namespace) -> int:
    def body(hsx: HsxClient) -> int:
        if not args.watch:
            job = hsx.get_job(args.job)
            if args.json:
                print_json(job)
            else:
                readers = consumer_lines(job, hsx.consumers(job))
                print("\n".join([*describe(job), progress_line(job), *filter(None, [waiting_line(job)]), *readers]))
            return 0
        progress = Progress(as_json=args.json)
        if not args.json:
            print(describe(hsx.get_job(args.job))[0], flush=True)
        try:
            job = hsx.wait(args.job, poll_s=min(0.5, args.interval), max_poll_s=args.interval, on_progress=progress)
        finally:
            progress.close()
        if not args.json:
            for line in describe(job)[1:]:
                print(line)
        return outcome(job, as_json=args.json)

    return run(args, body)
