"""Fixtures for every tier: databases (a SQLite file and the machine's real Postgres) and a tiny checkpoint."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import psycopg
import pytest

# The helpers in tests/support assert too; pytest explains a failing assert only in modules it is
# told about before they are imported.
pytest.register_assert_rewrite("tests.support")

# The SGLang plugin is its own distribution (deploy/sglang), not installed with hsx: its tests import
# it from its source folder.
PLUGIN_SOURCE = Path(__file__).resolve().parents[1] / "deploy" / "sglang"
if str(PLUGIN_SOURCE) not in sys.path:
    sys.path.insert(0, str(PLUGIN_SOURCE))

from hsx.db.engine import make_engine, session_factory, upgrade  # noqa: E402
from tests.support.sglang.wheels import SUPPORTED_SGLANG, sglang_wheel  # noqa: E402

# What a plain `pytest` leaves out (the fast loop); `pytest --all` runs them too, and so does CI.
OUTER_TIERS = ("acceptance", "postgres", "slow")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--all",
        action="store_true",
        help="run every tier: also the tests marked acceptance, postgres or slow, which a plain `pytest` leaves out",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "acceptance" in Path(str(item.fspath)).parts:
            item.add_marker(pytest.mark.acceptance)
    if config.getoption("--all") or config.option.markexpr:
        return  # everything, or what the -m expression picks
    kept = [i for i in items if not any(i.get_closest_marker(t) for t in OUTER_TIERS)]
    if len(kept) < len(items):
        config.hook.pytest_deselected(items=[i for i in items if i not in kept])
        items[:] = kept


PG_ADMIN = os.environ.get("HSX_TEST_PG_ADMIN", "postgresql://postgres@127.0.0.1:5432/test")


def _pg_available() -> bool:
    try:
        with psycopg.connect(PG_ADMIN, connect_timeout=3):
            return True
    except psycopg.Error:
        return False


@pytest.fixture(scope="session")
def postgres_server():
    if not _pg_available():
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is not reachable at {PG_ADMIN}")
        pytest.skip(f"PostgreSQL is not reachable at {PG_ADMIN}")
    return PG_ADMIN


def _fresh_database(admin_url: str):
    name = f"hsx_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    host_part = admin_url.rsplit("/", 1)[0]
    yield f"{host_part}/{name}".replace("postgresql://", "postgresql+psycopg://", 1)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def postgres_url(postgres_server):
    """A fresh, empty database on the real server for one test, dropped afterwards."""
    yield from _fresh_database(postgres_server)


@pytest.fixture(scope="module")
def postgres_module_url(postgres_server):
    """A fresh database shared by one test module."""
    yield from _fresh_database(postgres_server)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'hsx.db'}"
    return request.getfixturevalue("postgres_url")


@pytest.fixture
def sessions(database_url):
    """Sessions on a fresh, migrated database of each kind."""
    engine = make_engine(database_url)
    upgrade(engine)
    yield session_factory(engine)
    engine.dispose()


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    from tests.support.stack import make_checkpoint  # torch and transformers: only for the tests that use it

    return make_checkpoint(tmp_path_factory.mktemp("checkpoint"))


@pytest.fixture(scope="session")
def recompute(checkpoint):
    from tests.support.stack import Recompute

    return Recompute(checkpoint)


@pytest.fixture(scope="session")
def supported_wheel() -> Path:
    """The wheel of the SGLang release the plugin supports (downloaded once, then cached)."""
    return sglang_wheel(SUPPORTED_SGLANG)
