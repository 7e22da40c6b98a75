"""Job and sample states: the one list of each, used by the database models, the API schemas, the
SDK and the CLI. Members are strings (`JobState.QUEUED == "queued"`), so they compare, serialise
and bind to SQL as the plain values the API and the database have always held."""

from __future__ import annotations

import enum


class StrEnum(str, enum.Enum):
    """Members that are their values: hsx's enums (states, proofs, engines) share it."""

    # enum.StrEnum is Python 3.11+; hsx supports 3.10, where SGLang's images still run.
    def __str__(self) -> str:
        return self.value


class JobState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    # Finished with some samples stored and some failed: not "failed", which says nothing was stored
    # (or the job could not run at all).
    PARTIAL = "partial"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_JOB_STATES


class SampleState(StrEnum):
    # A conversation waiting to be rendered into token ids (and regenerated, when the job asks), by
    # a writer's preparer, before it can be queued for extraction.
    PREPARING = "preparing"
    QUEUED = "queued"
    RUNNING = "running"
    STAGED = "staged"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    # Left out by the job's policy (too long, invalid): never extracted; last_error says why.
    SKIPPED = "skipped"


ACTIVE_JOB_STATES = frozenset({JobState.QUEUED, JobState.RUNNING, JobState.CANCELLING})
TERMINAL_JOB_STATES = frozenset({JobState.SUCCEEDED, JobState.PARTIAL, JobState.FAILED, JobState.CANCELLED})
