"""Soak run: thousands of samples with faults of every kind injected at random.

    python -m benchmarks.soak            # short run (what CI runs through tests/acceptance/test_soak.py)
    python -m benchmarks.soak --long     # 5,000 samples
    python -m benchmarks.soak --samples 2000 --database-url postgresql://postgres@127.0.0.1/test

A synthetic reference server (no model compute; content a pure function of the token ids) runs
with fault injection on; the service extracts one job while a chaos loop, at random, makes the
server write foreign dumps, late or missing `done` markers and every kind of bad dump, answer 503,
stall, crash (then it is restarted: counter back to 0, new boot id), and SIGKILLs the service
(then it is restarted). At the end every stored sample is checked against an independent
recomputation of its hidden states, and a table per fault kind is printed with samples stored,
failed, stored-but-wrong, stored twice and lost; the last three must be 0.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from tests.support.soak import Soak, print_report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--long", action="store_true", help="5,000 samples instead of 300")
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--database-url", default=None, help="default: a SQLite file in the work folder")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--deadline-s", type=float, default=None)
    args = parser.parse_args(argv)
    n = args.samples or (5000 if args.long else 300)
    with tempfile.TemporaryDirectory(prefix="hsx-soak-") as tmp:
        work = Path(tmp)
        url = args.database_url or f"sqlite:///{work / 'soak.db'}"
        report = Soak(work, url, args.seed).run(n, args.deadline_s or max(300.0, n * 0.5))
    print_report(report)
    bad = report["stored_but_wrong"] + report["stored_twice"] + report["lost"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
