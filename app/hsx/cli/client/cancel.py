"""`hsx cancel`: cancel a queued or running job, and with --wait follow it until it is cancelled."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from hsx.cli.client.common import ENV_NOTE, add_common, follow, print_json, progress_line, run
from hsx.states import JobState

if TYPE_CHECKING:
    from hsx.sdk import HsxClient

NAME = "cancel"
HELP = "cancel a job: queued samples are cancelled, those in flight are finished and stored"
DESCRIPTION = f"""Cancel a queued or running job. The service answers at once: the job is "cancelling" while its
queued samples are cancelled in the background and the samples being extracted finish and are stored (nothing
is half-stored); then it is "cancelled". Without --wait the command prints the job as the service answered
("cancelling") and exits 0; with --wait it follows the job until it has finished and exits 0 once it is
cancelled. Cancelling a job that is already cancelling is not an error; a finished job cannot be cancelled
(exit 2). --json prints the job (with --wait: the service's answer, then one JSON line per change, the last
one final). A cancelled job can go on later: hsx retry JOB queues the samples the cancel left unrun.
{ENV_NOTE}

examples:
  hsx cancel job_0123abcd
  hsx cancel job_0123abcd --wait
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id")
    parser.add_argument("--wait", action="store_true", help="follow the job until it is cancelled")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between updates (default: %(default)s)")
    add_common(parser)


def main(args: argparse.Namespace) -> int:
    def body(hsx: HsxClient) -> int:
        job = hsx.cancel(args.job)
        if not args.wait:
            print_json(job) if args.json else print(f"{job.id} {job.state}\n{progress_line(job)}")
            return 0
        print_json(job) if args.json else print(f"{job.id} {job.state}", flush=True)
        job = follow(hsx, job, as_json=args.json, interval=args.interval)
        if not args.json:
            print(f"{job.id} {job.state}")
        return 0 if job.state == JobState.CANCELLED else 1

    return run(args, body)
