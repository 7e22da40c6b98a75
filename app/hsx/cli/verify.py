"""`hsx verify`: check a job folder's shards and samples against its manifest."""

from __future__ import annotations

import argparse
import json
import sys

from hsx.cli.progress import PROGRESS_NOTE, progress

NAME = "verify"
HELP = "check a job's shards (size, sha256, layout) and samples (ranges, shapes, dtype, finite values)"
DESCRIPTION = f"""\
Check a job folder against its manifest.json: every shard's byte size, sha256 and tensor layout, every
sample's placement (inside its shard, overlapping no other), shapes, dtype, token ids, loss mask and
that every hidden-state value is finite. Sample rows are read a chunk at a time, never a shard whole.
Prints a summary (or the full report with --json) and exits 1 when anything is wrong.
The bytes read so far are shown as progress. {PROGRESS_NOTE}
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", help="the job folder, or its manifest.json")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--no-hash", action="store_true", help="skip the sha256 of each shard")
    parser.add_argument("--no-values", action="store_true", help="skip reading sample rows (shapes, finite values)")
    parser.add_argument(
        "--max-faults",
        type=int,
        default=1000,
        help="list at most this many faults (all are counted; default: %(default)s)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="show no progress on stderr")


def main(args: argparse.Namespace) -> int:
    from hsx.verify import summary_lines, verify_job

    with progress("hsx verify", None, quiet=args.quiet or args.json) as meter:
        report = verify_job(
            args.source,
            check_hashes=not args.no_hash,
            check_values=not args.no_values,
            max_faults=args.max_faults,
            progress=meter.moveto,
        )
    if args.json:
        json.dump(report.to_dict(), sys.stdout, indent=1)
        print()
    else:
        print("\n".join(summary_lines(report)))
    return 0 if report.ok else 1
