"""`hsx workers`: the writers on the service's database, with their model servers, state and lease."""

from __future__ import annotations

import argparse

from hsx.cli.client.common import ENV_NOTE, add_common, print_json, run, table, when

NAME = "workers"
HELP = "list the writers (workers) and their model servers, state and lease"
DESCRIPTION = f"""List every writer that registered with the service's database (`hsx worker`, or `hsx serve`
with its writer): identity, state, model server, layers, last heartbeat, tokens per second, and why
it is not ready. A worker whose lease expired shows state lost: its samples went back to the queue.
--json prints a JSON array.
{ENV_NOTE}

examples:
  hsx workers
  hsx workers --json
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_common(parser)


def main(args: argparse.Namespace) -> int:
    def body(hsx) -> int:
        workers = hsx.workers()
        if args.json:
            print_json(workers)
            return 0
        rows = [
            [
                w.identity,
                w.state,
                w.backend_url or "",
                ",".join(map(str, w.layers or [])),
                when(w.heartbeat_at),
                f"{w.tokens_per_s or 0:.0f}",
                w.reason or "",
            ]
            for w in workers
        ]
        table(rows, ["WORKER", "STATE", "SERVER", "LAYERS", "HEARTBEAT", "TOK/S", "REASON"])
        return 0

    return run(args, body)
