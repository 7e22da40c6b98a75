"""Encodings of stored hidden states: shards.layer_stats

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # NULL is what every existing shard is: raw.
    with op.batch_alter_table("shards") as batch:
        batch.add_column(sa.Column("layer_stats", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.drop_column("layer_stats")
