"""`hsx retry`: queue again what a job has not stored (its failed samples; a cancelled job's cancelled ones): the
job goes on."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from hsx.cli.client.common import ENV_NOTE, add_common, print_json, progress_line, run

if TYPE_CHECKING:
    from hsx.sdk import HsxClient

NAME = "retry"
HELP = "resume a job: queue its failed (and, once cancelled, its cancelled) samples again"
DESCRIPTION = f"""Resume a job: queue again what it has not stored, each sample with a fresh attempt budget. That
is its failed samples (a partial or failed job, or a running one), and for a cancelled job also the samples the
cancel left unrun (conversations never rendered are rendered then). Its stored and skipped samples stay. The job
runs again from where it stopped: its new shards follow its old ones in its commit feed, and its manifest, written
again when it ends, lists every stored sample once. A job that is still cancelling, or that has no failed or
cancelled samples, cannot be retried (exit 2). --json prints the job.
{ENV_NOTE}

examples:
  hsx retry job_0123abcd && hsx status job_0123abcd --watch
  hsx cancel job_0123abcd --wait && hsx retry job_0123abcd    # stop a job now, go on with it later
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id")
    add_common(parser)


def main(args: argparse.Namespace) -> int:
    def body(hsx: HsxClient) -> int:
        job = hsx.retry(args.job)
        again = f"{job.counts.queued} sample(s) queued" + (
            f", {job.counts.preparing} conversation(s) to prepare" if job.counts.preparing else ""
        )
        print_json(job) if args.json else print(f"{job.id} {job.state}: {again}\n{progress_line(job)}")
        return 0

    return run(args, body)
