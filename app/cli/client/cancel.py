"""`hsx cancel`: cancel a queued or running job."""

from __future__ import annotations

import argparse

from hsx.cli.client.common import ENV_NOTE, add_common, print_json, progress_line, run

NAME = "cancel"
HELP = "cancel a job: queued samples are cancelled, the one in flight is finished and stored"
DESCRIPTION = f"""Cancel a queued or running job. Its queued samples are cancelled; the sample being extracted
finishes and is stored, so nothing is half-stored. The job is "cancelling" until then, then "cancelled".
A finished job cannot be cancelled (exit 2). --json prints the job.
{ENV_NOTE}

example:
  hsx cancel job_0123abcd
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id")
    add_common(parser)


def main(args: argparse.Namespace) -> int:
    def body(hsx) -> int:
        job = hsx.cancel(args.job)
        print_json(job) if args.json else print(f"{job.id} {job.state}\n{progress_line(job)}")
        return 0

    return run(args, body)
