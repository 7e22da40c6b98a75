"""Shards: numbering the next one, and recording one written with its samples succeeded."""

from __future__ import annotations

from typing import Any

from sqlalchemy import insert, update
from sqlalchemy.orm import Session

from hsx.db.models import JobRow, ShardRow
from hsx.db.repository._base import PKS_PER_QUERY, utcnow
from hsx.db.repository.feed import next_seq
from hsx.db.repository.transitions import transition
from hsx.states import SampleState


def reserve_shard_number(session: Session, job_id: str) -> int:
    return (
        session.execute(
            update(JobRow)
            .where(JobRow.id == job_id)
            .values(shards_written=JobRow.shards_written + 1)
            .returning(JobRow.shards_written)
        ).scalar_one()
        - 1
    )


def commit_shard(
    session: Session,
    job_id: str,
    *,
    name: str,
    nbytes: int,
    sha256: str,
    placed: list[tuple[int, int, int]],
    layer_stats: dict[str, Any] | None = None,
) -> None:
    """Record a written shard, the job's next in its commit feed, and mark its samples succeeded. `placed`:
    (pk, offset, tokens); `layer_stats`: what an encoded shard stored per layer (ShardRow.layer_stats)."""
    seq = next_seq(session, job_id, nbytes)
    session.execute(
        insert(ShardRow).values(
            job_id=job_id,
            seq=seq,
            name=name,
            bytes=nbytes,
            sha256=sha256,
            num_samples=len(placed),
            num_tokens=sum(t for _, _, t in placed),
            created_at=utcnow(),
            layer_stats=layer_stats,
        )
    )
    # In parts, each within any database's limit on parameters (three a sample: pk twice, offset).
    for start in range(0, len(placed), PKS_PER_QUERY // 2):
        part = placed[start : start + PKS_PER_QUERY // 2]
        moved = transition(
            session,
            job_id,
            [pk for pk, _, _ in part],
            SampleState.STAGED,
            SampleState.SUCCEEDED,
            {"shard": name, "staged_path": None},
            per_sample={"shard_offset": {pk: offset for pk, offset, _ in part}},
        )
        if moved != len(part):
            raise RuntimeError(f"job {job_id}: {len(part) - moved} samples left the staged state during {name}")
