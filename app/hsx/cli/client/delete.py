"""`hsx delete`: delete a finished job's records, and with --files its shards and manifest."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from hsx.cli.client.common import ENV_NOTE, add_common, print_json, run

if TYPE_CHECKING:
    from hsx.sdk import HsxClient

NAME = "delete"
HELP = "delete a finished job (and with --files its shards and manifest)"
DESCRIPTION = f"""Delete a finished (succeeded, partial, failed or cancelled) job's records from the service's database.
With --files the service also deletes the job's folder (shards and manifest.json) from its output root; without
it the folder stays, and a later `hsx delete JOB --files` removes it, also once the records are gone. The folder
is deleted only when it holds nothing but what hsx writes there: a folder holding anything else, or a symbolic
link in its place, is refused (exit 2) and nothing is deleted, the records included. A queued or running job
must be cancelled first (exit 2).
--json prints {{"deleted": JOB, "files": true|false}}.
{ENV_NOTE}

examples:
  hsx delete job_0123abcd --files
  hsx delete job_0123abcd            # the records only; the files stay
  hsx delete job_0123abcd --files    # later: the files the first delete left
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id")
    parser.add_argument(
        "--files",
        action="store_true",
        help="also delete its folder (shards and manifest) on the service; for a job deleted before without "
        "--files, delete the folder that delete left",
    )
    add_common(parser)


def main(args: argparse.Namespace) -> int:
    def body(hsx: HsxClient) -> int:
        hsx.delete(args.job, files=args.files)
        if args.json:
            print_json({"deleted": args.job, "files": args.files})
        else:
            print(f"deleted {args.job} and its files" if args.files else kept(args.job))
        return 0

    return run(args, body)


def kept(job: str) -> str:
    return (
        f"deleted {job}'s records; its files stay in the folder {job} under the service's output root "
        f"(remove them with: hsx delete {job} --files)"
    )
