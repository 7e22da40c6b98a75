"""job_throughput: what each job extracted per time bucket (the dashboard's plot, GET .../throughput);
writers.tokens_per_s: each writer's recent rate, reported with its heartbeat

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
    op.create_table(
        "job_throughput",
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("bucket_start", sa.BigInteger(), nullable=False),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("tokens", sa.BigInteger(), nullable=False),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("job_id", "bucket_start"),
    )
    with op.batch_alter_table("writers", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tokens_per_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("writers", schema=None) as batch_op:
        batch_op.drop_column("tokens_per_s")
    op.drop_table("job_throughput")
