"""`hsx follow`: a job's shards as they are recorded (its commit feed), optionally mirrored into a folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hsx.cli.client.common import ENV_NOTE, add_common, add_quiet, human_bytes, print_json, run
from hsx.storage.atomic import atomic_file

if TYPE_CHECKING:
    from hsx.sdk import HsxClient
    from hsx.sdk.models import Shard

NAME = "follow"
HELP = "print a job's shards as they are recorded; with --download mirror them into DIR"
DESCRIPTION = f"""Follow a job's commit feed: every shard the job records, in the order recorded, as it is
recorded, until the job has ended and its last shard was given (exit 0).

Each line says the shard's seq (1, 2, ...), its name, bytes and samples (--json: one JSON object per line,
the feed's shard with its samples' ids, offsets and lengths). --after SEQ starts after that position.

With --download DIR each shard is fetched into DIR as it is recorded (DIR/<shard>.part first, renamed
into place once its sha256 matches), and manifest.json is written last, once the feed is complete: the
folder is then what `hsx download` makes, readable by HiddenStateDataset. DIR/.follow-position keeps the
last shard mirrored, so the same command run again goes on from there. A shard that retention deleted
before it could be fetched (a job with retention acked, followed by someone who is not one of its
consumers) is reported and skipped.
{ENV_NOTE}

examples:
  hsx follow job_0123abcd
  hsx follow job_0123abcd --download data/run1
"""

POSITION = ".follow-position"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id")
    parser.add_argument("--after", type=int, default=None, metavar="SEQ", help="start after this seq (default: 0)")
    parser.add_argument("--download", metavar="DIR", default=None, help="mirror each shard into DIR as it comes")
    parser.add_argument(
        "--poll", type=float, default=30.0, metavar="S", help="seconds each request waits for a shard (default 30)"
    )
    add_quiet(parser)
    add_common(parser)


def main(args: argparse.Namespace) -> int:
    if args.after is not None and args.after < 0:
        print("hsx follow: --after is a seq, 0 or more", file=sys.stderr)
        return 2
    if not 0 < args.poll <= 60:
        print("hsx follow: --poll is more than 0 and at most 60 seconds", file=sys.stderr)
        return 2

    def body(hsx: HsxClient) -> int:
        mirror = Mirror(hsx, args.job, Path(args.download)) if args.download else None
        after = args.after if args.after is not None else (mirror.position() if mirror else 0)
        count = 0
        for shard in hsx.follow_shards(args.job, after=after, wait=args.poll):
            got = mirror.take(shard) if mirror else None
            count += 1
            if args.json:
                print_json({**shard.model_dump(mode="json"), **({"downloaded": got} if mirror else {})})
            else:
                note = "" if got is None else ("  downloaded, sha256 ok" if got else "  deleted by retention: skipped")
                print(f"{shard.seq:>6}  {shard.name}  {human_bytes(shard.bytes)}  {shard.num_samples} samples{note}")
            sys.stdout.flush()
        if mirror:
            mirror.finish()
        if not args.json and not args.quiet:
            where = f" into {args.download}/ with manifest.json" if mirror else ""
            print(f"{args.job}: the feed is complete, {count} shard(s) after seq {after}{where}", file=sys.stderr)
        return 0

    return run(args, body)


class Mirror:
    """A folder that holds the feed's shards as they come, and its manifest.json once it is complete."""

    def __init__(self, hsx: HsxClient, job: str, folder: Path):
        self.hsx, self.job, self.folder = hsx, job, folder
        folder.mkdir(parents=True, exist_ok=True)

    def position(self) -> int:
        try:
            return int((self.folder / POSITION).read_text().strip() or 0)
        except (FileNotFoundError, ValueError):
            return 0

    def take(self, shard: Shard) -> bool:
        """Fetch the shard (sha256 checked); False for one retention deleted. The position moves on after."""
        if not shard.deleted:
            self.hsx.download_shard(
                self.job, shard.name, self.folder / shard.name, sha256=shard.sha256, size=shard.bytes
            )
        with atomic_file(self.folder / POSITION) as f:
            f.write(f"{shard.seq}\n".encode())
        return not shard.deleted

    def finish(self) -> None:
        manifest = self.hsx.manifest(self.job)
        with atomic_file(self.folder / "manifest.json") as f:
            f.write(manifest.model_dump_json().encode())
