"""Every database query the service makes, and the one place sample and job states change
(hsx.db.repository.transitions), one module per aggregate:

- jobs: creating a job with its samples; cancel, retry, delete, fail and finish a job as a whole;
- samples: a writer's claim of the next sample, its attempts, what it staged or left behind;
- attempts: each job's attempts counted by outcome and reason code as they end;
- shards: numbering and recording written shards;
- feed: the shards in the order recorded, the job's consumers and what they acknowledged;
- reads: jobs, samples, attempts and shards, one or a page at a time;
- throughput: what each job extracted over time;
- writers: registration, leases and their takeover, who is live;
- output_root: the output root the jobs write to.

Callers use the package, `from hsx.db import repository as repo; repo.claim_next(...)`: every public
name of the modules is here, but for what the modules share among themselves and callers never use:
`_base` (the clock, the tables, row counts), `transitions` (the state machine every module moves samples
through), and the counters a sample's outcome moves (`attempts.count_attempt`, `throughput.count_throughput`).
"""

from __future__ import annotations

from hsx.db.repository._base import utcnow
from hsx.db.repository.attempts import attempt_counts, reason_code
from hsx.db.repository.feed import (
    AckRefused,
    Placed,
    Position,
    add_consumer,
    bytes_after,
    consumer_acks,
    delete_consumer,
    feed_shards,
    get_consumer,
    job_consumers,
    jobs_with_consumers,
    mark_released,
    position,
    positions,
    record_ack,
    refresh_unread,
    shard_samples,
)
from hsx.db.repository.jobs import (
    JobBuilder,
    NewSample,
    cancel_job,
    cancel_queued,
    cancelling_jobs,
    create_job,
    delete_job,
    fail_job,
    final_state,
    finish_job_if_done,
    is_job_id,
    job_by_idempotency_key,
    new_job_id,
    pending_output_bytes,
    retry_job,
    set_job_model_info,
    warn_job,
)
from hsx.db.repository.output_root import record_output_root, recorded_output_root
from hsx.db.repository.preparing import (
    Prepared,
    ToPrepare,
    claim_preparing,
    jobs_to_prepare,
    pin_job_model,
    release_preparing,
    store_prepared,
)
from hsx.db.repository.reads import (
    active_attempt_counts,
    get_job,
    get_sample,
    get_shard,
    iter_stored_samples,
    job_shards,
    jobs_by_state,
    list_jobs,
    list_samples,
    ping,
    requeued_samples,
    sample_attempts,
    samples_by_state,
)
from hsx.db.repository.samples import (
    Claimed,
    claim_next,
    held_back_jobs,
    mark_staged,
    queued_left,
    record_failed_attempt,
    recover_writer,
    reject_staged,
    release_interrupted,
    requeue_staged,
    running_samples,
    staged_samples,
)
from hsx.db.repository.shards import commit_shard, reserve_shard_number
from hsx.db.repository.throughput import THROUGHPUT_BUCKET_S, ThroughputPoint, job_throughput
from hsx.db.repository.writers import (
    WRITER_STALE_S,
    LeaseLost,
    all_writers,
    check_lease,
    expire_leases,
    live_writers,
    present_writers,
    register_writer,
    renew_lease,
    report_writer_stopped,
    reported_model_paths,
    waiting,
    writer_limits,
)

__all__ = [
    "THROUGHPUT_BUCKET_S",
    "WRITER_STALE_S",
    "AckRefused",
    "Claimed",
    "JobBuilder",
    "LeaseLost",
    "NewSample",
    "Placed",
    "Position",
    "Prepared",
    "ThroughputPoint",
    "ToPrepare",
    "active_attempt_counts",
    "add_consumer",
    "all_writers",
    "attempt_counts",
    "bytes_after",
    "cancel_job",
    "cancel_queued",
    "cancelling_jobs",
    "check_lease",
    "claim_next",
    "claim_preparing",
    "commit_shard",
    "consumer_acks",
    "create_job",
    "delete_consumer",
    "delete_job",
    "expire_leases",
    "fail_job",
    "feed_shards",
    "final_state",
    "finish_job_if_done",
    "get_consumer",
    "get_job",
    "get_sample",
    "get_shard",
    "held_back_jobs",
    "is_job_id",
    "iter_stored_samples",
    "job_by_idempotency_key",
    "job_consumers",
    "job_shards",
    "job_throughput",
    "jobs_by_state",
    "jobs_to_prepare",
    "jobs_with_consumers",
    "list_jobs",
    "list_samples",
    "live_writers",
    "mark_released",
    "mark_staged",
    "new_job_id",
    "pending_output_bytes",
    "pin_job_model",
    "ping",
    "position",
    "positions",
    "present_writers",
    "queued_left",
    "reason_code",
    "record_ack",
    "record_failed_attempt",
    "record_output_root",
    "recorded_output_root",
    "recover_writer",
    "refresh_unread",
    "register_writer",
    "reject_staged",
    "release_interrupted",
    "release_preparing",
    "renew_lease",
    "report_writer_stopped",
    "reported_model_paths",
    "requeue_staged",
    "requeued_samples",
    "reserve_shard_number",
    "retry_job",
    "running_samples",
    "sample_attempts",
    "samples_by_state",
    "set_job_model_info",
    "shard_samples",
    "staged_samples",
    "store_prepared",
    "utcnow",
    "waiting",
    "warn_job",
    "writer_limits",
]
