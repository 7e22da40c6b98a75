"""jobs.layers_key, jobs.model_key: a job runs only on workers whose layers and model match it

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("layers_key", sa.String(length=2000), nullable=True))
        batch.add_column(sa.Column("model_key", sa.String(length=32), nullable=True))
    # Jobs still to run get their keys from what they recorded. Their model key is left unset: the
    # model as recorded mixes the server's description with the dump's own fields, so no key made
    # from it could equal a worker's; such a job keeps the old rule (any worker of its layers).
    jobs = sa.table(
        "jobs",
        sa.column("id", sa.String),
        sa.column("state", sa.String),
        sa.column("layers", sa.JSON),
        sa.column("model_info", sa.JSON),
        sa.column("layers_key", sa.String),
    )
    conn = op.get_bind()
    active = conn.execute(
        sa.select(jobs.c.id, jobs.c.layers, jobs.c.model_info).where(
            jobs.c.state.in_(("queued", "running", "cancelling"))
        )
    ).all()
    for job_id, layers, info in active:
        chosen = layers if layers is not None else (info or {}).get("layers")
        if chosen is not None:
            key = ",".join(str(int(i)) for i in chosen)
            conn.execute(sa.update(jobs).where(jobs.c.id == job_id).values(layers_key=key))


def downgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("model_key")
        batch.drop_column("layers_key")
