"""The commit feed and its consumers: shards.seq and shards.deleted_at, jobs.shards_committed,
jobs.max_unread_bytes and jobs.unread_bytes, job_consumers and job_consumer_acks, and the index that
finds a shard's samples

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("shards") as batch:
        batch.add_column(sa.Column("seq", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True))
    # Shards recorded before the feed existed are numbered in the order they were recorded.
    op.execute(
        "UPDATE shards SET seq = (SELECT count(*) FROM shards earlier "
        "WHERE earlier.job_id = shards.job_id AND earlier.pk <= shards.pk)"
    )
    with op.batch_alter_table("shards") as batch:
        batch.alter_column("seq", existing_type=sa.Integer(), nullable=False)
        batch.create_unique_constraint("uq_shards_job_seq", ["job_id", "seq"])
    op.add_column("jobs", sa.Column("shards_committed", sa.Integer(), nullable=False, server_default="0"))
    op.add_column("jobs", sa.Column("max_unread_bytes", sa.BigInteger(), nullable=True))
    op.add_column("jobs", sa.Column("unread_bytes", sa.BigInteger(), nullable=False, server_default="0"))
    op.execute("UPDATE jobs SET shards_committed = (SELECT count(*) FROM shards s WHERE s.job_id = jobs.id)")
    op.create_index("ix_samples_job_shard", "samples", ["job_id", "shard"])
    op.create_table(
        "job_consumers",
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "name"),
    )
    op.create_table(
        "job_consumer_acks",
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("consumer", sa.String(length=200), nullable=False),
        sa.Column("rank", sa.Integer(), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("epochs", sa.Integer(), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("acked_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id", "consumer"], ["job_consumers.job_id", "job_consumers.name"], ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("job_id", "consumer", "rank"),
    )


def downgrade() -> None:
    op.drop_table("job_consumer_acks")
    op.drop_table("job_consumers")
    op.drop_index("ix_samples_job_shard", table_name="samples")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("unread_bytes")
        batch.drop_column("max_unread_bytes")
        batch.drop_column("shards_committed")
    with op.batch_alter_table("shards") as batch:
        batch.drop_constraint("uq_shards_job_seq", type_="unique")
        batch.drop_column("deleted_at")
        batch.drop_column("seq")
