"""drop ix_samples_claim: a claim picks its job first, then the job's oldest queued sample
through ix_samples_job_state_idx, so a state-first index only slows every insert

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-30
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_samples_claim", table_name="samples")


def downgrade() -> None:
    op.create_index("ix_samples_claim", "samples", ["state", "job_id", "idx"], unique=False)
