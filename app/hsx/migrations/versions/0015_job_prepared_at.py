"""When a job's conversations were prepared: jobs.prepared_at

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-08
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # NULL for every existing job: when a job prepared before this column ended its preparation was not
    # recorded, and no other column tells it.
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("prepared_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("prepared_at")
