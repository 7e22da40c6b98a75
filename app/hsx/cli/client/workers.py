"""`hsx workers`: the writers on the service's database, with their model servers, state and lease."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from hsx.cli.client.common import ENV_NOTE, add_common, print_json, run, table, when

if TYPE_CHECKING:
    from hsx.sdk import HsxClient

NAME = "workers"
HELP = "list the writers (workers) and their model servers, state and lease"
DESCRIPTION = f"""List every writer that registered with the service's database (`hsx worker`, or `hsx serve`
with its writer): identity, state, model server, model (the path its server reports, then the first
characters of its model key: a job goes only to workers of one model key), layers, last heartbeat,
tokens per second, and why it is not ready. A worker whose lease expired shows state lost: its
samples went back to the queue.
--json prints a JSON array.
{ENV_NOTE}

examples:
  hsx workers
  hsx workers --json
"""


KEY_CHARS = 12  # of a model key, in the table: enough to tell the models of one service apart


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser)


def main(args: argparse.Namespace) -> int:
    def body(hsx: HsxClient) -> int:
        workers = hsx.workers()
        if args.json:
            print_json(workers)
            return 0
        rows = [
            [
                w.identity,
                w.state,
                w.backend_url or "",
                model_cell(w.model_path, w.model_key),
                ",".join(map(str, w.layers or [])),
                when(w.heartbeat_at),
                f"{w.tokens_per_s or 0:.0f}",
                w.reason or "",
            ]
            for w in workers
        ]
        table(rows, ["WORKER", "STATE", "SERVER", "MODEL", "LAYERS", "HEARTBEAT", "TOK/S", "REASON"])
        return 0

    return run(args, body)


def model_cell(path: str | None, key: str | None) -> str:
    """The model's path and the start of its key: two workers of one path may still serve
    different models (another shape or revision), and the key is what jobs are matched on."""
    short = f"({key[:KEY_CHARS]})" if key else ""
    return " ".join(filter(None, [path, short]))
