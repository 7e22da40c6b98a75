"""Stored rows as the API shows them (hsx.wire): jobs with their progress, samples with their attempts,
shards, throughput, writers."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any, cast

from hsx.db import repository as repo
from hsx.db.models import AttemptRow, JobRow, SampleRow, WriterRow
from hsx.layers import ANY_LAYERS, LayerSetName, choice_parts, shown_choice
from hsx.matching import layer_sets, serves_default
from hsx.states import JobState
from hsx.wire import (
    AttemptOut,
    Attempts,
    Counts,
    JobOptions,
    JobOut,
    PreparerOut,
    SampleOut,
    Throughput,
    ThroughputPoint,
    Tokens,
    WorkerOut,
    WriterOut,
    utc,
)


def job_out(job: JobRow, waiting: str | None = None, attempts: list[tuple[str, str, int]] | None = None) -> JobOut:
    """A job, its rate and ETA; `waiting` is why it makes no progress if active (see hsx.matching.Waiting);
    `attempts` its counts of ended attempts (repo.attempt_counts), none for a job just created."""
    rate = eta = None
    created, started = utc(job.created_at), utc(job.started_at)
    end = utc(job.finished_at) or datetime.now(timezone.utc)
    if started is not None:
        elapsed = (end - started).total_seconds()
        extracted = job.tokens_done + job.tokens_staged
        if elapsed > 0 and extracted:
            rate = extracted / elapsed
            if job.finished_at:
                eta = 0.0
            elif job.state != JobState.CANCELLING:  # what is left of a cancelled job is not extracted
                eta = (job.tokens_total - extracted) / rate
    # Only a job with samples left to extract can be kept waiting by the writer.
    extracting = job.state in (JobState.QUEUED, JobState.RUNNING) and (job.n_preparing or job.n_queued or job.n_running)
    return JobOut(
        id=job.id,
        name=job.name,
        state=job.state,
        error=job.error,
        warning=job.warning,
        created_at=created,
        waiting_reason=waiting if extracting else None,
        prepared_at=utc(job.prepared_at),
        started_at=started,
        cancel_requested_at=utc(job.cancel_requested_at),
        finished_at=utc(job.finished_at),
        elapsed_s=_seconds(created, end),
        preparing_s=_preparing_s(job, created, end),
        extracting_s=_seconds(started, end),
        counts=Counts(
            total=job.num_samples,
            preparing=job.n_preparing,
            queued=job.n_queued,
            running=job.n_running,
            staged=job.n_staged,
            succeeded=job.n_succeeded,
            failed=job.n_failed,
            cancelled=job.n_cancelled,
            skipped=job.n_skipped,
            truncated=job.n_truncated or 0,
        ),
        tokens=Tokens(total=job.tokens_total, done=job.tokens_done, staged=job.tokens_staged),
        attempts=attempts_out(attempts or [], job.n_requeued or 0),
        rate_tokens_per_s=rate,
        eta_s=eta,
        shards_written=job.shards_written,
        estimated_bytes=job.estimated_bytes,
        disk_warning=job.disk_warning,
        layers=list[int | str](job.layers) if job.layers is not None else _layer_choice(job.layers_key),
        model=job.model_info,
        options=JobOptions.model_validate(job.options or {}),
        manifest_url=f"/v1/jobs/{job.id}/manifest",
    )


def _layer_choice(key: str | None) -> list[int | str] | LayerSetName:
    """What a job without a layer list asked for: a named set, several sets (with any ids) as a list, or any
    (whose key is its first stored sample's layers once one is stored)."""
    if key is None or not choice_parts(key)[0]:
        return ANY_LAYERS
    shown = shown_choice(key)
    return shown if isinstance(shown, list) else cast(LayerSetName, shown)


def _seconds(start: datetime | None, end: datetime) -> float | None:
    return None if start is None else round(max(0.0, (end - start).total_seconds()), 3)


def _preparing_s(job: JobRow, created: datetime, end: datetime) -> float | None:
    """How long its conversations took to be prepared: to prepared_at, or to `end` while some still wait; None for
    a job that had none to prepare."""
    if job.prepared_at is not None:
        return _seconds(created, utc(job.prepared_at))
    return _seconds(created, end) if job.n_preparing else None


# Outcomes of an attempt that spent the sample's budget for a reason.
SPENT = ("retry", "failed")


def attempts_out(counts: list[tuple[str, str, int]], requeued: int) -> Attempts:
    """A job's ended attempts from its (outcome, reason code, n) counts."""
    by_outcome: dict[str, int] = {}
    by_reason: dict[str, int] = {}
    for outcome, reason, n in counts:
        by_outcome[outcome] = by_outcome.get(outcome, 0) + n
        if outcome in SPENT:
            by_reason[reason] = by_reason.get(reason, 0) + n
    return Attempts(
        total=sum(by_outcome.values()),
        ok=by_outcome.get("ok", 0),
        retried=by_outcome.get("retry", 0),
        failed=by_outcome.get("failed", 0),
        interrupted=by_outcome.get("interrupted", 0),
        by_reason=dict(sorted(by_reason.items(), key=lambda kv: (-kv[1], kv[0]))),
        waiting_retry=requeued,
    )


def sample_out(s: SampleRow, attempts: Sequence[AttemptRow] | None = None) -> SampleOut:
    """A sample; with `attempts` (the single-sample view), every attempt and its outcome, and a
    conversation's turns, too."""
    log = None
    if attempts is not None:
        log = [
            AttemptOut(
                number=a.number,
                worker=a.writer,
                outcome=a.outcome,
                reason=a.reason,
                started_at=utc(a.started_at),
                finished_at=utc(a.finished_at),
                dump=a.dump_key,
                observed_tokens=a.observed_tokens,
                boot_id=a.boot_id,
            )
            for a in attempts
        ]
    return SampleOut(
        id=s.sample_id,
        index=s.idx,
        state=s.state,
        expected_tokens=s.num_tokens,
        observed_tokens=s.observed_tokens,
        attempts=s.attempts,
        last_error=s.last_error,
        shard=s.shard,
        offset=s.shard_offset,
        truncated_from=s.truncated_from,
        attempt_log=log,
        messages=json.loads(s.conversation) if attempts is not None and s.conversation else None,
    )


def throughput_out(job_id: str, width: int, points: Sequence[repo.ThroughputPoint]) -> Throughput:
    return Throughput(
        job_id=job_id,
        window_s=width,
        points=[_point(p) for p in points],
    )


def _point(p: repo.ThroughputPoint) -> ThroughputPoint:
    # The rate from the seconds as shown, so that a client dividing the two gets the same figure.
    seconds = round(p.seconds, 3)
    return ThroughputPoint(
        start=datetime.fromtimestamp(p.start, timezone.utc),
        seconds=seconds,
        samples=p.samples,
        tokens=p.tokens,
        tokens_per_s=round(p.tokens / seconds, 3) if seconds > 0 else 0.0,
    )


def writer_out(w: WriterRow) -> WriterOut:
    """A live writer, as /healthz lists it."""
    return WriterOut(
        identity=w.identity,
        state=w.state,
        reason=w.reason,
        server=w.server,
        heartbeat_at=utc(w.heartbeat_at),
        tokens_per_s=(w.stats or {}).get("tokens_per_s"),
        preparer=preparer_out(w.stats),
        layer_sets=layer_sets(w.server),
        serves_default=serves_default(w.server),
    )


def preparer_out(stats: dict[str, Any] | None) -> PreparerOut | None:
    """A writer's preparer as its heartbeat reported it; None from a writer that reports none."""
    reported = (stats or {}).get("preparer")
    if not isinstance(reported, dict):
        return None
    return PreparerOut.model_validate({k: reported.get(k) for k in ("state", "reason", "prepared")})


def worker_out(w: WriterRow) -> WorkerOut:
    """A writer with its model server, layers and lease, as /v1/workers lists it."""
    server, stats = w.server or {}, w.stats or {}
    return WorkerOut(
        identity=w.identity,
        state=w.state,
        reason=w.reason,
        backend_url=server.get("url"),
        model_path=server.get("model_path"),
        model_key=server.get("model_key"),
        layers=server.get("layers"),
        final_layer=server.get("final_layer"),
        final_norm=server.get("final_norm"),
        final_norm_problem=server.get("final_norm_problem"),
        source=server.get("source"),
        vocab_size=w.vocab_size,
        max_prompt_tokens=w.max_prompt_tokens,
        started_at=utc(w.started_at),
        heartbeat_at=utc(w.heartbeat_at),
        lease_expires_at=utc(w.lease_expires_at),
        lease=w.epoch,
        samples_staged=stats.get("samples_staged"),
        tokens_per_s=stats.get("tokens_per_s"),
        preparer=preparer_out(stats),
        layer_sets=layer_sets(w.server),
        serves_default=serves_default(w.server),
    )
