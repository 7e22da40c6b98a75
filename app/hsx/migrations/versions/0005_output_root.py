"""output_root: the one output root the services sharing a database write to

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "output_root",
        sa.Column("pk", sa.Integer(), autoincrement=False, nullable=False),
        sa.Column("root_id", sa.String(length=64), nullable=False),
        sa.Column("location", sa.Text(), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("pk"),
    )


def downgrade() -> None:
    op.drop_table("output_root")
