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
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from hsx.layers import (
    ANY_LAYERS,
    CHOICE_JOIN,
    DEFAULT_LAYER_SET,
    LAYER_SETS,
    choice_parts,
    describe_choice,
    parse_choice,
    resolve,
    sets_given,
)
from hsx.sources import source_label

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
    dumps are checked against the job as they come.

    A job's layers key is served when the captured layers cover every layer the job's sets and ids
    need on this model (`hsx.layers.resolve`), and its sets read layer L on the side of the final norm
    the server gives it, or read it after the norm from a server that gives it before while hsx applies
    the model's own final norm itself (`converts`). The reverse cannot be computed: a norm is not undone."""

    layers: str | None
    model: str | None
    sets: tuple[str, ...] = ()  # the named layer sets it serves (hsx.layers.LAYER_SETS), by conversion too
    num_layers: int | None = None
    final_layer: str = "post_norm"
    converts: bool = False  # whether hsx applies the final norm to its pre-norm layer L

    @classmethod
    def of(cls, layers: list[int] | None, described: dict[str, Any] | None, *, converts: bool = False) -> Serves:
        info = described or {}
        num_layers = info.get("num_hidden_layers")
        final_layer = info.get("final_layer") or "post_norm"
        sets = sets_given(layers, num_layers, final_layer, converts=converts)
        depth = num_layers if isinstance(num_layers, int) else None
        return cls(layers_key(layers), model_key(described), tuple(sets), depth, final_layer, converts)

    def gives(self, wanted: str | None) -> bool:
        """Whether it may take a job whose layers key is `wanted` (a list's key, a set's name, several sets
        and ids joined; None: any layers)."""
        if wanted is None or self.layers is None or wanted == self.layers or wanted in self.sets:
            return True
        return self.refusal(wanted) is None

    def refusal(self, wanted: str) -> str | None:
        """Why it cannot take a job whose layers key is `wanted`, and which set to ask for instead; None
        when it can."""
        captured = [int(i) for i in (self.layers or "").split(",") if i]
        if self.num_layers is None:
            names, ids = choice_parts(wanted)
            if names:
                return "its server does not say the model's depth, so no named set can be matched to it"
            missing = [i for i in ids if i not in captured]
            return None if not missing else f"it does not capture layers {missing}"
        try:
            need = resolve(wanted, self.num_layers)
        except ValueError as exc:
            return str(exc)
        missing = [i for i in need.layers if i not in captured]
        if missing:
            return f"it does not capture layers {missing}"
        return self._side_refusal(need.final_layer if self.num_layers in need.layers else None)

    def _side_refusal(self, side: str | None) -> str | None:
        """Why it cannot give layer L on `side` of the final norm (None: either side will do)."""
        if side is None or side == self.final_layer or (side == "post_norm" and self.converts):
            return None
        if side == "pre_norm":
            return (
                f"its server gives layer {self.num_layers} after the final norm, and a norm cannot be undone to "
                "give it before"
            )
        return (
            f"its server gives layer {self.num_layers} before the final norm, and hsx cannot apply the model's "
            "final norm here"
        )


def choice_key(choice: list[int] | str) -> str | None:
    """The layers key a job's choice is stored as: a list's key, a set's name or several sets and ids
    joined (hsx.layers.parse_choice), None for any layers."""
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
    "only when launched with --enable-deterministic-inference, which needs one of its GPU attention backends: "
    "its CPU engine refuses that flag at start (docs/chat.md), so on a CPU-only host no server applies a seed. "
    "Sample greedily (temperature 0), leave the seed out, or set regenerate.seed_ignored to warn; on a GPU host, "
    "launch SGLang with --enable-deterministic-inference"
)


def preparing_refusal(options: dict[str, Any] | None, writers: Sequence[WriterRow]) -> str | None:
    """Why no writer among `writers` may prepare a job with `options`; None when one may."""
    if any(prepares(w.server, options) for w in writers):
        return None
    if not regeneration_needs(options)[0]:
        return None
    offers = "; ".join(describe_writer(w) for w in writers)
    if not any((w.server or {}).get("regenerates") is True for w in writers):
        return f"{REGENERATE_NEEDS}; live now: {offers}"
    return f"{SEED_NEEDS}; live now: {offers}"


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
        offers = "; ".join(f"{describe_writer(w)} gives {_offer(w, job.layers_key)}" for w in self.writers)
        return f"no live worker serves this job: it needs {' and '.join(needs)}; {offers}"


def layer_sets(server: dict[str, Any] | None) -> list[str] | None:
    """The named layer sets a writer's server gives exactly, as the writer last reported the server
    (WriterRow.server); None before it said its layers."""
    if (server or {}).get("layers") is None:
        return None
    return list((server or {}).get("layer_sets") or [])


def serves_default(server: dict[str, Any] | None) -> bool | None:
    """Whether a writer whose server is `server` may take a job that leaves its layers to the default set
    (DEFAULT_LAYER_SET); None while its server's layers are not known."""
    return None if layer_sets(server) is None else _serves_of(server).gives(DEFAULT_LAYER_SET)


def default_layers_warning(writers: Sequence[WriterRow]) -> str | None:
    """What /healthz says when writers are ready but none of them gives the default layer set: every job that
    does not name its layers then waits, though each writer is ready. None otherwise (no ready writer is a
    matter of the writers' own states)."""
    ready = [w for w in writers if w.state == "ready"]
    if not ready or any(serves_default(w.server) is not False for w in ready):
        return None
    given = sorted({name for w in ready for name in layer_sets(w.server) or []})
    if given:
        it = "it" if len(given) == 1 else "one of them"
        ask = (
            f"the ready writers give {' and '.join(given)}: ask for {it} (hsx submit --layers {given[0]}, "
            f'"layers": "{given[0]}")'
        )
    else:
        ask = "the ready writers give none of the named sets: ask for their layers as a list (GET /v1/workers)"
    return (
        f"no ready writer gives the default {describe_choice(DEFAULT_LAYER_SET)}: a job that does not name its "
        f"layers waits; {ask}"
    )


def may_take_new(w: WriterRow, choice: list[int] | str) -> bool:
    """Whether the writer may claim the samples of a job just created with layers `choice`, which no
    stored sample has tied to a model yet."""
    return _serves(w).gives(choice_key(choice))


def _choice(key: str) -> list[int] | str:
    """A job's layers key as the choice it stands for."""
    names, ids = choice_parts(key)
    return key if names else ids


def _not_ready(w: WriterRow) -> str:
    """`the worker ...: state: reason`, without a state of "waiting": the job's reason is shown as why it
    waits ("Waiting: the worker on host reading /dumps: model server not ready: ..."), which would say it
    twice."""
    said = [w.state] if w.state != "waiting" or not w.reason else []
    return ": ".join([describe_writer(w), *said, *([w.reason] if w.reason else [])])


def describe_writer(w: WriterRow) -> str:
    """A writer as a person reads it in a message: "the worker on vm reading /data/dumps1 (SGLang dumps)". Its
    identity (host:dump root) stays what every machine-readable field (`identity`, metrics' labels) carries."""
    host, sep, root = w.identity.partition(":")
    where = f"the worker on {host} reading {root}" if sep and host and root else f"the worker {w.identity}"
    label = source_label((w.server or {}).get("source"))
    return f"{where} ({label})" if label else where


def _serves(w: WriterRow) -> Serves:
    return _serves_of(w.server)


def _serves_of(server: dict[str, Any] | None) -> Serves:
    said = server or {}
    depth = said.get("num_hidden_layers")
    return Serves(
        layers_key(said.get("layers")),
        said.get("model_key"),
        tuple(said.get("layer_sets") or ()),
        depth if isinstance(depth, int) else None,
        said.get("final_layer") or "post_norm",
        bool(said.get("final_norm")),
    )


def _fits(serves: Serves, job: JobRow) -> bool:
    return serves.gives(job.layers_key) and (job.model_key is None or serves.model in (None, job.model_key))


# A set and its counterpart on the other side of the final norm.
_OTHER_SIDE = {
    **{n: f"{n}_pre_norm" for n in LAYER_SETS if f"{n}_pre_norm" in LAYER_SETS},
    **{n: n.removesuffix("_pre_norm") for n in LAYER_SETS if n.endswith("_pre_norm")},
}


def ask_instead(serves: Serves, wanted: str | None) -> str | None:
    """What a job asking for `wanted` could ask for instead to run on a worker that serves `serves`: the
    same sets read on the side of the final norm the server gives, else the named sets it serves, else
    the layers it captures; None when it serves `wanted` already or says nothing of its layers."""
    if wanted is None or serves.layers is None or serves.gives(wanted):
        return None
    names, ids = choice_parts(wanted)
    if names and all(n in _OTHER_SIDE for n in names):
        other = [_OTHER_SIDE[n] for n in names]
        key = parse_choice([*other, *ids]) if len(other) > 1 or ids else other[0]
        if serves.gives(key if isinstance(key, str) else layers_key(key)):
            return _shown(key)
    if serves.sets:
        return " or ".join(serves.sets) if len(serves.sets) < 3 else f"one of {', '.join(serves.sets)}"
    return f"layers [{serves.layers.replace(',', ', ')}]"


def _shown(key: list[int] | str) -> str:
    if isinstance(key, list) or CHOICE_JOIN not in key:
        return str(key)
    names, ids = choice_parts(key)
    return "[" + ", ".join([*(f'"{n}"' for n in names), *map(str, ids)]) + "]"


def _offer(w: WriterRow, wanted: str | None = None) -> str:
    """What a writer's server gives; why that is not what the job asks for, what to change there, and which
    layer set to ask for instead."""
    server = w.server or {}
    source = f" from {server['layers_from']}" if server.get("layers_from") else ""
    text = f"layers {server.get('layers')} of {server.get('model_path')}{source}"
    if server.get("layers_hint"):
        text += f" ({server['layers_hint']})"
    serves = _serves(w)
    if wanted is None or serves.layers is None or serves.gives(wanted):
        return text
    text += f": {serves.refusal(wanted)}"
    # Served but for the final norm hsx could not read: both ways out are named.
    norm_only = serves.final_layer == "pre_norm" and replace(serves, converts=True).gives(wanted)
    problem = server.get("final_norm_problem") if norm_only else None
    if problem:
        text += f" ({problem})"
    ask = ask_instead(serves, wanted)
    if ask is not None:
        text += f"; {'or ' if problem else ''}ask for {ask}"
    return text
