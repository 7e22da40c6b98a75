"""samples.identity, attempts.identity: what proved that a stored dump is its sample's (hsx.identity)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Samples stored before this revision keep NULL: what proved them was not recorded, and their
    # job's manifest says so (identity null) rather than claiming a proof.
    for table in ("samples", "attempts"):
        with op.batch_alter_table(table) as batch:
            batch.add_column(sa.Column("identity", sa.String(length=16), nullable=True))


def downgrade() -> None:
    for table in ("attempts", "samples"):
        with op.batch_alter_table(table) as batch:
            batch.drop_column("identity")
