"""`hsx download`: a job's shards and manifest.json into a folder, resumable and sha256-checked."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from hsx.cli.client.common import ENV_NOTE, add_common, add_quiet, follow, human_bytes, print_json, run
from hsx.cli.progress import PROGRESS_NOTE, progress
from hsx.states import TERMINAL_JOB_STATES

if TYPE_CHECKING:
    from hsx.sdk import HsxClient

NAME = "download"
HELP = "download a job's shards and manifest.json into DIR (resumable, sha256-checked)"
DESCRIPTION = f"""Download every shard of a job and its manifest.json into DIR.

Each shard arrives as DIR/<shard>.part and is renamed into place only after its sha256 matches the
manifest's; run the same command again after an interruption and it resumes each part where it stopped
(HTTP Range) and skips shards already there. A shard whose bytes do not match is deleted and reported
(exit 1). manifest.json is written last, once the job has finished, so its presence means the folder is
complete; for a job still running only the shards written so far are fetched (--wait waits for the job to
finish first). --json prints {{"job_id", "state", "directory", "manifest", "shards": [{{"name", "bytes", "sha256",
"resumed_from", "skipped"}}]}}.
{PROGRESS_NOTE}
{ENV_NOTE}

examples:
  hsx download job_0123abcd out/run1
  hsx download job_0123abcd out/run1 --wait --json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id")
    parser.add_argument("dir", metavar="DIR", help="folder to download into (created if missing)")
    parser.add_argument(
        "--wait", action="store_true", help="wait for the job to finish first (its progress on stderr, unless -q)"
    )
    add_quiet(parser)
    add_common(parser)


class ShardsSeen:
    """Where each shard's transfer started (a resumed part's size), to tell fetched shards from skipped ones."""

    def __init__(self) -> None:
        self.started: dict[str, int] = {}

    def __call__(self, name: str, done: int, total: int) -> None:
        self.started.setdefault(name, done)


class DownloadedShard(TypedDict):
    """A shard as the command reports it (--json: `shards`)."""

    name: str
    bytes: int
    sha256: str
    resumed_from: int  # bytes that were there from an earlier run
    skipped: bool  # whole already: nothing fetched


def main(args: argparse.Namespace) -> int:
    def body(hsx: HsxClient) -> int:
        if args.wait:
            if args.json or args.quiet:
                job = hsx.wait(args.job, max_poll_s=2)
            else:
                job = follow(hsx, args.job, as_json=False, stream=sys.stderr)  # stdout: what was downloaded
            if not args.json:
                print(f"{job.id} {job.state}")
        directory = Path(args.dir)
        seen = ShardsSeen()
        with progress("hsx download", None, quiet=args.quiet or args.json) as meter:
            manifest = hsx.download_job(args.job, directory, on_progress=seen, progress=meter.moveto)
        shards: list[DownloadedShard] = []
        for s in manifest.shards:
            resumed = seen.started.get(s.name)
            shards.append(
                {
                    "name": s.name,
                    "bytes": s.bytes,
                    "sha256": s.sha256,
                    "resumed_from": resumed or 0,
                    "skipped": resumed is None,
                }
            )
        finished = manifest.state in TERMINAL_JOB_STATES
        if not finished:
            print(
                f"hsx download: job {manifest.job_id} is {manifest.state}: downloaded the {len(shards)} shard(s) "
                "written so far; run this again once it has finished for the rest and manifest.json",
                file=sys.stderr,
            )
        if args.json:
            print_json(
                {
                    "job_id": manifest.job_id,
                    "state": manifest.state,
                    "directory": str(directory),
                    "manifest": str(directory / "manifest.json") if finished else None,
                    "shards": shards,
                }
            )
            return 0
        for shard in shards:
            how = (
                "already there"
                if shard["skipped"]
                else f"resumed from byte {shard['resumed_from']}"
                if shard["resumed_from"]
                else "downloaded"
            )
            print(f"  {shard['name']}  {human_bytes(shard['bytes'])}  sha256 ok  ({how})")
        total = sum(shard["bytes"] for shard in shards)
        print(
            f"{manifest.job_id} {manifest.state}: {len(shards)} shard(s), {human_bytes(total)}, "
            f"{len(manifest.samples)} sample(s) in {directory}/" + (" with manifest.json" if finished else "")
        )
        return 0

    return run(args, body)
