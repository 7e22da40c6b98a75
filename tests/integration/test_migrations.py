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
