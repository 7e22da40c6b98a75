"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=True),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("cancel_requested_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("idempotency_key", sa.String(length=255), nullable=True),
        sa.Column("request_sha256", sa.String(length=64), nullable=True),
        sa.Column("model_info", sa.JSON(), nullable=True),
        sa.Column("layers", sa.JSON(), nullable=True),
        sa.Column("estimated_bytes", sa.BigInteger(), nullable=True),
        sa.Column("disk_warning", sa.Text(), nullable=True),
        sa.Column("num_samples", sa.Integer(), nullable=False),
        sa.Column("tokens_total", sa.BigInteger(), nullable=False),
        sa.Column("tokens_done", sa.BigInteger(), nullable=False),
        sa.Column("tokens_staged", sa.BigInteger(), nullable=False),
        sa.Column("n_queued", sa.Integer(), nullable=False),
        sa.Column("n_running", sa.Integer(), nullable=False),
        sa.Column("n_staged", sa.Integer(), nullable=False),
        sa.Column("n_succeeded", sa.Integer(), nullable=False),
        sa.Column("n_failed", sa.Integer(), nullable=False),
        sa.Column("n_cancelled", sa.Integer(), nullable=False),
        sa.Column("shards_written", sa.Integer(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("idempotency_key"),
    )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.create_index("ix_jobs_state", ["state"], unique=False)

    op.create_table(
        "samples",
        sa.Column("pk", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("sample_id", sa.String(length=200), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("input_ids", sa.LargeBinary(), nullable=False),
        sa.Column("loss_mask", sa.LargeBinary(), nullable=True),
        sa.Column("num_tokens", sa.Integer(), nullable=False),
        sa.Column("observed_tokens", sa.Integer(), nullable=True),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("tries", sa.Integer(), nullable=False),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("writer", sa.String(length=500), nullable=True),
        sa.Column("staged_path", sa.Text(), nullable=True),
        sa.Column("shard", sa.String(length=200), nullable=True),
        sa.Column("shard_offset", sa.BigInteger(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("pk"),
        sa.UniqueConstraint("job_id", "idx", name="uq_samples_job_idx"),
        sa.UniqueConstraint("job_id", "sample_id", name="uq_samples_job_sample"),
    )
    with op.batch_alter_table("samples", schema=None) as batch_op:
        batch_op.create_index("ix_samples_claim", ["state", "job_id", "idx"], unique=False)
        batch_op.create_index("ix_samples_job_state_idx", ["job_id", "state", "idx"], unique=False)
        batch_op.create_index("ix_samples_writer_state", ["writer", "state"], unique=False)
        batch_op.create_index(
            "ux_samples_one_running_per_writer",
            ["writer"],
            unique=True,
            sqlite_where=sa.text("state = 'running'"),
            postgresql_where=sa.text("state = 'running'"),
        )

    op.create_table(
        "shards",
        sa.Column("pk", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(length=64), nullable=False),
        sa.Column("num_samples", sa.Integer(), nullable=False),
        sa.Column("num_tokens", sa.BigInteger(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("pk"),
        sa.UniqueConstraint("job_id", "name", name="uq_shards_job_name"),
    )
    op.create_table(
        "writers",
        sa.Column("identity", sa.String(length=500), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("server", sa.JSON(), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("identity"),
    )
    op.create_table(
        "attempts",
        sa.Column("pk", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("sample_pk", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("writer", sa.String(length=500), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("outcome", sa.String(length=16), nullable=True),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("dump_key", sa.String(length=300), nullable=True),
        sa.Column("observed_tokens", sa.Integer(), nullable=True),
        sa.Column("boot_id", sa.String(length=100), nullable=True),
        sa.ForeignKeyConstraint(["sample_pk"], ["samples.pk"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("pk"),
        sa.UniqueConstraint("sample_pk", "number", name="uq_attempts_sample_number"),
    )


def downgrade() -> None:
    op.drop_table("attempts")
    op.drop_table("writers")
    op.drop_table("shards")
    with op.batch_alter_table("samples", schema=None) as batch_op:
        batch_op.drop_index(
            "ux_samples_one_running_per_writer",
            sqlite_where=sa.text("state = 'running'"),
            postgresql_where=sa.text("state = 'running'"),
        )
        batch_op.drop_index("ix_samples_writer_state")
        batch_op.drop_index("ix_samples_job_state_idx")
        batch_op.drop_index("ix_samples_claim")

    op.drop_table("samples")
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index("ix_jobs_state")

    op.drop_table("jobs")
