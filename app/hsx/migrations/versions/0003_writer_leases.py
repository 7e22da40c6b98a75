"""writers hold leases: a fencing token (epoch) and an expiry, renewed by heartbeats

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("writers") as batch:
        batch.add_column(sa.Column("epoch", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("stats", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("writers") as batch:
        batch.drop_column("stats")
        batch.drop_column("lease_expires_at")
        batch.drop_column("epoch")
