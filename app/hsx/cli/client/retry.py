"""`hsx retry`: queue a job's failed samples again."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from hsx.cli.client.common import ENV_NOTE, add_common, print_json, progress_line, run

if TYPE_CHECKING:
    from hsx.sdk import HsxClient

NAME = "retry"
HELP = "queue a job's failed samples again, with a fresh attempt budget"
DESCRIPTION = f"""Queue a finished job's failed samples again, each with a fresh attempt budget; the job runs
again and stores them next to the samples it already has. A job without failed samples cannot be retried
(exit 2). --json prints the job.
{ENV_NOTE}

example:
  hsx retry job_0123abcd && hsx status job_0123abcd --watch
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id")
    add_common(parser)


def main(args: argparse.Namespace) -> int:
    def body(hsx: HsxClient) -> int:
        job = hsx.retry(args.job)
        print_json(job) if args.json else print(
            f"{job.id} {job.state}: {job.counts.queued} sample(s) queued again\n{progress_line(job)}"
        )
        return 0

    return run(args, body)
