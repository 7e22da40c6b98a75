"""Conversation samples and job policies: jobs.options, jobs.n_preparing, jobs.n_skipped,
samples.conversation

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("options", sa.JSON(), nullable=True))
        # Existing jobs have no sample in either state: zero is their true count.
        batch.add_column(sa.Column("n_preparing", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("n_skipped", sa.Integer(), nullable=False, server_default="0"))
    with op.batch_alter_table("samples") as batch:
        batch.add_column(sa.Column("conversation", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("samples") as batch:
        batch.drop_column("conversation")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("n_skipped")
        batch.drop_column("n_preparing")
        batch.drop_column("options")
