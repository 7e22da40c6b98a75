"""Alembic environment: run against the engine the app hands over, or HSX_DATABASE_URL."""

from __future__ import annotations

from alembic import context

from hsx.db.engine import make_engine
from hsx.db.models import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    engine = config.attributes.get("engine")
    if engine is None:
        from hsx.config import Settings

        engine = make_engine(config.get_main_option("sqlalchemy.url") or Settings().database_url)
    with engine.connect() as connection:
        context.configure(
            connection=connection, target_metadata=target_metadata, render_as_batch=connection.dialect.name == "sqlite"
        )
        with context.begin_transaction():
            context.run_migrations()


run_migrations_online()
