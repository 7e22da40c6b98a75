"""Engine and session factory for SQLite (embedded default) or Postgres, and schema migration."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

import hsx.migrations

READONLY = "hsx_readonly"
MIGRATIONS_DIR = Path(hsx.migrations.__file__).resolve().parent


# An engine keeps up to POOL_SIZE connections open and opens up to MAX_OVERFLOW more while they are all in
# use, on both databases: CONNECTIONS at once in all. The API counts its requests' use against it
# (hsx.api.admission), so that none waits on the pool.
POOL_SIZE = 10
MAX_OVERFLOW = 10
CONNECTIONS = POOL_SIZE + MAX_OVERFLOW


def make_engine(url: str, *, connections: int = CONNECTIONS, idle_in_transaction_s: float | None = None) -> Engine:
    """An engine of at most `connections` connections (the first POOL_SIZE of them kept open).
    `idle_in_transaction_s` (Postgres): the server ends a session that sits inside a transaction
    for longer, releasing its row locks. A writer sets it below its lease: a writer process that is
    paused or cut off in the middle of a transaction must not hold up the others' claims and
    heartbeats until its connection dies."""
    parsed = make_url(url)
    pool = {"pool_size": min(connections, POOL_SIZE), "max_overflow": max(0, connections - POOL_SIZE)}
    if parsed.get_backend_name() != "sqlite":
        if parsed.drivername == "postgresql":
            parsed = parsed.set(drivername="postgresql+psycopg")
        connect_args = {}
        if idle_in_transaction_s is not None:
            ms = max(1, int(idle_in_transaction_s * 1000))
            connect_args["options"] = f"-c idle_in_transaction_session_timeout={ms}"
        return create_engine(parsed, pool_pre_ping=True, connect_args=connect_args, **pool)

    memory = parsed.database in (None, "", ":memory:")
    if parsed.database and not memory:
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)
    # SQLAlchemy keeps an in-memory database in one connection per thread, a pool that takes no sizes.
    engine = create_engine(parsed, connect_args={"check_same_thread": False, "timeout": 60}, **({} if memory else pool))

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
        # Take transaction control from pysqlite so that BEGIN IMMEDIATE below is what runs:
        # a deferred transaction that reads then writes can fail with "database is locked"
        # instead of waiting when another process wrote in between.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        # In WAL mode NORMAL loses no commit when the process dies, only (at worst) the last ones on
        # power loss, and those are safe to lose: an unrecorded shard is an orphan file that is
        # removed, its samples run again. FULL would put an fsync on every commit of every sample.
        cur.execute("PRAGMA synchronous=NORMAL")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute("PRAGMA busy_timeout=60000")
        cur.close()

    @event.listens_for(engine, "begin")
    def _sqlite_begin(conn: Connection) -> None:
        # Readers take no write lock, so a long read never holds up the writer.
        conn.exec_driver_sql("BEGIN" if conn.get_execution_options().get(READONLY) else "BEGIN IMMEDIATE")

    return engine


def session_factory(engine: Engine, *, readonly: bool = False) -> sessionmaker[Session]:
    bind = engine.execution_options(**{READONLY: True}) if readonly else engine
    return sessionmaker(bind, expire_on_commit=False)


def alembic_config(engine: Engine) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.attributes["engine"] = engine
    return cfg


# Any 64-bit number no other program uses on the same database: "hsx" in ASCII.
MIGRATION_LOCK = 0x687378


def upgrade(engine: Engine) -> None:
    """Bring the database to the newest schema (`alembic upgrade head`). On Postgres the API and
    every worker may start at once on an empty database: an advisory lock runs one upgrade at a
    time, and the others then find the schema current."""
    if engine.dialect.name != "postgresql":
        command.upgrade(alembic_config(engine), "head")
        return
    with engine.connect() as conn:
        conn.exec_driver_sql(f"SELECT pg_advisory_lock({MIGRATION_LOCK})")
        try:
            command.upgrade(alembic_config(engine), "head")
        finally:
            conn.exec_driver_sql(f"SELECT pg_advisory_unlock({MIGRATION_LOCK})")
            conn.commit()
