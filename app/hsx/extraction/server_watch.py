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
from hsx.backends.engine import CaptureProblem, Engine, Limits, Server
from hsx.backends.http import BackendRejected, BackendUnavailable
from hsx.config import Settings
from hsx.extraction.backoff import Backoff
from hsx.identity import Identity
from hsx.matching import Serves, model_key

log = logging.getLogger("hsx.writer")

SERVER_RECHECK_S = 60.0


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
        self.limits = Limits()  # what the server accepts, as last found ready
        self.backoff = Backoff()
        # The weakest proof of identity among the dumps taken from this server (hsx.identity), or
        # what the server says of its dumps before the first one is taken.
        self.identity: Identity | None = None
        self._observed = False  # whether `identity` comes from a dump taken, not from what the server says
        self._outage = False
        self._checked_at = 0.0
        self._lock = threading.Lock()
        self._identity_lock = threading.Lock()  # not _lock: a check, which holds that, notes what the server says

    @property
    def usable(self) -> bool:
        return self.engine is not None

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
            return ServerVerdict("waiting", f"model server not ready: {exc}")
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
        self._last = engine
        self.layers = capture.layers
        self.proved(capture.identity, said=True)
        self.model_info = capture.model
        if probe_due:
            try:
                problem = engine.probe()
            except BackendUnavailable as exc:
                self.lost()
                return ServerVerdict("waiting", f"model server not ready: {exc}")
            if problem is not None:
                self.engine = None
                return ServerVerdict("refusing", problem)
        self.engine = engine
        self.limits = self._limits(engine)
        self._outage = False
        self._checked_at = time.monotonic()
        self.backoff.reset()
        server = {
            "url": self.server.url,
            "source": engine.source,
            "name_by": capture.name_by,
            "boot_id": capture.boot_id,
            "model_path": capture.model.get("model_path"),
            "model_key": model_key(self.model_info),
            "layers": self.layers,
            "layers_from": capture.layers_from,
            "identity": self.identity,
            # The named layer sets it gives (jobs asking for one match on it), which side of the final norm its
            # layer L lies, and what to change when it gives less than EAGLE-3's layers.
            "layer_sets": list(Serves.of(self.layers, self.model_info).sets),
            "final_layer": capture.model.get("final_layer") or "post_norm",
            "layers_hint": capture.hint,
            # Whether conversations' answers can be regenerated here, with a seed that holds.
            "regenerates": engine.regenerates,
            "applies_seed": engine.regenerates and capture.applies_seed,
            # What the server accepts; registered with the writer, where an API checks samples against it.
            "vocab_size": self.limits.vocab_size,
            "max_prompt_tokens": self.limits.max_tokens,
        }
        return ServerVerdict("ready", server=server)

    def _limits(self, engine: Engine) -> Limits:
        """What the server accepts, as its engine reads it; unknown when the server does not say."""
        try:
            return type(engine).limits(self.server) or Limits()
        except (BackendUnavailable, BackendRejected, ValueError):
            return Limits()
