"""Watching the model server: whether it is ready, whether its settings allow whole dumps, which
layers it captures, and when it restarted.

A server that went away is trusted again only once /health says it is ready, and its settings are
read again then: a restarted server may capture other layers or name its dumps differently.
Settings that silently break dumps are detected here, never assumed away.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from hsx.backends import discover
from hsx.backends.engine import Capture, CaptureProblem, Engine, Limits, ProbeRefused, Server, ServerDown
from hsx.backends.final_norm import FinalNorm, NormUnavailable, load_final_norm
from hsx.backends.http import BackendRejected, BackendUnavailable
from hsx.config import Settings
from hsx.extraction.backoff import Backoff
from hsx.identity import Identity
from hsx.matching import Serves, model_key

log = logging.getLogger("hsx.writer")

SERVER_RECHECK_S = 60.0
# A probe that keeps failing the same way is sent less and less often: each may leave a dump where hsx cannot
# see it (a server writing to another folder than the dump root), and the same cause gives the same answer.
# The first retry after PROBE_RETRY_FIRST_S, then each wait doubles, up to PROBE_RETRY_MOST_S; a new cause,
# a restarted server or a probe that gets through starts over.
PROBE_RETRY_FIRST_S = 2.0
PROBE_RETRY_MOST_S = 120.0


@dataclass(frozen=True)
class ServerVerdict:
    """What a check of the server found, as the writer's status: ready, waiting or refusing."""

    state: str
    reason: str | None = None
    server: dict[str, Any] | None = None  # when ready: what /healthz shows of the server


class ServerWatch:
    def __init__(self, settings: Settings, server: Server):
        self.settings = settings
        self.server = server
        # The engine for the server as last checked: None until a check finds it ready, and again from
        # the moment it is seen to go away.
        self.engine: Engine | None = None
        self._last: Engine | None = None  # the engine the last check found, usable or not: restarts show against it
        self.model_info: dict[str, Any] = {}
        self.layers: list[int] | None = None  # the layers the server captures; None: not said
        # The model's final norm, where the server gives layer L before it and hsx can apply it (jobs that
        # read L after the norm are then served here too), or why hsx cannot.
        self.final_norm: FinalNorm | None = None
        self.final_norm_problem: str | None = None
        self.limits = Limits()  # what the server accepts, as last found ready
        self.backoff = Backoff()
        self._refused: ProbeRefused | None = None  # the last probe's failure, until a probe gets through
        self._probe_backoff = Backoff(PROBE_RETRY_FIRST_S, PROBE_RETRY_MOST_S)
        self._probe_at = 0.0  # when the next probe may go, while _refused
        # The weakest proof of identity among the dumps taken from this server (hsx.identity), or
        # what the server says of its dumps before the first one is taken.
        self.identity: Identity | None = None
        self._observed = False  # whether `identity` comes from a dump taken, not from what the server says
        self._outage = False
        # Why the server went down at hsx's last probe (ServerDown), said with every "not ready" until a probe
        # gets through: the server's absence alone would hide that its engine died at hsx's request.
        self._down: str | None = None
        self._checked_at = 0.0
        self._lock = threading.Lock()
        self._identity_lock = threading.Lock()  # not _lock: a check, which holds that, notes what the server says

    @property
    def usable(self) -> bool:
        return self.engine is not None

    def serves(self) -> Serves:
        """What the server as last checked gives, for claiming jobs (hsx.matching)."""
        return Serves.of(self.layers, self.model_info, converts=self.final_norm is not None)

    @property
    def applies_seed(self) -> bool:
        """Whether the server as last checked applies a request's sampling seed (Capture.applies_seed)."""
        engine = self.engine
        return engine is not None and engine.regenerates and engine.capture.applies_seed

    @property
    def regenerates(self) -> bool:
        """Whether the server as last checked can write a conversation's answers anew (Engine.regenerates)."""
        engine = self.engine
        return engine is not None and engine.regenerates

    def ensure(self) -> tuple[Engine | None, ServerVerdict | None]:
        """The engine for the server as last checked, checking it first when that is due (none usable
        yet, or the last check older than SERVER_RECHECK_S); with the verdict of that check, None when
        no check ran."""
        engine = self.engine
        if engine is not None and not self._check_due():
            return engine, None
        with self._lock:
            engine = self.engine
            if engine is not None and not self._check_due():
                return engine, None
            verdict = self._check()
            return self.engine, verdict

    def lost(self) -> None:
        """A request found the server gone: nothing is sent until /health says it is back."""
        self.engine, self._outage = None, True

    def gone_since(self, engine: Engine) -> str | None:
        """Why the server `engine` was found on is not the one running now (down, restarted, changed); None
        while it is. Asked when a request's dump never came: a server killed after its reply loses the dump
        with it, and the sample is not at fault."""
        try:
            # As after an outage: /health first, which a server that lost its process, or is not ready, fails.
            now = discover(self.server, self.settings.source, after_outage=True)
        except (BackendUnavailable, BackendRejected) as exc:
            return f"model server unavailable: {exc}"
        except CaptureProblem as exc:
            return f"model server changed: {exc}"
        if now.restarted(engine):
            return f"model server restarted (boot id {engine.capture.boot_id} -> {now.capture.boot_id})"
        return None

    def proved(self, identity: Identity | None, *, said: bool = False) -> bool:
        """Note what proved a dump its sample's (or, with `said`, what the server says its dumps will
        prove, which holds only until the first dump is taken); True when /healthz must show a new
        value: the first dump's proof, or one weaker than any before. The first `count` is warned about."""
        if identity is None:
            return False
        with self._identity_lock:
            if said and self._observed:
                return False
            if not said and self._observed and self.identity is not None and self.identity.rank <= identity.rank:
                return False
            changed = identity != self.identity
            self.identity, self._observed = identity, self._observed or not said
        if changed and identity == Identity.COUNT:
            log.warning(
                "dumps in %s carry neither input ids (input_ids.safetensors or meta input_ids_sha256) nor the "
                "request's rid (meta rid): hsx tells a sample's dump from another request's only by its token "
                "count, which holds only while nothing but hsx sends requests to %s (identity: count)",
                self.server.root.path,
                self.server.url,
            )
        return changed

    def _check_due(self) -> bool:
        return time.monotonic() - self._checked_at >= SERVER_RECHECK_S

    def _check(self) -> ServerVerdict:
        try:
            engine = discover(self.server, self.settings.source, after_outage=self._outage)
        except (BackendUnavailable, BackendRejected) as exc:
            self.lost()
            down = f" (it went away at hsx's last probe: {self._down})" if self._down else ""
            return ServerVerdict("waiting", f"model server not ready: {exc}{down}")
        except CaptureProblem as exc:
            self.engine = None
            return ServerVerdict("refusing", str(exc))
        return self._take(engine)

    def _take(self, engine: Engine) -> ServerVerdict:
        """Use the engine found: probed first when the server is new or restarted."""
        capture = engine.capture
        before = self._last
        restarted = before is not None and engine.restarted(before)
        if restarted:
            was = before.capture.boot_id if before is not None else None
            log.warning("model server restarted (boot id %s -> %s); settings re-read", was, capture.boot_id)
        probe_due = self.engine is None or restarted
        if capture.layers_unverified and (
            before is None or before.capture.layers_unverified != capture.layers_unverified
        ):
            log.warning("layers %s, not verified: %s", capture.layers, capture.layers_unverified)
        self._last = engine
        self.layers = capture.layers
        self.proved(capture.identity, said=True)
        self.model_info = capture.model
        said_before = self.final_norm_problem
        self.final_norm, self.final_norm_problem = _final_norm(capture)
        if self.final_norm_problem and self.final_norm_problem != said_before:  # once, not at every check
            log.warning("layer L comes before the final norm, and hsx cannot apply it: %s", self.final_norm_problem)
        if probe_due:
            if self._refused is not None and not restarted and time.monotonic() < self._probe_at:
                self.engine = None
                return ServerVerdict("refusing", self._refused.reason)
            try:
                problem = engine.probe()
            except ServerDown as exc:
                self.lost()
                self._down = str(exc)
                return ServerVerdict("waiting", self._down)
            except BackendUnavailable as exc:
                self.lost()
                return ServerVerdict("waiting", f"model server not ready: {exc}")
            if problem is not None:
                self.engine = None
                self._probe_failed(problem)
                return ServerVerdict("refusing", problem.reason)
            self._down = None
            self._refused = None
            self._probe_backoff.reset()
        self.engine = engine
        self.limits = self._limits(engine)
        self._outage = False
        self._checked_at = time.monotonic()
        self.backoff.reset()
        server = server_report(
            self.server.url, engine, self.identity, self.limits, self.final_norm, self.final_norm_problem
        )
        return ServerVerdict("ready", server=server)

    def _probe_failed(self, problem: ProbeRefused) -> None:
        if self._refused is None or self._refused.cause != problem.cause:
            self._probe_backoff.reset()
        wait = self._probe_backoff.next()
        self._refused = problem
        self._probe_at = time.monotonic() + wait
        # The writer warns of the refusal itself (its state and reason); this only says when it looks again.
        log.info("probe refused (%s); the next probe in %g s unless the server restarts", problem.cause, wait)

    def _limits(self, engine: Engine) -> Limits:
        """What the server accepts, as its engine reads it; unknown when the server does not say."""
        try:
            return type(engine).limits(self.server) or Limits()
        except (BackendUnavailable, BackendRejected, ValueError):
            return Limits()


def _final_norm(capture: Capture) -> tuple[FinalNorm | None, str | None]:
    """The model's final norm where the server captures layer L before it (None where it gives L after the
    norm, or not at all), or why hsx cannot apply it."""
    model = capture.model
    if model.get("final_layer") != "pre_norm" or model.get("num_hidden_layers") not in (capture.layers or []):
        return None, None
    try:
        return load_final_norm(model), None
    except NormUnavailable as exc:
        return None, str(exc)


def server_report(
    url: str,
    engine: Engine,
    identity: Identity | None,
    limits: Limits,
    final_norm: FinalNorm | None = None,
    final_norm_problem: str | None = None,
) -> dict[str, Any]:
    """What a writer reports of the server it found ready (WriterRow.server): /healthz and /v1/workers show it,
    jobs are matched against it (hsx.matching), an API checks samples against its limits. `final_norm`: the
    norm hsx applies where the server gives layer L before it (`final_norm_problem`: why it cannot)."""
    capture = engine.capture
    return {
        "url": url,
        "source": engine.source,
        "name_by": capture.name_by,
        "boot_id": capture.boot_id,
        "model_path": capture.model.get("model_path"),
        "model_key": model_key(capture.model),
        "layers": capture.layers,
        "layers_from": capture.layers_from,
        "layers_unverified": capture.layers_unverified,
        "identity": identity,
        # The named layer sets it gives (jobs asking for one match on it), conversion included, which side of
        # the final norm its layer L lies, and what to change when it gives less than EAGLE-3's layers.
        "layer_sets": list(Serves.of(capture.layers, capture.model, converts=final_norm is not None).sets),
        "num_hidden_layers": capture.model.get("num_hidden_layers"),
        "final_layer": capture.model.get("final_layer") or "post_norm",
        "final_norm": final_norm.describe() if final_norm is not None else None,
        "final_norm_problem": final_norm_problem,
        "layers_hint": capture.hint,
        # Whether conversations' answers can be regenerated here, with a seed that holds.
        "regenerates": engine.regenerates,
        "applies_seed": engine.regenerates and capture.applies_seed,
        # What the server accepts; registered with the writer, where an API checks samples against it.
        "vocab_size": limits.vocab_size,
        "max_prompt_tokens": limits.max_tokens,
    }
