"""What the model servers accept, for validating submitted samples: the server at --backend-url, asked of
the engine the service is set to use (hsx.backends.limits; cached, best effort), and each writer's server,
as the writer registered it in the database.

The limits a new job's samples keep to are the tightest of all that are known: the live writers that may
run the job (those whose server gives its `layers`, when it asks for some; a new job is not yet tied to
a model, so any of them may take its first sample), and the --backend-url server when it answers. So an
API without a writer of its own (`hsx serve --no-writer`) refuses what the workers' servers would refuse,
as one with a writer does.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from sqlalchemy.orm import Session, sessionmaker

from hsx import backends
from hsx.backends.dumps import DumpRoot
from hsx.backends.engine import Limits, Server
from hsx.backends.http import BackendRejected, BackendUnavailable
from hsx.config import Settings
from hsx.db import repository as repo

TTL_S = 30.0
FAILURE_TTL_S = 5.0
ASK_TIMEOUT_S = 2.0


class BackendInfo:
    def __init__(self, settings: Settings):
        self._server = Server(
            settings.backend_url,
            DumpRoot(settings.dump_root),
            settings.resolved_staging_dir(),
            timeout_s=ASK_TIMEOUT_S,
            capture_layers=settings.capture_layer_list(),
        )
        self._choice = settings.source
        self._lock = threading.Lock()
        self._limits = Limits()
        self._expires = 0.0

    def limits(self) -> Limits:
        """Vocabulary size, prompt length limit and what the server captures, as its engine tells them.

        When the server cannot be asked, the limits are unknown and only the model-independent
        checks apply; the server itself still refuses what it cannot take, as a failed attempt.
        """
        with self._lock:
            if time.monotonic() < self._expires:
                return self._limits
            try:
                self._limits = backends.limits(self._server, self._choice)
                self._expires = time.monotonic() + TTL_S
            except (BackendUnavailable, BackendRejected, ValueError):
                self._limits = Limits()
                self._expires = time.monotonic() + FAILURE_TTL_S
            return self._limits


def job_limits(backend: BackendInfo, sessions: sessionmaker[Session], layers: list[int] | str) -> Limits:
    """What a new job asking for `layers` checks its samples against (see the module's docstring)."""
    server = backend.limits()
    with sessions() as session:
        vocab, longest = repo.writer_limits(session, layers)
    return replace(server, vocab_size=_least(server.vocab_size, vocab), max_tokens=_least(server.max_tokens, longest))


def _least(*values: int | None) -> int | None:
    return min((v for v in values if v is not None), default=None)
