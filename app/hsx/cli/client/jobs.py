"""`hsx jobs`: list jobs, newest first."""

from __future__ import annotations

import argparse
from itertools import islice
from typing import TYPE_CHECKING

from hsx.cli.client.common import ENV_NOTE, add_common, print_json, run, table, when
from hsx.states import JobState

if TYPE_CHECKING:
    from hsx.sdk import HsxClient

NAME = "jobs"
HELP = "list jobs, newest first"
DESCRIPTION = f"""List jobs, newest first: state, samples stored and failed, tokens, creation time, name.
--json prints a JSON array of jobs.
{ENV_NOTE}

examples:
  hsx jobs
  hsx jobs --state failed --all --json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state", choices=[s.value for s in JobState], help="only jobs in this state")
    parser.add_argument("--limit", type=int, default=20, help="at most this many (default: %(default)s)")
    parser.add_argument("--all", action="store_true", help="every job, however many")
    add_common(parser)


def main(args: argparse.Namespace) -> int:
    def body(hsx: HsxClient) -> int:
        found = hsx.iter_jobs(state=args.state, page_size=1000 if args.all else max(1, min(args.limit, 1000)))
        jobs = list(found if args.all else islice(found, max(args.limit, 0)))
        if args.json:
            print_json(jobs)
            return 0
        if not jobs:
            print(f"no {args.state} jobs" if args.state else "no jobs")
            return 0
        rows = [
            [
                j.id,
                j.state,
                f"{j.counts.succeeded}/{j.counts.total}",
                str(j.counts.failed),
                f"{j.tokens.done + j.tokens.staged}/{j.tokens.total}",
                when(j.created_at),
                j.name or "",
            ]
            for j in jobs
        ]
        table(rows, ["ID", "STATE", "STORED", "FAILED", "TOKENS", "CREATED", "NAME"])
        return 0

    return run(args, body)
