"""`hsx samples`: a job's samples (optionally by state), or one sample with every attempt."""

from __future__ import annotations

import argparse
from itertools import islice
from typing import TYPE_CHECKING

from hsx.cli.client.common import ENV_NOTE, add_common, print_json, run, table, when
from hsx.states import SampleState

if TYPE_CHECKING:
    from hsx.sdk import HsxClient, Sample

NAME = "samples"
HELP = "list a job's samples (e.g. --state failed, with reasons) or show one with its attempts"
DESCRIPTION = f"""List a job's samples in input order: state, tokens, attempts, shard placement and the last error.
With SAMPLE, show that one sample with every attempt and its outcome. --json prints a JSON array (or, with
SAMPLE, the sample).
{ENV_NOTE}

examples:
  hsx samples job_0123abcd --state failed
  hsx samples job_0123abcd sample-17
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id")
    parser.add_argument("sample", metavar="SAMPLE", nargs="?", help="one sample's id: show it with its attempts")
    parser.add_argument("--state", choices=[s.value for s in SampleState], help="only samples in this state")
    parser.add_argument("--limit", type=int, default=100, help="at most this many (default: %(default)s; 0: all)")
    add_common(parser)


def show_one(s: Sample) -> None:
    print(
        f"{s.id}  #{s.index}  {s.state}  {s.expected_tokens} tokens  attempts {s.attempts}"
        + (f"  {s.shard} @ {s.offset}" if s.shard else "")
    )
    if s.last_error:
        print(f"last error: {s.last_error}")
    for a in s.attempt_log or []:
        print(
            f"  attempt {a.number}: {a.outcome or 'running'}"
            + (f" ({a.reason})" if a.reason else "")
            + f"  started {when(a.started_at, '%H:%M:%S')}"
            + (f"  dump {a.dump}" if a.dump else "")
        )


def main(args: argparse.Namespace) -> int:
    def body(hsx: HsxClient) -> int:
        if args.sample is not None:
            sample = hsx.get_sample(args.job, args.sample)
            print_json(sample) if args.json else show_one(sample)
            return 0
        found = hsx.iter_samples(
            args.job, state=args.state, page_size=1000 if args.limit <= 0 else min(args.limit, 1000)
        )
        samples = list(found if args.limit <= 0 else islice(found, args.limit))
        if args.json:
            print_json(samples)
            return 0
        rows = [
            [
                s.id,
                s.state,
                str(s.expected_tokens),
                str(s.attempts),
                f"{s.shard}@{s.offset}" if s.shard else "-",
                s.last_error or "",
            ]
            for s in samples
        ]
        table(rows, ["ID", "STATE", "TOKENS", "ATTEMPTS", "SHARD", "LAST ERROR"])
        return 0

    return run(args, body)
