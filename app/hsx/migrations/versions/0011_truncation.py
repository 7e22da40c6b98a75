"""Truncation recorded: samples.truncated_from, jobs.n_truncated

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        # Samples stored before this revision were not recorded as cut: zero is what is known of them.
        batch.add_column(sa.Column("n_truncated", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("samples") as batch:
        batch.add_column(sa.Column("truncated_from", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("truncated_from")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("n_truncated")
