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

from hsx.layers import ANY_LAYERS, LAYER_SETS, describe_choice, sets_given

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
    sets: tuple[str, ...] = ()  # the named layer sets it gives exactly (hsx.layers.LAYER_SETS)

    @classmethod
    def of(cls, layers: list[int] | None, described: dict[str, Any] | None) -> Serves:
        info = described or {}
        sets = sets_given(layers, info.get("num_hidden_layers"), info.get("final_layer"))
        return cls(layers_key(layers), model_key(described), tuple(sets))

    def gives(self, wanted: str | None) -> bool:
        """Whether it may take a job whose layers key is `wanted` (a list's key or a set's name; None:
        any layers)."""
        return wanted is None or self.layers is None or wanted == self.layers or wanted in self.sets


def choice_key(choice: list[int] | str) -> str | None:
    """The layers key a job's choice is stored as: a list's key, a set's name, None for any layers."""
    if isinstance(choice, list):
        return layers_key(choice)
    return None if choice == ANY_LAYERS else choice


def regeneration_needs(options: dict[str, Any] | None) -> tuple[bool, bool]:
    """(whether a job's answers are regenerated, whether by sampling with a seed that must hold), from its
    options: a seed only matters where sampling is not greedy, and holds unless the job said `warn`."""
    regenerate = (options or {}).get("regenerate")
    if not regenerate:
        return False, False
    return True, _samples_with_seed(regenerate) and regenerate.get("seed_ignored", "refuse") == "refuse"


def _samples_with_seed(regenerate: dict[str, Any]) -> bool:
    """A seed only matters where sampling is not greedy."""
    return regenerate.get("seed") is not None and float(regenerate.get("temperature") or 0) > 0


def ignores_seed(server: dict[str, Any] | None, options: dict[str, Any] | None) -> bool:
    """Whether a writer whose server is `server` would sample a job's answers without the seed it gives (a job
    that said `seed_ignored: warn`; any other is not prepared there)."""
    regenerate = (options or {}).get("regenerate") or {}
    return _samples_with_seed(regenerate) and (server or {}).get("applies_seed") is not True


SEED_IGNORED = (
    "regenerate.seed was ignored: the model server that generated answers does not apply sampling seeds "
    "(SGLang without --enable-deterministic-inference), so a rerun gives other answers"
)


def prepares(server: dict[str, Any] | None, options: dict[str, Any] | None) -> bool:
    """Whether a writer whose server is `server` (as it reports it) may prepare a job with `options`."""
    regenerate, seeded = regeneration_needs(options)
    said = server or {}
    return (not regenerate or said.get("regenerates") is True) and (not seeded or said.get("applies_seed") is True)


REGENERATE_NEEDS = (
    "regenerating answers needs a model server that generates them for hsx (SGLang's /generate; vLLM does not)"
)
SEED_NEEDS = (
    "regenerate.seed with a temperature above 0 needs a server that applies sampling seeds: SGLang applies them "
    "only when launched with --enable-deterministic-inference (launch it so, leave the seed out, or set "
    "regenerate.seed_ignored to warn)"
)


def preparing_refusal(options: dict[str, Any] | None, writers: Sequence[WriterRow]) -> str | None:
    """Why no writer among `writers` may prepare a job with `options`; None when one may."""
    if any(prepares(w.server, options) for w in writers):
        return None
    if not regeneration_needs(options)[0]:
        return None
    offers = "; ".join(f"{w.identity} runs {(w.server or {}).get('source')}" for w in writers)
    if not any((w.server or {}).get("regenerates") is True for w in writers):
        return f"{REGENERATE_NEEDS}; {offers}"
    return f"{SEED_NEEDS}; {offers}"


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
        if job.n_preparing and fitting:
            refusal = preparing_refusal(job.options, fitting)
            if refusal is not None:
                return refusal
        if any(w.state == "ready" for w in fitting):
            return None
        if fitting:
            return "; ".join(_not_ready(w) for w in fitting)
        needs = []
        if job.layers_key is not None:
            needs.append(describe_choice(_choice(job.layers_key)))
        if job.model_key is not None:
            path = (job.model_info or {}).get("model_path")
            needs.append(
                f"the model its first sample came from ({path})"
                if path
                else "the model whose chat template rendered its conversations"
            )
        offers = "; ".join(f"{w.identity} gives {_offer(w)}" for w in self.writers)
        return f"no live worker serves this job: it needs {' and '.join(needs)}; {offers}"


def may_take_new(w: WriterRow, choice: list[int] | str) -> bool:
    """Whether the writer may claim the samples of a job just created with layers `choice`, which no
    stored sample has tied to a model yet."""
    return _serves(w).gives(choice_key(choice))


def _choice(key: str) -> list[int] | str:
    """A job's layers key as the choice it stands for."""
    return key if key in LAYER_SETS else [int(i) for i in key.split(",")]


def _not_ready(w: WriterRow) -> str:
    """`identity: state: reason`, without a state of "waiting": the job's reason is shown as why it
    waits ("Waiting: host:/dumps: model server not ready: ..."), which would say it twice."""
    said = [w.state] if w.state != "waiting" or not w.reason else []
    return ": ".join([w.identity, *said, *([w.reason] if w.reason else [])])


def _serves(w: WriterRow) -> Serves:
    server = w.server or {}
    return Serves(layers_key(server.get("layers")), server.get("model_key"), tuple(server.get("layer_sets") or ()))


def _fits(serves: Serves, job: JobRow) -> bool:
    return serves.gives(job.layers_key) and (job.model_key is None or serves.model in (None, job.model_key))


def _offer(w: WriterRow) -> str:
    """What a writer's server gives, and what to change there when it gives less than EAGLE-3's layers."""
    server = w.server or {}
    source = f" from {server['layers_from']}" if server.get("layers_from") else ""
    hint = f" ({server['layers_hint']})" if server.get("layers_hint") else ""
    return f"layers {server.get('layers')} of {server.get('model_path')}{source}{hint}"
