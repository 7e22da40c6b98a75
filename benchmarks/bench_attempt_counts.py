"""What a job's attempt counters cost and save: one job of many samples with many ended attempts.

    python -m benchmarks.bench_attempt_counts                         # 200,000 samples, 2 attempts each, SQLite
    python -m benchmarks.bench_attempt_counts --database-url postgresql://postgres@127.0.0.1/test

Builds the job and its attempt rows in bulk (a third of them retries, spread over six reason codes),
counts them once as migration 0008 does, then times, p50 of repeated runs: reading the job as
GET /v1/jobs/{id} does (the job row, its counters, why it waits), the database's part of GET /metrics,
the GROUP BY over the job's attempts that the counters replace, and what counting adds to each attempt
that ends (one counter upsert, in the attempt's own transaction). Prints the figures. The database given
is used as it is: pass an empty one.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from sqlalchemy import func, insert, select, text
from sqlalchemy.orm import Session, sessionmaker

import hsx.migrations
from hsx.db import repository as repo
from hsx.db.engine import make_engine, session_factory, upgrade
from hsx.db.models import AttemptRow, SampleRow
from hsx.db.repository.attempts import _count_attempt
from hsx.service import queries
from hsx.service.status import state_metrics

# Migration 0008's count of stored attempts (its module's name starts with a digit: loaded from its file).
_spec = importlib.util.spec_from_file_location(
    "migration_0008", Path(hsx.migrations.__file__).parent / "versions" / "0008_attempt_counts.py"
)
assert _spec is not None and _spec.loader is not None
MIGRATION_0008 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(MIGRATION_0008)

CODES = ["no_dump", "wrong_shape", "missing_layer", "incomplete", "non_finite", "bad_meta"]


def p50_ms(run: Callable[[], object], times: int) -> float:
    took = []
    for _ in range(times):
        started = time.perf_counter()
        run()
        took.append(time.perf_counter() - started)
    return statistics.median(took) * 1000


def build(sessions: sessionmaker[Session], samples: int, per_sample: int) -> tuple[str, int, float]:
    """The job, its attempts (bulk), and its counters from them: (job id, attempts, seconds to count)."""
    rng = random.Random(3)
    ids = np.arange(1, 17, dtype="<i4").tobytes()
    with sessions.begin() as s:
        builder = repo.JobBuilder(s, name="bench", layers=None)
        for start in range(0, samples, 50_000):
            builder.add([repo.NewSample(f"s{i}", ids, None, 16) for i in range(start, min(samples, start + 50_000))])
        job_id = builder.finish().id
    with sessions.begin() as s:
        pks = list(s.execute(select(SampleRow.pk).where(SampleRow.job_id == job_id)).scalars())
        rows = []
        for pk in pks:
            for number in range(1, per_sample + 1):
                retry = rng.random() < 1 / 3
                reason = f"{rng.choice(CODES)}: details of the attempt" if retry else None
                outcome = "retry" if retry else "ok"
                rows.append({"sample_pk": pk, "number": number, "writer": "w", "outcome": outcome, "reason": reason})
            if len(rows) >= 50_000:
                s.execute(insert(AttemptRow).values(started_at=func.now()), rows)
                rows = []
        if rows:
            s.execute(insert(AttemptRow).values(started_at=func.now()), rows)
    started = time.perf_counter()
    with sessions.begin() as s:
        s.execute(text(MIGRATION_0008.counts_sql(s.get_bind().dialect.name)))
    return job_id, len(pks) * per_sample, time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--attempts-per-sample", type=int, default=2)
    parser.add_argument("--database-url", default=None, help="an empty database; default: a SQLite file")
    parser.add_argument("--repeat", type=int, default=200, help="runs of each timed read")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="hsx-bench-") as tmp:
        url = args.database_url or f"sqlite:///{Path(tmp) / 'hsx.db'}"
        engine = make_engine(url)
        upgrade(engine)
        sessions = session_factory(engine)
        job_id, attempts, counted_s = build(sessions, args.samples, args.attempts_per_sample)
        with sessions() as s:
            view = p50_ms(lambda: queries.job_view(session=s, job_id=job_id), args.repeat)
            metrics = p50_ms(lambda: state_metrics(session=s), args.repeat)
            grouped = select(AttemptRow.outcome, AttemptRow.reason, func.count()).join(
                SampleRow, SampleRow.pk == AttemptRow.sample_pk
            )
            grouped = grouped.where(SampleRow.job_id == job_id).group_by(AttemptRow.outcome, AttemptRow.reason)
            group_by = p50_ms(lambda: s.execute(grouped).all(), max(3, args.repeat // 20))
            retried = queries.job_view(session=s, job_id=job_id).attempts.retried

        # The upsert runs inside the transaction that ends the attempt: what it adds is one statement.
        def statements(run: Callable[[Session], object], n: int = 5000) -> float:
            with sessions.begin() as s:
                started = time.perf_counter()
                for _ in range(n):
                    run(s)
                return (time.perf_counter() - started) / n * 1000

        upsert = statements(lambda s: _count_attempt(s, job_id, "retry", "no_dump: again"))
        engine.dispose()
    print(f"{args.samples:,} samples, {attempts:,} ended attempts ({retried:,} retried) on {url.split(':')[0]}")
    print(f"  counting them once (migration 0008):   {counted_s:.2f} s")
    print(f"  GET /v1/jobs/{{id}}'s reads:            {view:.2f} ms p50 (counters)")
    print(f"  GET /metrics' database reads:          {metrics:.2f} ms p50")
    print(f"  GROUP BY over the job's attempts:      {group_by:.1f} ms p50 (what the counters replace)")
    print(f"  counting one ended attempt:            {upsert:.3f} ms (its upsert, mean of 5,000)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
