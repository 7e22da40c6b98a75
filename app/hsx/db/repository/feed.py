"""A job's commit feed and its consumers: shards in the order they were recorded, who has read how far,
what retention may delete and how far extraction may run ahead of the readers.

Every shard a job records takes the job's next sequence number in the transaction that records it
(`next_seq`, called by shards.commit_shard): the UPDATE of the job's row that hands it out holds that
row until the transaction ends, so a second writer's shard waits for the first to commit and numbers
are given in commit order, without gaps (a transaction that rolls back gives its number back).

A consumer is a named reader (a trainer, whatever its number of ranks). Each rank acknowledges a
position: every shard up to `seq` read in epoch `epoch` of `epochs`. Read by a consumer: up to the
lowest position among its ranks (a rank that has said nothing has read nothing; any rank past its
first epoch has read everything once). Released by a consumer: the same, counted only in its last
epoch (a shard it will read again stays). Retention `acked` deletes what every consumer released;
`unread_bytes` is what some consumer has not read, the job's back-pressure. With no consumer,
nothing is released and nothing is unread.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import case, delete, exists, func, select, update
from sqlalchemy.orm import Session

from hsx.db.models import ConsumerAckRow, ConsumerRow, JobRow, SampleRow, ShardRow
from hsx.db.repository._base import utcnow
from hsx.names import could_be_stored

# Past any sequence number, "everything" in a comparison, and within the column's type (a 4-byte integer:
# Postgres refuses a wider parameter); no job records this many shards (AckIn.seq's bound too).
ALL = 2**31 - 1


def next_seq(session: Session, job_id: str, nbytes: int) -> int:
    """The job's next feed number, for a shard of `nbytes` being recorded now (unread by every
    consumer the job has)."""
    has_consumers = exists().where(ConsumerRow.job_id == job_id)
    unread = JobRow.unread_bytes + case((has_consumers, nbytes), else_=0)
    return session.execute(
        update(JobRow)
        .where(JobRow.id == job_id)
        .values(shards_committed=JobRow.shards_committed + 1, unread_bytes=unread)
        .returning(JobRow.shards_committed)
    ).scalar_one()


def feed_shards(session: Session, job_id: str, after: int, limit: int) -> list[ShardRow]:
    """Up to `limit` of the job's shards recorded after `after`, in feed order."""
    return list(
        session.execute(
            select(ShardRow).where(ShardRow.job_id == job_id, ShardRow.seq > after).order_by(ShardRow.seq).limit(limit)
        ).scalars()
    )


@dataclass(frozen=True)
class Placed:
    """Where a stored sample lies in its shard."""

    sample_id: str
    offset: int
    num_tokens: int


def shard_samples(session: Session, job_id: str, names: list[str]) -> dict[str, list[Placed]]:
    """The samples of each named shard of the job, in their order in the shard."""
    found: dict[str, list[Placed]] = {name: [] for name in names}
    if not names:
        return found
    rows = session.execute(
        select(SampleRow.shard, SampleRow.sample_id, SampleRow.shard_offset, SampleRow.num_tokens)
        .where(SampleRow.job_id == job_id, SampleRow.shard.in_(names))
        .order_by(SampleRow.shard, SampleRow.shard_offset)
    )
    for shard, sample_id, offset, num_tokens in rows:
        # a stored sample records both where it lies; the query asked for stored shards' names only
        found[str(shard)].append(Placed(sample_id, int(offset or 0), num_tokens))
    return found


# --- consumers ----------------------------------------------------------------------------------


def get_consumer(session: Session, job_id: str, name: str) -> ConsumerRow | None:
    if not could_be_stored(name):
        return None
    return session.get(ConsumerRow, (job_id, name))


def add_consumer(session: Session, job_id: str, name: str) -> tuple[ConsumerRow, bool]:
    """The job's consumer of that name, registered now unless it was already (then False)."""
    found = get_consumer(session, job_id, name)
    if found is not None:
        return found, False
    row = ConsumerRow(job_id=job_id, name=name, created_at=utcnow())
    session.add(row)
    session.flush()
    refresh_unread(session, job_id)
    return row, True


def delete_consumer(session: Session, job_id: str, name: str) -> bool:
    """Forget a consumer and its acknowledgements (its ranks' rows go with it); False if there was none."""
    if get_consumer(session, job_id, name) is None:
        return False
    session.execute(delete(ConsumerAckRow).where(ConsumerAckRow.job_id == job_id, ConsumerAckRow.consumer == name))
    session.execute(delete(ConsumerRow).where(ConsumerRow.job_id == job_id, ConsumerRow.name == name))
    refresh_unread(session, job_id)
    return True


def job_consumers(session: Session, job_id: str) -> list[ConsumerRow]:
    return list(
        session.execute(select(ConsumerRow).where(ConsumerRow.job_id == job_id).order_by(ConsumerRow.name)).scalars()
    )


def consumer_acks(session: Session, job_id: str, names: list[str] | None = None) -> dict[str, list[ConsumerAckRow]]:
    """Each consumer's ranks' acknowledgements (only those that said something), by consumer name."""
    query = select(ConsumerAckRow).where(ConsumerAckRow.job_id == job_id)
    if names is not None:
        query = query.where(ConsumerAckRow.consumer.in_(names))
    found: dict[str, list[ConsumerAckRow]] = {}
    for row in session.execute(query.order_by(ConsumerAckRow.consumer, ConsumerAckRow.rank)).scalars():
        found.setdefault(row.consumer, []).append(row)
    return found


@dataclass(frozen=True)
class Position:
    """How far one consumer has gone: `read` every shard up to that number at least once, `released`
    every shard up to that number for the last time (both 0 before its ranks said anything)."""

    world_size: int | None
    ranks_acked: int
    read: int
    released: int


def position(acks: list[ConsumerAckRow]) -> Position:
    """A consumer's position from its ranks' acknowledgements."""
    if not acks:
        return Position(None, 0, 0, 0)
    world = acks[0].world_size
    by_rank = {a.rank: a for a in acks}
    reads, releases = [], []
    for rank in range(world):
        a = by_rank.get(rank)
        reads.append(0 if a is None else (ALL if a.epoch > 1 else a.seq))
        releases.append(0 if a is None or a.epoch < a.epochs else a.seq)
    return Position(world, len(by_rank), min(reads), min(releases))


class AckRefused(ValueError):
    """An acknowledgement that contradicts what the consumer's other ranks said (their world size)."""


def record_ack(
    session: Session, job_id: str, consumer: str, *, rank: int, world_size: int, epoch: int, epochs: int, seq: int
) -> None:
    """Keep one rank's acknowledgement: its position only moves forward (an older one, from a trainer
    resumed from an earlier checkpoint, changes nothing); AckRefused for another world size."""
    others = session.execute(
        select(ConsumerAckRow.world_size).where(ConsumerAckRow.job_id == job_id, ConsumerAckRow.consumer == consumer)
    ).scalars()
    sizes = set(others)
    if sizes and sizes != {world_size}:
        raise AckRefused(
            f"consumer {consumer!r} acknowledged with world_size {sorted(sizes)[0]} before, not {world_size}: "
            "delete the consumer to start it again with another world size"
        )
    row = session.get(ConsumerAckRow, (job_id, consumer, rank))
    if row is None:
        session.add(
            ConsumerAckRow(
                job_id=job_id,
                consumer=consumer,
                rank=rank,
                world_size=world_size,
                epoch=epoch,
                epochs=epochs,
                seq=seq,
                acked_at=utcnow(),
            )
        )
    elif (epoch, seq) > (row.epoch, row.seq):
        row.epoch, row.epochs, row.seq, row.acked_at = epoch, epochs, seq, utcnow()
    session.flush()
    refresh_unread(session, job_id)


def positions(session: Session, job_id: str) -> dict[str, Position]:
    """Every consumer's position, by name."""
    acks = consumer_acks(session, job_id)
    return {c.name: position(acks.get(c.name, [])) for c in job_consumers(session, job_id)}


def bytes_after(session: Session, job_id: str, seq: int) -> tuple[int, int]:
    """(shards, bytes) the job recorded after feed number `seq`."""
    count, total = session.execute(
        select(func.count(), func.coalesce(func.sum(ShardRow.bytes), 0)).where(
            ShardRow.job_id == job_id, ShardRow.seq > seq
        )
    ).one()
    return int(count), int(total)


def refresh_unread(session: Session, job_id: str) -> int:
    """Recount what some consumer has not read (none without consumers) into jobs.unread_bytes."""
    found = positions(session, job_id)
    unread = bytes_after(session, job_id, min(p.read for p in found.values()))[1] if found else 0
    session.execute(update(JobRow).where(JobRow.id == job_id).values(unread_bytes=unread))
    return unread


def mark_released(session: Session, job_id: str) -> list[ShardRow]:
    """Mark deleted every shard each consumer released (none without consumers) that is not marked yet,
    and return every shard so marked, whose files are for the caller to remove."""
    found = positions(session, job_id)
    if found:
        upto = min(p.released for p in found.values())
        session.execute(
            update(ShardRow)
            .where(ShardRow.job_id == job_id, ShardRow.seq <= upto, ShardRow.deleted_at.is_(None))
            .values(deleted_at=utcnow())
        )
    return list(
        session.execute(
            select(ShardRow).where(ShardRow.job_id == job_id, ShardRow.deleted_at.is_not(None)).order_by(ShardRow.seq)
        ).scalars()
    )


def jobs_with_consumers(session: Session) -> list[JobRow]:
    """The jobs that have consumers, oldest first."""
    ids = select(ConsumerRow.job_id).distinct()
    return list(session.execute(select(JobRow).where(JobRow.id.in_(ids)).order_by(JobRow.id)).scalars())
