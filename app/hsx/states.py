"""Job and sample states: the one list of each, used by the database models, the API schemas, the
SDK and the CLI. Members are strings (`JobState.QUEUED == "queued"`), so they compare, serialise
and bind to SQL as the plain values the API and the database have always held."""

from __future__ import annotations

import enum


class _StrEnum(str, enum.Enum):
    # enum.StrEnum is Python 3.11+; hsx supports 3.10, where SGLang's images still run.
    def __str__(self) -> str:
        return self.value


class JobState(_StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    CANCELLING = "cancelling"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_JOB_STATES


class SampleState(_StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    STAGED = "staged"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


ACTIVE_JOB_STATES = frozenset({JobState.QUEUED, JobState.RUNNING, JobState.CANCELLING})
TERMINAL_JOB_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
TERMINAL_SAMPLE_STATES = frozenset({SampleState.SUCCEEDED, SampleState.FAILED, SampleState.CANCELLED})
