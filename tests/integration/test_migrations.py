"""The schema `alembic upgrade head` makes is exactly the models' schema, on SQLite and Postgres."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from hsx.db.engine import make_engine, upgrade
from hsx.db.models import Base


def test_migrated_schema_equals_models(database_url):
    engine = make_engine(database_url)
    try:
        upgrade(engine)
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
            assert diff == [], diff
            tables = set(inspect(conn).get_table_names())
            indexes = {ix["name"] for ix in inspect(conn).get_indexes("samples")}
        assert {"jobs", "samples", "attempts", "shards", "output_root", "alembic_version"} <= tables
        assert "ux_samples_one_running_per_writer" in indexes
        upgrade(engine)  # a second upgrade is a no-op, as at every service start
    finally:
        engine.dispose()


def test_alembic_command_line_upgrades_a_fresh_database(tmp_path):
    db = tmp_path / "cli.db"
    env = {"HSX_DATABASE_URL": f"sqlite:///{db}", "PATH": ""}
    result = subprocess.run(
        [sys.executable, "-m", "alembic", "upgrade", "head"],
        cwd=str(_repo_root()),
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    engine = make_engine(f"sqlite:///{db}")
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    engine.dispose()


def _repo_root():
    return Path(__file__).resolve().parents[2]


def test_processes_starting_together_on_an_empty_postgres_upgrade_it_once(postgres_url):
    """The API and every worker migrate at start; on an empty database they must not collide."""
    engines = [make_engine(postgres_url) for _ in range(4)]
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(engines))

    def start(engine) -> None:
        barrier.wait()
        try:
            upgrade(engine)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with engines[0].connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []
    for e in engines:
        e.dispose()


def test_shards_recorded_before_the_feed_are_numbered_in_the_order_recorded(database_url):
    """Migration 0014 gives every existing shard its feed number (by the order recorded, per job) and every
    job its count of them."""
    from alembic import command
    from sqlalchemy import text

    from hsx.db.engine import alembic_config

    engine = make_engine(database_url)
    try:
        command.upgrade(alembic_config(engine), "0013")
        now = "2026-12-01 00:00:00+00:00"
        with engine.begin() as conn:
            for job in ("job_a", "job_b"):
                conn.execute(
                    text(
                        "INSERT INTO jobs (id, state, created_at, num_samples, tokens_total, tokens_done, "
                        "tokens_staged, n_queued, n_running, n_staged, n_succeeded, n_failed, n_cancelled, "
                        "shards_written) VALUES (:id, 'succeeded', :now, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 3)"
                    ),
                    {"id": job, "now": now},
                )
            # recorded out of name order, and interleaved between the jobs
            for job, name in [("job_a", "s2"), ("job_b", "s0"), ("job_a", "s0"), ("job_a", "s1"), ("job_b", "s1")]:
                conn.execute(
                    text(
                        "INSERT INTO shards (job_id, name, bytes, sha256, num_samples, num_tokens, created_at) "
                        "VALUES (:job, :name, 10, 'x', 1, 1, :now)"
                    ),
                    {"job": job, "name": name, "now": now},
                )
        upgrade(engine)
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT job_id, name, seq FROM shards ORDER BY job_id, seq")).all()
            counts = dict(conn.execute(text("SELECT id, shards_committed FROM jobs")).all())
        assert [tuple(r) for r in rows] == [
            ("job_a", "s2", 1),
            ("job_a", "s0", 2),
            ("job_a", "s1", 3),
            ("job_b", "s0", 1),
            ("job_b", "s1", 2),
        ]
        assert counts == {"job_a": 3, "job_b": 2}
    finally:
        engine.dispose()
