"""job_attempt_counts and jobs.n_requeued: each job's attempts by outcome and reason code, and its queued
samples that were tried before, kept as counters so that reading a job never groups its attempts

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

# The reason's code: what precedes its first ':' (the whole reason when it has none), at most 100
# characters, "" for none; as hsx.db.repository.attempts.reason_code cuts it.
REASON_CODE = {
    "sqlite": "substr(CASE WHEN instr(coalesce(a.reason, ''), ':') > 0 "
    "THEN substr(a.reason, 1, instr(a.reason, ':') - 1) ELSE coalesce(a.reason, '') END, 1, 100)",
    "postgresql": "left(split_part(coalesce(a.reason, ''), ':', 1), 100)",
}


def upgrade() -> None:
    op.create_table(
        "job_attempt_counts",
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.String(length=100), nullable=False),
        sa.Column("n", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "outcome", "reason"),
    )
    # A plain ADD COLUMN on both databases: no copy of the jobs table.
    op.add_column("jobs", sa.Column("n_requeued", sa.Integer(), nullable=False, server_default="0"))
    # Jobs stored before this revision get their counts from the rows, once.
    op.execute(counts_sql(op.get_bind().dialect.name))
    op.execute(
        "UPDATE jobs SET n_requeued = (SELECT count(*) FROM samples s WHERE s.job_id = jobs.id "
        "AND s.state = 'queued' AND s.tries > 0) WHERE jobs.n_queued > 0"
    )


def counts_sql(dialect: str) -> str:
    """Every job's ended attempts counted by outcome and reason code, from the attempts table."""
    code = REASON_CODE[dialect]
    return (
        "INSERT INTO job_attempt_counts (job_id, outcome, reason, n) "
        f"SELECT s.job_id, a.outcome, {code}, count(*) FROM attempts a JOIN samples s ON s.pk = a.sample_pk "
        f"WHERE a.outcome IS NOT NULL GROUP BY s.job_id, a.outcome, {code}"
    )


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("n_requeued")
    op.drop_table("job_attempt_counts")
