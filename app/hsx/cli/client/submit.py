"""`hsx submit`: create a job from a local JSONL file (streamed) or a file under the service's input root."""

from __future__ import annotations

import argparse
import os
import stat
import sys
from typing import TYPE_CHECKING, Any, BinaryIO

from hsx.cli.client.common import ENV_NOTE, UsageError, add_common, add_quiet, follow, outcome, print_json, run
from hsx.cli.progress import PROGRESS_NOTE, progress
from hsx.layers import layers_arg

if TYPE_CHECKING:
    from hsx.sdk import HsxClient, Job

NAME = "submit"
HELP = "create a job from a JSONL file (streamed) or a file under the service's input root"
DESCRIPTION = f"""Create an extraction job.

FILE is a local JSONL file with one sample per line, {{"id": ..., "input_ids": [...], "loss_mask": [...]}}
(id and loss_mask optional). It is streamed to the service as application/x-ndjson, never read whole;
"-" reads standard input. With --input-path the service reads a JSONL file under its own input root
instead. Every sample is checked before anything is stored: a refused job lists each bad line on stderr
and exits 2. With --wait the job's progress is followed until it finishes (exit 0 only if it succeeded).
The upload of FILE shows its progress in bytes. {PROGRESS_NOTE}
{ENV_NOTE}

examples:
  hsx submit samples.jsonl --name run1 --wait
  hsx submit --input-path run1.jsonl --layers 2,4,5,8 --idempotency-key run1 --json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", nargs="?", metavar="FILE", help="local JSONL file to stream ('-': standard input)")
    parser.add_argument("--input-path", help="a JSONL file under the service's input root, read by the service")
    parser.add_argument("--name", help="job name")
    parser.add_argument(
        "--layers", type=layers_arg, help="layers the job requires, e.g. 2,4,5,8 (default: the server's)"
    )
    parser.add_argument("--idempotency-key", help="repeating a submission with the same key returns the first job")
    parser.add_argument("--wait", action="store_true", help="follow the job's progress until it finishes")
    parser.add_argument(
        "--interval",
        type=float,
        default=1.0,
        help="seconds between progress updates with --wait (default: %(default)s)",
    )
    add_quiet(parser)
    add_common(parser)


def _open_jsonl(path: str) -> BinaryIO:
    """The file to stream; one that cannot be opened is a usage error, not a failed request."""
    try:
        return open(path, "rb")
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


def _size(source: BinaryIO) -> int | None:
    """The bytes there are to send: a regular file's size; None for a pipe or a terminal."""
    try:
        info = os.fstat(source.fileno())
    except (OSError, ValueError):
        return None
    return info.st_size if stat.S_ISREG(info.st_mode) else None


def _upload(hsx: HsxClient, source: BinaryIO, args: argparse.Namespace, options: dict[str, Any]) -> Job:
    with progress("hsx submit", _size(source), quiet=args.quiet or args.json) as meter:
        return hsx.submit_jsonl(source, progress=meter.moveto, **options)


def main(args: argparse.Namespace) -> int:
    def body(hsx: HsxClient) -> int:
        if (args.file is None) == (args.input_path is None):
            raise UsageError("give exactly one of FILE or --input-path")
        options = {"name": args.name, "layers": args.layers, "idempotency_key": args.idempotency_key}
        if args.input_path is not None:
            job = hsx.create_job(input_path=args.input_path, **options)
        elif args.file == "-":
            job = _upload(hsx, sys.stdin.buffer, args, options)
        else:
            with _open_jsonl(args.file) as source:
                job = _upload(hsx, source, args, options)
        if not args.json:
            print(
                f"{job.id} {job.state}: {job.counts.total} samples, {job.tokens.total} tokens"
                + (f" ({job.name})" if job.name else ""),
                flush=True,
            )
        if not args.wait:
            if args.json:
                print_json(job)
            return 0
        if args.json:
            final = hsx.wait(job, poll_s=min(0.5, args.interval), max_poll_s=args.interval)
            print_json(final)
        else:
            final = follow(hsx, job, as_json=False, interval=args.interval)
        return outcome(final, as_json=args.json)

    return run(args, body)
