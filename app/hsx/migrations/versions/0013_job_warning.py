"""A job's warning: jobs.warning

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # NULL is what every existing job is: nothing it asked for went without.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("warning", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("warning")
