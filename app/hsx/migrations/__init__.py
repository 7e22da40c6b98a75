"""Alembic migration scripts, shipped inside the package as hsx.migrations."""
