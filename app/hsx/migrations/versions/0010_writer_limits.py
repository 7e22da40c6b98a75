"""What each writer's model server accepts: writers.vocab_size, writers.max_prompt_tokens, so that an API
without a writer in its process checks submitted samples against them

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Unknown until each writer's next heartbeat after its server is found ready.
    with op.batch_alter_table("writers") as batch:
        batch.add_column(sa.Column("vocab_size", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("max_prompt_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("writers") as batch:
        batch.drop_column("max_prompt_tokens")
        batch.drop_column("vocab_size")
