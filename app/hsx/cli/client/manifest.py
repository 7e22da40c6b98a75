"""`hsx manifest`: print or save a job's manifest."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from hsx.cli.client.common import ENV_NOTE, add_common, print_json, run

if TYPE_CHECKING:
    from hsx.sdk import HsxClient

NAME = "manifest"
HELP = "print a job's manifest (model, layers, shards with sha256, sample placement) or save it with -o"
DESCRIPTION = f"""Print a job's manifest as JSON: model, captured layers, hidden size, dtype, every shard with
its size and sha256, and where each stored sample lies (shard, offset, num_tokens). With -o it is written
to FILE (whole or not at all) and a summary is printed (--json: {{"path", "job_id", "state", "shards",
"samples"}}).
{ENV_NOTE}

examples:
  hsx manifest job_0123abcd > manifest.json
  hsx manifest job_0123abcd -o out/run1/manifest.json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id")
    parser.add_argument("-o", "--output", metavar="FILE", help="write the manifest to FILE")
    add_common(parser)


def main(args: argparse.Namespace) -> int:
    from hsx.storage.atomic import write_json_atomic

    def body(hsx: HsxClient) -> int:
        manifest = hsx.manifest(args.job)
        doc = manifest.model_dump(mode="json")
        if args.output is None:
            print(json.dumps(doc) if args.json else json.dumps(doc, indent=1))
            return 0
        path = Path(args.output)
        write_json_atomic(path, doc)
        summary = {
            "path": str(path),
            "job_id": manifest.job_id,
            "state": manifest.state,
            "shards": len(manifest.shards),
            "samples": len(manifest.samples),
        }
        if args.json:
            print_json(summary)
        else:
            print(
                f"wrote {path}: job {manifest.job_id} {manifest.state}, {len(manifest.shards)} shard(s), "
                f"{len(manifest.samples)} stored sample(s)"
            )
        return 0

    return run(args, body)
