"""Which workers may run which jobs.

Several workers share one queue, each beside its own model server. A job runs only on workers
whose server gives the layers it asks for and serves the model its first sample came from: a
worker never claims a sample it would have to fail, and a job nobody can serve waits (its
`waiting_reason` says why) instead of failing on the first worker that looks at it.

Both sides are compared as short keys stored beside the job, so a claim filters in SQL on plain
equality, the same on SQLite and Postgres:
  layers   the job's requested layers, or the ones its first stored sample was captured with
  model    a digest of the model as the server describes it (backends.model.describe_model:
           path, type, layer count, hidden size, norm eps, vocabulary), recorded with the job's
           first stored sample. Workers of one job must serve the model under the same path.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hsx.db.models import JobRow, WriterRow


def layers_key(layers: list[int] | None) -> str | None:
    return None if layers is None else ",".join(str(int(i)) for i in layers)


def model_key(described: dict[str, Any] | None) -> str | None:
    """The model's identity; None while the server has not described it."""
    if not described:
        return None
    text = json.dumps(described, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class Serves:
    """What a worker's model server gives now. A None key is unknown (a server that does not say
    which layers its dumps hold): such a worker may claim whatever the other key allows, and its
    dumps are checked against the job as they come."""

    layers: str | None
    model: str | None

    @classmethod
    def of(cls, layers: list[int] | None, described: dict[str, Any] | None) -> Serves:
        return cls(layers_key(layers), model_key(described))


NO_WRITER = "no writer is running (start `hsx serve` or `hsx worker` with a dump root against this database)"


class Waiting:
    """Why an active job makes no progress now, from the live writers as they last reported."""

    def __init__(self, writers: Sequence[WriterRow]):
        self.writers = writers

    def reason(self, job: JobRow) -> str | None:
        """None while some ready writer may claim the job's samples."""
        if not self.writers:
            return NO_WRITER
        fitting = [w for w in self.writers if _fits(_serves(w), job)]
        if any(w.state == "ready" for w in fitting):
            return None
        if fitting:
            return "; ".join(_not_ready(w) for w in fitting)
        needs = []
        if job.layers_key is not None:
            needs.append(f"layers [{job.layers_key.replace(',', ', ')}]")
        if job.model_key is not None:
            path = (job.model_info or {}).get("model_path")
            needs.append(
                f"the model its first sample came from ({path})"
                if path
                else "the model whose chat template rendered its conversations"
            )
        offers = "; ".join(f"{w.identity} gives {_offer(w)}" for w in self.writers)
        return f"no live worker serves this job: it needs {' and '.join(needs)}; {offers}"


def may_take_new(w: WriterRow, layers: list[int] | None) -> bool:
    """Whether the writer may claim the samples of a job just created with `layers` (None: any), which
    no stored sample has tied to a model yet."""
    wanted, mine = layers_key(layers), _serves(w).layers
    return wanted is None or mine is None or wanted == mine


def _not_ready(w: WriterRow) -> str:
    """`identity: state: reason`, without a state of "waiting": the job's reason is shown as why it
    waits ("Waiting: host:/dumps: model server not ready: ..."), which would say it twice."""
    said = [w.state] if w.state != "waiting" or not w.reason else []
    return ": ".join([w.identity, *said, *([w.reason] if w.reason else [])])


def _serves(w: WriterRow) -> Serves:
    server = w.server or {}
    return Serves(layers_key(server.get("layers")), server.get("model_key"))


def _fits(serves: Serves, job: JobRow) -> bool:
    return all(
        wanted is None or mine is None or wanted == mine
        for wanted, mine in ((job.layers_key, serves.layers), (job.model_key, serves.model))
    )


def _offer(w: WriterRow) -> str:
    server = w.server or {}
    source = f" from {server['layers_from']}" if server.get("layers_from") else ""
    return f"layers {server.get('layers')} of {server.get('model_path')}{source}"
