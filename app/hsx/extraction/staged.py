"""What this writer has staged and not yet written, per job, and the batches its flushers have taken:
the in-memory half of cutting shards (the flusher decides when a shard is due, this says what goes in).

A sample is in one batch at a time: a flusher takes it out of `waiting` into its batch. (A sample
staged again while an earlier staging of it is being written, after the writer lost its lease and
extracted it anew, waits until that batch is done.) A batch is taken oldest sample first, up to the
size bound (a sample larger than the bound makes a batch of its own), so another flusher can take the
next batch of the same job at once. What a flusher could not
write is given back with the time it was staged, so that how long it has waited still counts.

The database stays the truth about which samples are staged: a flusher reads its batch's rows back
before writing and drops those that are no longer this writer's staged samples.

Not thread-safe: the flusher holds its lock around every call.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Staged:
    nbytes: int
    at: float  # time.monotonic() when it was staged (or found staged at the writer's start)


@dataclass
class Batch:
    """Samples of one job that one flusher writes as one shard."""

    job_id: str
    samples: dict[int, Staged]  # sample pk -> its size and staging time

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.samples.values())


@dataclass(frozen=True)
class Waiting:
    """A job's untaken samples as one flusher's turn sees them."""

    job_id: str
    nbytes: int
    oldest: float


@dataclass
class _Job:
    waiting: dict[int, Staged] = field(default_factory=dict)  # oldest first
    nbytes: int = 0
    writing: int = 0  # batches of this job being written now
    not_before: float = 0.0  # after a failed write: when to try again


class StagedSamples:
    def __init__(self, shard_max_bytes: int):
        self.shard_max_bytes = shard_max_bytes
        self._jobs: dict[str, _Job] = {}
        self._nbytes = 0
        self._taken: set[int] = set()  # samples in a batch being written

    def add(self, job_id: str, pk: int, staged: Staged) -> int:
        """A sample of the job waits for its shard; returns the job's waiting bytes."""
        job = self._jobs.setdefault(job_id, _Job())
        old = job.waiting.pop(pk, None)
        if old is not None:  # staged again (requeued and extracted anew): the newer one counts
            self._count(job, -old.nbytes)
        job.waiting[pk] = staged
        self._count(job, staged.nbytes)
        return job.nbytes

    @property
    def waiting_bytes(self) -> int:
        """Staged bytes no flusher has taken yet, all jobs together."""
        return self._nbytes

    def holds(self, job_id: str) -> bool:
        """Whether the job has samples waiting or being written here."""
        return job_id in self._jobs

    def writing(self, job_id: str) -> int:
        job = self._jobs.get(job_id)
        return job.writing if job else 0

    def waiting(self, now: float) -> list[Waiting]:
        """Jobs with samples waiting that may be tried now, the longest-waiting first."""
        out = [
            Waiting(job_id, job.nbytes, next(iter(job.waiting.values())).at)
            for job_id, job in self._jobs.items()
            if job.waiting and now >= job.not_before
        ]
        return sorted(out, key=lambda w: w.oldest)

    def take(self, job_id: str) -> Batch | None:
        """The job's oldest waiting samples, as many as fit the size bound (at least one)."""
        job = self._jobs.get(job_id)
        if job is None or not job.waiting:
            return None
        taken: dict[int, Staged] = {}
        size = 0
        for pk, s in job.waiting.items():
            if pk in self._taken:
                continue
            if taken and size + s.nbytes > self.shard_max_bytes:
                break
            taken[pk] = s
            size += s.nbytes
        if not taken:
            return None
        for pk in taken:
            del job.waiting[pk]
        self._taken.update(taken)
        self._count(job, -size)
        job.writing += 1
        return Batch(job_id, taken)

    def done(self, batch: Batch, back: Iterable[int] = (), not_before: float = 0.0) -> bool:
        """A flusher is done with `batch`: the samples in `back` wait again (not tried before
        `not_before`), the others are written or no longer this writer's. Returns whether the job
        has nothing left here, waiting or being written (it is then forgotten)."""
        job = self._jobs.setdefault(batch.job_id, _Job())
        job.writing -= 1
        self._taken.difference_update(batch.samples)
        returned = {pk: batch.samples[pk] for pk in back if pk not in job.waiting}
        if returned:
            for s in returned.values():
                self._count(job, s.nbytes)
            job.waiting = dict(sorted({**job.waiting, **returned}.items(), key=lambda kv: kv[1].at))
            job.not_before = max(job.not_before, not_before)
        if job.waiting or job.writing:
            return False
        del self._jobs[batch.job_id]
        return True

    def _count(self, job: _Job, delta: int) -> None:
        job.nbytes += delta
        self._nbytes += delta
