"""SQLAlchemy models: jobs, their samples, each sample's attempts and each job's count of them by outcome
and reason, written shards, each job's throughput over time, and the writers' last reports.

The schema the service runs on is the one `alembic upgrade head` makes from migrations/;
tests/integration/test_migrations.py proves it equals these models.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    ForeignKey,
    ForeignKeyConstraint,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from hsx.states import JobState, SampleState

# SQLite only auto-increments an INTEGER PRIMARY KEY; Postgres wants 64-bit keys for big jobs.
BigPk = BigInteger().with_variant(Integer(), "sqlite")


class Base(DeclarativeBase):
    pass


class JobRow(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str | None] = mapped_column(String(200))
    state: Mapped[str] = mapped_column(String(16), default=JobState.QUEUED)
    error: Mapped[str | None] = mapped_column(Text)
    # what the job ran without that it asked for (a sampling seed its server ignored); NULL: nothing
    warning: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # When its last conversation left `preparing` (rendered, and regenerated when the job asks); NULL for a
    # job of token ids, and while conversations wait to be prepared.
    prepared_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancel_requested_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # Idempotency-Key of the creating request and a hash of its body: a replay returns this job.
    idempotency_key: Mapped[str | None] = mapped_column(String(255), unique=True)
    request_sha256: Mapped[str | None] = mapped_column(String(64))
    # What the first sample's dump said about the model: every later sample must agree.
    model_info: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # Captured layers the job asks for; NULL takes whatever the server captures.
    layers: Mapped[list[int] | None] = mapped_column(JSON)
    # Which workers may claim its samples (hsx.matching): the layers it asks for or was first
    # captured with, and the model its first stored sample came from. NULL: any worker.
    layers_key: Mapped[str | None] = mapped_column(String(2000))
    model_key: Mapped[str | None] = mapped_column(String(32))
    # How its conversations become token ids and which samples it leaves out (hsx.wire.JobOptions:
    # max_length, length_policy, on_invalid, loss, tokenizer, regenerate); NULL: the defaults.
    options: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # Bytes its shards will take (tokens x (layers x hidden x dtype size + ids and mask)); NULL: unknown.
    estimated_bytes: Mapped[int | None] = mapped_column(BigInteger)
    disk_warning: Mapped[str | None] = mapped_column(Text)
    num_samples: Mapped[int] = mapped_column(Integer, default=0)
    tokens_total: Mapped[int] = mapped_column(BigInteger, default=0)
    tokens_done: Mapped[int] = mapped_column(BigInteger, default=0)  # in written shards
    tokens_staged: Mapped[int] = mapped_column(BigInteger, default=0)  # validated, shard not yet written
    # Per-state counters kept in step with every sample transition, so progress never counts rows.
    n_preparing: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    n_queued: Mapped[int] = mapped_column(Integer, default=0)
    n_running: Mapped[int] = mapped_column(Integer, default=0)
    n_staged: Mapped[int] = mapped_column(Integer, default=0)
    n_succeeded: Mapped[int] = mapped_column(Integer, default=0)
    n_failed: Mapped[int] = mapped_column(Integer, default=0)
    n_cancelled: Mapped[int] = mapped_column(Integer, default=0)
    n_skipped: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    n_truncated: Mapped[int] = mapped_column(Integer, default=0, server_default="0")  # samples cut to fit, any state
    # Of the queued samples, those tried before (a retry, an interrupted attempt, a retry asked for):
    # kept in step like the state counters, so that a job says what waits for another attempt.
    n_requeued: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    shards_written: Mapped[int] = mapped_column(Integer, default=0)
    # The commit feed: shards recorded so far, each numbered in the order recorded (ShardRow.seq).
    shards_committed: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Back-pressure (JobOptions.max_unread_bytes, NULL: none): writers claim none of its samples while the
    # bytes of its recorded shards some consumer has not read (unread_bytes, kept as shards are recorded
    # and consumers acknowledge) plus its staged bytes reach it.
    max_unread_bytes: Mapped[int | None] = mapped_column(BigInteger)
    unread_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")

    __table_args__ = (Index("ix_jobs_state", "state"),)


class SampleRow(Base):
    __tablename__ = "samples"

    pk: Mapped[int] = mapped_column(BigPk, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    idx: Mapped[int] = mapped_column(Integer)
    sample_id: Mapped[str] = mapped_column(String(200))
    state: Mapped[str] = mapped_column(String(16), default=SampleState.QUEUED)
    # Token ids as little-endian int32 bytes; loss mask as one byte per token (NULL: all ones). A
    # conversation's are empty until it is prepared.
    input_ids: Mapped[bytes] = mapped_column(LargeBinary)
    loss_mask: Mapped[bytes | None] = mapped_column(LargeBinary)
    num_tokens: Mapped[int] = mapped_column(Integer)
    # A conversation sample's messages as JSON ([{"role", "content"}...]); after regeneration, the
    # regenerated ones. NULL for samples given as token ids.
    conversation: Mapped[str | None] = mapped_column(Text)
    # Its token count before the job's length policy cut it to fit (truncate); NULL: not cut.
    truncated_from: Mapped[int | None] = mapped_column(Integer)
    observed_tokens: Mapped[int | None] = mapped_column(Integer)
    identity: Mapped[str | None] = mapped_column(String(16))  # what proved its dump its own (hsx.identity)
    # attempts: the retry budget spent; tries: every claim, including ones an outage interrupted.
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    tries: Mapped[int] = mapped_column(Integer, default=0)
    last_error: Mapped[str | None] = mapped_column(Text)
    # The dump root (host:path) whose single writer holds this sample while running or staged.
    writer: Mapped[str | None] = mapped_column(String(500))
    staged_path: Mapped[str | None] = mapped_column(Text)
    shard: Mapped[str | None] = mapped_column(String(200))
    shard_offset: Mapped[int | None] = mapped_column(BigInteger)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        UniqueConstraint("job_id", "sample_id", name="uq_samples_job_sample"),
        UniqueConstraint("job_id", "idx", name="uq_samples_job_idx"),
        Index("ix_samples_job_state_idx", "job_id", "state", "idx"),
        Index("ix_samples_writer_state", "writer", "state"),
        # a shard's samples, for the commit feed
        Index("ix_samples_job_shard", "job_id", "shard"),
        # The database's half of the single-writer rule: one running sample per dump root.
        Index(
            "ux_samples_one_running_per_writer",
            "writer",
            unique=True,
            sqlite_where=text("state = 'running'"),
            postgresql_where=text("state = 'running'"),
        ),
    )


class AttemptRow(Base):
    __tablename__ = "attempts"

    pk: Mapped[int] = mapped_column(BigPk, primary_key=True, autoincrement=True)
    sample_pk: Mapped[int] = mapped_column(ForeignKey("samples.pk", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column(Integer)
    writer: Mapped[str] = mapped_column(String(500))
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # ok | retry | failed | interrupted; reason says why for anything but ok.
    outcome: Mapped[str | None] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    dump_key: Mapped[str | None] = mapped_column(String(300))
    observed_tokens: Mapped[int | None] = mapped_column(Integer)
    identity: Mapped[str | None] = mapped_column(String(16))
    boot_id: Mapped[str | None] = mapped_column(String(100))

    __table_args__ = (UniqueConstraint("sample_pk", "number", name="uq_attempts_sample_number"),)


class AttemptCountRow(Base):
    """How many of a job's attempts ended with each outcome and reason code (the reason up to its first
    ':'), counted as each attempt ends: a job shows its retries by reason without reading its attempts.
    An ok attempt whose values the shard writer then finds NaN or Inf moves from ok to its new outcome."""

    __tablename__ = "job_attempt_counts"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    outcome: Mapped[str] = mapped_column(String(16), primary_key=True)
    reason: Mapped[str] = mapped_column(String(100), primary_key=True)  # "" for none (ok)
    n: Mapped[int] = mapped_column(BigInteger)


class ShardRow(Base):
    __tablename__ = "shards"

    pk: Mapped[int] = mapped_column(BigPk, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(200))
    bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    num_samples: Mapped[int] = mapped_column(Integer)
    num_tokens: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # Per captured layer ("<i>": hsx.storage.encoding.LayerStats), what the job's encoding stored: raw
    # and stored bytes, and for fp8 the errors; the manifest adds them up. NULL: a raw shard.
    layer_stats: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # Its place in the job's commit feed: 1, 2, ... in the order shards are recorded, without gaps.
    seq: Mapped[int] = mapped_column(Integer)
    # When retention deleted its file, every consumer having read it; the record stays. NULL: on disk.
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        UniqueConstraint("job_id", "name", name="uq_shards_job_name"),
        UniqueConstraint("job_id", "seq", name="uq_shards_job_seq"),
    )


class ConsumerRow(Base):
    """A named reader of a job's shards (a trainer, however many ranks it has): what it acknowledged
    decides which shards retention may delete and how much the job may extract ahead of it."""

    __tablename__ = "job_consumers"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


class ConsumerAckRow(Base):
    """One rank's last acknowledged position in a job's feed: every shard up to `seq` read in epoch
    `epoch` of `epochs`. A consumer's ranks all say the same world_size."""

    __tablename__ = "job_consumer_acks"

    job_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    consumer: Mapped[str] = mapped_column(String(200), primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    world_size: Mapped[int] = mapped_column(Integer)
    epoch: Mapped[int] = mapped_column(Integer)
    epochs: Mapped[int] = mapped_column(Integer)
    seq: Mapped[int] = mapped_column(Integer)
    acked_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        ForeignKeyConstraint(
            ["job_id", "consumer"], ["job_consumers.job_id", "job_consumers.name"], ondelete="CASCADE"
        ),
    )


class ThroughputRow(Base):
    """What a job extracted (samples staged) in each window of repository.THROUGHPUT_BUCKET_S seconds:
    the history behind its throughput plot. Rows grow with the job's duration, not its size."""

    __tablename__ = "job_throughput"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    bucket_start: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # Unix seconds
    samples: Mapped[int] = mapped_column(Integer)
    tokens: Mapped[int] = mapped_column(BigInteger)


class WriterRow(Base):
    """Each dump-root writer's last reported state: jobs show why they wait, /healthz shows all writers."""

    __tablename__ = "writers"

    identity: Mapped[str] = mapped_column(String(500), primary_key=True)
    state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(Text)
    server: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    # The lease: the fencing token every write of this writer is checked against (raised each time
    # the writer registers, and when another writer finds the lease expired), and its expiry.
    epoch: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    stats: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # samples done, tokens/s: what GET /v1/workers shows
    # What its model server accepts, as last found ready (None: not said): token ids below vocab_size, at
    # most max_prompt_tokens a prompt. An API checks submitted samples against these (hsx.service.limits).
    vocab_size: Mapped[int | None] = mapped_column(Integer)
    max_prompt_tokens: Mapped[int | None] = mapped_column(Integer)


class OutputRootRow(Base):
    """The output root of every service on this database: one row, the id its marker file holds
    (hsx.storage.output_root) and where it was first recorded. Services that share a database write
    their shards and manifests to that one folder, so every shard of a job lies next to the others."""

    __tablename__ = "output_root"

    pk: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)  # always 1
    root_id: Mapped[str] = mapped_column(String(64))
    location: Mapped[str] = mapped_column(Text)  # host:path of the service that recorded it
    recorded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
